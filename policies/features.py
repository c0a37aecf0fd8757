"""Per-sequence prompt features phi for a whole batch at once: `BatchedPromptFeatures`.

Per sequence and linear-block, over the tokens the sequence computed: the routing-weighted mean
and RMS of the block's input norm and the max norm; merged over running sequences weighted by their
KV blocks (see policies.observe). Methods: `update` (one sequence), `update_batch` (a whole
flattened batch, or several steps' batches one after another, in a handful of numpy calls), `drop`, `sequences`,
`sequence_features`, `merged`. Sequences live in rows ("slots") of dense arrays, and each sequence's phi is kept up
to date at the entries a step touched, so `merged` is two matrix-vector products instead of a Python loop over
sequences.
Results equal a straightforward per-sequence reference up to floating-point summation order
(tests/test_sim_features.py checks 1e-12).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from itertools import compress
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
            arr = _zeros_aligned((cap, nb, 4))
            if old:
                arr[:old] = getattr(self, name)
            setattr(self, name, arr)
        self._free.extend(range(cap - 1, old - 1, -1))  # pop() hands out the lowest free row
        self._cap = cap

    def _rows(self, seq_ids: list) -> np.ndarray:
        """The rows of `seq_ids`, in order, new sequences given rows as they come (as `_row` one by one)."""
        rows = list(map(self._slot.get, seq_ids))
        if None in rows:
            rows = [self._row(s) if r is None else r for s, r in zip(seq_ids, rows)]
        return np.array(rows, dtype=np.int64)

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
        """A flattened batch (sequence 0's tokens, then sequence 1's, ...): arrays as in `update`. A sequence may
        appear more than once (several steps' batches one after another): its runs add up in order."""
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
        kept = list(compress(seq_ids, keep.tolist()))
        rows = self._rows(kept)
        lens = lens[keep]
        if len(set(kept)) < len(kept):  # several steps' batches at once: a sequence's tokens in several runs
            rows, local = np.unique(rows, return_inverse=True)
            self._update_multi(rows, np.repeat(local, lens), ids, w, gu, dn)
            return
        single = lens == 1
        if single.all():
            self._update_single(rows, ids, w, gu, dn)
            return
        first = np.cumsum(lens) - lens  # each kept sequence's first token (empty ones hold none)
        if single.any():
            t = first[single]  # the one token of each single-token sequence
            self._update_single(rows[single], *take_tokens(t, ids, w, gu, dn))
        multi = ~single
        if single.sum() <= lens[multi].sum():
            # chunks are most of the step: the arrays go to `_update_multi` whole, uncopied, each token to its
            # multi-token sequence's row (a single-token one's to none: the extra row)
            local = np.repeat(np.where(multi, np.cumsum(multi) - 1, int(multi.sum())), lens)
            self._update_multi(rows[multi], local, ids, w, gu, dn)
            return
        tok = np.flatnonzero(np.repeat(multi, lens))  # decode rows are most: a copy of the chunks' fewer tokens
        self._update_multi(rows[multi], np.repeat(np.arange(int(multi.sum())), lens[multi]),
                           *take_tokens(tok, ids, w, gu, dn))

    def _pair_index(self, local: np.ndarray, ids: np.ndarray) -> np.ndarray:
        """[layers * tokens * k] flat (row, layer, expert) pair of every routing slot: `local[t]` is token t's row."""
        E2 = self.num_blocks // 2
        return (local[None, :, None] * E2 + np.arange(0, self.layers * self.experts, self.experts)[:, None, None]
                + ids).ravel()

    def _update_single(self, rows, ids, w, gu, dn) -> None:
        """One token per sequence: no (row, expert) repeats (a token's top-k experts are distinct).

        Works on (row, expert) pairs: an expert's gate_up and down accumulators are adjacent."""
        pair = self._pair_index(rows, ids)
        x = np.empty((len(pair), 2))  # per pair: the gate_up input, the down input
        x.reshape(-1, ids.shape[2], 2)[:, :, 0] = gu.reshape(-1, 1)  # a token's gate_up input, for each of its slots
        x[:, 1] = dn.ravel()
        acc = self._acc.reshape(-1, 2, 4)
        a = np.take(acc, pair, axis=0).reshape(-1, 4)  # [pairs * 2 kinds, 4]
        _accumulate(a, np.repeat(w.ravel(), 2), x.ravel())
        _put_rows(acc, pair, a)
        _put_rows(self._feat.reshape(-1, 2, 4), pair, _phi(a))

    def _update_multi(self, rows, local, ids, w, gu, dn) -> None:
        """Several tokens per sequence: sum per (sequence, block) with bincount, then update whole rows. `rows` are
        distinct; token t belongs to `rows[local[t]]`, in any order, or to none where `local[t] == len(rows)` (its
        sums go to an extra row, dropped).

        A pair's two kinds have the same routing weights, so one bincount gives both kinds' sum r; each other sum
        adds the same terms in the same order as one bincount over both kinds' blocks would."""
        m, E2 = len(rows), self.num_blocks // 2
        pair = self._pair_index(local, ids)
        size = (m + 1) * E2
        r = w.ravel()
        add = np.empty((size, 2, 4))
        add[:, :, 0] = np.bincount(pair, weights=r, minlength=size)[:, None]
        add[:, :, 3] = 0.0
        for kind, x in enumerate((np.broadcast_to(gu[:, :, None], ids.shape).ravel(), dn.ravel())):
            rx = r * x
            add[:, kind, 1] = np.bincount(pair, weights=rx, minlength=size)
            add[:, kind, 2] = np.bincount(pair, weights=rx * x, minlength=size)
            np.maximum.at(add[:, kind, 3], pair, x)
        acc = self._acc[rows]  # [m, nb, 4]
        flat = acc.reshape(-1, 4)
        add = add[:m * E2].reshape(-1, 4)   # the extra row's sums dropped
        flat[:, :3] += add[:, :3]
        np.maximum(flat[:, 3], add[:, 3], out=flat[:, 3])
        _put_rows(self._acc, rows, acc)
        _put_rows(self._feat, rows, _phi(flat))

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
        wt = self._merge_weights(usage)
        used = np.flatnonzero(wt)
        if not used.size:
            return np.zeros((self.num_blocks, 3))
        lo, hi = int(used[0]), int(used[-1]) + 1  # rows cluster low (lowest free row first)
        wt = wt[lo:hi]
        both = (wt @ self._feat[lo:hi].reshape(hi - lo, -1)).reshape(-1, 4)  # phi sums and weight of seen
        den = both[:, 3]
        seen = den > 0
        out = both[:, :3] / np.where(seen, den, 1.0)[:, None]
        out[~seen] = 0.0
        return out

    def _merge_weights(self, usage: Mapping[Hashable, int]) -> np.ndarray:
        """[rows] each row's KV blocks in `usage` (0: not in it, no blocks, or no row)."""
        slot = self._slot
        rows = np.fromiter((slot.get(s, -1) for s in usage), dtype=np.int64, count=len(usage))
        blocks = np.fromiter(usage.values(), dtype=np.float64, count=len(usage))
        ok = (rows >= 0) & (blocks > 0)
        wt = np.zeros(self._cap)
        wt[rows[ok]] = blocks[ok]
        return wt


def _put_rows(dst: np.ndarray, rows: np.ndarray, values: np.ndarray) -> None:
    """`dst[rows] = values` for a C-contiguous `dst`, moving each row as one record: numpy's fancy assignment copies
    element by element, which made these scatters most of a decode step's feature update (about 10x slower)."""
    if not dst.flags.c_contiguous:
        raise ValueError("_put_rows writes through a view: dst must be C-contiguous")
    rec = np.dtype((np.void, dst[0].nbytes))
    flat = dst.reshape(len(dst), -1).view(rec).reshape(-1)
    np.put(flat, rows, np.ascontiguousarray(values, dtype=dst.dtype).reshape(len(rows), -1).view(rec).reshape(-1))


def take_tokens(t: np.ndarray, *arrays: np.ndarray) -> list[np.ndarray]:
    """Tokens `t` (axis 1) of each `[layers, tokens, ...]` array, as C-contiguous arrays."""
    return [np.take(a, t, axis=1) for a in arrays]


def _zeros_aligned(shape: tuple[int, ...], align: int = 64) -> np.ndarray:
    """float64 zeros starting on an `align`-byte boundary: a 64-byte (sequence, expert) record then fills one cache
    line instead of straddling two (numpy's buffers start 16 bytes past one)."""
    n = int(np.prod(shape))
    buf = np.zeros(n + align // 8, dtype=np.float64)
    off = (-buf.ctypes.data % align) // 8
    return buf[off:off + n].reshape(shape)


def _accumulate(a: np.ndarray, r: np.ndarray, x: np.ndarray) -> None:
    """Add one routing slot to each of `a`'s `[n, 4]` accumulators: weights `r` `[n]`, inputs `x` `[n]`."""
    rx = r * x
    a[:, 0] += r
    a[:, 1] += rx
    rx *= x
    a[:, 2] += rx
    np.maximum(a[:, 3], x, out=a[:, 3])


def _phi(a: np.ndarray) -> np.ndarray:
    """`[n, 4]` accumulators (sum r, sum r*x, sum r*x^2, max x) -> `[n, 4]` (mean, rms, max, seen)."""
    s0 = a[:, 0]
    seen = s0 > 0
    if seen.all():  # a decode step's entries (positive routing weights): no masks
        f = np.empty_like(a)
        np.divide(a[:, 1], s0, out=f[:, 0])
        np.divide(a[:, 2], s0, out=f[:, 1])
        f[:, 2] = a[:, 3]
        f[:, 3] = 1.0
    else:
        f = np.zeros_like(a)
        np.divide(a[:, 1], s0, out=f[:, 0], where=seen)
        np.divide(a[:, 2], s0, out=f[:, 1], where=seen)
        np.copyto(f[:, 2], a[:, 3], where=seen)
        f[:, 3] = seen
    np.sqrt(f[:, 1], out=f[:, 1])
    return f
