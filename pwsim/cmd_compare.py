"""`pwsim compare`: every policy at every budget; a table (printed, JSON, CSV) and comparison plots.

With no arguments it runs the bundled default (`pwsim.defaults`). Runs go to `--jobs` worker
processes (pwsim.parallel); each run is fully determined by its config (seeded), so the table does not depend on
the number of workers or the order they finish in.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

from pwsim.cmd_run import (add_common, add_sweep_flag, command_line, config_from_args, middle_budget,
                           policies_and_budgets, policy_variants, remember_defaults, validate_config)
from pwsim.parallel import map_jobs, worker_count
from pwsim.defaults import DEFAULTS
from pwsim.hardware import memory_unit
from traces.clikit import UserError
from traces.results import add_slo_flags, prepare_dir, slo_attainment, slo_bounds

GiB = 2**30
COLUMNS = ["policy", "budget", "status", "peak_gib", "used_gib", "weights_gib", "kv_pool_gib", "mean_bits",
           "throughput_tok_s", "ttft_p50_s", "ttft_p99_s", "tpot_p50_ms", "itl_p99_ms", "e2e_p50_s", "completed",
           "requests", "preemptions", "stall_s", "budget_violations", "reloaded_gib", "damage_per_token",
           "predicted_ppl", "slo_attainment", "goodput_rps", "round_trips", "round_trip_share", "wall_s", "note"]


def _row(cfg, budget: str, summary: dict | None, error: str | None) -> dict:
    base = {"policy": cfg.policy_label, "budget": budget}
    if summary is None:
        return {**base, "status": "infeasible", "note": error}
    m, q = summary["memory"], summary["quality"]
    return {**base, "status": "ok", "peak_gib": m["peak_bytes"] / GiB, "used_gib": m["peak_used_bytes"] / GiB,
            "weights_gib": m["peak_weight_bytes"] / GiB,
            "kv_pool_gib": m["peak_kv_pool_bytes"] / GiB, "mean_bits": summary["mean_committed_bits"],
            "throughput_tok_s": summary["throughput_tokens_per_s"], "ttft_p50_s": summary["ttft_s"]["p50"],
            "ttft_p99_s": summary["ttft_s"]["p99"],
            "tpot_p50_ms": None if summary["tpot_s"]["p50"] is None else summary["tpot_s"]["p50"] * 1e3,
            "itl_p99_ms": None if summary["itl_s"]["p99"] is None else summary["itl_s"]["p99"] * 1e3,
            "e2e_p50_s": summary["e2e_s"]["p50"], "completed": summary["completed"], "requests": summary["requests"],
            "preemptions": summary["preemptions"], "stall_s": sum(v["time_s"] for v in summary["stalls"].values()),
            "budget_violations": m["budget_violations"], "reloaded_gib": summary["page_traffic"]["reload_bytes"] / GiB,
            "damage_per_token": q.get("mean_damage_per_token"), "predicted_ppl": q.get("predicted_ppl"),
            "quality_fit": q.get("fit"), "wall_s": summary["wall_s"], "note": "",
            "slo_attainment": (summary.get("slo") or {}).get("attainment"),
            "goodput_rps": (summary.get("slo") or {}).get("goodput_rps"),
            "round_trips": summary["plans"]["round_trips"]["count"],
            "round_trip_share": summary["plans"]["round_trips"]["share_of_taken_bytes"]}


def run_one(cfg_json: dict, keep_timeline: bool, slo: tuple | None = None):
    """Worker: one run; returns (summary or None, timeline or None, error message or None). `slo`: (TTFT s, TPOT s)
    bounds whose attainment the summary reports."""
    from pwsim.engine import BudgetError
    from pwsim.runner import RunConfig, execute
    cfg = RunConfig.from_json(cfg_json)
    try:
        res = execute(cfg)
    except BudgetError as e:
        return None, None, str(e)
    if slo is not None:
        res.summary["slo"] = slo_attainment(res.requests, *slo)
    res.plans.clear()
    return res.summary, (res if keep_timeline else None), None


def _fmt(v, nd=2) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.{nd}f}"
    return str(v)


def table(rows: list[dict]) -> str:
    q_key = "predicted_ppl" if any(r.get("predicted_ppl") is not None for r in rows) else "damage_per_token"
    div, unit = memory_unit(max((r.get("peak_gib") or 0.0) for r in rows) * GiB)
    scale = GiB / div  # rows hold GiB
    relative = any((r.get("quality_fit") or {}).get("relative") for r in rows)
    slo = any(r.get("slo_attainment") is not None for r in rows)
    head = ("policy", "budget", f"peak {unit}", f"used {unit}", f"weights {unit}", f"KV pool {unit}", "bits",
            "out tok/s", "TTFT p50 s", "TPOT p50 ms", "preempt", "stall s", "viol", f"reload {unit}",
            ("ppl/fp" if relative else "ppl") if q_key == "predicted_ppl" else "damage/tok") + (("SLO met %",) * slo)
    body = []
    for r in rows:
        if r["status"] != "ok":
            body.append((r["policy"], r["budget"], "infeasible: weights exceed the budget") + ("",) * (len(head) - 3))
            continue
        mem = lambda k: _fmt(r[k] * scale)  # noqa: E731
        body.append((r["policy"], r["budget"], mem("peak_gib"), mem("used_gib"), mem("weights_gib"), mem("kv_pool_gib"),
                     _fmt(r["mean_bits"]), _fmt(r["throughput_tok_s"], 0), _fmt(r["ttft_p50_s"], 3),
                     _fmt(r["tpot_p50_ms"]), _fmt(r["preemptions"]), _fmt(r["stall_s"], 3),
                     _fmt(r["budget_violations"]), mem("reloaded_gib"),
                     "-" if r.get(q_key) is None else f"{r[q_key]:.4g}")
                    + ((_fmt(100 * r["slo_attainment"], 1),) if slo else ()))
    widths = [max(len(str(x)) for x in col) for col in zip(head, *[b for b in body if not b[2].startswith("infeasible")])]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths))]
    for b in body:
        if b[2].startswith("infeasible"):
            lines.append("  ".join([b[0].ljust(widths[0]), b[1].ljust(widths[1]), b[2]]))
        else:
            lines.append("  ".join(str(c).ljust(w) if i < 2 else str(c).rjust(w) for i, (c, w) in enumerate(zip(b, widths))))
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from pwsim import output, plots

    t0 = time.perf_counter()
    policy_names, budgets = policies_and_budgets(args)
    configs = [(p, b, config_from_args(args, p, kw, b)) for p, kw in policy_variants(args, policy_names)
               for b in budgets]
    jobs, slo = worker_count(args.jobs, len(configs)), slo_bounds(args)
    tl_budget = args.timeline_budget or middle_budget(budgets)
    if tl_budget not in budgets:
        raise UserError(f"--timeline-budget {tl_budget} is not one of --budgets {','.join(budgets)}")
    out = prepare_dir(args.out, args.force, "pwsim compare", "compare.json")  # written once every run is done
    validate_config(configs[0][2])
    results = map_jobs(run_one, [(cfg.to_json(), b == tl_budget, slo) for _, b, cfg in configs], jobs, "simulations",
                       "run", progress=not args.no_progress)
    rows = [_row(cfg, b, *[results[k][0], results[k][2]]) for k, (p, b, cfg) in enumerate(configs)]
    first = next((results[k][0] for k in range(len(configs)) if results[k][0] is not None), None)
    if first is None:  # nothing to tabulate or plot
        raise UserError(f"no run is feasible at --budgets {','.join(budgets)}; the first: {rows[0]['note']}")
    meta = {"command": command_line("pwsim compare", args, always=("policies", "budgets")), "jobs": jobs,
            "wall_s": None, "policies": policy_names, "budgets": budgets, "timeline_budget": tl_budget,
            "quality_note": first["quality"]["note"], "hardware": first["hardware"],
            "calibration": first["calibration"], "workload": first["workload"], "model": first["model"]}
    timelines = {cfg.policy_label: results[k][1] for k, (p, b, cfg) in enumerate(configs)
                 if b == tl_budget and results[k][1] is not None}

    context = plots.setting(meta["model"], meta["hardware"])

    def write_json(path: Path) -> None:
        meta["wall_s"] = time.perf_counter() - t0
        path.write_text(output.dumps({**meta, "rows": rows, "configs": [c.to_json() for _, _, c in configs]}))

    output.write_files(out, {  # all five or none
        "compare.csv": lambda path: path.write_text(output.csv_text(rows, COLUMNS)),
        "quality_vs_memory.png": lambda path: plots.compare_quality_memory(rows, path, context),
        "throughput.png": lambda path: plots.compare_throughput(rows, budgets, path, context),
        "timelines.png": lambda path: plots.compare_timelines(timelines, path,
                                                              f"timelines at {tl_budget} · {context}"),
        "compare.json": write_json})
    if args.json:
        print(output.dumps({**meta, "rows": rows}))
    else:
        print(table(rows))
        print(f"\nquality: {meta['quality_note']}")
        if not first["hardware"]["measured"]:
            print(f"hardware: {first['hardware']['name']} is a roofline profile, not a measurement")
        if first["calibration"]["synthetic"]:
            print("calibration: synthetic (policies.synthetic), not measured on a model")
        print(f"wrote {out}/compare.json, compare.csv, quality_vs_memory.png, throughput.png, timelines.png "
              f"({len(configs)} runs, {jobs} jobs, {meta['wall_s']:.1f} s)")
        print(f"reproduce: {meta['command']}")
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("compare", help="compare policies across memory budgets (table and plots)",
                              description="Run every policy at every budget and print a table; writes "
                                          "compare.json, compare.csv and plots (quality vs memory, throughput, "
                                          "timelines). With no arguments: the bundled default setup.")
    p.add_argument("--policies", default=",".join(DEFAULTS.policies),
                   help=f"comma-separated policy names, MODULE:CLASS or FILE.py:CLASS for one of your own "
                        f"(default {','.join(DEFAULTS.policies)})")
    p.add_argument("--budgets", default=",".join(DEFAULTS.budgets),
                   help=f"comma-separated memory budgets (default {','.join(DEFAULTS.budgets)})")
    p.add_argument("--policy-arg", action="append", default=[], metavar="K=V",
                   help="parameter of the (single) policy compared (repeatable)")
    add_sweep_flag(p)
    p.add_argument("--jobs", type=int, default=None, help="worker processes (default: available cores)")
    p.add_argument("--timeline-budget", default=None, help="budget whose timelines are plotted (default: the middle one)")
    p.add_argument("--out", default="runs/compare", help="output directory (default runs/compare)")
    p.add_argument("--force", action="store_true", help="write into a non-empty --out that holds no compare.json")
    p.add_argument("--json", action="store_true", help="print the table as JSON")
    p.add_argument("--no-progress", action="store_true")
    add_slo_flags(p)
    add_common(p)
    p.set_defaults(func=run)
    remember_defaults(p)
