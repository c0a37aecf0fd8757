"""`pwsim bench planner`: runs, writes the JSON it prints, names the command that reproduces it."""
from __future__ import annotations

import json

from pwsim.cli import main


def test_bench_planner_json(tmp_path, capsys):
    out = tmp_path / "bench" / "planner.json"
    rc = main(["bench", "planner", "--models", "Mixtral-8x7B-v0.1", "--steps", "40", "--no-pin", "--no-progress",
               "--json", "--out", str(out)])
    assert rc == 0
    printed = json.loads(capsys.readouterr().out)
    assert json.loads(out.read_text()) == printed
    (row,) = printed["models"]
    assert row["model"] == "Mixtral-8x7B-v0.1" and row["blocks"] == 32 * 8 * 2 and row["timed_steps"] == 35
    assert row["cpu_ms"]["median"] > 0 and row["wall_ms"]["p99"] >= row["wall_ms"]["median"]
    assert printed["command"].startswith("pwsim bench planner --models Mixtral-8x7B-v0.1 --policy pagedweight")
    assert sorted(p.name for p in out.parent.iterdir()) == ["planner.json"]  # written atomically, no leftovers


def test_bench_user_errors(capsys):
    assert main(["bench"]) == 2
    assert "choose a benchmark target: planner" in capsys.readouterr().err
    assert main(["bench", "planner", "--policy", "pagedweight", "--policy-arg", "alpha=loud", "--no-pin"]) == 2
    assert "'alpha' expects a number or none" in capsys.readouterr().err
    assert main(["bench", "planner", "--models", "NoSuchModel", "--no-pin"]) == 2
    assert "no model card 'NoSuchModel'" in capsys.readouterr().err


def test_bench_scheduler_times_one_table_and_the_hybrid_groups_of_a_sliding_model(tmp_path, capsys):
    """Gemma 4's card gets a row for one table and one for its six groups, Mixtral's (no sliding layers) one table;
    the JSON it prints is the one it writes, with a PNG beside it and the command that reproduces it."""
    out = tmp_path / "sched.json"
    assert main(["bench", "scheduler", "--models", "Gemma-4-26B-A4B,Mixtral-8x7B-v0.1", "--rows", "6",
                 "--context-min", "100", "--context-max", "3000", "--steps", "8", "--rounds", "2", "--json",
                 "--out", str(out)]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert json.loads(out.read_text()) == printed and out.with_suffix(".png").stat().st_size > 0
    assert [(r["model"], r["layout"], r["groups"]) for r in printed["rows"]] == [
        ("Gemma-4-26B-A4B", "one table", 1), ("Gemma-4-26B-A4B", "hybrid", 6), ("Mixtral-8x7B-v0.1", "one table", 1)]
    assert all(r["step_ms"] > 0 and abs(r["us_a_sequence"] * 6 - r["step_ms"] * 1e3) < 1e-6 for r in printed["rows"])
    assert printed["command"].startswith("pwsim bench scheduler --models Gemma-4-26B-A4B,Mixtral-8x7B-v0.1 --rows 6")


def test_bench_scheduler_user_errors(tmp_path, capsys):
    for argv, message in ((["--models", "NoSuchModel"], "no model card 'NoSuchModel'"),
                          (["--rows", "0"], "--rows must be positive"),
                          (["--context-min", "10", "--context-max", "5"], "--context-max (5) must be at least"),
                          (["--out", str(tmp_path)], "is a directory")):
        assert main(["bench", "scheduler", *argv]) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []
