"""What every planner shares: the error type, table/calibration checks, byte helpers, plan building.

`weight_bytes(policy, table)` is the one function engines call for the GPU bytes the routed-expert
weights occupy under a policy: the page table's own accounting, unless the policy keeps weights
the table does not describe (fp16 stores no AP planes; dp-llm keeps every plane and LUT resident)
and reports them through its `weight_bytes(table)` method.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from policies.apformat import lut_bytes_of
from policies.contract import NoopPolicy, Plan, Transition

if TYPE_CHECKING:  # pragma: no cover
    from policies.calibration import Calibration
    from policies.page_table import PageTable


class PolicyError(ValueError):
    """A policy cannot be built or run as asked (unknown name, bad parameter, wrong calibration)."""


def weight_bytes(policy, table: "PageTable") -> int:
    """GPU bytes of the routed-expert weights under `policy` (engines size the KV pool with it)."""
    own = getattr(policy, "weight_bytes", None)
    value = own(table) if callable(own) else None
    return int(table.resident_bytes() if value is None else value)


def fp16_block_bytes(table: "PageTable") -> np.ndarray:
    """Per block: bytes of the same matrix stored in fp16 (the full-precision reference)."""
    return table.shapes[:, 0] * table.shapes[:, 1] * 2


def plane_bytes_per_block(table: "PageTable") -> np.ndarray:
    """Per block: bytes of one bit-plane, from the table's byte table (M at 1 bit less its LUT)."""
    return table.M[:, 1] - lut_bytes_of(table.shapes[:, 0], 1)


def in_flight_split(table: "PageTable") -> tuple[int, int]:
    """(bytes that in-flight offloads will release, bytes in-flight reloads hold): `table.in_flight()` by direction."""
    _, extra, reload = table.in_flight()
    return int(extra[~reload].sum()), int(extra[reload].sum())


def check_calibration(table: "PageTable", calibration: "Calibration | None", policy: str) -> "Calibration":
    """The calibration must exist and describe this table (layers, experts, supported bits)."""
    if calibration is None:
        raise PolicyError(f"policy {policy!r} needs a calibration (pass --calibration DIR, or build one with "
                          "policies.synthetic.synthetic_calibration for a quick run)")
    if (calibration.layers, calibration.experts) != (table.layers, table.experts):
        raise PolicyError(f"calibration is for {calibration.layers} layers x {calibration.experts} experts, "
                          f"the page table has {table.layers} x {table.experts}; use the calibration of this model")
    missing = sorted(set(table.bits) - set(calibration.bits))
    if missing:
        raise PolicyError(f"calibration covers bitwidths {calibration.bits} but the table supports {table.bits} "
                          f"(missing {missing}); recalibrate with those bitwidths")
    return calibration


def make_plan(table: "PageTable", blocks, to_bits, damage: float, reason: str,
              in_place: bool = False) -> Plan | None:
    """A plan moving each block from its committed bits to `to_bits` (None if nothing changes)."""
    blocks = np.asarray(blocks, dtype=np.int64)
    to_bits = np.asarray(to_bits, dtype=np.int64)
    frm = table.q[blocks].astype(np.int64)
    moved = frm != to_bits
    blocks, frm, to_bits = blocks[moved], frm[moved], to_bits[moved]
    if blocks.size == 0:
        return None
    delta = np.zeros_like(blocks) if in_place else table.M[blocks, frm] - table.M[blocks, to_bits]
    trans = tuple(Transition(i, f, t, d, in_place)
                  for i, f, t, d in zip(blocks.tolist(), frm.tolist(), to_bits.tolist(), delta.tolist()))
    return Plan(trans, predicted_damage=float(damage), reason=reason)


def apply_plan_now(table: "PageTable", plan: Plan | None) -> int:
    """Apply a plan at once (begin and finish every transfer); returns the net GPU bytes freed.

    For tests, benchmarks and zero-cost engines: the real engines go through policies.loop.
    """
    if plan is None:
        return 0
    freed = 0
    for t in plan.transitions:
        if t.in_place:
            table.commit_in_place(t.block, t.to_bits)
        elif t.to_bits < t.from_bits:
            freed += table.begin_offload(t.block, t.to_bits)
            table.finish_offload(t.block)
        else:
            table.begin_reload(t.block, t.to_bits)
            table.finish_reload(t.block)
            freed -= int(table.M[t.block, t.to_bits] - table.M[t.block, t.from_bits])
    return freed


def never_plans(policy) -> bool:
    """Whether the policy never plans (`NoopPolicy`, the `StaticPolicy` baselines): an engine serving it needs no
    routing observation (routing mass, prompt features), since nothing reads it."""
    return isinstance(policy, (NoopPolicy, StaticPolicy))


class StaticPolicy:
    """Base of the policies that fix every block's bits at reset and never plan."""

    name = "static"

    def initial_bits(self, table: "PageTable", calibration: "Calibration | None") -> np.ndarray | int:
        raise NotImplementedError

    def reset(self, table: "PageTable", calibration: "Calibration | None") -> None:
        table.initialize(self.initial_bits(table, calibration))

    def plan_step(self, table: "PageTable", observation) -> Plan | None:
        return None
