"""policies.features.BatchedPromptFeatures computes exactly what a straightforward per-sequence reference computes."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, Mapping

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.features import BatchedPromptFeatures
from policies.observe import _as_lt


@dataclass
class PromptFeatures:  # the straightforward reference: one accumulator per sequence
    """Per-sequence accumulators of the phi features, one row per linear-block (page-table order)."""

    layers: int
    experts: int
    _acc: dict = field(init=False, default_factory=dict)  # seq_id -> [num_blocks, 4]: sum r, sum r*x, sum r*x^2, max x

    @property
    def num_blocks(self) -> int:
        return self.layers * self.experts * 2

    def update(self, seq_id: Hashable, topk_ids, topk_weights, gate_up_in_norm, down_in_norm) -> None:
        """Add one sequence's tokens: ids/weights/down norms [layers, n, k], gate_up norms [layers, n]."""
        ids = _as_lt(topk_ids, "topk_ids", 3)
        w = _as_lt(topk_weights, "topk_weights", 3).astype(np.float64)
        gu = _as_lt(gate_up_in_norm, "gate_up_in_norm", 2).astype(np.float64)
        dn = _as_lt(down_in_norm, "down_in_norm", 3).astype(np.float64)
        if not (ids.shape == w.shape == dn.shape and gu.shape == ids.shape[:2] and ids.shape[0] == self.layers):
            raise ValueError(f"feature shapes disagree: ids {ids.shape}, weights {w.shape}, "
                             f"gate_up norms {gu.shape}, down norms {dn.shape}, layers {self.layers}")
        if ids.shape[1] == 0:
            return
        acc = self._acc.get(seq_id)
        if acc is None:
            acc = self._acc[seq_id] = np.zeros((self.num_blocks, 4), dtype=np.float64)
        base = (np.arange(self.layers)[:, None, None] * self.experts + ids) * 2
        x_gu = np.broadcast_to(gu[:, :, None], ids.shape)
        for kind, x in ((0, x_gu), (1, dn)):
            idx = (base + kind).ravel()
            xr, wr = x.ravel(), w.ravel()
            acc[:, 0] += np.bincount(idx, weights=wr, minlength=self.num_blocks)
            acc[:, 1] += np.bincount(idx, weights=wr * xr, minlength=self.num_blocks)
            acc[:, 2] += np.bincount(idx, weights=wr * xr * xr, minlength=self.num_blocks)
            np.maximum.at(acc[:, 3], idx, xr)

    def drop(self, seq_id: Hashable) -> None:
        """Forget a sequence (finished, or preempted: its recompute will add its tokens again)."""
        self._acc.pop(seq_id, None)

    def sequences(self) -> list:
        return list(self._acc)

    def sequence_features(self, seq_id: Hashable) -> np.ndarray:
        """[num_blocks, 3] phi of one sequence (zeros for blocks it never routed to)."""
        acc = self._acc.get(seq_id)
        out = np.zeros((self.num_blocks, 3))
        if acc is None:
            return out
        seen = acc[:, 0] > 0
        out[seen, 0] = acc[seen, 1] / acc[seen, 0]
        out[seen, 1] = np.sqrt(acc[seen, 2] / acc[seen, 0])
        out[seen, 2] = acc[seen, 3]
        return out

    def merged(self, usage: Mapping[Hashable, int]) -> np.ndarray:
        """[num_blocks, 3] phi averaged over `usage`'s sequences, weighted by their KV blocks."""
        num = np.zeros((self.num_blocks, 3))
        den = np.zeros(self.num_blocks)
        for sid, blocks in usage.items():
            acc = self._acc.get(sid)
            if acc is None or blocks <= 0:
                continue
            seen = acc[:, 0] > 0
            num[seen] += blocks * self.sequence_features(sid)[seen]
            den[seen] += blocks
        return np.divide(num, den[:, None], out=np.zeros_like(num), where=den[:, None] > 0)


def _batch(rng, L, E, K, T):
    ids = np.array([[rng.choice(E, K, replace=False) for _ in range(T)] for _ in range(L)], dtype=np.int64).reshape(L, T, K)
    return ids, rng.random((L, T, K)), rng.random((L, T)) * 3, rng.random((L, T, K)) * 2


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), L=st.integers(1, 3), E=st.integers(2, 9), steps=st.integers(1, 25))
def test_batched_features_equal_the_reference(seed, L, E, steps):
    rng = np.random.default_rng(seed)
    K = int(rng.integers(1, E + 1))
    ref, fast = PromptFeatures(L, E), BatchedPromptFeatures(L, E, initial_slots=1)  # forces slot growth
    for step in range(steps):
        seqs = [int(s) for s in rng.choice(12, int(rng.integers(1, 6)), replace=False)]
        lens = rng.integers(1, 4, len(seqs)) if rng.random() < 0.5 else np.ones(len(seqs), int)
        if rng.random() < 0.2:
            lens[0] = 0  # a sequence with no tokens in this step
        ids, w, gu, dn = _batch(rng, L, E, K, int(lens.sum()))
        if rng.random() < 0.2:
            w[:, : max(1, w.shape[1] // 2)] = 0.0  # zero routing weights: routed but not "seen"
        off = np.concatenate([[0], np.cumsum(lens)])
        for j, s in enumerate(seqs):
            a, b = off[j], off[j + 1]
            ref.update(s, ids[:, a:b], w[:, a:b], gu[:, a:b], dn[:, a:b])
        fast.update_batch(seqs, lens, ids, w, gu, dn)
        if rng.random() < 0.3:
            ref.drop(seqs[0])
            fast.drop(seqs[0])
        usage = {int(s): int(rng.integers(0, 5)) for s in rng.choice(12, 6, replace=False)}
        assert np.allclose(fast.merged(usage), ref.merged(usage), rtol=1e-12, atol=1e-12)
        for s in range(12):
            assert np.allclose(fast.sequence_features(s), ref.sequence_features(s), rtol=1e-12, atol=1e-12)
    assert sorted(fast.sequences()) == sorted(ref.sequences())


def test_single_sequence_update_api_and_empty_merge():
    f = BatchedPromptFeatures(2, 4)
    assert not f.merged({1: 3}).any()
    ids = np.array([[[0, 1]], [[2, 3]]])
    f.update(7, ids, np.full((2, 1, 2), 0.5), np.full((2, 1), 2.0), np.full((2, 1, 2), 4.0))
    m = f.merged({7: 1})
    gu0 = (0 * 4 + 0) * 2  # layer 0, expert 0, gate_up
    assert np.allclose(m[gu0], [2.0, 2.0, 2.0]) and np.allclose(m[gu0 + 1], [4.0, 4.0, 4.0])
    assert not m[(0 * 4 + 2) * 2].any()  # expert 2 of layer 0 was not routed


def test_put_rows_matches_fancy_assignment_and_refuses_a_copy():
    from policies.features import _put_rows
    rng = np.random.default_rng(3)
    dst = rng.random((50, 2, 4))
    want = dst.copy()
    rows = np.array([7, 0, 49, 13])
    values = rng.random((4, 2, 4))
    want[rows] = values
    _put_rows(dst, rows, values)
    assert np.array_equal(dst, want)
    _put_rows(dst.reshape(-1, 2, 4), rows, values.reshape(4, 8))  # any shape of the same bytes per row
    assert np.array_equal(dst, want)
    try:
        _put_rows(dst[:, :, :2], rows, values[:, :, :2])  # a strided view: writing a copy would be lost
    except ValueError as e:
        assert "C-contiguous" in str(e)
    else:
        raise AssertionError("a non-contiguous destination must be refused")


def test_rows_start_on_cache_lines_and_survive_growth():
    f = BatchedPromptFeatures(2, 4, initial_slots=1)
    for s in range(5):  # grows 1 -> 2 -> 4 -> 8 rows
        f.update(s, np.array([[[0, 1]], [[2, 3]]]), np.full((2, 1, 2), 0.5), np.full((2, 1), 2.0),
                 np.full((2, 1, 2), 4.0))
    for a in (f._acc, f._feat):
        assert a.ctypes.data % 64 == 0 and a.flags.c_contiguous and a.shape == (8, f.num_blocks, 4)
    assert np.allclose(f.merged({s: 1 for s in range(5)})[0], [2.0, 2.0, 2.0])


def test_update_batch_with_a_sequence_twice_equals_two_updates():
    """Two steps' single tokens of one sequence in one batch both count (none is overwritten by the other)."""
    ids = np.zeros((1, 2, 1), dtype=np.int64)
    w = np.ones((1, 2, 1))
    gu, dn = np.array([[1.0, 3.0]]), np.array([[[2.0], [4.0]]])
    batched, stepwise = BatchedPromptFeatures(1, 2), BatchedPromptFeatures(1, 2)
    batched.update_batch(["s", "s"], [1, 1], ids, w, gu, dn)
    for t in range(2):
        stepwise.update("s", ids[:, t:t + 1], w[:, t:t + 1], gu[:, t:t + 1], dn[:, t:t + 1])
    np.testing.assert_allclose(batched.sequence_features("s"), stepwise.sequence_features("s"))
    np.testing.assert_allclose(batched.sequence_features("s")[0], [2.0, np.sqrt(5.0), 3.0])  # gate_up: mean, rms, max


def _one_token(layers: int = 2):
    """One token routed to experts 0 and 1 in every layer: ids, weights, gate_up norms, down norms."""
    return (np.tile([[[0, 1]]], (layers, 1, 1)), np.full((layers, 1, 2), 0.5), np.full((layers, 1), 2.0),
            np.full((layers, 1, 2), 4.0))


def test_no_initial_rows_still_takes_sequences():
    f = BatchedPromptFeatures(2, 4, initial_slots=0)
    f.update("a", *_one_token())
    assert f.sequences() == ["a"] and np.allclose(f.sequence_features("a")[0], [2.0, 2.0, 2.0])


def test_a_sequence_with_no_token_in_a_batch_gets_no_row():
    f = BatchedPromptFeatures(2, 4)
    f.update_batch(["a", "idle"], [1, 0], *_one_token())
    assert f.sequences() == ["a"]


@pytest.mark.parametrize("bad", ["weights", "gate_up", "down", "layers", "tokens", "ids-2d"])
def test_each_shape_disagreement_alone_is_refused(bad):
    ids, w, gu, dn = _one_token()
    lens = [1]
    if bad == "weights":
        w = w[:, :, :1]
    elif bad == "gate_up":
        gu = gu[:1]
    elif bad == "down":
        dn = dn[:, :, :1]
    elif bad == "layers":
        ids, w, gu, dn = _one_token(layers=3)
    elif bad == "tokens":
        lens = [2]
    else:
        ids, w, dn = ids[0], w[0], dn[0]
    with pytest.raises(ValueError, match="feature shapes disagree"):
        BatchedPromptFeatures(2, 4).update_batch(["a"], lens, ids, w, gu, dn)
