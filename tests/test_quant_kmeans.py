"""Weighted 1-D k-means with incremental upscaling (pwruntime.quant.kmeans)."""
from __future__ import annotations

import numpy as np
import pytest

from pwruntime.quant.kmeans import quantize_matrix, weighted_error

BITS = range(3, 9)


def _mats(seed: int = 0):
    rng = np.random.default_rng(seed)
    return [
        (rng.standard_normal((16, 50)) * 0.02).astype(np.float32),
        (rng.standard_t(3, (8, 768)) * 0.01).astype(np.float32),  # heavy tails
        (rng.standard_normal((4, 1408)) * 0.05).astype(np.float16).astype(np.float32),  # many ties
    ]


def test_b_bit_clusters_are_the_top_bits_of_the_8_bit_code():
    rng = np.random.default_rng(1)
    w = rng.standard_normal((6, 200))
    wt = rng.uniform(0.1, 3.0, (6, 200))
    q = quantize_matrix(w, wt, seed=3)
    for b in BITS:
        code_b = q.codes >> (8 - b)
        assert np.array_equal(q.codes_at(b), code_b)
        for r in range(w.shape[0]):
            for c in np.unique(code_b[r]):
                members = code_b[r] == c
                mean = (wt[r, members] * w[r, members]).sum() / wt[r, members].sum()
                assert q.luts[b][r, c] == np.float16(mean)  # LUT_b is the weighted mean of the b-bit cluster
            # clusters are value intervals, ordered like their codes
            order = np.argsort(w[r], kind="stable")
            assert (np.diff(code_b[r][order].astype(int)) >= 0).all()


def test_three_bit_seed_is_a_weighted_lloyd_fixed_point():
    rng = np.random.default_rng(2)
    w = rng.standard_normal((5, 300))
    wt = rng.uniform(0.5, 2.0, (5, 300))
    q = quantize_matrix(w, wt, seed=0)
    for r in range(5):
        code = q.codes_at(3)[r]
        cents = np.array([(wt[r, code == c] * w[r, code == c]).sum() / wt[r, code == c].sum() for c in range(8)])
        nearest = np.abs(w[r][:, None] - cents[None, :]).argmin(axis=1)
        dist_own = np.abs(w[r] - cents[code])
        dist_best = np.abs(w[r] - cents[nearest])
        assert np.allclose(dist_own, dist_best, atol=1e-12)


@pytest.mark.parametrize("weighted", [False, True])
def test_error_falls_monotonically_with_bits_for_every_block(weighted):
    for i, w in enumerate(_mats()):
        wt = np.random.default_rng(i).exponential(1.0, w.shape) if weighted else None
        q = quantize_matrix(w, wt, seed=i)
        for r in range(w.shape[0]):  # every row is its own quantizer, so check per row too
            errs = [weighted_error(w[r:r + 1], None if wt is None else wt[r:r + 1],
                                   type(q)(codes=q.codes[r:r + 1], luts={b: q.luts[b][r:r + 1] for b in BITS}), b)
                    for b in BITS]
            assert all(a >= b for a, b in zip(errs, errs[1:])), (i, r, errs)
        errs = [weighted_error(w, wt, q, b) for b in BITS]
        assert all(a > 1.5 * b for a, b in zip(errs[:4], errs[1:5])), errs  # real progress 3 -> 7 bits


def test_weighted_kmeans_beats_unweighted_on_the_weighted_error():
    rng = np.random.default_rng(4)
    rows = []
    wts = []
    for _ in range(4):
        spread = rng.uniform(-1.0, 1.0, 480)  # many values that do not matter
        important = rng.uniform(0.10, 0.20, 32)  # few values that matter, inside one coarse cluster
        rows.append(np.concatenate([spread, important]))
        wts.append(np.concatenate([np.full(480, 1e-3), np.full(32, 1.0)]))
    w, wt = np.array(rows), np.array(wts)
    q_w = quantize_matrix(w, wt, seed=0)
    q_u = quantize_matrix(w, None, seed=0)
    for b in (3, 4, 5):
        assert weighted_error(w, wt, q_w, b) < 0.25 * weighted_error(w, wt, q_u, b)
    # and the unweighted one wins on the unweighted error: the weights really changed the clustering
    assert weighted_error(w, None, q_u, 3) < weighted_error(w, None, q_w, 3)


def test_deterministic_given_seed_and_edge_cases():
    w = _mats(7)[0]
    a, b = quantize_matrix(w, seed=11), quantize_matrix(w, seed=11)
    assert np.array_equal(a.codes, b.codes) and all(np.array_equal(a.luts[k], b.luts[k]) for k in BITS)
    const = np.full((2, 40), 0.25)
    qc = quantize_matrix(const, np.zeros((2, 40)))  # all-zero weights fall back to uniform
    for k in BITS:
        assert np.array_equal(qc.reconstruct(k), const.astype(np.float32))
    tiny = np.array([[0.5, -1.0, 2.0, 0.0, 0.125]])  # fewer elements than 3-bit clusters
    qt = quantize_matrix(tiny)
    assert np.array_equal(qt.reconstruct(3), tiny.astype(np.float32))
    assert len(np.unique(qt.codes)) == 5


def test_per_column_weights_broadcast_and_bad_weights_rejected():
    rng = np.random.default_rng(5)
    w = rng.standard_normal((3, 64))
    h = rng.uniform(0.0, 2.0, 64)
    a = quantize_matrix(w, h, seed=1)
    b = quantize_matrix(w, np.broadcast_to(h, w.shape).copy(), seed=1)
    assert np.array_equal(a.codes, b.codes)
    with pytest.raises(ValueError):
        quantize_matrix(w, -h)
    with pytest.raises(ValueError):
        quantize_matrix(w[:, :0])


def test_normalize_weights_scales_rows_to_mean_one_and_floors_zeros():
    """Each row is scaled to mean 1 on its own, zero weights are lifted to WEIGHT_FLOOR (so no cluster is weightless),
    an all-zero row falls back to uniform, and a per-column vector broadcasts over the rows."""
    from pwruntime.quant.kmeans import WEIGHT_FLOOR, normalize_weights

    w = normalize_weights(np.array([[0.0, 1.0, 3.0, 0.0], [2.0, 2.0, 2.0, 2.0], [0.0, 0.0, 0.0, 0.0]]), (3, 4))
    np.testing.assert_allclose(w, [[WEIGHT_FLOOR, 1.0, 3.0, WEIGHT_FLOOR], [1.0] * 4, [1.0] * 4])
    assert w.dtype == np.float64 and (w > 0).all()
    np.testing.assert_allclose(normalize_weights(np.array([1.0, 3.0]), (2, 2)), [[0.5, 1.5], [0.5, 1.5]])
    assert np.array_equal(normalize_weights(None, (2, 3)), np.ones((2, 3)))
