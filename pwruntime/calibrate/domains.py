"""Per-domain measured damages E_d[i, b] for the simulator's quality model (independent of the planner).

pwsim's quality model adds, for every generated token and every expert the token is routed to, the
damage `E_d[i, q_i]` of both of that expert's blocks. So E_d is a damage *per routed (token, slot)
pair*: over the domain's held-out text,

    E_d[i, b] = sum r ||(W_b - W_top) x||^2 / (number of pairs routed to the block's expert)

(the `rel` measurement of `measure`; r the routing weight, x the block input), 0 at the top stored
bitwidth, NaN where b is not stored. A block the domain's text never routed to gets the same
per-pair damage measured over all calibration and domain text (`fallback`), else 0.
Also returned: the domain's routing frequency `pairs per token` of each (layer, expert), which with
E_d gives the expected per-token damage of an assignment (`expected_token_damage`).
"""
from __future__ import annotations

import numpy as np

from pwruntime.calibrate.measure import SequenceStats


def per_pair_damage(stats: SequenceStats) -> tuple[np.ndarray, np.ndarray]:
    """(rel damage per routed pair [n, NB] (NaN where no pair), pairs [n]) summed over sequences."""
    pairs = stats.pairs.sum(axis=0)
    rel = stats.rel.sum(axis=0)
    with np.errstate(divide="ignore", invalid="ignore"):
        per = rel / pairs[:, None]
    per[pairs == 0] = np.nan
    return per, pairs


def domain_damage(stats: SequenceStats, bits: tuple[int, ...], layers: int, experts: int,
                  fallback: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(E_d [n, NB], routing frequency [layers, experts] in pairs per token) of one domain's sequences."""
    per, pairs = per_pair_damage(stats)
    cols = list(bits)
    missing = pairs == 0
    if fallback is not None:
        per[np.ix_(missing, cols)] = fallback[np.ix_(missing, cols)]
    still = missing & ~np.isfinite(per[:, cols]).all(axis=1)
    per[np.ix_(still, cols)] = 0.0
    per[:, max(bits)] = 0.0
    freq = pairs[0::2].reshape(layers, experts) / float(stats.tokens.sum())
    return per, freq


def expected_token_damage(E: np.ndarray, freq: np.ndarray, bits: np.ndarray) -> float:
    """Mean damage per token of assignment `bits` [n]: sum over experts of freq * (E[gate_up] + E[down])."""
    n = E.shape[0]
    per_block = E[np.arange(n), np.asarray(bits, dtype=np.int64)]
    return float((np.nan_to_num(per_block).reshape(-1, 2).sum(axis=1) * freq.reshape(-1)).sum())
