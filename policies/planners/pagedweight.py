"""The PagedWeight planner: paper Algorithm 1 with Eqs. 4-8, reload with hysteresis, and its ablations.

One `plan_step`:

1. Byte target (Eq. 7, extended). `F = free_blocks - pending_kv_blocks` (blocks the running
   requests need within the next iteration are as good as gone); the raw target is
   `max(0, T_blk + 1 - F) * B_KV`. Pressure is triggered when it is positive. From it we subtract
   the bytes in-flight offloads are about to release (they become KV blocks without a new plan, so
   a slow transfer is never answered by a second offload) and, with `count_headroom`, the
   allocator headroom the engine can turn into KV blocks without moving weights. With no pending
   growth, nothing in flight and no headroom this is exactly Eq. 7. `min_plan_blocks` (default 0) raises a
   triggered deficit to at least that many blocks: a load that grows a block at a time then plans once every few
   steps instead of on every one (a planning step costs a runtime milliseconds of host work).
2. Scoring (Eqs. 4, 6, 8). Per block and step b->b' (adjacent supported bitwidths):
   `d = max(eps, mu[bucket] * g * eta)`; buckets from the observed routing mass (experts sorted
   per layer, hottest bucket first); `eta = exp(alpha * c_u * clip(w_u . phi_i + a_u))` from the
   merged prompt features (1 when the engine supplies none).
3. For every bitwidth-floor stage (Algorithm 1, lines 5-9): the legal steps are those of idle
   blocks from their committed bits down to `max(floor[stage][bucket], start - depth_cap[stage])`
   (`start` = the initial assignment); `scoring.chain_greedy_stages` takes the lowest d / Delta
   steps until the target is met (exactly; see `scoring` for the definition the tests check) and
   each stage's plan replaces its entry in the plan queue. Every stage is rescored each step, so
   the queue always holds the plans of the latest observation, never a stale one; a queued plan is
   turned into Transitions only when it is selected.
   When every idle block already sits at the lowest bits any stage allows in any bucket, no stage
   has a legal step whatever the routing is, and the step says so without reading the routing mass
   or prompt features (an engine's fold and merge: most steps of a long spell of pressure).
4. If pressure triggered, the best queued plan: the first (most protective) stage whose plan meets
   the target - so floors and depth caps are relaxed only when the tighter ones cannot free enough;
   if none does, the plan freeing the most bytes (the largest safe reduction).
5. Otherwise, reload: when no request waits, `F > max(reload_threshold, T_blk + 1 + margin)` (and not within
   `reload_cooldown_steps` of an offload), raise idle blocks below their ceiling by one supported
   bitwidth each, most damage recovered per byte first (ties: lower block), skipping any that do
   not fit the budget `(F - T_blk - 1 - margin) * B_KV (+ headroom) - bytes of reloads in flight`.
   A reload therefore never leaves fewer than `T_blk + 1 + margin` free blocks, and the next offload
   needs the free blocks to fall to T_blk again: the two cannot alternate on a steady load.

Batched serving: the routing mass and prompt features are the engine's batch-level signals, merged
over running requests weighted by their KV-block usage (`policies.observe`); the planner uses them
as given. The policy never writes the table; engines apply its plans. Ablations: `no_routing` (every expert
in the coldest bucket), `no_residual` (eta = 1), `no_movement` (the initial assignment, never a
plan), `no_sensitivity` (g from a stand-in that knows bytes and bit levels only,
`s[i, b] = params_i * 4 ** (8 - b)`, and an initial assignment made from it at the same bytes).
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from functools import cached_property

import numpy as np

from policies.apformat import MAX_BITS, lut_bytes_of
from policies.contract import Observation, Plan, Transition
from policies.planners.allocation import sensitivity_optimal_bits
from policies.planners.base import (PolicyError, check_calibration, in_flight_split, make_plan,
                                    plane_bytes_per_block)
from policies.planners.scoring import (MatrixChains, Scorer, StepHeads, StepTable, build_step_table,
                                       chain_greedy_stages, expert_buckets, first_bad, fit_in_order)


@dataclass(frozen=True)
class PagedWeightParams:
    no_routing: bool = False
    no_residual: bool = False
    no_movement: bool = False
    no_sensitivity: bool = False
    alpha: float | None = None  # residual strength; None: the calibration's
    reload: bool = True
    reload_threshold: int | None = None  # free blocks above which reload may start; None: the calibration's
    reload_margin_blocks: int = 4  # a reload leaves at least T_blk + 1 + margin free blocks
    reload_cooldown_steps: int = 32  # no reload within this many steps after an offload plan (anti-thrash)
    reload_to: str = "initial"  # reload ceiling: "initial" assignment or "max" supported bits
    count_headroom: bool = True  # allocator headroom counts toward the byte target and reload budget
    min_plan_blocks: int = 0  # an offload frees at least this many KV blocks' bytes (0: Eq. 7's deficit alone)

    def __post_init__(self) -> None:
        if self.reload_to not in ("initial", "max"):
            raise ValueError(f"reload_to must be 'initial' or 'max', got {self.reload_to!r}")
        for name in ("reload_margin_blocks", "reload_cooldown_steps", "min_plan_blocks"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.reload_threshold is not None and self.reload_threshold < 0:
            raise ValueError(f"reload_threshold must be >= 0, got {self.reload_threshold}")
        if self.alpha is not None and not np.isfinite(self.alpha):
            raise ValueError(f"alpha must be finite, got {self.alpha}")


@dataclass(frozen=True)
class QueuedPlan:
    """One floor stage's candidate plan, kept as arrays; `plan` builds the Plan when it is chosen."""

    stage: int
    step: int
    target_bytes: int
    bytes_freed: int
    damage: float
    blocks: np.ndarray
    from_bits: np.ndarray
    to_bits: np.ndarray
    delta_bytes: np.ndarray

    @property
    def meets_target(self) -> bool:
        return self.bytes_freed >= self.target_bytes

    @cached_property
    def plan(self) -> Plan:
        how = "meets target" if self.meets_target else "largest safe reduction"
        trans = tuple(Transition(i, f, t, d) for i, f, t, d in zip(
            self.blocks.tolist(), self.from_bits.tolist(), self.to_bits.tolist(), self.delta_bytes.tolist()))
        return Plan(trans, self.damage, f"offload stage {self.stage}: {self.bytes_freed} of {self.target_bytes} "
                                        f"bytes ({how})")


@dataclass(frozen=True)
class Decision:
    """What the last `plan_step` saw and chose (for logs and tests)."""

    step: int
    target_bytes: int
    pressure: bool
    action: str  # "offload", "reload" or "none"
    stage: int | None = None
    reason: str = ""


@dataclass
class _Prepared:
    scorer: Scorer
    steps: StepTable
    start: np.ndarray  # [n] initial bits, block order
    ceiling: np.ndarray  # [n] reload ceiling, block order
    mu: np.ndarray  # [buckets]
    log_mu: np.ndarray  # [buckets]
    floor_last: np.ndarray  # [stages, buckets]: last step column a bucket's floor allows
    cap_last: np.ndarray  # [stages, n] (internal order): last step column the depth cap allows
    bucket_bounds: tuple[float, ...]
    reload_threshold: int
    plane: np.ndarray  # [n] bytes of one plane
    next_up: np.ndarray  # [MAX_BITS + 1]: next supported bitwidth above b (0: none)
    last_ok: np.ndarray | None  # [S + 1, n]: last column before a missing g, per first column (None: none missing)
    any_last: np.ndarray  # [n] (internal order): the last column any stage allows in any bucket


@dataclass
class PagedWeightPolicy:
    params: PagedWeightParams = field(default_factory=PagedWeightParams)
    name: str = "pagedweight"
    queue: tuple[QueuedPlan, ...] = ()
    last: Decision | None = None
    _p: _Prepared | None = None
    _last_offload_step: int | None = None

    # ------------------------------------------------------------------ reset
    def reset(self, table, calibration) -> None:
        cal = check_calibration(table, calibration, self.name)
        if not ((table.kind[0::2] == 0).all() and (table.kind[1::2] == 1).all()):
            raise PolicyError("page table rows must alternate gate_up, down (policies.page_table.block_index)")
        if min(cal.bucket_multipliers) <= 0:
            raise PolicyError(f"bucket multipliers must be positive, got {cal.bucket_multipliers}")
        if cal.epsilon <= 0:
            raise PolicyError(f"calibration epsilon must be positive, got {cal.epsilon}")
        prm = self.params
        init = np.asarray(cal.initial_bits, dtype=np.int64)
        sens = np.asarray(cal.sensitivity, dtype=np.float64)
        if prm.no_sensitivity:
            sens = self.stand_in_sensitivity(table)
            budget = int(table.M[np.arange(table.num_blocks), init].sum())
            init = sensitivity_optimal_bits(table, sens, budget_bytes=budget)
        table.initialize(init)
        steps = build_step_table(table.M, sens, table.bits)
        alpha = cal.alpha if prm.alpha is None else prm.alpha
        scorer = Scorer(steps, StepHeads.from_calibration(cal, steps, alpha), float(cal.epsilon))
        last_ok = None
        if not scorer.finite.all():
            S = steps.num_steps
            last_ok = np.stack([first_bad(scorer.finite, np.full(table.num_blocks, c)) - 1 for c in range(S + 1)])
        mu = np.asarray(cal.bucket_multipliers, dtype=np.float64)
        floors = np.asarray(cal.floor_stages, dtype=np.int64)
        caps = np.asarray(cal.depth_caps, dtype=np.int64)
        floor_last = steps.last_for_low[np.clip(floors, 0, MAX_BITS + 1)]
        cap_last = steps.last_for_low[np.clip(init[scorer.perm][None, :] - caps[:, None], 0, MAX_BITS + 1)]
        next_up = np.zeros(MAX_BITS + 1, dtype=np.int64)
        for b in range(MAX_BITS + 1):
            above = [x for x in table.bits if x > b]
            next_up[b] = min(above) if above else 0
        self._p = _Prepared(
            scorer=scorer, steps=steps, start=init.copy(),
            ceiling=init.copy() if prm.reload_to == "initial" else np.full_like(init, max(table.bits)),
            mu=mu, log_mu=np.log(mu), floor_last=floor_last, cap_last=cap_last,
            any_last=np.minimum(floor_last.max(axis=1)[:, None], cap_last).max(axis=0),
            bucket_bounds=tuple(cal.bucket_bounds),
            reload_threshold=int(cal.reload_threshold if prm.reload_threshold is None else prm.reload_threshold),
            plane=plane_bytes_per_block(table), next_up=next_up, last_ok=last_ok)
        self.queue, self.last, self._last_offload_step = (), None, None

    @staticmethod
    def stand_in_sensitivity(table) -> np.ndarray:
        """The no-sensitivity ablation's s[i, b]: parameters times 4 ** (8 - b) (bytes and bit level only)."""
        s = np.full((table.num_blocks, MAX_BITS + 1), np.nan)
        params = (table.shapes[:, 0] * table.shapes[:, 1]).astype(np.float64)
        for b in table.bits:
            s[:, b] = params * 4.0 ** (MAX_BITS - b)
        return s

    # ------------------------------------------------------------------ pieces
    def _prepared(self) -> _Prepared:
        if self._p is None:
            raise PolicyError(f"policy {self.name!r}: call reset(table, calibration) before plan_step")
        return self._p

    def target_bytes(self, table, obs: Observation) -> tuple[int, bool]:
        """(byte target D, pressure triggered); see the module docstring, step 1."""
        free = obs.free_blocks - obs.pending_kv_blocks
        deficit = max(0, obs.free_block_threshold + 1 - free)
        if deficit <= 0:
            return 0, False
        raw = max(deficit, self.params.min_plan_blocks) * obs.kv_block_bytes
        releasing, _ = in_flight_split(table)
        headroom = max(0, obs.headroom_bytes) if self.params.count_headroom else 0
        return max(0, raw - releasing - headroom), True

    def expert_buckets(self, table, obs: Observation) -> np.ndarray:
        """[layers * experts] routing bucket of each expert (0 = hottest)."""
        mass = None if self.params.no_routing else obs.routing_mass
        return expert_buckets(mass, table.layers, table.experts, self._prepared().bucket_bounds).reshape(-1)

    def _features(self, table, obs: Observation) -> np.ndarray | None:
        if obs.prompt_features is None or self.params.no_residual:
            return None
        phi = np.asarray(obs.prompt_features, dtype=np.float64)
        if phi.shape != (table.num_blocks, 3):
            raise ValueError(f"prompt_features has shape {phi.shape}, expected {(table.num_blocks, 3)}")
        return phi

    def _may_step(self, first: np.ndarray) -> bool:
        """Whether some block has a step some stage allows in some routing bucket (internal order, `first` its first
        step column, S when busy). When none has, every stage's greedy finds no legal step whatever the routing is,
        so plan_step decides that without reading the routing statistics, which costs an engine its fold and merge
        (the runtime's planner steps under pressure were 0.7 ms longer when they read)."""
        p = self._prepared()
        last = p.any_last if p.last_ok is None else np.minimum(p.any_last, p.last_ok[first, np.arange(first.size)])
        return bool((first <= last).any())

    # ------------------------------------------------------------------ the step
    def plan_step(self, table, observation: Observation) -> Plan | None:
        p, prm, obs = self._prepared(), self.params, observation
        if prm.no_movement:
            self.last = Decision(obs.step, 0, False, "none", reason="no movement")
            return None
        target, pressure = self.target_bytes(table, obs)
        if target <= 0:
            self.queue = ()
            plan = self._reload(table, obs) if (prm.reload and not pressure) else None
            if plan is None:
                self.last = Decision(obs.step, 0, pressure, "none")
            return plan
        sc, steps = p.scorer, p.steps
        q, busy = sc.internal(table.q), sc.internal(table.target) >= 0
        first = np.where(busy, sc.S, steps.col_from[q])
        if not self._may_step(first):  # every idle block at the loosest floor: no need to read the routing
            self.queue = ()
            self.last = Decision(obs.step, target, True, "none", reason="no legal step")
            return None
        bucket = np.tile(self.expert_buckets(table, obs), 2)  # internal (kind-major) order
        feats = self._features(table, obs)
        lasts = []
        for k in range(len(p.cap_last)):  # Algorithm 1, lines 5-9: each stage's legal steps ...
            last = np.minimum(p.floor_last[k][bucket], p.cap_last[k])
            lasts.append(last if p.last_ok is None else np.minimum(last, p.last_ok[first, np.arange(sc.n)]))
        ratios = MatrixChains(sc.log_ratio(p.log_mu[bucket], feats), sc.bytes, keyed=False)
        stage_picks = chain_greedy_stages(ratios, sc.perm, first, lasts, target, min_weight=sc.min_bytes)
        queue: list[QueuedPlan] = []
        prev_picks, entry = None, None
        for k, picks in enumerate(stage_picks):  # ... greedy-selected and queued
            if prev_picks is None or not all(np.array_equal(a, b) for a, b in zip(picks, prev_picks)):
                entry = self._queued(table, picks, ratios, k, target, obs.step)
            elif entry is not None:  # the same picks as the tighter stage: the same plan
                entry = _restaged(entry, k)
            prev_picks = picks
            if entry is not None:
                queue.append(entry)
        self.queue = tuple(queue)
        best = select_best(self.queue, target)
        if best is None:
            self.last = Decision(obs.step, target, True, "none", reason="no legal step")
            return None
        self._last_offload_step = obs.step
        self.last = Decision(obs.step, target, True, "offload", best.stage, best.plan.reason)
        return best.plan

    def _queued(self, table, picks: tuple[np.ndarray, np.ndarray], ratios: MatrixChains, stage: int, target: int,
                step: int) -> QueuedPlan | None:
        """The plan of one stage's picks: each picked block goes to its deepest (= last) picked step."""
        cols, js = picks
        if cols.size == 0:
            return None
        steps, perm = self._p.steps, self._p.scorer.perm
        blocks, last = np.unique(perm[js[::-1]], return_index=True)
        frm = table.q[blocks].astype(np.int64)
        to = steps.to_bits[cols[::-1][last]]
        nbytes = ratios.weight_at(cols, js)
        damage = float(np.dot(np.exp(ratios.head(cols, js)), nbytes))  # d = (d / Delta) * Delta
        return QueuedPlan(stage, step, target, int(nbytes.sum()), damage, blocks, frm, to,
                          table.M[blocks, frm] - table.M[blocks, to])

    def _reload(self, table, obs: Observation) -> Plan | None:
        p, prm = self._prepared(), self.params
        keep = obs.free_block_threshold + 1 + prm.reload_margin_blocks
        free = obs.free_blocks - obs.pending_kv_blocks
        if free <= max(p.reload_threshold, keep) or obs.num_waiting > 0:  # requests still queue: no ease
            return None
        if self._last_offload_step is not None and obs.step - self._last_offload_step < prm.reload_cooldown_steps:
            return None
        _, reloading = in_flight_split(table)
        budget = (free - keep) * obs.kv_block_bytes - reloading
        budget += max(0, obs.headroom_bytes) if prm.count_headroom else 0
        q = table.q.astype(np.int64)
        up = p.next_up[q]
        idx = np.flatnonzero((table.target < 0) & (up > 0) & (up <= p.ceiling) & ~table.held)
        if budget <= 0 or idx.size == 0:
            return None
        sc = p.scorer
        u = up[idx]
        js = np.where(idx % 2 == 0, idx // 2, sc.half + idx // 2)
        bucket = np.tile(self.expert_buckets(table, obs), 2)
        recovered = sc.damage(p.steps.col_from[u], js, p.mu[bucket], self._features(table, obs))
        cost = (u - q[idx]) * p.plane[idx] + lut_bytes_of(table.shapes[idx, 0], u)  # held while copying
        order = np.lexsort((idx, -(recovered / cost)))
        taken = np.sort(fit_in_order(order, cost, budget))
        if taken.size == 0:
            return None
        total = float(recovered[taken].sum())
        plan = make_plan(table, idx[taken], u[taken], -total,  # negative: damage recovered
                         f"reload: {int(cost[taken].sum())} of {budget} bytes, recovers {total:.4g}")
        self.last = Decision(obs.step, 0, False, "reload", reason=plan.reason if plan else "")
        return plan


def _restaged(entry: QueuedPlan, stage: int) -> QueuedPlan:
    return QueuedPlan(stage, *(getattr(entry, f.name) for f in fields(entry)[1:]))


def select_best(queue: tuple[QueuedPlan, ...], target: int) -> QueuedPlan | None:
    """The first stage whose plan meets the target; otherwise the plan freeing the most bytes."""
    if not queue:
        return None
    meeting = [e for e in queue if e.bytes_freed >= target]
    if meeting:
        return min(meeting, key=lambda e: e.stage)
    return max(queue, key=lambda e: (e.bytes_freed, -e.plan.predicted_damage, -e.stage))
