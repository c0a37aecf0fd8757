"""Trace files: round trips, atomic writes, and one clear error (file, column, row) per malformed input."""
from __future__ import annotations

import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from traces import io as tio
from traces.generators import RoutingSpec, WorkloadSpec, generate_requests, generate_routing
from traces.model_card import ModelSpec, load_card
from traces.schema import RequestTrace, RoutingTrace, TraceError

CARD = load_card("OLMoE-1B-7B-0924")


@pytest.fixture(scope="module")
def small():
    req = generate_requests(WorkloadSpec(requests=6, token_ids_vocab=500), seed=3)
    req = RequestTrace(req.request_id, req.arrival_s, np.minimum(req.prompt_tokens, 5), np.minimum(req.output_tokens, 3),
                       req.domain_idx, req.domains,
                       np.concatenate([[0], np.cumsum(np.minimum(req.prompt_tokens, 5))]),
                       np.arange(int(np.minimum(req.prompt_tokens, 5).sum())) % 500, req.provenance)
    rt = generate_routing(req, CARD, RoutingSpec(features=True), seed=3)
    return req, rt


def _write(table: pa.Table, path) -> str:
    pq.write_table(table, path)
    return str(path)


def _set(table: pa.Table, name: str, array: pa.Array) -> pa.Table:
    out = table.set_column(table.column_names.index(name), name, array)
    return out.replace_schema_metadata(table.schema.metadata)


def _raises(fn, file, column, row=None, match=None) -> TraceError:
    with pytest.raises(TraceError) as info:
        fn()
    e = info.value
    assert e.file == str(file) and e.column == column and e.row == row, str(e)
    assert str(file) in str(e) and "\n" not in str(e)
    if row is not None:
        assert f"row {row}" in str(e)
    if match:
        assert match in str(e), str(e)
    return e


# ---------------------------------------------------------------- round trips
def test_request_round_trip_keeps_everything(tmp_path, small):
    req, _ = small
    path = tio.write_requests(tmp_path / "r.parquet", req)
    back = tio.read_requests(path)
    for name in ("request_id", "arrival_s", "prompt_tokens", "output_tokens", "token_offsets", "token_ids"):
        np.testing.assert_array_equal(getattr(back, name), getattr(req, name))
    assert back.domains == req.domains and list(back.domain) == list(req.domain)
    assert back.provenance == req.provenance and back.source == str(path)
    assert list(back.prompt_ids(2)) == list(req.prompt_ids(2))


def test_unused_domains_and_their_order_survive(tmp_path):
    req = RequestTrace([0, 1], [0.0, 1.0], [3, 4], [1, 2], [2, 2], ("zeta", "alpha", "mid"))
    back = tio.read_requests(tio.write_requests(tmp_path / "r.parquet", req))
    assert back.domains == ("zeta", "alpha", "mid") and list(back.domain) == ["mid", "mid"]


def test_routing_round_trip_and_directory(tmp_path, small):
    req, rt = small
    tio.write_trace_dir(tmp_path / "t", tio.Trace(req, rt))
    assert sorted(os.listdir(tmp_path / "t")) == ["requests.parquet", "routing.parquet"]
    back = tio.read_trace_dir(tmp_path / "t", model=CARD)
    r = back.routing
    assert (r.card, r.layers, r.experts, r.top_k) == (CARD.name, CARD.moe_layers, CARD.experts, CARD.top_k)
    for name in ("request_id", "position", "layer", "expert_ids", "weights", "gate_up_in_norm", "down_in_norm"):
        np.testing.assert_array_equal(getattr(r, name), getattr(rt, name))
    np.testing.assert_allclose(r.routing_mass(), rt.routing_mass())
    # rewriting without routing removes the stale routing file
    tio.write_trace_dir(tmp_path / "t", tio.Trace(req))
    assert tio.read_trace_dir(tmp_path / "t").routing is None
    # the card of a model no bundled card describes travels beside its trace, and goes with a rewrite without one
    tio.write_trace_dir(tmp_path / "t", tio.Trace(req, rt), CARD.to_dict())
    assert ModelSpec.from_dict(json.loads((tmp_path / "t" / tio.CARD_FILE).read_text())) == CARD
    tio.write_trace_dir(tmp_path / "t", tio.Trace(req, rt))
    assert not (tmp_path / "t" / tio.CARD_FILE).exists()


def test_a_warm_up_s_routing_travels_with_the_trace_and_covers_its_first_requests(tmp_path, small):
    """`warmup_routing.parquet` (a replay's --record-routing): the routing a warm-up computed for the trace's first
    requests, read back beside the trace's own and checked against those requests."""
    req, rt = small
    first = req.head(2)
    assert first.request_id.tolist() == req.request_id[:2].tolist()
    assert list(first.prompt_ids(1)) == list(req.prompt_ids(1))
    warm = generate_routing(first, CARD, RoutingSpec(features=True), seed=4)
    tio.write_trace_dir(tmp_path / "t", tio.Trace(req, rt, warm))
    assert sorted(os.listdir(tmp_path / "t")) == ["requests.parquet", "routing.parquet", "warmup_routing.parquet"]
    back = tio.read_trace_dir(tmp_path / "t", model=CARD)
    np.testing.assert_array_equal(back.warmup_routing.expert_ids, warm.expert_ids)
    np.testing.assert_array_equal(back.routing.expert_ids, rt.expert_ids)
    # a warm-up serves the trace's first requests: routing of others is refused, naming the fix
    later = generate_routing(RequestTrace(req.request_id[2:4], req.arrival_s[2:4], req.prompt_tokens[2:4],
                                          req.output_tokens[2:4], req.domain_idx[2:4], req.domains), CARD,
                             RoutingSpec(), seed=4)
    with pytest.raises(TraceError, match="first 2.*--warmup-requests N --record-routing"):
        tio.write_trace_dir(tmp_path / "u", tio.Trace(req, rt, later))
    tio.write_routing(tmp_path / "t" / "warmup_routing.parquet", later)
    with pytest.raises(TraceError, match="other than the trace's first 2"):
        tio.read_trace_dir(tmp_path / "t")
    tio.write_trace_dir(tmp_path / "t", tio.Trace(req, rt))  # rewritten without one: the stale file goes
    assert tio.read_trace_dir(tmp_path / "t").warmup_routing is None


def test_a_run_s_result_directory_is_refused_as_a_trace(tmp_path, small):
    """A result directory's requests.parquet is what a run measured: read as a trace it would silently simulate
    those requests on synthetic routing. The error names the trace a replay recorded beside it, when there is one."""
    req, rt = small
    run = tmp_path / "run"
    tio.write_trace_dir(run, tio.Trace(req))  # a requests.parquet the reader would otherwise accept
    (run / "summary.json").write_text("{}")
    with pytest.raises(TraceError, match="result directory.*config.json names it"):
        tio.read_trace_dir(run)
    tio.write_trace_dir(run / "trace", tio.Trace(req, rt))
    with pytest.raises(TraceError, match=f"give {run / 'trace'}"):
        tio.read_trace_dir(run)
    assert len(tio.read_trace_dir(run / "trace").routing) == len(rt)


def test_empty_traces_round_trip(tmp_path):
    req = generate_requests(WorkloadSpec(requests=0), seed=0)
    rt = generate_routing(req, CARD, RoutingSpec(features=True), seed=0)
    back = tio.read_trace_dir(tio.write_trace_dir(tmp_path, tio.Trace(req, rt)))
    assert len(back.requests) == 0 and len(back.routing) == 0 and back.routing.has_features
    assert back.routing.summary()["rows"] == 0 and back.requests.summary()["requests"] == 0


def test_reader_accepts_other_integer_widths_and_variable_lists(tmp_path, small):
    """A pandas-style file (int64 everywhere, plain list<...>) reads the same."""
    _, rt = small
    t = tio.routing_table(rt)
    for name, typ in (("position", pa.int64()), ("layer", pa.int64())):
        t = _set(t, name, t.column(name).cast(typ))
    t = _set(t, "expert_ids", t.column("expert_ids").cast(pa.list_(pa.int64())))
    t = _set(t, "weights", t.column("weights").cast(pa.list_(pa.float64())))
    back = tio.read_routing(_write(t, tmp_path / "r.parquet"))
    np.testing.assert_array_equal(back.expert_ids, rt.expert_ids)
    np.testing.assert_array_equal(back.layer, rt.layer)


def test_read_trace_tells_files_apart(tmp_path, small):
    req, rt = small
    tio.write_trace_dir(tmp_path, tio.Trace(req, rt))
    assert tio.read_trace(tmp_path / "routing.parquet").requests is None
    assert tio.read_trace(tmp_path / "requests.parquet").routing is None


def test_sorted_and_request_ranges(small):
    _, rt = small
    rng = np.random.default_rng(0)
    perm = rng.permutation(len(rt))
    shuffled = RoutingTrace(rt.card, rt.layers, rt.experts, rt.top_k, rt.request_id[perm], rt.position[perm],
                            rt.layer[perm], rt.expert_ids[perm], rt.weights[perm])
    assert not shuffled.is_sorted()
    again = shuffled.sorted()
    np.testing.assert_array_equal(again.expert_ids, rt.expert_ids)
    ids, start, stop = again.request_ranges()
    for rid, a, b in zip(ids, start, stop):
        assert (again.request_id[a:b] == rid).all()
    assert stop[-1] == len(rt)


# ---------------------------------------------------------------- atomic writes
def test_failed_write_keeps_the_old_file_and_leaves_no_temp(tmp_path, small, monkeypatch):
    req, _ = small
    path = tio.write_requests(tmp_path / "r.parquet", req)
    before = path.read_bytes()

    def boom(table, where, **kw):
        open(where, "wb").write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(tio.pq, "write_table", boom)
    with pytest.raises(OSError):
        tio.write_requests(path, req)
    assert path.read_bytes() == before and os.listdir(tmp_path) == ["r.parquet"]


def test_writer_refuses_invalid_traces_before_touching_disk(tmp_path, small):
    _, rt = small
    with pytest.raises(TraceError):
        tio.write_trace_dir(tmp_path / "t", tio.Trace(RequestTrace([5], [0.0], [1], [1], [0], ("a",)), rt))
    assert not (tmp_path / "t").exists()


# ---------------------------------------------------------------- request errors
def test_request_errors_name_file_column_row(tmp_path, small):
    req, _ = small
    base = tio.requests_table(req)
    f = tmp_path / "bad.parquet"
    cases = [
        ("prompt_tokens", pa.array([4, 5, -3, 2, 1, 1], pa.int32()), 2, "not positive"),
        ("output_tokens", pa.array([1, 1, 1, 0, 1, 1], pa.int32()), 3, "not positive"),
        ("arrival_s", pa.array([0.0, 1.0, 2.0, 1.5, 3.0, 4.0]), 3, "earlier than the previous"),
        ("arrival_s", pa.array([0.0, float("nan"), 2.0, 3, 4, 5]), 1, "finite"),
        ("request_id", pa.array([0, 7, 2, 3, 7, 5], pa.int64()), 4, "duplicate request id 7 (first at row 1)"),
        ("request_id", pa.array([0, 7, 2, 2, 7, 5], pa.int64()), 3, "duplicate request id 2 (first at row 2)"),
        ("request_id", pa.array([0, 1, None, 3, 4, 5], pa.int64()), 2, "null value"),
        ("prompt_tokens", pa.array([1, 2, 3, 2**40, 1, 1], pa.int64()), 3, "does not fit int32"),
        ("output_tokens", pa.array([1, 2, -2**40, 1, 1, 1], pa.int64()), 2, "does not fit int32"),  # would wrap to 0
    ]
    for column, array, row, match in cases:
        _write(_set(base, column, array), f)
        _raises(lambda: tio.read_requests(f), f, column, row, match)


def test_two_requests_of_one_id_are_refused():
    with pytest.raises(TraceError, match=r"row 1: duplicate request id 5 \(first at row 0\)"):
        RequestTrace([5, 5], [0.0, 1.0], [1, 1], [1, 1], [0, 0], ("a",))


def test_request_column_errors(tmp_path, small):
    req, _ = small
    base = tio.requests_table(req)
    f = tmp_path / "bad.parquet"
    _write(base.drop_columns(["output_tokens"]), f)
    _raises(lambda: tio.read_requests(f), f, "output_tokens", None, "missing column")
    _write(_set(base, "arrival_s", pa.array(["0", "1", "2", "3", "4", "5"])), f)
    _raises(lambda: tio.read_requests(f), f, "arrival_s", None, "has type string")
    _write(_set(base, "domain", pa.array([1, 2, 3, 4, 5, 6])), f)
    _raises(lambda: tio.read_requests(f), f, "domain", None, "expected string")
    lens = np.diff(req.token_offsets)
    bad = [list(range(n)) for n in lens]
    bad[4] = bad[4] + [1]
    _write(_set(base, "prompt_token_ids", pa.array(bad, pa.list_(pa.int32()))), f)
    _raises(lambda: tio.read_requests(f), f, "prompt_token_ids", 4, "token ids")


def test_not_parquet_missing_and_wrong_kind(tmp_path, small):
    req, rt = small
    junk = tmp_path / "junk.parquet"
    junk.write_text("request_id,arrival_s\n0,0.0\n" * 20)
    _raises(lambda: tio.read_requests(junk), junk, None, None, "not a Parquet file")
    _raises(lambda: tio.read_requests(tmp_path / "nope.parquet"), tmp_path / "nope.parquet", None, None, "does not exist")
    tio.write_routing(tmp_path / "routing.parquet", rt)
    _raises(lambda: tio.read_requests(tmp_path / "routing.parquet"), tmp_path / "routing.parquet", "metadata.schema",
            None, "expected a 'requests' trace")
    (tmp_path / "empty").mkdir()
    _raises(lambda: tio.read_trace_dir(tmp_path / "empty"), tmp_path / "empty", None, None, "has no requests.parquet")


# ---------------------------------------------------------------- routing errors
def _fixed(rows, typ, k):
    return pa.FixedSizeListArray.from_arrays(pa.array(np.asarray(rows).ravel(), typ), k)


def test_routing_value_errors_name_file_column_row(tmp_path, small):
    _, rt = small
    base = tio.routing_table(rt)
    f, k = tmp_path / "bad.parquet", rt.top_k
    ids = rt.expert_ids.copy()
    ids[5, 2] = CARD.experts  # out of range
    rep = rt.expert_ids.copy()
    rep[9, 1] = rep[9, 0]  # repeated expert
    w = rt.weights.copy()
    w[11, 0] = -0.5
    layer = rt.layer.copy()
    layer[7] = CARD.moe_layers
    pos = rt.position.copy()
    pos[6] = -1
    dup_layer = rt.layer.copy()
    dup_layer[1] = dup_layer[0]
    cases = [("expert_ids", _fixed(ids, pa.int16(), k), 5, "out of range"),
             ("expert_ids", _fixed(rep, pa.int16(), k), 9, "repeated expert"),
             ("weights", _fixed(w, pa.float32(), k), 11, "finite and >= 0"),
             ("layer", pa.array(layer), 7, "out of range"),
             ("position", pa.array(pos), 6, "negative position"),
             ("layer", pa.array(dup_layer), 1, "duplicate (request")]
    for column, array, row, match in cases:
        _write(_set(base, column, array), f)
        _raises(lambda: tio.read_routing(f), f, column, row, match)
    short = [list(r) for r in rt.expert_ids]
    short[3] = short[3][:-1]
    _write(_set(base, "expert_ids", pa.array(short, pa.list_(pa.int16()))), f)
    _raises(lambda: tio.read_routing(f), f, "expert_ids", 3, "top_k")


def test_routing_metadata_errors(tmp_path, small):
    _, rt = small
    f = tmp_path / "routing.parquet"
    _write(tio.routing_table(rt).replace_schema_metadata(None), f)
    _raises(lambda: tio.read_routing(f), f, "metadata", None, "no PagedWeight metadata")
    tio.write_routing(f, rt)
    _raises(lambda: tio.read_routing(f, model="Qwen1.5-MoE-A2.7B"), f, "metadata.card", None, "OLMoE-1B-7B-0924")
    from dataclasses import replace
    _raises(lambda: tio.read_routing(f, model=replace(CARD, top_k=2)), f, "metadata.top_k", None, "top_k is 8")
    table = tio.routing_table(rt)
    meta = dict(table.schema.metadata)
    meta[b"pagedweight"] = meta[b"pagedweight"].replace(b'"top_k": 8', b'"top_k": 4')
    _write(table.replace_schema_metadata(meta), f)
    _raises(lambda: tio.read_routing(f), f, "expert_ids", 0, "top_k = 4")


def test_routing_must_match_its_requests(tmp_path, small):
    req, rt = small
    tio.write_trace_dir(tmp_path, tio.Trace(req, rt))
    f = tmp_path / "routing.parquet"
    base = tio.routing_table(rt)
    rid = rt.request_id.copy()
    rid[-1] = 999
    _write(_set(base, "request_id", pa.array(rid)), f)
    _raises(lambda: tio.read_trace_dir(tmp_path), f, "request_id", len(rt) - 1, "not in the request trace")
    pos = rt.position.copy()
    last = len(rt) - 1
    pos[last] = int(req.prompt_tokens[-1] + req.output_tokens[-1])
    _write(_set(base, "position", pa.array(pos)), f)
    _raises(lambda: tio.read_trace_dir(tmp_path), f, "position", last, "past the request")


def test_atomic_writes_follow_the_umask_not_tempfiles_private_modes(tmp_path):
    """Files and result folders written through temporaries get the mode a plain open/mkdir would (tempfile makes
    them 0600/0700, which other users of a shared results folder could not read)."""
    import stat

    from traces.clikit import write_json_atomic
    from traces.results import write_result_dir
    old = os.umask(0o022)
    try:
        f = write_json_atomic(tmp_path / "x.json", {"a": 1})
        d = tmp_path / "run"
        write_result_dir(d, {"requests": {"request_id": np.arange(3)}}, {"summary": {"ok": True}})
    finally:
        os.umask(old)
    assert stat.S_IMODE(f.stat().st_mode) == 0o644
    assert stat.S_IMODE(d.stat().st_mode) == 0o755
    assert {stat.S_IMODE(p.stat().st_mode) for p in d.iterdir()} == {0o644}


def test_request_summary_rate_and_percentiles():
    """Five requests over 2 s arrive at 2/s (four gaps); p99 of lengths 1..100 is 99.01, not p95."""
    req = RequestTrace.from_columns(np.arange(5), np.array([0.0, 0.5, 1.0, 1.5, 2.0]), np.array([1, 2, 3, 4, 5]),
                                    np.ones(5, int), ["a"] * 5)
    s = req.summary()
    assert s["duration_s"] == 2.0 and s["rate_per_s"] == 2.0
    req = RequestTrace.from_columns(np.arange(100), np.zeros(100), np.arange(1, 101), np.ones(100, int), ["a"] * 100)
    assert req.summary()["prompt_tokens"]["p99"] == pytest.approx(99.01)


def test_request_summary_counts_lengths_domains_and_token_ids():
    req = RequestTrace.from_columns(np.arange(3), np.zeros(3), np.array([2, 7, 3]), np.array([5, 1, 4]),
                                    ["b", "a", "b"], prompt_token_ids=[[1, 2], list(range(7)), [4, 5, 6]])
    s = req.summary()
    assert s["requests"] == 3 and s["duration_s"] == 0.0 and s["rate_per_s"] == 0.0
    assert s["prompt_tokens"] == {"mean": 4.0, "p50": 3.0, "p99": pytest.approx(6.92), "max": 7}
    assert s["output_tokens"]["max"] == 5 and s["output_tokens"]["mean"] == pytest.approx(10 / 3)
    assert s["total_tokens"] == 12 + 10 and s["domains"] == {"a": 1, "b": 2} and s["prompt_token_ids"]
    one = RequestTrace.from_columns(np.arange(1), np.array([3.0]), np.array([4]), np.array([2]), ["a"]).summary()
    assert one["duration_s"] == 0.0 and not one["prompt_token_ids"]


def test_request_domain_index_and_negative_token_id_rows():
    with pytest.raises(TraceError, match="domain index 1 out of range"):
        RequestTrace(np.arange(2), np.zeros(2), np.ones(2), np.ones(2), np.array([0, 1]), ("a",))
    with pytest.raises(TraceError, match=r"row 1: negative token id -3"):  # the row of the request holding it
        RequestTrace.from_columns(np.arange(3), np.zeros(3), np.array([2, 2, 1]), np.ones(3, int), ["a"] * 3,
                                  prompt_token_ids=[[1, 2], [-3, 3], [4]])


def _tiny_routing(**kw):
    """Request 0, two positions of one layer; then request 0's recompute (attempt 1) of position 0."""
    args = dict(request_id=np.zeros(3), position=np.array([0, 1, 0]), layer=np.zeros(3),
                expert_ids=np.array([[0, 1], [2, 3], [1, 2]]), weights=np.array([[0.75, 0.25], [0.5, 0.5], [1.0, 0.0]]),
                attempt=np.array([0, 0, 1]))
    args.update(kw)
    return RoutingTrace("OLMoE-1B-7B-0924", 1, 40, 2, **args)


def test_routing_sorted_orders_attempts_before_positions():
    back = _tiny_routing(position=np.array([0, 1, 0]), attempt=np.array([1, 0, 0]))
    assert not back.is_sorted() and _tiny_routing().is_sorted()  # attempt 1's position 0 follows attempt 0's 1
    s = back.sorted()
    assert s.is_sorted() and s.attempts.tolist() == [0, 0, 1] and s.position.tolist() == [0, 1, 0]
    assert s.sorted() is s   # already sorted: the same trace back
    two = _tiny_routing(request_id=np.array([1, 0]), position=np.array([0, 0]), layer=np.zeros(2),
                        expert_ids=np.array([[0, 1], [2, 3]]), weights=np.full((2, 2), 0.5), attempt=None)
    assert not two.is_sorted() and two.sorted().request_id.tolist() == [0, 1]
    assert two.sorted().expert_ids.tolist() == [[2, 3], [0, 1]]


def test_routing_norms_must_be_finite_and_not_negative():
    zeros = _tiny_routing(gate_up_in_norm=np.zeros(3), down_in_norm=np.zeros((3, 2)))   # a zero input's norm is 0
    assert zeros.has_features
    for gu, dn, column in [(np.array([1.0, -1.0, 1.0]), np.ones((3, 2)), "gate_up_in_norm"),
                           (np.ones(3), np.array([[1.0, 1.0], [1.0, np.nan], [1.0, 1.0]]), "down_in_norm")]:
        with pytest.raises(TraceError, match=rf"column '{column}', row 1: norm .* must be finite and >= 0"):
            _tiny_routing(gate_up_in_norm=gu, down_in_norm=dn)


def test_routing_mass_summary_and_card_check():
    rt = _tiny_routing()
    mass = rt.routing_mass()
    assert mass.sum() == pytest.approx(1.0) and mass[0, :4] == pytest.approx([0.75 / 3, 1.25 / 3, 0.5 / 3, 0.5 / 3])
    two = RoutingTrace("x", 2, 4, 2, np.zeros(2), np.zeros(2), np.array([0, 1]), np.array([[0, 1], [0, 1]]),
                       np.array([[1.0, 1.0], [0.5, 0.0]]))
    assert two.routing_mass().tolist() == [[0.5, 0.5, 0, 0], [1.0, 0, 0, 0]]  # each layer's row sums to 1
    # experts 40 // 10 = 4 hottest: expert 4 and beyond hold nothing, so they hold all of it
    assert rt.summary()["hottest_10pct_mass"] == pytest.approx(1.0)
    from types import SimpleNamespace
    rt.check_model(SimpleNamespace(name="olmoe-1b-7b-0924", moe_layers=1, experts=40, top_k=2))  # names ignore case
    with pytest.raises(TraceError, match="not a valid MoE shape"):
        RoutingTrace("OLMoE-1B-7B-0924", 0, 40, 2, np.zeros(0), np.zeros(0), np.zeros(0), np.zeros((0, 2)),
                     np.zeros((0, 2)))


@pytest.mark.parametrize("experts, top_k, ok", [(4, 4, True), (32767, 2, True), (4, 0, False), (4, 5, False),
                                                (32768, 2, False)])
def test_a_routing_shape_takes_top_k_1_to_experts_and_experts_that_fit_int16(experts, top_k, ok):
    def make():
        return RoutingTrace("x", 1, experts, top_k, np.zeros(0), np.zeros(0), np.zeros(0), np.zeros((0, top_k)),
                            np.zeros((0, top_k)))
    if ok:
        assert make().top_k == top_k
    else:
        with pytest.raises(TraceError, match="not a valid MoE shape"):
            make()


def test_reader_edge_values_null_rows_and_boolean_metadata(tmp_path, small):
    """An int64 column at the target type's maximum fits; a null first in a row's list names that row; a boolean is
    not an integer in the metadata."""
    _, rt = small
    f = tmp_path / "edge.parquet"
    base = tio.routing_table(rt)
    layer = rt.layer.astype(np.int64).copy()
    layer[0] = np.iinfo(np.int16).max
    _write(_set(base, "layer", pa.array(layer)), f)
    _raises(lambda: tio.read_routing(f), f, "layer", 0, "out of range")  # it fits int16: the range check speaks
    ids = [list(r) for r in rt.expert_ids.tolist()]
    ids[4][0] = None
    _write(_set(base, "expert_ids", pa.array(ids, pa.list_(pa.int16()))), f)
    _raises(lambda: tio.read_routing(f), f, "expert_ids", 4, "null inside a list")
    meta = dict(base.schema.metadata)
    meta[b"pagedweight"] = meta[b"pagedweight"].replace(b'"top_k": 8', b'"top_k": true')
    _write(base.replace_schema_metadata(meta), f)
    _raises(lambda: tio.read_routing(f), f, "metadata.top_k", None, "lacks a valid 'top_k'")


def test_a_plain_requests_file_with_a_categorical_domain_reads(tmp_path, small):
    """A requests file written by other tools (no PagedWeight metadata, the domain dictionary-encoded, as pandas
    writes a categorical) reads as the same requests."""
    import pyarrow.compute as pc
    req, _ = small
    t = tio.requests_table(req).drop_columns(["prompt_token_ids"]).replace_schema_metadata(None)
    domain = pc.dictionary_encode(t.column("domain").combine_chunks())
    t = t.set_column(t.column_names.index("domain"), "domain", domain)
    back = tio.read_requests(_write(t, tmp_path / "requests.parquet"))
    np.testing.assert_array_equal(back.request_id, req.request_id)
    assert [back.domains[i] for i in back.domain_idx] == [req.domains[i] for i in req.domain_idx]


def test_routing_with_one_norm_column_names_the_other_and_provenance_survives(tmp_path, small):
    _, rt = small
    path = tio.write_routing(tmp_path / "nested" / "new" / "routing.parquet", rt)
    assert tio.read_routing(path).provenance == rt.provenance and rt.provenance
    t = pq.read_table(path).drop_columns(["down_in_norm"])
    bad = _write(t, tmp_path / "one_norm.parquet")
    _raises(lambda: tio.read_routing(bad), bad, "down_in_norm", None, "missing")


def test_a_trace_directory_that_is_a_file_or_missing_says_which(tmp_path):
    (tmp_path / "file").write_text("x")
    _raises(lambda: tio.read_trace_dir(tmp_path / "file"), tmp_path / "file", None, None, "is not a directory")
    _raises(lambda: tio.read_trace_dir(tmp_path / "gone"), tmp_path / "gone", None, None, "does not exist")
