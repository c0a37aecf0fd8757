"""`pwsim bench scheduler`: the host time of the shared scheduler's step (policies.scheduler over a KV pool), which
both engines pay every iteration, at a model card's KV layouts: one table and, for a card with sliding-window layers,
its hybrid KV groups (policies.kv_groups).

Workload (seeded): `rows` length-only sequences with prompts drawn from [context_min, context_max] tokens, admitted
and prefilled in chunks of `max_num_batched_tokens` (not timed), then `steps` decode steps of every sequence at once.
A timed step is what an engine's iteration asks of the policies: `schedule()`, `pending_blocks()` (the planner's
observation) and `postprocess()` (the simulator's: no token ids). The pool holds every sequence to the end (no
preemption), as at a budget with room. The least, over `rounds`, of the mean step time, wall clock.
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

from traces.clikit import UserError, check_counts, check_output, pyplot, report_bench, text_table, write_png

BLOCK_TOKENS = 16


def bench_layout(card, hybrid: bool, args: argparse.Namespace) -> dict | None:
    """One row: the card's layout (None where `hybrid` would be the same single table)."""
    from policies.kv_groups import new_pool
    from policies.scheduler import Scheduler
    from policies.sequence import Sequence

    layout = card.kv_layout(BLOCK_TOKENS, hybrid=hybrid)
    if hybrid and not layout.hybrid:
        return None
    rng = random.Random(args.seed)
    prompts = [rng.randint(args.context_min, args.context_max) for _ in range(args.rows)]
    # the steps a sequence may decode: those timed, and those while later prompts are prefilled
    decode_steps = args.rounds * args.steps + sum(prompts) // args.max_num_batched_tokens + args.rows + 8
    pages = sum(layout.pages(0, p + decode_steps + 1) for p in prompts)
    pool = new_pool(layout, pages)
    sched = Scheduler(pool, max_num_seqs=args.rows, max_num_batched_tokens=args.max_num_batched_tokens)
    seqs = [Sequence(i, prompt_len=p, max_tokens=decode_steps + 2, eos_token_id=None) for i, p in enumerate(prompts)]
    for seq in seqs:
        sched.add(seq)
    while any(s.num_computed_tokens < s.prompt_len for s in seqs):   # admission and prefill, not timed
        sched.postprocess(sched.schedule())

    def step() -> None:
        batch = sched.schedule()
        sched.pending_blocks()
        sched.postprocess(batch)

    best = float("inf")
    for _ in range(args.rounds):
        start = time.perf_counter()
        for _ in range(args.steps):
            step()
        best = min(best, (time.perf_counter() - start) / args.steps)
    if sched.num_preemptions or len(sched.running) != args.rows:
        raise RuntimeError("the bench's pool preempted or finished a sequence; it is sized to run them all")
    return {"model": card.name, "layout": "hybrid" if layout.hybrid else "one table", "groups": len(layout.groups),
            "pages": pages, "step_ms": 1e3 * best, "us_a_sequence": 1e6 * best / args.rows}


def plot(res: dict, png: Path) -> Path:
    plt = pyplot()
    rows = res["rows"]
    fig, ax = plt.subplots(figsize=(max(4.0, 1.3 * len(rows)), 3.6))
    ax.bar(range(len(rows)), [r["step_ms"] for r in rows])
    ax.set_xticks(range(len(rows)), [f"{r['model']}\n{r['layout']} ({r['groups']})" for r in rows], fontsize=7)
    ax.set_ylabel("ms a decode step")
    ax.set_title(f"schedule + pending_blocks + postprocess, {res['config']['rows']} sequences", fontsize=9)
    return write_png(fig, png)


def run_scheduler(args: argparse.Namespace) -> int:
    from traces.model_card import load_card

    names = [m.strip() for m in args.models.split(",") if m.strip()]
    if not names:
        raise UserError("--models needs at least one card name (see `pwsim models`)")
    cards = [load_card(n) for n in names]   # an unknown name is a UserError naming the cards there are
    check_counts(("--rows", args.rows), ("--steps", args.steps), ("--rounds", args.rounds),
                 ("--context-min", args.context_min), ("--max-num-batched-tokens", args.max_num_batched_tokens))
    if args.context_max < args.context_min:
        raise UserError(f"--context-max ({args.context_max}) must be at least --context-min ({args.context_min})")
    if args.out:
        check_output(args.out, directory=False)
    command = " ".join(["pwsim bench scheduler", f"--models {','.join(c.name for c in cards)}", f"--rows {args.rows}",
                        f"--context-min {args.context_min}", f"--context-max {args.context_max}",
                        f"--max-num-batched-tokens {args.max_num_batched_tokens}", f"--steps {args.steps}",
                        f"--rounds {args.rounds}", f"--seed {args.seed}", *(["--json"] if args.json else []),
                        *([f"--out {args.out}"] if args.out else [])])
    rows = [r for c in cards for h in (False, True) if (r := bench_layout(c, h, args)) is not None]
    config = {k: getattr(args, k) for k in ("rows", "context_min", "context_max", "max_num_batched_tokens", "steps",
                                            "rounds", "seed")}
    result = {"target": "scheduler", "command": command, "config": config, "python": sys.version.split()[0],
              "rows": rows}

    def text(result: dict) -> None:
        body = [(r["model"], r["layout"], str(r["groups"]), f"{r['step_ms']:.3f}", f"{r['us_a_sequence']:.1f}")
                for r in rows]
        print(text_table(("model", "layout", "groups", "ms a step", "us a sequence"), body))
        print(f"\n{args.rows} decoding sequences; least mean of {args.rounds} x {args.steps} steps")

    return report_bench(result, command, args.out, args.json, text, plot)


def register_target(targets) -> None:
    p = targets.add_parser("scheduler", help="the shared scheduler's host time a decode step, one table and hybrid",
                           description="Time the scheduler's step (schedule, pending_blocks, postprocess) over a KV "
                                       "pool at each card's layouts (see pwsim/bench_scheduler.py).")
    p.add_argument("--models", default="Gemma-4-26B-A4B", help="comma-separated card names (default Gemma-4-26B-A4B)")
    p.add_argument("--rows", type=int, default=48, help="decoding sequences (default 48)")
    p.add_argument("--context-min", type=int, default=1500)
    p.add_argument("--context-max", type=int, default=6000)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="the prefill's chunks (default 2048)")
    p.add_argument("--steps", type=int, default=64, help="timed steps a round (default 64)")
    p.add_argument("--rounds", type=int, default=5, help="rounds; the least mean counts (default 5)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--out", default=None, help="also write the JSON result to this file (a PNG beside it)")
    p.set_defaults(func=run_scheduler)
