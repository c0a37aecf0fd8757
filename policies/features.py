"""Per-sequence prompt features phi for a whole batch at once: `BatchedPromptFeatures`.

Per sequence and linear-block, over the tokens the sequence computed: the routing-weighted mean
and RMS of the block's input norm and the max norm; merged over running sequences weighted by their
KV blocks (see policies.observe). Methods: `update` (one sequence), `update_batch` (a whole
flattened batch in a handful of numpy calls), `drop`, `sequences`, `sequence_features`, `merged`. Sequences live in rows
("slots") of dense arrays, and each sequence's phi is kept up to date at the entries a step
touched, so `merged` is two matrix-vector products instead of a Python loop over sequences.
Results equal a straightforward per-sequence reference up to floating-point summation order
(tests/test_sim_features.py checks 1e-12).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, Mapping, Sequence as Seq

import numpy as np


@dataclass
class BatchedPromptFeatures:
    layers: int
    experts: int
    initial_slots: int = 64
    _slot: dict = field(init=False, default_factory=dict)  # seq_id -> row
    _free: list = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        self._alloc(max(1, self.initial_slots))

    @property
    def num_blocks(self) -> int:
        return self.layers * self.experts * 2

    def _alloc(self, cap: int) -> None:
        """Rows of `_acc` [cap, blocks, 4]: sum r, sum r*x, sum r*x^2, max x; `_feat` [cap, blocks, 4]: phi, seen."""
        nb = self.num_blocks
        old = getattr(self, "_cap", 0)
        for name in ("_acc", "_feat"):
            arr = np.zeros((cap, nb, 4), dtype=np.float64)
            if old:
                arr[:old] = getattr(self, name)
            setattr(self, name, arr)
        self._free.extend(range(cap - 1, old - 1, -1))  # pop() hands out the lowest free row
        self._cap = cap

    def _row(self, seq_id: Hashable) -> int:
        row = self._slot.get(seq_id)
        if row is None:
            if not self._free:
                self._alloc(2 * self._cap)
            row = self._slot[seq_id] = self._free.pop()
        return row

    # ------------------------------------------------------------------ updates
    def update(self, seq_id: Hashable, topk_ids, topk_weights, gate_up_in_norm, down_in_norm) -> None:
        """One sequence's tokens: ids/weights/down norms [layers, n, k], gate_up norms [layers, n]."""
        ids = np.asarray(topk_ids)
        self.update_batch([seq_id], [ids.shape[1] if ids.ndim == 3 else 0], ids, topk_weights,
                          gate_up_in_norm, down_in_norm)

    def update_batch(self, seq_ids: Seq[Hashable], query_lens: Seq[int], topk_ids, topk_weights,
                     gate_up_in_norm, down_in_norm) -> None:
        """A flattened batch (sequence 0's tokens, then sequence 1's, ...): arrays as in `update`."""
        ids = np.asarray(topk_ids)
        w = np.asarray(topk_weights, dtype=np.float64)
        gu = np.asarray(gate_up_in_norm, dtype=np.float64)
        dn = np.asarray(down_in_norm, dtype=np.float64)
        lens = np.asarray(query_lens, dtype=np.int64)
        if ids.ndim != 3 or not (ids.shape == w.shape == dn.shape and gu.shape == ids.shape[:2]
                                 and ids.shape[0] == self.layers and int(lens.sum()) == ids.shape[1]):
            raise ValueError(f"feature shapes disagree: ids {ids.shape}, weights {w.shape}, gate_up norms {gu.shape}, "
                             f"down norms {dn.shape}, layers {self.layers}, tokens {int(lens.sum())}")
        if ids.shape[1] == 0:
            return
        keep = lens > 0  # sequences with no token in this batch change nothing
        rows = np.array([self._row(s) for s, k in zip(seq_ids, keep) if k], dtype=np.int64)
        lens, offs = lens[keep], np.concatenate([[0], np.cumsum(lens)])[:-1][keep]
        single = lens == 1
        if single.all():
            self._update_single(rows, ids, w, gu, dn)
            return
        if single.any():
            t = offs[single]  # the one token of each single-token sequence
            self._update_single(rows[single], ids[:, t], w[:, t], gu[:, t], dn[:, t])
        multi = np.flatnonzero(~single)
        tok = np.concatenate([np.arange(offs[j], offs[j] + lens[j]) for j in multi])
        self._update_multi(rows[multi], lens[multi], ids[:, tok], w[:, tok], gu[:, tok], dn[:, tok])

    def _pairs(self, local: np.ndarray, ids, w, gu, dn, stride: int):
        """Flat (row-local) block indices, inputs x and weights r of every (token, layer, slot, kind)."""
        base = local[None, :, None] * stride + (np.arange(self.layers)[:, None, None] * self.experts + ids) * 2
        idx = np.concatenate([base.ravel(), (base + 1).ravel()])
        x = np.concatenate([np.broadcast_to(gu[:, :, None], ids.shape).ravel(), dn.ravel()])
        r = np.concatenate([w.ravel(), w.ravel()])
        return idx, x, r

    def _update_single(self, rows, ids, w, gu, dn) -> None:
        """One token per sequence: no (row, expert) repeats (a token's top-k experts are distinct).

        Works on (row, expert) pairs: an expert's gate_up and down accumulators are adjacent."""
        E2 = self.num_blocks // 2
        pair = (rows[None, :, None] * E2 + np.arange(self.layers)[:, None, None] * self.experts + ids).ravel()
        r = w.ravel()[:, None]  # [n, 1] for both kinds
        x = np.empty((len(pair), 2))
        x[:, 0] = np.broadcast_to(gu[:, :, None], ids.shape).ravel()
        x[:, 1] = dn.ravel()
        acc = self._acc.reshape(-1, 2, 4)
        a = np.take(acc, pair, axis=0)  # [n, 2 kinds, 4]
        rx = r * x
        a[:, :, 0] += r
        a[:, :, 1] += rx
        a[:, :, 2] += rx * x
        np.maximum(a[:, :, 3], x, out=a[:, :, 3])
        _put_rows(acc, pair, a)
        _put_rows(self._feat.reshape(-1, 2, 4), pair, _phi(a.reshape(-1, 4)))

    def _update_multi(self, rows, lens, ids, w, gu, dn) -> None:
        """Several tokens per sequence: sum per (sequence, block) with bincount, then update whole rows."""
        nb, m = self.num_blocks, len(rows)
        local = np.repeat(np.arange(m), lens)
        idx, x, r = self._pairs(local, ids, w, gu, dn, nb)
        size = m * nb
        add = np.empty((m, nb, 4))
        add[..., 0] = np.bincount(idx, weights=r, minlength=size).reshape(m, nb)
        add[..., 1] = np.bincount(idx, weights=r * x, minlength=size).reshape(m, nb)
        add[..., 2] = np.bincount(idx, weights=r * x * x, minlength=size).reshape(m, nb)
        mx = np.zeros(size)
        np.maximum.at(mx, idx, x)
        acc = self._acc[rows]  # [m, nb, 4]
        acc[..., :3] += add[..., :3]
        np.maximum(acc[..., 3], mx.reshape(m, nb), out=acc[..., 3])
        _put_rows(self._acc, rows, acc)
        _put_rows(self._feat, rows, _phi(acc.reshape(-1, 4)))

    def drop(self, seq_id: Hashable) -> None:
        """Forget a sequence (finished, or preempted: its recompute will add its tokens again)."""
        row = self._slot.pop(seq_id, None)
        if row is None:
            return
        self._acc[row] = 0.0
        self._feat[row] = 0.0
        self._free.append(row)
        self._free.sort(reverse=True)

    # -------------------------------------------------------------------- views
    def sequences(self) -> list:
        return list(self._slot)

    def sequence_features(self, seq_id: Hashable) -> np.ndarray:
        """[num_blocks, 3] phi of one sequence (zeros for blocks it never routed to)."""
        row = self._slot.get(seq_id)
        return np.zeros((self.num_blocks, 3)) if row is None else self._feat[row, :, :3].copy()

    def merged(self, usage: Mapping[Hashable, int]) -> np.ndarray:
        """[num_blocks, 3] phi averaged over `usage`'s sequences, weighted by their KV blocks."""
        wt = np.zeros(self._cap)
        for sid, blocks in usage.items():
            row = self._slot.get(sid)
            if row is not None and blocks > 0:
                wt[row] = blocks
        used = np.flatnonzero(wt)
        if not used.size:
            return np.zeros((self.num_blocks, 3))
        lo, hi = int(used[0]), int(used[-1]) + 1  # rows cluster low (lowest free row first)
        wt = wt[lo:hi]
        both = (wt @ self._feat[lo:hi].reshape(hi - lo, -1)).reshape(-1, 4)  # phi sums and weight of seen
        num, den = both[:, :3], both[:, 3]
        return np.divide(num, den[:, None], out=np.zeros_like(num), where=den[:, None] > 0)


def _put_rows(dst: np.ndarray, rows: np.ndarray, values: np.ndarray) -> None:
    """`dst[rows] = values` for a C-contiguous `dst`, moving each row as one record: numpy's fancy assignment copies
    element by element, which made these scatters most of a decode step's feature update (about 10x slower)."""
    if not dst.flags.c_contiguous:
        raise ValueError("_put_rows writes through a view: dst must be C-contiguous")
    rec = np.dtype((np.void, dst[0].nbytes))
    flat = dst.reshape(len(dst), -1).view(rec).reshape(-1)
    np.put(flat, rows, np.ascontiguousarray(values, dtype=dst.dtype).reshape(len(rows), -1).view(rec).reshape(-1))


def _phi(a: np.ndarray) -> np.ndarray:
    """`[n, 4]` accumulators (sum r, sum r*x, sum r*x^2, max x) -> `[n, 4]` (mean, rms, max, seen)."""
    s0 = a[:, 0]
    seen = s0 > 0
    f = np.zeros_like(a)
    np.divide(a[:, 1], s0, out=f[:, 0], where=seen)
    np.divide(a[:, 2], s0, out=f[:, 1], where=seen)
    np.sqrt(f[:, 1], out=f[:, 1])
    np.copyto(f[:, 2], a[:, 3], where=seen)
    f[:, 3] = seen
    return f
