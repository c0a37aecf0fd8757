"""Prompt-residual head fitting (pwruntime.calibrate.heads) on planted data."""
from __future__ import annotations

import numpy as np
import pytest

from policies.calibration import NB
from pwruntime.calibrate.heads import fit_residual_head, fit_residual_heads
from pwruntime.calibrate.measure import SequenceStats


def _phi(rng, m):
    """Realistic raw features: mean <= rms <= max norms around different scales."""
    mean = rng.lognormal(1.0, 0.4, m)
    rms = mean * rng.uniform(1.0, 1.3, m)
    mx = rms * rng.uniform(1.2, 3.0, m)
    return np.stack([mean, rms, mx], axis=1)


def test_fit_recovers_a_planted_linear_relation_on_raw_features():
    rng = np.random.default_rng(0)
    w_true, a_true = np.array([0.8, -0.5, 0.15]), -0.7
    x_tr, x_he = _phi(rng, 400), _phi(rng, 200)
    y_tr = x_tr @ w_true + a_true + rng.normal(0, 0.02, 400)
    y_he = x_he @ w_true + a_true + rng.normal(0, 0.02, 200)
    head = fit_residual_head(x_tr, y_tr, x_he, y_he)
    np.testing.assert_allclose(head.weights, w_true, atol=0.05)
    assert head.bias == pytest.approx(a_true, abs=0.1)
    # the folded head predicts from raw phi, as the planner applies it
    np.testing.assert_allclose(head.predict(x_he), x_he @ w_true + a_true, atol=0.05)
    assert head.confidence > 0.95 and head.r2_heldout > 0.95
    lo, hi = head.clip
    assert lo == pytest.approx(np.quantile(y_he, 0.05)) and hi == pytest.approx(np.quantile(y_he, 0.95))
    assert head.n_train == 400 and head.n_heldout == 200


def test_pure_noise_gives_confidence_near_zero():
    rng = np.random.default_rng(1)
    x_tr, x_he = _phi(rng, 300), _phi(rng, 300)
    head = fit_residual_head(x_tr, rng.normal(0, 1, 300), x_he, rng.normal(0, 1, 300))
    assert head.confidence < 0.05
    assert np.abs(head.weights).max() < 0.5


def test_a_constant_offset_counts_as_explained_against_the_global_estimate():
    """rho = 1.5 everywhere: g is off by e^1.5 on every sequence; the bias corrects it (confidence high)."""
    rng = np.random.default_rng(2)
    x_tr, x_he = _phi(rng, 100), _phi(rng, 100)
    head = fit_residual_head(x_tr, 1.5 + rng.normal(0, 0.05, 100), x_he, 1.5 + rng.normal(0, 0.05, 100))
    assert head.predict(x_he) == pytest.approx(np.full(100, 1.5), abs=0.05)
    assert head.confidence > 0.99


def test_constant_features_and_too_few_points_are_handled():
    rng = np.random.default_rng(3)
    x = _phi(rng, 50)
    x[:, 2] = 7.0  # a constant feature: absorbed by the bias, weight 0
    y = 0.5 * x[:, 0] + 0.1
    head = fit_residual_head(x, y, x, y)
    assert head.weights[2] == pytest.approx(0.0, abs=1e-9) and head.weights[0] == pytest.approx(0.5, abs=1e-3)
    empty = fit_residual_head(x[:3], y[:3], x, y)
    assert empty.confidence == 0.0 and not empty.weights.any() and empty.clip == (0.0, 0.0)


def test_fit_residual_heads_fills_the_adjacent_transitions_by_kind():
    """Planted: measured/global = exp(0.3 * mean_norm - 0.6) for gate_up, exp(-0.2 * max_norm) for down."""
    rng = np.random.default_rng(4)
    S, n, bits = 40, 12, (3, 4, 5, 6, 7, 8)
    sens = np.full((n, NB), np.nan)
    for i in range(n):
        sens[i, list(bits)] = rng.uniform(0.5, 2.0) * 4.0 ** (8 - np.array(bits))
    phi = np.stack([_phi(rng, n) for _ in range(S)])
    weight = rng.uniform(0.5, 3.0, (S, n))
    weight[rng.random((S, n)) < 0.2] = 0.0  # blocks a sequence did not route to
    step = np.full((S, n, NB), np.nan)
    rho = np.where(np.arange(n) % 2 == 0, 0.3 * phi[..., 0] - 0.6, -0.2 * phi[..., 2])
    for b, lo in zip(bits[::-1][:-1], bits[::-1][1:]):
        g = sens[:, lo] - sens[:, b]
        step[:, :, b] = weight * g[None, :] * np.exp(rho)
    z = np.zeros((S, n, NB))
    stats = SequenceStats(np.full(S, 10), weight, np.ones((S, n)), z, step, z, phi, np.zeros((S, 1, n // 2)))
    heads = fit_residual_heads(stats.subset(range(30)), stats.subset(range(30, 40)), sens, bits)
    assert heads.weights.shape == (2, NB, NB, 3) and len(heads.report) == 10
    np.testing.assert_allclose(heads.weights[0, 8, 7], [0.3, 0.0, 0.0], atol=1e-4)
    assert heads.bias[0, 8, 7] == pytest.approx(-0.6, abs=1e-4)
    np.testing.assert_allclose(heads.weights[1, 4, 3], [0.0, 0.0, -0.2], atol=1e-4)
    assert (heads.confidence[:, [8, 7, 6, 5, 4], [7, 6, 5, 4, 3]] > 0.99).all()
    assert heads.confidence[0, 8, 6] == 0 and not heads.weights[:, 8, 6].any()  # not an adjacent step
