"""The simulator's quality model: measured per-domain damage accrued per generated token, and its
mapping to perplexity. Independent of every planner's own predictor.

Accrual: a generated token of a request from domain `d` adds, for every MoE layer and every expert
it is routed to (its top-k), the measured damage `E_d[i, q_i]` (`Calibration.domain_damage[d]`) of
both linear-blocks of that expert (gate_up and down) at their committed bits at the time the token
is computed. Domains the calibration has no damages for use the mean over the domains it has
(counted as `fallback_tokens`).

Perplexity: `log ppl = a + b * damage` (damage = mean per-token damage of a run), fit by least
squares on (damage, ppl) points measured by the runtime (a JSON file, `load_fit_points`). Without
such points the fit is *unmeasured* and no perplexity is predicted: the summary reports damage only.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from traces.clikit import UserError


class QualityError(UserError):
    """A quality-fit file is missing or malformed."""


@dataclass(frozen=True)
class PerplexityFit:
    """`log ppl = a + b * damage`; `measured` only when fit on runtime measurements.

    `relative`: the points carried domains, so the fit is of log(ppl / the domain's least-damaged
    ppl), and `predict` returns a perplexity ratio to full precision (domains start from different
    perplexities, so one absolute fit across them would mostly fit the domains, not the damage)."""

    a: float
    b: float
    r2: float
    n_points: int
    measured: bool
    source: str = ""
    relative: bool = False

    def predict(self, damage: float) -> float:
        return float(math.exp(self.a + self.b * damage))


def fit_perplexity(damage: np.ndarray, ppl: np.ndarray, source: str = "",
                   domains: list[str] | None = None) -> PerplexityFit:
    """Least-squares fit of log ppl on damage; needs at least two distinct damages. With `domains`,
    each point's ppl is first divided by its domain's least-damaged ppl (a relative fit)."""
    x = np.asarray(damage, dtype=np.float64)
    y = np.log(np.asarray(ppl, dtype=np.float64))
    if domains is not None:
        dom = np.asarray(domains)
        for d in np.unique(dom):
            sel = dom == d
            y[sel] -= y[sel][np.argmin(x[sel])]
    if len(x) < 2 or len(np.unique(x)) < 2:
        raise QualityError(f"a perplexity fit needs at least two points with different damage, got {len(x)}")
    b, a = np.polyfit(x, y, 1)
    resid = y - (a + b * x)
    ss_tot = float(((y - y.mean()) ** 2).sum())
    r2 = 1.0 - float((resid ** 2).sum()) / ss_tot if ss_tot > 0 else 1.0
    return PerplexityFit(float(a), float(b), r2, int(len(x)), True, source, relative=domains is not None)


def load_fit_points(path: str | os.PathLike) -> PerplexityFit:
    """Read `{"points": [{"damage": x, "ppl": y}, ...], "source": "..."}` and fit it."""
    p = Path(path)
    try:
        data = json.loads(p.read_text())
        pts = data["points"]
        x = np.array([float(q["damage"]) for q in pts])
        y = np.array([float(q["ppl"]) for q in pts])
    except FileNotFoundError:
        raise QualityError(f"quality fit file {p} not found") from None
    except IsADirectoryError:
        raise QualityError(f"quality fit {p} is a directory; pass the JSON file of (damage, perplexity) points, "
                           "or 'none'") from None
    except OSError as e:
        raise QualityError(f"cannot read quality fit file {p} ({e.strerror or e})") from None
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise QualityError(f"{p}: expected {{\"points\": [{{\"damage\": x, \"ppl\": y}}, ...]}} ({e})") from None
    if (y <= 0).any() or not np.isfinite(x).all():
        raise QualityError(f"{p}: perplexities must be positive and damages finite")
    domains = [str(q["domain"]) for q in pts] if all("domain" in q for q in pts) else None
    try:
        return fit_perplexity(x, y, source=str(data.get("source", p)), domains=domains)
    except QualityError as e:
        raise QualityError(f"{p}: {e}") from None


@dataclass
class QualitySummary:
    available: bool
    note: str
    tokens: int = 0
    mean_damage_per_token: float | None = None
    per_domain: dict[str, dict] = field(default_factory=dict)  # domain -> {tokens, mean_damage_per_token}
    fallback_tokens: int = 0
    fit: dict | None = None
    predicted_ppl: float | None = None  # only with a measured fit
    predicted_ppl_label: str = ""

    def to_json(self) -> dict:
        return asdict(self)


class QualityModel:
    """Accrues per-token damage; one instance per simulation run (it keeps per-request totals)."""

    def __init__(self, domain_damage: dict[str, np.ndarray], layers: int, experts: int,
                 fit: PerplexityFit | None = None, zero_damage: bool = False) -> None:
        self.layers, self.experts = layers, experts
        self.zero_damage = zero_damage  # full-precision weights: every token accrues 0
        self.fit = fit
        self.domains = sorted(domain_damage)
        n = layers * experts * 2
        arrs = []
        for d in self.domains:
            a = np.asarray(domain_damage[d], dtype=np.float64)
            if a.shape[0] != n:
                raise QualityError(f"domain_damage[{d!r}] has {a.shape[0]} blocks, the model has {n}")
            arrs.append(np.zeros_like(a) if zero_damage else np.nan_to_num(a, nan=0.0))
        # [domains + 1 (fallback = mean), blocks, bits]
        self._E = np.stack(arrs + [np.mean(arrs, axis=0)]) if arrs else np.zeros((1, n, 9))
        self._index = {d: k for k, d in enumerate(self.domains)}
        self._cached_q: np.ndarray | None = None
        self._expert_damage = np.zeros((len(self.domains) + 1, layers, experts))
        self.total = np.zeros(len(self.domains) + 1)
        self.count = np.zeros(len(self.domains) + 1, dtype=np.int64)

    @property
    def available(self) -> bool:
        return bool(self.domains)

    def domain_index(self, domain: str) -> int:
        """Row of `domain` in the damage stack (the fallback row for an unknown domain)."""
        return self._index.get(domain, len(self.domains))

    def expert_damage(self, q: np.ndarray) -> np.ndarray:
        """`[domains + 1, layers, experts]`: E_d[gate_up, q] + E_d[down, q] of each expert."""
        if self._cached_q is None or not np.array_equal(self._cached_q, q):
            n = len(q)
            per_block = self._E[:, np.arange(n), q.astype(np.int64)]  # [D+1, n]
            self._expert_damage = per_block.reshape(len(self._E), self.layers, self.experts, 2).sum(axis=3)
            self._cached_q = q.copy()
        return self._expert_damage

    def accrue(self, q: np.ndarray, domain_idx: np.ndarray, topk_ids: np.ndarray) -> np.ndarray:
        """Damage of each token `[T]` routed as `topk_ids [T, layers, k]`; adds it to the totals."""
        if len(domain_idx) == 0 or not self.available:
            return np.zeros(len(domain_idx))
        ed = self.expert_damage(q).reshape(-1)  # [(domain * layers + layer) * experts + expert]
        row = (domain_idx[:, None] * self.layers + np.arange(self.layers)[None, :]) * self.experts  # [T, L]
        dmg = ed[row[:, :, None] + topk_ids].reshape(len(domain_idx), -1).sum(axis=1)
        m = len(self.total)
        self.total += np.bincount(domain_idx, weights=dmg, minlength=m)
        self.count += np.bincount(domain_idx, minlength=m)
        return dmg

    def summary(self) -> QualitySummary:
        if not self.available:
            return QualitySummary(False, "the calibration has no per-domain damages (domain_damage); "
                                         "quality is not modelled in this run")
        tokens = int(self.count.sum())
        mean = float(self.total.sum() / tokens) if tokens else 0.0
        per = {d: {"tokens": int(self.count[k]),
                   "mean_damage_per_token": float(self.total[k] / self.count[k]) if self.count[k] else None}
               for k, d in enumerate(self.domains)}
        s = QualitySummary(True, "", tokens, mean, per, int(self.count[-1]))
        if self.fit is not None and self.fit.measured:
            s.fit = asdict(self.fit)
            s.predicted_ppl = self.fit.predict(mean)
            what = "perplexity / full precision" if self.fit.relative else "perplexity"
            s.predicted_ppl_label = (f"predicted {what} from a fit log({what}) = {self.fit.a:.4g} + "
                                     f"{self.fit.b:.4g} * damage "
                                     f"(R^2 {self.fit.r2:.3f}, {self.fit.n_points} runtime points)")
            s.note = "damage measured per domain; perplexity predicted by a measured fit"
        else:
            s.note = ("perplexity fit unmeasured: no runtime (damage, perplexity) points were given, "
                      "so only the mean damage per token is reported")
        return s
