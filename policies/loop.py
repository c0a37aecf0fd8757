"""The observe -> plan -> move -> commit step both engines run at the end of every iteration.

`PlanLoop.step(observation)`, called at an iteration boundary (no kernel is reading weights):

1. `policy.plan_step(table, observation)`.
2. Each transition of the plan is checked against the table (its `from_bits` must be the block's
   committed bits and the block idle) and begun through the table's protocol: an offload commits
   the lower bits at once (after asking the engine for room for their LUT) and its surplus planes
   wait for the mover; a reload first asks the
   engine for room (`reserve(bytes)`, e.g. by shrinking the KV pool over free blocks) and then
   marks its planes in flight. The mover gets `start(transition, bytes)`. An `in_place` transition
   (planes already resident) is committed at once without the mover. A transition the table
   or the engine refuses is recorded in `rejected` and changes nothing. What raises is a planner that breaks the
   contract (a PolicyError: it returned something other than a Plan, changed the table itself, or asked an engine
   that fetches no absent expert for 0 bits), and its own exceptions, with a note naming it.
3. Transfers the mover reports as landed are committed (`finish_offload` frees planes, and the
   engine's `release(bytes)` can give them to the KV pool; `finish_reload` raises `q`).

While a plan's transitions are begun, `room_left()` says how many bytes those not begun yet will ask `reserve` for,
so an engine whose `reserve` must shrink the KV pool shrinks it once for the whole plan (both engines do: one
compaction and one resize of the cache a plan instead of one a transition).

An offload's lower-bitwidth LUT is on the GPU beside the planes it replaces until the offload lands. With
`lut_slack_bytes` (both engines pass their budget's allocator slack, policies.memory_budget, which is kept out of the
KV pool for this) that room is borrowed from the slack, as far as the LUTs in flight fit in it, instead of asked of
`reserve`; the offload repays it when it lands, out of the bytes it frees, and `release` gets the rest. An offload
plan then neither shrinks the KV pool nor is refused for want of free blocks (it used to be shrunk for a plan's LUTs
and grown again when they landed: two resizes of the cache a plan). `lut_borrowed` is what offloads in flight hold.

The simulator and the runtime differ only in their mover (a PCIe link model vs. copy streams) and
in the `reserve`/`release` callbacks; the loop is the same object, so the same observations give
the same plans.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, Protocol

import numpy as np

from policies.contract import Observation, Plan, Policy, Transition
from policies.apformat import MAX_BITS, lut_bytes, plane_bytes
from policies.page_table import PageTable, PageTableError
from policies.planners.base import PolicyError


class PageMover(Protocol):
    """Moves the planes of begun transitions; reports the blocks whose transfer finished."""

    def start(self, transition: Transition, nbytes: int) -> None: ...

    def landed(self) -> list[int]:
        """Blocks whose transfer finished since the last call, in the order they finished."""
        ...


@dataclass
class ImmediateMover:
    """Every transfer lands at once (full-precision weights, the CPU runtime's AP experts, or a zero-cost model)."""

    _pending: list[int] = field(default_factory=list)
    bytes_moved: int = 0

    def start(self, transition: Transition, nbytes: int) -> None:
        self._pending.append(transition.block)
        self.bytes_moved += int(nbytes) if not transition.is_offload else 0

    def landed(self) -> list[int]:
        out, self._pending = self._pending, []
        return out


@dataclass(frozen=True)
class LoopResult:
    plan: Plan | None
    started: tuple[Transition, ...] = ()
    rejected: tuple[tuple[Transition, str], ...] = ()
    committed: tuple[int, ...] = ()  # blocks whose transfer finished at this boundary
    released_bytes: int = 0  # GPU bytes freed by the offloads committed now
    reserved_bytes: int = 0  # GPU bytes the reloads begun now occupy


def room_for(table: PageTable, t: Transition) -> int:
    """Bytes beginning transition `t` asks the engine's `reserve` for: a reload its planes from..to-1 and LUT_to (what
    `begin_reload` copies), an offload the LUT of its lower bits (none for 0 bits)."""
    out, inp = (int(x) for x in table.shapes[t.block])
    if t.to_bits > t.from_bits:
        return (t.to_bits - t.from_bits) * plane_bytes(out, inp) + lut_bytes(out, t.to_bits)
    return lut_bytes(out, t.to_bits) if t.to_bits > 0 else 0


def borrows_from_slack(lut_bytes: int, slack: int) -> bool:
    """Whether an offload's LUT of `lut_bytes` takes its room from the LUT slack, `slack` bytes of it left, rather than
    from the engine's `reserve`."""
    return 0 < lut_bytes <= slack


def policy_name(policy) -> str:
    return str(getattr(policy, "name", type(policy).__name__))


def absent_error(policy, block: str) -> str:
    """Why an engine that fetches no absent expert cannot serve a policy that leaves `block` at 0 bits."""
    return (f"policy {policy_name(policy)} leaves {block} at 0 bits (an absent expert): the runtime does not fetch "
            "absent experts when the router picks them, as the simulator models it, so it cannot serve this policy; "
            "keep every block at a bitwidth the table supports")


def _served(table: PageTable, bits: int) -> bool:
    """Whether a transition may end at `bits`: a bitwidth the table supports, or 0 (absent)."""
    return bits == 0 or 0 < bits <= MAX_BITS and bool(table.supported[bits])


def checked_plan(plan, policy, table: PageTable) -> Plan | None:
    """What `plan_step` returned, as the loop begins it: None, or a Plan of Transitions (a PolicyError naming what is
    wrong otherwise), their numbers plain ints (numpy's would leak into the engines' state and reports) and each
    `delta_bytes` the table's M[from] - M[to], which the plan log and its byte totals report (a planner's own number
    could be anything)."""
    if plan is None:
        return None
    if not isinstance(plan, Plan):
        raise PolicyError(f"policy {policy_name(policy)}: plan_step returned {type(plan).__name__}; return a "
                          "policies.Plan (policies.planners.base.make_plan builds one) or None")
    moves = plan.transitions
    if not isinstance(moves, (tuple, list)) or any(type(t) is not Transition for t in moves):
        kinds = sorted({type(t).__name__ for t in moves}) if isinstance(moves, (tuple, list)) else \
            [type(moves).__name__]
        raise PolicyError(f"policy {policy_name(policy)}: a Plan's transitions must be a tuple of "
                          f"policies.Transition, got {', '.join(kinds)}")
    wants = _delta_bytes(table, moves)
    if isinstance(moves, tuple) and all(type(v) is int for t in moves for v in (t.block, t.from_bits, t.to_bits)) \
            and all(want == t.delta_bytes if want is not None else type(t.delta_bytes) is int
                    for t, want in zip(moves, wants)):
        return plan  # as the built-in planners return it: nothing to mend
    return replace(plan, transitions=tuple(
        Transition(int(t.block), int(t.from_bits), int(t.to_bits), int(t.delta_bytes) if want is None else want,
                   bool(t.in_place)) for t, want in zip(moves, wants)))


def _delta_bytes(table: PageTable, moves) -> list[int | None]:
    """The GPU bytes each transition frees by the table's M (0 in place), what the plan log reports; None where the
    loop refuses it (a block or bits out of range), which keeps the planner's number."""
    n = len(moves)
    blocks = np.fromiter((t.block for t in moves), np.int64, n)
    frm = np.fromiter((t.from_bits for t in moves), np.int64, n)
    to = np.fromiter((t.to_bits for t in moves), np.int64, n)
    ok = (blocks >= 0) & (blocks < table.num_blocks) & (frm >= 0) & (frm <= MAX_BITS) & (to >= 0) & (to <= MAX_BITS)
    b, f, t = np.where(ok, blocks, 0), np.where(ok, frm, 0), np.where(ok, to, 0)
    delta = np.where([m.in_place for m in moves], 0, table.M[b, f] - table.M[b, t]).tolist() if n else []
    return [d if good else None for d, good in zip(delta, ok.tolist())]


class PlanLoop:
    """One policy over one page table, with a mover and the engine's memory callbacks."""

    def __init__(self, policy: Policy, table: PageTable, mover: PageMover | None = None,
                 reserve: Callable[[int], bool] | None = None,
                 release: Callable[[int], None] | None = None, lut_slack_bytes: int = 0,
                 serves_absent: bool = True) -> None:
        if lut_slack_bytes < 0:
            raise ValueError(f"lut_slack_bytes must be >= 0, got {lut_slack_bytes}")
        self.policy, self.table = policy, table
        self.serves_absent = serves_absent  # whether the engine fetches a block at 0 bits when it is routed to
        self.mover = mover if mover is not None else ImmediateMover()
        self._reserve, self._release = reserve, release
        self.lut_slack_bytes = int(lut_slack_bytes)
        self._release_on_commit: dict[int, int] = {}  # block -> GPU bytes freed when its transfer commits
        self._borrowed: dict[int, int] = {}  # block -> LUT bytes its offload in flight borrowed from the slack
        self.lut_borrowed = 0  # their sum
        self.num_plans = 0
        self._beginning: Plan | None = None  # the plan whose transitions step() is beginning

    def step(self, observation: Observation) -> LoopResult:
        q, target = self.table.q.copy(), self.table.target.copy()
        try:
            plan = self.policy.plan_step(self.table, observation)
        except Exception as e:  # the planner's own code failed: say whose and when, above its traceback
            if not isinstance(e, PolicyError) and hasattr(e, "add_note"):  # Python 3.11 on
                e.add_note(f"(raised by policy {policy_name(self.policy)}'s plan_step at step {observation.step})")
            raise
        if not (np.array_equal(q, self.table.q) and np.array_equal(target, self.table.target)):
            raise PolicyError(f"policy {policy_name(self.policy)}: plan_step changed the page table itself; return the "
                              "moves as a policies.Plan instead (the loop begins them, and the mover moves the pages)")
        plan = checked_plan(plan, self.policy, self.table)
        started, rejected = [], []
        reserved = 0
        if plan is not None:
            self.num_plans += 1
            self._beginning = plan
            try:
                for t in plan.transitions:
                    why, nbytes = self._begin(t)
                    if why is None:
                        started.append(t)
                        reserved += 0 if t.is_offload else nbytes
                    else:
                        rejected.append((t, why))
            finally:
                self._beginning = None
        committed, released = [], 0
        for i in self.mover.landed():
            if self.table.target[i] < 0:
                continue  # nothing in flight (a mover reporting twice); ignore
            if self.table.target[i] > self.table.q[i]:
                self.table.finish_reload(i)
            else:
                self.table.finish_offload(i)
            released += self._release_on_commit.pop(i, 0) - self._repay(i)
            committed.append(i)
        if released and self._release is not None:
            self._release(released)
        return LoopResult(plan, tuple(started), tuple(rejected), tuple(committed), released, reserved)

    def room_left(self) -> int:
        """Bytes the transitions of the plan being begun that are not begun yet will ask `reserve` for (`room_for`; the
        one being reserved for included); 0 outside a plan."""
        if self._beginning is None:
            return 0
        table, total, slack = self.table, 0, self.lut_slack_bytes - self.lut_borrowed
        for t in self._beginning.transitions:
            if t.in_place or self._refusal(t) is not None:  # moves nothing, or `_begin` refuses it
                continue
            room = room_for(table, t)
            if t.is_offload and borrows_from_slack(room, slack):  # as `_begin` will
                slack -= room
            else:
                total += room
        return total

    def kv_blocks_to_free(self, nbytes: int, spare_bytes: int, block_bytes: int, free_blocks: int) -> int | None:
        """How many KV blocks an engine's `reserve` of `nbytes` takes from its pool, holding `spare_bytes` and
        `free_blocks` of `block_bytes` each: 0 when the spare bytes hold it, None when the free blocks cannot, else
        enough for every transition of the plan still to begin (`room_left`) as far as the free blocks go, so the
        pool shrinks once a plan (its blocks the plan does not take come back after it)."""
        if spare_bytes >= nbytes:
            return 0
        need = -(-(nbytes - spare_bytes) // block_bytes)
        if need > free_blocks:
            return None
        return min(max(need, -(-(self.room_left() - spare_bytes) // block_bytes)), free_blocks)

    def _repay(self, i: int) -> int:
        """The slack block i's landed offload borrowed for its LUT, returned to the slack (0 if none)."""
        borrowed = self._borrowed.pop(i, 0)
        self.lut_borrowed -= borrowed
        return borrowed

    def _refusal(self, t: Transition) -> str | None:
        """Why the loop refuses `t` before asking for any room (None: it may begin, room permitting)."""
        table, i = self.table, t.block
        if not 0 <= i < table.num_blocks:
            return f"block {i} out of range"
        if table.target[i] >= 0:  # busy
            return "transfer already in flight"
        if int(table.q[i]) != t.from_bits:
            return f"stale plan: block is at {int(table.q[i])} bits, not {t.from_bits}"
        if t.to_bits == t.from_bits or t.to_bits < 0:
            return f"no legal change {t.from_bits} -> {t.to_bits}"
        if not _served(table, t.to_bits):
            return f"{t.to_bits} bits not supported; supported: {table.bits}"
        if t.to_bits > t.from_bits and not t.in_place and table.held[i]:
            return "block keeps planes in place (commit_in_place); it cannot reload"
        return None

    def _begin(self, t: Transition) -> tuple[str | None, int]:
        """Begin one transition; returns (why it was refused or None, bytes moved)."""
        table, i = self.table, t.block
        why = self._refusal(t)
        if why is not None:
            return why, 0
        try:
            if t.in_place:  # planes already resident: commit now, nothing moves
                table.commit_in_place(i, t.to_bits)
                return None, 0
            if t.is_offload:
                if t.to_bits == 0 and not self.serves_absent:
                    raise PolicyError(absent_error(self.policy, table.block_id(i)))
                # the lower bits' LUT must be on the GPU before they are committed, while the
                # surplus planes and the old LUT stay until the commit: ask for the LUT's room first
                new_lut = room_for(table, t)
                borrow = new_lut if borrows_from_slack(new_lut, self.lut_slack_bytes - self.lut_borrowed) else 0
                if new_lut and not borrow and self._reserve is not None and not self._reserve(new_lut):
                    return "no room for the lower bitwidth's LUT", 0
                try:
                    nbytes = table.begin_offload(i, t.to_bits)
                except PageTableError:
                    if new_lut and not borrow and self._reserve is not None and self._release is not None:
                        self._release(new_lut)
                    raise
                if borrow:
                    self._borrowed[i] = borrow
                    self.lut_borrowed += borrow
                self._release_on_commit[i] = nbytes + new_lut  # surplus planes and the old LUT
            else:
                # planes q..to-1 plus LUT_to must fit before the copy starts; LUT_q goes at commit
                need = room_for(table, t)
                if self._reserve is not None and not self._reserve(need):
                    return "no room for the reload", 0
                try:
                    nbytes = table.begin_reload(i, t.to_bits)
                except PageTableError:
                    if self._reserve is not None and self._release is not None:
                        self._release(need)  # give the room back
                    raise
                self._release_on_commit[i] = lut_bytes(int(table.shapes[i, 0]), t.from_bits) if t.from_bits > 0 else 0
        except PageTableError as e:
            return str(e), 0
        self.mover.start(t, nbytes)
        return None, nbytes
