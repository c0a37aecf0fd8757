"""Routing sources: synthetic (the generator's popularity model, drawn per request) and recorded traces."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from pwsim.routing import PopularityRouting, TraceRouting, _duplicate_slots, synthetic_routing
from traces.generators import LengthDist, RoutingSpec, WorkloadSpec, generate_requests, generate_routing
from traces.model_card import load_card
from traces.schema import TraceError


@pytest.fixture(scope="module")
def olmoe():
    return load_card("OLMoE-1B-7B-0924")


def test_synthetic_routing_is_a_function_of_request_and_position(olmoe):
    req = generate_requests(WorkloadSpec(requests=6, rate=10.0), seed=1)
    a = synthetic_routing(req, olmoe, RoutingSpec(features=True), seed=5)
    b = synthetic_routing(req, olmoe, RoutingSpec(features=True), seed=5)
    whole = a.route(np.array([2]), np.array([0]), np.array([9]))
    parts = [b.route(np.array([2]), np.array([k]), np.array([3])) for k in (0, 3, 6)]
    assert np.array_equal(whole.ids, np.concatenate([p.ids for p in parts], axis=1))
    assert np.array_equal(whole.weights, np.concatenate([p.weights for p in parts], axis=1))
    assert np.array_equal(whole.down_norm, np.concatenate([p.down_norm for p in parts], axis=1))
    b.release(2)  # a released request is drawn again identically (a recompute after preemption)
    again = b.route(np.array([2]), np.array([0]), np.array([9]))
    assert np.array_equal(again.ids, whole.ids)
    mixed = a.route(np.array([0, 2]), np.array([4, 0]), np.array([1, 9]))
    assert np.array_equal(mixed.ids[:, 1:], whole.ids)
    c = synthetic_routing(req, olmoe, RoutingSpec(features=True), seed=6)
    assert not np.array_equal(c.route(np.array([2]), np.array([0]), np.array([9])).ids, whole.ids)


def test_top_k_distinct_weights_normalised_and_frequencies_follow_popularity():
    rng = np.random.default_rng(0)
    L, E, K = 3, 16, 4
    pop = rng.permutation(1.0 / np.arange(1, E + 1) ** 1.2)[None, None, :] * np.ones((1, L, 1))
    n = 4000
    src = PopularityRouting(pop, np.zeros(1, np.int64), np.array([n]), K, seed=2)
    r = src.route(np.array([0]), np.array([0]), np.array([n]))
    assert r.ids.shape == (L, n, K) and not _duplicate_slots(r.ids).any()
    assert np.allclose(r.weights.sum(axis=2), 1.0, atol=1e-5)
    # first slot is a draw from the popularity; compare frequencies (4000 draws per layer)
    freq = np.bincount(r.ids[:, :, 0].ravel(), minlength=E) / (L * n)
    assert np.abs(freq - src.p[0, 0]).max() < 0.02
    # the hottest expert appears in most tokens' top-4 but never twice
    hot = int(np.argmax(src.p[0, 0]))
    assert ((r.ids == hot).sum(axis=2) <= 1).all() and (r.ids == hot).any(axis=2).mean() > src.p[0, 0, hot]


def test_filling_a_long_request_in_chunks_draws_what_one_call_draws():
    from pwsim.routing import _FILL_CHUNK
    rng = np.random.default_rng(1)
    L, E, K = 3, 16, 4
    pop = rng.random((2, L, E)) ** 3 + 1e-3  # skewed: many duplicate slots to redraw
    n = 2 * _FILL_CHUNK + 37
    src = PopularityRouting(pop, np.array([1, 0]), np.array([n, 5]), K, seed=4)
    r = src.route(np.array([0]), np.array([0]), np.array([n]))
    whole = src._records(np.zeros(n, np.int64), np.arange(n))  # one call, no chunks
    assert np.array_equal(src._cache[0], whole)
    assert np.array_equal(r.ids, whole[:, :, :K].transpose(1, 0, 2))
    assert all(a.flags.c_contiguous for a in (r.ids, r.weights, r.gate_up_norm, r.down_norm))


def test_synthetic_matches_the_generator_popularity_model(olmoe):
    n, tokens, L, E = 100, 16, olmoe.moe_layers, olmoe.experts
    req = generate_requests(WorkloadSpec(requests=n, rate=10.0, prompt=LengthDist("fixed", 12),
                                         output=LengthDist("fixed", 4)), seed=0)
    spec = RoutingSpec(drift=0.0)
    gen = generate_routing(req, olmoe, spec, seed=0)
    src = synthetic_routing(req, olmoe, spec, seed=0)
    r = src.route(np.arange(n), np.zeros(n, np.int64), np.full(n, tokens))
    flat = (gen.layer.astype(np.int64)[:, None] * E + gen.expert_ids).ravel()
    g = np.bincount(flat, minlength=L * E).reshape(L, E) / (n * tokens * olmoe.top_k)  # per layer, sums to 1
    def freq(ids):
        return np.bincount((np.arange(L)[:, None, None] * E + ids).ravel(), minlength=L * E).reshape(L, E) / ids[0].size
    m = freq(r.ids)
    # same popularity (Plackett-Luce top-k) up to sampling noise; an unrelated popularity is far off
    assert np.abs(g - m).mean() < 0.003 and np.abs(g - m).max() < 0.03
    other = synthetic_routing(req, olmoe, spec, seed=1).route(np.arange(n), np.zeros(n, np.int64), np.full(n, tokens))
    mo = freq(other.ids)
    assert np.abs(g - mo).mean() > 3 * np.abs(g - m).mean()


def test_trace_routing_replays_a_generated_trace(olmoe):
    req = generate_requests(WorkloadSpec(requests=5, rate=10.0), seed=2)
    spec = RoutingSpec(features=True)
    gen = generate_routing(req, olmoe, spec, seed=2)
    tr = TraceRouting.from_trace(gen, req)
    r = tr.route(np.array([3, 1]), np.array([2, 0]), np.array([2, 1]))
    rid = req.request_id
    for t, (ri, pos) in enumerate([(3, 2), (3, 3), (1, 0)]):
        rows = (gen.request_id == rid[ri]) & (gen.position == pos)
        order = np.argsort(gen.layer[rows])
        assert np.array_equal(r.ids[:, t], gen.expert_ids[rows][order])
        assert np.allclose(r.weights[:, t], gen.weights[rows][order])
        assert np.allclose(r.gate_up_norm[:, t], gen.gate_up_in_norm[rows][order])
    # a gap in a request's positions is refused with a clear error
    keep = ~((gen.request_id == rid[0]) & (gen.position == 1))
    from dataclasses import replace
    holed = replace(gen, request_id=gen.request_id[keep], position=gen.position[keep], layer=gen.layer[keep],
                    expert_ids=gen.expert_ids[keep], weights=gen.weights[keep],
                    gate_up_in_norm=gen.gate_up_in_norm[keep], down_in_norm=gen.down_in_norm[keep])
    with pytest.raises(TraceError, match="gap"):
        TraceRouting.from_trace(holed, req)


def _routing_with_a_recompute():
    """Request 10: positions 0..4, then a recompute of 0..2 that chose other experts; request 11: 0..1 once."""
    from traces.schema import RoutingTrace
    rows = [(10, 0, p, [0, 1]) for p in range(5)] + [(10, 1, p, [2, 3]) for p in range(3)] \
        + [(11, 0, p, [1, 2]) for p in range(2)]
    rid, att, pos, ids = zip(*rows)
    return RoutingTrace("demo", 1, 4, 2, np.array(rid), np.array(pos), np.zeros(len(rows)), np.array(ids),
                        np.full((len(rows), 2), 0.5), attempt=np.array(att))


def test_trace_routing_replays_a_recompute_with_its_own_attempt():
    from traces.schema import RequestTrace
    requests = RequestTrace.from_columns(np.array([10, 11]), np.zeros(2), np.array([3, 1]), np.array([2, 1]),
                                         np.array(["x", "x"], dtype=object))
    tr = TraceRouting.from_trace(_routing_with_a_recompute(), requests)
    first = tr.route(np.array([0, 1]), np.array([0, 0]), np.array([3, 2]))
    assert first.ids[0].tolist() == [[0, 1]] * 3 + [[1, 2]] * 2
    assert tr.route(np.array([0]), np.array([3]), np.array([2])).ids[0].tolist() == [[0, 1]] * 2
    # positions routed before: a recompute, which replays the trace's attempt 1 (its last position past its end)
    assert tr.route(np.array([0]), np.array([0]), np.array([4])).ids[0].tolist() == [[2, 3]] * 4
    # request 11's recompute: the trace has none, so its first computation again
    assert tr.route(np.array([1]), np.array([0]), np.array([2])).ids[0].tolist() == [[1, 2]] * 2
    tr.release(0)  # finished: served again (a warm-up's request, then the trace's), it starts at attempt 0
    assert tr.route(np.array([0]), np.array([0]), np.array([1])).ids[0].tolist() == [[0, 1]]


def test_a_routing_trace_keeps_its_attempts(tmp_path):
    from traces.io import read_routing, write_routing
    trace = _routing_with_a_recompute()
    back = read_routing(write_routing(tmp_path / "routing.parquet", trace))
    assert back.attempts.tolist() == trace.attempts.tolist() and back.summary()["recomputed_rows"] == 3
    assert read_routing(write_routing(tmp_path / "plain.parquet", _without_attempts(trace))).attempt is None
    with pytest.raises(TraceError, match=r"duplicate \(request 10, attempt 1, position 0"):
        replace(trace, attempt=np.where(np.arange(len(trace)) == 0, 1, trace.attempts))
    with pytest.raises(TraceError, match="negative attempt"):
        replace(trace, attempt=-trace.attempts)


def _without_attempts(trace):
    first = trace.attempts == 0
    return replace(trace, request_id=trace.request_id[first], position=trace.position[first],
                   layer=trace.layer[first], expert_ids=trace.expert_ids[first], weights=trace.weights[first],
                   attempt=None)


def test_the_recorder_records_a_recompute_as_the_next_attempt():
    from pwruntime.model_runner import RoutingArrays
    from pwruntime.trace_recorder import TraceRecorder
    rec = TraceRecorder(card="demo")
    rec.set_model(1, 4, 2)
    rec.on_arrival(5, 0.0, [1, 2, 3])

    def step(start: int, n: int, expert: int) -> None:
        ids = np.full((1, n, 2), [expert, expert + 1])
        rec.on_routing([(5, start, n)], RoutingArrays(ids, np.full((1, n, 2), 0.5, np.float32),
                                                      np.ones((1, n), np.float32), np.ones((1, n, 2), np.float32), (n,)))
    step(0, 3, 0)
    step(3, 1, 0)
    step(0, 4, 2)  # preempted, computed again from the start (at other bits: other experts)
    step(4, 1, 2)
    r = rec.routing_trace()
    assert r.attempts.tolist() == [0] * 4 + [1] * 5 and r.position.tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 4]
    assert r.expert_ids[:, 0].tolist() == [0] * 4 + [2] * 5


def test_the_recorder_keeps_what_was_computed_of_the_requests_it_may_record(tmp_path):
    """At most max_requests requests (later ones counted as skipped); each batch entry's routing is its own rows; a
    request never routed (aborted before its first step) and routing past a request's finish are left out; a
    request cut before it finished keeps the outputs it was routed for; a server's trace counts arrivals and its
    plans' times from the first computed request's arrival."""
    from pwruntime.model_runner import RoutingArrays
    from pwruntime.trace_recorder import TraceRecorder
    from traces.io import read_trace_dir
    from traces.results import read_columns

    rec = TraceRecorder(card="demo", max_requests=4)
    rec.set_model(1, 200, 2)
    for rid, t in ((7, 1.0), (3, 2.0), (9, 0.5), (12, 3.0), (20, 4.0)):   # 20 arrives past max_requests
        rec.on_arrival(rid, t, [1, 2, 3])

    def route(entries, first):
        n = sum(k for *_, k in entries)
        ids = np.stack([np.arange(first, first + n), np.arange(first, first + n) + 100], axis=-1)[None]
        rec.on_routing(entries, RoutingArrays(ids, np.full((1, n, 2), 0.5, np.float32), np.ones((1, n), np.float32),
                                              np.ones((1, n, 2), np.float32), tuple(k for *_, k in entries)))

    route([(3, 0, 3), (7, 0, 3), (12, 0, 2)], 0)   # rows 0-2, 3-5, 6-7; 12's prompt is cut after 2 tokens
    route([(3, 3, 1), (7, 3, 1)], 10)
    rec.on_finish(3, 2)
    route([(3, 4, 1), (7, 4, 1)], 20)               # 3 ran one step past its stop: not recorded
    assert rec.skipped == 1 and rec.num_requests == 3   # 9 was never routed
    r = rec.routing_trace()
    got = {rid: r.expert_ids[r.request_id == rid, 0].tolist() for rid in (3, 7, 12)}
    assert got == {3: [0, 1, 2, 10], 7: [3, 4, 5, 11, 21], 12: [6, 7]}
    plans = {"step": np.array([1, 2]), "time_s": np.array([1.5, 2.5])}
    trace = read_trace_dir(rec.write(tmp_path / "t", from_first_arrival=True, plans=plans))
    assert trace.requests.request_id.tolist() == [7, 3, 12]   # arrival order
    assert trace.requests.arrival_s.tolist() == [0.0, 1.0, 2.0]
    assert trace.requests.output_tokens.tolist() == [3, 2, 1]   # 7: cut after two routed outputs and one sampled
    assert read_columns(tmp_path / "t" / "plans.parquet")["time_s"].tolist() == [0.5, 1.5]
    unrouted = TraceRecorder(card="demo")   # a recorder that saw no routing holds every request
    unrouted.on_arrival(1, 0.0, [1, 2])
    assert unrouted.num_requests == 1


def test_a_later_recompute_falls_back_on_the_latest_recorded_attempt():
    """Request 11 was recorded twice (attempts 0, 1), request 10 three times: 11's third computation replays its
    attempt 1, the latest it has, not its first."""
    rows = [(10, a, p, [a, a + 1]) for a in range(3) for p in range(2)] \
        + [(11, 0, p, [0, 3]) for p in range(2)] + [(11, 1, p, [1, 3]) for p in range(2)]
    tr = _replay(rows, [10, 11])
    got = [tr.route(np.array([1]), np.array([0]), np.array([2])).ids[0, 0].tolist() for _ in range(3)]
    assert got == [[0, 3], [1, 3], [1, 3]]


def _replay(rows, request_ids) -> TraceRouting:
    """`TraceRouting.from_trace` of a one-layer, top-2 routing trace of rows (request id, attempt, position, ids), for
    requests `request_ids` (one prompt and one output token each)."""
    from traces.schema import RequestTrace, RoutingTrace
    rid, att, pos, ids = zip(*rows)
    trace = RoutingTrace("demo", 1, 4, 2, np.array(rid), np.array(pos), np.zeros(len(rows)), np.array(ids),
                         np.full((len(rows), 2), 0.5), attempt=np.array(att))
    n = len(request_ids)
    requests = RequestTrace.from_columns(np.array(request_ids), np.zeros(n), np.ones(n, int), np.ones(n, int),
                                         np.array(["x"] * n, dtype=object))
    return TraceRouting.from_trace(trace, requests)


def test_a_request_computed_three_times_replays_its_three_attempts_in_order():
    tr = _replay([(10, a, p, [a, a + 1]) for a in range(3) for p in range(2)], [10])
    got = [tr.route(np.array([0]), np.array([0]), np.array([2])).ids[0, 0].tolist() for _ in range(3)]
    assert got == [[0, 1], [1, 2], [2, 3]]


@pytest.mark.parametrize("attempt", [0, 1])
def test_a_gap_in_a_computation_names_its_request_and_position(attempt):
    """A gap in a request's first computation, or in its recompute (which the trace keeps as a record of its own),
    names the request of the trace and the first missing position."""
    rows = [(10, 0, p, [0, 1]) for p in range(3)] + [(10, 1, p, [2, 3]) for p in range(3)] \
        + [(11, 0, 0, [1, 2])]
    rows = [r for r in rows if not (r[1] == attempt and r[2] == 1 and r[0] == 10)]
    with pytest.raises(TraceError) as e:
        _replay(rows, [10, 11])
    assert "request 10 has a gap in its positions (position 1 missing)" in str(e.value)


@pytest.mark.parametrize("rows", [
    [(0, 0), (1, 1)],  # position 0 has only layer 0, position 1 only layer 1: as many rows as one whole token
    [(0, 0), (0, 1), (1, 0)],  # position 1 lacks layer 1
], ids=["split-token", "short-token"])
def test_every_routed_position_needs_every_layer(rows):
    from traces.schema import RequestTrace, RoutingTrace
    pos, layer = (np.array(c) for c in zip(*rows))
    trace = RoutingTrace("demo", 2, 4, 2, np.full(len(rows), 10), pos, layer, np.tile([0, 1], (len(rows), 1)),
                         np.full((len(rows), 2), 0.5))
    requests = RequestTrace.from_columns(np.array([10]), np.zeros(1), np.array([1]), np.array([1]),
                                         np.array(["x"], dtype=object))
    with pytest.raises(TraceError, match="some \\(request, position\\) lacks one of the 2 layers"):
        TraceRouting.from_trace(trace, requests)


def test_trace_routing_gives_every_recorded_position_and_then_the_last():
    ids = np.arange(5 * 2).reshape(5, 1, 2)  # 5 rows, 1 layer, top-2: request 0 rows 0..2, request 1 rows 3..4
    tr = TraceRouting(ids, np.full(ids.shape, 0.5), np.array([3, 2]), 10)
    got = tr.route(np.array([0, 1]), np.array([0, 0]), np.array([4, 3])).ids[0]
    assert got.tolist() == [ids[i, 0].tolist() for i in (0, 1, 2, 2, 3, 4, 4)]


@pytest.mark.parametrize("weights_shape, lens, needle", [
    ((4, 1, 1), [2, 2], "ids and weights must both be"),
    ((4, 1, 2), [0, 4], "at least one routed position"),
    ((4, 1, 2), [2, 1], "lens must cover all rows"),
])
def test_trace_routing_refuses_arrays_that_disagree(weights_shape, lens, needle):
    with pytest.raises(ValueError, match=needle):
        TraceRouting(np.zeros((4, 1, 2)), np.zeros(weights_shape), np.array(lens), 4)


def test_a_request_without_routing_rows_is_a_trace_error():
    from traces.schema import RequestTrace
    trace = _without_attempts(_routing_with_a_recompute())
    requests = RequestTrace.from_columns(np.array([10, 11, 12]), np.zeros(3), np.array([3, 1, 1]),
                                         np.array([2, 1, 1]), np.array(["x"] * 3, dtype=object))
    with pytest.raises(TraceError, match="request 12 has no routing rows"):
        TraceRouting.from_trace(trace, requests)


def test_popularity_routing_past_a_request_s_length_reuses_its_last_position():
    src = PopularityRouting(np.ones((1, 2, 4)), np.array([0]), np.array([3]), top_k=2, seed=1)
    last = src.route(np.array([0]), np.array([2]), np.array([1]))
    past = src.route(np.array([0]), np.array([2]), np.array([3]))
    assert np.array_equal(past.ids, np.repeat(last.ids, 3, axis=1))


def test_popularity_routing_may_route_to_every_expert():
    src = PopularityRouting(np.ones((1, 1, 3)), np.array([0]), np.array([4]), top_k=3, seed=0)
    ids = src.route(np.array([0]), np.array([0]), np.array([4])).ids
    assert (np.sort(ids, axis=2) == np.arange(3)).all()
    with pytest.raises(ValueError, match="top_k"):
        PopularityRouting(np.ones((1, 1, 3)), np.array([0]), np.array([4]), top_k=4)
    with pytest.raises(ValueError, match="positive length"):
        PopularityRouting(np.ones((1, 1, 3)), np.array([0]), np.array([0]), top_k=1)


@pytest.mark.parametrize("popularity, group, tokens, needle", [
    (np.ones((1, 3)), [0], [4], "popularity must be"),
    (-np.ones((1, 1, 3)), [0], [4], "popularity must be"),
    (np.zeros((1, 1, 3)), [0], [4], "popularity must be"),
    (np.ones((1, 1, 3)), [0], [1, 1], "positive length"),
    (np.ones((2, 1, 3)), [0, 2], [4, 4], "does not exist"),
    (np.ones((2, 1, 3)), [-1, 1], [4, 4], "does not exist"),
])
def test_popularity_routing_refuses_each_bad_input_alone(popularity, group, tokens, needle):
    with pytest.raises(ValueError, match=needle):
        PopularityRouting(popularity, np.array(group), np.array(tokens), top_k=1)


def test_popularity_routing_takes_one_token_requests_and_the_last_group_and_routes_nothing_for_no_tokens():
    src = PopularityRouting(np.ones((2, 1, 3)), np.array([1, 0]), np.array([1, 1]), top_k=1)
    none = src.route(np.array([0, 1]), np.array([0, 0]), np.array([0, 0]))
    assert none.num_tokens == 0 and none.has_norms
    step = src.route(np.array([0, 1]), np.array([0, 0]), np.array([1, 1]))
    assert step.num_tokens == 2 and step.has_norms
    bare = PopularityRouting(np.ones((1, 1, 3)), np.array([0]), np.array([2]), top_k=1, norms=False)
    plain = bare.route(np.array([0]), np.array([0]), np.array([2]))
    assert not plain.has_norms
    assert not replace(plain, gate_up_norm=np.ones((1, 2))).has_norms  # both norms, or none to feature on


def test_popularity_routing_draws_each_norm_around_its_own_scale():
    """gate_up norms centre on exp(gate_up_mu), down norms on exp(down_mu): the columns are not mixed up."""
    src = PopularityRouting(np.ones((1, 1, 8)), np.array([0]), np.array([2000]), top_k=2, seed=3,
                            gate_up_mu=np.log(20.0), down_mu=np.log(5.0))
    r = src.route(np.array([0]), np.array([0]), np.array([2000]))
    assert np.median(r.gate_up_norm) == pytest.approx(20.0, rel=0.05)
    assert np.median(r.down_norm) == pytest.approx(5.0, rel=0.05)


@pytest.mark.parametrize("rounds", [0, 1, 3])
def test_a_repeat_left_after_the_redraws_is_drawn_from_the_popularity_of_the_unused_experts(rounds):
    """Top-2 of 4 experts, another popularity in each layer. The second slot draws the first slot's expert a with
    p_a each round; a repeat left after the rounds draws from the other experts in proportion to their popularity.
    So P(a, c) = p_a p_c (1 + ... + p_a^rounds) + p_a p_a^(rounds + 1) p_c / (1 - p_a) = p_a p_c / (1 - p_a) for
    any number of rounds: sampling without replacement."""
    p = np.array([[0.4, 0.3, 0.2, 0.1], [0.1, 0.2, 0.3, 0.4]])
    n, E = 20000, 4
    src = PopularityRouting(p[None], np.zeros(1, np.int64), np.array([n]), 2, seed=7, redraw_rounds=rounds, norms=False)
    ids = src.route(np.array([0]), np.array([0]), np.array([n])).ids
    assert not _duplicate_slots(ids).any()
    for layer, q in enumerate(p):
        got = np.zeros((E, E))
        np.add.at(got, (ids[layer, :, 0], ids[layer, :, 1]), 1 / n)
        want = q[:, None] * q[None, :] / (1 - q[:, None])
        np.fill_diagonal(want, 0.0)
        assert np.abs(got - want).max() < 0.01, (layer, got, want)


def test_a_token_s_leftovers_settle_in_slot_order_and_never_take_an_expert_of_zero_popularity():
    """Without redraws, top-3 of 5 experts where two experts hold no popularity: every repeat is a leftover, and each
    token still ends with three distinct experts, none of them an expert nothing routes to while others are free."""
    p = np.array([[[0.5, 0.3, 0.2, 0.0, 0.0]]])
    src = PopularityRouting(p, np.zeros(1, np.int64), np.array([4000]), 3, seed=2, redraw_rounds=0, norms=False)
    ids = src.route(np.array([0]), np.array([0]), np.array([4000])).ids
    assert not _duplicate_slots(ids).any()
    assert set(np.unique(ids).tolist()) == {0, 1, 2}


def test_leftovers_with_no_popularity_left_take_a_free_expert_uniformly():
    """Top-3 of 4 where one expert holds all the popularity: the two other slots can only be leftovers over experts
    of zero popularity, and they spread evenly over the three."""
    p = np.array([[[1.0, 0.0, 0.0, 0.0]]])
    n = 6000
    src = PopularityRouting(p, np.zeros(1, np.int64), np.array([n]), 3, seed=4, redraw_rounds=2, norms=False)
    ids = src.route(np.array([0]), np.array([0]), np.array([n])).ids
    assert not _duplicate_slots(ids).any() and (ids[..., 0] == 0).all()
    share = np.bincount(ids[..., 1:].ravel(), minlength=4) / (2 * n)
    assert share[0] == 0 and np.abs(share[1:] - 1 / 3).max() < 0.02, share


def test_the_fallback_expert_is_unused_by_every_other_slot():
    """Without redraws, a repeat takes the next expert that no other slot holds, the later slots' included."""
    p = np.array([[[0.7, 0.1, 0.1, 0.05, 0.05]]])
    src = PopularityRouting(p, np.zeros(1, np.int64), np.array([4000]), 3, seed=1, redraw_rounds=0, norms=False)
    ids = src.route(np.array([0]), np.array([0]), np.array([4000])).ids
    assert not _duplicate_slots(ids).any()


def test_the_last_arrival_routes_with_the_drift_at_the_end_of_the_walk(olmoe):
    """Two requests of one domain, arriving at the two ends of the drift walk's grid: each routes with the popularity
    the generator gives it (the second with the walk's last step), and the drift sets them apart."""
    L, E, tokens = olmoe.moe_layers, olmoe.experts, 3001
    req = generate_requests(WorkloadSpec(requests=2, rate=10.0, prompt=LengthDist("fixed", tokens - 1),
                                         output=LengthDist("fixed", 1), domains=("chat",)), seed=0)
    spec = RoutingSpec(drift=1.0)
    gen = generate_routing(req, olmoe, spec, seed=0)
    src = synthetic_routing(req, olmoe, spec, seed=0)

    def freq(layer, ids):
        flat = (np.asarray(layer, np.int64)[:, None] * E + ids).ravel()
        return np.bincount(flat, minlength=L * E).reshape(L, E) / (tokens * olmoe.top_k)
    sim = [freq(np.repeat(np.arange(L), tokens), src.route(np.array([r]), np.array([0]), np.array([tokens])).ids
                .reshape(L * tokens, -1)) for r in range(2)]
    for r in range(2):
        mine = gen.request_id == r
        assert np.abs(freq(gen.layer[mine], gen.expert_ids[mine]) - sim[r]).mean() < 0.002, r
    assert np.abs(sim[1] - sim[0]).mean() > 0.004


def test_with_one_expert_dominating_each_layer_the_experts_are_chosen_as_often_as_the_generator_chooses_them(olmoe):
    """Skew 3 makes most top-8 draws repeat the leading experts, so many slots outlast the redraw rounds. Per layer and
    expert, the synthetic source picks each expert as often as the generator's Gumbel top-k (sampling without
    replacement) does, to sampling noise."""
    L, E, tokens = olmoe.moe_layers, olmoe.experts, 3001
    req = generate_requests(WorkloadSpec(requests=1, rate=10.0, prompt=LengthDist("fixed", tokens - 1),
                                         output=LengthDist("fixed", 1), domains=("chat",)), seed=0)
    spec = RoutingSpec(skew=3.0)
    gen = generate_routing(req, olmoe, spec, seed=0)
    ids = synthetic_routing(req, olmoe, spec, seed=0).route(np.array([0]), np.array([0]), np.array([tokens])).ids

    def freq(layer, chosen):
        flat = (np.asarray(layer, np.int64)[:, None] * E + chosen).ravel()
        return np.bincount(flat, minlength=L * E).reshape(L, E) / (tokens * olmoe.top_k)
    sim = freq(np.repeat(np.arange(L), tokens), ids.reshape(L * tokens, -1))
    assert np.abs(freq(gen.layer, gen.expert_ids) - sim).max() < 0.012


def test_the_binned_inverse_cdf_draws_what_an_exact_search_draws():
    """The bin table is a shortcut: every hash maps to the expert an exact search of its row's CDF finds, down to
    the last expert and the bins that straddle an expert boundary."""
    from pwsim.routing import _hi, _inverse_cdf, _inverse_table, hash_key
    E, rows = 7, 3
    p = np.random.default_rng(0).dirichlet(np.full(E, 0.5), size=rows)
    c = np.cumsum(p, axis=1)
    c /= c[:, -1:]
    c[:, -1] = 1.0 + 1e-12
    table = _inverse_table(c + np.arange(rows)[:, None])
    x = hash_key(np.arange(200_000), seed=1)
    row = np.arange(len(x)) % rows
    got = _inverse_cdf(table, row, x, E)
    u = _hi(x)
    want = np.empty(len(x), dtype=np.int64)
    for r in range(rows):
        want[row == r] = np.searchsorted(c[r], u[row == r], side="right")
    assert (got == want).all() and set(got.tolist()) == set(range(E))


def test_hash_helpers_repeats_and_norm_bins():
    from pwsim.routing import _bits_20_31, _repeats
    ids = np.array([[1, 2, 1], [3, 4, 5]])
    assert _repeats(ids, np.array([0, 1])).tolist() == [True, False]  # a slot is not a repeat of itself
    x = np.array([2**64 - 1, 1 << 20, (1 << 20) - 1, 1 << 32], dtype=np.uint64)
    assert _bits_20_31(x).tolist() == [4095, 1, 0, 0]
