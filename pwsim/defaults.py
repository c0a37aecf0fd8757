"""The bundled default setup of `pwsim run` / `pwsim compare` with no arguments: the one place to swap.

The default is the project's own demo model end to end: its model card (`PagedWeight-demo`), the
calibration `pwruntime calibrate` measured on it (traces/bundled/demo-calibration: sensitivities,
residual heads, buckets and per-domain damages from held-out corpus text), a trace recorded by
`pwruntime record-trace` from the real engine on the three corpus domains (96 requests, their real
routing), the (damage, perplexity) points `pwruntime quality-table` measured on it
(traces/bundled/demo-quality-fit.json), and the H200 roofline profile. The demo model's expert
weights are 12 MiB in fp16 (6.5 MiB of other weights) and its KV cache 2 KiB per token, so the
budgets are in MiB; at 24 MiB the KV cache competes hard with the weights.

`--model Qwen1.5-MoE-A2.7B --calibration synthetic --trace synthetic --budgets 20GiB,24GiB,30GiB`
gives the large-model setup with a synthetic calibration and workload (`DEFAULT_WORKLOAD`).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from traces.generators import LengthDist, RoutingSpec, WorkloadSpec

SYNTHETIC = "synthetic"  # value of `calibration` / `trace` meaning "generate it from the seed"
BUNDLED = Path(__file__).resolve().parent.parent / "traces" / "bundled"


@dataclass(frozen=True)
class Defaults:
    model: str = "PagedWeight-demo"
    calibration: str = str(BUNDLED / "demo-calibration")  # or a calibration directory, or SYNTHETIC
    trace: str = str(BUNDLED / "demo-trace")  # or a trace directory (requests.parquet [+ routing.parquet])
    quality_fit: str | None = str(BUNDLED / "demo-quality-fit.json")  # runtime (damage, perplexity) points
    hardware: str = "h200-roofline"
    policies: tuple[str, ...] = ("fp16", "uniform-4", "static-mixed", "pagedweight")
    budgets: tuple[str, ...] = ("24MiB", "32MiB", "48MiB")
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
