"""The quality model: per-domain damage accrued through routed blocks, and the perplexity fit."""
from __future__ import annotations

import json

import numpy as np
import pytest

from pwsim.quality import QualityError, QualityModel, fit_perplexity, load_fit_points
from pwsim.routing import TraceRouting


def _planted(layers=2, experts=3):
    n = layers * experts * 2
    E = {"a": np.zeros((n, 9)), "b": np.zeros((n, 9))}
    for i in range(n):
        for b in range(9):
            E["a"][i, b] = (i + 1) * 10.0 ** (8 - b)  # damage grows 10x per bit removed
            E["b"][i, b] = 2 * E["a"][i, b]
    return E


def test_accrual_sums_the_damage_of_routed_blocks_at_their_bits():
    L, X = 2, 3
    E = _planted(L, X)
    qm = QualityModel(E, L, X)
    q = np.full(L * X * 2, 8)
    q[0] = 4  # layer 0, expert 0, gate_up at 4 bits
    ids = np.array([[[0, 2], [1, 2]],  # token 0: layer 0 experts {0, 2}, layer 1 experts {1, 2}
                    [[1, 2], [0, 1]]])  # token 1
    dom = np.array([qm.domain_index("a"), qm.domain_index("b")])
    d = qm.accrue(q, dom, ids)

    def blk(l, e, k):
        return (l * X + e) * 2 + k

    def exp_damage(tok, scale):
        total = 0.0
        for l in range(L):
            for e in ids[tok, l]:
                for k in (0, 1):
                    i = blk(l, e, k)
                    total += scale * E["a"][i, q[i]]
        return total
    assert d[0] == pytest.approx(exp_damage(0, 1.0))
    assert d[1] == pytest.approx(exp_damage(1, 2.0))
    assert d[0] > 1e4  # the 4-bit gate_up of expert 0 dominates token 0
    s = qm.summary()
    assert s.tokens == 2 and s.mean_damage_per_token == pytest.approx(d.mean())
    assert s.per_domain["a"]["mean_damage_per_token"] == pytest.approx(d[0])
    assert s.predicted_ppl is None and "unmeasured" in s.note


def test_unknown_domain_uses_the_mean_and_is_counted():
    E = _planted()
    qm = QualityModel(E, 2, 3)
    q = np.full(12, 6)
    ids = np.array([[[0, 1], [1, 2]]])
    unknown = qm.domain_index("nowhere")
    da = qm.accrue(q, np.array([qm.domain_index("a")]), ids)
    du = qm.accrue(q, np.array([unknown]), ids)
    assert du[0] == pytest.approx(1.5 * da[0])  # mean of a and b = 2a
    assert qm.summary().fallback_tokens == 1


def test_full_precision_and_missing_damages():
    E = _planted()
    qm = QualityModel(E, 2, 3, zero_damage=True)
    assert qm.accrue(np.full(12, 3), np.array([0]), np.array([[[0, 1], [1, 2]]]))[0] == 0.0
    none = QualityModel({}, 2, 3)
    assert not none.summary().available and "no per-domain damages" in none.summary().note


def test_accrual_follows_trace_routing_through_the_engine_path():
    """Routing recorded in a trace, read back per (request, position), drives the accrual."""
    L, X = 2, 3
    ids = np.array([[[0, 1], [2, 0]], [[1, 2], [0, 1]], [[2, 0], [1, 2]]])  # 3 positions of one request
    tr = TraceRouting(ids, np.full(ids.shape, 0.5), np.array([3]), X)
    step = tr.route(np.array([0]), np.array([1]), np.array([2]))  # positions 1 and 2
    assert np.array_equal(step.ids.transpose(1, 0, 2), ids[1:])
    E = _planted(L, X)
    qm = QualityModel(E, L, X)
    q = np.full(L * X * 2, 7)
    d = qm.accrue(q, np.zeros(2, np.int64), step.ids.transpose(1, 0, 2))
    manual = [sum(E["a"][(l * X + e) * 2 + k, 7] for l in range(L) for e in ids[p, l] for k in (0, 1)) for p in (1, 2)]
    assert np.allclose(d, manual)


def test_perplexity_fit_recovers_a_planted_relation_and_reports_r2(tmp_path):
    x = np.array([0.0, 1.0, 2.0, 4.0, 8.0])
    y = np.exp(2.0 + 0.05 * x)
    f = fit_perplexity(x, y)
    assert f.a == pytest.approx(2.0) and f.b == pytest.approx(0.05) and f.r2 == pytest.approx(1.0) and f.measured
    noisy = fit_perplexity(x, y * np.array([1.0, 1.01, 0.99, 1.02, 0.98]))
    assert 0.5 < noisy.r2 < 1.0
    path = tmp_path / "fit.json"
    points = [{"damage": float(a), "ppl": float(b)} for a, b in zip(x, y)]
    path.write_text(json.dumps({"source": "runtime", "points": points}))
    loaded = load_fit_points(path)
    assert loaded.predict(3.0) == pytest.approx(np.exp(2.15))
    qm = QualityModel(_planted(), 2, 3, fit=loaded)
    qm.accrue(np.full(12, 8), np.array([0]), np.array([[[0, 1], [1, 2]]]))
    s = qm.summary()
    assert s.predicted_ppl == pytest.approx(loaded.predict(s.mean_damage_per_token)) and "R^2" in s.predicted_ppl_label


def test_bad_fit_files_are_refused(tmp_path):
    p = tmp_path / "bad.json"
    p.write_text("{\"points\": [{\"damage\": 1}]}")
    with pytest.raises(QualityError):
        load_fit_points(p)
    with pytest.raises(QualityError):
        fit_perplexity(np.array([1.0, 1.0]), np.array([2.0, 3.0]))


def test_a_relative_fit_measures_each_domain_from_its_least_damaged_point():
    """With domains, log perplexity is taken relative to each domain's lowest-damage (reference) point."""
    x = np.array([0.0, 1.0, 0.0, 1.0])
    ppl = np.array([10.0, 10.0 * np.e, 20.0, 20.0 * np.e])
    f = fit_perplexity(x, ppl, domains=["a", "a", "b", "b"])
    assert f.relative and f.a == pytest.approx(0.0, abs=1e-12) and f.b == pytest.approx(1.0)


def test_a_relative_fit_over_three_domains_removes_each_domain_s_own_start():
    x = np.tile([0.0, 1.0, 2.0], 3)
    base = np.repeat([10.0, 20.0, 40.0], 3)
    f = fit_perplexity(x, base * np.exp(0.5 * x), domains=list("aaabbbccc"))
    assert f.a == pytest.approx(0.0, abs=1e-12) and f.b == pytest.approx(0.5) and f.r2 == pytest.approx(1.0)


def test_two_points_are_enough_and_a_flat_fit_explains_everything():
    f = fit_perplexity(np.array([0.0, 1.0]), np.array([5.0, 5.0]))
    assert (f.n_points, f.r2) == (2, 1.0) and f.b == pytest.approx(0.0, abs=1e-12)
    assert f.predict(3.0) == pytest.approx(5.0)


@pytest.mark.parametrize("ppl", [0.0, -1.0])
def test_a_fit_file_with_a_perplexity_not_above_zero_is_refused(tmp_path, ppl):
    p = tmp_path / "fit.json"
    p.write_text(json.dumps({"points": [{"damage": 0.0, "ppl": 5.0}, {"damage": 1.0, "ppl": ppl}]}))
    with pytest.raises(QualityError, match="perplexities must be positive"):
        load_fit_points(p)


def test_accrual_follows_a_change_of_bits_and_a_model_without_damages_accrues_nothing():
    qm = QualityModel(_planted(), 2, 3)
    ids, dom = np.array([[[0, 1], [1, 2]]]), np.array([0])
    at8 = qm.accrue(np.full(12, 8), dom, ids)[0]
    at4 = qm.accrue(np.full(12, 4), dom, ids)[0]
    assert at4 == pytest.approx(1e4 * at8)  # the damage table is re-read for the new bits, not cached
    s = qm.summary()
    assert s.available and s.tokens == 2 and s.fallback_tokens == 0
    none = QualityModel({}, 2, 3)
    assert none.accrue(np.full(12, 4), dom, ids).tolist() == [0.0]
