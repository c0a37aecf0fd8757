"""The simulated serving replica: SimPy time around the shared scheduler, block pool, page table and plan loop.

Everything that decides is shared with pwruntime (`policies/`): the `Scheduler` over a `BlockPool`,
the `PageTable`, the observation (`policies.observe`) and the observe -> plan -> move -> commit step
(`policies.loop.PlanLoop`) that calls the planner exactly as the runtime does. This module adds only
time and hardware:

* arrivals: a SimPy process adds each request to the scheduler at its arrival time;
* the engine loop: schedule -> routing of the batch's tokens -> cost model -> (time passes) ->
  postprocess -> observe -> plan loop step (the iteration boundary) -> KV pool resize; with asynchronous
  scheduling (`SimConfig.async_scheduling`, the runtime's `--async-scheduling`) in the runtime's order instead:
  schedule -> advance -> settle the previous batch -> boundary -> (time passes: the longer of the forward's device
  work and the host's, which overlap), so the same steps make the same decisions as there (the timeline's row of a
  step holds the batch scheduled at it, as the runtime's does);
* the PCIe link (`LinkMover`): a reload's bytes take `bytes / H2D bandwidth` on it, one transfer at a
  time from when the plan's host work queues it (`plan_transition_us` a transition), and it is committed at
  the boundary that began it when copied before the plan's moves end, else at the first boundary after it
  lands; an offload copies nothing and is committed at the boundary that began it, or at the next one
  when the forward launched before it (asynchronous scheduling) outlasts the host's work and so may still be
  reading the planes as the host plans;
* memory under one budget: non-expert fp16 weights + expert weight bytes (the page table's own
  accounting, or the policy's `weight_bytes`) + the KV pool's backed blocks (`id_limit`). The pool
  grows into the headroom after every boundary and shrinks over free blocks when a reload needs
  room (compacting when retired blocks leave holes), each resize of its id space charging the copy the runtime's
  cache makes (`_resized`); an offload's lower LUT borrows the allocator slack while it is in flight
  (`SimConfig.lut_room`, policies.loop); every check that finds the budget exceeded is recorded, never hidden;
* stalls: iterations with unfinished requests but nothing schedulable (memory), and forwards that
  wait for absent experts (q = 0) to be fetched;
* a warm-up (`SimConfig.warmup_requests`, the runtime replay's `--warmup-requests`): the trace's first prompts
  served before the trace's clock starts, outside every metric, leaving what they planned in place;
* prefix caching (`SimConfig.prefix_caching`, off by default): each request's `Sequence` carries its
  prompt token ids and the pool caches full blocks as the runtime's does. Generated tokens are
  `UNKNOWN_TOKEN`, so only prompt blocks are cached and matched (`Sequence.num_known_tokens`); a first
  chunk that starts after cached tokens costs only its new tokens, attending over the whole context.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np
import simpy

from policies.calibration import Calibration, free_block_threshold
from policies.contract import Policy, Transition
from policies.kv_groups import new_pool
from policies.loop import PlanLoop, room_for
from policies.memory_budget import (DEFAULT_PREFILL_CHUNK_BYTES, allocator_slack_bytes, kv_room_bytes,
                                    lut_slack_bytes)
from policies.observe import RoutingStats, build_observation
from policies.page_table import DEFAULT_BITS
from policies.planners.base import never_plans, weight_bytes
from policies.scheduler import ScheduledBatch, Scheduler
from policies.sequence import Sequence
from pwsim.cost_model import BatchShape, CostBreakdown, CostModel
from pwsim.hardware import format_size
from pwsim.link import LinkMover
from pwsim.quality import PerplexityFit, QualityModel
from pwsim.recorder import Recorder
from pwsim.routing import RoutingSource
from traces.clikit import UserError
from traces.hardware import HardwareProfile
from traces.model_card import ModelSpec
from traces.results import WARMUP_TOKENS
from traces.schema import RequestTrace


class BudgetError(UserError):
    """The memory budget cannot hold the weights the policy starts with."""


@dataclass(frozen=True)
class SimConfig:
    """Engine settings of one simulated replica (everything but model, hardware, workload and policy)."""

    budget_bytes: int
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    stall_limit: int = 8  # scheduler: consecutive stalls before the blocking request is finished
    allocator_slack_bytes: int | None = None  # kept out of the KV pool (LUTs of transitions in flight,
    # fragmentation); None: the budget's (policies.memory_budget.allocator_slack_bytes), as the runtime's
    activation_bytes: int = 0  # kept out of the KV pool for a step's activations (policies.memory_budget), never lent
    free_block_threshold: int | None = None  # None: the calibration's (8 without one)
    routing_half_life_tokens: float | None = 4096.0
    prompt_features: bool = True  # feed per-block prompt features when the routing has input norms (never for
    # the policies that never plan, noop and the static ones: nothing reads them)
    max_miss_rounds: int = 4  # fetch rounds a forward waits for absent experts before it runs anyway
    timeline_stride: int = 1  # record every n-th boundary in the timeline
    check_invariants: bool = False  # pool/table invariants after every boundary (tests)
    max_iterations: int = 50_000_000
    prefix_caching: bool = False  # share cached full KV blocks of common prompt prefixes (needs prompt token ids)
    hybrid_kv: bool = True  # sliding-window layers' KV in block tables of their own that hand back what leaves the
    # window (policies.kv_groups; a model without such layers keeps one table), as the runtime's hybrid_kv_cache
    async_scheduling: bool = False  # as the runtime's: the next batch is scheduled before this one settles
    instant_page_moves: bool = False  # every page move lands at the boundary that began it, as the CPU runtime's
    lut_room: str = "slack"  # where offloads' lower LUTs find room in flight (policies.memory_budget.LUT_ROOMS)
    prefill_chunk_bytes: int = DEFAULT_PREFILL_CHUNK_BYTES  # as the runtime's --prefill-chunk: the dequantized experts
    # a prefill layer holds at once, which sets its chunks (the cost model's prefill_chunk_overhead_us each)
    warmup_requests: int = 0  # as `pwruntime replay --warmup-requests`: see `Simulation.run`
    max_concurrency: int | None = None  # as `pwruntime bench serve --max-concurrency`: at most this many requests in
    # flight; one whose arrival finds them all in flight is sent when one ends, its latencies counted from then

    def __post_init__(self) -> None:
        if self.budget_bytes <= 0 or self.block_size <= 0 or self.timeline_stride < 1 or self.prefill_chunk_bytes <= 0:
            raise ValueError("budget_bytes, block_size, timeline_stride and prefill_chunk_bytes must be positive")
        if self.allocator_slack_bytes is None:
            object.__setattr__(self, "allocator_slack_bytes", allocator_slack_bytes(self.budget_bytes))
        if self.warmup_requests < 0 or self.activation_bytes < 0:
            raise ValueError(f"warmup_requests and activation_bytes must be >= 0, got {self.warmup_requests} and "
                             f"{self.activation_bytes}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        lut_slack_bytes(self.lut_room, self.allocator_slack_bytes)  # refuses a room it does not know


@dataclass(frozen=True)
class Workload:
    """Requests (`requests`: request r is row r, its arrival, lengths, domain and prompt ids) and the routing of their
    tokens; `warmup_routing`: what a recorded warm-up routed for the first requests (`_warm_up`)."""

    requests: RequestTrace
    routing: RoutingSource
    description: dict = field(default_factory=dict)
    warmup_routing: RoutingSource | None = None

    def __len__(self) -> int:
        return len(self.requests)

    def retimed(self, arrival_s: np.ndarray, **about) -> "Workload":
        """The same requests and routing arriving at `arrival_s`; `about` joins the description."""
        return replace(self, requests=replace(self.requests, arrival_s=arrival_s),
                       description={**self.description, **about})


@dataclass(frozen=True)
class _Launched:
    """A batch on its way through the simulated forward: what its time, its damage and its settling need."""
    batch: ScheduledBatch
    req: np.ndarray  # request of each entry
    new: np.ndarray  # new tokens of each entry
    sample: np.ndarray  # bool: the entry samples a token
    first: np.ndarray  # bool: ... its first one
    routing: object  # the RoutingSource's batch routing
    expert_tokens: np.ndarray  # [layers, experts] tokens routed to each expert
    num_tokens: int
    cost: CostBreakdown
    q_now: np.ndarray  # the bits the forward reads


class Simulation:
    """One run: a policy on a model card and hardware profile, serving a workload under a budget."""

    def __init__(self, card: ModelSpec, profile: HardwareProfile, workload: Workload, policy: Policy,
                 calibration: Calibration | None, config: SimConfig, quality_fit: PerplexityFit | None = None) -> None:
        self.card, self.profile, self.workload, self.policy, self.cal, self.cfg = (
            card, profile, workload, policy, calibration, config)
        for r in (workload.routing, workload.warmup_routing):
            if r is not None and (r.layers, r.experts, r.top_k) != (card.moe_layers, card.experts, card.top_k):
                raise UserError(f"routing has {r.layers} layers x {r.experts} experts top-{r.top_k}, the model card "
                                f"{card.name} has {card.moe_layers} x {card.experts} top-{card.top_k}")
        self.routing_source = workload.routing  # what `_launch` routes tokens with (a recorded warm-up's in `_warm_up`)
        self.table = card.page_table(bits=calibration.bits if calibration is not None else DEFAULT_BITS)
        policy.reset(self.table, calibration)
        self.full_precision = bool(getattr(policy, "full_precision", False))
        self._own_bytes = getattr(policy, "weight_bytes", None)
        self.cost = CostModel(card, profile, fp16_experts=self.full_precision,
                              prefill_chunk_bytes=config.prefill_chunk_bytes)
        self.nonexpert_bytes = card.fp16_bytes() - 2 * card.routed_expert_params()
        layout = card.kv_layout(config.block_size, hybrid=config.hybrid_kv)
        self.kv_block_bytes = layout.page_bytes   # a block of every layer, or with hybrid KV a page of one group
        self.threshold = free_block_threshold(calibration, config.free_block_threshold)
        self._refresh()
        weights = self._weights
        room = kv_room_bytes(config.budget_bytes, weights, config.allocator_slack_bytes, config.activation_bytes)
        if room < 0:
            raise BudgetError(f"budget {format_size(config.budget_bytes)} cannot hold the weights policy "
                              f"{getattr(policy, 'name', policy)!r} starts with ({format_size(weights)} + "
                              f"{format_size(config.allocator_slack_bytes)} allocator slack + "
                              f"{format_size(config.activation_bytes)} activation reserve); raise the budget")
        if config.prefix_caching and workload.requests.token_ids is None:
            raise UserError("prefix caching needs the prompt token ids of every request, and this trace has none; "
                            "generate one with them (`pwsim gen-trace --token-ids-vocab V`, optionally "
                            "`--shared-prefix-tokens N`; or `--trace synthetic --token-ids-vocab V`)")
        pages = room // self.kv_block_bytes
        self.pool = new_pool(layout, pages, config.prefix_caching)
        self.sched = Scheduler(self.pool, max_num_seqs=config.max_num_seqs,
                               max_num_batched_tokens=config.max_num_batched_tokens, stall_limit=config.stall_limit)
        self.env = simpy.Environment()
        self.mover = LinkMover(self.env, profile.h2d_bytes_per_s, self._check_memory_in_step, self._on_begin,
                               transition_s=profile.plan_transition_us * 1e-6, instant=config.instant_page_moves)
        self.loop = PlanLoop(policy, self.table, self.mover, reserve=self._reserve, release=None,
                             lut_slack_bytes=lut_slack_bytes(config.lut_room, config.allocator_slack_bytes))
        L, E = card.moe_layers, card.experts
        self.routing = RoutingStats(L, E, config.routing_half_life_tokens,
                                    features=config.prompt_features and not never_plans(policy))
        damage = {} if calibration is None else calibration.domain_damage
        self.quality = QualityModel(damage, L, E, quality_fit, zero_damage=self.full_precision)
        req = workload.requests
        self._req_dom = np.array([self.quality.domain_index(d) for d in req.domains], dtype=np.int64)[
            req.domain_idx] if len(workload) else np.zeros(0, np.int64)
        self.rec = Recorder(len(workload), req.arrival_s, config.timeline_stride, self.kv_block_bytes)
        self._arrived = 0
        self._finished = 0  # requests of the trace finished (in flight: arrived - finished)
        self._slot: simpy.Event | None = None  # a request waits on it for a client slot (max_concurrency)
        self._on_finish: Callable[[], object] | None = None
        self._wake: simpy.Event | None = None
        self._step = 0
        self.t0 = 0.0  # simulated time at which the trace's clock starts (after a warm-up)
        self._extra_time = 0.0  # host work charged to the next iteration: KV compaction copies, planning
        self._plan_time = 0.0  # the planning part of it
        self.in_boundary = False
        self.total_cost = CostBreakdown()
        self.charged_s = (0.0, 0.0)  # host time charged besides the cost model's: in all, and its planning part

    # ------------------------------------------------------------------ memory
    def expert_bytes(self) -> int:
        """GPU bytes of the routed experts, as the runtime sizes its pool by them (policies.planners.base.weight_bytes:
        the policy's own figure, else the page table's committed planes and LUTs plus transfers in flight)."""
        return weight_bytes(self.policy, self.table)

    def _refresh(self) -> None:
        """Recompute the weight bytes and those in flight after the page table changed (only the plan loop changes
        it)."""
        self._inflight = int(self.table.in_flight_bytes().sum())
        self._weights = self.nonexpert_bytes + self.expert_bytes()

    def used_bytes(self) -> tuple[int, int]:
        """(weights, KV pool) bytes on the GPU now."""
        return self._weights, self.pool.id_limit * self.kv_block_bytes

    def _headroom(self) -> int:
        """The budget beside the weights, the KV pool, the allocator slack and the activation reserve; LUTs of
        offloads in flight that the slack holds (policies.loop: `lut_borrowed`) are the slack's, not the headroom's."""
        w, kv = self.used_bytes()
        c = self.cfg
        room = kv_room_bytes(c.budget_bytes, w + kv, c.allocator_slack_bytes, c.activation_bytes)
        return room + self.loop.lut_borrowed

    def _check_memory(self, where: str) -> None:
        """Record the weights and the KV pool against what the budget leaves them (all of it but the activation
        reserve: the slack is theirs to borrow)."""
        w, kv = self.used_bytes()
        self.rec.memory(self.now, self._step, w, kv, self.cfg.budget_bytes - self.cfg.activation_bytes, where)

    def _check_memory_in_step(self) -> None:
        if self.cfg.check_invariants:
            w = self._weights
            self._refresh()
            assert w == self._weights, f"incremental weight bytes {w} != recount {self._weights}"
        self._check_memory("plan begun")

    def _on_begin(self, t: Transition, nbytes: int) -> None:
        """A transition of the current plan began: its bytes join the weights now (exactly what the
        page table accounts: a reload holds its planes and new LUT, an offload the new LUT beside the
        old planes), so memory checks inside the plan step need no full recount."""
        if callable(self._own_bytes):
            self._refresh()
            return
        self._weights += room_for(self.table, t)  # an eviction to 0 bits holds no new LUT

    def _reserve(self, nbytes: int) -> bool:
        """Room for a reload, or an offload's new LUT: headroom first, then shrink the KV pool over free blocks
        (compacting if needed).

        When the pool must shrink, it shrinks once for all transitions still to begin in this plan
        (`PlanLoop.kv_blocks_to_free`), so a plan costs at most one compaction (blocks it does not need come back at
        the boundary)."""
        B = self.kv_block_bytes
        need = self.loop.kv_blocks_to_free(nbytes, self._headroom(), B, self.pool.num_free)
        if need is None:
            self.rec.count("reload_refused_no_room")
            return False
        if need == 0:
            return True
        before = self.pool.id_limit
        self.pool.shrink(need)
        if self.pool.hole_blocks:  # retired blocks left holes below live ones: compact, as the runtime's KvCapacity
            moves = self.pool.compact()
            self.rec.count("kv_compactions")
            self.rec.count("kv_blocks_moved", len(moves))
            self._extra_time += 2 * len(moves) * B / self.profile.bandwidth("kv")
        self._resized(before)
        return self._headroom() >= nbytes

    def _grow_pool(self) -> None:
        head = self._headroom()
        n = self.pool.hole_blocks + max(0, head // self.kv_block_bytes)
        if n > 0:
            before = self.pool.id_limit
            self.pool.grow(int(n))
            self._resized(before)

    def _resized(self, before: int) -> None:
        """The pool's id space went from `before` blocks to `id_limit`: the runtime's KV cache copies the blocks it
        keeps into new tensors and zeroes those it adds (`pwruntime.kv_cache.KVCache.resize`), device time the next
        forward waits for, which grows with the cache. A streaming copy, charged at the `dense` class's bandwidth: on
        the H200 at OLMoE's shapes a resize's copy read and wrote 3.5-3.9 TB/s (1.7 ms at 2.9 GB of cache, 6.1 ms at
        11.7, 19.9 ms at 39; session 38), `h200-measured`'s dense class 3.8. Its host work is in the profile's plan
        terms, fitted with it. (Since session 43 the runtime's cache on CUDA maps memory behind the blocks it adds and
        copies nothing; every bundled runtime run and fitted profile predates that, so the copy stays charged here
        until they are recorded again: at the demo's sizes it is microseconds a resize.)"""
        after = self.pool.id_limit
        if after != before:
            moved = 2 * min(before, after) + max(0, after - before)  # blocks read and written
            self._extra_time += moved * self.kv_block_bytes / self.profile.bandwidth("dense")
            self.rec.count("kv_resizes")

    # ---------------------------------------------------------------- processes
    def _arrivals(self):
        req, limit = self.workload.requests, self.cfg.max_concurrency
        for r in range(len(req)):
            delay = float(req.arrival_s[r]) - self.now
            if delay > 0:
                yield self.env.timeout(delay)
            while limit is not None and self._arrived - self._finished >= limit:
                self._slot = self.env.event()
                yield self._slot
            arrival = max(float(req.arrival_s[r]), self.now)  # later when it waited for a slot
            self.rec.arrival[r] = arrival
            self.sched.add(self._sequence(r, int(req.output_tokens[r]), arrival))
            self._arrived += 1
            if self._wake is not None and not self._wake.triggered:
                self._wake.succeed()

    def _sequence(self, r: int, max_tokens: int, arrival: float) -> Sequence:
        """Request r of the workload as a scheduler sequence (with its prompt ids only for prefix caching: the outputs
        are unknown, so prompts alone are cached)."""
        req = self.workload.requests
        return Sequence(r, prompt_token_ids=req.prompt_ids(r).tolist() if self.cfg.prefix_caching else None,
                        prompt_len=int(req.prompt_tokens[r]), max_tokens=max_tokens, arrival_time=arrival)

    @property
    def now(self) -> float:
        """Seconds on the trace's clock (simulated time since the warm-up ended)."""
        return self.env.now - self.t0

    def _engine(self, n: int):
        """Serve until `n` requests have arrived and nothing is left to do."""
        pending = None  # the launched batch not yet settled (asynchronous scheduling)
        while self._step < self.cfg.max_iterations:
            if not self.sched.has_unfinished() and pending is None:
                if self._arrived >= n:
                    return
                self._wake = self.env.event()
                yield self._wake
                continue
            batch = self.sched.schedule()
            batch.mark_scheduled(self.now)
            for s in batch.preempted:
                self._forget(s)
            for s in batch.aborted:
                self._finish(s)
            if batch.is_empty and pending is not None:  # sequences await their last token: settle, no time passes
                self._settle(pending)
                pending = None
            elif batch.is_empty:
                dt = self.cost.overhead + self._take_extra()[0]
                self.rec.stall(self.now, dt, "memory")
                yield self.env.timeout(dt)
            elif self.cfg.async_scheduling:
                launched = yield from self._launch(batch)
                if pending is not None:
                    self._settle(pending)
                # the plan overlaps this batch (its commits reach the next one), which is still on the device as the
                # host plans where its device work outlasts the host's
                self._boundary(forward_in_flight=launched.cost.device > launched.cost.overhead)
                yield from self._run(launched, overlap=True)
                pending = launched
                continue
            else:
                launched = yield from self._launch(batch)
                yield from self._run(launched, overlap=False)
                self._settle(launched)
            self._boundary()

    def _launch(self, batch: ScheduledBatch):
        """The batch's routing, the wait for absent experts, its cost and the bits it reads (`_Launched`); the batch is
        advanced in the scheduler (its tokens settle in `_settle`)."""
        entries = batch.entries
        cols = np.array([(e.seq.seq_id, e.start, e.num_new_tokens, e.sample, not e.seq.output_token_ids)
                         for e in entries], dtype=np.int64).reshape(-1, 5)
        req, start, new = cols[:, 0], cols[:, 1], cols[:, 2]
        sample, first = cols[:, 3].astype(bool), cols[:, 4].astype(bool)  # first: its first token is sampled now
        routing = self.routing_source.route(req, start, new)
        L, E = self.card.moe_layers, self.card.experts
        flat = (np.arange(L)[:, None, None] * E + routing.ids).ravel()
        expert_tokens = np.bincount(flat, minlength=L * E).reshape(L, E)
        yield from self._wait_for_absent(expert_tokens > 0)
        shape = BatchShape(new, start, int(sample.sum()))
        cost = self.cost.iteration(shape, self.table.q, expert_tokens)
        q_now = self.table.q.copy()  # the bits this forward reads (commits happen only at boundaries)
        self.sched.advance(batch)  # its sequences' progress, and a pending token for each it samples
        return _Launched(batch, req, new, sample, first, routing, expert_tokens, shape.num_tokens, cost, q_now)

    def _run(self, b: "_Launched", overlap: bool):
        """Time passes for the forward: its cost, or with asynchronous scheduling the longer of its device work and
        the host's work (which overlap); then the damage of the tokens it sampled accrues."""
        cost, (extra, plan_s) = b.cost, self._take_extra()
        dt = max(cost.device, cost.overhead + extra) if overlap else cost.total + extra
        self.total_cost = self.total_cost + cost
        yield self.env.timeout(dt)
        self.rec.iteration(self.now, dt, b.num_tokens, b.batch.num_decode_tokens, len(b.batch.entries), plan_s,
                           launched_before_last_boundary=overlap)
        ends = np.cumsum(b.new)  # tokens sampled by this forward: the last position of every sampling entry
        self.quality_accrue(b.q_now, b.req[b.sample], b.routing.ids[:, (ends - 1)[b.sample], :])

    def _settle(self, b: "_Launched") -> None:
        """The batch's tokens reach the scheduler (advanced at its launch), its routing the statistics; finished
        requests are recorded. A sequence that finished since its launch gets nothing (asynchronous scheduling)."""
        live = np.array([not e.seq.is_finished for e in b.batch.entries if e.sample], bool)
        finished = self.sched.settle(b.batch)  # in entry order
        self.rec.tokens(b.req[b.sample][live], self.now, b.first[b.sample][live])
        if callable(getattr(self.policy, "touch", None)):
            self.policy.touch(b.expert_tokens > 0)
        r = b.routing
        self.routing.add(b.req.tolist(), b.new, r.ids, r.weights, *((r.gate_up_norm, r.down_norm) if r.has_norms else ()))
        self.routing.drop_stopped(e.seq for e in b.batch.entries)
        for seq in finished:
            self._finish(seq)

    def quality_accrue(self, q: np.ndarray, reqs: np.ndarray, ids_lt: np.ndarray) -> None:
        if len(reqs):
            dmg = self.quality.accrue(q, self._req_dom[reqs], np.ascontiguousarray(ids_lt.transpose(1, 0, 2)))
            self.rec.damage(reqs, dmg)

    def _wait_for_absent(self, used: np.ndarray):
        """A forward that routes to an expert with no GPU-resident planes waits until it is fetched."""
        q = self.table.q.reshape(-1, 2)
        for _ in range(self.cfg.max_miss_rounds):
            absent = used.reshape(-1) & ((q[:, 0] == 0) | (q[:, 1] == 0))
            if not absent.any():
                return
            t0 = self.now
            if callable(getattr(self.policy, "touch", None)):
                self.policy.touch(used)
            self._boundary()  # the policy plans the fetch
            while self.mover.in_flight_reloads:
                yield self.mover.next_landing()
            self._boundary()  # commit what landed
            self.rec.stall(t0, self.now - t0, "absent_experts")
        absent = used.reshape(-1) & ((q[:, 0] == 0) | (q[:, 1] == 0))
        if absent.any():
            self.rec.count("forwards_with_absent_experts")

    def _boundary(self, forward_in_flight: bool = False):
        self.mover.boundary(forward_in_flight)
        obs = build_observation(step=self._step, time_s=self.now, pool=self.pool, scheduler=self.sched,
                                kv_block_bytes=self.kv_block_bytes, free_block_threshold=self.threshold,
                                routing=self.routing,
                                headroom_bytes=max(0, self._headroom()), inflight_bytes=self._inflight)
        self.in_boundary = True  # the page table changes only inside this call (tests check it)
        res = self.loop.step(obs)
        self.in_boundary = False
        # the planner's host work, which the runtime pays before its next forward: reading the routing statistics
        # and beginning the plan's moves
        read_s = 0.0
        if obs.routing_read:
            read_s = self.profile.routing_read_us * 1e-6
            self._extra_time += read_s
            self.rec.count("routing_reads")
        moves_s = self.profile.plan_transition_us * 1e-6 * len(res.started)
        self._extra_time += moves_s
        self._plan_time += read_s + moves_s
        if res.plan is not None or res.committed:
            self._refresh()  # exact recount after the plan's begins and this boundary's commits
        self.rec.plan(self.now, self._step, res, self.table)
        self._grow_pool()
        self._check_memory("boundary")
        if self.cfg.check_invariants:
            self.pool.check_invariants()
            self.table.check_invariants()
            shared = self.nonexpert_bytes + weight_bytes(self.policy, self.table)
            assert self._weights == shared, f"incremental weight bytes {self._weights} != recount {shared}"
        w, kv = self.used_bytes()
        bits = self._mean_bits()
        self.rec.timeline(self.now, self._step, w, kv, self.pool, self.table, self.sched, self._inflight, bits)
        self._step += 1

    def _mean_bits(self) -> float:
        """Mean committed bits over the expert blocks (16 for full-precision weights)."""
        return 16.0 if self.full_precision else float(self.table.q.mean())

    def _take_extra(self) -> tuple[float, float]:
        """The host time charged to the next forward (or stall), and the planning part of it."""
        taken = (self._extra_time, self._plan_time)
        self.charged_s = (self.charged_s[0] + taken[0], self.charged_s[1] + taken[1])
        self._extra_time = self._plan_time = 0.0
        return taken

    def _forget(self, seq: Sequence) -> None:
        self.routing.drop(seq.seq_id)

    def _finish(self, seq: Sequence) -> None:
        self._forget(seq)
        self.routing_source.release(int(seq.seq_id))
        self.rec.finish(int(seq.seq_id), self.now, seq.num_output_tokens, seq.finish_reason,
                        seq.num_preemptions, seq.first_scheduled_time)
        self._finished += 1
        if self._slot is not None and not self._slot.triggered:
            self._slot.succeed()
        if self._on_finish is not None:
            self._on_finish()

    # --------------------------------------------------------------------- run
    def run(self, on_finish: Callable[[], object] | None = None):
        """Simulate to the last request's completion; returns a `pwsim.recorder.SimResult`. `on_finish` is called
        as each request finishes (a progress bar). With `SimConfig.warmup_requests` the warm-up runs first."""
        self._check_memory("start")
        if self.cfg.warmup_requests:
            self._warm_up(min(self.cfg.warmup_requests, len(self.workload)))
        self._on_finish = on_finish
        self.rec.start(self._mean_bits())
        self.rec.count("kv_resizes", 0)  # counted from here, none included (pwsim fidelity tells it from "not counted")
        self.env.process(self._arrivals())
        proc = self.env.process(self._engine(len(self.workload)))
        self.env.run(until=proc)
        return self.rec.result(self)

    def _warm_up(self, k: int) -> None:
        """The runtime's replay warm-up (`pwruntime replay --warmup-requests`): the trace's first `k` prompts at once,
        up to WARMUP_TOKENS tokens each, served before the trace's clock starts and left out of every metric. What
        they change stays, as it does on the runtime: the plans made under their pressure (the page table, the KV
        pool), the routing statistics, the links' transfers. The trace's clock then starts at 0 (`now`, `t0`). A
        workload with a recorded warm-up's routing (`pwruntime replay --record-routing`) routes them with it."""
        wl, rec = self.workload, self.rec
        if wl.warmup_routing is not None:
            recorded = wl.warmup_routing.num_requests
            if k > recorded:
                raise UserError(f"the trace's recorded warm-up routed its first {recorded} requests, not {k}: give "
                                f"--warmup-requests {recorded} or fewer")
            self.routing_source = wl.warmup_routing
        self.rec = Recorder(len(wl), wl.requests.arrival_s, self.cfg.timeline_stride, self.kv_block_bytes)  # not kept
        for r in range(k):
            self.sched.add(self._sequence(r, min(WARMUP_TOKENS, int(wl.requests.output_tokens[r])), self.now))
        self._arrived = k
        self.env.run(until=self.env.process(self._engine(k)))
        rec.keep_memory_checks(self.rec)  # a budget exceeded is never hidden, warm-up or not
        self._arrived, self._finished, self.rec, self.t0 = 0, 0, rec, self.env.now
        self.routing_source = wl.routing
