"""Damage scoring (paper Eqs. 4-8) and the exact greedy selections, vectorised over all blocks.

Steps. Every block has the same chain of *steps* between adjacent supported bitwidths, listed
top-down: with bits (3..8), column c = 0 is 8->7, ..., column 4 is 4->3. A reduction of several
bits is a run of consecutive steps; its damage is the sum of its steps' damages, each scored with
its own b->b' residual head (heads of non-adjacent pairs are not used by the step planners).

Greedy over chains (`chain_greedy`). A block's legal steps form one contiguous run of columns that
starts at its committed bits (a step can only be taken after the one above it). The selection is
defined as this loop, which the tests run literally on small tables:

    repeat: among the *next* legal step of every block, take the one with the lowest
            damage / released bytes (ties: lower block index); until the bytes reach the target
            or no legal step is left.

It equals sorting all legal steps by (k, block, column) and taking the shortest prefix that
reaches the target, where k is the running maximum of the ratio along the block's chain from its
first legal step (a cheap step behind an expensive one is taken right after the expensive one,
which is exactly when the loop reaches it). When a block's ratios grow as bits fall (the usual
case) k is the ratio itself. Only the candidates that can matter are sorted: at most
ceil(target / smallest step) steps are needed, so only chains whose first key is among that many
smallest are expanded (`chain_greedy_stages`), ties at the boundary included. Any strictly
increasing transform of the ratio gives the same picks; the planner ranks by log ratio, which
needs no exp per step.

Layout. Arrays the greedy reads are *step-major*, `[S, n]` (one contiguous row per step column),
so per-block vectors broadcast along long rows; `block[j]` names the block of chain j for ties.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from policies.apformat import MAX_BITS


@dataclass(frozen=True)
class StepTable:
    """Per block and step column: released bytes and global damage g (Eq. 4); inf where unknown."""

    from_bits: np.ndarray  # [S]
    to_bits: np.ndarray  # [S]
    bytes: np.ndarray  # [n, S] int64, M[from] - M[to] > 0
    global_damage: np.ndarray  # [n, S] float64, max(s[to] - s[from], 0); inf where s is missing
    col_from: np.ndarray  # [MAX_BITS + 1]: column whose from_bits is b, S where none (lowest bits)
    last_for_low: np.ndarray  # [MAX_BITS + 2]: last column whose to_bits >= v (-1 if none)

    @property
    def num_steps(self) -> int:
        return len(self.from_bits)


def build_step_table(M: np.ndarray, sensitivity: np.ndarray, bits: tuple[int, ...]) -> StepTable:
    down = np.array(sorted(bits, reverse=True), dtype=np.int64)
    frm, to = down[:-1], down[1:]
    s = np.asarray(sensitivity, dtype=np.float64)
    with np.errstate(invalid="ignore"):
        g = np.maximum(s[:, to] - s[:, frm], 0.0)
    g[~np.isfinite(g)] = np.inf
    col_from = np.full(MAX_BITS + 1, len(frm), dtype=np.int64)
    col_from[frm] = np.arange(len(frm))
    last_for_low = np.array([(to >= v).sum() - 1 for v in range(MAX_BITS + 2)], dtype=np.int64)
    return StepTable(frm, to, (M[:, frm] - M[:, to]).astype(np.int64), g, col_from, last_for_low)


# ------------------------------------------------------------------ routing buckets (Eq. 8's mu)
def expert_buckets(routing_mass: np.ndarray | None, layers: int, experts: int,
                   bounds: tuple[float, ...]) -> np.ndarray:
    """[layers, experts] bucket per expert: experts sorted by mass per layer, hottest bucket 0.

    `bounds` are cumulative fractions of a layer's experts per bucket (hottest first): the expert
    of rank r (0 = most mass; ties by lower expert index) is in the first bucket k with
    r < round(bounds[k] * experts). A layer without routing information (no array, or a row of
    zeros) puts every expert in the coldest bucket: no expert is protected on no evidence.
    """
    last = len(bounds) - 1
    out = np.full((layers, experts), last, dtype=np.int64)
    if routing_mass is None:
        return out
    m = np.asarray(routing_mass, dtype=np.float64)
    if m.shape != (layers, experts):
        raise ValueError(f"routing_mass has shape {m.shape}, expected {(layers, experts)}")
    cuts = np.floor(np.asarray(bounds, dtype=np.float64) * experts + 0.5).astype(np.int64)
    cuts[-1] = experts
    by_rank = np.minimum(np.searchsorted(cuts, np.arange(experts), side="right"), last)
    seen = np.flatnonzero(m.sum(axis=1) > 0)
    order = np.argsort(-m[seen], axis=1, kind="stable")  # rank -> expert per layer; ties by lower index
    out[seen[:, None], order] = by_rank
    return out


# ------------------------------------------------------------------ prompt residual (Eqs. 5-6)
@dataclass(frozen=True)
class StepHeads:
    """The residual heads of the step columns, per kind: rho = w . phi + a; eta = exp(scale * clip(rho))."""

    weights: np.ndarray  # [2, S, 3]
    bias: np.ndarray  # [2, S]
    scale: np.ndarray  # [2, S] = alpha * confidence
    lo: np.ndarray  # [2, S]
    hi: np.ndarray  # [2, S]

    @classmethod
    def from_calibration(cls, cal, steps: StepTable, alpha: float) -> "StepHeads":
        f, t = steps.from_bits, steps.to_bits
        clip = np.asarray(cal.residual_clip, dtype=np.float64)[:, f, t]
        return cls(np.asarray(cal.residual_weights, dtype=np.float64)[:, f, t],
                   np.asarray(cal.residual_bias, dtype=np.float64)[:, f, t],
                   alpha * np.asarray(cal.residual_confidence, dtype=np.float64)[:, f, t],
                   clip[..., 0], clip[..., 1])

    def folded(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """log eta = clip(Wa . [phi, 1], lo', hi') with the scale folded in: (Wa [2, S, 4], lo' [2, S], hi' [2, S])."""
        sc = self.scale
        wa = np.concatenate([self.weights, self.bias[..., None]], axis=-1) * sc[..., None]
        lo = np.where(sc >= 0, sc * self.lo, sc * self.hi)
        hi = np.where(sc >= 0, sc * self.hi, sc * self.lo)
        return wa, lo, hi


class Scorer:
    """Step-major log-ratio scoring: log(max(eps, mu * g * eta) / Delta), no exp per step.

    Internally blocks are kind-major (all gate_up blocks, then all down blocks; `perm[j]` is the
    block of internal column j) so each kind's residual head is one small matrix product.
    """

    def __init__(self, steps: StepTable, heads: StepHeads, eps: float) -> None:
        n, S = steps.bytes.shape
        self.n, self.S, self.half = n, S, n // 2
        self.perm = np.concatenate([np.arange(0, n, 2), np.arange(1, n, 2)])
        self.bytes = np.ascontiguousarray(steps.bytes[self.perm].T)  # [S, n] int64
        self.g = np.ascontiguousarray(steps.global_damage[self.perm].T)
        log_b = np.log(self.bytes.astype(np.float64))
        with np.errstate(divide="ignore"):
            self.log_g_per_byte = np.log(self.g) - log_b
        self.log_floor = np.log(eps) - log_b
        self.finite = np.isfinite(self.g)
        self.min_bytes = int(self.bytes.min()) if self.bytes.size else 1
        self.eps = eps
        self._wa, lo, hi = heads.folded()
        self._lo, self._hi = lo[..., None], hi[..., None]
        self._residual = bool(np.any(self._wa != 0) or np.any(lo != 0) or np.any(hi != 0))

    @staticmethod
    def internal(values: np.ndarray) -> np.ndarray:
        """A per-block vector in internal (kind-major) order."""
        return np.concatenate((values[0::2], values[1::2]))

    def log_ratio(self, log_mu: np.ndarray, features: np.ndarray | None) -> np.ndarray:
        """[S, n] log(max(eps, mu g eta) / Delta); `log_mu` per internal column, `features` phi in block order."""
        lr = self.log_g_per_byte + log_mu
        if features is not None and self._residual:
            h = self.half
            phi = np.ones((2, 4, h))  # kind-major features plus a row of ones
            phi[:, :3] = np.asarray(features, dtype=np.float64).reshape(h, 2, 3).transpose(1, 2, 0)
            for k, part in ((0, lr[:, :h]), (1, lr[:, h:])):
                log_eta = self._wa[k] @ phi[k]
                np.maximum(log_eta, self._lo[k], out=log_eta)
                np.minimum(log_eta, self._hi[k], out=log_eta)
                part += log_eta
        np.maximum(lr, self.log_floor, out=lr)
        return lr

    def damage(self, cols: np.ndarray, js: np.ndarray, mu: np.ndarray, features: np.ndarray | None) -> np.ndarray:
        """Linear predicted damage d (Eq. 8) of the entries (cols[k], js[k]); `mu` per internal column."""
        d = mu[js] * self.g[cols, js]
        if features is not None and self._residual and len(js):
            phi = np.asarray(features, dtype=np.float64)[self.perm[js]]
            kind = (js >= self.half).astype(np.int64)
            wa = self._wa[kind, cols]
            log_eta = np.einsum("kf,kf->k", wa[:, :3], phi) + wa[:, 3]
            d = d * np.exp(np.clip(log_eta, self._lo[kind, cols, 0], self._hi[kind, cols, 0]))
        return np.maximum(d, self.eps)


# ------------------------------------------------------------------ greedy over chains (step-major)
def first_bad(ok: np.ndarray, first: np.ndarray) -> np.ndarray:
    """[n] the first column >= first[j] where ok[:, j] is False (S if none)."""
    S = ok.shape[0]
    bad = ~ok & (np.arange(S)[:, None] >= first[None, :])
    return np.where(bad.any(axis=0), bad.argmax(axis=0), S)


def chain_legal(first: np.ndarray, last: np.ndarray, S: int) -> np.ndarray:
    """[S, n] legal steps: columns first[j]..last[j] of each chain."""
    rows = np.arange(S)[:, None]
    return (rows >= first[None, :]) & (rows <= last[None, :])


def chain_keys(values: np.ndarray, first: np.ndarray, inplace: bool = False) -> np.ndarray:
    """[S, n] running maximum of `values` down each chain from its first legal column (-inf above it)."""
    keys = values if inplace else values.copy()
    np.copyto(keys, -np.inf, where=np.arange(values.shape[0])[:, None] < first[None, :])
    for c in range(1, keys.shape[0]):
        np.maximum(keys[c], keys[c - 1], out=keys[c])
    return keys


class MatrixChains:
    """A chain source over full `[S, n]` value and weight matrices.

    `keyed`: the values are already `chain_keys` (running maxima); otherwise they are ratios and
    only the chains the greedy expands get their running maxima taken.
    """

    def __init__(self, values: np.ndarray, weight: np.ndarray, keyed: bool = True) -> None:
        self.values, self.weight, self.keyed = values, weight, keyed
        self.S, self.n = values.shape

    def head(self, cols: np.ndarray, chains: np.ndarray) -> np.ndarray:
        return np.take(self.values, cols * self.n + chains)  # a chain's first key is its first value

    def chain_keys(self, chains: np.ndarray, first: np.ndarray) -> np.ndarray:
        cols = np.take(self.values, chains, axis=1)
        return cols if self.keyed else chain_keys(cols, first, inplace=True)

    def weight_at(self, cols: np.ndarray, chains: np.ndarray) -> np.ndarray:
        return np.take(self.weight, cols * self.n + chains)


def chain_greedy(keys: np.ndarray, weight: np.ndarray, legal: np.ndarray, block: np.ndarray,
                 target: float) -> np.ndarray:
    """Flat indices into the `[S, n]` arrays of the greedy's picks, in pick order.

    Stops once the picked weights reach `target`; when all legal steps together do not reach it,
    returns every legal step (the largest reduction the constraints allow). See the module docstring.
    """
    S, n = keys.shape
    first = np.where(legal.any(axis=0), legal.argmax(axis=0), S)
    last = np.where(legal.any(axis=0), S - 1 - legal[::-1].argmax(axis=0), -1)
    cols, chains = chain_greedy_stages(MatrixChains(keys, weight), block, first, [last], target)[0]
    return cols * n + chains


def chain_greedy_stages(src, block: np.ndarray, first: np.ndarray, lasts: list[np.ndarray], target: float,
                        min_weight: float | None = None) -> list[tuple[np.ndarray, np.ndarray]]:
    """`chain_greedy` for several stages at once: stage s allows columns first[j]..lasts[s][j].

    Returns, per stage, (columns, chains) of the picks in pick order. `src` (a `MatrixChains`) gives
    the keys lazily: `head(cols, chains)` the key of each chain's first step and
    `chain_keys(chains, first)` the `[S, m]` keys of whole chains (-inf above their first step);
    `weight_at(cols, chains)` the steps' weights. `block[j]` is the block of chain j (ties go to
    the lower block, then the earlier step); `min_weight` bounds every step's weight from below.

    The stages share one partial sort. Keys grow along a chain, so the `size`-th smallest key
    among the chains' first steps bounds the `size`-th smallest key overall: only the chains whose
    first step is within that bound are expanded, their steps with keys up to the bound sorted,
    and each stage filters that sorted prefix. The bound grows (x4) only if some stage has not met
    the target inside it; past the number of chains every legal step is a candidate.
    """
    S = src.S
    empty = (np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64))
    if target <= 0 or not lasts:
        return [empty for _ in lasts]
    union_last = lasts[0]
    for last in lasts[1:]:
        union_last = np.maximum(union_last, last)
    chains = np.flatnonzero(first <= union_last)
    if chains.size == 0:
        return [empty for _ in lasts]
    head = src.head(first[chains], chains)
    if min_weight is None:
        min_weight = float(np.min(src.weight_at(first[chains], chains)))
    size = int(np.ceil(target / min_weight)) + 1 if min_weight > 0 else chains.size
    out: list[tuple[np.ndarray, np.ndarray] | None] = [None] * len(lasts)
    rows = np.arange(S)[:, None]
    while True:
        complete = size >= chains.size
        if complete:
            sub, thr = chains, np.inf
        else:
            thr = np.partition(head, size - 1)[size - 1]
            sub = chains[head <= thr]
        keys = src.chain_keys(sub, first[sub])
        ok = (rows >= first[sub]) & (rows <= union_last[sub])
        if not complete:
            ok &= keys <= thr
        cols, loc = np.nonzero(ok)
        js = sub[loc]
        k_all = keys[cols, loc]
        w_all = src.weight_at(cols, js)
        order = np.lexsort((block[js] * S + cols, k_all))
        for s, last in enumerate(lasts):
            if out[s] is not None:
                continue
            o = order[(cols <= last[js])[order]]
            cs = np.cumsum(w_all[o])
            if cs.size and cs[-1] >= target:
                o = o[: int(np.searchsorted(cs, target, side="left")) + 1]
                out[s] = (cols[o], js[o])
            elif complete:
                out[s] = (cols[o], js[o])
        if all(x is not None for x in out):
            return out  # type: ignore[return-value]
        size *= 4


def block_chain_greedy(ratio: np.ndarray, weight: np.ndarray, ok: np.ndarray, first: np.ndarray,
                       last: np.ndarray, target: float) -> tuple[np.ndarray, np.ndarray]:
    """Block-major convenience ([n, S] inputs): (rows, cols) of the picks, in pick order."""
    n, S = ratio.shape
    firsts = np.asarray(first, dtype=np.int64)
    ok_t = np.ascontiguousarray(ok.T)
    lasts = np.minimum(np.asarray(last, dtype=np.int64), first_bad(ok_t, firsts) - 1)
    legal = chain_legal(firsts, lasts, S)
    keys = chain_keys(np.where(legal, ratio.T, 0.0), firsts)
    picks = chain_greedy(keys, np.ascontiguousarray(weight.T), legal, np.arange(n), target)
    cols, rows = np.divmod(picks, n)
    return rows, cols


def fit_in_order(order: np.ndarray, cost: np.ndarray, budget: float) -> np.ndarray:
    """Take items in `order`, each only if its cost still fits the remaining budget (skip if not).

    Vectorised in rounds: drop what no longer fits, take the longest prefix that fits, skip the
    item that broke it; each round shrinks the largest cost that can still fit.
    """
    taken = []
    items, left = order, float(budget)
    while items.size and left > 0:
        items = items[cost[items] <= left]
        if not items.size:
            break
        cs = np.cumsum(cost[items])
        k = int(np.searchsorted(cs, left, side="right"))
        taken.append(items[:k])
        left -= float(cs[k - 1])
        items = items[k + 1:]
    return np.concatenate(taken) if taken else np.empty(0, dtype=np.int64)
