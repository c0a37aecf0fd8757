"""`pwsim policies`: the planners both engines can run, what each does, its parameters and their defaults."""
from __future__ import annotations

import argparse
import json

from policies.registry import REQUIRED, available, describe, summary


def policy_row(name: str) -> dict:
    """A policy's name, one line on it and its `--policy-arg` parameters (type and default for this name)."""
    return {"name": name, "summary": summary(name),
            "parameters": [{"name": p, "type": t, "default": d} for p, t, d in describe(name)]}


def _text(rows: list[dict]) -> str:
    """A line on each policy, then its parameters; a preset of a policy listed above it (the same parameters, some
    defaults changed: `pagedweight-no-routing` after `pagedweight`) lists only the defaults that differ."""
    lines = []
    shapes = [[(p["name"], p["type"]) for p in r["parameters"]] for r in rows]
    for i, r in enumerate(rows):
        lines.append(f"{r['name']}: {r['summary'] or '-'}")
        like = next((rows[j] for j in range(i) if shapes[i] and shapes[j] == shapes[i]), None)
        shown = [p for j, p in enumerate(r["parameters"]) if like is None or p != like["parameters"][j]]
        for p in shown:
            given = "required" if p["default"] == REQUIRED else f"default {p['default']}"
            lines.append(f"    --policy-arg {p['name']}=...  {p['type']}, {given}")
        if like is not None and len(shown) < len(shapes[i]):
            lines.append(f"    (its other parameters and their defaults: those of {like['name']})")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    rows = [policy_row(name) for name in (args.names or available())]
    if args.json:
        print(json.dumps(rows, indent=2, default=str))
    else:
        print(_text(rows))
        if not args.names:
            print("\nA planner of your own: --policy MODULE:CLASS or FILE.py:CLASS (a dataclass implementing "
                  "policies.Policy; its fields are its parameters), e.g. `pwsim policies "
                  "policies/examples/coldest_first.py:ColdestFirst`.")
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("policies", help="list the planners, their parameters and defaults",
                              description="List the planners `--policy` takes (or describe the ones named, a "
                                          "planner of your own as MODULE:CLASS or FILE.py:CLASS included): what "
                                          "each does and its `--policy-arg` parameters with their types and "
                                          "defaults.")
    p.add_argument("names", nargs="*", help="policies to describe (default: every built-in one)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)
