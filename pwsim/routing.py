"""Routing for the simulator: the top-k experts (and input norms) of every token an iteration computes.

A `RoutingSource` answers, for one iteration, the routing of all its tokens at once (no Python loop
over tokens or layers): sequence `s` computes positions `[start[s], start[s] + n[s])`; the answer
is laid out like the runtime's flattened batch (sequence 0's tokens, then sequence 1's, ...) as
`[layers, tokens, k]` arrays, the layout `policies.observe` takes.

Synthetic routing is a pure function of (request, position, layer): a sequence recomputed after preemption sees
the same routing again. Recorded routing follows the recording: a runtime recomputes at the bits of its time and
records that computation as the request's next attempt, which `TraceRouting` replays for the simulator's recompute.

* `TraceRouting`: per request and attempt, the recorded `[positions, layers, k]` ids and weights (and optional
  norms), e.g. read from a routing trace.
* `PopularityRouting`: synthetic. Expert popularity per (domain, layer) (rows of `popularity`), optionally drifting
  with the position in the request. Top-k without replacement drawn by inverse-CDF sampling from counter-based hashes
  of (seed, request, position, layer, slot), with duplicate slots redrawn, and a slot still repeating after the
  rounds drawn from the popularity of the experts its token does not hold yet. Weights are the chosen experts'
  popularity, normalised per token; input norms are log-normal around 1 with a per-layer scale.
"""
from __future__ import annotations

from dataclasses import dataclass
from statistics import NormalDist
from typing import Protocol

import numpy as np


@dataclass(frozen=True)
class StepRouting:
    ids: np.ndarray  # [layers, T, k] int64
    weights: np.ndarray  # [layers, T, k] float32
    gate_up_norm: np.ndarray | None = None  # [layers, T]
    down_norm: np.ndarray | None = None  # [layers, T, k]

    @property
    def num_tokens(self) -> int:
        return int(self.ids.shape[1])

    @property
    def has_norms(self) -> bool:
        return self.gate_up_norm is not None and self.down_norm is not None


class RoutingSource(Protocol):
    layers: int
    experts: int
    top_k: int

    def route(self, requests: np.ndarray, start: np.ndarray, n: np.ndarray) -> StepRouting:
        """Routing of positions [start[s], start[s] + n[s]) of request index requests[s], flattened."""
        ...

    def release(self, request: int) -> None:
        """Request index `request` finished: forget what was kept of it (served again, it routes as the first
        time)."""
        ...


def flat_positions(requests: np.ndarray, start: np.ndarray, n: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per flattened token: (request index, position)."""
    n = np.asarray(n, dtype=np.int64)
    req = np.repeat(np.asarray(requests, dtype=np.int64), n)
    offsets = np.cumsum(n) - n
    pos = np.arange(int(n.sum()), dtype=np.int64) - np.repeat(offsets, n) + np.repeat(np.asarray(start, dtype=np.int64), n)
    return req, pos


_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_GOLD = np.uint64(0x9E3779B97F4A7C15)
_U32 = 1.0 / 4294967296.0


def _mix(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finalizer (uint64 in, uint64 out; wraps silently). `x` is left as it was."""
    with np.errstate(over="ignore"):
        x = x ^ (x >> np.uint64(30))  # a new array: the steps below work in place
        x *= _M1
        x ^= x >> np.uint64(27)
        x *= _M2
        x ^= x >> np.uint64(31)
    return x


def hash_key(*keys, seed: int = 0) -> np.ndarray:
    """A well-mixed uint64 key from integer keys (broadcast) and a seed; deterministic."""
    with np.errstate(over="ignore"):
        x = _mix(np.asarray(np.uint64(seed & 0xFFFFFFFFFFFFFFFF) + _GOLD))
        for k in keys:
            x = _mix((x ^ np.asarray(k).astype(np.uint64)) + _GOLD)
    return x


def _hi(x: np.ndarray) -> np.ndarray:
    return (x >> np.uint64(32)).astype(np.float64) * _U32


def _lo(x: np.ndarray) -> np.ndarray:
    return (x & np.uint64(0xFFFFFFFF)).astype(np.float64) * _U32


class PopularityRouting:
    """Synthetic routing from expert popularity per (group, layer); see the module docstring.

    `popularity`: `[groups, layers, experts]` (rows normalised here); a group is e.g. a (domain,
    drift step) pair. `request_group[r]`: the group of request index r. Input norms are log-normal:
    gate_up `exp(gate_up_mu[g, l] + gate_up_sigma * N)`, down `exp(down_mu[g, l] + down_sigma * N)`.
    """

    def __init__(self, popularity: np.ndarray, request_group: np.ndarray, request_tokens: np.ndarray, top_k: int,
                 seed: int = 0,
                 gate_up_mu: np.ndarray | None = None, down_mu: np.ndarray | None = None,
                 gate_up_sigma: float = 0.25, down_sigma: float = 0.4, norms: bool = True,
                 redraw_rounds: int = 6) -> None:
        p = np.asarray(popularity, dtype=np.float64)
        if p.ndim != 3 or (p < 0).any() or not (p.sum(axis=2) > 0).all():
            raise ValueError(f"popularity must be a non-negative [groups, layers, experts] array, got {p.shape}")
        self.groups, self.layers, self.experts = p.shape
        if not 1 <= top_k <= self.experts:
            raise ValueError(f"top_k {top_k} not in 1..{self.experts}")
        self.top_k, self.seed, self.redraw_rounds = int(top_k), int(seed), int(redraw_rounds)
        self.norms = bool(norms)
        self.request_group = np.asarray(request_group, dtype=np.int64)
        self.request_tokens = np.asarray(request_tokens, dtype=np.int64)  # prompt + output tokens per request
        if self.request_tokens.shape != self.request_group.shape or (self.request_tokens < 1).any():
            raise ValueError("request_tokens needs one positive length per request")
        self._cache: dict[int, np.ndarray] = {}
        if len(self.request_group) and not (0 <= self.request_group.min() and self.request_group.max() < self.groups):
            raise ValueError("request_group indexes a popularity group that does not exist")
        self.p = p / p.sum(axis=2, keepdims=True)
        shape = (self.groups, self.layers)
        self.gate_up_mu = np.zeros(shape) if gate_up_mu is None else np.broadcast_to(gate_up_mu, shape).astype(np.float64)
        self.down_mu = np.zeros(shape) if down_mu is None else np.broadcast_to(down_mu, shape).astype(np.float64)
        # per (layer, slot) key mixed into each token's hash; log-normal noise through quantile tables
        lk = hash_key(np.arange(self.layers)[:, None, None], np.arange(self.top_k)[None, None, :], seed=self.seed + 1)
        self._lk_tlk = lk.reshape(1, self.layers, self.top_k)  # broadcast over tokens
        self._p32 = self.p.reshape(-1).astype(np.float32)
        self._gu_scale = np.exp(self.gate_up_mu.reshape(-1)).astype(np.float32)  # per popularity row
        self._dn_scale = np.exp(self.down_mu.reshape(-1)).astype(np.float32)
        q = _probit((np.arange(_NORM_BINS) + 0.5) / _NORM_BINS)
        self._gu_noise = np.exp(gate_up_sigma * q).astype(np.float32)
        self._dn_noise = np.exp(down_sigma * q).astype(np.float32)
        c = np.cumsum(self.p.reshape(-1, self.experts), axis=1)
        c /= c[:, -1:]
        c[:, -1] = 1.0 + 1e-12
        self._table = _inverse_table(c + np.arange(len(c))[:, None])

    def route(self, requests: np.ndarray, start: np.ndarray, n: np.ndarray) -> StepRouting:
        """From per-request caches: a request's whole routing is drawn the first time it is asked for."""
        requests = np.asarray(requests, dtype=np.int64)
        L, K = self.layers, self.top_k
        if not len(requests) or int(np.sum(n)) == 0:
            z = np.zeros((L, 0, K))
            return StepRouting(z.astype(np.int64), z.astype(np.float32), np.zeros((L, 0)) if self.norms else None,
                               z if self.norms else None)
        reqs = requests.tolist()
        cache = self._cache
        new = [r for r in dict.fromkeys(reqs) if r not in cache]
        if new:
            self._fill(np.array(new, dtype=np.int64))
        pieces = [cache[r][a:a + m] if a + m <= len(cache[r]) else self._clamped(r, a, m)
                  for r, a, m in zip(reqs, np.asarray(start).tolist(), np.asarray(n).tolist()) if m > 0]
        rec = np.concatenate(pieces).transpose(1, 0, 2)  # [L, T, columns]
        ids = rec[:, :, :K].astype(np.int64, order="C")  # C order: the engine and features flatten them
        w = np.ascontiguousarray(rec[:, :, K:2 * K])
        if not self.norms:
            return StepRouting(ids, w)
        return StepRouting(ids, w, rec[:, :, 3 * K].astype(np.float64, order="C"),
                           rec[:, :, 2 * K:3 * K].astype(np.float64, order="C"))

    def _clamped(self, r: int, a: int, m: int) -> np.ndarray:
        """Positions a..a+m-1 of request r, those past its length reusing its last one (cannot happen normally)."""
        c = self._cache[r]
        return c[np.minimum(np.arange(a, a + m), len(c) - 1)]

    def release(self, request: int) -> None:
        """Forget a finished request's routing (it is drawn again, identically, if asked for later)."""
        self._cache.pop(int(request), None)

    def _fill(self, reqs: np.ndarray) -> None:
        """Draw whole requests; each is cached as one float32 record `[positions, layers, columns]`:
        ids (exact in float32), weights, then (with norms) down norms and the gate_up norm."""
        lens = self.request_tokens[reqs]
        req, pos = np.repeat(reqs, lens), np.concatenate([np.arange(m) for m in lens])
        C = _FILL_CHUNK
        rec = np.concatenate([self._records(req[a:a + C], pos[a:a + C]) for a in range(0, len(req), C)])
        offs = np.concatenate([[0], np.cumsum(lens)])
        for j, q in enumerate(reqs.tolist()):
            self._cache[q] = rec[offs[j]:offs[j + 1]]

    def _records(self, req: np.ndarray, pos: np.ndarray) -> np.ndarray:
        """`[T, layers, columns]` float32 routing records of tokens (req[t], pos[t]), from hashes."""
        T, L, K, E = len(req), self.layers, self.top_k, self.experts
        rec = np.empty((T, L, 3 * K + 1 if self.norms else 2 * K), dtype=np.float32)
        if T == 0:
            return rec
        tok = hash_key(req, pos, seed=self.seed)  # [T]
        x = _mix(tok[:, None, None] ^ self._lk_tlk)  # [T, L, K]: one hash per (token, layer, slot)
        row = (self.request_group[req] * L)[:, None] + np.arange(L)[None, :]  # [T, L] popularity row
        ids = self._draw(self._table, row, x)
        w = self._p32[row[:, :, None] * E + ids]
        rec[:, :, :K] = ids
        rec[:, :, K:2 * K] = w / w.sum(axis=2, keepdims=True)
        if self.norms:
            # norms: bits 20..31 of the slot hashes (down), a second hash per (token, layer) (gate_up)
            rec[:, :, 2 * K:3 * K] = self._dn_scale[row][:, :, None] * self._dn_noise[_bits_20_31(x)]
            xg = _mix(tok[:, None] ^ self._lk_tlk[:, :, 0] ^ np.uint64(0x5851F42D4C957F2D))
            rec[:, :, 3 * K] = self._gu_scale[row] * self._gu_noise[_bits_20_31(xg)]
        return rec

    def _draw(self, table: tuple, row: np.ndarray, x: np.ndarray) -> np.ndarray:
        """Top-k without replacement: inverse CDF for each slot, duplicate slots redrawn.

        `row [T, L]` popularity rows, `x [T, L, K]` hashes; returns ids `[T, L, K]`."""
        E, K = self.experts, x.shape[-1]
        row2, x2 = row.reshape(-1), x.reshape(-1, K)
        ids = _inverse_cdf(table, row[..., None], x, E).reshape(-1, K)
        n, k = np.nonzero(_duplicate_slots(ids))
        for rnd in range(1, self.redraw_rounds + 1):
            if not len(n):
                return ids.reshape(x.shape)
            with np.errstate(over="ignore"):
                xr = _mix(x2[n, k] + np.uint64(rnd) * _GOLD)
            ids[n, k] = _inverse_cdf(table, row2[n], xr, E)
            still = _repeats(ids[n], k)  # equals another slot
            n, k = n[still], k[still]
        if len(n):
            self._draw_leftovers(ids, n, k, row2[n], x2[n, k])
        return ids.reshape(x.shape)

    def _draw_leftovers(self, ids: np.ndarray, n: np.ndarray, k: np.ndarray, row: np.ndarray, x: np.ndarray) -> None:
        """Slots still repeating after the redraw rounds, drawn in place from their popularity row renormalised over
        the experts their token's settled slots do not hold (the next draw of sampling without replacement).

        `ids [N, K]`; leftover i is slot `k[i]` of token `n[i]`, with popularity row `row[i]` and hash `x[i]`. A
        token's leftovers settle in slot order, each seeing the ones before it; where the free experts' popularity
        underflowed to zero, any free expert is equally likely."""
        E, K = self.experts, ids.shape[1]
        with np.errstate(over="ignore"):
            u = _hi(_mix(x + np.uint64(self.redraw_rounds + 1) * _GOLD))
        pending = np.zeros(ids.shape, dtype=bool)
        pending[n, k] = True
        p = self.p.reshape(-1, E)
        for j in range(K):
            mine = k == j
            if not mine.any():
                continue
            t = n[mine]
            free = np.ones((len(t), E), dtype=bool)
            for m in range(K):
                settled = ~pending[t, m]
                free[np.flatnonzero(settled), ids[t[settled], m]] = False
            w = p[row[mine]] * free
            none_left = w.sum(axis=1) <= 0
            w[none_left] = free[none_left]
            c = np.cumsum(w, axis=1)
            ids[t, j] = np.minimum((c <= (u[mine] * c[:, -1])[:, None]).sum(axis=1), E - 1)
            pending[t, j] = False


_FILL_CHUNK = 1024  # tokens per `_records` call: each token's draw is its own, and the temporaries stay in cache
_BIN_BITS = 12
_BINS = 1 << _BIN_BITS  # inverse-CDF bins per popularity row
_NORM_BINS = 4096


def _inverse_table(cdf: np.ndarray) -> tuple:
    """Exact inverse CDF through a bin table: (flat offset CDF, per row and bin the expert, or -1
    where the bin straddles an expert boundary and needs an exact search)."""
    rows, E = cdf.shape
    edges = np.arange(_BINS + 1) / _BINS
    table = np.empty((rows, _BINS), dtype=np.int16)
    for r in range(rows):
        lo = np.minimum(np.searchsorted(cdf[r] - r, edges[:-1], side="right"), E - 1)
        hi = np.minimum(np.searchsorted(cdf[r] - r, np.nextafter(edges[1:], 0), side="right"), E - 1)
        table[r] = np.where(lo == hi, lo, -1)
    return cdf.ravel(), table.ravel()


def _inverse_cdf(table: tuple, row: np.ndarray, x: np.ndarray, E: int) -> np.ndarray:
    """Experts drawn with u = the top 32 bits of hash `x` / 2^32: bin table first, exact search on straddles.

    `row`: each hash's popularity row, or an array that broadcasts to `x`'s shape."""
    cdf_flat, bins = table
    b = (x >> np.uint64(64 - _BIN_BITS)).view(np.int64)  # < 2^12: the same value as an int64
    b += row * _BINS  # the flat bin: row * _BINS + bin
    ids = np.take(bins, b).astype(np.int64)
    amb = np.flatnonzero(ids < 0)
    if amb.size:
        r = b.reshape(-1)[amb] >> _BIN_BITS  # the rows back from the flat bins
        hit = np.searchsorted(cdf_flat, r + _hi(x.reshape(-1)[amb]), side="right") - r * E
        np.put(ids, amb, np.clip(hit, 0, E - 1))
    return ids


def _bits_20_31(x: np.ndarray) -> np.ndarray:
    """Bits 20..31 of uint64 hashes, as int64 indices 0..4095."""
    b = x >> np.uint64(20)
    b &= np.uint64(_NORM_BINS - 1)
    return b.view(np.int64)


def _repeats(ids: np.ndarray, k: np.ndarray) -> np.ndarray:
    """Whether slot `k[i]` of row `ids[i]` holds an expert another slot of the row holds too."""
    eq = ids == ids[np.arange(len(k)), k][:, None]
    count = np.zeros(len(k), dtype=np.int32)
    for j in range(ids.shape[1]):  # column by column: a sum over the short last axis is slow
        count += eq[:, j]
    return count > 1


def _duplicate_slots(ids: np.ndarray) -> np.ndarray:
    """True where a slot repeats an expert chosen by an earlier slot of the same token and layer."""
    K = ids.shape[-1]
    dup = np.zeros(ids.shape, dtype=bool)
    for j in range(1, K):
        d = dup[..., j]
        for i in range(j):
            d |= ids[..., i] == ids[..., j]
    return dup


def _probit(u: np.ndarray) -> np.ndarray:
    """Standard normal quantiles of `u` (used once per source to build noise tables)."""
    inv = NormalDist().inv_cdf
    return np.array([inv(float(x)) for x in np.clip(u, 1e-12, 1 - 1e-12)])


class TraceRouting:
    """Recorded routing: per record (a request index and attempt), positions `0..lens[rec]-1`, each `[layers, k]` ids
    and weights.

    Stored flat: record rec's rows are `offsets[rec]:offsets[rec+1]` of `ids [rows, layers, k]` (and of
    `weights`, and of the optional norms `gate_up_norm [rows, layers]`, `down_norm [rows, layers, k]`); records
    0..R-1 are the requests' first computations, `attempt_records[r, a]` request r's a-th (its first where the trace
    has no such recompute). `route` counts a request's attempts as the recorder did: a call for a position before the
    ones it routed last is a recompute. Positions past the end of a record reuse its last recorded position (a
    trace recorded with fewer tokens than the simulation computes)."""

    def __init__(self, ids: np.ndarray, weights: np.ndarray, lens: np.ndarray, experts: int,
                 gate_up_norm: np.ndarray | None = None, down_norm: np.ndarray | None = None,
                 attempt_records: np.ndarray | None = None) -> None:
        self._ids = np.asarray(ids, dtype=np.int64)
        self._w = np.asarray(weights, dtype=np.float32)
        if self._ids.ndim != 3 or self._ids.shape != self._w.shape:
            raise ValueError(f"ids and weights must both be [rows, layers, k], got {self._ids.shape}, {self._w.shape}")
        self.lens = np.asarray(lens, dtype=np.int64)
        if (self.lens <= 0).any() or self.lens.sum() != len(self._ids):
            raise ValueError("every request needs at least one routed position and lens must cover all rows")
        self.layers, self.top_k, self.experts = int(self._ids.shape[1]), int(self._ids.shape[2]), int(experts)
        self.offsets = np.concatenate([[0], np.cumsum(self.lens)])
        self._gu = None if gate_up_norm is None else np.asarray(gate_up_norm, dtype=np.float64)
        self._dn = None if down_norm is None else np.asarray(down_norm, dtype=np.float64)
        self.attempt_records = (np.arange(len(self.lens))[:, None] if attempt_records is None
                                else np.asarray(attempt_records, dtype=np.int64))
        requests = len(self.attempt_records)
        self._next = np.zeros(requests, dtype=np.int64)  # per request: the position after the last one routed
        self._attempt = np.zeros(requests, dtype=np.int64)  # per request: its computation now

    @classmethod
    def from_trace(cls, routing, requests) -> "TraceRouting":
        """From a `traces.schema.RoutingTrace` and its `RequestTrace` (request index = request-trace row)."""
        from traces.schema import TraceError

        L, k, R = routing.layers, routing.top_k, len(requests)
        order_req = np.argsort(requests.request_id, kind="stable")
        ridx = order_req[np.searchsorted(requests.request_id[order_req], routing.request_id)]
        att = routing.attempts.astype(np.int64)
        # records: every request's first computation (record r), then each (request, attempt > 0) the trace has
        width = int(att.max(initial=0)) + 1
        key = ridx * width + att
        again = np.unique(key[att > 0])  # sorted by request, then attempt
        rec = np.where(att > 0, R + np.searchsorted(again, key), ridx)
        order = np.lexsort((routing.layer, routing.position, rec))
        r_s, p_s, l_s = rec[order], routing.position[order].astype(np.int64), routing.layer[order]
        n = len(order)
        tok = None if n % L else np.stack([r_s, p_s, l_s.astype(np.int64)]).reshape(3, -1, L)  # [record, pos, layer]
        if tok is None or not ((tok[2] == np.arange(L)).all() and (tok[:2] == tok[:2, :, :1]).all()):
            raise TraceError(routing.source, f"some (request, position) lacks one of the {L} layers", column="layer",
                             fix="record every MoE layer for every routed token")
        r_tok, p_tok = r_s[::L], p_s[::L]
        lens = np.bincount(r_tok, minlength=R + len(again))
        if (lens[:R] == 0).any():
            missing = int(requests.request_id[np.flatnonzero(lens[:R] == 0)[0]])
            raise TraceError(routing.source, f"request {missing} has no routing rows", column="request_id",
                             fix="route every request (or simulate without the routing trace)")
        starts = np.concatenate([[0], np.cumsum(lens)[:-1]])
        expect = np.arange(len(r_tok)) - np.repeat(starts, lens)
        if (p_tok != expect).any():
            at = int(np.flatnonzero(p_tok != expect)[0])
            who = r_tok[at] if r_tok[at] < R else again[r_tok[at] - R] // width
            raise TraceError(routing.source, f"request {int(requests.request_id[who])} has a gap in its "
                             f"positions (position {int(expect[at])} missing)", column="position",
                             fix="routing positions of a request (and of each recompute) must run 0, 1, 2, ... "
                                 "without gaps")
        attempt_records = np.repeat(np.arange(R)[:, None], width, axis=1)
        for j, (r, a) in enumerate(divmod(int(x), width) for x in again):  # later attempts fall back on the latest
            attempt_records[r, a:] = R + j
        ids = routing.expert_ids[order].reshape(-1, L, k)
        w = routing.weights[order].reshape(-1, L, k)
        gu = dn = None
        if routing.has_features:
            gu = routing.gate_up_in_norm[order].reshape(-1, L)
            dn = routing.down_in_norm[order].reshape(-1, L, k)
        return cls(ids, w, lens, routing.experts, gu, dn, attempt_records)

    def route(self, requests: np.ndarray, start: np.ndarray, n: np.ndarray) -> StepRouting:
        requests, start = np.asarray(requests, dtype=np.int64), np.asarray(start, dtype=np.int64)
        self._attempt[requests] += start < self._next[requests]  # positions routed before: a recompute
        self._next[requests] = start + np.asarray(n, dtype=np.int64)
        attempt = np.minimum(self._attempt[requests], self.attempt_records.shape[1] - 1)
        rec = np.repeat(self.attempt_records[requests, attempt], np.asarray(n, dtype=np.int64))
        _, pos = flat_positions(requests, start, n)
        row = self.offsets[rec] + np.minimum(pos, self.lens[rec] - 1)
        ids = np.ascontiguousarray(self._ids[row].transpose(1, 0, 2))
        w = np.ascontiguousarray(self._w[row].transpose(1, 0, 2))
        gu = None if self._gu is None else np.ascontiguousarray(self._gu[row].T)
        dn = None if self._dn is None else np.ascontiguousarray(self._dn[row].transpose(1, 0, 2))
        return StepRouting(ids, w, gu, dn)

    @property
    def num_requests(self) -> int:
        return len(self.attempt_records)

    def release(self, request: int) -> None:
        """A finished request starts over at its first computation if served again (a warm-up's, then the trace's)."""
        self._next[int(request)] = self._attempt[int(request)] = 0


def synthetic_routing(requests, model, spec, seed: int, drift_steps: int = 8) -> PopularityRouting:
    """A fast routing source with the popularity model of `traces.generators.generate_routing`.

    Same per-layer Zipf logits with per-domain reshuffles (`popularity_logits`), same random walk
    of the logits over arrival times (`drift_walk`, on `drift_steps` grid points), same norm
    distributions when `spec.features`; tokens are drawn per iteration (see `PopularityRouting`)
    instead of materialising a row per (request, position, layer). `model`: a ModelSpec.
    """
    from traces.generators import drift_walk, popularity_logits

    L, E, k = int(model.moe_layers), int(model.experts), int(model.top_k)
    rng_pop, rng_walk, _, rng_feat = (np.random.default_rng(s) for s in np.random.SeedSequence([seed, 1]).spawn(4))
    D = max(len(requests.domains), 1)
    logits = popularity_logits(L, E, D, spec, rng_pop).astype(np.float64)
    arrival = np.asarray(requests.arrival_s, dtype=np.float64)
    grid, walk = drift_walk(arrival, L, E, spec.drift, rng_walk, max_steps=drift_steps)
    G = len(grid)
    step = np.clip(np.searchsorted(grid, arrival, side="right") - 1, 0, G - 1)
    z = logits[:, None] + walk[None].astype(np.float64)  # [D, G, L, E]
    z -= z.max(axis=3, keepdims=True)
    pop = np.exp(z).reshape(D * G, L, E)
    group = np.asarray(requests.domain_idx, dtype=np.int64) * G + step
    mu = rng_feat.normal(np.log(20.0), 0.3, size=(D, L))
    mu_g = np.repeat(mu, G, axis=0)  # [D * G, L]
    tokens = np.asarray(requests.prompt_tokens, dtype=np.int64) + np.asarray(requests.output_tokens, dtype=np.int64)
    return PopularityRouting(pop, group, tokens, k, seed=seed, gate_up_mu=mu_g, down_mu=mu_g - np.log(4.0),
                             norms=spec.features)
