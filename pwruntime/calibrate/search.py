"""The planner's hyperparameters by a small deterministic search on held-out text at a fixed byte target.

A candidate fixes routing bucket bounds and multipliers, bitwidth-floor stages with their depth
caps, and the residual strength alpha. Its score: for every held-out sequence, the PagedWeight
planner (`policies.get("pagedweight")` with the candidate calibration) starts from the initial
assignment and takes one `plan_step` against a KV-pressure observation whose byte target is exactly
`target_bytes` (free blocks 0, threshold 0, one KV block of `target_bytes`), seeing that sequence's
routing mass and prompt features; the resulting bits are scored by the sequence's *measured*
held-out damage `sum_i err[s, i, bits_i]` (routing-weighted output error against full precision,
an independent measurement, not the planner's predictor). Score = total damage / total tokens
(lower is better). A candidate whose plan misses the target on any sequence ranks below every
candidate that meets it.

Search: coordinate descent from the default candidate over alpha, then the bucket set, then the
floor/cap set, then alpha again (17 distinct candidates); ties keep the earlier (incumbent) one.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
from tqdm import tqdm

from policies.contract import Observation, RoutingReadout
from policies.registry import get as get_policy
from pwruntime.calibrate.measure import SequenceStats

ALPHAS = (1.0, 0.0, 0.5, 2.0)
BUCKETS = (  # (cumulative expert fraction per bucket, hottest first; damage multipliers)
    ((0.25, 0.5, 1.0), (4.0, 2.0, 1.0)),
    ((0.25, 0.5, 1.0), (1.0, 1.0, 1.0)),
    ((0.25, 0.5, 1.0), (2.0, 1.5, 1.0)),
    ((0.25, 0.5, 1.0), (8.0, 3.0, 1.0)),
    ((0.125, 0.375, 1.0), (4.0, 2.0, 1.0)),
    ((0.125, 0.375, 1.0), (8.0, 3.0, 1.0)),
    ((0.375, 0.75, 1.0), (3.0, 1.5, 1.0)),
)
FLOORS = (  # (floor stages: floor bits per bucket; depth caps: most bits below the start, per stage)
    (((5, 4, 3), (4, 3, 3), (3, 3, 3)), (1, 2, 5)),
    (((5, 4, 3), (4, 3, 3), (3, 3, 3)), (3, 4, 5)),
    (((6, 5, 4), (5, 4, 3), (3, 3, 3)), (2, 3, 5)),
    (((4, 3, 3), (3, 3, 3)), (4, 5)),
    (((3, 3, 3),), (5,)),
)


@dataclass(frozen=True)
class Candidate:
    bucket_bounds: tuple[float, ...]
    bucket_multipliers: tuple[float, ...]
    floor_stages: tuple[tuple[int, ...], ...]
    depth_caps: tuple[int, ...]
    alpha: float

    def calibration(self, base):
        return replace(base, bucket_bounds=self.bucket_bounds, bucket_multipliers=self.bucket_multipliers,
                       floor_stages=self.floor_stages, depth_caps=self.depth_caps, alpha=float(self.alpha))

    def with_option(self, axis: str, option) -> "Candidate":
        if axis == "alpha":
            return replace(self, alpha=float(option))
        if axis == "buckets":
            return replace(self, bucket_bounds=option[0], bucket_multipliers=option[1])
        if axis == "floors":
            return replace(self, floor_stages=option[0], depth_caps=option[1])
        raise ValueError(f"unknown search axis {axis!r}")

    def to_json(self) -> dict:
        return {"bucket_bounds": list(self.bucket_bounds), "bucket_multipliers": list(self.bucket_multipliers),
                "floor_stages": [list(s) for s in self.floor_stages], "depth_caps": list(self.depth_caps),
                "alpha": self.alpha}


DEFAULT = Candidate(BUCKETS[0][0], BUCKETS[0][1], FLOORS[0][0], FLOORS[0][1], ALPHAS[0])
ROUNDS = (("alpha", ALPHAS), ("buckets", BUCKETS), ("floors", FLOORS), ("alpha", ALPHAS))


@dataclass(frozen=True)
class SearchProblem:
    table: object  # policies.PageTable of the model
    initial: np.ndarray  # [n] initial assignment
    target_bytes: int
    held: SequenceStats

    def damage(self, bits: np.ndarray) -> tuple[float, np.ndarray]:
        """(token-weighted mean per-token measured damage, per-sequence damage) of per-sequence bits [S, n]."""
        n = bits.shape[1]
        per_seq = self.held.err[np.arange(len(bits))[:, None], np.arange(n)[None, :], bits].sum(axis=1)
        return float(per_seq.sum() / self.held.tokens.sum()), per_seq / self.held.tokens


def evaluate(cal, problem: SearchProblem) -> dict:
    """Score one calibration (see the module docstring)."""
    table, held = problem.table, problem.held
    policy = get_policy("pagedweight")
    bits = np.repeat(problem.initial[None, :], held.num_sequences, axis=0)
    freed = []
    for s in range(held.num_sequences):
        policy.reset(table, cal)
        obs = Observation(step=0, time_s=0.0, free_blocks=0, total_blocks=1, kv_block_bytes=problem.target_bytes,
                          free_block_threshold=0, routing=RoutingReadout(held.mass[s], held.phi[s]))
        plan = policy.plan_step(table, obs)
        for t in plan.transitions if plan is not None else ():
            bits[s, t.block] = t.to_bits
        freed.append(plan.bytes_freed if plan is not None else 0)
    score, _ = problem.damage(bits)
    return {"score": score, "meets_target": bool(min(freed) >= problem.target_bytes),
            "min_bytes_freed": int(min(freed)), "mean_bits": float(bits.mean())}


def reference_rows(problem: SearchProblem, static_bits: np.ndarray, uniform_bits: int) -> list[dict]:
    """Scores of fixed assignments at (about) the same bytes, for comparison with the candidates."""
    rows = []
    S = problem.held.num_sequences
    M = problem.table.M
    n = M.shape[0]
    for name, b in (("initial assignment (no offload)", problem.initial),
                    (f"uniform {uniform_bits} bits", np.full(n, uniform_bits)),
                    ("static sensitivity-optimal at the target", static_bits)):
        b = np.asarray(b, dtype=np.int64)
        score, _ = problem.damage(np.repeat(b[None, :], S, axis=0))
        freed = int(M[np.arange(n), problem.initial].sum() - M[np.arange(n), b].sum())
        rows.append({"reference": name, "score": score, "bytes_freed": freed, "mean_bits": float(b.mean())})
    return rows


def search(base_cal, problem: SearchProblem, progress: bool = True) -> tuple[Candidate, list[dict]]:
    """(best candidate, score table in evaluation order); see the module docstring."""
    seen: dict[Candidate, dict] = {}
    order: list[Candidate] = []
    current = DEFAULT
    total = 1 + sum(len(opts) - 1 for _, opts in ROUNDS)  # each round's options include the incumbent's
    bar = tqdm(total=total, desc="search", unit="cand", disable=None if progress else True)
    for axis, options in ROUNDS:
        cands = [current] + [current.with_option(axis, o) for o in options]
        for c in cands:
            if c not in seen:
                seen[c] = evaluate(c.calibration(base_cal), problem)
                order.append(c)
                bar.update(1)
        current = min(cands, key=lambda c: (not seen[c]["meets_target"], seen[c]["score"]))
    bar.close()
    rows = [{"candidate": i, **c.to_json(), **seen[c], "chosen": c == current} for i, c in enumerate(order)]
    return current, rows

