"""`pwruntime replay` (a request trace served in real time) and `pwsim fidelity` (a simulated run against it)."""
from __future__ import annotations

import json
import time
from dataclasses import replace

import numpy as np
import pytest
from model_fixtures import make_tiny_checkpoint

from pwruntime.cli import main as rt_main
from pwsim.cli import main as sim_main
from pwsim.fidelity import RunView, compare, fitted_profile, iteration_fit, iteration_kinds
from traces.clikit import UserError
from traces.hardware import load_profile
from traces.io import write_requests
from traces.results import read_result_dir, write_result_dir
from traces.schema import RequestTrace

BUNDLED = "traces/bundled/demo-replay-h200"
ARRIVALS = (0.0, 0.02, 0.25)
OUTPUTS = (5, 3, 4)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("replay"), "mixtral", seed=5)


def _trace(with_ids: bool = True) -> RequestTrace:
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12], [20, 21, 22, 23, 24, 25, 26]]
    return RequestTrace.from_columns([7, 3, 11], list(ARRIVALS), [len(p) for p in prompts], list(OUTPUTS),
                                     ["a", "b", "a"], prompt_token_ids=prompts if with_ids else None)


def _engine(ckpt, clock=None):
    from pwruntime.engine import EngineConfig, LLMEngine
    from pwruntime.model import load_model
    kw = {} if clock is None else {"clock": clock}
    return LLMEngine(load_model(ckpt), EngineConfig(num_kv_blocks=64, block_size=4, max_num_seqs=4), **kw)


class VirtualClock:
    """Time that passes only when the replay sleeps: engine steps take no time, so the schedule is exact."""

    def __init__(self) -> None:
        self.now, self.slept = 0.0, []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def test_replay_serves_each_request_at_its_arrival(ckpt):
    from pwruntime.replay import replay
    clock = VirtualClock()
    res = replay(_engine(ckpt, clock), _trace(), sleep=clock.sleep)
    r = res.requests
    np.testing.assert_array_equal(r["request_id"], [7, 3, 11])
    np.testing.assert_array_equal(r["output_tokens"], OUTPUTS)
    assert list(r["finish_reason"]) == ["length"] * 3 and list(r["domain"]) == ["a", "b", "a"]
    # with steps that take no time, each request is served the moment it arrives, and the replay sleeps exactly
    # until the next arrival
    np.testing.assert_allclose(clock.slept, [ARRIVALS[1] - ARRIVALS[0], ARRIVALS[2] - ARRIVALS[1]])
    np.testing.assert_allclose(r["first_token_s"], ARRIVALS)
    np.testing.assert_allclose(r["finish_s"], ARRIVALS)
    np.testing.assert_allclose(r["ttft_s"], 0.0, atol=1e-12)
    tl = res.timeline
    # every prompt token and every output token but the last is computed once (no preemption here)
    assert int(tl["batch_tokens"].sum()) == 5 + 3 + 7 + sum(OUTPUTS) - 3
    np.testing.assert_allclose(tl["iter_s"], 0.0)
    s = res.summary
    assert s["completed"] == 3 and s["output_tokens"] == sum(OUTPUTS) and s["iterations"] == len(tl["time_s"])
    assert s["computed_tokens"] == 5 + 3 + 7 + sum(OUTPUTS) - 3  # prefill tokens too, not only decode ones


def test_replay_times_the_gaps_between_each_request_s_tokens(ckpt, monkeypatch):
    """A step that takes 10 ms on the clock puts 10 ms between two tokens of a request; a step the replay skips
    (nothing to run until the next arrival) puts none."""
    from pwruntime.replay import replay
    clock = VirtualClock()
    engine = _engine(ckpt, clock)
    step = engine.step

    def slow_step():
        clock.now += 0.01
        return step()
    monkeypatch.setattr(engine, "step", slow_step)
    res = replay(engine, _trace(), sleep=clock.sleep)
    r, s = res.requests, res.summary
    np.testing.assert_allclose(r["max_itl_s"], 0.01)
    np.testing.assert_allclose([s["itl_s"][k] for k in ("p50", "p99", "max")], 0.01)
    assert s["itl_s"]["mean"] * (sum(OUTPUTS) - 3) == pytest.approx(np.sum(r["finish_s"] - r["first_token_s"]))


def test_a_time_scale_of_zero_sends_every_request_at_once(ckpt):
    from pwruntime.replay import replay
    clock = VirtualClock()
    res = replay(_engine(ckpt, clock), _trace(), time_scale=0.0, sleep=clock.sleep)
    r = res.requests
    assert clock.slept == [] and np.all(r["arrival_s"] == 0.0)  # nothing to wait for
    np.testing.assert_array_equal(r["output_tokens"], OUTPUTS)
    assert res.timeline["batch_tokens"][0] == 5 + 3 + 7  # the three prompts in the first step
    assert res.timeline["batch_seqs"][0] == 3 and res.timeline["batch_seqs"][-1] == 1  # the longest ends alone
    assert (res.timeline["plan_transitions"] == 0).all()  # the noop policy never plans


def test_warm_up_runs_before_the_clock_and_stays_out_of_the_result(ckpt):
    from pwruntime.replay import replay
    from traces.results import WARMUP_TOKENS
    clock = VirtualClock()
    engine = _engine(ckpt, clock)
    res = replay(engine, _trace(), warmup_requests=2, sleep=clock.sleep)
    warm = res.summary["warmup_steps"]
    # two prompts (5 and 3 tokens) prefilled together, then decoded for min(16, their output lengths) - 1 steps
    assert warm == 1 + max(min(WARMUP_TOKENS, o) for o in OUTPUTS[:2]) - 1
    assert res.timeline["step"][0] == warm and engine.num_steps == warm + len(res.timeline["step"])
    np.testing.assert_array_equal(res.requests["output_tokens"], OUTPUTS)  # the trace's own requests, in full
    np.testing.assert_allclose(res.requests["first_token_s"], ARRIVALS)   # the clock started after the warm-up
    assert res.summary["iterations"] == len(res.timeline["step"])


def test_a_warm_up_of_more_requests_than_the_trace_has_serves_each_prompt_once(ckpt):
    """`--warmup-requests 32` on a shorter trace warms up with every prompt it has, once."""
    from pwruntime.replay import warm_up
    engine = _engine(ckpt)
    assert len(warm_up(engine, _trace(), 32)) == len(_trace()) and not engine.has_unfinished()


@pytest.mark.parametrize("warmup", [0, 2])
def test_graphs_are_captured_before_the_warm_up_and_the_clock(ckpt, monkeypatch, warmup):
    # as a server captures them before its first request: no step pays a capture, and a pool sized from memory gives
    # up what they take before anything runs (the pool the summary says the replay started with)
    from pwruntime.replay import replay
    clock = VirtualClock()
    engine = _engine(ckpt, clock)
    captured = []
    monkeypatch.setattr(engine, "capture_graphs", lambda: captured.append((engine.num_steps, engine.pool.capacity)))
    res = replay(engine, _trace(), warmup_requests=warmup, sleep=clock.sleep)
    # once, before the warm-up's steps and the first replayed one
    assert captured == [(0, res.summary["kv_blocks_start"])]
    assert res.summary["warmup_steps"] == res.timeline["step"][0] and (warmup > 0) == (res.timeline["step"][0] > 0)


def test_the_pool_a_replay_starts_with_is_the_one_its_captures_leave(ckpt, monkeypatch):
    """`kv_blocks_start` is the pool once the graphs are captured (a budget's pool gives up their memory: here two
    blocks, a stand-in), not the pool before them, after the warm-up or at the end (a plan's reserve shrinks it as
    steps run: here a block a step, another stand-in)."""
    from pwruntime.replay import replay
    clock = VirtualClock()
    engine = _engine(ckpt, clock)
    step = engine.step

    def shrinking_step():
        engine.capacity.shrink(1)
        return step()
    monkeypatch.setattr(engine, "capture_graphs", lambda: engine.capacity.shrink(2))
    monkeypatch.setattr(engine, "step", shrinking_step)
    res = replay(engine, _trace(), warmup_requests=2, sleep=clock.sleep)
    assert res.summary["warmup_steps"] > 0 and res.summary["kv_blocks_start"] == 64 - 2
    assert engine.pool.capacity == 64 - 2 - engine.num_steps


def test_replay_on_the_wall_clock_never_serves_early(ckpt):
    from pwruntime.replay import replay
    res = replay(_engine(ckpt), _trace())
    r = res.requests
    assert np.all(r["first_token_s"] >= r["arrival_s"]) and np.all(r["finish_s"] >= r["first_token_s"])
    np.testing.assert_allclose(r["tpot_s"], (r["finish_s"] - r["first_token_s"]) / (np.array(OUTPUTS) - 1))
    assert np.all(res.timeline["iter_s"] > 0) and np.all(np.diff(res.timeline["time_s"]) >= 0)


def test_replay_times_each_step_s_phases(ckpt):
    """The engine's phase times (StepPhases) land in the timeline: they cover the step (the replay's own clock reads
    around it add next to nothing), the forward takes time in every step, and the summary averages them per kind."""
    from pwruntime.engine import PlanCosts, StepPhases
    from pwruntime.replay import replay
    res = replay(_engine(ckpt), _trace())
    tl = res.timeline
    phases = np.stack([np.asarray(tl[p]) for p in StepPhases.PHASES])
    assert np.all(phases >= 0) and np.all(phases[1] > 0)
    total = phases.sum(axis=0)
    # inside each step, and covering it (a step the OS paused between the replay's clock read and the step's own
    # first mark is the exception the median allows: CI shares two cores)
    assert np.all(total <= tl["iter_s"] + 1e-9) and np.median(total / tl["iter_s"]) >= 0.9
    decode = np.asarray(tl["batch_tokens"]) == np.asarray(tl["decode_tokens"])
    got = res.summary["phase_ms"]
    assert set(got) == {"decode", "mixed"} and set(got["decode"]) == {p[:-2] for p in StepPhases.PHASES}
    assert got["mixed"]["forward"] == pytest.approx(1e3 * np.mean(phases[1][~decode]), abs=1e-3)
    assert set(np.unique(tl["routing_read"])) <= {0, 1} and res.summary["routing_reads"] == int(tl["routing_read"].sum())
    parts = np.stack([np.asarray(tl[f"plan_{p}"]) for p in PlanCosts.PARTS])  # parts of the plan phase, inside it
    assert np.all(parts >= 0) and np.all(parts.sum(axis=0) <= np.asarray(tl["plan_s"]) + 1e-9)
    assert res.summary["plan_ms"] is None  # the noop policy never plans


def test_replay_needs_prompt_ids_and_a_time_scale_of_zero_or_more(ckpt):
    from pwruntime.replay import replay
    with pytest.raises(UserError, match="prompt token ids"):
        replay(_engine(ckpt), _trace(with_ids=False))
    with pytest.raises(UserError, match="time-scale must be a number >= 0"):
        replay(_engine(ckpt), _trace(), time_scale=-1)
    with pytest.raises(UserError, match="warmup-requests"):
        replay(_engine(ckpt), _trace(), warmup_requests=-1)


def test_replay_cli_writes_a_result_directory(ckpt, tmp_path, capsys):
    write_requests(tmp_path / "t" / "requests.parquet", _trace())
    out = tmp_path / "run"
    args = ["replay", "--trace", str(tmp_path / "t"), "--out", str(out), "--model", str(ckpt), "--block-size", "4",
            "--num-kv-blocks", "64", "--max-requests", "2", "--json"]
    assert rt_main(args) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["requests"] == 2 and summary["output_tokens"] == OUTPUTS[0] + OUTPUTS[1]
    s, req, tl, cfg = read_result_dir(out)
    assert s == json.loads((out / "summary.json").read_text()) and cfg["max_requests"] == 2
    np.testing.assert_array_equal(req["request_id"], [7, 3])
    assert len(tl["iter_s"]) == s["iterations"] and "slo" not in s
    # with SLO bounds: a generous TTFT bound every request meets, and the same bound with an impossible TPOT
    assert rt_main(args[:-1] + ["--slo-ttft", "60", "--force"]) == 0
    assert "SLO TTFT <= 60000 ms: 2/2 requests (100.0%)" in capsys.readouterr().out
    assert json.loads((out / "summary.json").read_text())["slo"]["attainment"] == 1.0
    assert rt_main(args + ["--slo-ttft", "60", "--slo-tpot", "1e-9", "--force"]) == 0
    assert json.loads(capsys.readouterr().out)["slo"]["met"] == 0


def test_replay_cli_samples_where_the_host_stood_still(ckpt, tmp_path, capsys, monkeypatch):
    # a capture that takes 0.8 s before the clock shows as a stretch there, with the line that made it
    from pwruntime.engine import LLMEngine

    monkeypatch.setattr(LLMEngine, "capture_graphs", lambda self: time.sleep(0.8))
    write_requests(tmp_path / "t" / "requests.parquet", _trace())
    out = tmp_path / "run"
    assert rt_main(["replay", "--trace", str(tmp_path / "t"), "--out", str(out), "--model", str(ckpt),
                    "--block-size", "4", "--num-kv-blocks", "64", "--max-requests", "2", "--sample-host-stacks"]) == 0
    doc = json.loads((out / "host_stacks.json").read_text())
    assert doc["samples"] > 10 and doc["interval_s"] == 0.05
    top = doc["stretches"][0]
    assert 0.5 <= top["seconds"] <= 1.0 and -5 < top["start_s"] < 0 and top["stack"][0].endswith("<lambda>")
    assert f"the host stood {top['seconds']:.2f} s" in capsys.readouterr().out


@pytest.mark.parametrize("setup, needle", [("no-ids", "prompt token ids"), ("missing", "does not exist"),
                                           ("not-a-result", "not empty")])
def test_replay_cli_user_errors_exit_2(ckpt, tmp_path, capsys, setup, needle):
    trace = tmp_path / "t"
    write_requests(trace / "requests.parquet", _trace(with_ids=setup != "no-ids"))
    out = tmp_path / "run"
    if setup == "not-a-result":
        out.mkdir()
        (out / "keep.txt").write_text("mine")
    src = tmp_path / "nope" if setup == "missing" else trace
    assert rt_main(["replay", "--trace", str(src), "--out", str(out), "--model", str(ckpt)]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err
    assert not (out / "summary.json").exists()


# ---------------------------------------------------------------- fidelity
def _view(ids, ttft, tpot, e2e, iter_s, tokens, throughput=100.0):
    req = {"request_id": np.asarray(ids), "ttft_s": np.asarray(ttft, float), "tpot_s": np.asarray(tpot, float),
           "e2e_s": np.asarray(e2e, float)}
    return RunView({"throughput_tokens_per_s": throughput, "makespan_s": 2.0}, req,
                   {"iter_s": np.asarray(iter_s, float), "batch_tokens": np.asarray(tokens)})


def test_a_metric_s_ratios_are_its_median_and_10th_and_90th_percentiles():
    from pwsim.fidelity import metric_report
    ratio = np.arange(1.0, 101.0)
    r = metric_report(ratio, np.ones(100))
    assert (r["ratio_p10"], r["ratio_p50"], r["ratio_p90"]) == pytest.approx((10.9, 50.5, 90.1))
    assert r["pairs"] == 100 and r["median_abs_rel_error"] == pytest.approx(49.5)


def test_the_iteration_fit_leaves_out_steps_that_computed_no_token():
    """A boundary with no tokens (a stall, an empty step) is no point on the line a token's cost is fitted from."""
    tokens = np.array([1, 2, 4, 8, 16, 0, 0])
    t = np.r_[0.003 + 1e-4 * tokens[:5], 0.5, 0.5]
    fit = iteration_fit({"iter_s": t, "batch_tokens": tokens})
    assert fit["iterations"] == 5 and fit["intercept_s"] == pytest.approx(0.003) and fit["per_token_s"] == \
        pytest.approx(1e-4)


def test_fidelity_ratios_errors_and_overhead_gap():
    tokens = np.array([1, 2, 4, 8, 16])
    runtime = _view([1, 2, 3], [0.1, 0.2, 0.4], [0.01, 0.02, 0.04], [1.0, 2.0, 4.0], 0.003 + 1e-4 * tokens, tokens, 50)
    # the simulator sees requests 2, 3 and 9 at half the runtime's latencies, with 2 ms less per iteration
    sim = _view([9, 3, 2], [5.0, 0.2, 0.1], [1.0, 0.02, 0.01], [9.0, 2.0, 1.0], 0.001 + 1e-4 * tokens, tokens, 100)
    rep = compare(sim, runtime)
    assert rep["requests"] == {"sim": 3, "runtime": 3, "paired": 2}
    for m in ("ttft_s", "tpot_s", "e2e_s"):
        assert rep["metrics"][m]["ratio_p50"] == pytest.approx(0.5)
        assert rep["metrics"][m]["median_abs_rel_error"] == pytest.approx(0.5)
    assert rep["throughput_ratio"] == pytest.approx(2.0) and rep["makespan_ratio"] == pytest.approx(1.0)
    assert rep["iterations"]["overhead_gap_us"] == pytest.approx(2000.0, rel=1e-6)
    assert iteration_fit(runtime.timeline)["per_token_s"] == pytest.approx(1e-4)
    prof = load_profile("h200-roofline")
    fit = fitted_profile(prof, rep)
    assert fit.iteration_overhead_us == pytest.approx(prof.iteration_overhead_us + 2000.0) and fit.name.endswith("-fit")


def test_fidelity_sets_the_two_sides_gaps_between_tokens_side_by_side():
    itl = lambda p50, p99: {"mean": p50, "p50": p50, "p90": p99, "p95": p99, "p99": p99, "max": 2 * p99}  # noqa: E731
    sim, runtime = _view([1], [0.1], [0.01], [1.0], [0.01], [1]), _view([1], [0.1], [0.01], [1.0], [0.01], [1])
    assert compare(sim, runtime)["itl"] is None      # results from before session 57 have none
    sim.summary["itl_s"], runtime.summary["itl_s"] = itl(0.01, 0.03), itl(0.02, 0.12)
    rep = compare(sim, runtime)["itl"]
    assert rep["ratio_p50"] == pytest.approx(0.5) and rep["ratio_p99"] == pytest.approx(0.25)
    assert rep["runtime"] == {"p50": 0.02, "p99": 0.12, "max": 0.24}


def test_the_fit_tells_a_sequence_s_host_cost_from_a_token_s():
    """Decode steps of several batch sizes and mixed steps with prompt chunks: the three-term fit recovers each
    side's costs, their gaps move the profile's three terms, and old timelines estimate their sequences."""
    seqs = np.array([1, 4, 16, 32, 2, 33, 8])
    tokens = np.array([1, 4, 16, 32, 400, 512, 8])
    decode = np.array([1, 4, 16, 32, 1, 32, 8])
    runtime = _view([1], [0.1], [0.01], [1.0], 500e-6 + 20e-6 * seqs + 5e-6 * tokens, tokens)
    sim = _view([1], [0.1], [0.01], [1.0], 400e-6 + 1e-6 * seqs + 2e-6 * tokens, tokens)
    runtime.timeline.update(batch_seqs=seqs, decode_tokens=decode)
    sim.timeline.update(batch_seqs=seqs, decode_tokens=decode)
    fit = iteration_fit(runtime.timeline, per_seq=True)
    assert (fit["intercept_s"], fit["per_seq_s"], fit["per_token_s"]) == (
        pytest.approx(500e-6), pytest.approx(20e-6), pytest.approx(5e-6))
    rep = compare(sim, runtime)
    it = rep["iterations"]["per_sequence"]
    assert it["overhead_gap_us"] == pytest.approx(100.0) and it["per_seq_gap_us"] == pytest.approx(19.0)
    assert it["per_token_gap_us"] == pytest.approx(3.0)
    assert "per_seq_gap_us" not in rep["iterations"]  # the two-term fit stays the report's first
    prof = replace(load_profile("h200-roofline"), sequence_overhead_us=2.0, token_overhead_us=1.0)
    fitted = fitted_profile(prof, rep, per_sequence=True)
    assert fitted.sequence_overhead_us == pytest.approx(21.0) and fitted.token_overhead_us == pytest.approx(4.0)
    assert fitted.iteration_overhead_us == pytest.approx(prof.iteration_overhead_us + 100.0)
    assert fitted_profile(prof, rep).sequence_overhead_us == 2.0  # the two-term fit leaves it as it was
    # a timeline from before `batch_seqs`: its decode tokens, plus one for a step with prompt tokens
    del runtime.timeline["batch_seqs"]
    assert compare(sim, runtime)["iterations"]["per_sequence"]["per_seq_gap_us"] == pytest.approx(19.0, abs=2.0)
    del runtime.timeline["decode_tokens"]  # nothing to count sequences by
    assert compare(sim, runtime)["iterations"]["per_sequence"] is None
    with pytest.raises(UserError, match="per-sequence"):
        fitted_profile(prof, compare(sim, runtime), per_sequence=True)
    # decode steps alone cannot tell a sequence from a token: the two-term fit, no sequence term
    only = {k: v[:4] for k, v in runtime.timeline.items()}
    assert iteration_fit(only, per_seq=True)["per_seq_s"] is None
    assert iteration_fit(only, per_seq=True)["per_token_s"] == pytest.approx(25e-6)


def test_fidelity_compares_decode_and_mixed_iterations_apart():
    tokens = np.array([4, 4, 100, 4, 300, 0])
    decode = np.array([4, 4, 3, 4, 0, 0])
    iter_s = np.array([0.001, 0.003, 0.010, 0.002, 0.020, 0.5])   # the empty iteration counts as neither kind
    kinds = iteration_kinds({"iter_s": iter_s, "batch_tokens": tokens, "decode_tokens": decode})
    assert kinds["decode"] == {"iterations": 3, "mean_iter_s": pytest.approx(0.002), "mean_tokens": pytest.approx(4.0)}
    assert kinds["mixed"] == {"iterations": 2, "mean_iter_s": pytest.approx(0.015), "mean_tokens": pytest.approx(200.0)}
    only_decode = iteration_kinds({"iter_s": iter_s[:2], "batch_tokens": tokens[:2], "decode_tokens": decode[:2]})
    assert only_decode["mixed"] == {"iterations": 0, "mean_iter_s": None, "mean_tokens": None}
    old = _view([1], [0.1], [0.01], [1.0], iter_s[:5], tokens[:5])         # a result from before the column
    assert iteration_kinds(old.timeline) is None
    assert compare(old, old)["iterations"]["by_kind"] == {"sim": None, "runtime": None}


def test_fidelity_measures_what_reading_the_routing_costs():
    """A replay that records which steps' planners read the routing statistics gives their cost (mean plan phase of
    those steps minus the others'), which the fitted profile takes as routing_read_us; without the record, or
    without steps of both kinds, the profile keeps its own."""
    tokens = np.array([1, 1, 2, 2, 4, 4])
    sim = _view([1], [0.1], [0.01], [1.0], 0.001 + 1e-4 * tokens, tokens)
    sim.summary["counters"] = {"routing_reads": 4}
    runtime = _view([1], [0.1], [0.01], [1.0], 0.002 + 1e-4 * tokens, tokens)
    runtime.timeline["plan_s"] = np.array([1e-4, 6e-4, 1e-4, 7e-4, 1e-4, 5e-4])
    runtime.timeline["routing_read"] = np.array([0, 1, 0, 1, 0, 1])
    rep = compare(sim, runtime)
    assert rep["routing_reads"]["sim"] == 4 and rep["routing_reads"]["runtime"] == 3
    assert rep["routing_reads"]["plan_gap_us"] == pytest.approx(500.0)
    prof = load_profile("h200-roofline")
    assert prof.routing_read_us == 0 and fitted_profile(prof, rep).routing_read_us == pytest.approx(500.0)
    runtime.timeline["routing_read"] = np.zeros(6, int)
    assert compare(sim, runtime)["routing_reads"]["plan_gap_us"] is None
    del runtime.timeline["routing_read"]
    rep = compare(sim, runtime)
    assert rep["routing_reads"] == {"sim": 4, "runtime": None, "plan_gap_us": None, "read_us": None,
                                    "transition_us": None}
    assert fitted_profile(replace(prof, routing_read_us=80.0), rep).routing_read_us == 80.0


def test_a_plan_s_transitions_are_fitted_apart_from_its_read():
    """A planning step's cost grows with the transitions its plan starts (the runtime's page moves); a replay that
    records them splits the plan phase into a read's fixed part and a transition's, and the fitted profile takes
    both (the simulator then charges a small plan less than a large one)."""
    tokens = np.array([1, 1, 2, 2, 4, 4, 4])
    sim = _view([1], [0.1], [0.01], [1.0], 0.001 + 1e-4 * tokens, tokens)
    runtime = _view([1], [0.1], [0.01], [1.0], 0.002 + 1e-4 * tokens, tokens)
    read = np.array([0, 1, 0, 1, 0, 1, 1])
    moves = np.array([0, 2, 0, 50, 3, 10, 0])  # a reload may start moves without reading
    runtime.timeline.update(routing_read=read, plan_transitions=moves,
                            plan_s=(50 + 1500 * read + 200 * moves) * 1e-6)
    rr = compare(sim, runtime)["routing_reads"]
    assert rr["read_us"] == pytest.approx(1500.0) and rr["transition_us"] == pytest.approx(200.0)
    fit = fitted_profile(load_profile("h200-roofline"), compare(sim, runtime))
    assert fit.routing_read_us == pytest.approx(1500.0) and fit.plan_transition_us == pytest.approx(200.0)
    runtime.timeline["plan_transitions"] = np.zeros(7, int)  # nothing to tell the terms apart by
    rr = compare(sim, runtime)["routing_reads"]
    assert rr["transition_us"] is None and rr["plan_gap_us"] is not None


def test_the_host_fit_leaves_planning_to_the_plan_terms():
    """Where planning is a large part of a step (a model of OLMoE's size reads its routing statistics in 6 ms), the
    iteration and token terms are fitted without each side's planning (the simulator's own charge, the runtime's
    reads and moves at the fitted terms), so the fitted profile charges it once: as reads and transitions."""
    tokens = np.array([1, 1, 2, 2, 4, 4, 4])
    read = np.array([0, 1, 0, 1, 0, 1, 1])
    moves = np.array([0, 2, 0, 50, 3, 10, 0])
    runtime_plan = (50 + 6000 * read + 400 * moves) * 1e-6  # 50 us of commits every step
    sim_plan = (100 * read + 10 * moves) * 1e-6  # the profile the simulator ran with charges less
    sim = _view([1], [0.1], [0.01], [1.0], 0.001 + 1e-4 * tokens + sim_plan, tokens)
    runtime = _view([1], [0.1], [0.01], [1.0], 0.002 + 1e-4 * tokens + runtime_plan, tokens)
    sim.timeline["plan_s"] = sim_plan
    runtime.timeline.update(routing_read=read, plan_transitions=moves, plan_s=runtime_plan)
    rep = compare(sim, runtime)
    it = rep["iterations"]
    assert it["net_of_planning"]
    assert it["overhead_gap_us"] == pytest.approx(1050.0) and it["per_token_gap_us"] == pytest.approx(0.0, abs=1e-6)
    prof = load_profile("h200-roofline")
    fit = fitted_profile(prof, rep)
    assert fit.routing_read_us == pytest.approx(6000.0) and fit.plan_transition_us == pytest.approx(400.0)
    # what the fitted profile charges a step is what the runtime paid beyond the simulator's device and host work
    charged = (fit.iteration_overhead_us - prof.iteration_overhead_us) + 6000 * read + 400 * moves
    assert np.allclose(charged * 1e-6, runtime.timeline["iter_s"] - (0.001 + 1e-4 * tokens))
    # a simulation that does not record its planning: the host terms absorb the runtime's (as before)
    del sim.timeline["plan_s"]
    old = compare(sim, runtime)["iterations"]
    assert not old["net_of_planning"] and old["overhead_gap_us"] > 2000.0


def test_a_metric_pairs_only_requests_both_sides_measured():
    """A request with no finite value on either side, or a runtime value of 0 (no ratio), is no pair: it counts in
    neither side's median."""
    from pwsim.fidelity import metric_report
    r = metric_report(np.array([1.0, np.nan, 2.0, 4.0]), np.array([2.0, 1.0, 0.0, 8.0]))
    assert r["pairs"] == 2 and r["ratio_p50"] == pytest.approx(0.5)
    assert (r["sim_p50"], r["runtime_p50"]) == (pytest.approx(2.5), pytest.approx(5.0))


def test_old_timelines_count_a_step_with_prompt_tokens_as_one_more_sequence():
    from pwsim.fidelity import batch_seqs
    seqs = batch_seqs({"batch_tokens": np.array([4, 100, 300]), "decode_tokens": np.array([4, 3, 0])})
    assert seqs.tolist() == [4.0, 4.0, 1.0]  # a decode-only step is its decode tokens


def test_three_steps_of_three_sizes_give_the_fit_with_a_sequence_term():
    seqs, tokens = np.array([1, 4, 2]), np.array([1, 4, 400])
    fit = iteration_fit({"iter_s": 500e-6 + 20e-6 * seqs + 5e-6 * tokens, "batch_tokens": tokens, "batch_seqs": seqs},
                        per_seq=True)
    assert (fit["intercept_s"], fit["per_seq_s"], fit["per_token_s"]) == (
        pytest.approx(500e-6), pytest.approx(20e-6), pytest.approx(5e-6))


def test_steps_of_one_size_fit_no_token_cost_and_their_median_is_the_intercept():
    fit = iteration_fit({"iter_s": np.array([0.01, 0.02, 0.06]), "batch_tokens": np.array([8, 8, 8])})
    assert fit["per_token_s"] is None and fit["intercept_s"] == pytest.approx(0.02)
    assert fit["median_iter_s"] == pytest.approx(0.02) and fit["iterations"] == 3


def test_the_kinds_of_iteration_report_mean_times_and_tokens():
    tokens = np.array([2, 4, 12, 100, 150, 500])
    kinds = iteration_kinds({"iter_s": np.array([0.001, 0.002, 0.006, 0.01, 0.01, 0.04]), "batch_tokens": tokens,
                             "decode_tokens": np.array([2, 4, 12, 3, 0, 0])})
    assert kinds["decode"] == {"iterations": 3, "mean_iter_s": pytest.approx(0.003), "mean_tokens": pytest.approx(6.0)}
    assert kinds["mixed"] == {"iterations": 3, "mean_iter_s": pytest.approx(0.02), "mean_tokens": pytest.approx(250.0)}


def test_a_mixed_step_is_judged_among_mixed_steps_of_its_size_not_decode_ones():
    """A prompt chunk of 32 tokens costs more than 32 decode tokens: six such steps at 60 ms beside twenty decode
    steps at 10 ms are the mixed steps' typical cost, not one-off work."""
    from pwsim.fidelity import one_off_steps
    tokens, decode = np.full(26, 32), np.array([32] * 20 + [0] * 6)
    t = np.array([0.01] * 20 + [0.06] * 6)
    assert one_off_steps({"iter_s": t, "batch_tokens": tokens, "decode_tokens": decode})["steps"] == 0
    # a run whose steps took no time (a virtual clock) has no one-off share
    none = one_off_steps({"iter_s": np.zeros(3), "batch_tokens": np.full(3, 8), "decode_tokens": np.full(3, 8)})
    assert none == {"steps": 0, "excess_s": 0.0, "share": 0.0}


def test_no_throughput_without_one_off_steps_when_they_are_the_whole_makespan():
    tokens, decode = np.full(21, 8), np.full(21, 8)
    sim = _view([1], [0.1], [0.01], [1.0], np.full(21, 0.0078125), tokens)
    runtime = _view([1], [0.1], [0.01], [1.0], np.r_[np.full(20, 0.0078125), 2.0078125], tokens)
    for run in (sim, runtime):
        run.timeline["decode_tokens"] = decode
    runtime.summary["output_tokens"] = 100
    rep = compare(sim, runtime)
    assert rep["one_off_steps"]["runtime"]["excess_s"] == runtime.summary["makespan_s"] == 2.0
    assert rep["throughput_ratio_without_one_off"] is None  # nothing left of the makespan to divide by
    runtime.summary["makespan_s"] = 4.0  # half of it one-off work: 100 tokens in the 2 s left, 50 a second
    assert compare(sim, runtime)["throughput_ratio_without_one_off"] == pytest.approx(100.0 / 50.0)


def test_where_each_side_found_room_for_its_lower_luts():
    from pwsim.fidelity import lut_room_of
    old = RunView({}, {}, {})
    assert lut_room_of(old, True) == "pool" and lut_room_of(old, False) == "pool"  # results before session 38
    assert lut_room_of(RunView({}, {}, {}, {"lut_room": "slack"}), True) == "slack"
    assert lut_room_of(RunView({"lut_room": "slack"}, {}, {}), False) == "slack"  # as the replay's engine had it
    assert lut_room_of(RunView({}, {}, {}, {"server": {}}), False) is None  # a server that did not say
    assert lut_room_of(RunView({}, {}, {}, {"server": {}, "lut_room": "slack"}), False) == "slack"


def test_the_itl_ratios_are_of_the_medians_and_the_99th_percentiles():
    sim, runtime = _view([1], [0.1], [0.01], [1.0], [0.01], [1]), _view([1], [0.1], [0.01], [1.0], [0.01], [1])
    sim.summary["itl_s"] = {"mean": 0.01, "p50": 0.01, "p99": 0.03, "max": 0.5}
    runtime.summary["itl_s"] = {"mean": 0.02, "p50": 0.02, "p99": 0.06, "max": 0.1}
    rep = compare(sim, runtime)["itl"]
    assert rep["ratio_p50"] == pytest.approx(0.5) and rep["ratio_p99"] == pytest.approx(0.5)
    assert rep["sim"] == {"p50": 0.01, "p99": 0.03, "max": 0.5}


def test_fidelity_reads_each_side_s_settings_under_its_own_names():
    """The simulation's config names (`hybrid_kv`, its counters' `kv_resizes`) and the runtime's (`hybrid_kv_cache`, its
    summary's `kv_resizes`) each land on their side; the requests each side ran, paired or not; makespan sim/runtime."""
    sim = _view([1, 2, 3], [0.1] * 3, [0.01] * 3, [1.0] * 3, [0.01], [1])
    runtime = _view([1, 2], [0.1] * 2, [0.01] * 2, [1.0] * 2, [0.01], [1])
    sim = replace(sim, config={"request_rate": 40.0, "max_concurrency": 8, "hybrid_kv": False})
    runtime = replace(runtime, config={"request_rate": 20.0, "max_concurrency": 4, "hybrid_kv_cache": True})
    sim.summary.update(makespan_s=1.0, counters={"kv_resizes": 2})
    runtime.summary["kv_resizes"] = 5
    rep = compare(sim, runtime)
    assert rep["requests"] == {"sim": 3, "runtime": 2, "paired": 2} and rep["makespan_ratio"] == pytest.approx(0.5)
    assert rep["kv_resizes"] == {"sim": 2, "runtime": 5}
    assert rep["request_rate"] == {"sim": 40.0, "runtime": 20.0} and rep["max_concurrency"] == {"sim": 8, "runtime": 4}
    assert rep["scheduler"]["hybrid_kv_cache"] == {"sim": False, "runtime": True}


def test_a_ratio_to_a_runtime_value_of_zero_is_none():
    sim, runtime = _view([1], [0.1], [0.01], [1.0], [0.01], [1]), _view([1], [0.1], [0.01], [1.0], [0.01], [1], 0.0)
    assert compare(sim, runtime)["throughput_ratio"] is None  # a runtime result that served no token


def test_round_trips_are_compared_only_where_both_sides_wrote_a_plan_log():
    log = {"step": np.array([1, 5]), "block": np.array([3, 3]), "from_bits": np.array([8, 4]),
           "to_bits": np.array([4, 8]), "status": np.array(["started", "started"], dtype=object),
           "delta_bytes": np.array([100, -100]), "layer": np.zeros(2, int), "expert": np.array([1, 1]),
           "kind": np.zeros(2, int), "reason": np.array(["pressure", "reload"], dtype=object)}
    sim = replace(_view([1], [0.1], [0.01], [1.0], [0.01], [1]), plans=log)
    runtime = _view([1], [0.1], [0.01], [1.0], [0.01], [1])  # a replay from before the plan log
    assert compare(sim, runtime)["round_trips"] is None
    assert compare(sim, replace(runtime, plans=log))["round_trips"]["runtime"]["count"] == 1


def test_the_per_sequence_fit_needs_both_sides_to_tell_a_sequence_from_a_token():
    seqs, tokens = np.array([1, 4, 16, 32, 2, 33, 8]), np.array([1, 4, 16, 32, 400, 512, 8])
    sim = _view([1], [0.1], [0.01], [1.0], 400e-6 + 1e-6 * seqs + 2e-6 * tokens, tokens)
    decode = np.array([1, 4, 16, 32, 8])  # the runtime's decode steps alone: as many sequences as tokens
    runtime = _view([1], [0.1], [0.01], [1.0], 500e-6 + 25e-6 * decode, decode)
    sim.timeline["batch_seqs"], runtime.timeline["batch_seqs"] = seqs, decode
    assert compare(sim, runtime)["iterations"]["per_sequence"] is None


def test_three_planning_steps_tell_a_read_from_a_transition():
    from pwsim.fidelity import routing_read_cost
    read, moves = np.array([0, 1, 1]), np.array([0, 0, 5])
    rr = routing_read_cost({"routing_read": read, "plan_transitions": moves, "plan_s": (50 + 1500 * read + 200 * moves)
                            * 1e-6})
    assert rr["read_us"] == pytest.approx(1500.0) and rr["transition_us"] == pytest.approx(200.0)


def test_a_fitted_profile_charges_no_negative_host_cost():
    """A runtime faster than the simulation's profile moves its costs down to 0, never below; a fitted read that
    costs less than nothing is 0 too."""
    from pwsim.fidelity import plan_terms
    tokens = np.array([1, 1, 2, 2, 4, 4])
    sim = _view([1], [0.1], [0.01], [1.0], 0.003 + 1e-4 * tokens, tokens)
    runtime = _view([1], [0.1], [0.01], [1.0], 0.001 + 1e-4 * tokens, tokens)  # 2 ms an iteration faster
    # steps that read the routing statistics planned faster than those that did not
    runtime.timeline.update(plan_s=np.array([6e-4, 1e-4, 7e-4, 1e-4, 5e-4, 1e-4]), routing_read=np.array([0, 1] * 3))
    prof = replace(load_profile("h200-roofline"), iteration_overhead_us=500.0, routing_read_us=80.0)
    fit = fitted_profile(prof, compare(sim, runtime))
    assert fit.iteration_overhead_us == 0.0 and fit.routing_read_us == 0.0
    assert plan_terms({"read_us": -30.0, "transition_us": 200.0}) == (0.0, 200.0)


def test_a_fitted_profile_needs_iterations_of_two_sizes():
    sim = _view([1], [0.1], [0.01], [1.0], [0.001, 0.002], [8, 8])
    runtime = _view([1], [0.1], [0.01], [1.0], [0.003, 0.004], [8, 8])  # one size: an intercept, no token slope
    with pytest.raises(UserError, match="fewer than two iterations of different sizes"):
        fitted_profile(load_profile("h200-roofline"), compare(sim, runtime))


def _runs_under_pressure(tmp_path, field: str, costs: tuple[float, ...]) -> dict:
    """The large-model setup under pressure (pagedweight at 20 GiB), simulated with h200-measured's `field` at each
    of `costs`: SimResult by cost."""
    from pwsim.runner import SyntheticWorkload, build, make_config, run_simulation
    wl = SyntheticWorkload(requests=60, rate=50.0, burstiness=1.0, prompt="lognormal:512,0.5,16,2048",
                           output="lognormal:256,0.5,16,1024", features=True)
    runs = {}
    for cost in costs:
        path = replace(load_profile("h200-measured"), **{field: cost}).save(tmp_path / f"{field}{cost:.0f}.json")
        cfg = make_config("20GiB", policy="pagedweight", policy_params={}, workload=wl, seed=0, hardware=str(path),
                          model="Qwen1.5-MoE-A2.7B", calibration="synthetic", trace="synthetic", quality_fit=None)
        runs[cost] = run_simulation(build(cfg))
    return runs


def test_simulator_charges_each_routing_read_to_the_next_iteration(tmp_path):
    """Under pressure the planner reads the routing statistics at most boundaries; with routing_read_us each read
    adds that much host time, so the run takes longer by about reads x cost (the timing shifts decisions a little)."""
    runs = {cost: r.summary for cost, r in _runs_under_pressure(tmp_path, "routing_read_us", (0.0, 2000.0)).items()}
    reads = runs[0.0]["counters"].get("routing_reads", 0)
    assert reads > 10 and runs[2000.0]["counters"]["routing_reads"] > 10
    extra = runs[2000.0]["makespan_s"] - runs[0.0]["makespan_s"]
    assert 0.5 * reads * 2e-3 < extra < 2.0 * reads * 2e-3


def test_simulator_charges_each_plan_transition_and_records_them(tmp_path):
    """The timeline records the transitions each boundary's plan started (their sum is every transition started);
    with plan_transition_us each adds that much host time to the next iteration."""
    runs = _runs_under_pressure(tmp_path, "plan_transition_us", (0.0, 500.0))
    free = runs[0.0]
    moves = int(np.asarray(free.timeline["plan_transitions"]).sum())
    assert moves == sum(free.summary["plans"]["transitions_started"].values()) > 20
    extra = runs[500.0].summary["makespan_s"] - free.summary["makespan_s"]
    assert 0.5 * moves * 5e-4 < extra < 2.0 * moves * 5e-4
    # ... and each iteration the planning charged to it (`plan_s`: reads and moves begun), which fidelity's host fit
    # leaves out; a boundary whose next step stalls charges the stall instead
    costly = runs[500.0]
    charged = (np.asarray(costly.timeline["plan_transitions"]).sum() * 5e-4
               + costly.summary["counters"].get("routing_reads", 0) * load_profile("h200-measured").routing_read_us * 1e-6)
    assert 0.9 * charged <= np.asarray(costly.timeline["plan_s"]).sum() <= charged + 1e-9


def test_one_off_steps_are_those_far_above_their_kind_and_size():
    """A step 4x the median of its kind among steps of its size (and 20 ms more) is one-off work, counted with its
    excess over that median; a step of another size or kind is judged among its own; a uniform run has none."""
    from pwsim.fidelity import one_off_steps
    tokens = np.array([32] * 20 + [512] * 6 + [32, 512, 600])
    decode = np.array([32] * 20 + [0] * 6 + [32, 0, 0])
    t = np.array([0.010] * 20 + [0.030] * 6 + [0.500, 0.100, 0.400])
    r = one_off_steps({"iter_s": t, "batch_tokens": tokens, "decode_tokens": decode})
    assert r["steps"] == 2  # the 0.5 s decode step and the 0.4 s mixed one; the 0.1 s mixed step is under 4x
    assert r["excess_s"] == pytest.approx(0.49 + (0.4 - 0.03)) and r["share"] == pytest.approx(r["excess_s"] / t.sum())
    assert one_off_steps({"iter_s": np.full(9, 0.01), "batch_tokens": np.full(9, 8), "decode_tokens": np.full(9, 8)}
                         )["steps"] == 0
    assert one_off_steps({"iter_s": t, "batch_tokens": tokens}) is None  # an older timeline
    # 5x its median but 4 ms longer: a jitter, not one-off work
    short = np.array([0.001] * 20 + [0.005])
    assert one_off_steps({"iter_s": short, "batch_tokens": np.full(21, 8), "decode_tokens": np.full(21, 8)}
                         )["steps"] == 0


def _against_kv236(out_dir, capsys, *flags) -> tuple[str, dict]:
    """`pwsim run` of the bundled 236-block replay's settings with `flags`, then `pwsim fidelity` against that replay:
    what fidelity printed, and its report."""
    from pathlib import Path
    replay = Path(__file__).resolve().parents[1] / BUNDLED / "kv236-run1"
    assert sim_main(["run", "--policy", "pagedweight", "--budget", "24MiB", "--max-num-seqs", "32",
                     "--max-num-batched-tokens", "512", "--hardware", "h200-demo-runtime", "--no-plots", "--no-progress",
                     *flags, "--out", str(out_dir / "sim")]) == 0
    capsys.readouterr()
    assert sim_main(["fidelity", "--sim", str(out_dir / "sim"), "--runtime", str(replay), "--out",
                     str(out_dir / "fid")]) == 0
    return capsys.readouterr().out, json.loads((out_dir / "fid" / "fidelity.json").read_text())


def test_fidelity_notes_a_cold_replay_s_one_off_steps_and_another_lut_room(tmp_path, capsys):
    """Against a bundled replay without a warm-up (its offloads' LUTs in the pool, a fixed-size pool having no
    slack): the report counts the runtime's one-off steps and the throughput ratio without them, and notes that the
    simulation (the default `--lut-room slack`) found its LUTs' room elsewhere; simulated with `--lut-room pool`, it
    does not."""
    for room in ("slack", "pool"):
        out, report = _against_kv236(tmp_path / room, capsys, "--lut-room", room)
        assert report["lut_room"] == {"sim": room, "runtime": "pool"}
        assert ("found room for their lower LUTs in the pool, the simulation's in the slack" in out) == (room == "slack")
        one = report["one_off_steps"]["runtime"]
        assert one["steps"] > 5 and 0.2 < one["share"] < 0.6 and "the runtime's one-off steps" in out
        assert "--warmup-requests N" in out  # the replay had none
        assert report["throughput_ratio_without_one_off"] < report["throughput_ratio"]


def test_fidelity_notes_another_activation_reserve(tmp_path, capsys):
    """A bundled replay from before the activation reserve kept none; a simulation that keeps one is told its pool
    differs, and one that keeps none is not."""
    for reserve in ("0B", "1MiB"):
        out, report = _against_kv236(tmp_path / reserve, capsys, "--lut-room", "pool", "--activation-reserve", reserve)
        assert report["activation_reserve"] == {"sim": 0 if reserve == "0B" else 1 << 20, "runtime": 0}
        note = ("the runtime kept 0 B of its budget for a step's activations, graphs and buffers, the simulation "
                "1.00 MiB")
        assert (note in out) == (reserve == "1MiB")


def test_fidelity_refuses_runs_of_different_traces():
    a = _view([1, 2], [0.1, 0.1], [0.01, 0.01], [1, 1], [0.001, 0.002], [1, 2])
    b = _view([3, 4], [0.1, 0.1], [0.01, 0.01], [1, 1], [0.001, 0.002], [1, 2])
    with pytest.raises(UserError, match="share no request_id"):
        compare(a, b)


def _write_run(path, view, hardware="h200-roofline", **config):
    write_result_dir(path, {"requests": view.requests, "timeline": view.timeline},
                     {"summary": view.summary, "config": {"hardware": hardware, **config}})


def test_fidelity_cli_writes_report_plot_and_fitted_profile(tmp_path, capsys):
    tokens = np.array([1, 2, 4, 8])
    sim = _view([1, 2], [0.1, 0.2], [0.01, 0.02], [1, 2], 0.001 + 1e-4 * tokens, tokens)
    rt = _view([1, 2], [0.2, 0.4], [0.02, 0.04], [2, 4], 0.004 + 1e-4 * tokens, tokens)
    for run in (sim, rt):   # the first two iterations decode only, the others carry prompt tokens
        run.timeline["decode_tokens"] = np.array([1, 2, 1, 0])
    _write_run(tmp_path / "sim", sim)
    rt.summary["phase_ms"] = {"decode": {"schedule": 0.1, "forward": 2.5, "sample": 0.1, "observe": 0.3, "plan": 0.1}}
    _write_run(tmp_path / "rt", rt)
    out = tmp_path / "fid"
    rc = sim_main(["fidelity", "--sim", str(tmp_path / "sim"), "--runtime", str(tmp_path / "rt"), "--out", str(out),
                   "--fit-profile", str(tmp_path / "fit.json")])
    assert rc == 0
    text = capsys.readouterr().out
    assert "2 requests paired" in text and "median 0.50" in text
    assert "runtime decode iterations, mean ms: schedule 0.1, forward 2.5" in text
    assert "decode iterations: sim 2 of 1.15 ms (2 tokens), runtime 2 of 4.15 ms (2 tokens)" in text
    assert "mixed iterations: sim 2 of 1.6 ms (6 tokens), runtime 2 of 4.6 ms (6 tokens)" in text
    rep = json.loads((out / "fidelity.json").read_text())
    assert rep["runtime_phase_ms"]["decode"]["observe"] == 0.3
    assert rep["metrics"]["tpot_s"]["ratio_p50"] == pytest.approx(0.5)
    assert (out / "fidelity.png").stat().st_size > 10_000
    fit = load_profile(tmp_path / "fit.json")
    assert fit.iteration_overhead_us == pytest.approx(load_profile("h200-roofline").iteration_overhead_us + 3000.0)
    assert "with a per-sequence term: +3000 us an iteration, +0.0 us a sequence and +0.0 us a token" in text
    assert sim_main(["fidelity", "--sim", str(tmp_path / "sim"), "--runtime", str(tmp_path / "rt"), "--out", str(out),
                     "--fit-profile", str(tmp_path / "fit-seq.json"), "--fit-per-sequence"]) == 0
    assert "0.0 us a sequence" in capsys.readouterr().out
    assert load_profile(tmp_path / "fit-seq.json").iteration_overhead_us == pytest.approx(fit.iteration_overhead_us)
    assert sim_main(["fidelity", "--sim", str(tmp_path / "sim"), "--runtime", str(tmp_path / "rt"), "--out", str(out),
                     "--fit-per-sequence"]) == 2
    assert "give --fit-profile JSON too" in capsys.readouterr().err
    assert rep["async_scheduling"] == {"sim": False, "runtime": False} and "note:" not in text
    _write_run(tmp_path / "rt-async", rt, async_scheduling=True)   # a replay scheduled asynchronously
    assert sim_main(["fidelity", "--sim", str(tmp_path / "sim"), "--runtime", str(tmp_path / "rt-async"), "--out",
                     str(tmp_path / "fid2")]) == 0
    assert "note: the replay scheduled asynchronously and the simulation did not" in capsys.readouterr().out
    assert json.loads((tmp_path / "fid2" / "fidelity.json").read_text())["async_scheduling"]["runtime"] is True
    assert rep["instant_page_moves"] == {"sim": False, "runtime": None}  # the runtime's summary does not say
    assert rep["round_trips"] is None  # neither wrote a plan log
    cpu = replace(rt, summary={**rt.summary, "instant_page_moves": True})  # a CPU replay: its moves landed at once
    _write_run(tmp_path / "rt-cpu", cpu)
    _write_run(tmp_path / "sim-instant", sim, instant_page_moves=True)
    for name, note in (("sim", True), ("sim-instant", False)):
        assert sim_main(["fidelity", "--sim", str(tmp_path / name), "--runtime", str(tmp_path / "rt-cpu"), "--out",
                         str(tmp_path / "fid-cpu")]) == 0
        text = capsys.readouterr().out
        assert ("note: the replay's page moves landed at the boundary that began them and the simulation's did not"
                in text) == note and ("--instant-page-moves" in text) == note
    assert rep["warmup_requests"] == {"sim": 0, "runtime": 0}
    _write_run(tmp_path / "rt-warm", rt, warmup_requests=32)   # a replay that warmed up, a simulation that did not
    assert sim_main(["fidelity", "--sim", str(tmp_path / "sim"), "--runtime", str(tmp_path / "rt-warm"), "--out",
                     str(tmp_path / "fid3")]) == 0
    assert "note: the simulation warmed up on 0 requests and the replay on 32" in capsys.readouterr().out
    assert json.loads((tmp_path / "fid3" / "fidelity.json").read_text())["warmup_requests"] == {"sim": 0, "runtime": 32}
    assert rep["time_scale"] == {"sim": 1.0, "runtime": 1.0}
    _write_run(tmp_path / "rt-fast", rt, time_scale=0.5)   # a replay at twice the trace's rate
    assert sim_main(["fidelity", "--sim", str(tmp_path / "sim"), "--runtime", str(tmp_path / "rt-fast"), "--out",
                     str(tmp_path / "fid4")]) == 0
    assert "note: the simulation ran the trace at --time-scale 1 and the runtime at --time-scale 0.5" in \
        capsys.readouterr().out
    assert rep["max_concurrency"] == {"sim": None, "runtime": None}
    _write_run(tmp_path / "rt-users", rt, max_concurrency=8)   # a benchmark of 8 users, a simulation without them
    assert sim_main(["fidelity", "--sim", str(tmp_path / "sim"), "--runtime", str(tmp_path / "rt-users"), "--out",
                     str(tmp_path / "fid5")]) == 0
    assert ("note: the simulation ran the trace with no client limit and the runtime with at most 8 requests in "
            "flight" in capsys.readouterr().out)
    _write_run(tmp_path / "rt-rate", rt, request_rate=40.0)   # a replay re-timed at 40 requests a second
    assert sim_main(["fidelity", "--sim", str(tmp_path / "sim"), "--runtime", str(tmp_path / "rt-rate"), "--out",
                     str(tmp_path / "fid5b")]) == 0
    assert ("note: the simulation ran the trace at its recorded times and the runtime at 40 requests per second"
            in capsys.readouterr().out)
    assert rep["scheduler"]["max_num_seqs"] == {"sim": None, "runtime": None}  # neither recorded: nothing to check
    _write_run(tmp_path / "sim-32", sim, max_num_seqs=32, block_size=16, prefix_caching=False)
    _write_run(tmp_path / "rt-16", rt, max_num_seqs=16, block_size=16, enable_prefix_caching=False)
    assert sim_main(["fidelity", "--sim", str(tmp_path / "sim-32"), "--runtime", str(tmp_path / "rt-16"), "--out",
                     str(tmp_path / "fid6"), "--json"]) == 0
    rep6 = json.loads(capsys.readouterr().out)
    assert rep6["scheduler"]["max_num_seqs"] == {"sim": 32, "runtime": 16}
    assert rep6["scheduler"]["enable_prefix_caching"] == {"sim": False, "runtime": False}
    assert sim_main(["fidelity", "--sim", str(tmp_path / "sim-32"), "--runtime", str(tmp_path / "rt-16"), "--out",
                     str(tmp_path / "fid6")]) == 0
    text = capsys.readouterr().out
    assert "note: the scheduler limits differ (max_num_seqs 32 simulated, 16 on the runtime)" in text
    # a served run whose server said nothing of itself (another server): its settings unknown, not "synchronous"
    _write_run(tmp_path / "served", rt, target="serve", server=None, max_concurrency=8)
    assert sim_main(["fidelity", "--sim", str(tmp_path / "sim-32"), "--runtime", str(tmp_path / "served"), "--out",
                     str(tmp_path / "fid7")]) == 0
    text = capsys.readouterr().out
    assert "server did not say how it scheduled" in text and "scheduler limits differ" not in text
    assert "plans: not recorded simulated, not recorded on the runtime" in text
    # nor what it kept out of its KV pool (activations, graphs and buffers): unknown, not none
    assert json.loads((tmp_path / "fid7" / "fidelity.json").read_text())["activation_reserve"]["runtime"] is None


def test_fidelity_cli_bad_directory_exit_2(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert sim_main(["fidelity", "--sim", str(tmp_path / "empty"), "--runtime", str(tmp_path / "empty"),
                     "--out", str(tmp_path / "fid")]) == 2
    err = capsys.readouterr().err
    assert "not a result directory" in err and "Traceback" not in err
    assert not (tmp_path / "fid").exists()


def test_fidelity_cli_out_that_is_a_file_exit_2(tmp_path, capsys):
    from pathlib import Path
    runs = Path(__file__).resolve().parents[1] / BUNDLED
    out = tmp_path / "fid"
    out.write_text("keep me")
    assert sim_main(["fidelity", "--sim", str(runs / "kv980-run1"), "--runtime", str(runs / "kv980-run2"),
                     "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is a file; give a directory" in err[0], err
    assert out.read_text() == "keep me"


# ---------------------------------------------------------------- the bundled measurement


@pytest.mark.parametrize("budget, warm, cold", [
    ("48MiB", ("kv980-warmup32-run2", "kv980-warmup32-run3"), ("kv980-run1", "kv980-run2")),
    ("24MiB", ("kv236-warmup32", "kv236-warmup32-run2", "kv236-warmup32-run3"), ("kv236-run1", "kv236-run2"))])
def test_fitted_profile_predicts_the_measured_runtime(tmp_path, budget, warm, cold):
    """The simulator with the bundled fitted profile (h200-demo-runtime, fitted on kv980-warmup32) against the
    runtime's other replays of the demo trace on the H200 (session 26), each side warmed up as the other
    (`--warmup-requests 32` for the warmed-up replays, none for the cold ones). Warmed up: end-to-end latency, TPOT
    and throughput within the runtime's own spread (up to 30% between runs of one setting on two machines) at 980
    blocks; under pressure (24 MiB, 236 blocks) the simulator is slower (end to end 1.30-1.38x, TPOT 1.23-1.29x: the
    host costs were fitted on steps of 32 sequences, and the runtime's steps under pressure hold fewer and cost less),
    and both planners plan and read the routing statistics on as many steps (the runtime reads them only where it can
    plan, and the profile's routing_read_us, measured on kv236-warmup32, charges such a step: 6.8 ms). Cold replays
    also pay one-off costs (graph captures, first launches) the profile leaves out, so the simulator is faster than
    them; with the plain GPU profile it is 2.4-9x off end to end."""
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    args = ["run", "--policy", "pagedweight", "--budget", budget, "--max-num-seqs", "32", "--max-num-batched-tokens", "512",
            "--lut-room", "pool", "--no-plots"]  # the replays' offloads took their LUTs' room from the pool
    runs = {}
    for name, extra in (("fit", ["--hardware", "h200-demo-runtime"]), ("gpu", ["--hardware", "h200-measured"])):
        for warmup in (0, 32):
            out = tmp_path / f"{name}-{warmup}"
            assert sim_main([*args, *extra, "--warmup-requests", str(warmup), "--out", str(out)]) == 0
            runs[name, warmup] = RunView(*read_result_dir(out))
    for run in warm + cold:
        rt = RunView(*read_result_dir(root / BUNDLED / run))
        warmup = 32 if run in warm else 0
        assert rt.config["warmup_requests"] == warmup
        good, plain = compare(runs["fit", warmup], rt), compare(runs["gpu", warmup], rt)
        assert good["requests"]["paired"] == 96 and good["warmup_requests"] == {"sim": warmup, "runtime": warmup}
        # the same planner and scheduler on both sides: the pressure run plans and preempts on both, the other not
        plans, pre, reads = good["planner"]["plans"], good["planner"]["preemptions"], good["routing_reads"]
        if budget == "24MiB":
            assert plans["runtime"] > 0 and 0.8 <= plans["sim"] / plans["runtime"] <= 1.25, run
            assert pre["runtime"] > 0 and 0.8 <= pre["sim"] / pre["runtime"] <= 1.25, run
            assert reads["runtime"] > 10 and 0.8 <= reads["sim"] / reads["runtime"] <= 1.25, run
            assert reads["runtime"] <= plans["runtime"]  # a planner step reads them only where it can plan
        else:
            assert plans == {"sim": 0, "runtime": 0} and pre == {"sim": 0, "runtime": 0}
        e2e, tpot = good["metrics"]["e2e_s"]["ratio_p50"], good["metrics"]["tpot_s"]["ratio_p50"]
        if run in warm and budget == "48MiB":
            assert 0.75 <= e2e <= 1.35 and 0.75 <= tpot <= 1.35 and 0.75 <= good["throughput_ratio"] <= 1.35, run
        elif run in warm:  # under pressure: slower, never faster (without routing_read_us: 0.85-0.9x throughput)
            assert 1.0 <= e2e <= 1.5 and 1.0 <= tpot <= 1.45 and 0.7 <= good["throughput_ratio"] <= 1.0, run
        else:  # the one-off costs weigh more as the steady state gets faster (session 11's replays: 0.47-0.59,
            assert 0.25 <= e2e <= 0.85, run  # session 22's: 0.45-0.82; session 26's: 0.40-0.70)
        # the plain profile has the prefill MoE layer's fixed cost (prefill_layer_overhead_us) but not the
        # iteration's host costs: end to end 2.4-9x too fast, throughput 1.9-3.7x too high (session 26's replays)
        assert plain["metrics"]["e2e_s"]["ratio_p50"] < 0.45 and plain["throughput_ratio"] > 1.8, run


@pytest.mark.parametrize("budget, runs", [("48MiB", ("kv980-warmup32-run2", "kv980-warmup32-run3")),
                                          ("24MiB", ("kv236-warmup32-run2", "kv236-warmup32-run3",
                                                     "kv236-warmup32-run4"))])
def test_the_h100_profile_fitted_on_one_replay_predicts_the_others(tmp_path, budget, runs):
    """The same on an H100 (session 69, `traces/bundled/demo-replay-h100`): `h100-demo-runtime`, h100-measured with
    the host costs fitted on the first warmed-up replay of each pool, against the other warmed-up replays. At 980
    blocks end to end, TPOT and throughput within 15%; under pressure within 20% (the runtime's own runs there differ
    by 28% in throughput and 32-48 in plans), both sides planning and preempting; the plain GPU profile stays 2x or
    more off in throughput."""
    from pathlib import Path
    bundle = Path(__file__).resolve().parents[1] / "traces" / "bundled" / "demo-replay-h100"
    args = ["run", "--policy", "pagedweight", "--budget", budget, "--max-num-seqs", "32", "--max-num-batched-tokens", "512",
            "--lut-room", "pool", "--warmup-requests", "32", "--no-plots"]
    sims = {}
    for profile in ("h100-demo-runtime", "h100-measured"):
        assert sim_main([*args, "--hardware", profile, "--out", str(tmp_path / profile)]) == 0
        sims[profile] = RunView(*read_result_dir(tmp_path / profile))
    for run in runs:
        rt = RunView(*read_result_dir(bundle / run))
        good, plain = compare(sims["h100-demo-runtime"], rt), compare(sims["h100-measured"], rt)
        assert good["requests"]["paired"] == 96 and rt.config["warmup_requests"] == 32
        ratios = (good["metrics"]["e2e_s"]["ratio_p50"], good["metrics"]["tpot_s"]["ratio_p50"], good["throughput_ratio"])
        bound = 0.15 if budget == "48MiB" else 0.2
        assert all(abs(r - 1) <= bound for r in ratios), (run, ratios)
        plans, pre = good["planner"]["plans"], good["planner"]["preemptions"]
        if budget == "24MiB":
            assert plans["runtime"] > 0 and 0.6 <= plans["sim"] / plans["runtime"] <= 1.5, run
            assert pre["runtime"] > 0 and 0.8 <= pre["sim"] / pre["runtime"] <= 1.25, run
        else:
            assert plans == {"sim": 0, "runtime": 0} and pre == {"sim": 0, "runtime": 0}
        assert plain["throughput_ratio"] > 2.0, run


@pytest.mark.parametrize("replay, time_scale, min_plan_blocks", [("m2-ts4_mp128_a", "4.0", 128),
                                                                  ("m2-ts4_mp0_a", "4.0", 0)])
def test_a_profile_fitted_net_of_planning_predicts_its_replay(tmp_path, replay, time_scale, min_plan_blocks):
    """Session 33's H200 replays that record their plans' transitions (bundled, requests arriving over time): the
    simulator on `h200-demo-runtime-seq`, a profile fitted from the pair (`--fit-per-sequence`), then the simulator on
    it against the same replay. Fitted without either side's planning, throughput within 5% and end to end within
    10% here (on all eight such replays 1.00-1.09 and 0.87-1.04); fitted as before session 37, with the planning
    left in the host terms and charged again as reads and transitions, further off: 0.80 and 1.42, 0.86 and 1.34 on
    these two (on all eight 0.80-0.99 and 0.98-1.42; where a replay planned little, as close or closer)."""
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    runtime = RunView(*read_result_dir(root / "traces" / "bundled" / "demo-replay-h200-plans" / replay))
    args = ["run", "--policy", "pagedweight", "--policy-arg", f"min_plan_blocks={min_plan_blocks}", "--budget", "24MiB",
            "--max-num-seqs", "32", "--max-num-batched-tokens", "512", "--warmup-requests", "32", "--time-scale",
            time_scale, "--no-plots", "--no-progress"]

    def simulate(hardware: str, name: str) -> RunView:
        assert sim_main([*args, "--hardware", hardware, "--out", str(tmp_path / name)]) == 0
        return RunView(*read_result_dir(tmp_path / name))

    base = simulate("h200-demo-runtime-seq", "base")
    report = compare(base, runtime)
    assert report["iterations"]["net_of_planning"] and report["routing_reads"]["transition_us"] > 0
    raw_timeline = {k: v for k, v in base.timeline.items() if k != "plan_s"}
    ratios = {}
    for name, sim in (("net", base), ("raw", replace(base, timeline=raw_timeline))):
        fitted = fitted_profile(load_profile("h200-demo-runtime-seq"), compare(sim, runtime), per_sequence=True)
        again = compare(simulate(str(fitted.save(tmp_path / f"{name}.json")), f"sim-{name}"), runtime)
        ratios[name] = (again["throughput_ratio"], again["metrics"]["e2e_s"]["ratio_p50"])
    (net_tp, net_e2e), (raw_tp, raw_e2e) = ratios["net"], ratios["raw"]
    assert 0.95 <= net_tp <= 1.05 and 0.9 <= net_e2e <= 1.1, ratios
    assert abs(raw_tp - 1) >= abs(net_tp - 1) and abs(raw_e2e - 1) >= abs(net_e2e - 1), ratios


def test_a_request_s_queueing_delay_is_from_its_arrival_to_its_first_batch(ckpt):
    """One sequence at a time, every request at once: each waits for the one before it to finish, and queue_s (first
    batch - arrival, in requests.parquet and the summary) says how long; never more than its TTFT."""
    from pwruntime.engine import EngineConfig, LLMEngine
    from pwruntime.model import load_model
    from pwruntime.replay import replay

    ticks = iter(range(1_000_000))
    engine = LLMEngine(load_model(ckpt), EngineConfig(num_kv_blocks=64, block_size=4, max_num_seqs=1),
                       clock=lambda: next(ticks) * 1e-3)  # every reading of the clock a millisecond on
    r = replay(engine, _trace(), time_scale=0.0, sleep=lambda s: None).requests
    order = np.argsort(r["first_scheduled_s"])
    assert r["queue_s"][order[0]] < r["queue_s"][order[1]] < r["queue_s"][order[2]]
    assert all(r["first_scheduled_s"][b] >= r["finish_s"][a] for a, b in zip(order, order[1:]))
    assert np.all(r["queue_s"] <= r["ttft_s"]) and np.all(r["queue_s"] >= 0)


def test_the_plan_phase_counts_moves_a_transition_over_every_step_landings_included():
    """A transition lands at a later boundary, often a step that begins none: the planning steps' means leave that out,
    the costs a transition begun take every step's."""
    from pwruntime.replay import _plan_ms

    tl = {"plan_transitions": [4, 0, 0, 2, 0], "plan_s": [0.010, 0.003, 0.0, 0.006, 0.002],
          "plan_read_s": [0.002, 0.0, 0.0, 0.001, 0.0], "plan_moves_s": [0.004, 0.002, 0.0, 0.002, 0.001],
          "plan_kv_s": [0.001, 0.0005, 0.0, 0.001, 0.0]}
    plan = _plan_ms(tl)
    assert (plan["steps"], plan["transitions_per_step"], plan["moves"], plan["kv"]) == (2, 3.0, 3.0, 1.0)
    assert plan["per_transition_us"] == {"moves": 1500.0, "kv": 416.667}   # 9 ms and 2.5 ms over 6 transitions
    assert _plan_ms({**tl, "plan_transitions": [0] * 5}) is None
