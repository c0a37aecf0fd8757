"""Planners of one's own (`--policy FILE.py:CLASS` / `MODULE:CLASS`): resolved by the registry as built-ins are,
refused with one clear error when they cannot be, listed by `pwsim policies`, and run by both engines; the bundled
example (`policies/examples/coldest_first.py`) lowers the coldest experts first and raises the hottest back."""
from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from policies import Observation, PageTable, PolicyError, RoutingReadout, get, parse_policy_args
from policies.examples.coldest_first import ColdestFirst
from policies.registry import describe, summary
from pwsim.cli import main as pwsim_main

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = "policies/examples/coldest_first.py:ColdestFirst"


def test_a_planner_by_file_or_module_takes_typed_parameters(monkeypatch):
    monkeypatch.chdir(ROOT)
    by_file = get(EXAMPLE, **parse_policy_args(EXAMPLE, ["floor_bits=4", "reload_margin_blocks=2"]))
    by_module = get("policies.examples.coldest_first:ColdestFirst", floor_bits=5)
    assert type(by_file) is type(get(EXAMPLE))  # the file is loaded once
    assert (by_file.floor_bits, by_file.reload_margin_blocks, by_file.name) == (4, 2, "coldest-first")
    assert isinstance(by_module, ColdestFirst) and by_module.floor_bits == 5
    assert ("floor_bits", "an integer", 3) in describe(EXAMPLE)
    assert summary(EXAMPLE).startswith("Under KV pressure, lower the least-routed experts' blocks")
    with pytest.raises(PolicyError, match=r"expects an integer, got 'low'"):
        parse_policy_args(EXAMPLE, ["floor_bits=low"])
    with pytest.raises(PolicyError, match="has no parameter 'floor'; its parameters: floor_bits"):
        get(EXAMPLE, floor=3)


@pytest.mark.parametrize("source,spec,match", [
    (None, "missing.py:X", r"cannot import missing.py \(FileNotFoundError: no file missing.py\)"),
    (None, "no_such_module_pw:X", r"cannot import no_such_module_pw \(ModuleNotFoundError"),
    ("x = 1\n", "p.py:Planner", "p.py has no class 'Planner'"),
    ("class Planner:\n    name = 'p'\n", "p.py:Planner", "must be a dataclass"),
    ("from dataclasses import dataclass\n@dataclass\nclass Planner:\n    name: str = 'p'\n"
     "    def reset(self, table, calibration): pass\n", "p.py:Planner", "lacks plan_step"),
    ("from dataclasses import dataclass\n@dataclass\nclass Planner:\n"
     "    def reset(self, table, calibration): pass\n    def plan_step(self, table, obs): pass\n",
     "p.py:Planner", "lacks name"),
    ("def broken(:\n", "p.py:Planner", r"cannot import p.py \(SyntaxError"),
    ("raise RuntimeError('no GPU here')\n", "p.py:Planner", r"cannot import p.py \(RuntimeError: no GPU here\)"),
    ("from dataclasses import dataclass\n@dataclass\nclass Planner:\n    name: int = 3\n"
     "    def reset(self, table, calibration): pass\n    def plan_step(self, table, obs): pass\n",
     "p.py:Planner", "its name must be a string"),
    ("from dataclasses import dataclass\n@dataclass\nclass Planner:\n    name: str = 'p'\n"
     "    def reset(self, table): pass\n    def plan_step(self, table, obs): pass\n",
     "p.py:Planner", r"Planner.reset must be a method taking \(table, calibration\)"),
    ("from dataclasses import dataclass\n@dataclass\nclass Planner:\n    name: str = 'p'\n    reset = 3\n"
     "    def plan_step(self, table, obs): pass\n", "p.py:Planner", "Planner.reset must be a method"),
    ("from dataclasses import dataclass\nfrom helper_pw import BITS\n@dataclass\nclass Planner:\n    name: str = 'p'\n"
     "    def reset(self, table, calibration): pass\n    def plan_step(self, table): pass\n",
     "p.py:Planner", r"Planner.plan_step must be a method taking \(table, observation\)"),
])
def test_a_planner_that_cannot_be_used_is_one_clear_error(tmp_path, monkeypatch, source, spec, match):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))   # a planner file's folder joins it (for its helpers)
    (tmp_path / "helper_pw.py").write_text("BITS = 4\n")   # a module beside the planner's file
    if source is not None:
        (tmp_path / spec.partition(":")[0]).write_text(source)
    with pytest.raises(PolicyError, match=match):
        get(spec)


PLANNER = ("from dataclasses import dataclass\n@dataclass\nclass Planner:\n    name: str = 'p'\n    x: int = 1\n"
           "    def reset(self, table, calibration): pass\n    def plan_step(self, table, obs): pass\n")


def test_a_planner_file_that_failed_to_import_is_read_again_once_fixed(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))
    spec = f"{tmp_path / 'fixme.py'}:Planner"
    (tmp_path / "fixme.py").write_text("raise RuntimeError('not yet')\n")
    with pytest.raises(PolicyError, match="not yet"):
        get(spec)
    (tmp_path / "fixme.py").write_text(PLANNER)
    assert get(spec).name == "p"
    assert summary(spec) == ""   # no docstring of its own: no summary (not the dataclass's generated signature)


def test_a_planners_parameters_read_as_what_they_take_and_its_errors_say_whose(tmp_path, monkeypatch):
    """A required parameter, a factory's default and a type --policy-arg cannot set are described as such (they read
    `<dataclasses._MISSING_TYPE ...>` and `<class 'list'>`); a file without its class is told to name it; an error in
    the planner's own plan_step says whose and at which step."""
    from policies.loop import PlanLoop
    (tmp_path / "mine.py").write_text(
        "from dataclasses import dataclass, field\n@dataclass\nclass Mine:\n    floor: int\n"
        "    layers: list = field(default_factory=lambda: [0, 1])\n    name: str = 'mine'\n"
        "    def reset(self, table, calibration): pass\n"
        "    def plan_step(self, table, observation): raise RuntimeError('my bug')\n")
    spec = f"{tmp_path / 'mine.py'}:Mine"
    assert describe(spec) == [("floor", "an integer", "required"),
                              ("layers", "list (not settable by --policy-arg)", [0, 1]), ("name", "a string", "mine")]
    with pytest.raises(PolicyError, match=r"name the planner's class too, as .*mine.py:CLASS"):
        get(str(tmp_path / "mine.py"))
    loop = PlanLoop(get(spec, floor=3), PageTable(1, 2, hidden=64, intermediate=32, initial_bits=8))
    with pytest.raises(RuntimeError, match="my bug") as raised:
        loop.step(Observation(step=7, time_s=0.0, free_blocks=1, total_blocks=4, kv_block_bytes=64,
                              free_block_threshold=2))
    assert raised.value.__notes__ == ["(raised by policy mine's plan_step at step 7)"]


def test_pwsim_policies_lists_builtins_and_describes_ones_own(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert pwsim_main(["policies"]) == 0
    text = capsys.readouterr().out
    assert "pagedweight: PagedWeight planner (paper Algorithm 1)" in text
    assert "--policy-arg min_plan_blocks=...  an integer, default 0" in text and "FILE.py:CLASS" in text
    # an ablation lists the default it changes, not pagedweight's twelve parameters again
    assert text.count("--policy-arg min_plan_blocks=") == 1
    ablation = text.split("pagedweight-no-routing: ")[1].split("\n")[:3]
    assert ablation == ["PagedWeight without routing (ablation)",
                        "    --policy-arg no_routing=...  true/false, default True",
                        "    (its other parameters and their defaults: those of pagedweight)"], ablation
    assert pwsim_main(["policies", EXAMPLE, "uniform-4", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["name"] for r in rows] == [EXAMPLE, "uniform-4"]
    assert {"name": "reload_margin_blocks", "type": "an integer", "default": 16} in rows[0]["parameters"]
    assert rows[1]["parameters"] == [{"name": "bits", "type": "an integer", "default": 4}]
    assert pwsim_main(["policies", "nope.py:Planner"]) == 2
    err = capsys.readouterr().err
    assert "cannot import nope.py" in err and "Traceback" not in err


def test_the_simulator_runs_ones_own_planner_under_pressure(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    out = tmp_path / "run"
    assert pwsim_main(["run", "--policy", EXAMPLE, "--policy-arg", "floor_bits=4", "--budget", "24MiB",
                       "--out", str(out), "--no-progress"]) == 0
    s = json.loads((out / "summary.json").read_text())
    assert s["completed"] == s["requests"] and s["plans"]["plans"] > 0
    assert s["plans"]["transitions_started"]["offload"] > 0
    assert 4 <= s["mean_committed_bits"] < 8
    assert json.loads((out / "config.json").read_text())["policy"] == EXAMPLE


def _obs(free: int, mass: np.ndarray | None, threshold: int = 4) -> Observation:
    return Observation(step=1, time_s=0.0, free_blocks=free, total_blocks=100, kv_block_bytes=4096,
                       free_block_threshold=threshold, routing=RoutingReadout(mass=mass))


def test_the_example_counts_the_blocks_the_next_step_takes_as_gone():
    table = PageTable(2, 4, 256, 128, bits=(3, 4, 6, 8))
    planner = ColdestFirst(floor_bits=4)
    planner.reset(table, None)
    ob = Observation(step=1, time_s=0.0, free_blocks=6, total_blocks=100, kv_block_bytes=4096, free_block_threshold=4,
                     pending_kv_blocks=4, routing=RoutingReadout(mass=None))
    assert planner.plan_step(table, ob).transitions  # 6 free, 4 of them taken next step: 2 left, 3 short
    assert planner.plan_step(table, dataclasses.replace(ob, pending_kv_blocks=2)).transitions  # 4 left: 1 short


def test_the_example_counts_what_offloads_in_flight_will_free():
    table = PageTable(2, 4, 256, 128, bits=(3, 4, 6, 8))
    planner = ColdestFirst(floor_bits=4)
    planner.reset(table, None)
    table.begin_offload(0, 4)   # frees more than one KV block once it lands
    ob = Observation(step=1, time_s=0.0, free_blocks=4, total_blocks=100, kv_block_bytes=4096, free_block_threshold=4)
    assert planner.plan_step(table, ob) is None


def test_the_example_raises_a_block_whose_planes_just_fit_the_room():
    table = PageTable(2, 4, 256, 128, bits=(3, 4, 6, 8))
    planner = ColdestFirst(floor_bits=4, reload_margin_blocks=2)
    planner.reset(table, None)
    table.begin_offload(0, 6)
    table.finish_offload(0)
    cost = int(table.M[0, 8] - table.M[0, 6])
    ob = Observation(step=1, time_s=0.0, free_blocks=4 + 2 + 1, total_blocks=100, kv_block_bytes=cost,
                     free_block_threshold=4)   # room for exactly one KV block: block 0's planes and LUT
    assert [(t.block, t.to_bits) for t in planner.plan_step(table, ob).transitions] == [(0, 8)]


def test_the_example_raises_the_hottest_block_the_room_holds():
    table = PageTable(2, 4, 256, 128, bits=(3, 4, 6, 8))
    planner = ColdestFirst(floor_bits=4, reload_margin_blocks=2)
    planner.reset(table, None)
    hot, cold = table.index(0, 0, 0), table.index(0, 1, 0)
    for i in (cold, hot):
        table.begin_offload(i, 6)
        table.finish_offload(i)
    cost = int(table.M[hot, 8] - table.M[hot, 6])   # the same for both: two gate_up blocks
    mass = np.array([[0.4, 0.1, 0.3, 0.2], [0.05, 0.5, 0.25, 0.2]])
    ob = Observation(step=1, time_s=0.0, free_blocks=4 + 2 + 1, total_blocks=100, kv_block_bytes=cost,
                     free_block_threshold=4, routing=RoutingReadout(mass=mass))   # room for one of them
    assert [(t.block, t.to_bits) for t in planner.plan_step(table, ob).transitions] == [(hot, 8)]


def test_the_example_lowers_the_coldest_first_and_raises_the_hottest_back():
    table = PageTable(2, 4, 256, 128, bits=(3, 4, 6, 8))
    planner = ColdestFirst(floor_bits=4, reload_margin_blocks=2)
    planner.reset(table, None)
    mass = np.array([[0.4, 0.1, 0.3, 0.2], [0.05, 0.5, 0.25, 0.2]])
    plan = planner.plan_step(table, _obs(free=2, mass=mass))  # 3 blocks short of the threshold + 1
    blocks = [t.block for t in plan.transitions]
    heat = [mass[table.layer[i], table.expert[i]] for i in blocks]
    assert heat == sorted(heat) and heat[0] == 0.05  # coldest first: layer 1's expert 0
    assert all((t.from_bits, t.to_bits) == (8, 6) for t in plan.transitions)
    assert sum(t.delta_bytes for t in plan.transitions) >= 3 * 4096
    assert sum(t.delta_bytes for t in plan.transitions[:-1]) < 3 * 4096  # no more than it needs
    for t in plan.transitions:
        table.begin_offload(t.block, t.to_bits)
        table.finish_offload(t.block)
    assert planner.plan_step(table, _obs(free=6, mass=mass)) is None  # not short, not above the margin
    small_room = _obs(free=7, mass=mass)  # one KV block of room: less than any block's planes
    assert planner.plan_step(table, small_room) is None and not small_room.routing_read  # decided without a read
    back = planner.plan_step(table, _obs(free=40, mass=mass))
    heat_back = [mass[table.layer[t.block], table.expert[t.block]] for t in back.transitions]
    assert heat_back == sorted(heat_back, reverse=True) and all(t.to_bits == 8 for t in back.transitions)
    assert {t.block for t in back.transitions} == set(blocks)
