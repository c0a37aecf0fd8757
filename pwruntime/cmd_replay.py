"""`pwruntime replay`: serve a recorded request trace in real time and write per-request latencies.

The trace's requests arrive at their recorded times (scaled by --time-scale), with their recorded
prompts and output lengths; the engine (the same options as `generate`: a model or an AP checkpoint
with a planner) serves them under continuous batching. The result directory has the layout of a
`pwsim run` result (requests.parquet, timeline.parquet, plans.parquet, summary.json, config.json), so
`pwsim fidelity --sim SIM_RUN --runtime THIS` measures how well the simulator predicts this run.

With --record-routing the result also holds `trace/`: the replayed requests (before --request-rate
re-times them) with the routing the engine computed for them, at the bits it served them with, and
the routing its warm-up computed for the trace's first prompts (`warmup_routing.parquet`), so
`pwsim run --like-replay OUT` (its trace and this replay's settings) simulates the routing the
runtime's planner saw, not the routing the trace was recorded with. Recording copies each
step's routing to the host, which the run's times include.

With --sample-host-stacks the result also holds `host_stacks.json`: the stretches in which the host's main thread
stood still for over half a second, from loading the model to the replay's end (pwruntime.host_stacks), on the
replay's clock; a step's one-off compile or a wait shows there with the Python line that made it.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from policies.plan_log import refusal_line
from traces.clikit import UserError, check_seed
from traces.results import add_slo_flags, slo_attainment, slo_bounds, slo_line


def register(subparsers) -> None:
    from pwruntime.cmd_generate import add_engine_args

    p = subparsers.add_parser("replay", help="serve a recorded request trace in real time; per-request latencies",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", required=True, help="trace directory (or requests.parquet) with prompt token ids")
    p.add_argument("--out", required=True, help="result directory to write")
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="multiply the arrival times by this (> 1 spreads the requests out, 0 sends them all at once; "
                        "default 1); give `pwsim run` the same --time-scale to compare the two with `pwsim fidelity`")
    add_request_rate_flags(p)
    p.add_argument("--seed", type=int, default=0, help="seed of --request-rate's arrival times (default 0)")
    p.add_argument("--max-requests", type=int, default=None, help="replay only the first N requests")
    p.add_argument("--warmup-requests", type=int, default=0,
                   help="first serve the trace's first N prompts, untimed, for up to 16 tokens each, so one-off costs "
                        "(first kernel launches; the CUDA graphs are captured before the clock either way) stay out of "
                        "the replay (default 0)")
    p.add_argument("--record-routing", action="store_true",
                   help="also write OUT/trace: the replayed requests with the routing this run computed (for "
                        "`pwsim run --like-replay OUT`)")
    p.add_argument("--sample-host-stacks", action="store_true",
                   help="also write OUT/host_stacks.json: where the host stood still for over 0.5 s (the main "
                        "thread's Python stack sampled every 50 ms from loading to the end; start_s on the replay's "
                        "clock, negative before it), longest first")
    p.add_argument("--force", action="store_true", help="overwrite a non-empty --out that is not a result directory")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    add_slo_flags(p)
    add_engine_args(p)
    p.set_defaults(func=run)


def add_request_rate_flags(p) -> None:
    """--request-rate and --burstiness, which `replay` and `bench serve` share."""
    p.add_argument("--request-rate", type=float, default=None, metavar="R",
                   help="send the trace's requests at R per second instead of their recorded times (as vLLM's "
                        "--request-rate; seeded by --seed); give `pwsim run` the same to compare them")
    p.add_argument("--burstiness", type=float, default=None, metavar="CV",
                   help="with --request-rate: the gaps' coefficient of variation (default 1: Poisson; above 1 "
                        "burstier, as vLLM's --burstiness)")


def arrival_args(args) -> tuple[float | None, float]:
    """(--request-rate, --burstiness) checked: one arrival setting at a time."""
    if args.request_rate is None:
        if args.burstiness is not None:
            raise UserError("--burstiness shapes the gaps of --request-rate; give --request-rate R too")
        return None, 1.0
    if args.time_scale not in (None, 1.0):
        raise UserError("give --request-rate or --time-scale, not both: each sets when the requests arrive")
    return args.request_rate, 1.0 if args.burstiness is None else args.burstiness


def _requests(path: str, limit: int | None, request_rate: float | None = None, burstiness: float = 1.0,
              seed: int = 0):
    """The trace at `path` (its first `limit` requests), re-timed at `request_rate` when one is given."""
    return _retimed(_read_requests(path, limit), request_rate, burstiness, seed)


def _retimed(trace, request_rate: float | None, burstiness: float, seed: int):
    """`trace` with arrivals at `request_rate` per second (traces.generators.retimed_arrivals); unchanged without."""
    from dataclasses import replace

    from traces.generators import retimed_arrivals

    if request_rate is None:
        return trace
    return replace(trace, arrival_s=retimed_arrivals(trace.arrival_s, request_rate, burstiness, seed))


def _read_requests(path: str, limit: int | None):
    """The request trace at `path` (a trace directory or requests.parquet), its first `limit` requests."""
    from traces.io import check_not_a_result, read_requests

    src = Path(path)
    check_not_a_result(src)
    if not src.exists():
        raise UserError(f"--trace {src} does not exist; give a trace directory recorded by `pwruntime record-trace`")
    if src.is_dir() and not (src / "requests.parquet").is_file():
        raise UserError(f"--trace {src} holds no requests.parquet; give a trace directory recorded by "
                        "`pwruntime record-trace`")
    trace = read_requests(src / "requests.parquet" if src.is_dir() else src)
    if len(trace) == 0:
        raise UserError(f"--trace {src} holds no requests; give a trace with at least one (`pwruntime record-trace`)")
    if limit is not None:
        if limit < 1:
            raise UserError(f"--max-requests must be >= 1, got {limit}")
        trace = trace.head(limit)
    return trace


def run(args) -> int:
    from policies.loop import ImmediateMover
    from pwruntime.cmd_generate import build_engine, engine_model_dir
    from pwruntime.host_stacks import HostStackSampler
    from pwruntime.replay import replay
    from pwruntime.stats_log import prefill_chunk_bytes, serves_from_plane_arena
    from pwruntime.trace_recorder import TraceRecorder, card_for
    from traces.io import Trace, write_trace_dir
    from traces.results import prepare_dir, write_result_dir

    check_seed(args.seed)
    rate, burstiness = arrival_args(args)
    source = _read_requests(args.trace, args.max_requests)
    if not 0 <= args.warmup_requests <= len(source):
        raise UserError(f"--warmup-requests must lie in 0..{len(source)}, the requests replayed (it serves the first "
                        f"of them), got {args.warmup_requests}")
    trace = _retimed(source, rate, burstiness, args.seed)
    slo = slo_bounds(args)
    out = Path(args.out)
    prepare_dir(out, args.force, tool="replay")
    recorder = None
    if args.record_routing:
        if args.enable_prefix_caching:
            raise UserError("--record-routing records the routing of every prompt token, which prefix caching skips: "
                            "drop --enable-prefix-caching")
        model_dir = engine_model_dir(args)
        card, card_json = card_for(model_dir)
        recorder = TraceRecorder(card=card, card_json=card_json,
                                 provenance={"model": str(model_dir), "replayed": str(args.trace)})
    sampler = HostStackSampler().start() if args.sample_host_stacks else None
    try:
        engine, model_dir, dtype, device = build_engine(args, recorder)
        start = time.perf_counter()
        result = replay(engine, trace, time_scale=args.time_scale, warmup_requests=args.warmup_requests,
                        progress=not args.json)
    finally:
        if sampler is not None:
            sampler.stop()
    summary = {**result.summary, "wall_s": time.perf_counter() - start, "model": str(model_dir), "dtype": dtype,
               "device": device, "policy": engine.policy.name,
               "instant_page_moves": isinstance(engine.loop.mover, ImmediateMover)}  # no copy stream (the CPU's)
    if slo is not None:
        summary["slo"] = slo_attainment(result.requests, *slo)
    config = {**{k: v for k, v in vars(args).items() if k != "func"}, "argv": sys.argv[1:],
              "hybrid_kv_cache": engine.kv_layout.hybrid,  # what ran: a model without sliding layers has one table
              "activation_reserve": engine.activation_reserve,  # bytes, measured (auto) or given
              "serving_reserve": engine.serving_reserve,  # bytes the graphs and buffers took of a budget's pool
              "plane_arena": serves_from_plane_arena(engine),  # what ran: the default is on for AP experts on CUDA
              "prefill_chunk_bytes": prefill_chunk_bytes(engine)}
    documents = {"summary": summary, "config": config}
    if sampler is not None:
        documents["host_stacks"] = {"interval_s": sampler.interval_s, "min_stretch_s": sampler.min_stretch_s,
                                    "samples": sampler.num_samples, "stretches": sampler.stretches(engine.t0)}
    def write_routing(d: Path) -> None:  # the replayed requests and the routing computed for them, in OUT/trace
        write_trace_dir(d / "trace", Trace(source, result.routing, result.warmup_routing), recorder.card_json)
    write_result_dir(out, {"requests": result.requests, "timeline": result.timeline, "plans": result.plans},
                     documents, extra=None if result.routing is None else write_routing,
                     force=args.force, tool="replay")
    if args.json:
        print(json.dumps(summary))
    else:
        t, itl = summary["tpot_s"]["p50"], summary["itl_s"]["p99"]
        print(f"replayed {summary['requests']} requests ({summary['output_tokens']} output tokens) in "
              f"{summary['makespan_s']:.2f} s: {summary['throughput_tokens_per_s']:.0f} tokens/s, median TPOT "
              f"{'n/a' if t is None else f'{t * 1e3:.2f} ms'}, ITL p99 "
              f"{'n/a' if itl is None else f'{itl * 1e3:.2f} ms'}; wrote {out}")
        plan = summary["plan_ms"]
        if plan is not None:
            print(f"{plan['steps']} planning steps ({plan['transitions_per_step']:.0f} transitions each), "
                  f"{plan['plan']:.2f} ms each: routing read {plan['read']:.2f}, page moves {plan['moves']:.2f}, "
                  f"KV resizes {plan['kv']:.2f}, the rest {plan['other']:.2f}")
            each = plan["per_transition_us"]
            print(f"page moves and KV resizes over every step, landings included: {each['moves']:.1f} and "
                  f"{each['kv']:.1f} us a transition begun")
        refused = refusal_line(result.plans, str(out))
        if refused:
            print(refused)
        if summary["gpu_memory"] is not None:
            print("\n".join(gpu_memory_lines(summary["gpu_memory"], args.gpu_memory_budget)))
        if result.routing is not None:
            how = (f"`pwsim run --like-replay {out}` simulates it with this replay's settings" if args.gpu_memory_budget
                   else "`pwsim run --like-replay` needs a replay with --gpu-memory-budget: give `pwsim run --trace "
                        f"{out / 'trace'} --budget SIZE` and the other settings yourself")
            print(f"the routing it computed: {out / 'trace'} ({how})")
        if slo is not None:
            print("SLO " + slo_line(summary["slo"]))
        if sampler is not None:
            for s in documents["host_stacks"]["stretches"][:3]:
                print(f"the host stood {s['seconds']:.2f} s at {s['start_s']:+.2f} s in {' <- '.join(s['stack'][:3])}")
    return 0


def gpu_memory_lines(mem: dict, budget: str | None) -> list[str]:
    """What a replay prints of its summary's `gpu_memory` (cuda_memory.memory_report): the memory held beside the
    budget, and the driver calls the KV cache's and the expert planes' mappings made."""
    lines = [f"GPU memory: peak {mem['peak_allocated_gib']:.2f} GiB in the allocator's tensors, "
             f"{mem['peak_reserved_gib']:.2f} GiB reserved by it, {mem['kv_peak_mapped_gib']:.2f} GiB mapped by the KV "
             f"cache, {mem['weights_peak_mapped_gib']:.2f} GiB by the expert planes; "
             + (f"{mem['peak_in_use_gib']:.2f} GiB in use and " if "peak_in_use_gib" in mem else "")
             + f"{mem['peak_held_gib']:.2f} GiB held at most" + (f" (budget {budget})" if budget else "")]
    owners = (("the KV cache", mem["driver_calls"]["kv"]), ("the expert planes", mem["driver_calls"]["weights"]))
    calls = [f"{what} {c['handles_mapped']} handles mapped in {c['map_ms']:.1f} ms, {c['handles_unmapped']} unmapped "
             f"in {c['unmap_ms']:.1f} ms" for what, c in owners if c["handles_mapped"]]
    if calls:
        lines.append("the driver's virtual memory, since the engine started: " + "; ".join(calls))
    return lines
