"""`pwsim plan-log`: a plan log's summary (moves, bytes, reasons, refusals, round trips) and its command."""
from __future__ import annotations

import json

import numpy as np
import pytest

from policies.plan_log import COLUMNS
from pwsim.cli import main
from pwsim.plan_stats import summarize


def _log(rows: list[tuple]) -> dict[str, np.ndarray]:
    """Plan-log columns from (step, block, layer, expert, kind, from, to, delta, status, reason) rows."""
    full = [(step, 0.001 * step, block, layer, expert, kind, fb, tb, delta, status, reason)
            for step, block, layer, expert, kind, fb, tb, delta, status, reason in rows]
    return {name: np.array(col, dtype=object if name in ("status", "reason") else None)
            for name, col in zip(COLUMNS, zip(*full))}


def test_a_summary_counts_moves_bytes_reasons_and_round_trips():
    log = _log([
        (10, 3, 0, 1, 1, 8, 4, 400, "started", "offload stage 0: 800 of 700 bytes"),
        (10, 5, 1, 2, 0, 8, 4, 500, "started", "offload stage 0: 800 of 700 bytes"),
        (10, 7, 1, 3, 0, 4, 3, 0, "rejected", "no room for the lower bitwidth's LUT"),
        (11, 3, 0, 1, 1, 8, 4, 400, "landed", ""),
        (11, 5, 1, 2, 0, 8, 4, 500, "landed", ""),
        (40, 3, 0, 1, 1, 4, 6, -250, "started", "reload: 250 of 260 bytes, recovers 2.5"),  # undoes step 10's
        (41, 3, 0, 1, 1, 4, 6, -250, "landed", ""),
        (50, 3, 0, 1, 1, 6, 8, -150, "started", "reload: 150 of 160 bytes, recovers 1.0"),  # no offload before it
        (50, 9, 2, 4, 1, 5, 6, -100, "started", "reload: 100 of 100 bytes, recovers 0.5"),  # begun before the log
    ])
    s = summarize(log)
    assert s["transitions"] == {"started": 5, "rejected": 1, "landed": 3}
    assert (s["offloads"], s["reloads"], s["freed_bytes"], s["taken_bytes"]) == (2, 3, 900, 500)
    assert s["planning_steps"] == 3
    assert s["by_layer"] == {0: {"offloads": 1, "reloads": 2}, 1: {"offloads": 1, "reloads": 0},
                             2: {"offloads": 0, "reloads": 1}}
    assert s["by_kind"] == {"gate_up": {"offloads": 1, "reloads": 0}, "down": {"offloads": 1, "reloads": 3}}
    assert s["plan_reasons"] == {"reload": 3, "offload stage 0": 2}
    assert s["refusals"] == {"no room for the lower bitwidth's LUT": 1}
    assert s["most_moved"][0] == {"block": 3, "layer": 0, "expert": 1, "kind": "down", "transitions": 3}
    assert s["round_trips"] == {"count": 1, "blocks": 1, "taken_bytes": 250, "share_of_taken_bytes": 0.5,
                                "steps_apart_p50": 30.0, "steps_apart_min": 30}
    empty = summarize(_log([(5, 1, 0, 0, 0, 4, 3, 0, "rejected", "no room")]))
    assert empty["round_trips"]["count"] == 0 and empty["round_trips"]["share_of_taken_bytes"] is None


def test_plan_log_command_on_two_runs(tmp_path, capsys):
    """On the bundled default at 24 MiB the template planner lowers and raises the same blocks far more often than
    PagedWeight: its round trips take a larger share of its reloads; text, JSON and the plot say so."""
    runs = {}
    for name, policy in (("pw", "pagedweight"), ("cold", "policies/examples/coldest_first.py:ColdestFirst")):
        runs[name] = tmp_path / name
        assert main(["run", "--policy", policy, "--budget", "24MiB", "--no-plots", "--no-progress", "--json",
                     "--out", str(runs[name])]) == 0
    capsys.readouterr()
    plot = tmp_path / "figs" / "plans.png"
    assert main(["plan-log", str(runs["pw"]), str(runs["cold"]), "--label", "pagedweight", "--label", "coldest",
                 "--plot", str(plot)]) == 0
    text = capsys.readouterr().out
    assert text.startswith("pagedweight: ") and "\ncoldest: " in text and "round trips" in text
    assert plot.stat().st_size > 10_000
    assert main(["plan-log", str(runs["pw"]), str(runs["cold"]), "--json"]) == 0
    pw, cold = json.loads(capsys.readouterr().out)
    summary = json.loads((runs["pw"] / "summary.json").read_text())
    assert pw["transitions"]["started"] == sum(summary["plans"]["transitions_started"].values())
    assert summary["plans"]["round_trips"] == pw["round_trips"]  # the run's own summary counts them too
    share = lambda s: s["round_trips"]["share_of_taken_bytes"]  # noqa: E731
    assert cold["round_trips"]["count"] > 2 * pw["round_trips"]["count"] and share(cold) > share(pw)


@pytest.mark.parametrize("argv, needle", [
    (["plan-log", "RUNLESS"], "holds no plan log"),
    (["plan-log", "PW", "--label", "a", "--label", "b"], "one --label for each RUN"),
])
def test_plan_log_misuse(tmp_path, capsys, argv, needle):
    (tmp_path / "RUNLESS").mkdir()
    (tmp_path / "PW").mkdir()
    argv = [str(tmp_path / a) if a in ("RUNLESS", "PW") else a for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0] and "Traceback" not in err[0], err
