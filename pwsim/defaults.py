"""The bundled default setup of `pwsim run` / `pwsim compare` with no arguments: the one place to swap.

Until the demo model, its measured calibration and traces recorded from the runtime exist, the
default is: the Qwen1.5-MoE-A2.7B card, the synthetic calibration of `policies.synthetic`
(seeded), a synthetic trace generated from a fixed seed (`DEFAULT_WORKLOAD`, `DEFAULT_ROUTING`),
and the H200 roofline profile. Budgets are chosen so that the KV cache competes with the weights:
the 8-bit AP weights take 18.4 GiB and fp16 26.7 GiB, so 20 GiB leaves PagedWeight about 1.5 GiB
of KV cache to start with and fp16 runs only at the largest budget.

To switch to the demo model later, change `DEFAULTS` (model card path, calibration directory,
trace directory with recorded routing) and nothing else.
"""
from __future__ import annotations

from dataclasses import dataclass

from traces.generators import LengthDist, RoutingSpec, WorkloadSpec

SYNTHETIC = "synthetic"  # value of `calibration` / `trace` meaning "generate it from the seed"


@dataclass(frozen=True)
class Defaults:
    model: str = "Qwen1.5-MoE-A2.7B"
    calibration: str = SYNTHETIC  # or a calibration directory
    trace: str = SYNTHETIC  # or a trace directory (requests.parquet [+ routing.parquet])
    hardware: str = "h200-roofline"
    policies: tuple[str, ...] = ("fp16", "uniform-4", "static-mixed", "pagedweight")
    budgets: tuple[str, ...] = ("20GiB", "24GiB", "30GiB")
    seed: int = 0


DEFAULTS = Defaults()

# the synthetic workload of the default (and of `--trace synthetic`): bursty arrivals that outrun
# the replica, so requests queue and the KV cache fills; domains named as the synthetic calibration's
DEFAULT_WORKLOAD = WorkloadSpec(
    requests=100, rate=30.0, burstiness=1.5,
    prompt=LengthDist("lognormal", 384, 0.6, 32, 4096),
    output=LengthDist("lognormal", 256, 0.6, 16, 2048),
    domains=("c4", "wikitext2", "code"),
)
DEFAULT_ROUTING = RoutingSpec(skew=1.0, domain_shift=0.5, drift=0.05, features=True)
