"""`pwsim capacity`: per policy and memory budget, the highest arrival rate that meets latency SLOs.

Each (policy, budget) search (pwsim.capacity) runs on its own worker process; every point is a seeded simulation of
the run's trace at a rate multiplier, so the capacities do not depend on `--jobs`. Writes `capacity.json` (every
point run, each capacity, the configs and the runs at capacity), `capacity.csv` (one row per point) and
`capacity.png` (capacity against memory; the SLO's latencies against the arrival rate at one budget), all or none.
"""
from __future__ import annotations

import argparse
import time
from dataclasses import asdict

from pwsim.capacity import PERCENTILES, SLO
from pwsim.cmd_run import (add_common, add_sweep_flag, command_line, config_from_args, middle_budget,
                           policies_and_budgets, policy_variants, remember_defaults, validate_config)
from pwsim.defaults import DEFAULTS

CAPACITY_ALWAYS = ("policies", "budgets", "min_rate", "max_rate", "tolerance")  # in its command even at defaults
from pwsim.parallel import map_jobs, worker_count
from traces.clikit import UserError
from traces.results import prepare_dir

DEFAULT_PERCENTILE = 99
POINT_COLUMNS = ["policy", "budget", "multiplier", "rate_rps", "met", "why", "ttft_s", "tpot_s", "attained",
                 "throughput_tok_s", "completed", "requests"]


def search_one(cfg_json: dict, slo: dict, lowest: float, highest: float, tolerance: float) -> tuple[dict, dict]:
    """Worker: one search; returns its Capacity as JSON and the summary of the run at capacity."""
    from pwsim.capacity import capacity_of
    from pwsim.runner import RunConfig
    cap, summary = capacity_of(RunConfig.from_json(cfg_json), SLO(**slo), lowest, highest, tolerance)
    return cap.to_json(), summary


def _slo(args: argparse.Namespace) -> SLO:
    if args.percentile is not None and args.attainment is not None:
        raise UserError("--percentile and --attainment are two ways to meet the SLO (a percentile within the bounds, "
                        "or a share of the requests within them); give one")
    try:
        return SLO(ttft_s=args.slo_ttft, tpot_s=None if args.slo_tpot is None else args.slo_tpot / 1e3,
                   percentile=DEFAULT_PERCENTILE if args.percentile is None else args.percentile,
                   attainment=args.attainment)
    except ValueError as e:
        raise UserError(f"--slo-ttft / --slo-tpot / --percentile / --attainment: {e}") from None


def _check_search(args: argparse.Namespace) -> None:
    if not 0 < args.min_rate < args.max_rate < float("inf"):
        raise UserError(f"--min-rate and --max-rate must satisfy 0 < min < max, got {args.min_rate:g} and "
                        f"{args.max_rate:g}")
    if not 0 < args.tolerance <= 1:
        raise UserError(f"--tolerance must lie in (0, 1], got {args.tolerance:g}")
    if args.time_scale != 1.0 or args.request_rate is not None:
        flag = "--time-scale" if args.time_scale != 1.0 else "--request-rate"
        raise UserError(f"{flag}: a capacity search sets the arrival rate itself; leave {flag} out and bound the "
                        "search with --min-rate / --max-rate")


def table(searches: list[dict], slo: SLO) -> str:
    key = f"p{slo.percentile}"
    head = ("policy", "budget", "capacity (x trace rate)", "requests/s", f"TTFT {key} ms", f"TPOT {key} ms",
            "within SLO %", "tok/s", "points", "note")
    body = []
    for res in searches:
        cap = next((p for p in res["points"] if p["multiplier"] == res["multiplier"]), None)
        ms = lambda v: "-" if v is None else f"{v * 1e3:.3g}"  # noqa: E731
        body.append((res["policy"], res["budget"], "-" if cap is None else f"{cap['multiplier']:.3g}",
                     "-" if cap is None else f"{cap['rate_rps']:.4g}", ms(cap and cap["ttft_s"]),
                     ms(cap and cap["tpot_s"]), "-" if cap is None else f"{100 * cap['attained']:.1f}",
                     "-" if cap is None else f"{cap['throughput_tok_s']:.0f}",
                     str(len(res["points"])), res["note"]))
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body)]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip() for row in (head, *body))


def run(args: argparse.Namespace) -> int:
    from pwsim import output, plots

    t0 = time.perf_counter()
    policy_names, budgets = policies_and_budgets(args)
    curve_budget = args.curve_budget or middle_budget(budgets)
    if curve_budget not in budgets:
        raise UserError(f"--curve-budget {curve_budget} is not one of --budgets {','.join(budgets)}")
    slo = _slo(args)
    _check_search(args)
    configs = [(p, b, config_from_args(args, p, kw, b)) for p, kw in policy_variants(args, policy_names)
               for b in budgets]
    jobs = worker_count(args.jobs, len(configs))
    out = prepare_dir(args.out, args.force, "pwsim capacity", "capacity.json")  # written once every search is done
    validate_config(configs[0][2])
    slo_json = asdict(slo)
    found = map_jobs(search_one, [(cfg.to_json(), slo_json, args.min_rate, args.max_rate, args.tolerance)
                                  for _, _, cfg in configs], jobs, "capacity searches", "search",
                     progress=not args.no_progress)
    searches = [{"policy": cfg.policy_label, "budget": b, **cap} for (_, b, cfg), (cap, _) in zip(configs, found)]
    first = found[0][1]
    meta = {"command": command_line("pwsim capacity", args, always=CAPACITY_ALWAYS), "budgets": budgets,
            "curve_budget": curve_budget, "slo": slo_json,
            "search": {"min_rate": args.min_rate, "max_rate": args.max_rate, "tolerance": args.tolerance},
            "jobs": jobs, "wall_s": None, "hardware": first["hardware"], "calibration": first["calibration"],
            "workload": first["workload"], "model": first["model"]}
    rows = [{"policy": s["policy"], "budget": s["budget"], **pt} for s in searches for pt in s["points"]]

    def write_json(path) -> None:
        meta["wall_s"] = time.perf_counter() - t0
        path.write_text(output.dumps({**meta, "searches": searches, "configs": [c.to_json() for _, _, c in configs],
                                      "at_capacity": [summary for _, summary in found]}))

    output.write_files(out, {  # all three or none
        "capacity.csv": lambda path: path.write_text(output.csv_text(rows, POINT_COLUMNS)),
        "capacity.png": lambda path: plots.capacity(searches, budgets, curve_budget, slo_json, path,
                                                    plots.setting(meta["model"], meta["hardware"])),
        "capacity.json": write_json})
    if args.json:
        print(output.dumps({**meta, "searches": searches}))
    else:
        print(table(searches, slo))
        if not first["hardware"]["measured"]:
            print(f"hardware: {first['hardware']['name']} is a roofline profile, not a measurement")
        print(f"wrote {out}/capacity.json, capacity.csv, capacity.png ({len(rows)} runs, {jobs} jobs, "
              f"{meta['wall_s']:.1f} s)")
        print(f"reproduce: {meta['command']}")
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("capacity", help="the highest arrival rate each policy serves within latency SLOs",
                              description="For each policy and memory budget, search the highest multiple of the "
                                          "trace's arrival rate at which every request completes and the TTFT / "
                                          "TPOT percentile stays within its bound (doubling, then bisection); "
                                          "writes capacity.json, capacity.csv and capacity.png.")
    p.add_argument("--policies", default=",".join(DEFAULTS.policies),
                   help=f"comma-separated policy names, MODULE:CLASS or FILE.py:CLASS for one of your own "
                        f"(default {','.join(DEFAULTS.policies)})")
    p.add_argument("--policy-arg", action="append", default=[], metavar="K=V",
                   help="parameter of the (single) policy searched (repeatable)")
    add_sweep_flag(p)
    p.add_argument("--budgets", default=",".join(DEFAULTS.budgets),
                   help=f"comma-separated memory budgets (default {','.join(DEFAULTS.budgets)})")
    p.add_argument("--curve-budget", default=None,
                   help="budget whose latency curves are plotted (default: the middle one)")
    p.add_argument("--slo-ttft", type=float, default=None, metavar="SECONDS", help="bound on the TTFT percentile")
    p.add_argument("--slo-tpot", type=float, default=None, metavar="MS", help="bound on the TPOT percentile")
    p.add_argument("--percentile", type=int, default=None,
                   help=f"the SLO's percentile, one of {', '.join(map(str, PERCENTILES))} (default "
                        f"{DEFAULT_PERCENTILE}; not with --attainment)")
    p.add_argument("--attainment", type=float, default=None, metavar="F",
                   help="instead of a percentile: a point meets the SLO when at least this share of its requests "
                        "completed within both bounds (DistServe's goodput; e.g. 0.9)")
    p.add_argument("--min-rate", type=float, default=0.25, metavar="X",
                   help="lowest multiple of the trace's arrival rate searched (default 0.25)")
    p.add_argument("--max-rate", type=float, default=64.0, metavar="X",
                   help="highest multiple searched (default 64)")
    p.add_argument("--tolerance", type=float, default=0.05,
                   help="stop when the rates that met and missed are within this ratio (default 0.05)")
    p.add_argument("--jobs", type=int, default=None, help="worker processes, one search each (default: cores)")
    p.add_argument("--out", default="runs/capacity", help="output directory (default runs/capacity)")
    p.add_argument("--force", action="store_true", help="write into a non-empty --out that holds no capacity.json")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--no-progress", action="store_true")
    add_common(p)
    p.set_defaults(func=run)
    remember_defaults(p)
