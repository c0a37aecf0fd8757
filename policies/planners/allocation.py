"""Offline sensitivity-optimal bit allocation under a budget (static-mixed, initial assignments).

Every block starts at the highest supported bitwidth; the chain greedy of `scoring` then lowers
the steps with the least global damage (Eq. 4, no routing or prompt terms) per unit saved until
the budget holds. The unit is parameter-bits for a mean-bitwidth target (so the parameter-weighted
mean of the bits is at most the target) or AP bytes (planes plus LUTs) for a byte budget. With
damages that grow as bits fall this is the classic greedy for the Lagrangian relaxation of the
multiple-choice knapsack; it overshoots the budget by less than one step.
"""
from __future__ import annotations

import numpy as np

from policies.planners.base import PolicyError
from policies.planners.scoring import block_chain_greedy, build_step_table


def sensitivity_optimal_bits(table, sensitivity: np.ndarray, *, target_mean_bits: float | None = None,
                             budget_bytes: int | None = None) -> np.ndarray:
    """[n] bits per block meeting a parameter-weighted mean-bit target or a byte budget.

    `table` supplies M, shapes and the supported bits (a PageTable). Exactly one budget is given.
    """
    if (target_mean_bits is None) == (budget_bytes is None):
        raise PolicyError("give exactly one of target_mean_bits or budget_bytes")
    steps = build_step_table(table.M, sensitivity, table.bits)
    n, S = steps.bytes.shape
    top, low = max(table.bits), min(table.bits)
    if S == 0:
        return np.full(n, top, dtype=np.int64)
    params = (table.shapes[:, 0] * table.shapes[:, 1]).astype(np.float64)
    if target_mean_bits is not None:
        if not low <= target_mean_bits:
            raise PolicyError(f"target mean bitwidth {target_mean_bits} is below the lowest supported ({low})")
        weight = params[:, None] * (steps.from_bits - steps.to_bits)[None, :]
        need = float(params.sum()) * (top - float(target_mean_bits))
    else:
        weight = steps.bytes.astype(np.float64)
        need = float(table.M[:, top].sum()) - float(budget_bytes)
        floor_bytes = int(table.M[:, low].sum())
        if budget_bytes < floor_bytes:
            raise PolicyError(f"weight budget {budget_bytes} B is below {floor_bytes} B, the size at {low} bits; "
                              "raise the budget")
    bits = np.full(n, top, dtype=np.int64)
    if need <= 0:
        return bits
    ok = np.isfinite(steps.global_damage)
    ratio = np.where(ok, steps.global_damage, 0.0) / weight
    rows, cols = block_chain_greedy(ratio, weight, ok, np.zeros(n, dtype=np.int64), np.full(n, S - 1), need)
    np.minimum.at(bits, rows, steps.to_bits[cols])
    return bits
