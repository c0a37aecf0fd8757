"""Independent simulations on worker processes: `map_jobs`, in order, with a progress bar; one job runs in-process.

Each job must be fully determined by its arguments (seeded configs), so results do not depend on the number of
workers or the order they finish in. Workers are spawned (no inherited state) and use one core each.
"""
from __future__ import annotations

import os
import sys
from concurrent.futures import ProcessPoolExecutor, as_completed
from typing import Any, Callable, Sequence

from traces.clikit import UserError


def worker_count(requested: int | None, n_jobs: int) -> int:
    """`requested` workers (`--jobs`; default: the cores this process may use), at most one per job."""
    if requested is not None and requested < 1:
        raise UserError(f"--jobs must be at least 1, got {requested} (leave it out to use every available core)")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(n_jobs, requested if requested else cores))


def map_jobs(fn: Callable, args: Sequence[tuple], workers: int, desc: str, unit: str,
             progress: bool = True) -> list[Any]:
    """[fn(*a) for a in args], on `workers` processes when more than one (fn must be importable: a module-level
    function). The first failure cancels the jobs not started and is raised."""
    from tqdm import tqdm
    results: dict[int, Any] = {}
    # disable=None: a bar on a terminal only, as `pwsim run`'s (piped into a log, it wrote every refresh)
    bar = tqdm(total=len(args), desc=desc, unit=unit, file=sys.stderr, disable=None if progress else True)
    try:
        if workers == 1:
            for k, a in enumerate(args):
                results[k] = fn(*a)
                bar.update(1)
        else:
            import multiprocessing as mp
            os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # one core per worker
            os.environ.setdefault("OMP_NUM_THREADS", "1")
            with ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("spawn")) as pool:
                futs = {pool.submit(fn, *a): k for k, a in enumerate(args)}
                try:
                    for f in as_completed(futs):
                        results[futs[f]] = f.result()
                        bar.update(1)
                except BaseException:  # a job failed (e.g. a user error in a worker): do not start the others
                    for f in futs:
                        f.cancel()
                    raise
    finally:
        bar.close()
    return [results[k] for k in range(len(args))]
