"""The hyperparameter search (pwruntime.calibrate.search) on a planted held-out set."""
from __future__ import annotations

import json

import numpy as np

from policies.calibration import NB, Calibration
from policies.page_table import PageTable
from pwruntime.calibrate.measure import SequenceStats
from pwruntime.calibrate.search import DEFAULT, SearchProblem, evaluate, reference_rows, search

BITS = (3, 4, 5, 6, 7, 8)


def _problem(seed: int = 0):
    """Equal global sensitivity everywhere; the held-out damage scales with each expert's routing mass,
    and the hot experts have the lowest indices (where the planner's tie-break would start)."""
    rng = np.random.default_rng(seed)
    L, E, S = 1, 8, 4
    table = PageTable(L, E, 64, 32, bits=BITS)
    n = table.num_blocks
    sens = np.full((n, NB), np.nan)
    sens[:, list(BITS)] = 4.0 ** (8 - np.array(BITS, dtype=float))
    mass = np.full((S, L, E), 0.2 / 6)
    mass[:, :, :2] = 0.4
    mass *= rng.uniform(0.9, 1.1, mass.shape)
    mass /= mass.sum(axis=2, keepdims=True)
    tokens = np.full(S, 100)
    err = np.full((S, n, NB), np.nan)
    per_block = np.repeat(mass[:, 0, :], 2, axis=1)  # [S, n]: the expert's mass for both blocks
    err[:, :, list(BITS)] = tokens[:, None, None] * per_block[:, :, None] * sens[None, :, list(BITS)]
    z = np.zeros((S, n))
    held = SequenceStats(tokens, z, z, err, err, err, np.zeros((S, n, 3)), mass)
    init = np.full(n, 8)
    target = int(table.M[:, 8].sum() - table.M[:, 5].sum())
    cal = Calibration(fingerprint="arch:test", layers=L, experts=E, bits=BITS, sensitivity=sens, initial_bits=init)
    return table, cal, SearchProblem(table, init, target, held)


def test_routing_protection_scores_better_when_hot_experts_take_the_damage():
    table, cal, problem = _problem()
    flat = evaluate(DEFAULT.with_option("buckets", ((0.25, 0.5, 1.0), (1.0, 1.0, 1.0))).calibration(cal), problem)
    protected = evaluate(DEFAULT.with_option("buckets", ((0.25, 0.5, 1.0), (8.0, 3.0, 1.0))).calibration(cal),
                         problem)
    assert flat["meets_target"] and protected["meets_target"]
    assert protected["score"] < 0.8 * flat["score"]
    refs = {r["reference"]: r for r in reference_rows(problem, np.full(table.num_blocks, 5), 5)}
    assert refs["initial assignment (no offload)"]["bytes_freed"] == 0
    assert refs["uniform 5 bits"]["bytes_freed"] == problem.target_bytes
    assert protected["score"] < refs["uniform 5 bits"]["score"]


def test_search_is_small_deterministic_and_picks_a_protecting_candidate():
    _, cal, problem = _problem()
    best, rows = search(cal, problem, progress=False)
    assert len(rows) <= 17 and len({json.dumps(r, sort_keys=True) for r in rows}) == len(rows)
    assert sum(r["chosen"] for r in rows) == 1
    chosen = next(r for r in rows if r["chosen"])
    assert chosen["meets_target"] and chosen["score"] <= rows[0]["score"]  # never worse than the default
    assert best.bucket_multipliers[0] > best.bucket_multipliers[-1]
    best2, rows2 = search(cal, problem, progress=False)
    assert best2 == best and rows2 == rows
