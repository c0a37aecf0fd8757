"""Synthetic generators: determinism by seed, arrival and length statistics, routing skew, domains, drift."""
from __future__ import annotations

import numpy as np
import pytest

from traces.clikit import UserError
from traces.generators import (LengthDist, RoutingSpec, WorkloadSpec, arrival_times, generate_requests,
                               generate_routing, parse_domains, retimed_arrivals)
from traces.model_card import load_card
from traces.schema import RequestTrace

CARD = load_card("Qwen1.5-MoE-A2.7B")


def _requests(n: int, domains=("a",), arrival=None, prompt=1, output=1) -> RequestTrace:
    arrival = np.zeros(n) if arrival is None else np.asarray(arrival, float)
    return RequestTrace(np.arange(n), arrival, np.full(n, prompt), np.full(n, output),
                        np.arange(n) % len(domains), tuple(domains))


def test_same_seed_same_trace_other_seed_differs():
    w = WorkloadSpec(requests=30, token_ids_vocab=100)
    a, b, c = (generate_requests(w, s) for s in (7, 7, 8))
    for name in ("arrival_s", "prompt_tokens", "output_tokens", "domain_idx", "token_ids"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
    assert not np.array_equal(a.arrival_s, c.arrival_s)
    small = RequestTrace(a.request_id, a.arrival_s, np.minimum(a.prompt_tokens, 4), np.minimum(a.output_tokens, 2),
                         a.domain_idx, a.domains)
    r1, r2 = (generate_routing(small, CARD, RoutingSpec(features=True), seed=5) for _ in range(2))
    np.testing.assert_array_equal(r1.expert_ids, r2.expert_ids)
    np.testing.assert_array_equal(r1.down_in_norm, r2.down_in_norm)
    assert not np.array_equal(r1.expert_ids, generate_routing(small, CARD, RoutingSpec(), seed=6).expert_ids)


@pytest.mark.parametrize("cv", [1.0, 0.5, 3.0])
def test_arrivals_have_the_asked_rate_and_burstiness(cv):
    t = arrival_times(20000, rate=4.0, burstiness=cv, rng=np.random.default_rng(1))
    gaps = np.diff(t)
    assert t[0] == 0 and (gaps >= 0).all()
    assert abs(gaps.mean() - 0.25) < 0.02 * (1 + cv)
    assert abs(gaps.std() / gaps.mean() - cv) < 0.08 * cv


@pytest.mark.parametrize("rate, cv", [(0.0, 1.0), (float("inf"), 1.0), (1.0, 0.0), (1.0, float("inf"))])
def test_arrivals_need_a_positive_finite_rate_and_burstiness(rate, cv):
    with pytest.raises(UserError, match="rate and burstiness must be positive and finite"):
        arrival_times(5, rate, cv, np.random.default_rng(0))


def test_a_trace_re_timed_keeps_its_order_and_takes_the_asked_rate():
    """vLLM's --request-rate over a recorded trace: the same seed gives the same times; the requests keep their
    order of arrival (ties in order of position); the rate and burstiness are those asked for."""
    recorded = np.array([0.3, 0.1, 0.1, 0.2] * 2500)
    new = retimed_arrivals(recorded, rate=50.0, burstiness=2.0, seed=3)
    assert np.array_equal(new, retimed_arrivals(recorded, 50.0, 2.0, seed=3))
    assert not np.array_equal(new, retimed_arrivals(recorded, 50.0, 2.0, seed=4))
    order = np.argsort(recorded, kind="stable")
    assert (np.diff(new[order]) >= 0).all() and new.min() == 0.0
    gaps = np.diff(np.sort(new))
    assert abs(gaps.mean() - 0.02) < 0.002 and abs(gaps.std() / gaps.mean() - 2.0) < 0.2
    with pytest.raises(UserError, match="rate and burstiness must be positive"):
        retimed_arrivals(recorded, 0.0, 1.0, seed=0)


def test_length_distributions():
    rng = np.random.default_rng(2)
    assert (LengthDist.parse("fixed:300").sample(50, rng) == 300).all()
    u = LengthDist.parse("uniform:10,20").sample(5000, rng)
    assert u.min() == 10 and u.max() == 20 and abs(u.mean() - 15) < 0.3
    ln = LengthDist.parse("lognormal:median=200,sigma=0.5").sample(20000, rng)
    assert abs(np.median(ln) - 200) < 8
    clipped = LengthDist.parse("lognormal:200,2.0,50,400").sample(5000, rng)
    assert clipped.min() == 50 and clipped.max() == 400
    z = LengthDist.parse("zipf:1.5,1,1000").sample(20000, rng)
    counts = np.bincount(z, minlength=5)
    assert counts[1] > counts[2] > counts[4] and z.max() <= 1000
    assert np.isclose(counts[1] / counts[2], 2 ** 1.5, rtol=0.1)


@pytest.mark.parametrize("spec", ["gauss:3", "uniform:5", "lognormal:abc,1", "uniform:20,10", "zipf:1,foo=3", "fixed:0",
                                  "fixed:5,6", "zipf:0", "lognormal:100,-0.5", f"uniform:1,{2**31}"])
def test_bad_length_specs_are_user_errors(spec):
    with pytest.raises(UserError):
        LengthDist.parse(spec)


def test_length_specs_at_their_bounds_are_taken():
    """A one-value range, the int32 maximum, sigma 0 and a fixed value beyond the default maximum are all lengths."""
    rng = np.random.default_rng(0)
    assert (LengthDist.parse("uniform:5,5").sample(10, rng) == 5).all()
    assert LengthDist.parse(f"uniform:1,{2**31 - 1}").hi == 2**31 - 1
    assert (LengthDist.parse("lognormal:100,0").sample(10, rng) == 100).all()
    assert (LengthDist.parse("fixed:40000").sample(10, rng) == 40000).all()


def test_bounded_zipf_puts_its_mass_on_its_support_only():
    """On {1, 2} with alpha 1.2: P(2) = 2^-1.2 / (1 + 2^-1.2) = 0.303 (no mass beyond the maximum folded onto it)."""
    z = LengthDist.parse("zipf:1.2,1,2").sample(40000, np.random.default_rng(1))
    assert abs((z == 2).mean() - 2**-1.2 / (1 + 2**-1.2)) < 0.01


def test_domain_mix():
    names, w = parse_domains("chat:3,code:1")
    assert names == ("chat", "code") and np.allclose(w, (0.75, 0.25))
    req = generate_requests(WorkloadSpec(requests=4000, domains=names, domain_weights=w), seed=0)
    assert abs((req.domain == "chat").mean() - 0.75) < 0.03
    assert parse_domains("chat:1,code:0") == (("chat", "code"), (1.0, 0.0))  # a domain may have no share
    for bad in ("", "a,a", "a:-1,b:1", "a:-1,b:2", "a:x", "a:0,b:0"):
        with pytest.raises(UserError):
            parse_domains(bad)


def test_requests_do_not_depend_on_routing_generation():
    w = WorkloadSpec(requests=10)
    a = generate_requests(w, 3)
    generate_routing(RequestTrace(a.request_id, a.arrival_s, np.ones(10), np.ones(10), a.domain_idx, a.domains),
                     CARD, RoutingSpec(), seed=3)
    np.testing.assert_array_equal(a.prompt_tokens, generate_requests(w, 3).prompt_tokens)


def test_rows_cover_every_position_and_layer():
    req = RequestTrace([4, 9], [0.0, 1.0], [3, 2], [2, 1], [0, 0], ("a",))
    rt = generate_routing(req, CARD, RoutingSpec(), seed=0)
    assert len(rt) == (5 + 3) * CARD.moe_layers and rt.is_sorted(strict=True)
    assert list(rt.position[:: CARD.moe_layers]) == [0, 1, 2, 3, 4, 0, 1, 2]
    assert set(rt.request_id.tolist()) == {4, 9}
    capped = generate_routing(req, CARD, RoutingSpec(tokens_per_request=2), seed=0)
    assert len(capped) == 4 * CARD.moe_layers


def test_top_k_distinct_and_weights_softmax_normalised():
    rt = generate_routing(_requests(300), CARD, RoutingSpec(), seed=1)
    s = np.sort(rt.expert_ids, axis=1)
    assert (s[:, 1:] != s[:, :-1]).all()
    np.testing.assert_allclose(rt.weights.sum(axis=1), 1.0, rtol=1e-5)
    assert (np.diff(rt.weights, axis=1) <= 1e-7).all()  # largest weight first
    raw = generate_routing(_requests(300), CARD, RoutingSpec(normalize_top_k=False), seed=1)
    assert (raw.weights.sum(axis=1) < 1.0 + 1e-6).all() and raw.weights.sum(axis=1).mean() < 0.99


def _mass(rt, rows=None):
    return rt.routing_mass(rows)


def test_zipf_skew_concentrates_routing_mass():
    flat = generate_routing(_requests(400), CARD, RoutingSpec(skew=0.0, drift=0.0), seed=2)
    skewed = generate_routing(_requests(400), CARD, RoutingSpec(skew=1.5, drift=0.0), seed=2)
    top6 = lambda m: np.sort(m, axis=1)[:, ::-1][:, :6].sum(axis=1).mean()  # noqa: E731
    assert top6(_mass(flat)) < 0.15 < 0.4 < top6(_mass(skewed))
    # every layer has its own hot experts
    hot = np.argmax(_mass(skewed), axis=1)
    assert len(set(hot.tolist())) > CARD.moe_layers // 3


def test_domains_differ_by_domain_shift():
    req = _requests(800, domains=("a", "b"), prompt=4)
    by_dom = lambda rt: [rt.routing_mass(np.flatnonzero(req.domain_idx[rt.request_id] == d)) for d in (0, 1)]  # noqa: E731
    same = by_dom(generate_routing(req, CARD, RoutingSpec(domain_shift=0.0, drift=0.0), seed=4))
    diff = by_dom(generate_routing(req, CARD, RoutingSpec(domain_shift=1.0, drift=0.0), seed=4))
    tv = lambda p, q: 0.5 * np.abs(p - q).sum(axis=1).mean()  # noqa: E731
    assert tv(*same) < 0.1 and tv(*diff) > 0.3


def test_drift_changes_popularity_over_time():
    arrival = np.linspace(0, 2000, 1000)
    req = _requests(1000, arrival=arrival, prompt=10)  # 11 tokens per request
    rows = 11 * CARD.moe_layers
    early, late = np.arange(0, 200 * rows), np.arange(800 * rows, 1000 * rows)
    tv = lambda rt: 0.5 * np.abs(rt.routing_mass(early) - rt.routing_mass(late)).sum(axis=1).mean()  # noqa: E731
    still = tv(generate_routing(req, CARD, RoutingSpec(drift=0.0), seed=5))
    moving = tv(generate_routing(req, CARD, RoutingSpec(drift=0.05), seed=5))
    assert still < 0.1 and moving > 2 * still and moving > 0.15


def test_a_request_at_time_zero_is_routed_before_any_drift():
    """The drift walk is 0 at the first grid point: a request arriving at time 0 is routed the same whatever the drift
    (same seed), and one at the end of the trace is not."""
    req = _requests(2, arrival=[0.0, 1000.0], prompt=20)
    still = generate_routing(req, CARD, RoutingSpec(drift=0.0), seed=3)
    moving = generate_routing(req, CARD, RoutingSpec(drift=5.0), seed=3)
    first = still.request_id == 0
    np.testing.assert_array_equal(still.expert_ids[first], moving.expert_ids[first])
    assert not np.array_equal(still.expert_ids[~first], moving.expert_ids[~first])


@pytest.mark.parametrize("shift", [0.25, 1.0])
def test_every_domain_ranks_each_expert_once(shift):
    """A domain reshuffles part of a layer's popularity ranking: still a permutation (no expert ranked twice)."""
    from traces.generators import popularity_logits
    logits = popularity_logits(4, 16, 3, RoutingSpec(skew=1.0, domain_shift=shift), np.random.default_rng(0))
    ranks = np.rint(np.expm1(-logits.astype(np.float64))).astype(int)
    assert (np.sort(ranks, axis=-1) == np.arange(16)).all()


def test_routing_reports_progress_once_per_row_over_several_chunks():
    req = _requests(40, prompt=100, output=1)  # 101 tokens x 24 layers: more rows than one chunk
    seen = []
    rt = generate_routing(req, CARD, RoutingSpec(), seed=0, progress=seen.append)
    assert len(seen) > 1 and sum(seen) == len(rt.expert_ids)


@pytest.mark.parametrize("bad", [dict(skew=-1.0), dict(skew=float("inf")), dict(domain_shift=1.5),
                                 dict(drift=-0.1), dict(drift=float("inf")), dict(weight_temperature=0.0),
                                 dict(weight_temperature=float("inf")), dict(tokens_per_request=-1)])
def test_each_bad_routing_setting_alone_is_a_user_error(bad):
    with pytest.raises(UserError, match="routing"):
        RoutingSpec(**bad)


def test_synthetic_features_are_positive_and_shaped():
    rt = generate_routing(_requests(20, prompt=3), CARD, RoutingSpec(features=True), seed=0)
    assert rt.gate_up_in_norm.shape == (len(rt),) and rt.down_in_norm.shape == (len(rt), CARD.top_k)
    assert (rt.gate_up_in_norm > 0).all() and (rt.down_in_norm > 0).all()


def test_the_drift_walk_starts_at_zero_and_widens_with_time():
    """At the first arrival the popularity logits have not drifted yet; later grid points have."""
    from traces.generators import drift_walk
    grid, walk = drift_walk(np.linspace(0.0, 10.0, 50), 2, 8, 0.5, np.random.default_rng(0), max_steps=16)
    assert grid[0] == 0.0 and len(grid) == 16
    assert np.all(walk[0] == 0) and np.abs(walk[-1]).max() > 0
