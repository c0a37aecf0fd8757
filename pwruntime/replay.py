"""Trace replay on the runtime: a request trace's arrivals served in real time, timed as `pwsim run` times them.

`replay(engine, trace)` adds each request of a `traces.schema.RequestTrace` (its recorded prompt token ids; its
recorded output length, forced with ignore_eos) once the wall clock reaches its arrival time, steps the engine
whenever it has work and sleeps until the next arrival when it has none. Before its clock starts the engine captures
every CUDA graph it may replay, as `pwruntime serve` does before its first request (a replay measures that server, not
its start-up), then runs an optional untimed warm-up on the trace's first prompts. It records what the simulator records
for the same trace: per request the arrival, first-token and finish times (seconds from the trace's start) and
the gaps between its tokens (`traces.results.TokenGaps`, from the engine's `last_tokens`), per
iteration its end, duration, tokens and the committed mean bits, the engine's own phase times (`StepPhases`: schedule,
forward, sample, observe, plan), averaged per decode-only and mixed iteration in the summary's `phase_ms`, and whether
the step's planner read the routing statistics (`routing_read`; `pwsim fidelity` measures their cost from it) and
three parts of its plan phase (`PlanCosts`: `plan_read_s`, `plan_moves_s`, `plan_kv_s`; their means over the planning
steps in the summary's `plan_ms`), and every transition its plan loop began, refused or landed (`policies.plan_log`,
the simulator's log too); on CUDA the summary's `gpu_memory` says what the device held
(pwruntime.cuda_memory.memory_report), to set beside the memory budget. `ReplayResult` holds those columns and a
summary with `pwsim run`'s metric names; `pwruntime replay` writes them as a result directory (`traces.results`) for
`pwsim fidelity`. An engine with a trace recorder also gives the routing its forwards computed for the replayed
requests, under the trace's request ids, and apart from it the routing the warm-up computed for the trace's first
prompts: the simulator replays exactly the routing the runtime planned with.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import astuple, dataclass, field

import numpy as np

from policies.plan_log import PlanLog
from traces.clikit import UserError, check_time_scale
from pwruntime.cuda_memory import memory_report
from pwruntime.engine import PlanCosts, StepPhases
from pwruntime.sampling import SamplingParams
from pwruntime.stats_log import lut_room
from traces.results import WARMUP_TOKENS, TokenGaps, request_columns, request_summary, stats
from traces.schema import RequestTrace, RoutingTrace


@dataclass
class ReplayResult:
    requests: dict[str, np.ndarray]  # per request, in trace order
    timeline: dict[str, np.ndarray]  # per engine iteration
    summary: dict
    plans: dict[str, np.ndarray] = field(default_factory=dict)  # policies.plan_log columns: a row a transition
    routing: RoutingTrace | None = None  # what the engine's recorder saw of the replayed requests
    warmup_routing: RoutingTrace | None = None  # and of the warm-up's (the trace's first prompts, served before)


def warm_up(engine, trace: RequestTrace, requests: int) -> list[int]:
    """Serve the first `requests` prompts of the trace at once, untimed, for up to WARMUP_TOKENS tokens each: the
    runtime's one-off costs that graphs do not cover (first launches, allocations) and the pressure those prompts
    make then fall outside the replay. Returns the engine's ids of those requests, in trace order."""
    k = min(requests, len(trace))
    if not k:
        return []
    outputs = engine.generate([trace.prompt_ids(i).tolist() for i in range(k)],
                              [SamplingParams(max_tokens=min(WARMUP_TOKENS, int(trace.output_tokens[i])),
                                              ignore_eos=True) for i in range(k)])
    return [o.request_id for o in outputs]


def replay(engine, trace: RequestTrace, *, time_scale: float = 1.0, warmup_requests: int = 0,
           sleep: Callable[[float], None] = time.sleep, progress: bool = False) -> ReplayResult:
    """Serve `trace` on `engine` (fresh: nothing queued) in real time; arrival times are multiplied by `time_scale`.
    The engine's CUDA graphs are captured first (`LLMEngine.capture_graphs`: a budget's pool gives up what they and the
    runner hold); then, with `warmup_requests`, `warm_up` runs (it leaves the engine's routing statistics fed with its
    tokens) before the clock starts."""
    if trace.token_ids is None:
        raise UserError(f"{trace.source} has no prompt token ids (prompt_token_ids); replay needs the prompts "
                        "themselves: record the trace with `pwruntime record-trace`")
    vocab = engine.model.config.vocab
    if trace.token_ids.size and not 0 <= int(trace.token_ids.min()) <= int(trace.token_ids.max()) < vocab:
        raise UserError(f"{trace.source} has prompt token ids outside the model's vocabulary (0..{vocab - 1}): it was "
                        "recorded with another model's tokenizer; replay it with that model (--model or --ap)")
    check_time_scale(time_scale)
    if engine.has_unfinished():
        raise ValueError("replay needs an engine with no queued requests")
    if warmup_requests < 0:
        raise UserError(f"--warmup-requests must be >= 0, got {warmup_requests}")
    engine.capture_graphs()  # before the warm-up and the clock, as a server captures them before its first request
    kv_blocks_start = engine.pool.capacity  # what the budget leaves the pool beside the graphs' memory
    warmed = warm_up(engine, trace, warmup_requests)
    first_step, first_resize = engine.num_steps, engine.kv.generation

    n = len(trace)
    arrival = np.asarray(trace.arrival_s, dtype=np.float64) * time_scale
    outputs: dict[int, object] = {}
    index: dict[int, int] = {}  # engine request id -> trace row
    timeline: list[tuple] = []
    plan_log = PlanLog()
    mean_bits = engine.table.mean_bits
    gaps = TokenGaps(n)
    engine.t0 = engine.clock()  # the engine's clock is the trace's from here on
    nxt = 0
    from tqdm import tqdm

    with tqdm(total=int(trace.output_tokens.sum()), unit="tok", desc="replaying", disable=not progress) as bar:
        while nxt < n or engine.has_unfinished():
            now = engine.clock() - engine.t0
            while nxt < n and arrival[nxt] <= now:
                params = SamplingParams(max_tokens=int(trace.output_tokens[nxt]), ignore_eos=True)
                rid = engine.add_request(trace.prompt_ids(nxt).tolist(), params, arrival_time=float(arrival[nxt]),
                                         domain=str(trace.domain[nxt]))
                index[rid] = nxt
                nxt += 1
            if not engine.has_unfinished():
                sleep(max(0.0, float(arrival[nxt]) - (engine.clock() - engine.t0)))
                continue
            start = engine.clock() - engine.t0
            for out in engine.step():
                outputs[out.request_id] = out
                bar.update(len(out.token_ids))
            end = engine.clock() - engine.t0
            b = engine.last_batch
            timeline.append((end, engine.num_steps - 1, end - start, b.num_tokens, b.num_decode_tokens,
                             len(b.entries), len(engine.scheduler.running), len(engine.scheduler.waiting),
                             engine.pool.capacity, engine.pool.num_free, mean_bits(), *astuple(engine.last_phases),
                             int(engine.last_routing_read), len(engine.last_loop.started) if engine.last_loop else 0,
                             *astuple(engine.last_plan_costs)))
            if engine.last_loop is not None:
                plan_log.add(engine.num_steps - 1, end, engine.last_loop, engine.table)
            rows = np.fromiter((index.get(rid, -1) for rid, _ in engine.last_tokens), np.int64)
            times = np.fromiter((t for _, t in engine.last_tokens), np.float64)
            gaps.settled(rows[rows >= 0], times[rows >= 0])
    result = _result(trace, arrival, outputs, index, timeline, engine, gaps)
    result.plans = plan_log.columns()
    result.summary["warmup_steps"] = first_step
    result.summary["kv_blocks_start"] = kv_blocks_start
    result.summary["kv_resizes"] = engine.kv.generation - first_resize  # the KV cache's, since the clock started
    result.summary["kv_grow_failures"] = engine.capacity.grow_failures  # growths the device had no memory for
    result.summary["gpu_memory"] = memory_report(engine.kv.device, engine.capacity.mapped_memory())  # None off CUDA
    if engine.recorder is not None:
        result.routing = engine.recorder.routing_trace({rid: int(trace.request_id[row]) for rid, row in index.items()})
        if warmed:
            result.warmup_routing = engine.recorder.routing_trace(
                {rid: int(trace.request_id[row]) for row, rid in enumerate(warmed)})
    return result


TIMELINE = ("time_s", "step", "iter_s", "batch_tokens", "decode_tokens", "batch_seqs", "running", "waiting",
            "total_blocks", "free_blocks", "mean_bits", *StepPhases.PHASES, "routing_read", "plan_transitions",
            *(f"plan_{part}" for part in PlanCosts.PARTS))


def _result(trace, arrival, outputs, index, timeline, engine, gaps: TokenGaps) -> ReplayResult:
    n = len(trace)
    first, finish, scheduled = np.full(n, np.nan), np.full(n, np.nan), np.full(n, np.nan)
    out_tokens = np.zeros(n, dtype=np.int64)
    preempt = np.zeros(n, dtype=np.int64)
    reason = np.full(n, "", dtype=object)
    for rid, o in outputs.items():
        i = index[rid]
        first[i] = np.nan if o.first_token_time is None else o.first_token_time
        scheduled[i] = np.nan if o.first_scheduled_time is None else o.first_scheduled_time
        finish[i], out_tokens[i], preempt[i], reason[i] = o.finish_time, len(o.token_ids), o.num_preemptions, o.finish_reason
    requests = request_columns(trace.request_id, trace.domain, arrival, trace.prompt_tokens, out_tokens, first, finish,
                               preempt, reason, first_scheduled_s=scheduled, max_itl_s=gaps.max_s)
    tl = {c: np.array([row[k] for row in timeline]) for k, c in enumerate(TIMELINE)}
    iters = np.asarray(tl["iter_s"], dtype=np.float64)
    is_decode = np.asarray(tl["batch_tokens"]) == np.asarray(tl["decode_tokens"])
    summary = {
        **request_summary(requests, gaps.all()), "iterations": len(timeline),
        "computed_tokens": int(np.asarray(tl["batch_tokens"]).sum()) if timeline else 0,
        "iteration_s": stats(iters), "decode_iteration_s": stats(iters[is_decode]),
        "preemptions": int(engine.scheduler.num_preemptions),
        "routing_reads": int(np.asarray(tl["routing_read"]).sum()) if timeline else 0,
        "mean_committed_bits_end": float(engine.table.mean_bits()), "plans": int(engine.loop.num_plans),
        "lut_room": lut_room(engine),  # where its offloads' LUTs found room (pwsim fidelity checks the simulation's)
        "phase_ms": {kind: {p[:-2]: round(1e3 * float(np.mean(np.asarray(tl[p])[sel])), 4) for p in StepPhases.PHASES}
                     for kind, sel in (("decode", is_decode), ("mixed", ~is_decode)) if sel.any()},
        "plan_ms": _plan_ms(tl),
    }
    return ReplayResult(requests, tl, summary)


def _plan_ms(tl: dict) -> dict | None:
    """The plan phase of the steps that began transitions, in milliseconds a step: in all, its parts (`PlanCosts`) and
    the rest (the planner's decisions, the loop's bookkeeping); and the page moves and KV resizes of every step, in
    microseconds a transition begun (`per_transition_us`: a transition lands at a later boundary, often a step that
    begins none, so the planning steps' share leaves its landing out; `pwruntime bench plans` counts both); None when
    no step planned."""
    transitions = np.asarray(tl["plan_transitions"])
    planning = transitions > 0
    if not planning.any():
        return None
    mean = {"plan": float(np.mean(np.asarray(tl["plan_s"])[planning]))}
    for part in PlanCosts.PARTS:
        mean[part[:-2]] = float(np.mean(np.asarray(tl[f"plan_{part}"])[planning]))
    mean["other"] = mean["plan"] - sum(mean[part[:-2]] for part in PlanCosts.PARTS)
    began = int(transitions.sum())
    per_transition = {part: round(1e6 * float(np.sum(tl[f"plan_{part}_s"])) / began, 3) for part in ("moves", "kv")}
    return {"steps": int(planning.sum()), "transitions_per_step": float(np.mean(transitions[planning])),
            **{k: round(1e3 * v, 4) for k, v in mean.items()}, "per_transition_us": per_transition}
