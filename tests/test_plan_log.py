"""The plan log both engines write (`policies.plan_log`, `plans.parquet`): a row for each transition begun, refused
or landed, the landed one with its start's bits; `pwsim fidelity` compares two logs transition by transition."""
from __future__ import annotations

import json

import numpy as np

from policies import PageTable, Plan, Transition
from policies.loop import LoopResult
from policies.plan_log import COLUMNS, PlanLog, kind_name, refusal_line
from pwsim.cli import main as pwsim_main
from pwsim.fidelity import RunView, transitions
from traces.results import read_plan_log


def test_rows_for_begun_refused_and_landed_transitions():
    table = PageTable(2, 4, 64, 32)
    off, rel, bad = Transition(5, 8, 4, 100), Transition(9, 4, 8, -100), Transition(3, 6, 4, 10)
    log = PlanLog()
    log.add(7, 0.5, LoopResult(Plan((off, rel, bad), reason="pressure"), started=(off, rel),
                               rejected=((bad, "stale plan: block is at 8 bits, not 6"),), committed=(5,)), table)
    log.add(8, 0.6, LoopResult(None, committed=(9, 11)), table)  # 11 began before the log did: no row
    cols = log.columns()
    assert tuple(cols) == COLUMNS and len(cols["step"]) == 5
    assert cols["status"].tolist() == ["started", "started", "rejected", "landed", "landed"]
    assert cols["block"].tolist() == [5, 9, 3, 5, 9] and cols["step"].tolist() == [7, 7, 7, 7, 8]
    assert cols["to_bits"].tolist() == [4, 8, 4, 4, 8]  # a landed row carries its start's bits
    assert (cols["layer"][0], cols["expert"][0], cols["kind"][0]) == (0, 2, 1)  # block 5: layer 0, expert 2, down
    assert cols["reason"].tolist()[:3] == ["pressure", "pressure", "stale plan: block is at 8 bits, not 6"]
    assert cols["delta_bytes"].dtype == np.int64 and cols["time_s"].tolist()[-1] == 0.6
    assert all(len(v) == 0 for v in PlanLog().columns().values())


def test_an_in_place_commit_has_no_landed_row_and_an_unknown_block_no_kind():
    table = PageTable(2, 4, 64, 32)
    inp, ghost = Transition(6, 8, 5, 0, in_place=True), Transition(99, 8, 4, 0)
    log = PlanLog()
    log.add(1, 0.1, LoopResult(Plan((inp, ghost)), started=(inp,), rejected=((ghost, "block 99 out of range"),)), table)
    log.add(2, 0.2, LoopResult(None, committed=(6,)), table)   # a transfer begun before the log started lands
    cols = log.columns()
    assert cols["status"].tolist() == ["started", "rejected"]
    assert (cols["layer"][1], cols["expert"][1], cols["kind"][1]) == (-1, -1, -1)
    assert [kind_name(k) for k in (0, 1, -1, 2)] == ["gate_up", "down", "-", "-"]


def _view(steps: int, rows: list[tuple]) -> RunView:
    keys = ("step", "block", "from_bits", "to_bits", "status")
    plans = {k: np.array([r[i] for r in rows], dtype=object if k == "status" else np.int64) for i, k in enumerate(keys)}
    return RunView({}, {}, {"step": np.arange(steps)}, {}, plans)


def test_fidelity_compares_two_logs_transition_by_transition():
    same = [(3, 5, 8, 4, "started"), (3, 5, 8, 4, "landed"), (9, 7, 4, 8, "started")]
    t = transitions(_view(20, same), _view(20, same))
    assert t["alike"] == t["rows"] == 3 and t["first_difference"] is None
    assert t["sim"] == {"started": 2, "rejected": 0, "landed": 1}
    # the runtime lands the reload at step 9, the simulator a step later; rows past the steps both ran do not count
    sim = _view(12, same + [(10, 7, 4, 8, "landed"), (15, 2, 8, 3, "started")])
    rt = _view(20, same + [(9, 7, 4, 8, "landed")])
    t = transitions(sim, rt)
    assert (t["alike"], t["rows"], t["first_difference"]) == (3, 5, 9)
    assert t["runtime_only"] == [{"step": 9, "block": 7, "from_bits": 4, "to_bits": 8, "status": "landed"}]
    assert t["sim_only"] == [] and t["sim"]["landed"] == 2
    assert transitions(_view(5, same), RunView({}, {}, {"step": np.arange(5)})) is None  # a run without a log


def test_fidelity_counts_the_rows_of_the_last_step_both_engines_ran():
    """The last step both timelines record is shared: its rows are compared (one alike, one the runtime's alone);
    a row a step past it is not."""
    common = [(4, 1, 8, 4, "started"), (11, 2, 8, 4, "started")]
    sim = _view(12, common)  # steps 0..11
    rt = _view(20, common + [(11, 3, 8, 4, "started"), (12, 6, 8, 4, "started")])
    t = transitions(sim, rt)
    assert (t["alike"], t["rows"], t["first_difference"]) == (2, 3, 11)
    assert t["runtime_only"] == [{"step": 11, "block": 3, "from_bits": 8, "to_bits": 4, "status": "started"}]
    assert t["sim"]["started"] == 2 and t["runtime"]["started"] == 3


def test_a_simulation_writes_its_plan_log(tmp_path, capsys):
    out = tmp_path / "run"
    assert pwsim_main(["run", "--policy", "pagedweight", "--budget", "24MiB", "--out", str(out), "--no-progress"]) == 0
    capsys.readouterr()
    log, summary = read_plan_log(out), json.loads((out / "summary.json").read_text())
    status = log["status"].tolist()
    started = summary["plans"]["transitions_started"]
    assert status.count("started") == sum(started.values()) > 0
    assert status.count("rejected") == sum(summary["plans"]["transitions_rejected"].values())
    assert 0 < status.count("landed") <= summary["plans"]["commits"]
    offloads = (log["status"] == "started") & (log["to_bits"] < log["from_bits"])
    assert int(offloads.sum()) == started["offload"] and (log["delta_bytes"][offloads] > 0).all()
    assert read_plan_log(tmp_path) == {}  # a directory without one


def test_a_run_says_how_many_transitions_the_loop_refused_and_why():
    """A planner whose every transition is refused looked as if it worked (`pwsim plan-log` alone showed it)."""
    cols = {"status": np.array(["started", "rejected", "rejected", "rejected", "landed"], dtype=object),
            "reason": np.array(["kv", "stale plan: block is at 3 bits, not 4", "stale plan: block is at 5 bits, not 4",
                                "9 bits not supported; supported: (3, 4)", "kv"], dtype=object)}
    assert refusal_line(cols, "runs/x") == ("the plan loop refused 3 of the 4 transitions the planner asked for (most: "
                                            "'stale plan', 2); `pwsim plan-log runs/x` lists them")
    assert refusal_line({"status": cols["status"][:1], "reason": cols["reason"][:1]}, "runs/x") is None


def test_fidelity_shows_at_most_five_rows_of_the_first_step_apart():
    rows = [(2, b, 8, 4, "started") for b in range(6)]
    t = transitions(_view(10, []), _view(10, rows))
    assert t["first_difference"] == 2 and t["sim_only"] == []
    assert [r["block"] for r in t["runtime_only"]] == [0, 1, 2, 3, 4]
