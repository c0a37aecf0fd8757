"""PlanLog: every transition a plan loop began, refused or landed, a row each, as both engines record it.

Each engine adds its `PlanLoop.step` results at the boundaries it times (`add(step, time_s, result, table)`); a
result directory holds the rows as `plans.parquet` (`columns()`), which `pwsim fidelity` compares transition by
transition. Columns: `step`, `time_s`, `block`, `layer`, `expert`, `kind` (0 gate_up, 1 down: `kind_name`), `from_bits`,
`to_bits`, `delta_bytes` (GPU bytes the transition frees, negative for a reload), `status` (`started`, `rejected` or
`landed`: a transfer the mover reported finished, with the bits its start row had) and `reason` (the plan's reason, or
why the loop refused it).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from policies.contract import Transition
from policies.loop import LoopResult
from policies.page_table import KINDS, PageTable

COLUMNS = ("step", "time_s", "block", "layer", "expert", "kind", "from_bits", "to_bits", "delta_bytes", "status",
           "reason")
STATUSES = ("started", "rejected", "landed")


def kind_name(kind: int) -> str:
    """The `kind` column's name for a block kind (`-` for a block the table did not know)."""
    return KINDS[kind] if 0 <= kind < len(KINDS) else "-"


@dataclass
class PlanLog:
    """The rows so far (see the module docstring)."""
    rows: list[tuple] = field(default_factory=list)
    _moving: dict[int, Transition] = field(default_factory=dict)  # block -> its transition in flight

    def add(self, step: int, time_s: float, result: LoopResult, table: PageTable) -> None:
        reason = result.plan.reason if result.plan is not None else ""
        for t in result.started:
            self._row(step, time_s, t, "started", reason, table)
            if not t.in_place:  # an in-place commit lands as it starts
                self._moving[t.block] = t
        for t, why in result.rejected:
            self._row(step, time_s, t, "rejected", why, table)
        for block in result.committed:
            t = self._moving.pop(block, None)
            if t is not None:  # begun before the log started (a warm-up's transfer) otherwise
                self._row(step, time_s, t, "landed", "", table)

    def _row(self, step: int, time_s: float, t: Transition, status: str, reason: str, table: PageTable) -> None:
        i = t.block
        where = ((int(table.layer[i]), int(table.expert[i]), int(table.kind[i])) if 0 <= i < table.num_blocks
                 else (-1, -1, -1))
        self.rows.append((step, time_s, i, *where, t.from_bits, t.to_bits, t.delta_bytes, status, reason))

    def columns(self) -> dict[str, np.ndarray]:
        """The rows as typed columns (`COLUMNS`), for a Parquet table."""
        types = (np.int64, np.float64, np.int64, np.int32, np.int32, np.int8, np.int8, np.int8, np.int64, object,
                 object)
        cols = list(zip(*self.rows)) if self.rows else [()] * len(COLUMNS)
        return {name: np.array(col, dtype=dt) for name, col, dt in zip(COLUMNS, cols, types)}


def reason_kind(reason: object) -> str:
    """A plan's or a refusal's reason without the numbers after its colon (`stale plan: block is at 3 bits, not 4`
    -> `stale plan`), to count reasons by kind."""
    return str(reason).split(":")[0]


def refusal_line(columns: dict[str, np.ndarray], where: str) -> str | None:
    """A line on the transitions the loop refused in plan log `columns` (None when none was): how many of those asked
    for, the commonest reason, and where the log lies (`where`: a result directory) for `pwsim plan-log`."""
    status = np.asarray(columns.get("status", []), dtype=object)
    refused = status == "rejected"
    if not refused.any():
        return None
    why = [reason_kind(r) for r in np.asarray(columns["reason"], dtype=object)[refused]]
    reasons, counts = np.unique(why, return_counts=True)
    top = int(np.argmax(counts))
    asked = int(refused.sum() + (status == "started").sum())
    return (f"the plan loop refused {int(refused.sum()):,} of the {asked:,} transitions the planner asked for (most: "
            f"'{reasons[top]}', {int(counts[top]):,}); `pwsim plan-log {where}` lists them")
