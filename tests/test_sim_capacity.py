"""`pwsim capacity` and pwsim.capacity: the search, the SLO, the arrival time scale it runs on, the command end to end
and under misuse; the SLO attainment `run` and `compare` report (traces.results.slo_attainment)."""
from __future__ import annotations

import json
import math
from dataclasses import replace

import numpy as np
import pytest

from pwsim.capacity import SLO, LoadPoint, base_rate_rps, search
from pwsim.cli import main
from pwsim.runner import RunConfig, build_workload, execute, make_config
from traces.clikit import UserError

# the bundled demo model, trace and calibration at 32 MiB (a run takes a fraction of a second); a narrow search
DEMO = ["--budgets", "32MiB", "--slo-ttft", "0.05", "--min-rate", "0.5", "--max-rate", "4", "--tolerance", "0.2"]


def _point(m: float, met: bool) -> LoadPoint:
    return LoadPoint(m, 10.0 * m, met, "" if met else "over", 0.01, 0.001, 100.0, 5, 5, 1.0 if met else 0.5)


@pytest.mark.parametrize("threshold", [0.3, 3.3, 7.9, 63.0])
def test_search_brackets_the_highest_multiplier_that_meets(threshold):
    """Doubling from the lowest multiplier, then geometric bisection: the capacity met, the next point above missed,
    within the tolerance; each multiplier run once, the points in order."""
    calls = []

    def run(m):
        calls.append(m)
        return _point(m, m <= threshold)

    cap = search(run, 0.25, 64.0, 0.05)
    assert cap.multiplier <= threshold < cap.missed_at and cap.missed_at / cap.multiplier <= 1.05
    assert [p.multiplier for p in cap.points] == sorted(set(calls)) == sorted(calls)
    assert cap.at_capacity.met and cap.note == "" and len(calls) <= 16
    assert cap.to_json()["rate_rps"] == pytest.approx(10.0 * cap.multiplier)


def test_search_reports_a_floor_missed_and_a_ceiling_met():
    never = search(lambda m: _point(m, False), 0.5, 8.0, 0.1)
    assert never.multiplier is None and never.missed_at == 0.5 and len(never.points) == 1
    assert never.at_capacity is None and "lowest" in never.note and never.to_json()["rate_rps"] is None
    always = search(lambda m: _point(m, True), 0.5, 8.0, 0.1)
    assert always.multiplier == 8.0 and always.missed_at is None and "ceiling" in always.note
    assert [p.multiplier for p in always.points] == [0.5, 1.0, 2.0, 4.0, 8.0]
    capped = search(lambda m: _point(m, True), 0.5, 6.0, 0.1)   # the ceiling is no power of two times the floor
    assert [p.multiplier for p in capped.points] == [0.5, 1.0, 2.0, 4.0, 6.0] and capped.multiplier == 6.0
    with pytest.raises(ValueError, match="lowest < highest"):
        search(lambda m: _point(m, True), 2.0, 2.0, 0.1)
    with pytest.raises(ValueError, match="tolerance"):
        search(lambda m: _point(m, True), 1.0, 2.0, 0.0)


def test_slo_reads_its_percentile_and_needs_every_request_done():
    summary = {"requests": 4, "completed": 4, "ttft_s": {"p50": 0.01, "p90": 0.04, "p99": 0.09},
               "tpot_s": {"p50": 0.001, "p90": 0.002, "p99": 0.004}}
    assert SLO(ttft_s=0.05, percentile=90).check(summary) == (True, "")
    met, why = SLO(ttft_s=0.05).check(summary)
    assert not met and why == "TTFT p99 90 ms > 50 ms"
    assert SLO(tpot_s=0.003, percentile=90).check(summary)[0]
    assert SLO(tpot_s=0.003).check(summary) == (False, "TPOT p99 4 ms > 3 ms")
    assert SLO(ttft_s=1.0).check({**summary, "completed": 3}) == (False, "1 requests did not complete")
    # with an attainment, the share of requests within both bounds decides (unfinished ones count against it)
    by_share = SLO(ttft_s=0.05, attainment=0.9)
    assert by_share.check({**summary, "completed": 3}, 0.95) == (True, "")
    assert by_share.check(summary, 0.85) == (False, "85.0% of requests within the bounds < 90%")
    assert not by_share.check(summary, None)[0]
    assert SLO(ttft_s=0.05, attainment=1.0).check(summary, 1.0) == (True, "")   # every request: met
    assert SLO(ttft_s=0.09).check(summary) == (True, "")                          # at the bound: met
    for kw, msg in ((dict(), "needs a TTFT or a TPOT"), (dict(ttft_s=0.0), "must be a number > 0"),
                    (dict(tpot_s=float("nan")), "must be a number > 0"), (dict(ttft_s=1.0, percentile=95), "one of"),
                    (dict(ttft_s=1.0, attainment=0.0), "attainment must lie in"),
                    (dict(ttft_s=1.0, attainment=1.5), "attainment must lie in")):
        with pytest.raises(ValueError, match=msg):
            SLO(**kw)


def test_request_rate_re_times_a_trace_as_replay_and_bench_serve_do(tmp_path, capsys):
    """`--request-rate R` in the simulator sends the trace's requests at the times `pwruntime replay` and `bench
    serve` send them with the same rate and seed; it needs a recorded trace, and excludes --time-scale and a
    capacity search."""
    from pwruntime.cmd_replay import _requests
    cfg = make_config("32MiB")  # the bundled demo trace
    fast = build_workload(replace(cfg, request_rate=40.0, seed=5))
    assert fast.description["request_rate"] == 40.0
    base = build_workload(cfg)
    assert np.array_equal(fast.requests.prompt_tokens, base.requests.prompt_tokens)
    served = _requests(cfg.trace, None, 40.0, 1.0, 5)
    assert np.allclose(np.sort(fast.requests.arrival_s), np.sort(served.arrival_s))
    assert len(fast.requests.arrival_s) / fast.requests.arrival_s.max() == pytest.approx(40.0, rel=0.35)
    with pytest.raises(UserError, match="not both"):
        replace(cfg, request_rate=40.0, time_scale=0.5)
    with pytest.raises(UserError, match="a synthetic trace's rate is --rate"):
        replace(cfg, request_rate=40.0, trace="synthetic")
    with pytest.raises(UserError, match="--request-rate must be"):
        replace(cfg, request_rate=-1.0)
    assert main(["capacity", *DEMO, "--request-rate", "10", "--out", str(tmp_path / "cap")]) == 2
    assert "a capacity search sets the arrival rate itself" in capsys.readouterr().err


def test_time_scale_moves_only_the_arrivals():
    cfg = make_config("32MiB")
    base, fast = build_workload(cfg), build_workload(replace(cfg, time_scale=0.5))
    assert np.allclose(fast.requests.arrival_s, base.requests.arrival_s * 0.5)
    assert np.array_equal(fast.requests.prompt_tokens, base.requests.prompt_tokens)
    assert fast.description["time_scale"] == 0.5
    assert RunConfig.from_json(replace(cfg, time_scale=0.5).to_json()).time_scale == 0.5
    arrivals = base.requests.arrival_s
    assert base_rate_rps(cfg) == pytest.approx((len(arrivals) - 1) / (arrivals.max() - arrivals.min()))
    with pytest.raises(UserError, match="--time-scale must be a number >= 0"):
        replace(cfg, time_scale=-1.0)
    at_once = execute(replace(cfg, time_scale=0.0))  # every request at 0 s (bench serve's --time-scale 0)
    assert build_workload(replace(cfg, time_scale=0.0)).requests.arrival_s.max() == 0.0
    assert at_once.summary["completed"] == len(arrivals)
    # twice the rate queues requests longer behind each other
    assert execute(replace(cfg, time_scale=0.25)).summary["ttft_s"]["p99"] > execute(cfg).summary["ttft_s"]["p99"]


def test_capacity_command_end_to_end(tmp_path, capsys):
    """Per policy, a capacity whose point met and whose next point missed; pagedweight serves a higher rate than fp16
    at 32 MiB (fp16's weights leave the KV cache little room); `pwsim run --time-scale 1/m` at the capacity repeats
    the reported TTFT; the files are written, and one or two jobs give the same result."""
    out = tmp_path / "cap"
    assert main(["capacity", "--policies", "fp16,pagedweight", "--jobs", "2", "--out", str(out), *DEMO]) == 0
    text = capsys.readouterr().out
    assert "capacity (x trace rate)" in text and "reproduce: pwsim capacity --policies fp16,pagedweight" in text
    for name in ("capacity.json", "capacity.csv", "capacity.png"):
        assert (out / name).is_file(), name
    report = json.loads((out / "capacity.json").read_text())
    caps = {s["policy"]: s for s in report["searches"]}
    assert [s["budget"] for s in report["searches"]] == ["32MiB", "32MiB"] and len(report["at_capacity"]) == 2
    for name, res in caps.items():
        points = {p["multiplier"]: p for p in res["points"]}
        assert points[res["multiplier"]]["met"] and not points[res["missed_at_multiplier"]]["met"]
        assert res["missed_at_multiplier"] / res["multiplier"] <= 1.2
        assert points[res["multiplier"]]["ttft_s"] <= 0.05 < points[res["missed_at_multiplier"]]["ttft_s"]
    assert caps["pagedweight"]["multiplier"] > caps["fp16"]["multiplier"]
    m = caps["pagedweight"]["multiplier"]
    run_out = tmp_path / "run"
    assert main(["run", "--policy", "pagedweight", "--budget", "32MiB", "--time-scale", repr(1 / m), "--no-plots",
                 "--json", "--out", str(run_out)]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["ttft_s"]["p99"] == pytest.approx(caps["pagedweight"]["points"][
        [p["multiplier"] for p in caps["pagedweight"]["points"]].index(m)]["ttft_s"], rel=1e-9)
    csv_lines = (out / "capacity.csv").read_text().splitlines()
    assert csv_lines[0].startswith("policy,budget,multiplier,rate_rps,met")
    assert len(csv_lines) == 1 + sum(len(r["points"]) for r in caps.values())
    one = tmp_path / "one"
    assert main(["capacity", "--policies", "fp16,pagedweight", "--jobs", "1", "--json", "--no-progress",
                 "--out", str(one), *DEMO]) == 0
    assert json.loads(capsys.readouterr().out)["searches"] == report["searches"]
    assert math.isfinite(report["wall_s"])
    assert report["slo"] == {"ttft_s": 0.05, "tpot_s": None, "percentile": 99, "attainment": None}
    # by attainment (90% of requests within 50 ms): a looser SLO than every request's p99, so no lower a capacity
    share = tmp_path / "share"
    assert main(["capacity", "--policies", "pagedweight", "--attainment", "0.9", "--jobs", "1", "--no-progress",
                 "--out", str(share), *DEMO]) == 0
    capsys.readouterr()
    res = json.loads((share / "capacity.json").read_text())["searches"][0]
    points = {p["multiplier"]: p for p in res["points"]}
    assert points[res["multiplier"]]["attained"] >= 0.9 > points[res["missed_at_multiplier"]]["attained"]
    assert res["multiplier"] >= caps["pagedweight"]["multiplier"]


def test_capacity_sweeps_a_planner_parameter(tmp_path, capsys):
    """`--sweep`: a search per value, labelled with it, each the search `--policy-arg` gives; the reproduce line
    carries the sweep."""
    argv = ["capacity", "--policies", "pagedweight", "--jobs", "1", "--no-progress", *DEMO]
    assert main([*argv, "--sweep", "min_plan_blocks=0,16", "--out", str(tmp_path / "sweep")]) == 0
    line = capsys.readouterr().out.splitlines()[-1]
    assert line.startswith("reproduce: pwsim capacity --policies pagedweight ")
    assert all(f" {flag} " in line for flag in ("--sweep min_plan_blocks=0,16", "--budgets 32MiB", "--min-rate 0.5"))
    searches = json.loads((tmp_path / "sweep" / "capacity.json").read_text())["searches"]
    assert [s["policy"] for s in searches] == ["pagedweight,min_plan_blocks=0", "pagedweight,min_plan_blocks=16"]
    assert main([*argv, "--policy-arg", "min_plan_blocks=16", "--out", str(tmp_path / "one")]) == 0
    capsys.readouterr()
    (one,) = json.loads((tmp_path / "one" / "capacity.json").read_text())["searches"]
    assert one == searches[1]


@pytest.mark.parametrize("argv, needle", [
    (["--budgets", "32MiB"], "needs a TTFT or a TPOT bound"),
    (["--slo-ttft", "1", "--budgets", "24MiB,32MiB", "--curve-budget", "48MiB"], "--curve-budget 48MiB is not one of"),
    (["--slo-ttft", "-1"], "the TTFT bound must be a number > 0"),
    (["--slo-ttft", "1", "--min-rate", "4", "--max-rate", "2"], "--min-rate and --max-rate must satisfy"),
    (["--slo-ttft", "1", "--tolerance", "0"], "--tolerance must lie in (0, 1]"),
    (["--slo-ttft", "1", "--time-scale", "0.5"], "a capacity search sets the arrival rate itself"),
    (["--slo-ttft", "1", "--percentile", "95"], "the percentile must be one of (50, 90, 99), got 95"),
    (["--slo-ttft", "1", "--attainment", "2"], "the attainment must lie in (0, 1], got 2.0"),
    (["--slo-ttft", "1", "--jobs", "0"], "--jobs must be at least 1, got 0"),
    (["--slo-ttft", "1", "--policies", "nope"], "nope"),
    (["--slo-ttft", "1", "--budgets", "lots"], "lots"),
])
def test_capacity_misuse_is_one_line_and_writes_nothing(tmp_path, capsys, argv, needle):
    out = tmp_path / "cap"
    rc = main(["capacity", "--out", str(out), *argv])
    _, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2 and len(lines) == 1 and "error:" in lines[0] and needle in lines[0], err
    assert "Traceback" not in err and not out.exists()


def test_slo_attainment_counts_completed_requests_within_both_bounds():
    """A request meets the SLO when it completed, its TTFT is within the bound and its TPOT too (a one-token output
    has no TPOT); goodput is the met requests over the makespan."""
    from traces.results import request_columns, slo_attainment
    req = request_columns([1, 2, 3, 4], ["d"] * 4, [0.0, 0.0, 1.0, 1.0], [8, 8, 8, 8], [5, 1, 5, 5],
                          [0.01, 0.5, 1.02, float("nan")], [0.05, 0.5, 1.5, float("nan")], [0, 0, 0, 0],
                          ["length", "stop", "length", "abort"])
    got = slo_attainment(req, 0.1, 0.02)
    # 1: TTFT 10 ms, TPOT 10 ms -> met; 2: one token, TTFT 500 ms -> missed; 3: TPOT 120 ms -> missed; 4: aborted
    assert (got["met"], got["requests"], got["attainment"]) == (1, 4, 0.25)
    assert got["goodput_rps"] == pytest.approx(1 / 1.5)
    assert slo_attainment(req, 1.0, None)["met"] == 3 and slo_attainment(req, None, 0.02)["met"] == 2


def test_run_and_compare_report_slo_attainment(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["run", "--budget", "32MiB", "--slo-ttft", "0.005", "--slo-tpot", "1", "--no-plots", "--json",
                 "--out", str(out)]) == 0
    slo = json.loads(capsys.readouterr().out)["slo"]
    assert slo["requests"] == 96 and 0 < slo["attainment"] <= 1 and slo["tpot_s"] == 0.001
    assert json.loads((out / "summary.json").read_text())["slo"] == slo
    # the printed table without SLO flags has no SLO column (the quickstart's `pwsim compare`), and with them has one
    assert main(["compare", "--policies", "fp16,pagedweight", "--budgets", "24MiB,48MiB", "--jobs", "1",
                 "--no-progress", "--out", str(tmp_path / "plain")]) == 0
    text = capsys.readouterr().out
    assert any(line.split()[:2] == ["pagedweight", "48MiB"] for line in text.splitlines()) and "SLO met %" not in text
    assert main(["compare", "--policies", "fp16,pagedweight", "--budgets", "24MiB", "--slo-ttft", "0.05", "--jobs", "1",
                 "--no-progress", "--out", str(tmp_path / "cmp")]) == 0
    text = capsys.readouterr().out
    assert "SLO met %" in text
    rows = {r["policy"]: r for r in json.loads((tmp_path / "cmp" / "compare.json").read_text())["rows"]}
    assert rows["pagedweight"]["slo_attainment"] > rows["fp16"]["slo_attainment"]
    assert "slo_attainment" in (tmp_path / "cmp" / "compare.csv").read_text().splitlines()[0]
    assert main(["run", "--slo-ttft", "0", "--out", str(tmp_path / "bad")]) == 2
    assert "--slo-ttft must be a number > 0" in capsys.readouterr().err


def test_the_capacity_table_shows_the_point_at_capacity_and_a_tolerance_of_one_is_allowed():
    import argparse
    from pwsim.cmd_capacity import _check_search, table
    point = lambda m, ttft, tok, met: dict(multiplier=m, rate_rps=10.0 * m, ttft_s=ttft, tpot_s=0.001,  # noqa: E731
                                          attained=1.0 if met else 0.5, throughput_tok_s=tok, met=met)
    search_ = {"policy": "p", "budget": "32MiB", "multiplier": 1.0, "note": "",
               "points": [point(1.0, 0.02, 500.0, True), point(2.0, 0.09, 900.0, False)]}
    row = table([search_], SLO(ttft_s=0.05)).splitlines()[1].split()
    assert row[2:5] == ["1", "10", "20"] and "500" in row and "900" not in row   # the capacity's point, not the last
    _check_search(argparse.Namespace(min_rate=0.5, max_rate=4.0, tolerance=1.0, time_scale=1.0, request_rate=None))


def test_request_rate_refuses_a_rate_or_burstiness_of_zero_and_any_other_time_scale():
    cfg = make_config("32MiB")
    for kw in ({"request_rate": 0.0}, {"request_rate": 40.0, "request_burstiness": 0.0}):
        with pytest.raises(UserError, match="--request-rate must be"):
            replace(cfg, **kw)
    with pytest.raises(UserError, match="not both"):
        replace(cfg, request_rate=40.0, time_scale=2.0)  # a slower time scale too, not only a faster one


def test_request_burstiness_shapes_the_re_timed_gaps_as_the_runtime_s():
    from pwruntime.cmd_replay import _requests
    cfg = replace(make_config("32MiB"), request_rate=40.0, request_burstiness=3.0, seed=5)
    bursty = build_workload(cfg)
    assert bursty.description["burstiness"] == 3.0
    served = _requests(cfg.trace, None, 40.0, 3.0, 5)
    assert np.allclose(np.sort(bursty.requests.arrival_s), np.sort(served.arrival_s))
