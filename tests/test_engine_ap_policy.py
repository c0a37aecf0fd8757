"""`pwruntime generate --ap --policy --calibration`: a planner moves real AP expert bits under KV pressure."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from policies.calibration import Calibration
from demo_fixtures import first_prompts
from pwruntime.cli import main
from pwruntime.cmd_perplexity import default_model_dir
from pwruntime.quant.build import QuantizeOptions, quantize_checkpoint

CALIBRATION = Path(__file__).resolve().parents[1] / "traces" / "bundled" / "demo-calibration"
PROMPTS = ["--prompt", "And God said unto Moses", "--prompt", "The os module provides", "--prompt", "A fool and his"]


@pytest.fixture(scope="module")
def ap_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("ap") / "demo_ap"
    quantize_checkpoint(default_model_dir(), out, QuantizeOptions(weighting="none"), progress=False)
    return out


def _generate(capsys, *argv) -> tuple[int, dict | None, str]:
    rc = main(["generate", *argv, "--json"])
    cap = capsys.readouterr()
    return rc, (json.loads(cap.out) if rc == 0 else None), cap.err


def test_pressure_lowers_bits_and_grows_the_kv_pool(ap_dir, capsys):
    rc, out, _ = _generate(capsys, "--ap", str(ap_dir), "--calibration", str(CALIBRATION), "--policy", "pagedweight",
                           *PROMPTS, "--max-tokens", "64", "--num-kv-blocks", "12", "--block-size", "4")
    assert rc == 0
    stats = out["stats"]
    cal = Calibration.load(CALIBRATION)
    assert stats["mean_bits_start"] == pytest.approx(float(np.mean(cal.initial_bits)), abs=1e-4)  # its start
    assert stats["plans"] > 0 and stats["mean_bits_end"] < stats["mean_bits_start"]  # the planner offloaded
    assert stats["kv_blocks"] > 12  # ... and the released bytes became KV blocks
    assert all(o["finish_reason"] in ("stop", "length") for o in out["outputs"])


def test_a_planner_of_ones_own_runs_unchanged_in_the_runtime(ap_dir, capsys, monkeypatch):
    """The example planner the simulator runs by file name (tests/test_planner_plugins.py), in the runtime's engine."""
    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    rc, out, _ = _generate(capsys, "--ap", str(ap_dir), "--calibration", str(CALIBRATION), "--policy",
                           "policies/examples/coldest_first.py:ColdestFirst", "--policy-arg", "floor_bits=4",
                           *PROMPTS, "--max-tokens", "64", "--num-kv-blocks", "12", "--block-size", "4")
    assert rc == 0
    stats = out["stats"]
    assert stats["policy"] == "coldest-first" and stats["plans"] > 0
    assert stats["mean_bits_end"] < stats["mean_bits_start"] and stats["kv_blocks"] > 12
    rc, _, err = _generate(capsys, "--ap", str(ap_dir), "--calibration", str(CALIBRATION), "--policy",
                           "policies/examples/coldest_first.py:ColdestFirst", "--policy-arg", "floor_bits=2", *PROMPTS)
    assert rc == 2 and "floor_bits 2 is not a supported bitwidth" in err and "Traceback" not in err


def test_without_pressure_nothing_moves(ap_dir, capsys):
    args = ["--ap", str(ap_dir), "--calibration", str(CALIBRATION), *PROMPTS, "--max-tokens", "16"]
    rc, paged, _ = _generate(capsys, *args, "--policy", "pagedweight", "--num-kv-blocks", "256")
    assert rc == 0 and paged["stats"]["plans"] == 0
    assert paged["stats"]["mean_bits_end"] == paged["stats"]["mean_bits_start"]


def test_calibration_of_another_model_is_refused(ap_dir, capsys, tmp_path):
    cal = Calibration.load(CALIBRATION)
    cal.fingerprint = "arch:000000000000"
    cal.save(tmp_path / "other")
    rc, _, err = _generate(capsys, "--ap", str(ap_dir), "--calibration", str(tmp_path / "other"), "--prompt", "x")
    assert rc == 2 and "pwruntime calibrate" in err and "Traceback" not in err


def test_calibration_without_ap_exit_2(capsys):
    rc, _, err = _generate(capsys, "--calibration", str(CALIBRATION), "--prompt", "x")
    assert rc == 2 and "--ap" in err


def test_engine_records_the_steps_whose_planner_read_the_routing(ap_dir):
    """Under pressure the planner reads the routing statistics on some steps (which folds the held step at once)
    and not on others (nothing is merged then); the engine records which (`last_routing_read`, the replay's
    `routing_read` column, what `pwsim fidelity` measures the reads' cost from)."""
    from pwruntime.cli import _registrars
    from pwruntime.cmd_generate import build_engine
    from pwruntime.sampling import SamplingParams
    from traces.clikit import build_parser
    args = build_parser("pwruntime", "", _registrars()).parse_args(
        ["generate", "--ap", str(ap_dir), "--calibration", str(CALIBRATION), "--policy", "pagedweight",
         "--num-kv-blocks", "12", "--block-size", "4", "--prompt", "x"])
    engine, *_ = build_engine(args)
    for prompt in PROMPTS[1::2]:
        engine.add_request(prompt, SamplingParams(max_tokens=64, ignore_eos=True))
    reads = []
    while engine.has_unfinished():
        engine.step()
        reads.append(engine.last_routing_read)
        assert engine.last_observation.routing.read == engine.last_routing_read
        if engine.last_routing_read:
            assert engine.routing._held == []  # reading folded the held steps
    assert any(reads) and not all(reads), reads


def test_the_engine_loop_shows_ap_experts_bits_and_a_dense_model_none(ap_dir):
    """/metrics' gauges (EngineCore.stats), /server_info and the ready line carry the page table's bits and resident
    bytes for AP experts; a full-precision model's experts have no committed bits, so they leave them out."""
    from pwruntime.cli import _registrars
    from pwruntime.cmd_generate import build_engine
    from pwruntime.engine_core import EngineCore
    from pwruntime.stats_log import ready_line, serving_info
    from traces.clikit import build_parser
    parse = build_parser("pwruntime", "", _registrars()).parse_args
    ap, *_ = build_engine(parse(["generate", "--ap", str(ap_dir), "--calibration", str(CALIBRATION),
                                 "--num-kv-blocks", "12", "--prompt", "x"]))
    gauges = EngineCore(ap, lambda events: None).stats()["gauges"]
    assert gauges["mean_committed_bits"] == ap.table.mean_bits() < 16
    assert gauges["expert_resident_bytes"] == ap.table.resident_bytes() > 0
    info = serving_info(ap)  # /server_info and the ready line say the same
    assert info["ap_experts"] and info["policy"] == ap.policy.name and info["lut_room"] == "pool"  # no budget: no slack
    assert info["mean_committed_bits"] == ap.table.mean_bits()
    assert f"experts at {ap.table.mean_bits():.2f} mean bits" in ready_line(info, 1.0)
    dense, *_ = build_engine(parse(["generate", "--num-kv-blocks", "12", "--prompt", "x"]))
    gauges = EngineCore(dense, lambda events: None).stats()["gauges"]
    assert "mean_committed_bits" not in gauges and "expert_resident_bytes" not in gauges
    assert gauges["kv_blocks_total"] == 12
    info = serving_info(dense)
    assert not info["ap_experts"] and info["mean_committed_bits"] is None and info["num_kv_blocks"] == 12
    assert info["lut_room"] is None  # no pages to move
    assert "mean bits" not in ready_line(info, 1.0) and "12 KV blocks of 16 tokens" in ready_line(info, 1.0)


def test_the_serving_loop_logs_what_its_planner_did(ap_dir):
    """EngineCore with a PlanLog (what `pwruntime serve --record-trace` writes beside the trace): under pressure every
    transition the engine's plan loop began is a row, and each one landed (the CPU lands them at once), at steps the
    engine ran."""
    import threading

    from policies.plan_log import PlanLog
    from pwruntime.cli import _registrars
    from pwruntime.cmd_generate import build_engine
    from pwruntime.engine_core import EngineCore
    from pwruntime.sampling import SamplingParams
    from traces.clikit import build_parser
    engine, *_ = build_engine(build_parser("pwruntime", "", _registrars()).parse_args(
        ["generate", "--ap", str(ap_dir), "--calibration", str(CALIBRATION), "--policy", "pagedweight",
         "--num-kv-blocks", "12", "--block-size", "4", "--prompt", "x"]))
    done, finished, prompts = threading.Event(), [], PROMPTS[1::2]

    def emit(events: list) -> None:
        finished.extend(e for _, e in events if e[0] == "done")
        if len(finished) == len(prompts):
            done.set()

    core = EngineCore(engine, emit, plan_log=PlanLog())
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    core.inbox.put(("add", "k", [(p, params) for p in prompts], False))
    thread = threading.Thread(target=core.run, daemon=True)
    thread.start()
    assert done.wait(120)
    core.inbox.put(None)
    thread.join(30)
    log = core.plan_log.columns()
    started, landed = (log["status"] == s for s in ("started", "landed"))
    assert engine.loop.num_plans > 0 and started.sum() >= engine.loop.num_plans
    assert started.sum() == landed.sum() and sorted(log["block"][started]) == sorted(log["block"][landed])
    assert 0 <= log["step"].min() and log["step"].max() < engine.num_steps and (np.diff(log["time_s"]) >= 0).all()


def test_a_plan_shrinks_the_kv_pool_once(ap_dir):
    """A plan's reservations shrink the KV pool once for all its transitions (`PlanLoop.room_left`) instead of once
    a transition: the same transitions begin and are refused, the pool has the same capacity and spare bytes after
    every step and every request the same tokens as shrinking for one transition at a time, with fewer resizes of
    the cache (on the H200 a plan reloading about a hundred blocks had spent 46-49 ms resizing it)."""
    from pwruntime.cli import _registrars
    from pwruntime.cmd_generate import build_engine
    from pwruntime.sampling import SamplingParams
    from traces.clikit import build_parser

    def run(one_at_a_time: bool):
        args = build_parser("pwruntime", "", _registrars()).parse_args(
            ["generate", "--ap", str(ap_dir), "--calibration", str(CALIBRATION), "--policy", "pagedweight",
             "--num-kv-blocks", "12", "--block-size", "4", "--prompt", "x"])
        engine, *_ = build_engine(args)
        if one_at_a_time:
            engine.loop.room_left = lambda: 0
        resizes, resize = [0], engine.kv.resize

        def counted(n):
            resizes[0] += n != engine.kv.num_blocks
            resize(n)
        engine.kv.resize = counted
        for i, prompt in enumerate(PROMPTS[1::2] * 2):
            engine.add_request(prompt, SamplingParams(max_tokens=16 + 40 * i, ignore_eos=True))
        steps, tokens, reload_plans = [], {}, 0
        while engine.has_unfinished():
            tokens.update((o.request_id, o.token_ids) for o in engine.step())
            loop = engine.last_loop
            steps.append((engine.pool.capacity, engine.capacity.spare_bytes, loop.started, loop.rejected))
            reload_plans += loop.plan is not None and len(loop.started) > 1 and not loop.started[0].is_offload
        return steps, tokens, resizes[0], reload_plans

    steps, tokens, resizes, reload_plans = run(False)
    ref_steps, ref_tokens, ref_resizes, _ = run(True)
    assert reload_plans > 0  # plans that reload several blocks, each asking for room
    assert steps == ref_steps and tokens == ref_tokens
    assert resizes < ref_resizes


def test_offload_luts_in_flight_stay_in_the_budget(ap_dir):
    """Under a memory budget, every step: the weights (the page table's bytes, transfers in flight included), the KV
    pool and the spare bytes fill the budget less the allocator slack, plus the LUTs of offloads in flight that the
    slack holds (`--lut-room slack`, the default; never more than the slack, and nothing once they landed). Offload
    plans then shrink the pool for their LUTs, and are refused for want of room for them, only where the slack (here
    1/32 of 24 MiB) cannot hold them all: far less often than with `--lut-room pool`."""
    from policies.memory_budget import allocator_slack_bytes
    from pwruntime.cli import _registrars
    from pwruntime.cmd_generate import build_engine
    from pwruntime.sampling import SamplingParams
    from traces.clikit import build_parser
    from traces.io import read_requests

    trace = read_requests(Path(__file__).resolve().parents[1] / "traces" / "bundled" / "demo-trace" / "requests.parquet")
    budget, slack = 24 << 20, allocator_slack_bytes(24 << 20)

    def run(lut_room: str) -> tuple[int, int, int]:
        args = build_parser("pwruntime", "", _registrars()).parse_args(
            ["generate", "--ap", str(ap_dir), "--calibration", str(CALIBRATION), "--policy", "pagedweight",
             "--gpu-memory-budget", "24MiB", "--lut-room", lut_room, "--dtype", "bf16", "--prompt", "x"])
        engine, *_ = build_engine(args)
        own, B = engine.model.weight_bytes(), engine.block_bytes
        repaid, repay = [], engine.loop._repay  # the LUT bytes each landed offload had borrowed from the slack
        engine.loop._repay = lambda i: repaid.append(repay(i)) or repaid[-1]
        for i in range(32):  # the demo trace's first prompts, 48 tokens each: pressure at 24 MiB
            engine.add_request(trace.prompt_ids(i), SamplingParams(max_tokens=48, ignore_eos=True))
        offload_shrinks = lut_refusals = 0
        while engine.has_unfinished():
            capacity = engine.pool.capacity
            engine.step()
            loop = engine.last_loop
            used = own + engine.table.resident_bytes() + engine.pool.id_limit * B + engine.capacity.spare_bytes
            assert used == budget - slack + engine.loop.lut_borrowed and 0 <= engine.loop.lut_borrowed <= slack
            offloads = [t for t in loop.started if t.is_offload]
            offload_shrinks += bool(offloads) and len(offloads) == len(loop.started) and engine.pool.capacity < capacity
            lut_refusals += sum(why == "no room for the lower bitwidth's LUT" for _, why in loop.rejected)
        assert engine.loop.num_plans > 5 and engine.loop.lut_borrowed == 0
        return sum(r > 0 for r in repaid), offload_shrinks, lut_refusals

    borrowed, shrinks, refusals = run("slack")
    none_borrowed, pool_shrinks, pool_refusals = run("pool")
    assert borrowed > 20 and none_borrowed == 0
    assert shrinks + refusals < (pool_shrinks + pool_refusals) / 4, (shrinks, refusals, pool_shrinks, pool_refusals)


def test_room_a_plan_took_beyond_its_transitions_comes_back(ap_dir):
    """A plan whose first reload finds room and whose second does not: shrinking for the whole plan takes every free
    block, the second reload is refused, and the blocks it would have used return to the pool after the step (while
    the first reload's copy is still in flight), as shrinking for the first reload alone would have left them."""
    from policies.apformat import lut_bytes, plane_bytes
    from policies.contract import Plan, Transition
    from pwruntime.cli import _registrars
    from pwruntime.cmd_generate import build_engine
    from traces.clikit import build_parser

    class Scripted:
        def __init__(self, plan):
            self.plan = plan

        def plan_step(self, table, observation):
            plan, self.plan = self.plan, None
            return plan

    class InFlight:  # nothing lands during the test
        def start(self, t, nbytes):
            pass

        def landed(self):
            return []

    def engine_with(blocks: int):
        args = build_parser("pwruntime", "", _registrars()).parse_args(
            ["generate", "--ap", str(ap_dir), "--calibration", str(CALIBRATION), "--policy", "pagedweight",
             "--num-kv-blocks", str(blocks), "--block-size", "4", "--prompt", "x"])
        engine = build_engine(args)[0]
        engine.loop.mover = InFlight()
        return engine

    probe = engine_with(64)
    table, B = probe.table, probe.block_bytes
    assert probe.capacity.spare_bytes == 0 and probe.pool.capacity == 64
    a, b = (int(i) for i in np.flatnonzero(table.q < 8)[:2])

    def reload_bytes(i):
        out, inp = (int(x) for x in table.shapes[i])
        return (8 - int(table.q[i])) * plane_bytes(out, inp) + lut_bytes(out, 8)
    first, second = reload_bytes(a), reload_bytes(b)
    assert second > 2 * B  # more than the two blocks left below
    free = -(-first // B) + 1
    plan = Plan((Transition(a, int(table.q[a]), 8, -first), Transition(b, int(table.q[b]), 8, -second)))
    after = []
    for one_at_a_time in (False, True):
        engine = engine_with(free)
        if one_at_a_time:
            engine.loop.room_left = lambda: 0
        engine.loop.policy = Scripted(plan)
        engine.step()
        started, rejected = engine.last_loop.started, engine.last_loop.rejected
        assert [t.block for t in started] == [a] and [t.block for t, _ in rejected] == [b]
        after.append((engine.pool.capacity, engine.capacity.spare_bytes, engine.kv.num_blocks))
    assert after[0] == after[1] == (1, -first % B, 1)


@pytest.mark.parametrize("budget", ["48MiB", "24MiB"])
def test_a_memory_budget_starts_the_pool_the_simulator_starts(ap_dir, budget):
    """`--gpu-memory-budget` as `pwsim run --budget`: the same non-expert bytes (bf16, as the simulator's card counts
    them), the same experts' bytes at the planner's starting bits, the same slack, so the same KV pool."""
    import argparse

    from policies.planners.base import weight_bytes
    from pwruntime.cmd_generate import add_engine_args, build_engine
    from pwsim.runner import build, make_config

    sim = build(make_config(budget, policy="pagedweight"))
    p = argparse.ArgumentParser()
    add_engine_args(p)
    engine = build_engine(p.parse_args(["--ap", str(ap_dir), "--calibration", str(CALIBRATION), "--policy",
                                        "pagedweight", "--gpu-memory-budget", budget, "--dtype", "bf16",
                                        "--device", "cpu"]))[0]
    assert engine.block_bytes == sim.kv_block_bytes
    assert engine.model.weight_bytes() == sim.nonexpert_bytes
    assert weight_bytes(engine.policy, engine.table) == sim.expert_bytes()
    assert engine.pool.capacity == sim.pool.capacity > 0
    # what the room leaves short of one more block waits for released weight bytes on both (the runtime once dropped
    # it, and held one KV block less than the simulator after the first plan)
    assert engine.capacity.spare_bytes == sim._headroom() and 0 < engine.capacity.spare_bytes < engine.block_bytes


def _computed(routing, ids) -> list[int]:
    """Per request: the positions of its last computation, after checking that each of its computations (attempts)
    runs from position 0 without a gap."""
    out = []
    for rid in ids.tolist():
        mine = routing.request_id == rid
        for a in range(int(routing.attempts[mine].max()) + 1):
            pos = np.sort(routing.position[mine & (routing.attempts == a)])[::routing.layers]
            assert pos.tolist() == list(range(len(pos))), (rid, a)
        out.append(len(pos))
    return out


@pytest.mark.parametrize("schedule", [[], ["--async-scheduling"]])
def test_on_the_runtime_s_routing_the_simulator_makes_its_decisions_step_by_step(ap_dir, tmp_path, capsys, schedule):
    """The trace's first 32 prompts, 48 tokens each, at 24 MiB (CPU, bf16; synchronous and asynchronous), after a
    warm-up of 16 requests: `pwruntime replay --record-routing` writes the routing its forwards computed; `pwsim run`
    on it schedules the same batches, holds the same KV pool and bits and begins and lands the same plan transitions
    at every step (`pwsim fidelity`'s decisions), its warm-up routed with the warm-up's recorded routing, its page
    moves landing at once as the CPU runtime's (`--instant-page-moves`; with the link's timing, the first reload
    lands a boundary later and the runs part there). Before a budget's spare bytes were kept alike
    on both they parted at the first plan, and the asynchronous simulator recorded each step's batch a row late and
    held every offload a boundary; with the replayed requests' routing in its warm-up (the same prompts, computed at
    other bits) the simulator warms up differently; on the trace's synthetic routing they part at the first plan whose
    experts differ."""
    from pwsim.cli import main as sim_main
    from traces.io import read_trace_dir

    trace = first_prompts(tmp_path / "load", max_tokens=48)
    limits = ["--max-num-seqs", "32", "--time-scale", "0", "--warmup-requests", "16", *schedule]
    assert main(["replay", "--trace", str(trace), "--out", str(tmp_path / "rt"), "--ap", str(ap_dir), "--calibration",
                 str(CALIBRATION), "--policy", "pagedweight", "--gpu-memory-budget", "24MiB", "--dtype", "bf16",
                 "--device", "cpu", "--max-num-batched-tokens", "512", "--record-routing", *limits]) == 0
    printed = capsys.readouterr().out
    assert f"pwsim run --like-replay {tmp_path / 'rt'}" in printed and " planning steps (" in printed
    recorded = read_trace_dir(tmp_path / "rt" / "trace")
    ids = recorded.requests.request_id
    assert ids.tolist() == list(range(100, 132))  # the trace's ids; the warm-up's requests are not in it
    assert sorted(set(recorded.routing.request_id.tolist())) == ids.tolist()
    # each computation of a request as an attempt (a recompute after preemption the next), from its first position;
    # the last one whole: each prompt and its fed-back outputs, once each
    assert recorded.routing.attempts.max() >= 1
    assert _computed(recorded.routing, ids) == (recorded.requests.prompt_tokens + recorded.requests.output_tokens
                                                 - 1).tolist()
    # the warm-up's own routing of the trace's first 16 prompts (at the bits it ran with), for the simulator's
    warm = recorded.warmup_routing
    assert sorted(set(warm.request_id.tolist())) == list(range(100, 116))
    assert _computed(warm, ids[:16]) == (recorded.requests.prompt_tokens[:16] + 15).tolist()  # 16 tokens each

    reports = {}
    # the simulator on the replay's own trace and settings (`--like-replay`), and by hand on the synthetic routing
    for name, argv in (("own", ["--like-replay", str(tmp_path / "rt")]),
                       ("synthetic", ["--budget", "24MiB", "--policy", "pagedweight", "--trace", str(trace),
                                      "--calibration", str(CALIBRATION), "--max-num-batched-tokens", "512", *limits])):
        assert sim_main(["run", *argv, "--out", str(tmp_path / name)]) == 0
        # the CPU runtime lands its page moves at once (no copy stream): the replay says so, the simulator does so
        assert ("--instant-page-moves" in capsys.readouterr().out) == (name == "own")
        assert sim_main(["fidelity", "--sim", str(tmp_path / name), "--runtime", str(tmp_path / "rt"), "--out",
                         str(tmp_path / f"fid-{name}"), "--json"]) == 0
        reports[name] = json.loads(capsys.readouterr().out)
    own, synthetic = reports["own"], reports["synthetic"]
    assert own["planner"]["plans"]["runtime"] > 5 and own["planner"]["preemptions"]["runtime"] > 0  # under pressure
    d = own["decisions"]
    ran = json.loads((tmp_path / "rt" / "summary.json").read_text())["iterations"]
    assert d["steps"] == ran and d["first_difference"] is None, d
    assert d["agreeing_steps"] == d["steps"] and "total_blocks" in d["columns"] and "mean_bits" in d["columns"]
    # ... and, transition by transition (both plan logs), the same blocks begun, refused and landed at the same steps
    t = own["transitions"]
    assert t["first_difference"] is None and t["alike"] == t["rows"] and t["sim"] == t["runtime"], t
    k = own["kv_resizes"]  # the same pool, so the same resizes of the runtime's cache and the simulator's charges
    assert k["sim"] == k["runtime"] > 5, k
    assert t["runtime"]["started"] > 20 and t["runtime"]["landed"] > 0
    assert own["round_trips"]["sim"] == own["round_trips"]["runtime"]  # alike logs undo alike
    import pyarrow.parquet as pq
    log = pq.read_table(tmp_path / "rt" / "plans.parquet").to_pydict()
    assert sum(s == "landed" and b > a for s, a, b in zip(log["status"], log["from_bits"], log["to_bits"])) > 20
    timeline = pq.read_table(tmp_path / "rt" / "timeline.parquet").column("plan_transitions").to_pylist()
    assert t["runtime"]["started"] == sum(timeline)  # a row for each transition the timeline counts
    plan = json.loads((tmp_path / "rt" / "summary.json").read_text())["plan_ms"]  # the planning steps' plan phase
    assert plan["steps"] == sum(n > 0 for n in timeline) and plan["read"] > 0 and plan["kv"] > 0
    assert plan["moves"] == 0 and plan["plan"] >= plan["read"] + plan["kv"]  # the CPU's mover lands at once, no work
    assert plan["other"] == pytest.approx(plan["plan"] - plan["read"] - plan["kv"], abs=2e-4)  # the rest of the phase
    kv = pq.read_table(tmp_path / "rt" / "timeline.parquet").column("plan_kv_s").to_pylist()
    each = plan["per_transition_us"]   # every step's KV resizes (the landings' growths too), a transition begun
    assert each["moves"] == 0 and each["kv"] == pytest.approx(1e6 * sum(kv) / sum(timeline), abs=1e-3)
    assert f"landings included: {each['moves']:.1f} and {each['kv']:.1f} us a transition begun" in printed
    preempted = json.loads((tmp_path / "rt" / "summary.json").read_text())["preemptions"]
    per_request = pq.read_table(tmp_path / "rt" / "requests.parquet").column("preemptions").to_pylist()
    assert sum(per_request) == preempted > 0 and max(per_request) >= 1  # each request's own preemptions, none lost
    assert synthetic["sim_routing"].startswith("synthetic") and synthetic["decisions"]["first_difference"] is not None
    assert sim_main(["fidelity", "--sim", str(tmp_path / "own"), "--runtime", str(tmp_path / "rt"), "--out",
                     str(tmp_path / "fid-own")]) == 0
    assert f"the same at all {d['steps']} steps" in capsys.readouterr().out
    # --like-replay takes a replay that recorded its routing, and nothing else
    import shutil
    shutil.copytree(tmp_path / "rt", tmp_path / "rt-plain", ignore=shutil.ignore_patterns("trace"))
    shutil.copytree(tmp_path / "rt", tmp_path / "rt-blocks")
    config = json.loads((tmp_path / "rt-blocks" / "config.json").read_text())
    (tmp_path / "rt-blocks" / "config.json").write_text(json.dumps({**config, "gpu_memory_budget": None,
                                                                    "num_kv_blocks": 236}))
    shutil.copytree(tmp_path / "rt", tmp_path / "rt-unfinished", ignore=shutil.ignore_patterns("summary.json"))
    for src, needle in ((tmp_path / "own", "not a `pwruntime replay` result"),
                        (tmp_path / "rt-unfinished", "no readable summary.json"),
                        (tmp_path / "rt-plain", "--record-routing"), (tmp_path / "nowhere", "no readable config.json"),
                        (tmp_path / "rt-blocks", "without --gpu-memory-budget")):
        assert sim_main(["run", "--like-replay", str(src), "--out", str(tmp_path / "like")]) == 2
        err = capsys.readouterr().err
        assert needle in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    # a replay from before --lut-room, whose offloads' LUTs took their room from the KV pool, is simulated so
    shutil.copytree(tmp_path / "rt", tmp_path / "rt-old")
    (tmp_path / "rt-old" / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "lut_room"}))
    assert config["lut_room"] == "slack"
    assert sim_main(["run", "--like-replay", str(tmp_path / "rt-old"), "--out", str(tmp_path / "old"), "--no-plots"]) == 0
    assert "--lut-room pool" in capsys.readouterr().out
    assert json.loads((tmp_path / "old" / "config.json").read_text())["lut_room"] == "pool"
    # a longer warm-up than the one recorded is refused, naming the flag's limit
    assert sim_main(["run", "--budget", "24MiB", "--trace", str(tmp_path / "rt" / "trace"), "--calibration",
                     str(CALIBRATION), "--warmup-requests", "20", "--out", str(tmp_path / "long")]) == 2
    err = capsys.readouterr().err
    assert "--warmup-requests 16 or fewer" in err and "Traceback" not in err and not (tmp_path / "long").exists()


def test_record_routing_with_prefix_caching_exit_2(ap_dir, tmp_path, capsys):
    trace = first_prompts(tmp_path / "load")
    rc = main(["replay", "--trace", str(trace), "--out", str(tmp_path / "rt"), "--ap", str(ap_dir), "--device", "cpu",
               "--record-routing", "--enable-prefix-caching"])
    err = capsys.readouterr().err
    assert rc == 2 and "--record-routing" in err and "--enable-prefix-caching" in err and "Traceback" not in err
    assert not (tmp_path / "rt").exists()


@pytest.mark.parametrize("extra, needles", [
    (["--gpu-memory-budget", "1MiB"], ["cannot hold the model's weights", "raise --gpu-memory-budget"]),
    (["--gpu-memory-budget", "48MiB", "--num-kv-blocks", "8"], ["not both"]),
    (["--gpu-memory-budget", "48 MiBs"], ["--gpu-memory-budget", "cannot read size", "512MiB"]),
])
def test_memory_budget_misuse(ap_dir, capsys, extra, needles):
    rc, _, err = _generate(capsys, "--ap", str(ap_dir), "--calibration", str(CALIBRATION), "--policy", "pagedweight",
                           "--prompt", "x", *extra)
    assert rc == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert all(needle in err for needle in needles), err


def test_memory_budget_without_ap_exit_2(capsys):
    rc, _, err = _generate(capsys, "--gpu-memory-budget", "48MiB", "--prompt", "x")
    assert rc == 2 and "needs --ap" in err and "--num-kv-blocks" in err


def test_a_kv_growth_the_device_cannot_back_leaves_the_pool_and_loses_nothing(ap_dir, caplog):
    """The device refuses every KV growth past a size (as cuMemCreate does when it is out of memory): the pool and the
    cache stay as they were, the bytes stay spare under the budget, the growth is retried only once more bytes are
    released, and every request still finishes with all its tokens."""
    from pwruntime.cli import _registrars
    from pwruntime.cmd_generate import build_engine
    from pwruntime.sampling import SamplingParams
    from pwruntime.vmm import VmmOutOfMemory
    from traces.clikit import build_parser
    from traces.io import read_requests

    bundled = Path(__file__).resolve().parents[1] / "traces" / "bundled"
    trace = read_requests(bundled / "demo-trace" / "requests.parquet")
    args = build_parser("pwruntime", "", _registrars()).parse_args(
        ["generate", "--ap", str(ap_dir), "--calibration", str(CALIBRATION), "--policy", "pagedweight",
         "--gpu-memory-budget", "24MiB", "--dtype", "bf16", "--prompt", "x"])
    engine, *_ = build_engine(args)
    cap = engine.kv.num_blocks + 8
    resize, attempts = engine.kv.resize, []

    def refusing(n):
        if n > cap:
            attempts.append(engine.capacity.spare_bytes)
            raise VmmOutOfMemory("cuMemCreate failed: CUDA driver error 2 (out of memory)")
        resize(n)

    engine.kv.resize = refusing
    ids = [engine.add_request(trace.prompt_ids(i), SamplingParams(max_tokens=48, ignore_eos=True)) for i in range(32)]
    outputs = {}
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id] = out
        assert engine.kv.num_blocks == engine.pool.id_limit <= cap   # the pool never counts blocks the cache lacks
    assert sorted(outputs) == sorted(ids) and all(len(o.token_ids) == 48 for o in outputs.values())
    assert engine.capacity.grow_failures == len(attempts) > 0
    assert all(b > a for a, b in zip(attempts, attempts[1:]))   # each retry had more spare bytes than the last
    assert "growing the KV cache by" in caplog.text


def test_both_engines_keep_the_free_blocks_the_calibration_names(ap_dir, tmp_path):
    """T_blk (Eq. 7) is the calibration's `free_block_threshold` in both engines (the runtime once kept 8 whatever
    the calibration said, and planned apart from the simulator with any other)."""
    import argparse
    import dataclasses

    from pwruntime.cmd_generate import add_engine_args, build_engine
    from pwruntime.sampling import SamplingParams
    from pwsim.runner import build, make_config

    cal = dataclasses.replace(Calibration.load(CALIBRATION), free_block_threshold=3)
    cal.save(tmp_path / "cal")
    p = argparse.ArgumentParser()
    add_engine_args(p)
    engine = build_engine(p.parse_args(["--ap", str(ap_dir), "--calibration", str(tmp_path / "cal"), "--policy",
                                        "pagedweight", "--num-kv-blocks", "12", "--block-size", "4"]))[0]
    engine.add_request("x", SamplingParams(max_tokens=2, ignore_eos=True))
    engine.step()
    assert engine.last_observation.free_block_threshold == 3
    assert build(make_config("24MiB", policy="pagedweight", calibration=str(tmp_path / "cal"))).threshold == 3
