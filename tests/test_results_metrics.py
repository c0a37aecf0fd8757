"""A run's request metrics on requests whose answers are known: `traces.results` (statistics, summary, SLO
attainment) and `traces.sweep` (a sweep's rows and table)."""
from __future__ import annotations

import numpy as np
import pytest

from traces.clikit import UserError
from traces.results import (RESULT_MARKER, instant_page_moves, latency_columns, prepare_trace_dir, request_columns,
                             request_summary, result_tool, slo_attainment, slo_bounds, stats, write_result_dir)
from traces.sweep import sweep_row, table


def _requests():
    """Four requests over 3 s: two cut at their length, one stopped by EOS, one given a first token and never
    finished."""
    nan = float("nan")
    return request_columns([1, 2, 3, 4], ["a"] * 4, [0.0, 0.0, 1.0, 2.0], [10, 20, 30, 40], [3, 5, 2, 1],
                           [0.5, 1.0, 1.5, 2.2], [1.5, 3.0, 2.5, nan], [0] * 4, ["length", "stop", "length", ""])


def test_stats_are_the_percentiles_of_the_finite_values():
    s = stats(np.r_[np.arange(1.0, 101.0), np.nan, np.inf])
    assert s["p50"] == pytest.approx(50.5) and s["p90"] == pytest.approx(90.1) and s["p95"] == pytest.approx(95.05)
    assert s["p99"] == pytest.approx(99.01) and s["max"] == 100.0 and s["mean"] == pytest.approx(50.5)
    assert stats([np.nan])["p99"] is None


def test_the_summary_counts_eos_stops_as_completed_and_a_first_token_without_a_finish_as_unfinished():
    r = _requests()
    np.testing.assert_allclose(r["tpot_s"], [0.5, 0.5, 1.0, np.nan])   # (finish - first) / (tokens - 1)
    s = request_summary(r)
    assert s["completed"] == 3 and s["unfinished"] == 1 and s["finish_reasons"] == {"length": 2, "stop": 1, "": 1}
    assert s["makespan_s"] == 3.0 and s["output_tokens"] == 11
    assert s["throughput_tokens_per_s"] == pytest.approx(11 / 3)
    assert s["total_tokens_per_s"] == pytest.approx((100 + 11) / 3)      # prompt and output tokens
    assert s["requests_per_s"] == pytest.approx(3 / 3)                    # completed ones only


def test_a_request_exactly_at_an_slo_bound_meets_it():
    r = _requests()   # TTFT 0.5, 1.0, 0.5 and 0.2 (unfinished: never met)
    at = slo_attainment(r, ttft_s=1.0, tpot_s=None)
    assert at["met"] == 3 and at["attainment"] == pytest.approx(0.75) and at["goodput_rps"] == pytest.approx(1.0)
    assert slo_attainment(r, ttft_s=0.999, tpot_s=0.5)["met"] == 1      # request 1: TTFT 0.5, TPOT 0.5


def test_one_output_token_has_no_tpot_and_a_run_that_finished_nothing_has_no_makespan():
    cols = latency_columns([0.0, 0.0], [1.0, 1.0], [2.0, 3.0], [1, 2])
    assert np.isnan(cols["tpot_s"][0]) and cols["tpot_s"][1] == 2.0
    nan = float("nan")
    idle = request_summary(request_columns([1, 2], ["a"] * 2, [1.0, 2.0], [10, 10], [0, 0], [nan, nan], [nan, nan],
                                           [0, 0], ["", ""]))
    assert idle["makespan_s"] == 0.0 and idle["unfinished"] == 2 and idle["throughput_tokens_per_s"] == 0.0


@pytest.mark.parametrize("ttft, tpot", [(0.0, None), (float("inf"), None), (None, 0.0), (None, -5.0)])
def test_an_slo_bound_must_be_a_positive_finite_number(ttft, tpot):
    from argparse import Namespace
    with pytest.raises(UserError, match="must be a number > 0"):
        slo_bounds(Namespace(slo_ttft=ttft, slo_tpot=tpot))
    assert slo_bounds(Namespace(slo_ttft=None, slo_tpot=None)) is None
    assert slo_bounds(Namespace(slo_ttft=None, slo_tpot=50.0)) == (None, 0.05)


@pytest.mark.parametrize("config, tool", [({"command": "replay"}, "replay"),
                                          ({"command": "bench", "target": "serve"}, "bench serve"),
                                          ({"command": "bench", "target": "kernels"}, None),
                                          ({"command": "run", "target": "serve"}, None),
                                          ({"budget_bytes": 1}, "pwsim"), ([1, 2], None)])
def test_a_result_directory_is_told_by_its_config(tmp_path, config, tool):
    import json
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert result_tool(tmp_path) == tool


def test_a_sweep_row_and_its_table_in_the_units_they_name():
    s = request_summary(_requests())
    row = sweep_row(4, s)
    assert row["ttft_p99_s"] == s["ttft_s"]["p99"] != s["ttft_s"]["p90"]
    assert row["failed"] == 1                      # a simulated level: the requests not completed
    assert sweep_row(4, {**s, "failed": 0})["failed"] == 0   # a served one: what its client counted
    text = table([row])
    assert f"{s['ttft_s']['p50'] * 1e3:.2f}" in text and f"{s['tpot_s']['p99'] * 1e3:.2f}" in text
    assert "ms" in text.splitlines()[0]


def test_concurrency_levels_must_be_distinct():
    from traces.clikit import UserError
    from traces.sweep import parse_levels
    assert parse_levels("1,4,16") == [1, 4, 16] and parse_levels(None) == [None]
    with pytest.raises(UserError, match="distinct"):
        parse_levels("4,4")


def test_a_result_goes_into_a_new_nested_folder_and_not_over_a_stranger_without_force(tmp_path):
    out = write_result_dir(tmp_path / "a" / "b" / "run", {"requests": {"request_id": np.arange(2)}},
                           {"summary": {"requests": 2}})
    assert (out / "requests.parquet").is_file()
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match="not empty"):
        write_result_dir(busy, {}, {"summary": {}})
    assert [p.name for p in busy.iterdir()] == ["notes.txt"]


def test_a_trace_folder_is_written_fresh_or_over_anything_with_force_but_never_over_a_run(tmp_path):
    assert prepare_trace_dir(tmp_path / "new", force=False) == tmp_path / "new"
    full = tmp_path / "full"
    full.mkdir()
    (full / "x.txt").write_text("x")
    with pytest.raises(UserError, match="is not empty"):
        prepare_trace_dir(full, force=False)
    assert prepare_trace_dir(full, force=True) == full
    (full / RESULT_MARKER).write_text("{}")
    with pytest.raises(UserError, match="result directory"):
        prepare_trace_dir(full, force=True)


def test_whether_a_runtime_result_moved_pages_instantly():
    """A replay's summary says so; an older one did when it ran on the CPU; a served run does not say."""
    assert instant_page_moves({"instant_page_moves": False, "device": "cpu"}) is False
    assert (instant_page_moves({"device": "cpu"}), instant_page_moves({"device": "cuda"})) == (True, False)
    assert instant_page_moves({}) is None
