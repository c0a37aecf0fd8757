"""LLMEngine: continuous batching of requests over one model and one paged KV cache.

Every `step()` is one iteration: schedule (policies.Scheduler over policies.BlockPool) -> forward
(ModelRunner) -> sample (the whole batch at once, each request with its own counter-based random numbers) -> observe
(policies.observe builds the Observation from the pool, the scheduler, the online routing mass and the prompt
features; the routing is brought to the host and observed only when the policy plans, not for noop and the static
baselines. Steps' routing is held (policies.observe.RoutingStats) and folded into the statistics in batches:
while a forward runs on the GPU once they route `hold_slots` token slots, or when a planner reads the Observation's
routing) -> plan (policies.loop.PlanLoop: policy.plan_step, the plan handed to the page mover, finished
transfers committed). The default policy is "noop" and the default mover lands every transfer at
once (full-precision weights have no pages to move).

Memory (pwruntime.kv_capacity, `engine.capacity`): the KV pool starts with `num_kv_blocks` blocks (or, when unset, what
the memory budget leaves, else a share of free GPU memory or `cpu_kv_cache_bytes` on CPU, never more than max_num_seqs
full-length sequences need; a pool sized from device memory leaves out the activation reserve, measured by a profiling
forward: pwruntime.activation_profile). Bytes an offload releases grow the pool; a reload first takes spare bytes, then
shrinks the pool over free blocks, compacting live blocks downwards when needed so the cache can be truncated. Wall time
is used only for metrics and `Observation.time_s`.

Log-probabilities: a request whose SamplingParams ask (`logprobs`) gets a TokenLogprob per sampled token,
kept beside its sequence's output tokens and aligned with them (a preempted sequence keeps its tokens and
recomputes only their K/V, sampling nothing again, so its records neither repeat nor go missing). They are of the
raw logits: the logits processing a request may ask for (`logit_bias`, `min_tokens`, the penalties:
pwruntime.sampling) changes what it samples, from its prompt, its output so far and its stop tokens, and only
requests that ask pay for it;
stop strings, too, are looked for only once a request has more than `min_tokens` output tokens, as vLLM's.
A request asking `prompt_logprobs` gets a record per prompt token after the first (pwruntime.prompt_logprobs), from
the prefill steps that compute its prompt: the runner hands back those rows' hidden states, and the records are
made on the device and read back when the step settles.

Asynchronous scheduling (`async_scheduling`, off by default; vLLM's `--async-scheduling`): a step launches its
batch, samples on the device and schedules nothing more; the next step schedules and launches its batch first and
only then waits for the previous tokens and settles them (policies.scheduler: `advance`, then `settle` a step
later), so the host's scheduling, input preparation and launches overlap the device's work instead of following it.
The previous step's tokens reach the next forward on the device (ModelRunner.keep_sampled). What it changes: a
request's tokens become visible a step later, a sequence that an EOS, stop token or stop string ends computes one
more token, which is dropped, and the planner observes and plans while the next batch runs. While a request asks
for logits processing that reads every token so far (min_tokens, penalties; not `logit_bias`) steps settle before
scheduling, as synchronous ones do. Greedy and seeded outputs are the same tokens as without it.

Traces: with `record_traces` (or a `recorder`), a TraceRecorder collects the request and routing
traces in the traces/ schema; `engine.recorder.write(dir)` writes them.

Prefix caching (`prefix_caching`, off by default; policies.kv_blocks): a request admitted while full KV blocks
holding its leading tokens are cached shares them and computes only the rest (at least its last token), so the
routing observation (routing mass, prompt features) sees only the tokens computed: cached tokens are not observed
again. A routing trace needs every position's routing, so trace recording refuses prefix caching. Resizes
(pwruntime.kv_capacity: growth, and shrinking with its compaction) keep cached and shared blocks: the pool reports each move once.

Hybrid KV groups (`hybrid_kv_cache`, on by default as vLLM's; policies.kv_groups): a model that mixes sliding-window and
global layers (Gemma 4) keeps them in groups with block tables of their own, so a sliding group's table hands back the
blocks that left its window; the pool (a GroupedBlockPool) then counts pages, and the cache shares each page's memory
between the groups (pwruntime.kv_cache). Each group has its own block tables and K/V slots in a forward's metadata, and
in the CUDA graphs' static inputs. With prefix caching each group caches its own blocks (the pool's docstring).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence as Seq

import numpy as np
import torch

import policies
from policies.calibration import free_block_threshold
from policies.kv_groups import new_pool
from policies.loop import ImmediateMover, LoopResult, PageMover, PlanLoop, absent_error
from policies.memory_budget import allocator_slack_bytes, lut_slack_bytes
from policies.observe import RoutingStats, build_observation
from policies.page_table import PageTable
from policies.planners.base import never_plans
from policies.scheduler import ScheduledBatch, Scheduler
from policies.sequence import Sequence
from pwruntime.activation_profile import measure_activation_bytes
from pwruntime.cuda_memory import allocator_reserved
from pwruntime.kv_capacity import KvCapacity, initial_kv_blocks
from pwruntime import prompt_logprobs
from pwruntime.model_runner import ModelRunner, RoutingArrays, RoutingCopy, StepOutput, to_host
from pwruntime.sampling import (History, PendingLogprobs, RequestDraws, SamplingParams, TokenLogprob, adjust_logits,
                                find_stop, logprobs_on_device)
from pwruntime.trace_recorder import TraceRecorder
from traces.clikit import UserError
from traces.sizes import format_size


def _out_of_memory(e: BaseException) -> bool:
    """Whether `e` is an allocation the device could not satisfy: CUDA's out-of-memory error, the driver's (a
    MemoryError, pwruntime.vmm) or the CPU allocator's RuntimeError."""
    return isinstance(e, (MemoryError, torch.cuda.OutOfMemoryError)) or "can't allocate memory" in str(e)


@dataclass(frozen=True)
class StepPhases:
    """Seconds (on the engine's clock) of one step's phases; they add up to the step."""
    schedule_s: float  # the scheduler's batch (and dropping the preempted sequences' features)
    forward_s: float  # ModelRunner.run: inputs, the model (a graph replay or eager), logits, routing to the host
    # (with the held steps' routing folded into the statistics while the GPU runs, when due)
    sample_s: float  # sampling the next tokens, and waiting for the tokens that settle in this step
    observe_s: float  # settling them (the routing held for the statistics, stops), outputs, the planner's Observation
    plan_s: float  # PlanLoop.step: the policy's plan, page moves started and landed

    PHASES = ("schedule_s", "forward_s", "sample_s", "observe_s", "plan_s")


@dataclass(frozen=True)
class PlanCosts:
    """Host seconds of three parts of one step's plan phase (`StepPhases.plan_s`); the rest is the planner's decisions
    and the plan loop's bookkeeping."""
    read_s: float  # computing the routing statistics the planner read (folding the held steps, merging features)
    moves_s: float  # the page mover's `start` and `landed` (CudaPageMover; the CPU's immediate mover does nothing)
    kv_s: float  # resizing the KV cache (and compacting its pool) to give bytes to reloads or take freed ones back

    PARTS = ("read_s", "moves_s", "kv_s")


@dataclass(frozen=True)
class EngineConfig:
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: from gpu_memory_budget, else gpu_memory_fraction (CUDA) or
    # cpu_kv_cache_bytes (CPU)
    gpu_memory_budget: int | None = None  # bytes for the model's weights (the routed experts at the policy's starting
    # bits) and the KV pool, as pwsim's --budget (policies.memory_budget); the pool starts with what weights leave
    gpu_memory_fraction: float = 0.9  # share of the GPU's total memory this process may fill (weights included)
    cpu_kv_cache_bytes: int = 256 << 20
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None  # positions a request may use (prompt and output); None: the model's
    policy: str = "noop"
    policy_params: dict = field(default_factory=dict)
    free_block_threshold: int | None = None  # None: the calibration's (8 without one), as pwsim's
    routing_half_life_tokens: float | None = 4096.0
    observe_routing: bool | None = None  # routing mass and prompt features each forward; None: when the policy plans
    stall_limit: int = 8
    seed: int = 0  # seeds requests that carry no seed of their own
    record_traces: bool = False
    cuda_graphs: bool = True  # decode steps on CUDA replay captured graphs (when the expert store is capturable)
    mixed_cuda_graphs: bool = True  # with cuda_graphs, other steps replay piecewise graphs (pwruntime.mixed_graphs)
    graph_settle_steps: int = 8  # after a change that drops graphs (a new store or store epoch; KV resizes on CUDA do
    # not), steps of each kind (decode, mixed) that run eagerly before its graphs are captured again
    prefix_caching: bool = False  # share cached full KV blocks between requests with a common prefix
    hybrid_kv_cache: bool = True  # sliding-window and global layers in KV groups with tables of their own, so a
    # sliding group hands back what left its window (policies.kv_groups; blocks are then pages of one group)
    async_scheduling: bool = False  # schedule and launch the next step before settling this one (module docstring)
    lut_room: str = "slack"  # where an offload's lower LUT finds room in flight (policies.memory_budget.LUT_ROOMS);
    # the slack is a memory budget's (none without one, or with num_kv_blocks)
    activation_reserve: int | None = None  # bytes a pool sized from device memory leaves a step's activations; None:
    # measured by a profiling forward of the largest step (pwruntime.activation_profile; 0 off CUDA)

    def __post_init__(self) -> None:
        lut_slack_bytes(self.lut_room, 0)  # refuses a room it does not know
        if self.activation_reserve is not None and self.activation_reserve < 0:
            raise ValueError(f"activation_reserve must be >= 0 bytes, got {self.activation_reserve}")


@dataclass(frozen=True)
class RequestOutput:
    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]  # every sampled token (including an EOS or stop token that ended it)
    text: str  # decoded output, without the EOS/stop token, cut before a stop string
    finish_reason: str  # "stop", "length", "kv_capacity" or "abort"
    num_preemptions: int
    arrival_time: float
    first_token_time: float | None
    finish_time: float
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token id when SamplingParams.logprobs is set, else empty
    prompt_logprobs: tuple[TokenLogprob, ...] = ()  # one per prompt token after the first when
    # SamplingParams.prompt_logprobs is set (pwruntime.prompt_logprobs), else empty
    first_scheduled_time: float | None = None  # when a batch first held it (None: never)


@dataclass(frozen=True)
class PromptOutput:
    """A request's prompt as its RequestOutput will hold it (`LLMEngine.prompt_of`, while it runs)."""
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: tuple[TokenLogprob, ...]


@dataclass(frozen=True)
class _Launched:
    """A batch launched on the device, with its tokens sampled there: what settling it reads back."""
    batch: ScheduledBatch
    sampling: list  # the _Request of each sampling entry, in order
    tokens: torch.Tensor  # int64 [n] on the host (pinned from a GPU), valid once `ready`
    ready: torch.cuda.Event | None
    logprobs: PendingLogprobs | None
    routing: RoutingCopy | None
    prompt: prompt_logprobs.PendingPromptLogprobs | None = None


@dataclass
class _Request:
    seq: Sequence
    prompt: str | None
    params: SamplingParams
    draws: RequestDraws | None  # the random numbers of a request that samples (None: greedy)
    stop_ids: frozenset
    arrival_time: float
    first_token_time: float | None = None
    stop_text: str | None = None  # output text cut before (or after) the stop string that ended it
    checked_chars: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per output token, when params.logprobs is set
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # when params.prompt_logprobs is set


class LLMEngine:
    """add_request / step / generate / has_unfinished over one model."""

    def __init__(self, model, config: EngineConfig | None = None, *, policy=None, table: PageTable | None = None,
                 calibration=None, mover: PageMover | None = None, recorder: TraceRecorder | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.model, self.config = model, config or EngineConfig()
        cfg, mc = self.config, model.config
        self.tokenizer = model.tokenizer
        self.clock, self.t0 = clock, clock()
        self.max_model_len = self._context_limit()
        self.kv_layout = model.kv_layout(cfg.block_size, cfg.hybrid_kv_cache)
        self.block_bytes = self.kv_layout.page_bytes  # a block of every layer, or of one KV group's (hybrid_kv_cache)
        if cfg.prefix_caching and (cfg.record_traces or recorder is not None):
            raise UserError("prefix caching skips the routing of cached tokens, which a trace records: "
                            "record traces without prefix caching")
        n_moe = mc.num_moe_layers or mc.layers
        self.table = table if table is not None else PageTable(n_moe, mc.experts, mc.hidden, mc.expert_intermediate)
        if policy is None:
            try:
                policy = policies.get(cfg.policy, **dict(cfg.policy_params))
            except ValueError as e:
                raise UserError(str(e)) from None
        policy.reset(self.table, calibration)  # its starting bits, which a memory budget's pool is sized after
        absent = np.flatnonzero(self.table.q == 0)
        if absent.size:
            raise policies.PolicyError(absent_error(policy, self.table.block_id(int(absent[0]))))
        self.policy = policy
        self.threshold = free_block_threshold(calibration, cfg.free_block_threshold)
        # the blocks a request of the full context holds at its last position
        self.kv_blocks_per_request = self.kv_layout.pages(self.max_model_len - 1, self.max_model_len)
        self.activation_reserve = self._activation_reserve()
        self.serving_reserve = 0  # what serving holds beside weights, KV and activations (`capture_graphs`)
        budget_sized = cfg.gpu_memory_budget is not None and cfg.num_kv_blocks is None  # else the pool has no slack
        # with a pool sized by the budget and the activation reserve measured (auto), what the allocator holds before
        # the KV cache and the runner (`capture_graphs`)
        self._serving_base = (allocator_reserved(model.device) if budget_sized and cfg.activation_reserve is None
                              else None)
        blocks, spare = initial_kv_blocks(cfg, model, policy, self.table, self.block_bytes, self.kv_blocks_per_request,
                                          self.activation_reserve)
        graphs = cfg.cuda_graphs and model.device.type == "cuda"
        try:
            self.pool = new_pool(self.kv_layout, blocks, cfg.prefix_caching)
            self.kv = model.new_kv_cache(self.pool.id_limit, cfg.block_size, scratch=graphs,
                                         hybrid=cfg.hybrid_kv_cache)
        except (RuntimeError, MemoryError) as e:  # a pool sized past the memory there is
            if not _out_of_memory(e):
                raise
            size = format_size(blocks * self.block_bytes)
            raise UserError(f"cannot allocate a KV cache of {blocks:,} blocks ({size}) on {model.device}: lower "
                            "--gpu-memory-budget or --num-kv-blocks") from None
        self.runner = ModelRunner(model, self.kv, cuda_graphs=graphs, max_num_seqs=cfg.max_num_seqs,
                                  graph_settle_steps=cfg.graph_settle_steps,
                                  max_num_batched_tokens=cfg.max_num_batched_tokens if cfg.mixed_cuda_graphs else None,
                                  max_model_len=self.max_model_len)
        self.capacity = KvCapacity(model, self.pool, self.kv, self.runner.copy_blocks, self.block_bytes, spare)
        self.scheduler = Scheduler(self.pool, cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.stall_limit)
        slack = allocator_slack_bytes(cfg.gpu_memory_budget) if budget_sized else 0
        self.loop = PlanLoop(policy, self.table, mover or ImmediateMover(), reserve=self.capacity.reserve,
                             release=self.capacity.release, lut_slack_bytes=lut_slack_bytes(cfg.lut_room, slack),
                             serves_absent=False)
        self.capacity.loop = self.loop
        self.routing = RoutingStats(n_moe, mc.experts, cfg.routing_half_life_tokens)
        self.recorder = recorder if recorder is not None else (TraceRecorder(card=mc.arch) if cfg.record_traces else None)
        if self.recorder is not None:
            self.recorder.set_model(n_moe, mc.experts, mc.top_k)
        observe = cfg.observe_routing if cfg.observe_routing is not None else not never_plans(policy)
        self._record = observe or self.recorder is not None
        eos = tuple(mc.eos_token_ids) or ((mc.eos_token_id,) if mc.eos_token_id is not None else ())
        if not eos and self.tokenizer.eos_id is not None:
            eos = (self.tokenizer.eos_id,)
        self.eos_ids = tuple(int(e) for e in eos)
        self._requests: dict[int, _Request] = {}
        self._prompt_cursors: dict[int, int] = {}  # request id -> prompt positions asked for (pwruntime.prompt_logprobs)
        self._next_id = 0
        self.unclaimed: list[RequestOutput] = []  # outputs of requests finished inside another call's generate()
        self.num_steps = 0
        self.num_generated_tokens = 0  # output tokens settled so far (each request's, as its outputs count them)
        self.last_observation: policies.Observation | None = None
        self.last_loop: LoopResult | None = None
        self.last_batch: ScheduledBatch | None = None  # what the last step scheduled
        self.last_phases: StepPhases | None = None  # how long the last step's phases took
        self.last_plan_costs: PlanCosts | None = None  # and parts of its plan phase
        self.last_tokens: list[tuple[int, float]] = []  # (request id, engine time) of each token the last step settled
        self._inflight: _Launched | None = None  # launched and not yet settled (asynchronous scheduling)

    @property
    def last_routing_read(self) -> bool:
        """Whether the last step's planner read the routing statistics."""
        return self.last_observation is not None and self.last_observation.routing_read

    # ------------------------------------------------------------------ set-up
    def _context_limit(self) -> int:
        """Positions a request may use (prompt and output): max_model_len, at most the model's."""
        limit, positions = self.config.max_model_len, self.model.config.max_position
        if limit is None:
            return positions
        if not 2 <= limit <= positions:
            raise UserError(f"max_model_len (--max-model-len) must be in 2..{positions} (the model's positions), got "
                            f"{limit}")
        return int(limit)

    def _activation_reserve(self) -> int:
        """What a pool sized from device memory leaves a step's activations: the configured bytes, else measured
        (pwruntime.activation_profile); 0 for a pool of `num_kv_blocks`."""
        cfg = self.config
        if cfg.num_kv_blocks is not None:
            return 0
        if cfg.activation_reserve is not None:
            return int(cfg.activation_reserve)
        return measure_activation_bytes(self.model, cfg.block_size, cfg.hybrid_kv_cache, cfg.max_num_batched_tokens,
                                        self.max_model_len, cfg.max_num_seqs)

    # ---------------------------------------------------------------- requests
    def add_request(self, prompt: str | Seq[int], params: SamplingParams | None = None, *,
                    arrival_time: float | None = None, domain: str | None = None, text: str | None = None) -> int:
        """Queue a request (text, or token ids); returns its id. Raises UserError for an unusable prompt. `text`:
        the text token ids were encoded from (what an echo shows; the server encodes off its event loop)."""
        params = params or SamplingParams()
        mc = self.model.config
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenizer.encode(prompt)
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise UserError("the prompt has no tokens; give a non-empty prompt")
        if min(ids) < 0 or max(ids) >= mc.vocab:
            raise UserError(f"prompt token ids must lie in 0..{mc.vocab - 1}")
        if params.logit_bias and params.logit_bias[-1][0] >= mc.vocab:
            raise UserError(f"logit_bias names token {params.logit_bias[-1][0]}; token ids lie in 0..{mc.vocab - 1}")
        limit, whose = self.max_model_len, ("model's" if self.max_model_len == mc.max_position else "engine's")
        if len(ids) >= limit:
            raise UserError(f"the prompt has {len(ids)} tokens but the {whose} context holds at most {limit} "
                            "positions; shorten the prompt")
        if not params.clip_to_context and len(ids) + params.max_tokens > limit:
            raise UserError(f"the prompt has {len(ids)} tokens and max_tokens is {params.max_tokens}, more than the "
                            f"{whose} {limit} positions; ask for at most {limit - len(ids)} tokens")
        need = self.kv_layout.pages(len(ids), len(ids) + 1)   # to hold the prompt and compute one more token
        if need > self.pool.capacity:
            unit = "KV pages" if self.kv_layout.hybrid else f"KV blocks of {self.pool.block_size} tokens"
            raise UserError(f"the prompt needs {need} {unit} but the pool has {self.pool.capacity}; raise the KV cache "
                            "size or shorten the prompt")
        rid = self._next_id
        self._next_id += 1
        stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else frozenset(self.eos_ids))
        seq = Sequence(rid, ids, max_tokens=min(params.max_tokens, limit - len(ids)),
                       stop_token_ids=tuple(sorted(stop_ids)), params=params,
                       arrival_time=self._now() if arrival_time is None else float(arrival_time))
        draws = None
        if not params.greedy:
            draws = RequestDraws(params.seed if params.seed is not None else int(
                np.random.SeedSequence([self.config.seed, rid]).generate_state(1, np.uint64)[0]))
        self._requests[rid] = _Request(seq, text, params, draws, stop_ids, seq.arrival_time)
        if params.prompt_logprobs is not None and len(ids) > 1:
            self._prompt_cursors[rid] = 0
            seq.share_cached_prefix = False  # every prompt position is computed: cached ones would have no logits
        self.scheduler.add(seq)
        if self.recorder is not None:
            self.recorder.on_arrival(rid, seq.arrival_time, ids, domain)
        return rid

    def abort(self, request_id: int) -> RequestOutput | None:
        seq = self.scheduler.abort(request_id)
        if seq is None:
            return None
        self.routing.drop(request_id)
        return self._output(seq)

    def compile_kernels(self) -> tuple[int, float]:
        """Compile the CUDA kernels this engine's steps can launch now, not inside its first steps (ModelRunner)."""
        return self.runner.compile_kernels()

    def apply_starting_bits(self, store) -> None:
        """Bring the expert store (a DeviceExpertStore) to the planner's starting bits, which its reset wrote into the
        page table, before the first request. A pool sized from free memory (no budget, no --num-kv-blocks) takes the
        bytes that frees; what the store's own allocations change is not charged to the serving reserve."""
        before = allocator_reserved(store.device) if self._serving_base is not None else None
        resident = store.resident_bytes()
        store.sync()
        freed = resident - store.resident_bytes()
        cfg = self.config
        if cfg.num_kv_blocks is None and cfg.gpu_memory_budget is None and freed > 0:
            # the pool was sized while every plane was resident: the planes just dropped become KV blocks
            if store.device.type == "cuda":
                torch.cuda.synchronize(store.device)
            store.deferred.collect()
            self.capacity.give(freed)
        if before is not None:
            self._serving_base += allocator_reserved(store.device) - before

    def capture_graphs(self) -> None:
        """Capture the runner's CUDA graphs for every decode size and mixed-step bucket now, as this engine's steps
        will replay them (recording routing or not), so no step pays a capture later; nothing off CUDA. With a memory
        budget and the activation reserve measured (auto), the pool then gives up what torch's allocator came to hold
        since that measurement (`serving_reserve`): the graphs' pools and the MoE workspaces and buffers the runner
        and the captures' warm-ups made (1.04 GiB for a 12-layer Gemma-4-26B-A4B, against 59 MiB for the pools
        alone), so the budget holds them too. An explicit reserve is the whole of it."""
        if self._serving_base is None:
            self.runner.capture_graphs(self._record)
            return
        with self.capacity.unmapped():   # the captures allocate where the cache was, so the budget is never passed
            self.runner.capture_graphs(self._record)
            owed = allocator_reserved(self.model.device) - self._serving_base - self.serving_reserve
            if owed > 0:
                self.capacity.keep_out(owed, "the CUDA graphs' pools and the runner's buffers (--activation-reserve "
                                             "SIZE instead of auto keeps only SIZE)")
                self.serving_reserve += owed

    def has_unfinished(self) -> bool:
        """Whether a request is still waiting or running (a launched batch's live sequences are running; one whose
        sequences all finished has nothing left to give and is settled by the next step)."""
        return self.scheduler.has_unfinished()

    # -------------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """One iteration; returns the requests that finished in it. `last_phases` times its phases. With
        asynchronous scheduling the batch launched here settles in the next step, after that step's launch."""
        marks = [self.clock()]
        finished: list[Sequence] = []
        self.last_tokens = []
        if self._inflight is not None and any(r.params.reads_history for r in self._requests.values()):
            # their logits processing reads every token so far
            finished += self._settle(self._inflight)
            self._inflight = None
        batch = self.last_batch = self.scheduler.schedule()
        batch.mark_scheduled(self._now())
        for s in batch.preempted:
            self.routing.drop(s.seq_id)  # its recompute will observe its tokens again
        finished += batch.aborted
        marks.append(self.clock())
        launched = None
        if batch.entries:
            needed = prompt_logprobs.needed_rows(batch, self._prompt_cursors) if self._prompt_cursors else None
            out = self.runner.run(batch, self.pool, record=self._record, extra_rows=needed and needed.rows)
            if out.routing is not None:
                self.routing.fold_when_full()  # held routing, when due: host work while the GPU runs this forward
            marks.append(self.clock())
            launched = self._sample(batch, out, needed)
            self.scheduler.advance(batch)
        else:
            marks.append(marks[-1])
        if self.config.async_scheduling:
            launched, self._inflight = self._inflight, launched
        if launched is not None:
            finished += self._settle(launched)
        marks.append(self.clock())
        outputs = [self._output(s) for s in finished]
        self.last_observation = build_observation(
            step=self.num_steps, time_s=self._now(), pool=self.pool, scheduler=self.scheduler,
            kv_block_bytes=self.block_bytes, free_block_threshold=self.threshold,
            routing=self.routing if self._record else None,
            headroom_bytes=self.capacity.spare_bytes, inflight_bytes=int(self.table.in_flight_bytes().sum()))
        marks.append(self.clock())
        kv, moves = self.capacity.seconds, self._mover_seconds()
        self.last_loop = self.loop.step(self.last_observation)
        self.capacity.release(0)  # the whole blocks a plan's reservations took beyond its needs come back
        marks.append(self.clock())
        self.last_phases = StepPhases(*np.diff(marks).tolist())
        routing = self.last_observation.routing
        self.last_plan_costs = PlanCosts(0.0 if routing is None else routing.seconds, self._mover_seconds() - moves,
                                         self.capacity.seconds - kv)
        self.num_steps += 1
        return outputs

    def _sample(self, batch: ScheduledBatch, out: StepOutput, needed: prompt_logprobs.PromptRows | None) -> _Launched:
        """Queue the batch's sampling (and log-probabilities, the prompts' among them) on the device and the tokens'
        copy to the host; with asynchronous scheduling the runner keeps them for the next forward."""
        logits = out.logits
        sampling = [self._requests[e.seq.seq_id] for e in batch.entries if e.sample]
        params = [r.params for r in sampling]
        tokens = self.runner.sample(self._adjusted(logits, sampling), params,
                                    [None if r.draws is None else r.draws.next() for r in sampling])
        logprobs = logprobs_on_device(logits, params, tokens)
        if self.config.async_scheduling:
            self.runner.keep_sampled(tokens, [r.seq.seq_id for r in sampling])
        prompt = None
        if needed is not None:
            prompt = prompt_logprobs.on_device(self.model.logits, out.extra_hidden, needed)
            for rid, cursor in needed.cursors().items():  # asked now: a recompute does not ask again
                seq = self._requests[rid].seq
                if cursor < seq.prompt_len - 1:
                    self._prompt_cursors[rid] = cursor
                else:
                    del self._prompt_cursors[rid]
                    seq.share_cached_prefix = True
        return _Launched(batch, sampling, *to_host(tokens), logprobs, out.routing, prompt)

    def _settle(self, launched: _Launched) -> list[Sequence]:
        """Wait for a launched batch's tokens and settle them: routing observed, tokens in place, stops applied,
        log-probabilities, first-token times and `last_tokens` kept. A request that finished since it was launched
        (stopped by the token settled before, or aborted) gets nothing from it."""
        if launched.ready is not None:
            launched.ready.synchronize()
        sampling, batch = launched.sampling, launched.batch
        live = [not r.seq.is_finished for r in sampling]
        self.num_generated_tokens += sum(live)
        if launched.routing is not None:
            self._observe_routing(batch, launched.routing.arrays())
        if launched.prompt is not None:
            for rid, records in launched.prompt.records():
                if rid in self._requests:  # not aborted since
                    self._requests[rid].prompt_logprobs += records
        finished = self.scheduler.settle(batch, launched.tokens.tolist(), stop=self._stop_string)
        if launched.logprobs is not None:
            for r, ok, rec in zip(sampling, live, launched.logprobs.records([r.params for r in sampling])):
                if ok and rec is not None:  # asked for: one record per token settled
                    r.logprobs.append(rec)
        now = self._now()
        for r, ok in zip(sampling, live):
            if ok:
                self.last_tokens.append((r.seq.seq_id, now))
                if r.first_token_time is None:
                    r.first_token_time = now
        return finished

    def generate(self, prompts: Seq[str | Seq[int]], params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Run `prompts` to completion (continuously batched); outputs in the order of `prompts`."""
        if isinstance(prompts, str):
            raise TypeError("generate takes a list of prompts; wrap a single prompt in a list")
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(plist)} sampling params")
        ids: list[int] = []
        try:
            for p, sp in zip(prompts, plist):
                ids.append(self.add_request(p, sp))
        except Exception:
            for rid in ids:  # all or nothing: drop the prompts already queued
                self.abort(rid)
            raise
        wanted, results = set(ids), {}
        from tqdm import tqdm
        with tqdm(total=len(ids), desc="generating", unit="req", disable=not use_tqdm) as bar:
            while len(results) < len(ids):
                for out in self.step():
                    if out.request_id in wanted:
                        results[out.request_id] = out
                        bar.update(1)
                    else:
                        self.unclaimed.append(out)
        return [results[i] for i in ids]

    # ---------------------------------------------------------------- helpers
    def _now(self) -> float:
        return self.clock() - self.t0

    def _observe_routing(self, batch: ScheduledBatch, r: RoutingArrays) -> None:
        # held, and folded with the steps around it while a forward runs on the GPU (or when a planner reads it)
        self.routing.add([e.seq.seq_id for e in batch.entries], r.query_lens, r.topk_ids, r.topk_weights,
                         r.gate_up_in_norm, r.down_in_norm)
        self.routing.drop_stopped(e.seq for e in batch.entries)
        if self.recorder is not None:
            self.recorder.on_routing([(e.seq.seq_id, e.start, e.num_new_tokens) for e in batch.entries], r)

    def _adjusted(self, logits: torch.Tensor, sampling: list[_Request]) -> torch.Tensor:
        """The logits the requests sample from (pwruntime.sampling.adjust_logits); the histories are built only
        when a request asks for the processing."""
        if not any(r.params.adjusts_logits for r in sampling):
            return logits
        return adjust_logits(logits, [r.params for r in sampling],
                             [History(r.seq.prompt_token_ids, r.seq.output_token_ids, r.stop_ids) for r in sampling])

    def _stop_string(self, seq: Sequence) -> str | None:
        req = self._requests[seq.seq_id]
        stops = req.params.stop
        if not stops:
            return None
        settled = seq.num_settled_outputs
        text = self.tokenizer.decode(seq.output_token_ids[:settled])
        k = find_stop(text, stops, req.checked_chars - max(len(s) for s in stops) + 1)
        req.checked_chars = len(text)
        if k < 0 or settled <= req.params.min_tokens:  # as vLLM: none before min_tokens + 1
            return None
        if req.params.include_stop_str_in_output:
            k += max(len(s) for s in stops if text.startswith(s, k))
        req.stop_text = text[:k]
        return "stop"

    def tokens_so_far(self, request_id: int, start: int = 0) -> list[int]:
        """Tokens sampled so far for an unfinished request, from the `start`th (what a streaming server sends)."""
        req = self._requests.get(request_id)
        return [] if req is None else req.seq.output_token_ids[start:req.seq.num_settled_outputs]

    def logprobs_so_far(self, request_id: int, start: int = 0) -> list[TokenLogprob]:
        """The log-probability records of `tokens_so_far` (empty when the request did not ask for them)."""
        req = self._requests.get(request_id)
        return [] if req is None else req.logprobs[start:]

    def prompt_of(self, request_id: int) -> PromptOutput | None:
        """An unfinished request's prompt, with its prompt records so far (all of them once it has a token)."""
        req = self._requests.get(request_id)
        if req is None:
            return None
        return PromptOutput(req.prompt, list(req.seq.prompt_token_ids), tuple(req.prompt_logprobs))

    def _output(self, seq: Sequence) -> RequestOutput:
        req = self._requests.pop(seq.seq_id)
        self._prompt_cursors.pop(seq.seq_id, None)
        self.routing.drop(seq.seq_id)
        ids = list(seq.output_token_ids)
        if req.stop_text is not None:
            text = req.stop_text
        else:
            shown = ids[:-1] if seq.finish_reason == "stop" and ids and ids[-1] in req.stop_ids else ids
            text = self.tokenizer.decode(shown)
        if self.recorder is not None:
            self.recorder.on_finish(seq.seq_id, len(ids))
        return RequestOutput(seq.seq_id, req.prompt, list(seq.prompt_token_ids or []), ids, text,
                             seq.finish_reason or "abort", seq.num_preemptions, req.arrival_time,
                             req.first_token_time, self._now(), tuple(req.logprobs), tuple(req.prompt_logprobs),
                             seq.first_scheduled_time)

    def _mover_seconds(self) -> float:
        """Host time the page mover has spent so far (0 for one that keeps no such count)."""
        stats = getattr(self.loop.mover, "stats", None)
        return float(getattr(stats, "host_seconds", 0.0))
