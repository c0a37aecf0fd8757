"""`pwsim plan-log RUN [RUN ...]`: what each run's planner moved, where and why, and what it undid (`plan_stats`).

RUN is the result directory of a `pwsim run` or a `pwruntime replay`, or what `pwruntime serve --record-trace DIR`
wrote (each holds the plan log, `plans.parquet`).
Prints a summary per run (or `--json`); `--plot FILE` draws the transitions begun step by step and the GPU bytes
the reloads took back, those of round trips apart, one series per run.
"""
from __future__ import annotations

import argparse
import json

from pwsim.plan_stats import summarize
from traces.clikit import UserError, check_output
from traces.results import read_plan_log
from traces.sizes import format_size


def _read(path: str) -> dict:
    plans = read_plan_log(path, flag="pwsim plan-log")  # {} where the directory holds none
    if not plans:
        raise UserError(f"{path} holds no plan log (plans.parquet); give the --out of a `pwsim run` or a "
                        "`pwruntime replay`, or the --record-trace DIR of a `pwruntime serve` (each writes one)")
    return plans


def describe(label: str, s: dict) -> str:
    t, rt = s["transitions"], s["round_trips"]
    lines = [f"{label}: {t['started']} transitions begun on {s['planning_steps']} planning steps, {t['rejected']} "
             f"refused, {t['landed']} landed",
             f"  offloads {s['offloads']} (freed {format_size(s['freed_bytes'])} of GPU memory), reloads "
             f"{s['reloads']} (took back {format_size(s['taken_bytes'])})"]
    if rt["count"]:
        share = "" if rt["share_of_taken_bytes"] is None else f", {100 * rt['share_of_taken_bytes']:.0f}% of all"
        lines.append(f"  round trips (a block lowered, then raised again): {rt['count']} on {rt['blocks']} blocks, "
                     f"{rt['steps_apart_p50']:g} steps apart (median; min {rt['steps_apart_min']}); their reloads took "
                     f"back {format_size(rt['taken_bytes'])}{share}")
    else:
        lines.append("  round trips: none")
    per = lambda d: ", ".join(f"{k} {v['offloads']}/{v['reloads']}" for k, v in d.items())  # noqa: E731
    lines.append(f"  offloads/reloads by layer: {per(s['by_layer']) or '-'}; by kind: {per(s['by_kind']) or '-'}")
    if s["plan_reasons"]:
        lines.append("  plans' reasons: " + ", ".join(f"{r} {n}" for r, n in s["plan_reasons"].items()))
    if s["refusals"]:
        lines.append("  refused: " + "; ".join(f"{n} {r}" for r, n in s["refusals"].items()))
    if s["most_moved"]:
        lines.append("  most moved: " + ", ".join(f"block {m['block']} (layer {m['layer']} expert {m['expert']} "
                                                 f"{m['kind']}) {m['transitions']}" for m in s["most_moved"]))
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if args.label and len(args.label) != len(args.runs):
        raise UserError(f"give one --label for each RUN ({len(args.runs)}), or none")
    plot = check_output(args.plot, flag="--plot", directory=False) if args.plot is not None else None
    if plot is not None and plot.suffix.lower() != ".png":
        raise UserError(f"--plot {plot}: the plot is a PNG; give a file name ending in .png")
    labels = args.label or args.runs
    logs = [_read(r) for r in args.runs]
    summaries = [summarize(p) for p in logs]
    if plot is not None:
        from pwsim import output, plots
        output.write_files(plot.parent, {plot.name: lambda p: plots.plan_log(dict(zip(labels, logs)), summaries, p)})
    if args.json:
        print(json.dumps([{"run": r, "label": lab, **s} for r, lab, s in zip(args.runs, labels, summaries)],
                         indent=2))
    else:
        print("\n".join(describe(lab, s) for lab, s in zip(labels, summaries)))
        if plot is not None:
            print(f"wrote {plot}")
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("plan-log", help="what a run's planner moved, where, why, and what it undid",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", metavar="RUN", help="result directory of a `pwsim run` or `pwruntime replay`")
    p.add_argument("--label", action="append", default=[], help="a name for each RUN, in order (default: its path)")
    p.add_argument("--plot", default=None, metavar="FILE", help="also draw the runs' plan logs into this PNG")
    p.add_argument("--json", action="store_true", help="print the summaries as JSON")
    p.set_defaults(func=run)
