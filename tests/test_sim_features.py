"""policies.features.BatchedPromptFeatures computes exactly what policies.observe.PromptFeatures computes."""
from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.features import BatchedPromptFeatures
from policies.observe import PromptFeatures


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
