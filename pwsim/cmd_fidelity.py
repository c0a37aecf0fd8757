"""`pwsim fidelity`: a simulated run against the runtime's replay of the same trace, request by request.

Give the --out of a `pwsim run` (--sim) and of a `pwruntime replay` or `pwruntime bench serve` (--runtime) of
one request trace, with the same scheduler limits (--max-num-seqs, max batched tokens, block size; a note says
where they differ) and a comparable KV pool. It writes `fidelity.json` (per metric the ratio sim / runtime and the
median relative error, throughput and makespan ratios, the per-iteration overhead each engine pays;
pwsim/fidelity.py) and `fidelity.png` (simulated against measured latencies per request, iteration time against
batch tokens). With --fit-profile it also writes the simulated run's hardware profile with `iteration_overhead_us`
and `token_overhead_us` moved by the gaps between the two engines' fitted per-iteration and per-token costs (with
--fit-per-sequence, from the fits with a per-sequence term, `sequence_overhead_us` too), and, when the replay
records which planner steps read the routing statistics, `routing_read_us` their measured cost (and where it
records each step's plan transitions, `plan_transition_us`): a profile of the runtime as it is (host included),
for a second `pwsim run --hardware JSON`. It also compares the two engines' decisions step by step (batches, KV
pool, bits, plan transitions) and says what keeps them apart: arrivals over time, or the simulator's routing (a
replay's `--record-routing` writes the routing the runtime computed, which `pwsim run --like-replay` simulates).

Two concurrency sweeps (`pwsim run --max-concurrency 1,4,16,64` and `pwruntime bench serve --max-concurrency
1,4,16,64`) are compared level by level: `fidelity.json` holds a row per level both ran (the throughput ratio, the
median latency ratios and errors) and each level's whole report, `fidelity.png` both sides' throughput and median
TPOT against the level.
"""
from __future__ import annotations

import argparse

from traces.clikit import UserError, millis
from traces.sizes import format_size


def register(subparsers) -> None:
    p = subparsers.add_parser("fidelity", help="compare a pwsim run with a pwruntime replay of the same trace",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sim", required=True, metavar="DIR", help="result directory of `pwsim run`")
    p.add_argument("--runtime", required=True, metavar="DIR",
                   help="result directory of `pwruntime replay` or `pwruntime bench serve` (one level)")
    p.add_argument("--out", default="runs/fidelity", help="directory for fidelity.json and fidelity.png (default runs/fidelity)")
    p.add_argument("--force", action="store_true", help="write into a non-empty --out that holds no fidelity.json")
    p.add_argument("--fit-profile", default=None, metavar="JSON",
                   help="also write the simulated run's hardware profile with the runtime's per-iteration overhead")
    p.add_argument("--fit-per-sequence", action="store_true",
                   help="with --fit-profile: fit a host cost per sequence an iteration schedules too "
                        "(sequence_overhead_us), from the fits with that term")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=run)


def signed(value: float, digits: int) -> str:
    """`value` with its sign at `digits` decimals, a rounded zero as +0 (never "-0.0")."""
    return f"{round(value, digits) + 0.0:+.{digits}f}"


def _line(name: str, m: dict) -> str:
    def f(v, scale=1.0, fmt="{:.3g}"):
        return "n/a" if v is None else fmt.format(v * scale)
    return (f"{name:>5}: sim p50 {f(m['sim_p50'], 1e3)} ms, runtime p50 {f(m['runtime_p50'], 1e3)} ms, sim/runtime "
            f"median {f(m['ratio_p50'], fmt='{:.2f}')} (p10 {f(m['ratio_p10'], fmt='{:.2f}')}, p90 "
            f"{f(m['ratio_p90'], fmt='{:.2f}')}), median |error| {f(m['median_abs_rel_error'], 100, '{:.0f}')}%")


# the settings that decide when a run's requests went: report key, its value in words, the flag that sets it
ARRIVAL_SETTINGS = (
    ("time_scale", lambda s: f"at --time-scale {s:g}", "--time-scale"),
    ("request_rate", lambda r: "at its recorded times" if r is None else f"at {r:g} requests per second",
     "--request-rate"),
    ("max_concurrency", lambda n: "with no client limit" if n is None else f"with at most {n} requests in flight",
     "--max-concurrency"),
)


def check_sides(args: argparse.Namespace) -> None:
    """Refuse a --sim that a runtime wrote, a --runtime that the simulator wrote (`traces.results.result_tool`; a
    result that does not say passes), and one directory for both."""
    from pathlib import Path

    from traces.results import RUNTIME_TOOLS, command_of, result_tool

    both = "give --sim the --out of a `pwsim run` and --runtime that of a `pwruntime replay` or `pwruntime bench serve`"
    for flag, path, wanted in (("--sim", args.sim, ("pwsim",)), ("--runtime", args.runtime, RUNTIME_TOOLS)):
        tool = result_tool(path)
        if tool is not None and tool not in wanted:
            raise UserError(f"{flag} {path} is a `{command_of(tool)}` result; {both}")
    if Path(args.sim).resolve() == Path(args.runtime).resolve():
        raise UserError(f"--sim and --runtime are the same directory {args.sim}; {both} of the same trace")


def _sweep_summary(path) -> dict | None:
    """The summary of a sweep directory (`{"sweep": rows}`), or None for any other path."""
    import json
    from pathlib import Path

    try:
        summary = json.loads((Path(path) / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    return summary if isinstance(summary, dict) and isinstance(summary.get("sweep"), list) else None


def run_sweeps(args, sim_summary: dict | None, rt_summary: dict | None) -> int:
    """Two sweeps, level by level (the module docstring)."""
    from pwsim import plots
    from pwsim.fidelity import RunView, compare
    from pwsim.output import write_report
    from traces.results import dumps, read_result_dir
    from traces.sweep import level_dirs

    if sim_summary is None or rt_summary is None:
        one, other = ("--sim", "--runtime") if sim_summary is not None else ("--runtime", "--sim")
        raise UserError(f"{one} is a concurrency sweep and {other} is not: give two sweeps (`pwsim run` and "
                        "`pwruntime bench serve` with --max-concurrency 1,4,...) or two single runs")
    if args.fit_profile:
        raise UserError("--fit-profile fits a profile from one pair of runs; give one level of each sweep "
                        "(--sim DIR/c64 --runtime DIR/c64) or a replay")
    check_sides(args)
    sim_dirs, rt_dirs = level_dirs(args.sim, sim_summary), level_dirs(args.runtime, rt_summary)
    levels = sorted(set(sim_dirs) & set(rt_dirs))
    if not levels:
        raise UserError(f"the sweeps share no --max-concurrency level (simulated {sorted(sim_dirs)}, served "
                        f"{sorted(rt_dirs)}); run them over the same levels")
    sim_rows = {r["max_concurrency"]: r for r in sim_summary["sweep"]}
    rt_rows = {r["max_concurrency"]: r for r in rt_summary["sweep"]}
    rows, reports = [], {}
    for level in levels:
        rep = compare(RunView(*read_result_dir(sim_dirs[level], "--sim")),
                      RunView(*read_result_dir(rt_dirs[level], "--runtime")))
        reports[str(level)] = rep
        m = rep["metrics"]
        rows.append({"max_concurrency": level, "throughput_ratio": rep["throughput_ratio"],
                     **{f"{k}_ratio_p50": m[k]["ratio_p50"] for k in ("ttft_s", "tpot_s", "e2e_s")},
                     "e2e_median_abs_rel_error": m["e2e_s"]["median_abs_rel_error"],
                     "sim_tpot_p50_s": m["tpot_s"]["sim_p50"], "runtime_tpot_p50_s": m["tpot_s"]["runtime_p50"],
                     "sim_tokens_per_s": sim_rows[level]["throughput_tokens_per_s"],
                     "runtime_tokens_per_s": rt_rows[level]["throughput_tokens_per_s"]})
    report = {"levels": rows, "reports": reports, "inputs": {"sim": str(args.sim), "runtime": str(args.runtime)}}
    out = write_report(args.out, "fidelity", report, lambda png: plots.fidelity_sweep(rows, png))
    if args.json:
        print(dumps(report))
        return 0

    def f(v, fmt="{:.2f}") -> str:
        return "n/a" if v is None else fmt.format(v)
    print(f"{'N':>5} {'sim tok/s':>10} {'runtime':>8} {'ratio':>6}  sim/runtime p50: {'TTFT':>5} {'TPOT':>5} "
          f"{'e2e':>5}  |e2e error|")
    for r in rows:
        print(f"{r['max_concurrency']:>5} {r['sim_tokens_per_s']:>10.0f} {r['runtime_tokens_per_s']:>8.0f} "
              f"{f(r['throughput_ratio']):>6}  {'':>16}{f(r['ttft_s_ratio_p50']):>5} {f(r['tpot_s_ratio_p50']):>5} "
              f"{f(r['e2e_s_ratio_p50']):>5}  {f(r['e2e_median_abs_rel_error'], '{:.0%}'):>10}")
    print(f"wrote {out / 'fidelity.json'} and {out / 'fidelity.png'}")
    return 0


def _decision_lines(report: dict, sim, runtime_dir) -> list[str]:
    """The step-by-step comparison in words, and what keeps the two apart where it is not whole."""
    from pathlib import Path

    d = report["decisions"]
    if d is None or not d["steps"]:
        return []
    if d["first_difference"] is None:
        return [f"decisions: the same at all {d['steps']} steps both ran (batches, KV pool, bits, plan transitions)"]
    there = ", ".join(f"{c} {v[0]:g} simulated / {v[1]:g} on the runtime" for c, v in d["values"].items())
    lines = [f"decisions: the same at {d['agreeing_steps']} of the {d['steps']} steps both ran; first apart at step "
             f"{d['first_difference']} ({there})"]
    ts = report["time_scale"]
    if ts["sim"] != 0 or ts["runtime"] != 0 or report["request_rate"]["runtime"] is not None \
            or report["max_concurrency"]["runtime"] is not None:
        lines.append("  (with requests arriving over time, the step each one joins depends on both engines' speed)")
    routing = report["sim_routing"] or ""
    path = (sim.summary.get("workload") or {}).get("path")
    own = Path(runtime_dir) / "trace"
    try:
        replayed_own = path is not None and own.exists() and Path(path).exists() and own.samefile(path)
    except OSError:
        replayed_own = False
    if routing.startswith("synthetic"):
        lines.append("  the simulator drew synthetic routing (its trace has no routing.parquet); a replay with "
                     "--record-routing writes the routing the runtime computed, which `pwsim run --like-replay "
                     "RUNTIME` simulates")
    elif not replayed_own:
        lines.append("  the simulator replayed the trace's recorded routing, not the routing this runtime computed at "
                     "its own bits; a replay with --record-routing writes that, which `pwsim run --like-replay "
                     "RUNTIME` simulates")
    return lines


def _transition_lines(report: dict) -> list[str]:
    """The plan logs compared transition by transition, in words."""
    t = report["transitions"]
    if t is None or not t["rows"]:
        return []

    def counts(side: dict) -> str:
        return f"{side['started']} begun, {side['rejected']} refused, {side['landed']} landed"

    line = (f"plan transitions: {counts(t['sim'])} simulated; {counts(t['runtime'])} on the runtime; "
            f"{t['alike']} of {t['rows']} alike (step, block, bits and status)")
    trips = report["round_trips"]
    def share(rt: dict) -> str:
        return "-" if rt["share_of_taken_bytes"] is None else f"{100 * rt['share_of_taken_bytes']:.0f}%"
    trip_line = (f"round trips (a block lowered, then raised again): {trips['sim']['count']} simulated, "
                 f"{trips['runtime']['count']} on the runtime ({share(trips['sim'])} and {share(trips['runtime'])} of "
                 "the bytes their reloads took back)")
    if t["first_difference"] is None:
        return [line, trip_line]

    def rows(side: list[dict]) -> str:
        return ", ".join(f"block {r['block']} {r['from_bits']}->{r['to_bits']} {r['status']}" for r in side) or "none"

    return [line, f"  first apart at step {t['first_difference']}: the simulator's only {rows(t['sim_only'])}; "
                  f"the runtime's only {rows(t['runtime_only'])}", trip_line]


def _setting_lines(report: dict) -> list[str]:
    """What was paired, and a note for each setting the two runs did not share (their results part for it)."""
    r = report["requests"]
    lines = [f"{r['paired']} requests paired ({r['sim']} simulated, {r['runtime']} replayed)"]
    a = report["async_scheduling"]
    if a["runtime"] is None:
        lines.append("note: the served run's server did not say how it scheduled (no /server_info), so neither this "
                     "nor its scheduler limits are checked")
    elif a["sim"] != a["runtime"]:
        on, off = ("the simulation", "the replay") if a["sim"] else ("the replay", "the simulation")
        lines.append(f"note: {on} scheduled asynchronously and {off} did not; their decisions come in another order "
                     "(run both with or both without --async-scheduling)")
    m = report["instant_page_moves"]
    if m["runtime"] is not None and m["sim"] != m["runtime"]:
        lines.append(f"note: the {'simulation' if m['sim'] else 'replay'}'s page moves landed at the boundary that "
                     f"began them and the {'replay' if m['sim'] else 'simulation'}'s did not; their reloads land at "
                     "other steps (the CPU runtime's land at once: simulate it with --instant-page-moves, as "
                     "--like-replay does)")
    differ = [f"{key} {v['sim']} simulated, {v['runtime']} on the runtime" for key, v in report["scheduler"].items()
              if None not in (v["sim"], v["runtime"]) and v["sim"] != v["runtime"]]
    if differ:
        lines.append(f"note: the scheduler limits differ ({'; '.join(differ)}); give both engines the same")
    w = report["warmup_requests"]
    if w["sim"] != w["runtime"]:
        lines.append(f"note: the simulation warmed up on {w['sim']} requests and the replay on {w['runtime']}; the "
                     "state their pressure left (bits, KV pool) differs at the start (give both the same "
                     "--warmup-requests)")
    for key, describe, flag in ARRIVAL_SETTINGS:
        v = report[key]
        if v["sim"] != v["runtime"]:
            lines.append(f"note: the simulation ran the trace {describe(v['sim'])} and the runtime "
                         f"{describe(v['runtime'])}; their requests went at other times (give both the same {flag})")
    lut = report["lut_room"]
    planned = any(v for v in report["planner"]["plans"].values())
    if planned and None not in lut.values() and lut["sim"] != lut["runtime"]:
        lines.append(f"note: the runtime's offloads found room for their lower LUTs in the {lut['runtime']}, the "
                     f"simulation's in the {lut['sim']}; their plans part (simulate with --lut-room {lut['runtime']}, "
                     "as --like-replay does)")
    reserve = report["activation_reserve"]
    if None not in reserve.values() and reserve["sim"] != reserve["runtime"]:
        lines.append(f"note: the runtime kept {format_size(reserve['runtime'])} of its budget for a step's "
                     f"activations, graphs and buffers, the simulation {format_size(reserve['sim'])}; their KV pools "
                     f"differ (simulate with --activation-reserve {reserve['runtime']}, as --like-replay does)")
    return lines


def _latency_lines(report: dict) -> list[str]:
    """Each paired latency metric, and the gaps between tokens where both sides have them."""
    lines = [_line(name, report["metrics"][key]) for key, name in (("ttft_s", "TTFT"), ("tpot_s", "TPOT"),
                                                                      ("e2e_s", "E2E"))]
    itl = report["itl"]
    if itl is not None:
        side = lambda k: " / ".join(millis(itl[k][p]) for p in ("p50", "p99", "max"))  # noqa: E731
        lines.append(f"ITL (gaps between a request's tokens) p50 / p99 / max, ms: sim {side('sim')}, runtime "
                     f"{side('runtime')}")
    return lines


def _iteration_lines(report: dict) -> list[str]:
    """Throughput, and what the runtime pays an iteration and a token against the simulator (the host-cost fits)."""
    it = report["iterations"]
    tr = report["throughput_ratio"]
    gap = it["overhead_gap_us"]
    slope = it["per_token_gap_us"]
    lines = [f"throughput sim/runtime {'n/a' if tr is None else f'{tr:.2f}'}; the runtime pays "
             f"{'n/a' if gap is None else f'{signed(gap, 0)} us'} an iteration and "
             f"{'n/a' if slope is None else f'{signed(slope, 1)} us'}"
             f" a token against the simulator{' besides planning' if it.get('net_of_planning') else ''}"]
    one = report["one_off_steps"]["runtime"]
    if one and one["steps"]:
        without = report["throughput_ratio_without_one_off"]
        lines.append(f"  the runtime's one-off steps: {one['steps']} far longer than the typical step of their kind "
                     f"and size (a new batch shape's first launch; before session 39 its graph capture), "
                     f"{one['excess_s']:.2f} s beyond it, "
                     f"{one['share']:.0%} of its iteration time, which the simulator does not charge"
                     + ("" if without is None else f"; without them throughput sim/runtime about {without:.2f}")
                     + ("" if report["warmup_requests"]["runtime"] else
                        " (`pwruntime replay --warmup-requests N` serves a warm-up before the clock)"))
    seq = it["per_sequence"]
    if seq is not None:
        lines.append(f"  with a per-sequence term: {signed(seq['overhead_gap_us'], 0)} us an iteration, "
                     f"{signed(seq['per_seq_gap_us'], 1)} us a sequence and {signed(seq['per_token_gap_us'], 1)} us "
                     "a token (--fit-per-sequence fits these)")
    kinds = it["by_kind"]
    if kinds["sim"] and kinds["runtime"]:
        def kind(k: str, side: str) -> str:
            m = kinds[side][k]
            return "none" if m["mean_iter_s"] is None else \
                f"{m['iterations']} of {m['mean_iter_s'] * 1e3:.3g} ms ({m['mean_tokens']:.0f} tokens)"
        lines += [f"{k} iterations: sim {kind(k, 'sim')}, runtime {kind(k, 'runtime')}" for k in ("decode", "mixed")]
    return lines


def _planner_lines(report: dict) -> list[str]:
    """Plans, preemptions and KV cache resizes on each side."""
    pl = report["planner"]

    def count(v) -> str:
        return "not recorded" if v is None else str(v)
    return [f"plans: {count(pl['plans']['sim'])} simulated, {count(pl['plans']['runtime'])} on the runtime; "
            f"preemptions: {count(pl['preemptions']['sim'])} and {count(pl['preemptions']['runtime'])}"
            + ("" if report["kv_resizes"]["runtime"] is None else
               f"; KV cache resizes: {count(report['kv_resizes']['sim'])} and {report['kv_resizes']['runtime']}")]


def _runtime_plan_lines(report: dict) -> list[str]:
    """The runtime's phase times by kind of iteration, and what its planner's routing reads and transitions cost."""
    lines = [f"runtime {kind} iterations, mean ms: " + ", ".join(f"{k} {v:.3g}" for k, v in ms.items())
             for kind, ms in (report["runtime_phase_ms"] or {}).items()]
    rr = report["routing_reads"]
    if rr["runtime"] is not None:
        cost = rr["plan_gap_us"]
        lines.append(f"planner steps that read the routing statistics: {rr['sim']} simulated, {rr['runtime']} on the "
                     "runtime" + ("" if cost is None else f", each {cost:.0f} us more of plan phase there"))
        if rr.get("transition_us") is not None:
            lines.append(f"  the runtime's plan phase fitted: {rr['read_us']:.0f} us a read and "
                         f"{rr['transition_us']:.0f} us a transition its plan starts")
    return lines


def run(args) -> int:
    from pwsim import plots
    from pwsim.fidelity import RunView, compare, fitted_profile, paired_columns
    from pwsim.output import write_report
    from traces.results import dumps, prepare_dir, read_plan_log, read_result_dir

    if args.fit_per_sequence and not args.fit_profile:
        raise UserError("--fit-per-sequence fits the profile --fit-profile writes; give --fit-profile JSON too")
    prepare_dir(args.out, args.force, "pwsim fidelity", "fidelity.json")
    sweeps = [_sweep_summary(path) for path in (args.sim, args.runtime)]
    if any(s is not None for s in sweeps):
        return run_sweeps(args, *sweeps)
    sim = RunView(*read_result_dir(args.sim, "--sim"), plans=read_plan_log(args.sim, "--sim"))
    rt = RunView(*read_result_dir(args.runtime, "--runtime"), plans=read_plan_log(args.runtime, "--runtime"))
    check_sides(args)
    report = compare(sim, rt)
    report["inputs"] = {"sim": str(args.sim), "runtime": str(args.runtime)}
    fitted = None
    if args.fit_profile:
        from traces.hardware import load_profile
        hw = sim.config.get("hardware")
        if not hw:
            raise UserError(f"--sim {args.sim} names no hardware profile in its config.json; is it a `pwsim run` "
                            "result?")
        fitted = fitted_profile(load_profile(hw), report, per_sequence=args.fit_per_sequence)
        report["fitted_profile"] = {"path": str(args.fit_profile), "name": fitted.name,
                                    "iteration_overhead_us": fitted.iteration_overhead_us,
                                    "sequence_overhead_us": fitted.sequence_overhead_us,
                                    "token_overhead_us": fitted.token_overhead_us}
    out = write_report(args.out, "fidelity", report,
                       lambda png: plots.fidelity(paired_columns(sim, rt), sim.timeline, rt.timeline, report, png),
                       fitted, args.fit_profile)
    if args.json:
        print(dumps(report))
        return 0
    lines = (_setting_lines(report) + _latency_lines(report) + _iteration_lines(report) + _planner_lines(report)
             + _decision_lines(report, sim, args.runtime) + _transition_lines(report) + _runtime_plan_lines(report))
    print("\n".join(lines))
    print(f"wrote {out / 'fidelity.json'} and {out / 'fidelity.png'}"
          + (f"; the fitted profile ({fitted.iteration_overhead_us:.0f} us an iteration, "
             f"{fitted.sequence_overhead_us:.1f} us a sequence, {fitted.token_overhead_us:.1f} us a token, "
             f"{fitted.routing_read_us:.0f} us a routing read, {fitted.plan_transition_us:.0f} us a plan "
             "transition) to "
             f"{args.fit_profile}" if fitted is not None else ""))
    return 0
