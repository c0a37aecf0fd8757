"""Prompt-residual heads (paper Eqs. 5-6): one linear head per (block kind, transition b -> b').

Data. For a transition b -> b' (adjacent stored bitwidths) and every (sequence, block) pair of that
kind whose expert the sequence routed to: the measured damage `m = step[s, i, b] / weight[s, i]`
(the routing-weighted mean over the sequence's routed pairs of ||(W_b' - W_b) x||^2), the global
estimate `g = max(s[i, b'] - s[i, b], 0)` (both per routed pair), target `rho = log(m / g)` and
features phi[s, i]; pairs with m or g not positive are left out.

Fit. Features standardized on the training split, ridge-regularised least squares with an
unpenalised bias, then the standardization folded into the raw-feature weights and bias (the planner
applies `w . phi + a` to raw phi). Confidence = max(0, R^2 on the held-out split against the plain
global estimate, rho = 0): `1 - SSE / sum rho^2`, i.e. the fraction of the held-out log-residual
energy the head removes compared with not correcting g at all (a constant offset between measured
and global damage counts as explained). Clip bounds = the 5% / 95% quantiles of the held-out rho.
Too few points (< `min_points` in either split): an all-zero head with confidence 0.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from policies.calibration import NB
from pwruntime.calibrate.measure import SequenceStats


@dataclass(frozen=True)
class ResidualHead:
    weights: np.ndarray  # [3], applied to raw phi
    bias: float
    confidence: float
    clip: tuple[float, float]
    r2_heldout: float  # about the held-out mean (the usual R^2)
    r2_vs_global: float  # against rho = 0; the confidence is max(0, this)
    n_train: int
    n_heldout: int

    def predict(self, phi: np.ndarray) -> np.ndarray:
        return np.asarray(phi, dtype=np.float64) @ self.weights + self.bias

    def summary(self) -> dict:
        d = asdict(self)
        d["weights"] = [float(x) for x in self.weights]
        d["clip"] = [float(x) for x in self.clip]
        return {k: (None if isinstance(v, float) and not np.isfinite(v) else v) for k, v in d.items()}


def _empty(n_train: int, n_held: int) -> ResidualHead:
    return ResidualHead(np.zeros(3), 0.0, 0.0, (0.0, 0.0), float("nan"), float("nan"), n_train, n_held)


def fit_residual_head(x_train: np.ndarray, y_train: np.ndarray, x_held: np.ndarray, y_held: np.ndarray, *,
                      ridge: float = 1e-6, quantiles: tuple[float, float] = (0.05, 0.95),
                      min_points: int = 8) -> ResidualHead:
    """Least-squares head rho ~ w . phi + a; see the module docstring."""
    xt, yt = np.asarray(x_train, dtype=np.float64), np.asarray(y_train, dtype=np.float64)
    xh, yh = np.asarray(x_held, dtype=np.float64), np.asarray(y_held, dtype=np.float64)
    if len(yt) < min_points or len(yh) < min_points:
        return _empty(len(yt), len(yh))
    mu, sd = xt.mean(axis=0), xt.std(axis=0)
    sd = np.where(sd > 1e-12 * np.maximum(1.0, np.abs(mu)), sd, 1.0)
    z = (xt - mu) / sd
    y_mean = yt.mean()
    beta = np.linalg.solve(z.T @ z + ridge * len(yt) * np.eye(z.shape[1]), z.T @ (yt - y_mean))
    w = beta / sd
    a = float(y_mean - w @ mu)
    pred = xh @ w + a
    sse = float(((yh - pred) ** 2).sum())
    sst_mean = float(((yh - yh.mean()) ** 2).sum())
    sst_zero = float((yh ** 2).sum())
    r2 = 1.0 - sse / sst_mean if sst_mean > 0 else float("nan")
    r2_zero = 1.0 - sse / sst_zero if sst_zero > 0 else 0.0
    lo, hi = (float(q) for q in np.quantile(yh, quantiles))
    return ResidualHead(w, a, float(min(1.0, max(0.0, r2_zero))), (lo, hi), r2, r2_zero, len(yt), len(yh))


def residual_data(stats: SequenceStats, sensitivity: np.ndarray, kind: int, b: int,
                  b_low: int) -> tuple[np.ndarray, np.ndarray]:
    """(phi [m, 3], rho [m]) of the transition b -> b_low for blocks of `kind` (see the module docstring)."""
    blocks = np.arange(kind, sensitivity.shape[0], 2)
    with np.errstate(invalid="ignore"):
        g = np.maximum(sensitivity[blocks, b_low] - sensitivity[blocks, b], 0.0)
    wt = stats.weight[:, blocks]
    with np.errstate(divide="ignore", invalid="ignore"):
        m = stats.step[:, blocks, b] / wt
    ok = (wt > 0) & np.isfinite(m) & (m > 0) & np.isfinite(g)[None, :] & (g > 0)[None, :]
    s_idx, j = np.nonzero(ok)
    rho = np.log(m[s_idx, j] / g[j])
    return stats.phi[s_idx, blocks[j]], rho


@dataclass(frozen=True)
class HeadArrays:
    """The Calibration fields, indexed [kind, from_bits, to_bits, ...], and a per-head report."""

    weights: np.ndarray  # [2, NB, NB, 3]
    bias: np.ndarray  # [2, NB, NB]
    confidence: np.ndarray  # [2, NB, NB]
    clip: np.ndarray  # [2, NB, NB, 2]
    report: list


def fit_residual_heads(train: SequenceStats, held: SequenceStats, sensitivity: np.ndarray,
                       bits: tuple[int, ...], **fit_kw) -> HeadArrays:
    """One head per kind and adjacent transition of `bits` (the steps the planner scores)."""
    w, a = np.zeros((2, NB, NB, 3)), np.zeros((2, NB, NB))
    c, clip = np.zeros((2, NB, NB)), np.zeros((2, NB, NB, 2))
    report = []
    down = sorted(bits, reverse=True)
    for kind in (0, 1):
        for b, b_low in zip(down[:-1], down[1:]):
            xt, yt = residual_data(train, sensitivity, kind, b, b_low)
            xh, yh = residual_data(held, sensitivity, kind, b, b_low)
            head = fit_residual_head(xt, yt, xh, yh, **fit_kw)
            w[kind, b, b_low], a[kind, b, b_low] = head.weights, head.bias
            c[kind, b, b_low], clip[kind, b, b_low] = head.confidence, head.clip
            report.append({"kind": ("gate_up", "down")[kind], "from_bits": b, "to_bits": b_low,
                           "mean_rho_train": float(yt.mean()) if len(yt) else None, **head.summary()})
    return HeadArrays(w, a, c, clip, report)
