"""`pwsim bench sim`: how fast the simulator runs (simulated tokens per wall-clock second).

Default workload (the acceptance figure): 1000 requests with lognormal output lengths of mean 512
tokens (median 452, sigma 0.5) and prompts of median 256 tokens, Poisson arrivals at 20 requests/s,
on the Qwen1.5-MoE-A2.7B card with the synthetic calibration, the H200 roofline profile, the
pagedweight planner and a 24 GiB budget (the KV cache is under pressure: the planner offloads and
reloads throughout). The simulation runs in a fresh worker process pinned to one core, with BLAS
limited to one thread; the report gives wall and CPU seconds, simulated tokens (prompt + output)
and output tokens per wall second, and the run's own summary numbers.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

from traces.clikit import UserError, check_counts, check_output, check_seed, report_bench

LIMIT_S = 60.0


def _child(cfg_json: dict, core: int | None) -> dict:
    if core is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {core})
    from pwsim.runner import RunConfig, build, run_simulation
    t0, c0 = time.perf_counter(), time.process_time()
    sim = build(RunConfig.from_json(cfg_json))
    t1, c1 = time.perf_counter(), time.process_time()
    res = run_simulation(sim)
    t2, c2 = time.perf_counter(), time.process_time()
    s = res.summary
    return {"setup_wall_s": t1 - t0, "run_wall_s": t2 - t1, "run_cpu_s": c2 - c1, "total_wall_s": t2 - t0,
            "total_cpu_s": c2 - c0, "iterations": s["iterations"], "computed_tokens": s["computed_tokens"],
            "output_tokens": s["output_tokens"], "completed": s["completed"], "requests": s["requests"],
            "simulated_s": s["makespan_s"], "plans": s["plans"], "preemptions": s["preemptions"],
            "budget_violations": s["memory"]["budget_violations"], "mean_committed_bits": s["mean_committed_bits"],
            "reloads": s["page_traffic"]["reloads"], "throughput_tokens_per_simulated_s": s["throughput_tokens_per_s"]}


def run_sim(args: argparse.Namespace) -> int:
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    from pwsim.cmd_run import parse_policy
    from pwsim.runner import SyntheticWorkload, make_config

    check_counts(("--requests", args.requests))
    check_seed(args.seed)
    if args.out:
        check_output(args.out, directory=False)
    params = parse_policy(args.policy, args.policy_arg)
    wl = SyntheticWorkload(requests=args.requests, rate=args.rate, burstiness=1.0, prompt=args.prompt_dist,
                           output=args.output_dist, features=not args.no_features)
    # the setup: the Qwen1.5-MoE-A2.7B card, a synthetic calibration and workload (not the demo default)
    cfg = make_config(args.budget, policy=args.policy, policy_params=params, workload=wl, seed=args.seed,
                      model="Qwen1.5-MoE-A2.7B", calibration="synthetic", trace="synthetic", quality_fit=None)
    core = None
    if not args.no_pin and hasattr(os, "sched_getaffinity"):
        allowed = sorted(os.sched_getaffinity(0))
        core = allowed[0] if args.cpu is None else args.cpu
        if core not in allowed:
            raise UserError(f"--cpu {core} is not available to this process (allowed: {allowed})")
    command = " ".join(["pwsim bench sim", f"--requests {args.requests}", f"--rate {args.rate}",
                        f"--prompt-dist {args.prompt_dist}", f"--output-dist {args.output_dist}",
                        f"--policy {args.policy}", *[f"--policy-arg {a}" for a in args.policy_arg],
                        f"--budget {args.budget}", f"--seed {args.seed}", *(["--no-features"] if args.no_features else []),
                        *(["--no-pin"] if args.no_pin else []), *(["--json"] if args.json else [])])
    env = {k: os.environ.get(k) for k in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    for k in env:
        os.environ[k] = "1"  # the worker's BLAS: one thread on its one core
    try:
        with ProcessPoolExecutor(max_workers=1, mp_context=mp.get_context("spawn")) as pool:
            r = pool.submit(_child, cfg.to_json(), core).result()
    finally:
        for k, v in env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    result = {"target": "sim", "command": command, "config": cfg.to_json(), "pinned_cpu": core,
              "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
              "python": sys.version.split()[0], **r,
              "sim_tokens_per_wall_s": r["computed_tokens"] / r["run_wall_s"],
              "output_tokens_per_wall_s": r["output_tokens"] / r["run_wall_s"],
              "limit_s": LIMIT_S, "under_limit": r["total_wall_s"] < LIMIT_S}

    def text(result: dict) -> None:
        print(f"simulated {r['requests']} requests ({r['computed_tokens']:,} tokens computed, {r['output_tokens']:,} "
              f"generated; {r['simulated_s']:.1f} simulated s, {r['iterations']:,} iterations) in "
              f"{r['run_wall_s']:.1f} wall s ({r['run_cpu_s']:.1f} CPU s) + {r['setup_wall_s']:.1f} s set-up")
        print(f"  {result['sim_tokens_per_wall_s']:,.0f} simulated tokens per wall s "
              f"({result['output_tokens_per_wall_s']:,.0f} output tokens per wall s); pinned core {core}")
        print(f"  plans {r['plans']['plans']}, reloads {r['reloads']}, preemptions {r['preemptions']}, "
              f"budget violations {r['budget_violations']}")

    return report_bench(result, command, args.out, args.json, text)


def register_target(targets) -> None:
    p = targets.add_parser("sim", help="simulator speed (simulated tokens per wall second)",
                           description="Time one simulation (default: 1000 requests of mean 512 output tokens, "
                                       "Qwen1.5-MoE-A2.7B, pagedweight, 24 GiB) in a worker pinned to one core.")
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--rate", type=float, default=20.0, help="requests per second (Poisson)")
    p.add_argument("--prompt-dist", default="lognormal:256,0.5,16,4096")
    p.add_argument("--output-dist", default="lognormal:452,0.5,16,4096", help="default: mean 512")
    p.add_argument("--policy", default="pagedweight")
    p.add_argument("--policy-arg", action="append", default=[], metavar="K=V")
    p.add_argument("--budget", default="24GiB")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-features", action="store_true", help="synthetic routing without input norms (no prompt features)")
    p.add_argument("--cpu", type=int, default=None, help="core to pin the worker to (default: the first allowed)")
    p.add_argument("--no-pin", action="store_true")
    p.add_argument("--json", action="store_true")
    p.add_argument("--out", default=None, help="also write the JSON result to this file")
    p.set_defaults(func=run_sim)
