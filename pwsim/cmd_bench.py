"""`pwsim bench TARGET`: benchmarks that print the command reproducing them and write JSON.

Targets are registered in `_TARGETS` (one function each that adds its sub-parser); `planner` times
`policy.plan_step` at the page-table sizes of the bundled model cards under a KV-pressure workload.

The planner workload (per card; synthetic calibration with `initial_mean_bits`, seeded): a decode
batch of up to `max_batch` requests with lognormal prompt (mean 1500 tokens) and output (mean 400)
lengths, 16-token KV blocks of the card's KV bytes, new requests arriving while the batch has room,
the newest requests preempted when the KV pool is full. The pool is the budget left after the
expert weights, sized to hold 80% of the mean demand, so the free blocks cross the threshold often
and the planner both offloads and reloads. Offloads land one step after they begin, reloads two;
the page table is driven through its protocol. Routing mass is Zipf-skewed per layer and drifts
(two experts of every layer swap every 64 steps); prompt features jitter every step. Each
`plan_step` is timed in wall-clock and in thread CPU time (`time.thread_time_ns`, which excludes
time the process waits for a core), on one pinned core unless `--no-pin`.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

from traces.clikit import UserError, check_output, report_bench, text_table

BLOCK_TOKENS = 16
LIMIT_MS = 2.0  # the acceptance bound at the Gemma-4-26B-A4B size


# ------------------------------------------------------------------------------ planner workload
class _Workload:
    def __init__(self, rng: np.random.Generator, max_batch: int) -> None:
        self.rng, self.max_batch = rng, max_batch
        self.running: list[list[int]] = []  # [tokens so far, tokens still to generate]

    def _new(self) -> list[int]:
        prompt = int(np.clip(self.rng.lognormal(np.log(1500) - 0.18, 0.6), 64, 8192))
        out = int(np.clip(self.rng.lognormal(np.log(400) - 0.18, 0.6), 16, 4096))
        return [prompt, out]

    def advance(self) -> None:
        for r in self.running:
            r[0] += 1
            r[1] -= 1
        self.running = [r for r in self.running if r[1] > 0]
        while len(self.running) < self.max_batch and self.rng.random() < 0.35:
            self.running.append(self._new())

    def demand(self) -> int:
        return sum(-(-r[0] // BLOCK_TOKENS) for r in self.running)

    def pending(self) -> int:
        return sum(1 for r in self.running if r[0] % BLOCK_TOKENS == 0)

    def preempt_to(self, capacity: int) -> None:
        while self.running and self.demand() > capacity:
            self.running.pop()  # newest first; it would be recomputed later


def _stats(values: list[float]) -> dict:
    if not values:
        return {"median": None, "p99": None, "max": None, "mean": None}
    a = np.asarray(values)
    return {"median": float(np.median(a)), "p99": float(np.percentile(a, 99)), "max": float(a.max()),
            "mean": float(a.mean())}


def bench_planner_card(spec, policy_name: str, policy_kwargs: dict, steps: int, seed: int,
                       initial_mean_bits: float, max_batch: int, warmup: int = 5, progress=None) -> dict:
    """Time plan_step for one model card's page table; returns the per-card result row."""
    import policies
    from policies import Observation, RoutingReadout
    from policies.synthetic import synthetic_calibration, synthetic_features, synthetic_routing_mass

    table = spec.page_table()
    cal = synthetic_calibration(spec, seed=seed, initial_mean_bits=initial_mean_bits)
    policy = policies.get(policy_name, **policy_kwargs)
    policy.reset(table, cal)
    rng = np.random.default_rng(seed)
    B = spec.kv_bytes_per_token() * BLOCK_TOKENS
    work = _Workload(rng, max_batch)
    mean_demand = max_batch * (1500 + 200) / BLOCK_TOKENS
    budget = policies.planners.weight_bytes(policy, table) + int(0.8 * mean_demand) * B
    L, E = table.layers, table.experts
    mass = synthetic_routing_mass(L, E, seed=seed)
    phi0 = synthetic_features(table.num_blocks, seed=seed)
    landing: list[tuple[int, int]] = []  # (step it lands, block)
    wall, cpu, pressure_cpu = [], [], []
    counts = {"offload_plans": 0, "reload_plans": 0, "transitions": 0, "pressure_steps": 0, "preemptions": 0}
    min_free = None
    for step in range(steps):
        for due, i in [x for x in landing if x[0] <= step]:
            (table.finish_reload if table.target[i] > table.q[i] else table.finish_offload)(i)
        landing = [x for x in landing if x[0] > step]
        work.advance()
        cap = max(0, (budget - policies.planners.weight_bytes(policy, table)) // B)
        before = len(work.running)
        work.preempt_to(cap)
        counts["preemptions"] += before - len(work.running)
        free = cap - work.demand()
        min_free = free if min_free is None else min(min_free, free)
        if step % 64 == 63:
            for l in range(L):
                a, b = rng.choice(E, 2, replace=False)
                mass[l, [a, b]] = mass[l, [b, a]]
        phi = phi0 * rng.lognormal(0.0, 0.1, (table.num_blocks, 1))
        obs = Observation(step=step, time_s=0.0, free_blocks=free, total_blocks=cap, kv_block_bytes=B,
                          free_block_threshold=cal.free_block_threshold, pending_kv_blocks=work.pending(),
                          num_running=len(work.running), routing=RoutingReadout(mass, phi))
        c0, w0 = time.thread_time_ns(), time.perf_counter_ns()
        plan = policy.plan_step(table, obs)
        w1, c1 = time.perf_counter_ns(), time.thread_time_ns()
        last = getattr(policy, "last", None)
        pressured = bool(getattr(last, "pressure", False))
        if step >= warmup:
            wall.append((w1 - w0) / 1e6)
            cpu.append((c1 - c0) / 1e6)
            if pressured:
                pressure_cpu.append((c1 - c0) / 1e6)
        counts["pressure_steps"] += pressured
        if plan is not None:
            counts["offload_plans" if plan.transitions[0].to_bits < plan.transitions[0].from_bits else
                   "reload_plans"] += 1
            counts["transitions"] += len(plan)
            for t in plan.transitions:
                if t.in_place:
                    table.commit_in_place(t.block, t.to_bits)
                elif t.to_bits < t.from_bits:
                    table.begin_offload(t.block, t.to_bits)
                    landing.append((step + 1, t.block))
                else:
                    table.begin_reload(t.block, t.to_bits)
                    landing.append((step + 2, t.block))
        if progress is not None:
            progress.update(1)
    cpu_s = _stats(cpu)
    return {
        "model": spec.name, "layers": table.layers, "experts": table.experts, "hidden": spec.hidden,
        "intermediate": spec.expert_intermediate, "blocks": table.num_blocks, "kv_block_bytes": B,
        "pool_blocks_at_start": int(0.8 * mean_demand), "steps": steps, "timed_steps": len(cpu), **counts,
        "min_free_blocks": min_free, "mean_bits_at_end": table.mean_bits(),
        "wall_ms": _stats(wall), "cpu_ms": cpu_s, "cpu_ms_under_pressure": _stats(pressure_cpu),
        "p99_cpu_under_2ms": cpu_s["p99"] is not None and cpu_s["p99"] < LIMIT_MS,
    }


def _pin(cpu: int | None) -> int | None:
    if not hasattr(os, "sched_setaffinity"):
        return None
    allowed = sorted(os.sched_getaffinity(0))
    core = allowed[0] if cpu is None else cpu
    if core not in allowed:
        raise UserError(f"--cpu {core} is not available to this process (allowed: {allowed})")
    os.sched_setaffinity(0, {core})
    return core


def _table(rows: list[dict]) -> str:
    head = ("model", "blocks", "plans off/rel", "cpu median ms", "cpu p99 ms", "wall median ms", "wall p99 ms")
    body = [(r["model"], f"{r['blocks']:,}", f"{r['offload_plans']}/{r['reload_plans']}",
             f"{r['cpu_ms']['median']:.3f}", f"{r['cpu_ms']['p99']:.3f}", f"{r['wall_ms']['median']:.3f}",
             f"{r['wall_ms']['p99']:.3f}") for r in rows]
    return text_table(head, body, left=1)


def run_planner(args: argparse.Namespace) -> int:
    import policies
    from policies.page_table import DEFAULT_BITS
    from traces.model_card import available_cards, load_card

    try:
        kwargs = policies.parse_policy_args(args.policy, args.policy_arg)
        policies.get(args.policy, **kwargs)
    except policies.PolicyError as e:
        raise UserError(str(e)) from None
    names = available_cards() if args.models == "all" else [m.strip() for m in args.models.split(",") if m.strip()]
    if not names:
        raise UserError("--models needs at least one card name, or 'all' (see `pwsim models`)")
    specs = [load_card(n) for n in names]
    for flag, value, least in (("--warmup", args.warmup, 0), ("--max-batch", args.max_batch, 1),
                               ("--seed", args.seed, 0)):
        if value < least:
            raise UserError(f"{flag} must be at least {least}, got {value}")
    lo, hi = min(DEFAULT_BITS), max(DEFAULT_BITS)
    if not lo <= args.initial_mean_bits <= hi:  # NaN too
        raise UserError(f"--initial-mean-bits must be a finite number from {lo} to {hi} (the bitwidths the cards' "
                        f"tables hold), got {args.initial_mean_bits:g}")
    if args.steps <= args.warmup:
        raise UserError(f"--steps must exceed the {args.warmup} warm-up steps")
    if args.out:
        check_output(args.out, directory=False)
    core = None if args.no_pin else _pin(args.cpu)
    command = " ".join(["pwsim bench planner", f"--models {','.join(s.name for s in specs)}",
                        f"--policy {args.policy}", *[f"--policy-arg {a}" for a in args.policy_arg],
                        f"--steps {args.steps}", f"--seed {args.seed}", f"--initial-mean-bits {args.initial_mean_bits}",
                        f"--max-batch {args.max_batch}", *(["--no-pin"] if args.no_pin else
                                                           ([f"--cpu {args.cpu}"] if args.cpu is not None else [])),
                        *(["--json"] if args.json else []), *([f"--out {args.out}"] if args.out else [])])
    bar = None
    if not args.no_progress:
        from tqdm import tqdm
        bar = tqdm(total=len(specs) * args.steps, desc="plan_step", unit="step", file=sys.stderr, leave=False)
    try:
        rows = [bench_planner_card(s, args.policy, kwargs, args.steps, args.seed, args.initial_mean_bits,
                                   args.max_batch, args.warmup, bar) for s in specs]
    except policies.PolicyError as e:
        raise UserError(str(e)) from None
    finally:
        if bar is not None:
            bar.close()
    result = {"target": "planner", "command": command, "policy": args.policy, "policy_params": kwargs,
              "steps": args.steps, "warmup_steps": args.warmup, "seed": args.seed,
              "initial_mean_bits": args.initial_mean_bits, "max_batch": args.max_batch, "pinned_cpu": core,
              "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
              "numpy": np.__version__, "python": sys.version.split()[0], "limit_ms": LIMIT_MS, "models": rows}

    def text(result: dict) -> None:
        print(_table(rows))
        print(f"\ncpu = thread CPU time per plan_step (pinned core {core}); first {args.warmup} steps not timed.")

    return report_bench(result, command, args.out, args.json, text)


def _register_planner(targets) -> None:
    p = targets.add_parser("planner", help="time plan_step at the model cards' table sizes",
                           description="Time policy.plan_step at the page-table size of each bundled model card "
                                       "under a KV-pressure workload (see pwsim/cmd_bench.py).")
    p.add_argument("--models", default="all", help="comma-separated card names, or 'all' (default)")
    p.add_argument("--policy", default="pagedweight", help="policy name (default pagedweight)")
    p.add_argument("--policy-arg", action="append", default=[], metavar="K=V", help="policy parameter (repeatable)")
    p.add_argument("--steps", type=int, default=600, help="plan steps per model (default 600)")
    p.add_argument("--warmup", type=int, default=5, help="first steps not timed (default 5)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--initial-mean-bits", type=float, default=7.0,
                   help="mean bitwidth of the synthetic calibration's initial assignment, 3 to 8 (default 7.0)")
    p.add_argument("--max-batch", type=int, default=32, help="running requests at most (default 32)")
    p.add_argument("--cpu", type=int, default=None, help="core to pin to (default: the first allowed)")
    p.add_argument("--no-pin", action="store_true", help="do not pin the process to one core")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--out", default=None, help="also write the JSON result to this file")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run_planner)


def _register_sim(targets) -> None:
    from pwsim.bench_sim import register_target  # the simulator's own benchmark (pwsim/bench_sim.py)
    register_target(targets)


def _register_scheduler(targets) -> None:
    from pwsim.bench_scheduler import register_target  # the shared scheduler's step (pwsim/bench_scheduler.py)
    register_target(targets)


# a new target: a function that adds its parser to `targets`
_TARGETS = [_register_planner, _register_sim, _register_scheduler]


def register(subparsers) -> None:
    p = subparsers.add_parser("bench", help="benchmarks (planner step time, ...)",
                              description="Benchmarks. Each prints the command that reproduces it and can write JSON.")
    targets = p.add_subparsers(dest="target", metavar="TARGET")
    for add in _TARGETS:
        add(targets)

    def _no_target(_args: argparse.Namespace) -> int:
        raise UserError(f"choose a benchmark target: {', '.join(sorted(targets.choices))} "
                        "(e.g. `pwsim bench planner --json`)")

    p.set_defaults(func=_no_target)
