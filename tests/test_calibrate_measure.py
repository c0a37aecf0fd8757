"""Measured damages, sensitivity and per-domain damages (pwruntime.calibrate) on planted and tiny models."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from model_fixtures import make_text, make_tiny_checkpoint
from policies.calibration import NB
from pwruntime.calibrate.domains import domain_damage, expected_token_damage
from pwruntime.calibrate.global_sensitivity import monotone_envelope, sensitivity_table
from pwruntime.calibrate.measure import MeasuringStore, SequenceStats, measure_sequences
from pwruntime.model import DenseExpertStore, load_model
from pwruntime.quant.build import QuantizeOptions, quantize_checkpoint
from pwruntime.quant.sensitivity import hessian_diagonals
from pwruntime.quant.store import APExpertStore

BITS = (3, 4, 5, 6, 7, 8)


class _PlantedAP:
    """W_b = W + 2^-b * P: a known perturbation per block and bitwidth."""

    def __init__(self, dense: DenseExpertStore, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.dense = dense
        self.p = {(e, k): torch.randn(dense.weight(0, e, k).shape, generator=g, dtype=torch.float64)
                  for e in range(dense.gate_up[0].shape[0]) for k in ("gate_up", "down")}

    def dequantized(self, layer, e, kind, b):
        return (self.dense.weight(layer, e, kind).double() + 2.0 ** -b * self.p[(e, kind)]).float()


def test_measured_damage_equals_a_direct_computation_on_a_planted_case():
    torch.manual_seed(0)
    E, H, I, T, k = 3, 6, 4, 7, 2
    dense = DenseExpertStore([torch.randn(E, 2 * I, H)], [torch.randn(E, H, I)])
    ap = _PlantedAP(dense)
    store = MeasuringStore(dense, ap, BITS)
    x = torch.randn(T, H)
    ids = torch.stack([torch.randperm(E)[:k] for _ in range(T)])
    w = torch.softmax(torch.randn(T, k), dim=-1)
    out = store.moe(0, x, ids, w)
    torch.testing.assert_close(out, dense.moe(0, x, ids, w))  # serves the full-precision experts
    got = store.collect()
    for e in range(E):
        tok, slot = np.nonzero(ids.numpy() == e)
        r = w.numpy()[tok, slot].astype(np.float64)
        xg = x.numpy()[tok].astype(np.float64)
        gu = dense.weight(0, e, "gate_up").double().numpy()
        hh = xg @ gu.T
        act = hh[:, :I] / (1 + np.exp(-hh[:, :I])) * hh[:, I:]
        for kind, inp in ((0, xg), (1, act)):
            name = ("gate_up", "down")[kind]
            p = ap.p[(e, name)].numpy()
            i = e * 2 + kind
            assert got["weight"][i] == pytest.approx(r.sum()) and got["pairs"][i] == len(r)
            for b in BITS:
                d = (2.0 ** -b * p) @ inp.T  # (W_b - W) x, one column per pair
                assert got["err"][i, b] == pytest.approx(float((d ** 2).sum(0) @ r), rel=1e-4)
                assert got["rel"][i, b] == pytest.approx(float((((2.0 ** -b - 2.0 ** -8) * p @ inp.T) ** 2).sum(0) @ r),
                                                         rel=1e-4, abs=1e-12)
                if b > 3:
                    step = (2.0 ** -(b - 1) - 2.0 ** -b) * p @ inp.T
                    assert got["step"][i, b] == pytest.approx(float((step ** 2).sum(0) @ r), rel=1e-4)
            assert np.isnan(got["step"][i, 3]) and np.isnan(got["err"][i, :3]).all() and got["rel"][i, 8] == 0


def test_sensitivity_equals_eq2_on_a_planted_case():
    torch.manual_seed(1)
    dense = DenseExpertStore([torch.randn(2, 8, 5)], [torch.randn(2, 5, 4)])
    ap = _PlantedAP(dense, seed=1)
    h = {"gate_up": np.random.default_rng(0).uniform(0.5, 2, (1, 2, 5)),
         "down": np.random.default_rng(1).uniform(0.5, 2, (1, 2, 4))}
    s = sensitivity_table(MeasuringStore(dense, ap, BITS).deltas, h, BITS, progress=False)
    assert s.shape == (4, NB) and np.isnan(s[:, :3]).all()
    for e in range(2):
        for k, kind in enumerate(("gate_up", "down")):
            p = ap.p[(e, kind)].numpy()
            for b in BITS:
                want = float((((2.0 ** -b) * p) ** 2).sum(0) @ h[kind][0, e])
                assert s[e * 2 + k, b] == pytest.approx(want, rel=1e-3)  # the fake AP rounds W_b to fp32
    bumped = s.copy()
    bumped[0, 5] = s[0, 4] * 2  # now s[0, 4] < s[0, 5]: the 4-bit entry is lifted to the 5-bit one
    env, changed = monotone_envelope(bumped, BITS)
    assert changed == 1 and env[0, 4] == bumped[0, 5] and env[0, 3] == s[0, 3] > env[0, 4]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("calib_measure")
    src = make_tiny_checkpoint(root, "qwen2_moe", seed=3)
    calib = root / "calib.txt"
    calib.write_text(make_text(900, seed=5))
    ap_dir = root / "ap"
    quantize_checkpoint(src, ap_dir, QuantizeOptions(weighting="hessian", calib_files=(str(calib),), calib_tokens=400,
                                                     calib_seq_len=100), progress=False)
    model = load_model(src)
    ap = APExpertStore.from_checkpoint(ap_dir, cache_bytes=0)
    seqs = [model.tokenizer.encode(make_text(80, seed=s))[:64] for s in range(4)]
    return model, ap, seqs


def test_sensitivity_is_monotone_non_increasing_in_bits_for_every_block(tiny):
    model, ap, seqs = tiny
    h = hessian_diagonals(model, [torch.tensor(s) for s in seqs], damp=0.0, progress=False)
    s = sensitivity_table(MeasuringStore(model.experts, ap, BITS).deltas, h, BITS, progress=False)
    vals = s[:, list(BITS)]
    assert (vals[:, -1] > 0).all() and (vals[:, -1] < 1e-3 * vals[:, 0]).all()
    assert (np.diff(vals, axis=1) <= 0).all(), vals  # raw, before any envelope
    assert monotone_envelope(s, BITS)[1] == 0


def test_measure_sequences_on_a_tiny_model(tiny):
    model, ap, seqs = tiny
    stats = measure_sequences(model, ap, seqs, BITS, progress=False)
    L, E, k = model.config.num_moe_layers, model.config.experts, model.config.top_k
    n = L * E * 2
    assert stats.err.shape == (4, n, NB) and stats.phi.shape == (4, n, 3) and stats.mass.shape == (4, L, E)
    assert isinstance(model.experts, DenseExpertStore)  # restored
    # every (token, slot) pair lands on one expert: per layer, pairs sum to tokens * k for both kinds
    pairs = stats.pairs.reshape(4, L, E, 2).sum(axis=2)
    np.testing.assert_array_equal(pairs, np.broadcast_to(stats.tokens[:, None, None] * k, (4, L, 2)))
    np.testing.assert_allclose(stats.mass.sum(axis=2), 1.0)
    routed = stats.weight > 0
    assert ((stats.phi[..., 0] > 0) == routed).all() and (stats.phi[..., 0] <= stats.phi[..., 1] + 1e-9).all()
    tot = stats.err.sum(axis=(0, 1))
    assert (np.diff(tot[list(BITS)]) < 0).all()  # errors fall with bits
    # rel (against the top bits) is zero at the top; steps exist from 4..8 bits and are positive where routed
    assert (stats.rel[..., 8] == 0).all() and np.isnan(stats.step[..., 3]).all()
    assert (stats.step[..., 4:9][routed] > 0).all() and (stats.step[..., 4:9][~routed] == 0).all()
    # the measurement is deterministic
    again = measure_sequences(model, ap, seqs, BITS, progress=False)
    np.testing.assert_array_equal(again.err, stats.err)


def test_domain_damage_is_per_routed_pair_and_falls_back_for_unrouted_blocks():
    S, L, E = 2, 1, 3
    n = L * E * 2
    rel = np.full((S, n, NB), np.nan)
    rel[..., list(BITS)] = 0.0
    rel[:, :, 3] = 6.0
    pairs = np.array([[2, 2, 1, 1, 0, 0], [4, 4, 1, 1, 0, 0]], dtype=float)
    z = np.zeros((S, n))
    stats = SequenceStats(np.array([3, 5]), z, pairs, rel, rel, rel, np.zeros((S, n, 3)), np.zeros((S, L, E)))
    fallback = np.full((n, NB), 7.0)
    Ed, freq = domain_damage(stats, BITS, L, E, fallback)
    assert Ed[0, 3] == pytest.approx(12.0 / 6) and Ed[2, 3] == pytest.approx(12.0 / 2)
    assert Ed[4, 3] == 7.0 and (Ed[:, 8] == 0).all() and np.isnan(Ed[:, :3]).all()
    np.testing.assert_allclose(freq, [[6 / 8, 2 / 8, 0.0]])
    bits = np.full(n, 3)
    assert expected_token_damage(Ed, freq, bits) == pytest.approx(6 / 8 * 4 + 2 / 8 * 12 + 0.0)
    # without a fallback, a block the domain never routed to gets 0 damage at every stored bitwidth, not NaN
    Ed0, _ = domain_damage(stats, BITS, L, E)
    assert (Ed0[4:, list(BITS)] == 0).all() and Ed0[0, 3] == Ed[0, 3]


def test_routing_frequency_is_weight_per_token_floored_per_layer_and_scales_both_blocks():
    """f[l, e] = summed gate_up routing weight / tokens, floored at 1% of the layer's mean; frequency_scaled multiplies
    both blocks of expert (l, e) (rows 2i and 2i + 1) by that expert's f."""
    from pwruntime.calibrate.global_sensitivity import frequency_scaled, routing_frequency

    weight = np.array([6.0, 6.0, 3.0, 3.0, 0.0, 0.0, 12.0, 12.0, 0.0, 0.0, 0.0, 0.0])  # 2 layers x 3 experts x 2
    f = routing_frequency(weight, 3, 2, 3)
    np.testing.assert_allclose(f, [[2.0, 1.0, 0.01], [4.0, 0.04 / 3, 0.04 / 3]])
    s = np.arange(12 * NB, dtype=float).reshape(12, NB) + 1.0
    scaled = frequency_scaled(s, f)
    np.testing.assert_allclose(scaled, s * np.repeat(f.reshape(-1), 2)[:, None])
    np.testing.assert_allclose(scaled[6:8], 4.0 * s[6:8])  # layer 1, expert 0: both blocks
