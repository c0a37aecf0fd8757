"""`pwsim chrome-trace`: result directories as one Chrome trace, to look at in Perfetto (ui.perfetto.dev) or
chrome://tracing.

Give the --out of any `pwsim run`, `pwruntime replay` or `pwruntime bench serve` (several: each becomes a process of
the trace, in the order given, on the trace's clock): their iterations (a replay's phases nested inside), the
requests running and waiting, the KV pool and the experts' mean bits as counters, a simulation's link transfers,
stalls and plans, and every request from arrival to first token to end (traces/chrome_trace.py). A simulation and a
runtime replay of one trace side by side show where their iterations part.
"""
from __future__ import annotations

import argparse
import json

from traces.clikit import UserError, check_output, write_text_atomic, writing


def register(subparsers) -> None:
    p = subparsers.add_parser("chrome-trace", help="result directories as a Chrome trace (Perfetto, chrome://tracing)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", nargs="+", metavar="DIR",
                   help="result directories (`pwsim run`, `pwruntime replay`, `pwruntime bench serve`)")
    p.add_argument("--label", action="append", default=None, metavar="NAME",
                   help="the name of each DIR's process in the trace, in order (default: its folder and tool)")
    p.add_argument("--out", default="runs/chrome-trace.json", help="the trace file (default runs/chrome-trace.json)")
    p.add_argument("--json", action="store_true", help="print what was written as JSON (the file, its events, the "
                                                       "directories and their processes' names)")
    p.set_defaults(func=run)


def run(args) -> int:
    from traces.chrome_trace import chrome_trace

    if args.label is not None and len(args.label) != len(args.results):
        raise UserError(f"give one --label per result directory ({len(args.results)}), got {len(args.label)}")
    check_output(args.out, directory=False)
    trace = chrome_trace(args.results, args.label)
    with writing(args.out):
        write_text_atomic(args.out, json.dumps(trace, separators=(",", ":"), allow_nan=False))
    if args.json:
        names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "process_name"}
        print(json.dumps({"out": str(args.out), "events": len(trace["traceEvents"]), "results": args.results,
                          "processes": [names[pid] for pid in sorted(names)]}, indent=2))
    else:
        print(f"wrote {args.out}: {len(trace['traceEvents'])} events from {', '.join(args.results)}; open it in "
              "https://ui.perfetto.dev or chrome://tracing")
    return 0
