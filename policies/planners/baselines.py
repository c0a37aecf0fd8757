"""Static baselines: fp16 (the full-precision reference), uniform-<b> (APL-style), static-mixed (MxMoE-like).

None of them ever plans. fp16 has no AP storage: the page table keeps every block at its top
bitwidth (so kernels and the quality model see the highest precision the table knows) and the
policy reports the fp16 bytes of the expert weights through `weight_bytes`, which engines read
via `policies.planners.weight_bytes(policy, table)`; `full_precision = True` tells them to run
full-precision weights (and the quality model to charge no quantization damage).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from policies.planners.allocation import sensitivity_optimal_bits
from policies.planners.base import PolicyError, StaticPolicy, check_calibration, fp16_block_bytes


@dataclass(frozen=True)
class Fp16Params:
    pass


@dataclass
class Fp16Policy(StaticPolicy):
    params: Fp16Params = field(default_factory=Fp16Params)
    name: str = "fp16"
    full_precision: bool = True

    def initial_bits(self, table, calibration) -> int:
        return max(table.bits)

    def weight_bytes(self, table) -> int:
        return int(fp16_block_bytes(table).sum())


@dataclass(frozen=True)
class UniformParams:
    bits: int = 4

    def __post_init__(self) -> None:
        if not 1 <= self.bits <= 8:
            raise ValueError(f"bits must be in 1..8, got {self.bits}")


@dataclass
class UniformPolicy(StaticPolicy):
    params: UniformParams = field(default_factory=UniformParams)
    name: str = "uniform"

    def initial_bits(self, table, calibration) -> int:
        if self.params.bits not in table.bits:
            raise PolicyError(f"{self.name}: {self.params.bits} bits not supported by the page table {table.bits}")
        return self.params.bits


@dataclass(frozen=True)
class StaticMixedParams:
    target_bits: float = 3.25  # parameter-weighted mean bitwidth (MxMoE's best reported setting)

    def __post_init__(self) -> None:
        if not 1 <= self.target_bits <= 8:
            raise ValueError(f"target_bits must be in 1..8, got {self.target_bits}")


@dataclass
class StaticMixedPolicy(StaticPolicy):
    """Offline sensitivity-optimal allocation at a mean bitwidth, fixed for the whole run."""

    params: StaticMixedParams = field(default_factory=StaticMixedParams)
    name: str = "static-mixed"

    def initial_bits(self, table, calibration) -> np.ndarray:
        cal = check_calibration(table, calibration, self.name)
        return sensitivity_optimal_bits(table, cal.sensitivity, target_mean_bits=self.params.target_bits)
