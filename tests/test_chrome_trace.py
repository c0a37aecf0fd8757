"""`pwsim chrome-trace`: a runtime replay and a simulation as one Trace Event Format file whose slices, counters and
request spans say what their result directories say; misuse one clear error, nothing written."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from pwsim.cli import main
from traces.chrome_trace import chrome_trace
from traces.results import read_result_dir

REPLAY = Path(__file__).resolve().parents[1] / "traces" / "bundled" / "demo-replay-h200" / "kv236-run1"


@pytest.fixture(scope="module")
def sim_dir(tmp_path_factory):
    """The bundled default simulated at 24 MiB: the planner offloads, then reloads over the link; its offloads' LUTs
    take room from the KV pool (`--lut-room pool`), so some are refused for want of it."""
    out = tmp_path_factory.mktemp("sim") / "run"
    assert main(["run", "--policy", "pagedweight", "--budget", "24MiB", "--lut-room", "pool", "--no-progress", "--out",
                 str(out)]) == 0
    return out


def misuse(capsys, argv: list[str], needle: str) -> None:
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1 and "Traceback" not in err, err


def _of(trace: dict, pid: int, ph: str, cat: str | None = None) -> list[dict]:
    return [e for e in trace["traceEvents"] if e["pid"] == pid and e["ph"] == ph and (cat is None or e.get("cat") == cat)]


def test_a_replay_s_iterations_phases_and_requests():
    _, requests, timeline, _ = read_result_dir(REPLAY)
    trace = chrome_trace([REPLAY])
    its = _of(trace, 1, "X", "iteration")
    assert len(its) == len(timeline["time_s"])
    ends = np.array([(e["ts"] + e["dur"]) / 1e6 for e in its])
    assert np.allclose(ends, timeline["time_s"], atol=1e-5)
    kinds = ["decode" if t == d else "mixed" for t, d in zip(timeline["batch_tokens"], timeline["decode_tokens"])]
    assert [e["name"] for e in its] == kinds and {"decode", "mixed"} <= set(kinds)
    # each phase lies inside its iteration, in the engine's order
    phases = _of(trace, 1, "X", "phase")
    assert {p["name"] for p in phases} <= {"schedule", "forward", "sample", "observe", "plan"} and phases
    bounds = [(e["ts"], e["ts"] + e["dur"]) for e in its]
    for p in phases:
        assert any(lo - 1e-3 <= p["ts"] and p["ts"] + p["dur"] <= hi + 1e-3 for lo, hi in bounds), p
    # every request: waiting for its first token from its arrival, then decoding to its end
    begins, ends_ = _of(trace, 1, "b", "request"), _of(trace, 1, "e", "request")
    assert len(begins) == len(ends_) == 2 * int(np.isfinite(requests["finish_s"]).sum())
    first = [e for e in begins if e["name"] == "waiting for first token"]
    assert np.allclose(sorted(e["ts"] / 1e6 for e in first), sorted(requests["arrival_s"]), atol=1e-5)
    counters = _of(trace, 1, "C")
    assert {c["name"] for c in counters} == {"requests", "KV blocks", "mean bits"}


def test_a_simulation_s_link_transfers_and_plans(sim_dir):
    events = json.loads((sim_dir / "events.json").read_text())
    assert events["link_transfers"] and events["plans"]  # the fixture is under pressure
    trace = chrome_trace([sim_dir])
    link = _of(trace, 1, "X", "link")
    assert len(link) == len(events["link_transfers"])
    assert sorted(e["args"]["bytes"] for e in link) == sorted(t["bytes"] for t in events["link_transfers"])
    assert len(_of(trace, 1, "i", "plan")) == len(events["plans"])
    assert {c["name"] for c in _of(trace, 1, "C")} == {"requests", "KV blocks", "mean bits", "memory bytes"}
    (name,) = [e["args"]["name"] for e in _of(trace, 1, "M") if e["name"] == "process_name"]
    assert name == "run (simulation)"


def test_the_command_writes_both_as_processes(sim_dir, tmp_path, capsys):
    out = tmp_path / "t.json"
    assert main(["chrome-trace", str(sim_dir), str(REPLAY), "--label", "sim", "--label", "h200", "--out", str(out)]) == 0
    assert "open it in https://ui.perfetto.dev" in capsys.readouterr().out
    trace = json.loads(out.read_text())  # strict JSON: no NaN
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert names == {1: "sim", 2: "h200"}
    assert _of(trace, 2, "X", "phase") and not _of(trace, 1, "X", "phase")  # only the replay times phases
    assert main(["chrome-trace", str(sim_dir), "--out", str(out), "--json"]) == 0
    said = json.loads(capsys.readouterr().out)
    assert said["events"] == len(json.loads(out.read_text())["traceEvents"]) and said["results"] == [str(sim_dir)]
    assert said["out"] == str(out) and len(said["processes"]) == 1


def test_chrome_trace_misuse(sim_dir, tmp_path, capsys):
    out = tmp_path / "t.json"
    misuse(capsys, ["chrome-trace", str(sim_dir), "--label", "a", "--label", "b", "--out", str(out)],
           "one --label per result directory")
    misuse(capsys, ["chrome-trace", str(tmp_path), "--out", str(out)], "is not a result directory")
    misuse(capsys, ["chrome-trace", str(sim_dir), "--out", str(tmp_path)], "is a directory")
    assert not out.exists()


def test_page_moves_come_from_the_plan_log(sim_dir):
    """Each transition the plan log shows begun and landed is one async slice from its start to its landing (a reload
    or an offload, its block and bits in its args); each refused one an instant naming why; a result without a plan
    log (a replay older than it) has none."""
    from traces.results import read_plan_log

    plans = read_plan_log(sim_dir)
    trace = chrome_trace([sim_dir])
    begins, ends = _of(trace, 1, "b", "page move"), _of(trace, 1, "e", "page move")
    landed = plans["status"] == "landed"
    assert len(begins) == len(ends) == int(landed.sum()) > 0
    assert {e["name"] for e in begins} == {"reload", "offload"}  # at 24 MiB the planner lowers, then raises back
    end_of = {e["id"]: e["ts"] for e in ends}
    assert all(end_of[b["id"]] >= b["ts"] for b in begins)
    assert np.allclose(sorted(end_of.values()), sorted(np.round(plans["time_s"][landed] * 1e6, 3)))
    for b in begins:
        lo, hi = (int(x) for x in b["args"]["bits"].split("->"))
        assert (hi > lo) == (b["name"] == "reload") and b["args"]["kind"] in ("gate_up", "down")
    refused = _of(trace, 1, "i", "page move")
    assert len(refused) == int((plans["status"] == "rejected").sum()) > 0
    assert all(r["args"]["reason"] for r in refused)
    assert not _of(chrome_trace([REPLAY]), 1, "b", "page move")


def test_stalls_need_a_start_and_process_names_belong_to_no_thread(sim_dir, tmp_path):
    from traces.chrome_trace import _events_file
    doc = {"stalls": [{"time_s": 1.0, "duration_s": 0.5, "kind": "absent_experts"}, {"kind": "no start"}]}
    (tmp_path / "events.json").write_text(json.dumps(doc))
    stalls = [e for e in _events_file(tmp_path / "events.json", 1) if e.get("cat") == "stall"]
    assert [(s["name"], s["ts"], s["dur"]) for s in stalls] == [("absent_experts", 1e6, 5e5)]
    meta = _of(chrome_trace([sim_dir]), 1, "M")
    assert all(("tid" in e) == (e["name"] == "thread_name") for e in meta)


def test_plans_keep_their_fields_moves_need_a_start_and_spans_may_last_no_time(tmp_path):
    """A plan instant's args are the plan's fields but its time; a landing whose start the log lacks is no slice; a
    request whose first token came as it arrived has a waiting span of no length, and an unfinished one no decoding
    span."""
    from traces.chrome_trace import _events_file, _page_moves, _requests
    (tmp_path / "events.json").write_text(json.dumps({"plans": [{"time_s": 2.0, "blocks": 3}]}))
    (plan,) = [e for e in _events_file(tmp_path / "events.json", 1) if e.get("cat") == "plan"]
    assert plan["args"] == {"blocks": 3} and plan["ts"] == 2e6
    log = {"step": np.array([4]), "status": np.array(["landed"], dtype=object), "block": np.array([7]),
           "from_bits": np.array([4]), "to_bits": np.array([8]), "layer": np.array([0]), "expert": np.array([3]),
           "kind": np.array([0]), "time_s": np.array([1.0]), "reason": np.array(["reload"], dtype=object)}
    assert [e["ph"] for e in _page_moves(log, 1)] == ["M"]
    nan = float("nan")
    requests = {"arrival_s": np.array([1.0, 1.0]), "first_token_s": np.array([1.0, 2.0]),
                "finish_s": np.array([3.0, nan]), "request_id": np.array([0, 1]), "prompt_tokens": np.array([4, 4]),
                "output_tokens": np.array([2, 1]), "finish_reason": np.array(["length", ""], dtype=object)}
    spans = [(e["id"], e["name"], e["ts"]) for e in _requests(requests, 1) if e["ph"] == "b"]
    assert spans == [("1-0", "waiting for first token", 1e6), ("1-0", "decoding", 1e6),
                     ("1-1", "waiting for first token", 1e6)]
