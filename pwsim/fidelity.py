"""Fidelity: how well a simulated run predicts the runtime serving the same trace, request by request.

`compare(sim, runtime)` takes two result directories' contents (`traces.results.read_result_dir`: a
`pwsim run` and a `pwruntime replay` of one request trace), pairs their requests by request_id and
reports, per latency metric (TTFT, TPOT, end to end), the ratio sim / runtime (median, p10, p90) and
the median absolute relative error; the ratios of throughput and makespan; where both summaries have them, each
side's gaps between consecutive tokens (`itl`: p50, p99, max, and their ratios); the planner's plans and
the scheduler's preemptions on each side; and a least-squares fit
`iteration seconds = a + b * tokens` on each side: the intercepts are the per-iteration overhead each
engine pays, the slopes the cost of a token. Their gaps (`overhead_gap_us`, `per_token_gap_us`) are
what a hardware profile's `iteration_overhead_us` and `token_overhead_us` would need added to match
the runtime (the runtime of a small model is bound by the host, which the cost model's roofline does
not see); `fitted_profile` adds them. Where both timelines give each iteration's sequences and their sizes tell the
terms apart, the fit `a + c * sequences + b * tokens` too (`iterations.per_sequence`): a decode step's host work
grows with its sequences, a mixed step's far less with its prompt tokens, which one slope cannot hold;
`fitted_profile(per_sequence=True)` adds its three gaps, `sequence_overhead_us` among them. Where both timelines
record each iteration's decode tokens, the decode-only and the mixed iterations are also compared apart
(`iterations.by_kind`: count, mean time, mean tokens), which shows which kind of step a fit gets wrong. A replay
that records which steps' planners read the routing statistics (`routing_read`) also gives their cost: the mean
plan phase of those steps minus that of the others (`routing_reads.plan_gap_us`), which `fitted_profile` takes as
`routing_read_us` (the simulator charges it after each boundary whose planner read them, and counts them:
`counters.routing_reads`); a replay that also records each step's plan transitions splits that into a read's fixed
cost and a transition's (`routing_reads.read_us`, `transition_us`: `routing_read_us` and `plan_transition_us`).
Where the replay records its plans' transitions and the simulation the planning it charged each step (`plan_s`),
the iteration fits leave each side's planning out (`host_timelines`; `iterations.net_of_planning`), so a fitted
profile charges a runtime's planning once, as reads and transitions.
`one_off_steps` finds a run's steps far longer than the typical step of their kind and size: on the runtime, the
first step of each new batch shape launches its kernels for the first time (and, in replays before session 39,
captured its graphs or compiled its kernels) inside the clock of a replay without a warm-up, which the simulator does
not charge; the report gives their excess
and the throughput ratio without it (`throughput_ratio_without_one_off`). `lut_room` is where each side's offloads
found room for their lower LUTs (`--lut-room`; the runtime's as its engine had it: a pool sized by blocks has no
slack; results before session 38: the pool), and `activation_reserve` what each kept out of its pool for a step's
activations (`--activation-reserve`), the runtime's CUDA graphs and buffers included (`serving_reserve`).
`decisions` compares the two engines step by step: over the steps both timelines record, how many scheduled the
same batch, held the same KV pool and bits and began as many plan transitions, and the first step that did not.
Both engines share their scheduler, KV pool and planners (policies/), so with the same arrivals (all at once:
`--time-scale 0`) and the same routing (`pwruntime replay --record-routing`) they differ only where time enters:
when the runtime's page copies land against the simulator's link (the CPU runtime's land at once, as the simulator's
do with `--instant-page-moves`).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from policies.plan_log import STATUSES
from pwsim.plan_stats import summarize
from traces.clikit import UserError
from traces.results import instant_page_moves, kept_out_of_pool, percentile

METRICS = ("ttft_s", "tpot_s", "e2e_s")


@dataclass(frozen=True)
class RunView:
    """What fidelity reads of one result directory."""
    summary: dict
    requests: dict[str, np.ndarray]
    timeline: dict[str, np.ndarray]
    config: dict = field(default_factory=dict)
    plans: dict[str, np.ndarray] = field(default_factory=dict)  # the plan log (`traces.results.read_plan_log`)


def _pair(sim: RunView, rt: RunView) -> tuple[np.ndarray, np.ndarray]:
    """Row indices (into sim, into runtime) of the requests both ran, in runtime order."""
    s_ids, r_ids = np.asarray(sim.requests["request_id"]), np.asarray(rt.requests["request_id"])
    where = {int(r): k for k, r in enumerate(s_ids)}
    si = np.array([where.get(int(r), -1) for r in r_ids], dtype=np.int64)
    keep = si >= 0
    if not keep.any():
        raise UserError("the two runs share no request_id: give a `pwsim run` and a `pwruntime replay` of the same "
                        "trace")
    return si[keep], np.nonzero(keep)[0]


def metric_report(sim_v: np.ndarray, rt_v: np.ndarray) -> dict:
    ok = np.isfinite(sim_v) & np.isfinite(rt_v) & (rt_v > 0)
    s, r = sim_v[ok], rt_v[ok]
    ratio = s / r
    return {"pairs": int(ok.sum()), "sim_p50": percentile(s, 50), "runtime_p50": percentile(r, 50),
            "ratio_p50": percentile(ratio, 50), "ratio_p10": percentile(ratio, 10), "ratio_p90": percentile(ratio, 90),
            "median_abs_rel_error": percentile(np.abs(ratio - 1.0), 50)}


def _full_rank_fit(y: np.ndarray, *columns: np.ndarray) -> list[float] | None:
    """Least squares y = c0 + c1 * columns[0] + ...; None where the columns cannot tell their terms apart."""
    design = np.stack([np.ones_like(y), *columns], axis=1)
    coef, _, rank, _ = np.linalg.lstsq(design, y, rcond=None)
    return [float(v) for v in coef] if rank == design.shape[1] else None


def batch_seqs(timeline: dict[str, np.ndarray]) -> np.ndarray | None:
    """Each iteration's scheduled sequences: the timeline's `batch_seqs`, or for older results its decode tokens plus
    one for a step with prompt tokens (most of the demo's mixed steps hold one prompt chunk); None without either."""
    if "batch_seqs" in timeline:
        return np.asarray(timeline["batch_seqs"], dtype=np.float64)
    if "decode_tokens" not in timeline:
        return None
    decode = np.asarray(timeline["decode_tokens"], dtype=np.float64)
    return decode + (np.asarray(timeline["batch_tokens"], dtype=np.float64) > decode)


def iteration_fit(timeline: dict[str, np.ndarray], per_seq: bool = False) -> dict:
    """Least squares iter_s = a + b * batch_tokens over a run's iterations, and with `per_seq` (the timeline has
    `batch_seqs` or can estimate them) iter_s = a + c * batch_seqs + b * batch_tokens: a decode step's sequences
    and a mixed step's prompt tokens cost the host differently. Where the sizes cannot tell the sequence term from
    the token term (decode steps only), the first form, with `per_seq_s` None; where they cannot tell even the
    token term (one size), the median iteration as the intercept. `per_seq_s` is in the result with `per_seq`
    only."""
    t = np.asarray(timeline.get("iter_s", []), dtype=np.float64)
    x = np.asarray(timeline.get("batch_tokens", []), dtype=np.float64)
    seqs = batch_seqs(timeline) if per_seq else None
    ok = np.isfinite(t) & (x > 0)
    t, x = t[ok], x[ok]
    a = b = c = None
    if seqs is not None and t.size >= 3:
        a, c, b = _full_rank_fit(t, seqs[ok], x) or (None, None, None)
    if a is None and t.size >= 2 and np.ptp(x) > 0:
        b, a = (float(v) for v in np.polyfit(x, t, 1))
    if a is None and t.size:
        a = float(np.median(t))
    return {"iterations": int(t.size), "intercept_s": a, "per_token_s": b, "median_iter_s": percentile(t, 50)} | (
        {"per_seq_s": c} if per_seq else {})


def iteration_kinds(timeline: dict[str, np.ndarray]) -> dict | None:
    """A run's decode-only iterations (every token a decode) and mixed ones (prompt tokens among them): per kind the
    count, mean iteration time and mean tokens; None when the timeline lacks `decode_tokens` (older results)."""
    if "decode_tokens" not in timeline:
        return None
    t = np.asarray(timeline.get("iter_s", []), dtype=np.float64)
    tokens = np.asarray(timeline.get("batch_tokens", []), dtype=np.int64)
    ran = tokens > 0
    decode = (tokens == np.asarray(timeline["decode_tokens"], dtype=np.int64)) & ran
    out = {}
    for kind, rows in (("decode", decode), ("mixed", ran & ~decode)):
        out[kind] = {"iterations": int(rows.sum()), "mean_iter_s": float(t[rows].mean()) if rows.any() else None,
                     "mean_tokens": float(tokens[rows].mean()) if rows.any() else None}
    return out


ONE_OFF_FACTOR = 4.0  # a step this many times the median step of its kind and size ...
ONE_OFF_MIN_S = 0.02  # ... and this much longer is one-off work (a graph capture, a first launch, a compile)


def one_off_steps(timeline: dict[str, np.ndarray]) -> dict | None:
    """A run's steps far longer than the median step of their kind (decode or mixed) among the steps whose tokens
    are within a factor of two of theirs (`ONE_OFF_FACTOR` times it and `ONE_OFF_MIN_S` more): their count, the seconds
    they took beyond those medians and that excess's share of the run's iteration time; None without decode_tokens.
    A size whose every step is one-off (a shape seen once) shows none: the count is a floor."""
    if "decode_tokens" not in timeline:
        return None
    t = np.asarray(timeline.get("iter_s", []), dtype=np.float64)
    tokens = np.asarray(timeline.get("batch_tokens", []), dtype=np.int64)
    decode = tokens == np.asarray(timeline["decode_tokens"], dtype=np.int64)
    key = 2 * np.floor(np.log2(np.maximum(tokens, 1))).astype(np.int64) + decode
    excess = np.zeros_like(t)
    for k in np.unique(key[tokens > 0]):
        rows = (key == k) & (tokens > 0)
        typical = float(np.median(t[rows]))
        over = rows & (t > ONE_OFF_FACTOR * typical) & (t - typical > ONE_OFF_MIN_S)
        excess[over] = t[over] - typical
    total = float(t.sum())
    return {"steps": int((excess > 0).sum()), "excess_s": float(excess.sum()),
            "share": float(excess.sum()) / total if total > 0 else 0.0}


def _without_one_off(sim: RunView, runtime: RunView, one_off: dict | None) -> float | None:
    """Sim / runtime throughput had the runtime's one-off excess not delayed its makespan (an estimate: every later
    step moves up by it, as a load that is all at once or queued does)."""
    tokens, makespan = runtime.summary.get("output_tokens"), runtime.summary.get("makespan_s")
    if not one_off or not one_off["steps"] or not tokens or not makespan or makespan <= one_off["excess_s"]:
        return None
    return _ratio(sim.summary.get("throughput_tokens_per_s"), tokens / (makespan - one_off["excess_s"]))


def lut_room_of(view: RunView, simulated: bool) -> str | None:
    """Where a run's offloads found room for their lower LUTs: a simulation's `--lut-room`, a replay's as its engine
    had it (`lut_room` in its summary), a served run's as its server said; "pool" for results from before the choice
    (session 38); None where a served run's server did not say."""
    if simulated:
        return view.config.get("lut_room", "pool")
    if "lut_room" in view.summary:
        return view.summary["lut_room"]
    if "server" in view.config:  # a served run (`pwruntime bench serve`): what its server's /server_info said
        return view.config.get("lut_room")
    return "pool"


# the timeline columns that record what an engine decided at a step (not how long it took)
DECISION_COLUMNS = ("batch_tokens", "batch_seqs", "running", "waiting", "total_blocks", "free_blocks", "mean_bits",
                    "plan_transitions")


def decisions(sim_timeline: dict[str, np.ndarray], runtime_timeline: dict[str, np.ndarray]) -> dict | None:
    """Over the steps both timelines record (joined on `step`), how many agree in every decision column both have,
    and the first that does not with the columns it differs in; None where the timelines share no such column."""
    cols = [c for c in DECISION_COLUMNS if c in sim_timeline and c in runtime_timeline]
    if not cols or "step" not in sim_timeline or "step" not in runtime_timeline:
        return None
    steps, si, ri = np.intersect1d(np.asarray(sim_timeline["step"]), np.asarray(runtime_timeline["step"]),
                                   return_indices=True)
    equal = {c: np.isclose(np.asarray(sim_timeline[c], dtype=np.float64)[si],
                           np.asarray(runtime_timeline[c], dtype=np.float64)[ri], rtol=0.0, atol=1e-6) for c in cols}
    agree = np.logical_and.reduce([equal[c] for c in cols]) if steps.size else np.zeros(0, dtype=bool)
    first = np.flatnonzero(~agree)
    differ = [] if not first.size else [c for c in cols if not equal[c][first[0]]]
    return {"steps": int(steps.size), "agreeing_steps": int(agree.sum()), "columns": cols,
            "first_difference": None if not first.size else int(steps[first[0]]), "differing_columns": differ,
            # each differing column there: [simulated, runtime]
            "values": {c: [float(sim_timeline[c][si[first[0]]]), float(runtime_timeline[c][ri[first[0]]])]
                       for c in differ}}


PLAN_KEY = ("step", "block", "from_bits", "to_bits", "status")  # what makes two plan-log rows the same event


def transitions(sim: RunView, runtime: RunView) -> dict | None:
    """Transition by transition, over the steps both timelines record: each engine's rows by status (begun, refused,
    landed), how many rows the other engine has too (the same step, block, bits and status), and the first step with a
    row only one of them has, with those rows there (up to five a side). None where either run wrote no plan log."""
    if not sim.plans or not runtime.plans or "step" not in sim.timeline or "step" not in runtime.timeline:
        return None
    last = min(int(np.max(sim.timeline["step"], initial=-1)), int(np.max(runtime.timeline["step"], initial=-1)))

    def rows(log: dict) -> set[tuple]:
        keep = np.asarray(log["step"]) <= last
        return set(zip(*(np.asarray(log[c])[keep].tolist() for c in PLAN_KEY)))

    s, r = rows(sim.plans), rows(runtime.plans)
    only = (s - r) | (r - s)
    first = min(row[0] for row in only) if only else None

    def at_first(own: set) -> list[dict]:
        return [dict(zip(PLAN_KEY, row)) for row in sorted(own & only) if row[0] == first][:5]

    def by_status(own: set) -> dict[str, int]:
        return {st: sum(row[4] == st for row in own) for st in STATUSES}

    return {"sim": by_status(s), "runtime": by_status(r), "alike": len(s & r), "rows": len(s | r),
            "first_difference": first, "sim_only": at_first(s), "runtime_only": at_first(r)}


def _count(summary: dict, key: str) -> int | None:
    """A run's count of `key` (plans, preemptions): pwsim nests plans in a dict, the replay does not."""
    v = summary.get(key)
    if isinstance(v, dict):
        v = v.get(key)
    return None if v is None else int(v)


def inter_token_latency(sim: dict, runtime: dict) -> dict | None:
    """Each side's gaps between consecutive tokens (`itl_s`: p50, p99, max) and the sim / runtime ratios of p50 and
    p99; None where a summary lacks them (runs before session 57)."""
    a, b = sim.get("itl_s"), runtime.get("itl_s")
    if not a or not b:
        return None
    keep = ("p50", "p99", "max")
    return {"sim": {k: a[k] for k in keep}, "runtime": {k: b[k] for k in keep},
            "ratio_p50": _ratio(a["p50"], b["p50"]), "ratio_p99": _ratio(a["p99"], b["p99"])}


def _ratio(a, b) -> float | None:
    return float(a) / float(b) if a is not None and b not in (None, 0) else None


def plan_terms(reads: dict) -> tuple[float, float] | None:
    """(microseconds a routing read, a plan transition) that a fitted profile charges for planning, from the plan
    phase's two-term fit (`routing_read_cost`); None where the replay does not record its plans' transitions."""
    if reads.get("transition_us") is None:
        return None
    return max(0.0, reads["read_us"]), max(0.0, reads["transition_us"])


def _net_of_planning(timeline: dict[str, np.ndarray], planning_s: np.ndarray) -> dict[str, np.ndarray]:
    return {**timeline, "iter_s": np.asarray(timeline["iter_s"], dtype=np.float64) - planning_s}


def host_timelines(sim: RunView, runtime: RunView, reads: dict) -> tuple[dict, dict, bool]:
    """The two timelines the host-cost fits read, and whether planning was taken out of them. Where the simulator
    records the planning it charged each iteration (`plan_s`) and the runtime's plan phase gives the terms a fitted
    profile charges for planning (`plan_terms`), each iteration's time less that planning: the simulator's own
    charge, the runtime's reads and transitions at those terms (what else its plan phase does stays in the step).
    Else the iteration and token terms would absorb the runtime's planning, which the fitted profile charges again
    as reads and transitions (twice, where planning is a large part of a step)."""
    terms = plan_terms(reads)
    if terms is None or "plan_s" not in sim.timeline:
        return sim.timeline, runtime.timeline, False
    read = np.asarray(runtime.timeline["routing_read"], dtype=np.float64)
    moves = np.asarray(runtime.timeline["plan_transitions"], dtype=np.float64)
    return (_net_of_planning(sim.timeline, np.asarray(sim.timeline["plan_s"], dtype=np.float64)),
            _net_of_planning(runtime.timeline, (read * terms[0] + moves * terms[1]) * 1e-6), True)


def compare(sim: RunView, runtime: RunView) -> dict:
    paired = paired_columns(sim, runtime)
    per = {m: metric_report(*paired[m]) for m in METRICS}
    reads = routing_read_cost(runtime.timeline)
    sim_host, runtime_host, net = host_timelines(sim, runtime, reads)
    fit_s, fit_r = iteration_fit(sim_host), iteration_fit(runtime_host)
    one_off = {"sim": one_off_steps(sim.timeline), "runtime": one_off_steps(runtime.timeline)}
    return {
        "requests": {"sim": len(sim.requests["request_id"]), "runtime": len(runtime.requests["request_id"]),
                     "paired": len(paired[METRICS[0]][0])},
        "metrics": per,
        "throughput_ratio": _ratio(sim.summary.get("throughput_tokens_per_s"),
                                   runtime.summary.get("throughput_tokens_per_s")),
        "makespan_ratio": _ratio(sim.summary.get("makespan_s"), runtime.summary.get("makespan_s")),
        "itl": inter_token_latency(sim.summary, runtime.summary),
        "one_off_steps": one_off,
        "throughput_ratio_without_one_off": _without_one_off(sim, runtime, one_off["runtime"]),
        "lut_room": {"sim": lut_room_of(sim, True), "runtime": lut_room_of(runtime, False)},
        # the bytes each side kept out of its KV pool for a step's activations (`--activation-reserve`; absent from
        # results before session 53: none; None: a served run whose server did not say), the graphs' pools included
        "activation_reserve": {"sim": int(sim.config.get("activation_reserve_bytes") or 0),
                               "runtime": _kept_out(runtime.config)},
        "iterations": {"sim": fit_s, "runtime": fit_r, **_gaps(fit_s, fit_r), "net_of_planning": net,
                       "by_kind": {"sim": iteration_kinds(sim.timeline), "runtime": iteration_kinds(runtime.timeline)},
                       "per_sequence": per_sequence_fit(sim_host, runtime_host)},
        "planner": {k: {"sim": _count(sim.summary, k), "runtime": _count(runtime.summary, k)}
                    for k in ("plans", "preemptions")},
        # the KV cache's resizes after the warm-up (None: a result from before they were counted)
        "kv_resizes": {"sim": (sim.summary.get("counters") or {}).get("kv_resizes"),
                       "runtime": runtime.summary.get("kv_resizes")},
        "decisions": decisions(sim.timeline, runtime.timeline),
        "transitions": transitions(sim, runtime),
        # each planner's round trips (a block lowered, then raised again: `pwsim plan-log`) over its whole log
        "round_trips": ({"sim": summarize(sim.plans)["round_trips"], "runtime": summarize(runtime.plans)["round_trips"]}
                        if sim.plans and runtime.plans else None),
        # where the simulator's routing came from (`pwsim run`'s workload: "recorded routing" or synthetic)
        "sim_routing": (sim.summary.get("workload") or {}).get("routing"),
        "runtime_phase_ms": runtime.summary.get("phase_ms"),  # where a runtime iteration goes (replays that time it)
        "routing_reads": {"sim": int(sim.summary.get("counters", {}).get("routing_reads", 0)), **reads},
        # whether each side scheduled asynchronously (`--async-scheduling`; absent from older results: no; None: a
        # served run whose server did not say)
        "async_scheduling": {"sim": bool(sim.config.get("async_scheduling", False)),
                             "runtime": _setting(runtime.config, "async_scheduling", False)},
        # whether each side's page moves landed at the boundary that began them (`--instant-page-moves`, the CPU
        # runtime's; None: the runtime's result does not say)
        "instant_page_moves": {"sim": bool(sim.config.get("instant_page_moves", False)),
                               "runtime": instant_page_moves(runtime.summary)},
        # the scheduler limits each side ran with (None: not recorded)
        "scheduler": {key: {"sim": _setting(sim.config, sim_key, None), "runtime": _setting(runtime.config, key, None)}
                      for key, sim_key in SCHEDULER_KEYS.items()},
        # how many requests each side served before its clock started (`--warmup-requests`; absent: none)
        "warmup_requests": {"sim": int(sim.config.get("warmup_requests") or 0),
                            "runtime": int(runtime.config.get("warmup_requests") or 0)},
        # what each side multiplied the trace's arrival times by (`--time-scale`; absent: 1)
        "time_scale": {"sim": _time_scale(sim.config), "runtime": _time_scale(runtime.config)},
        # the rate each side re-timed the trace's requests at (`--request-rate`; None: their recorded times)
        "request_rate": {"sim": sim.config.get("request_rate"), "runtime": runtime.config.get("request_rate")},
        # the client's limit on requests in flight (`--max-concurrency` of `pwruntime bench serve` and `pwsim run`)
        "max_concurrency": {"sim": sim.config.get("max_concurrency"), "runtime": runtime.config.get("max_concurrency")},
    }


# the scheduler settings both engines take: the runtime's config key -> the simulator's
SCHEDULER_KEYS = {"max_num_seqs": "max_num_seqs", "max_num_batched_tokens": "max_num_batched_tokens",
                  "block_size": "block_size", "enable_prefix_caching": "prefix_caching", "hybrid_kv_cache": "hybrid_kv"}


def _kept_out(config: dict) -> int | None:
    """What a runtime result kept out of its KV pool beside the weights: the activation reserve and what its CUDA
    graphs and buffers took (`LLMEngine.serving_reserve`; absent before session 62: none)."""
    return None if _setting(config, "activation_reserve", 0) is None else kept_out_of_pool(config)


def _setting(config: dict, key: str, default):
    """A setting of a result's config: `default` where an older result lacks it, None where a served run's server
    did not say what it ran with (`pwruntime bench serve` against a server without /server_info)."""
    if key in config:
        return config[key]
    return None if config.get("target") == "serve" else default


def _gaps(fit_s: dict, fit_r: dict) -> dict:
    """What the runtime pays beyond the simulator, per term of the two fits (microseconds; None: not fitted)."""
    def gap(key: str) -> float | None:
        return None if None in (fit_r.get(key), fit_s.get(key)) else (fit_r[key] - fit_s[key]) * 1e6
    return {"overhead_gap_us": gap("intercept_s"), "per_token_gap_us": gap("per_token_s")} | (
        {"per_seq_gap_us": gap("per_seq_s")} if "per_seq_s" in fit_s else {})


def per_sequence_fit(sim_timeline: dict, runtime_timeline: dict) -> dict | None:
    """Both sides fitted with the per-sequence term, and its gaps; None where either timeline cannot give it (no
    sequences, or sizes that cannot tell a sequence from a token)."""
    if batch_seqs(sim_timeline) is None or batch_seqs(runtime_timeline) is None:
        return None
    fit_s, fit_r = iteration_fit(sim_timeline, True), iteration_fit(runtime_timeline, True)
    if None in (fit_s["per_seq_s"], fit_r["per_seq_s"]):
        return None
    return {"sim": fit_s, "runtime": fit_r, **_gaps(fit_s, fit_r)}


def _time_scale(config: dict) -> float:
    value = config.get("time_scale")
    return 1.0 if value is None else float(value)


def routing_read_cost(timeline: dict[str, np.ndarray]) -> dict:
    """The runtime's steps whose planner read the routing statistics and what reading cost: the mean plan phase of
    those steps minus that of the others (None when the replay lacks the record or either kind of step). Where the
    replay also records the transitions each step's plan started (`plan_transitions`), the plan phase fitted as
    `base + read * read_us + transitions * transition_us` over all steps: a plan's page moves cost per block, so a
    large plan's step costs more than a small one's (`read_us`, `transition_us`; None where the steps cannot tell
    the terms apart)."""
    if "routing_read" not in timeline or "plan_s" not in timeline:
        return {"runtime": None, "plan_gap_us": None, "read_us": None, "transition_us": None}
    read = np.asarray(timeline["routing_read"]).astype(bool)
    plan = np.asarray(timeline["plan_s"], dtype=np.float64)
    gap = float(plan[read].mean() - plan[~read].mean()) * 1e6 if read.any() and (~read).any() else None
    read_us = transition_us = None
    if "plan_transitions" in timeline and plan.size >= 3:
        fit = _full_rank_fit(plan, read.astype(np.float64), np.asarray(timeline["plan_transitions"], dtype=np.float64))
        if fit is not None:
            read_us, transition_us = fit[1] * 1e6, fit[2] * 1e6
    return {"runtime": int(read.sum()), "plan_gap_us": gap, "read_us": read_us, "transition_us": transition_us}


def paired_columns(sim: RunView, runtime: RunView) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """(sim, runtime) values of each metric for the paired requests (the plot's scatter)."""
    si, ri = _pair(sim, runtime)
    return {m: (np.asarray(sim.requests[m], dtype=np.float64)[si], np.asarray(runtime.requests[m], dtype=np.float64)[ri])
            for m in METRICS}


def fitted_profile(profile, report: dict, per_sequence: bool = False):
    """`profile` with the runtime's host costs: iteration_overhead_us plus the gap of the fitted intercepts,
    token_overhead_us plus the gap of the fitted per-token slopes (and with `per_sequence`, from the fits with the
    per-sequence term, sequence_overhead_us plus the gap of those slopes; each at least 0), and routing_read_us the
    measured cost of reading the routing statistics where the replay has steps that did and steps that did not
    (else the profile's own); where the replay records its plans' transitions, routing_read_us and
    plan_transition_us from the plan phase's fit (`routing_read_cost`), the other terms then fitted without the
    planning either side charged (`host_timelines`)."""
    it = report["iterations"]
    if per_sequence:
        it = it["per_sequence"]
        if it is None:
            raise UserError("cannot fit a per-sequence host cost: a run's timeline lacks each iteration's sequences "
                            "(batch_seqs or decode_tokens), or its steps cannot tell a sequence from a token (it "
                            "needs decode steps of several batch sizes and steps with prompt tokens)")
    gap, slope, per_seq = it["overhead_gap_us"], it["per_token_gap_us"], it.get("per_seq_gap_us")
    if gap is None or slope is None:
        raise UserError("cannot fit the host costs: a run has fewer than two iterations of different sizes")
    reads = report.get("routing_reads", {})
    read, per_transition = plan_terms(reads) or (reads.get("plan_gap_us"), None)
    seq_us = profile.sequence_overhead_us if per_seq is None else max(0.0, profile.sequence_overhead_us + per_seq)
    return replace(profile, name=f"{profile.name}-fit", iteration_overhead_us=max(0.0, profile.iteration_overhead_us + gap),
                   token_overhead_us=max(0.0, profile.token_overhead_us + slope), sequence_overhead_us=seq_us,
                   routing_read_us=profile.routing_read_us if read is None else max(0.0, read),
                   plan_transition_us=profile.plan_transition_us if per_transition is None else per_transition)
