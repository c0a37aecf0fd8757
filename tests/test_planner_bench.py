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
