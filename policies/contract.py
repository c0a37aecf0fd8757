"""The policy/engine contract: what an engine observes, what a policy returns, the Policy protocol."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Protocol, runtime_checkable

import numpy as np

if TYPE_CHECKING:  # pragma: no cover
    from policies.calibration import Calibration
    from policies.page_table import PageTable

# prompt feature columns (phi): routing-weighted mean input norm, routing-weighted RMS input norm,
# max input norm, merged over running requests weighted by their KV-block usage
PHI_NAMES = ("mean_norm", "rms_norm", "max_norm")


class RoutingReadout:
    """The routing mass ([layers, experts], each row summing to 1 or all 0) and prompt features ([num_blocks, 3],
    PHI_NAMES) an Observation carries. Each is an array, None, or a function of no arguments that computes it when
    first read: an engine defers that work (policies.observe.RoutingStats), since most steps' planners read neither."""

    __slots__ = ("_values", "read", "seconds")

    def __init__(self, mass: np.ndarray | Callable[[], np.ndarray] | None = None,
                 features: np.ndarray | Callable[[], np.ndarray | None] | None = None) -> None:
        self._values = {"mass": mass, "features": features}
        self.read = False  # whether a planner read either (engines charge or record the work: routing_read_us)
        self.seconds = 0.0  # host time computing them (the runtime's replay records it)

    def _get(self, key: str) -> np.ndarray | None:
        self.read = True
        value = self._values[key]
        if callable(value):
            start = time.perf_counter()
            value = self._values[key] = value()
            self.seconds += time.perf_counter() - start
        return value

    def mass(self) -> np.ndarray | None:
        return self._get("mass")

    def features(self) -> np.ndarray | None:
        return self._get("features")


@dataclass(frozen=True)
class Observation:
    """What an engine knows at the end of one iteration; built identically by pwsim and pwruntime."""

    step: int
    time_s: float
    free_blocks: int
    total_blocks: int
    kv_block_bytes: int
    free_block_threshold: int
    pending_kv_blocks: int = 0  # blocks the running requests will need within the next iteration
    headroom_bytes: int = 0  # budget not used by weights, KV pool or in-flight transfers
    inflight_bytes: int = 0
    num_running: int = 0
    num_waiting: int = 0
    routing: RoutingReadout | None = None  # the routing mass and prompt features, computed when first read

    @property
    def routing_mass(self) -> np.ndarray | None:
        """[layers, experts], each row sums to 1 (or all 0); None when the engine keeps no routing statistics."""
        return None if self.routing is None else self.routing.mass()

    @property
    def prompt_features(self) -> np.ndarray | None:
        """[num_blocks, 3], PHI_NAMES; None when the engine keeps no prompt features."""
        return None if self.routing is None else self.routing.features()

    @property
    def routing_read(self) -> bool:
        """Whether a planner read the routing mass or the prompt features (engines charge or record that work)."""
        return self.routing is not None and self.routing.read

    def __post_init__(self) -> None:
        if self.free_blocks < 0 or self.total_blocks < 0 or self.free_blocks > self.total_blocks:
            raise ValueError(f"free blocks {self.free_blocks} not within 0..{self.total_blocks}")
        if self.kv_block_bytes < 0:
            raise ValueError("kv_block_bytes must be non-negative")


@dataclass(frozen=True)
class Transition:
    """Move block `block` from `from_bits` to `to_bits`; `delta_bytes` = M[from] - M[to] (>0 frees), which the plan
    loop sets from the page table whatever the planner wrote.

    `in_place` transitions move no page: the engine applies them with `PageTable.commit_in_place`
    (only the dp-llm baseline, which keeps every plane resident, emits them; `delta_bytes` is 0).
    """

    block: int
    from_bits: int
    to_bits: int
    delta_bytes: int
    in_place: bool = False

    @property
    def is_offload(self) -> bool:
        return self.to_bits < self.from_bits and not self.in_place


@dataclass(frozen=True)
class Plan:
    transitions: tuple[Transition, ...]
    predicted_damage: float = 0.0
    reason: str = ""

    @property
    def bytes_freed(self) -> int:
        return int(sum(t.delta_bytes for t in self.transitions))

    def __len__(self) -> int:
        return len(self.transitions)


@runtime_checkable
class Policy(Protocol):
    """A planner. Deterministic given its inputs, parameters and seed.

    Optional, looked up by name where an engine needs them: `weight_bytes(table) -> int | None` (the routed experts'
    GPU bytes when the table does not tell them, as the full-precision baselines'; `planners.base.weight_bytes`),
    `full_precision: bool` (the simulator costs fp16 experts and no quality damage), and `touch(used)` (the
    simulator passes the [layers, experts] mask of the experts a step used before planning; expert-lru, which
    otherwise reads them off the routing mass, as it does in the runtime)."""

    name: str

    def reset(self, table: "PageTable", calibration: "Calibration | None") -> None:
        """Prepare for serving; may set the table's initial bits with `table.initialize`."""

    def plan_step(self, table: "PageTable", observation: Observation) -> Plan | None:
        """Decide this iteration's transitions, or None for no change."""


@dataclass
class NoopPolicy:
    """Keeps every block where it is; the default of an engine that has no planner."""

    name: str = "noop"
    params: dict = field(default_factory=dict)

    def reset(self, table: "PageTable", calibration: "Calibration | None") -> None:
        return None

    def plan_step(self, table: "PageTable", observation: Observation) -> Plan | None:
        return None
