"""The simulated replica: completion, KV pool bounds, the memory budget, the PCIe link, commit points, determinism."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import simpy

from policies.contract import Transition
from policies.page_table import PageTable
from pwsim.engine import BudgetError
from pwsim.link import LinkMover
from traces.hardware import load_profile
from sim_fixtures import same_arrays, summary_without_wall, tiny_card, tiny_sim, tiny_workload, weights_at


@pytest.mark.parametrize("policy", ["pagedweight", "uniform-4", "static-mixed", "noop"])
def test_every_request_completes(policy):
    sim = tiny_sim(policy, kv_blocks=20, n=30)
    res = sim.run()
    r = res.requests
    assert res.summary["completed"] == 30 and res.summary["unfinished"] == 0
    assert (r["finish_reason"] == "length").all()
    assert (r["output_tokens"] == sim.workload.requests.output_tokens).all()  # every requested token was generated
    assert (r["first_token_s"] >= r["arrival_s"]).all() and (r["finish_s"] >= r["first_token_s"]).all()
    assert not sim.sched.has_unfinished() and sim.pool.num_used == 0


def test_on_finish_is_called_once_per_finished_request_and_changes_nothing():
    seen = []
    sim = tiny_sim("pagedweight", kv_blocks=20, n=30)
    res = sim.run(on_finish=lambda: seen.append(1))
    assert len(seen) == 30
    plain = tiny_sim("pagedweight", kv_blocks=20, n=30).run()
    assert summary_without_wall(res.summary) == summary_without_wall(plain.summary)


def test_kv_blocks_never_exceed_the_pool_and_pool_follows_the_weights():
    sim = tiny_sim("pagedweight", kv_blocks=16, n=30)
    res = sim.run()  # check_invariants=True: pool and table invariants after every boundary
    tl = res.timeline
    B = sim.kv_block_bytes
    assert (tl["kv_used_bytes"] <= tl["kv_pool_bytes"]).all()
    assert (tl["free_blocks"] <= tl["total_blocks"]).all() and (tl["free_blocks"] >= 0).all()
    assert (tl["kv_pool_bytes"] == tl["kv_pool_bytes"] // B * B).all()
    # offloads gave memory to the KV pool: at some point it held more blocks than the start
    assert tl["total_blocks"].max() > tl["total_blocks"][0]
    assert tl["weight_bytes"].min() < tl["weight_bytes"][0]


def test_timeline_records_each_iterations_decode_tokens():
    """As the runtime's replay does: an iteration's decode tokens (what `pwsim fidelity` splits iterations by)."""
    res = tiny_sim("pagedweight", kv_blocks=64, n=30).run()
    tl = res.timeline
    batch, decode, seqs = tl["batch_tokens"], tl["decode_tokens"], tl["batch_seqs"]
    assert ((0 <= decode) & (decode <= batch)).all()
    assert ((decode <= seqs) & (seqs <= batch)).all()  # each decode a sequence; every sequence computes a token
    assert (seqs[batch > decode] > decode[batch > decode]).all()  # a step with prompt tokens has a prompt's sequence
    assert ((batch > decode) & (batch > 0)).any() and ((batch == decode) & (batch > 0)).any()  # mixed and decode-only


def test_memory_over_budget_is_recorded_never_hidden():
    """A pool grown two blocks past the budget (as a buggy planner could leave it) is over at every check: each is
    recorded, with its excess, and the summary counts them all."""
    sim = tiny_sim("pagedweight", kv_blocks=16, n=30)
    sim.pool.grow(2)
    res = sim.run()
    tl, budget = res.timeline, sim.cfg.budget_bytes
    over_steps = set(tl["step"][tl["memory_bytes"] > budget].tolist())
    recorded = {v["step"] for v in res.violations}
    assert over_steps and over_steps <= recorded  # every boundary over budget appears in the violations
    assert res.summary["memory"]["budget_violations"] == len(res.violations) >= len(over_steps)
    assert res.summary["memory"]["max_excess_bytes"] == 2 * 16 * tiny_card().kv_bytes_per_token()
    for v in res.violations:
        assert v["memory_bytes"] == v["weight_bytes"] + v["kv_pool_bytes"] > v["budget_bytes"]
        assert v["excess_bytes"] == v["memory_bytes"] - v["budget_bytes"]
    # a warm-up's checks stay in the record (its own recorder's peak and violations are taken over)
    from pwsim.recorder import Recorder
    main, warm_up = Recorder(1, np.zeros(1)), Recorder(1, np.zeros(1))
    main.memory(0.0, 9, 10, 5, budget=20, where="boundary")
    warm_up.memory(0.0, 3, 20, 4, budget=20, where="boundary")
    main.keep_memory_checks(warm_up)
    assert main.counters["budget_violations"] == 1 and [v["step"] for v in main.violations] == [3]
    assert main.peak == {"memory_bytes": 24, "weight_bytes": 20, "kv_pool_bytes": 4}
    # with slack for the LUTs an offload holds in flight, the same run stays within the budget
    roomy = tiny_sim("pagedweight", kv_blocks=16, n=30, slack=256 * 1024).run()
    assert roomy.summary["memory"]["budget_violations"] == 0
    assert (roomy.timeline["memory_bytes"] <= roomy.summary["memory"]["budget_bytes"]).all()


def test_the_largest_of_the_varying_excesses_is_the_summary_s_max_excess():
    from pwsim.recorder import Recorder
    sim = tiny_sim("noop", kv_blocks=16, n=2)
    rec = Recorder(2, np.zeros(2), kv_block_bytes=sim.kv_block_bytes)
    for step, kv in enumerate((12, 17, 9, 14)):  # excesses 2, 7, none and 4 over a budget of 20
        rec.memory(0.1 * step, step, 10, kv, budget=20, where="boundary")
    memory = rec.result(sim).summary["memory"]
    assert memory["budget_violations"] == 3 and memory["max_excess_bytes"] == 7 and memory["peak_bytes"] == 27


def test_mean_committed_bits_weigh_each_boundary_s_bits_by_the_time_until_the_next():
    """The bits committed at a boundary hold until the next one (from the start's bits at time 0), and the last
    boundary's until the last request finishes."""
    from pwsim.recorder import Recorder
    sim = tiny_sim("pagedweight", kv_blocks=12, n=30, slack=256 * 1024)
    res = sim.run()
    tl, end = res.timeline, np.nanmax(res.requests["finish_s"])
    assert len(np.unique(tl["mean_bits"])) > 3 and tl["time_s"][-1] == end
    held = np.diff(np.concatenate([[0.0], tl["time_s"]]))
    bits = np.concatenate([[8.0], tl["mean_bits"][:-1]])
    assert res.summary["mean_committed_bits"] == pytest.approx((bits * held).sum() / end, rel=1e-12)
    small = tiny_sim("noop", kv_blocks=16, n=2)
    rec = Recorder(2, np.zeros(2), kv_block_bytes=small.kv_block_bytes)  # requests finishing after the last boundary
    rec.start(8.0)
    rec.timeline(1.0, 0, 0, 0, small.pool, small.table, small.sched, 0, 4.0)
    rec.finish(0, 2.0, 1, "length", 0)
    rec.finish(1, 3.0, 1, "length", 0)
    assert rec.result(small).summary["mean_committed_bits"] == pytest.approx((8.0 * 1 + 4.0 * 2) / 3)


def test_mean_committed_bits_cover_a_boundary_after_the_last_finish():
    """Requests each larger than the pool are aborted by stalls, the last one before its boundary: the mean holds
    over every boundary it integrates, so bits that never change are their own mean."""
    card = tiny_card()
    res = tiny_sim("uniform-8", kv_blocks=8, card=card,
                   workload=tiny_workload(card, n=3, prompt="fixed:200", output="fixed:8")).run()
    assert set(res.requests["finish_reason"]) == {"kv_capacity"}
    assert res.timeline["time_s"][-1] > np.nanmax(res.requests["finish_s"])
    assert set(res.timeline["mean_bits"]) == {8.0} and res.summary["mean_committed_bits"] == 8.0


def test_static_policy_never_exceeds_the_budget():
    res = tiny_sim("uniform-4", kv_blocks=8, n=20).run()
    assert res.summary["memory"]["budget_violations"] == 0
    assert res.summary["memory"]["peak_bytes"] <= res.summary["memory"]["budget_bytes"]


def test_budget_below_the_weights_is_refused():
    with pytest.raises(BudgetError, match="raise the budget"):
        tiny_sim("uniform-8", kv_blocks=-1)  # one KV block short of the 8-bit weights


def test_link_transfers_serialize_at_h2d_bandwidth():
    sim = tiny_sim("pagedweight", kv_blocks=16, n=40, slack=256 * 1024)
    res = sim.run()
    tr = res.transfers
    assert len(tr) > 5, "the scenario must reload"
    order = np.argsort(tr[:, 1], kind="stable")
    start, end, nbytes = tr[order, 1], tr[order, 2], tr[order, 3]
    assert (start[1:] >= end[:-1] - 1e-15).all(), "two reloads overlapped on the link"
    assert np.allclose(end - start, nbytes / sim.profile.h2d_bytes_per_s, rtol=1e-9)
    assert res.summary["page_traffic"]["reload_bytes"] == int(nbytes.sum())
    log, M = res.plan_log, sim.table.M  # the planes the offloads begun released: their bits' bytes less the new
    off = (log["status"] == "started") & (log["to_bits"] < log["from_bits"])
    released = M[log["block"][off], log["from_bits"][off]] - M[log["block"][off], log["to_bits"][off]]
    assert res.summary["page_traffic"]["offload_bytes_released"] == int(released.sum()) > 0


@pytest.mark.parametrize("asynchronous, slow_device", [(False, False), (True, False), (True, True)])
def test_table_changes_only_at_iteration_boundaries_and_reloads_commit_after_landing(asynchronous, slow_device):
    """slow_device: a device a thousand times slower, so a launched forward outlasts the host's work."""
    profile = load_profile("h200-roofline")
    if slow_device:
        profile = replace(profile, hbm_gbps=profile.hbm_gbps / 1000, fp16_tflops=profile.fp16_tflops / 1000)
    sim = tiny_sim("pagedweight", kv_blocks=16, n=40, slack=256 * 1024, async_scheduling=asynchronous,
                   profile=profile)
    table: PageTable = sim.table
    commits: list[tuple[int, float]] = []
    boundary_times: list[float] = []
    offload_begun: dict[int, int] = {}
    offload_steps: list[tuple[int, int]] = []

    def guard(name):
        orig = getattr(table, name)

        def wrapped(i, *a):
            assert sim.in_boundary, f"{name} outside an iteration boundary at t={sim.env.now}"
            if name == "finish_reload":
                commits.append((i, sim.env.now))
            elif name == "begin_offload":
                offload_begun[i] = sim._step
            elif name == "finish_offload":
                offload_steps.append((offload_begun.pop(i), sim._step))
            return orig(i, *a)
        setattr(table, name, wrapped)

    for name in ("begin_offload", "finish_offload", "begin_reload", "finish_reload"):
        guard(name)
    step = sim.loop.step

    def step_logged(obs):
        boundary_times.append(sim.env.now)
        return step(obs)
    sim.loop.step = step_logged
    in_flight: dict[int, bool] = {}  # step -> whether a launched forward still ran on the device as its boundary planned
    mover_boundary = sim.mover.boundary

    def boundary_logged(forward_in_flight=False):
        in_flight[sim._step] = forward_in_flight
        return mover_boundary(forward_in_flight)
    sim.mover.boundary = boundary_logged
    res = sim.run()
    assert commits and offload_steps, "the scenario must reload and offload"
    # an offload's planes are released once no queued forward can read them: at the boundary that began it when
    # nothing runs there (always when the engine schedules synchronously, as in the runtime), at the next one when the
    # batch launched before the boundary (asynchronous scheduling) outlasts the host's work
    assert all(end == begin + in_flight[begin] for begin, end in offload_steps)
    assert any(in_flight.values()) == (asynchronous and slow_device)
    assert any(end == begin + 1 for begin, end in offload_steps) == (asynchronous and slow_device)
    landed = {}
    for block, _, end, _ in res.transfers.tolist():
        landed.setdefault(int(block), []).append(end)
    bt = np.array(boundary_times)
    for block, t in commits:
        ends = [e for e in landed[block] if e <= t + 1e-15]
        assert ends, f"block {block} committed at {t} before its planes landed"
        first_after = bt[bt >= max(ends) - 1e-15].min()
        assert t == first_after, "a landed reload must commit at the first boundary after it lands"


def test_same_seed_same_results_and_other_seed_differs():
    a = tiny_sim("pagedweight", kv_blocks=16, n=30, seed=3).run()
    b = tiny_sim("pagedweight", kv_blocks=16, n=30, seed=3).run()
    assert summary_without_wall(a.summary) == summary_without_wall(b.summary)
    assert same_arrays(a.requests, b.requests) and same_arrays(a.timeline, b.timeline)
    assert np.array_equal(a.transfers, b.transfers)
    c = tiny_sim("pagedweight", kv_blocks=16, n=30, seed=4).run()
    assert not same_arrays(a.requests, c.requests)


def test_memory_stall_is_recorded_and_an_oversized_request_finishes():
    card = tiny_card()
    wl = tiny_workload(card, n=3, prompt="fixed:200", output="fixed:8")  # 208 tokens = 13 blocks each
    sim = tiny_sim("uniform-8", kv_blocks=8, card=card, workload=wl)  # the pool holds fewer than one request
    res = sim.run()
    assert res.summary["stalls"]["memory"]["count"] > 0
    assert set(res.requests["finish_reason"]) == {"kv_capacity"}  # no request is lost: each finishes


def test_budget_pressure_lowers_bits_and_quality_damage():
    roomy = tiny_sim("pagedweight", kv_blocks=400, n=30, slack=256 * 1024).run()
    tight = tiny_sim("pagedweight", kv_blocks=12, n=30, slack=256 * 1024).run()
    assert roomy.summary["plans"]["plans"] == 0 and roomy.summary["mean_committed_bits"] == 8.0
    assert tight.summary["mean_committed_bits"] < 8.0
    assert tight.summary["quality"]["mean_damage_per_token"] > roomy.summary["quality"]["mean_damage_per_token"]


@pytest.mark.parametrize("asynchronous", [False, True])
def test_each_sampled_token_accrues_the_damage_of_its_own_position_s_routing(asynchronous):
    """A request's damage per token is the mean over the positions that sample its tokens (the prompt's last, then
    each decode's) of the damage of that position's own routing at the committed bits, not a neighbour's."""
    from pwsim.quality import QualityModel

    sim = tiny_sim("uniform-4", kv_blocks=400, n=12, async_scheduling=asynchronous)
    res = sim.run()
    assert res.summary["preemptions"] == 0 and (sim.table.q == 4).all()  # every token read the same bits
    wl, card = sim.workload, sim.card
    fresh = QualityModel(sim.cal.domain_damage, card.moe_layers, card.experts)
    want = []
    for r in range(len(wl)):
        P, O = int(wl.requests.prompt_tokens[r]), int(wl.requests.output_tokens[r])
        ids = wl.routing.route(np.array([r]), np.array([P - 1]), np.array([O])).ids  # positions P-1 .. P+O-2
        dmg = fresh.accrue(sim.table.q, np.full(O, sim._req_dom[r]), np.ascontiguousarray(ids.transpose(1, 0, 2)))
        want.append(dmg.mean())
    assert np.allclose(res.requests["damage_per_token"], want, rtol=1e-9)


def test_offload_luts_borrow_the_slack_within_the_budget():
    """An offload's lower LUT is held by the allocator slack while in flight (`lut_room="slack"`, the runtime's
    default): every boundary within the budget, and what the slack holds back in it once the offload lands; with
    `lut_room="pool"` the pool is shrunk for the LUTs instead and plans are refused for want of them."""
    runs = {}
    for room in ("slack", "pool"):
        sim = tiny_sim("pagedweight", kv_blocks=12, n=30, slack=256 * 1024, lut_room=room)
        borrowed, repay = [], sim.loop._repay  # what each landing offload had borrowed

        def repaid(i, _repay=repay, _loop=sim.loop):
            borrowed.append(_loop.lut_borrowed)
            assert 0 <= _loop.lut_borrowed <= _loop.lut_slack_bytes
            return _repay(i)
        sim.loop._repay = repaid
        res = sim.run()
        assert sim.loop.lut_borrowed == 0
        s = res.summary
        assert s["memory"]["budget_violations"] == 0 and s["plans"]["plans"] > 5
        runs[room] = (max(borrowed), sum(s["plans"]["transitions_rejected"].values()))
    assert runs["slack"][0] > 0 and runs["pool"][0] == 0
    assert runs["slack"][1] < runs["pool"][1], runs
    with pytest.raises(ValueError, match="lut_room"):
        tiny_sim("pagedweight", lut_room="kv")


def test_a_kv_pool_resize_charges_the_cache_s_copy():
    """A resize of the pool's id space charges the next forward the runtime's copy of the blocks kept and zeroing of
    those added (read and written at the profile's streaming bandwidth), and counts it; no change, no charge."""
    sim = tiny_sim("pagedweight", kv_blocks=12, n=30, slack=256 * 1024)
    B, bw, before = sim.kv_block_bytes, sim.profile.bandwidth("dense"), sim.pool.id_limit
    sim._extra_time = 0.0
    sim._resized(before)
    assert sim._extra_time == 0.0 and sim.rec.counters["kv_resizes"] == 0
    sim.pool.grow(5)
    sim._resized(before)
    assert sim._extra_time == pytest.approx((2 * before + 5) * B / bw) and sim.rec.counters["kv_resizes"] == 1
    res = tiny_sim("pagedweight", kv_blocks=12, n=30, slack=256 * 1024).run()
    assert res.summary["counters"]["kv_resizes"] > 5  # under pressure the pool follows the planes


def test_an_expert_missing_only_its_gate_up_is_absent_for_a_forward():
    """An expert needs both blocks: one whose gate_up planes are all gone (its down resident), or its down planes,
    makes a forward that routes to it wait for a fetch, and run anyway, counted, when no planner fetches it."""
    sim = tiny_sim("noop", kv_blocks=16, n=2)
    gate_up = sim.table.index(0, 0, 0)
    sim.table.begin_offload(gate_up, 0)
    sim.table.finish_offload(gate_up)
    sim._refresh()   # the page table changed outside a plan step: the weight bytes follow it
    used = np.zeros((sim.table.layers, sim.table.experts), bool)
    used[0, 0] = True
    assert list(sim._wait_for_absent(used)) == []   # nothing in flight to wait on: noop plans no fetch
    assert sim.rec.counters["forwards_with_absent_experts"] == 1
    stalls = sim.rec.stall_count["absent_experts"]
    used[0, 0], used[0, 1] = False, True            # an expert with both blocks resident: no wait
    assert list(sim._wait_for_absent(used)) == [] and sim.rec.counters["forwards_with_absent_experts"] == 1
    assert sim.rec.stall_count["absent_experts"] == stalls   # and no stall recorded for it
    down = sim.table.index(0, 2, 1)                  # one missing only its down planes is absent too
    sim.table.begin_offload(down, 0)
    sim.table.finish_offload(down)
    sim._refresh()
    used[0, 1], used[0, 2] = False, True
    assert list(sim._wait_for_absent(used)) == [] and sim.rec.counters["forwards_with_absent_experts"] == 2


def test_weight_accounting_matches_the_page_table():
    sim = tiny_sim("pagedweight", kv_blocks=16, n=20, slack=256 * 1024)
    sim.run()
    from policies.planners import weight_bytes  # the one function engines size memory with
    assert sim.used_bytes()[0] == sim.nonexpert_bytes + weight_bytes(sim.policy, sim.table)
    assert sim.used_bytes()[0] == sim.nonexpert_bytes + sim.table.resident_bytes()
    assert weights_at(sim.card, 8) == sim.nonexpert_bytes + sim.card.expert_bytes(8)


def test_forward_waits_for_absent_experts_to_be_fetched():
    card = tiny_card()
    table = card.page_table()
    per_expert = int(table.M[0, 4] + table.M[1, 4])
    wl = tiny_workload(card, n=6, rate=5.0, prompt="fixed:2")  # one short request at a time: <= 8 experts a forward
    sim = tiny_sim("expert-lru", kv_blocks=24, card=card, workload=wl, params={"budget_bytes": 8 * per_expert})
    res = sim.run()
    s = res.summary
    assert s["completed"] == 6
    assert s["stalls"]["absent_experts"]["count"] > 0 and s["counters"].get("forwards_with_absent_experts", 0) == 0
    # the forwards waited exactly for fetches on the link (nothing else is timed during those stalls)
    assert 0 < s["stalls"]["absent_experts"]["time_s"] <= s["page_traffic"]["link_busy_s"] + 1e-12
    assert sim.policy.misses > 0 and s["memory"]["budget_violations"] == 0
    # every stall's time counts, and the link's busy time is the sum of its transfers' durations
    stalls = [x["duration_s"] for x in res.stalls if x["kind"] == "absent_experts"]
    assert s["stalls"]["absent_experts"]["count"] == len(stalls) > 1
    assert s["stalls"]["absent_experts"]["time_s"] == pytest.approx(sum(stalls))
    t = res.transfers
    assert len(t) and s["page_traffic"]["link_busy_s"] == pytest.approx(float((t[:, 2] - t[:, 1]).sum()))
    # memory in use at a boundary: the weights and the KV blocks sequences hold, not the whole pool
    tl = res.timeline
    assert s["memory"]["peak_used_bytes"] == int((tl["weight_bytes"] + tl["kv_used_bytes"]).max())
    assert s["memory"]["peak_used_bytes"] < int(tl["memory_bytes"].max())


def test_async_scheduling_serves_every_token_in_the_runtimes_order():
    """With async scheduling the planner's boundary comes after the next batch is launched: its sequences hold a
    pending token there (never without), and every request still gets every token, deterministically."""
    from policies.sequence import PENDING_TOKEN

    runs = {}
    for asynchronous in (False, True):
        sim = tiny_sim("pagedweight", kv_blocks=16, n=30, async_scheduling=asynchronous)
        pending_at_boundary = []
        step = sim.loop.step

        def step_logged(obs, sim=sim, seen=pending_at_boundary):
            seen.append(any(PENDING_TOKEN in s.output_token_ids for s in sim.sched.running))
            return step(obs)
        sim.loop.step = step_logged
        res = sim.run()
        r = res.requests
        assert res.summary["completed"] == 30 and (r["output_tokens"] == sim.workload.requests.output_tokens).all()
        assert not sim.sched.has_unfinished() and sim.pool.num_used == 0
        assert any(pending_at_boundary) == asynchronous
        runs[asynchronous] = res
    again = tiny_sim("pagedweight", kv_blocks=16, n=30, async_scheduling=True).run()
    assert summary_without_wall(again.summary) == summary_without_wall(runs[True].summary)
    assert same_arrays(again.timeline, runs[True].timeline)
    assert not same_arrays(runs[False].timeline, runs[True].timeline)


@pytest.mark.parametrize("asynchronous, outputs", [(False, 9), (True, 8)])
def test_a_sequence_aborted_after_its_launch_is_credited_only_its_settled_tokens(asynchronous, outputs):
    """A 120-token prompt in a pool of 8 blocks (128 positions) samples 9 tokens (at positions 119..127) and then
    cannot grow: the stall aborts it at once (stall_limit 0). Asynchronously the 9th is still pending when the next
    schedule aborts it, so it is dropped, and settling that launched batch afterwards credits it nothing."""
    card = tiny_card()
    wl = tiny_workload(card, n=1, prompt="fixed:120", output="fixed:30")
    finished = []
    sim = tiny_sim("uniform-8", kv_blocks=8, card=card, workload=wl, async_scheduling=asynchronous, stall_limit=0)
    finish = sim._finish
    sim._finish = lambda seq: (finished.append(seq.num_output_tokens), finish(seq))
    res = sim.run()
    assert list(res.requests["finish_reason"]) == ["kv_capacity"] and finished == [outputs]
    assert list(res.requests["output_tokens"]) == [outputs] and res.summary["output_tokens"] == outputs


def test_async_iterations_take_the_longer_of_device_and_host_work():
    """Asynchronous: an iteration lasts max(device, host) where a synchronous one lasts their sum (a profile whose
    host work, 500 us an iteration, exceeds the tiny model's device work)."""
    from dataclasses import replace as dc_replace

    from traces.hardware import load_profile

    for asynchronous in (False, True):
        sim = tiny_sim("noop", kv_blocks=64, n=12, async_scheduling=asynchronous)
        sim.profile = dc_replace(load_profile("h200-roofline"), iteration_overhead_us=500.0)
        sim.cost = type(sim.cost)(sim.card, sim.profile)
        costs, lasted = [], []
        run, iteration = sim._run, sim.rec.iteration

        def run_logged(b, overlap, costs=costs, run=run):
            costs.append(b.cost)
            return run(b, overlap)

        def iteration_logged(now, dt, *a, lasted=lasted, iteration=iteration, **kw):
            lasted.append(dt)
            return iteration(now, dt, *a, **kw)
        sim._run, sim.rec.iteration = run_logged, iteration_logged
        assert sim.run().summary["completed"] == 12
        assert len(costs) == len(lasted) > 12
        device = np.array([c.total - c.overhead for c in costs])
        host = np.array([c.overhead for c in costs])
        assert (device > 0).all() and (device < host).all()
        want = host if asynchronous else host + device
        assert np.allclose(lasted, want, rtol=1e-12, atol=0)


def test_warm_up_serves_the_first_prompts_before_the_clock_and_keeps_their_plans():
    """`warmup_requests` (the runtime replay's `--warmup-requests`): the trace's first prompts, WARMUP_TOKENS tokens
    each at once, before the clock starts: every metric covers the trace alone (its requests, arrivals and tokens;
    times from 0; boundary steps counted on from the warm-up's), while what the warm-up's pressure planned stays
    (the run starts at the bits it left); deterministic, and the same as no warm-up when it is 0."""
    from traces.results import WARMUP_TOKENS

    cold = tiny_sim("pagedweight", kv_blocks=12, n=30).run()
    assert cold.timeline["step"][0] == 0
    sim = tiny_sim("pagedweight", kv_blocks=12, n=30, warmup_requests=8)
    served = []
    add = sim.sched.add
    sim.sched.add = lambda seq: served.append((seq.seq_id, seq.max_tokens)) or add(seq)
    warm = sim.run()
    wl = sim.workload
    assert served[:8] == [(r, min(WARMUP_TOKENS, int(wl.requests.output_tokens[r]))) for r in range(8)]
    assert [s for s, _ in served[8:]] == list(range(30))  # then the whole trace, from its first request
    r = warm.requests
    assert warm.summary["completed"] == 30 and (r["output_tokens"] == wl.requests.output_tokens).all()
    assert np.allclose(r["arrival_s"], wl.requests.arrival_s) and (r["ttft_s"] > 0).all()
    t = warm.timeline
    assert t["step"][0] > 0 and 0 < t["time_s"][0] < 0.01  # the warm-up's boundaries came first, off the clock
    assert warm.summary["iterations"] == len(t["step"])
    assert t["mean_bits"][0] < cold.timeline["mean_bits"][0]  # the warm-up's pressure lowered bits that stay
    again = tiny_sim("pagedweight", kv_blocks=12, n=30, warmup_requests=8).run()
    assert summary_without_wall(again.summary) == summary_without_wall(warm.summary)
    assert same_arrays(again.timeline, warm.timeline)
    none = tiny_sim("pagedweight", kv_blocks=12, n=30, warmup_requests=0).run()
    assert same_arrays(none.timeline, cold.timeline) and same_arrays(none.requests, cold.requests)


def test_max_concurrency_holds_requests_until_a_slot_frees():
    """As `pwruntime bench serve --max-concurrency`: never more than N requests between their send and their end,
    each sent no earlier than its arrival and timed from its send; no limit is the unlimited run itself."""
    arrivals = tiny_workload(tiny_card(), n=24).requests.arrival_s
    free = tiny_sim("noop", kv_blocks=64, n=24).run()
    held = tiny_sim("noop", kv_blocks=64, n=24, max_concurrency=3).run()
    sent = held.requests["arrival_s"]
    end = sent + held.requests["e2e_s"]
    assert max(int(((sent <= t) & (end > t)).sum()) for t in sent) == 3
    assert np.all(sent >= arrivals - 1e-12) and np.any(sent > arrivals + 1e-9)  # some waited for a slot
    assert np.allclose(free.requests["arrival_s"], arrivals)  # without a limit, the trace's own times
    assert held.summary["completed"] == free.summary["completed"] == 24


def test_a_plan_s_host_work_lets_its_small_reloads_land_at_the_boundary_that_began_them():
    """`LinkMover`: transition k of a boundary is queued (k - 1) * plan_transition_us after it and the plan's moves end
    n of them after it; a reload copied by then lands at that boundary (the runtime's `landed()` follows the plan),
    a longer one at the first boundary after its copy; copies follow each other on the link; with no host cost per
    transition nothing copied lands at the boundary that began it."""

    def plan(transition_s: float, sizes: list[int]) -> tuple[LinkMover, list[int]]:
        env = simpy.Environment()
        mover = LinkMover(env, 1e9, lambda: None, transition_s=transition_s)  # 1 GB/s: 1 us a kB
        mover.boundary()
        for block, nbytes in enumerate(sizes):
            mover.start(Transition(block, 3, 4, -nbytes), nbytes)
        mover.start(Transition(9, 4, 3, 100), 0)  # an offload: its host work counts, it lands now
        return mover, mover.landed()

    # 3 transitions of 10 us: the moves end at 30 us; reloads queued at 0 and 10 us, copies of 5 and 40 us
    mover, now = plan(10e-6, [5_000, 40_000])
    assert sorted(now) == [0, 9] and mover.in_flight_reloads == 1
    (_, s0, e0, _), (_, s1, e1, _) = mover.transfers
    assert (s0, e0) == pytest.approx((0.0, 5e-6)) and (s1, e1) == pytest.approx((10e-6, 50e-6))
    env = mover.env
    env.run(until=env.process((lambda: (yield mover.next_landing()))()))
    assert env.now == pytest.approx(50e-6) and mover.in_flight_reloads == 0
    mover.boundary()
    assert mover.landed() == [1]
    # a copy queued behind a longer one waits for the link
    mover, now = plan(10e-6, [40_000, 1_000])
    assert sorted(now) == [9] and [round(t[1] * 1e6) for t in mover.transfers] == [0, 40]
    # no host cost: the plan is instantaneous and every copy lands at a later boundary
    mover, now = plan(0.0, [5_000, 1_000])
    assert now == [9] and mover.in_flight_reloads == 2


def test_the_next_landing_is_the_first_copy_to_finish():
    """A forward that waits for an absent expert waits for the next copy to land, not for the whole queue."""
    env = simpy.Environment()
    mover = LinkMover(env, 1e9, lambda: None)
    mover.boundary()
    for block, nbytes in enumerate([1_000, 3_000]):
        mover.start(Transition(block, 3, 4, -nbytes), nbytes)
    env.run(mover.next_landing())
    assert env.now == pytest.approx(1e-6) and mover.in_flight_reloads == 1


def test_instant_page_moves_land_every_transfer_at_the_boundary_that_began_it():
    """`LinkMover(instant=True)`, the CPU runtime's moves: reloads of any size land at the boundary that began them
    and take no link time; offloads begun while a forward may still read their planes land at once too (the
    link's default holds them a boundary)."""

    def plan(instant: bool) -> tuple[LinkMover, list[int]]:
        mover = LinkMover(simpy.Environment(), 1e9, lambda: None, instant=instant)
        mover.boundary(forward_in_flight=True)
        for block, nbytes in enumerate([5_000, 4_000_000]):
            mover.start(Transition(block, 3, 4, -nbytes), nbytes)
        mover.start(Transition(9, 4, 3, 100), 0)
        return mover, mover.landed()

    mover, now = plan(instant=True)
    assert sorted(now) == [0, 1, 9] and mover.in_flight_reloads == 0 and mover.reload_bytes == 4_005_000
    mover.boundary()
    assert mover.landed() == []  # each lands once
    assert all(start == end == 0.0 for _, start, end, _ in mover.transfers)
    mover, now = plan(instant=False)
    assert now == [] and mover.in_flight_reloads == 2


@pytest.mark.parametrize("asynchronous", [False, True])
def test_the_cost_breakdown_adds_up_to_the_forwards_time(asynchronous):
    """cost_breakdown_s: operators plus the planning and KV copies charged besides them make its total, which is the
    forwards' time synchronously (they left the charged host work out) and above it asynchronously, where host and
    device work overlap."""
    from pwsim.runner import execute, make_config
    cfg = make_config("24MiB", policy="pagedweight", async_scheduling=asynchronous, hardware="h200-demo-runtime")
    c = execute(cfg).summary["cost_breakdown_s"]
    ops = c["attention"] + c["moe"] + c["dense"] + c["lm_head"] + c["overhead"]
    assert c["total"] == pytest.approx(ops + c["planning"] + c["kv_copies"])
    assert c["kv_copies"] > 0 and c["planning"] > 0   # the profile charges its routing reads
    if asynchronous:  # below it by more than rounding (a synchronous run's is a few ulps below the total too)
        assert c["iterations_s"] < c["total"] and c["iterations_s"] != pytest.approx(c["total"])
    else:
        assert c["iterations_s"] == pytest.approx(c["total"])


def test_the_simulator_reports_each_request_s_queueing_delay():
    """queue_s: from arrival to the first batch that holds the request, at most its TTFT; with every request at once
    and few sequences at a time, later requests wait longer."""
    from pwsim.runner import execute, make_config
    res = execute(make_config("48MiB", policy="uniform-4", time_scale=0.0, max_num_seqs=4))
    q, ttft = res.requests["queue_s"], res.requests["ttft_s"]
    assert np.all(q >= 0) and np.all(q <= ttft + 1e-12) and q.max() > 10 * max(q.min(), 1e-9)
    assert res.summary["queue_s"]["max"] == pytest.approx(q.max())


def test_a_timeline_stride_keeps_every_nth_boundary_from_the_first():
    every = tiny_sim("pagedweight", kv_blocks=24).run().timeline
    third = tiny_sim("pagedweight", kv_blocks=24, timeline_stride=3).run().timeline
    assert len(every["time_s"]) > 6
    for column in ("time_s", "step", "kv_pool_bytes", "mean_bits"):
        np.testing.assert_array_equal(third[column], every[column][::3])


def test_a_reserve_that_retires_blocks_below_a_live_one_compacts_the_pool():
    """A reload's room taken from the KV pool retires its highest free blocks; where one of them lies below a live
    block, the pool is compacted (as the runtime's KvCapacity does): no hole is left, the move is counted, and the
    next forward pays the copy of each moved block (read and written over the KV link)."""
    sim = tiny_sim("pagedweight", kv_blocks=12, n=30)
    pool, B = sim.pool, sim.kv_block_bytes
    n = pool.capacity
    pool.allocate("low", 4 * pool.block_size)
    pool.allocate("high", pool.block_size)  # block 4, live above the 4 free blocks below it
    pool.free("low")
    sim._extra_time = 0.0
    assert sim._reserve(sim._headroom() + (n - 4) * B)  # retires the n - 5 free blocks above 4 and block 3
    assert pool.hole_blocks == 0 and pool.id_limit == pool.capacity == 4
    assert pool.block_table("high")[0] < 4
    c = sim.rec.counters
    assert c["kv_compactions"] == 1 and c["kv_blocks_moved"] == 1
    resize = 2 * 4 * B / sim.profile.bandwidth("dense")  # the cache's copy of the 4 blocks it keeps
    assert sim._extra_time == pytest.approx(2 * B / sim.profile.bandwidth("kv") + resize)


def test_a_boundary_charges_plan_transition_us_for_each_transition_it_began():
    """The host work a boundary charges for its plan's moves is plan_transition_us a transition begun there (not
    one a transfer committed there; on a slow link reloads land boundaries later): each boundary's planning time
    grows by exactly that."""
    profile = replace(load_profile("h200-roofline"), plan_transition_us=37.0, routing_read_us=0.0, pcie_h2d_gbps=0.05)
    sim = tiny_sim("pagedweight", kv_blocks=12, n=30, slack=256 * 1024, profile=profile)
    seen = []  # (transitions begun, transitions committed, planning time the boundary added)
    step, boundary = sim.loop.step, sim._boundary

    def step_logged(obs):
        res = step(obs)
        seen.append([len(res.started), len(res.committed), None])
        return res

    def boundary_logged(*a, **kw):
        before = sim._plan_time
        boundary(*a, **kw)
        seen[-1][2] = sim._plan_time - before
    sim.loop.step, sim._boundary = step_logged, boundary_logged
    assert sim.run().summary["completed"] == 30
    started, committed, added = (np.array(col, dtype=float) for col in zip(*seen))
    assert started.sum() > 10 and (started != committed).any()
    np.testing.assert_allclose(added, started * 37e-6, rtol=1e-12, atol=0)


@pytest.mark.parametrize("asynchronous, slow_device", [(False, False), (True, False), (True, True)])
def test_an_iteration_pays_its_planning_host_work_beside_or_after_the_device_work(asynchronous, slow_device):
    """The host work charged to a forward (planning, KV copies) adds to its time synchronously; asynchronously it
    joins the host's overhead, which overlaps the device work: the iteration lasts the longer of the two (on a
    device ten thousand times slower the device work outlasts it)."""
    profile = replace(load_profile("h200-roofline"), plan_transition_us=300.0, routing_read_us=200.0)
    if slow_device:
        profile = replace(profile, hbm_gbps=profile.hbm_gbps / 1e4, fp16_tflops=profile.fp16_tflops / 1e4)
    sim = tiny_sim("pagedweight", kv_blocks=12, n=30, slack=256 * 1024, profile=profile,
                   async_scheduling=asynchronous)
    rows, take, iteration = [], sim._take_extra, sim.rec.iteration
    run = sim._run

    def run_logged(b, overlap):
        rows.append([b.cost.device, b.cost.overhead, None, None])
        return run(b, overlap)

    def take_logged():
        extra = take()
        if rows and rows[-1][2] is None:
            rows[-1][2] = extra[0]
        return extra

    def iteration_logged(now, dt, *a, **kw):
        rows[-1][3] = dt
        return iteration(now, dt, *a, **kw)
    sim._run, sim._take_extra, sim.rec.iteration = run_logged, take_logged, iteration_logged
    assert sim.run().summary["completed"] == 30
    device, host, extra, lasted = (np.array(col, dtype=float) for col in zip(*rows))
    assert (extra > 0).sum() > 5
    if asynchronous:
        want = np.maximum(device, host + extra)
        slower = device > host + extra
        assert ((slower if slow_device else ~slower) & (extra > 0)).sum() > 5
    else:
        want = device + host + extra
    np.testing.assert_allclose(lasted, want, rtol=1e-12, atol=0)


def test_weights_and_kv_beyond_the_budget_less_the_activation_reserve_are_a_violation():
    """The activation reserve is no memory for the weights and the KV pool: they are checked against the budget less
    the reserve, so a pool one block into the reserve (well within the whole budget) is over at every check."""
    block = 16 * tiny_card().kv_bytes_per_token()
    fits = tiny_sim("noop", kv_blocks=22, n=8, activation_bytes=6 * block)
    assert fits.pool.capacity == 16 and fits.run().summary["memory"]["budget_violations"] == 0
    sim = tiny_sim("noop", kv_blocks=22, n=8, activation_bytes=6 * block)
    sim.pool.grow(1)
    w, kv = sim.used_bytes()
    assert sim.cfg.budget_bytes - 6 * block < w + kv <= sim.cfg.budget_bytes - 5 * block
    res = sim.run()
    assert res.summary["completed"] == 8 and res.summary["memory"]["budget_violations"] == len(res.violations) > 8
    assert {v["budget_bytes"] for v in res.violations} == {sim.cfg.budget_bytes - 6 * block}
    assert {v["excess_bytes"] for v in res.violations} == {block}


def test_a_budget_that_exactly_holds_the_weights_is_accepted():
    """The weights may fill the budget to the byte: no KV room left is not a refusal."""
    sim = tiny_sim("uniform-8", kv_blocks=0)
    assert sim.pool.capacity == 0


def test_routing_reads_are_charged_in_microseconds_as_planning():
    """Each boundary whose planner read the routing charges the profile's routing_read_us (microseconds)."""
    prof = replace(load_profile("h200-roofline"), routing_read_us=250.0, plan_transition_us=0.0)
    res = tiny_sim("pagedweight", kv_blocks=12, profile=prof).run()
    reads = res.summary["counters"]["routing_reads"]
    assert reads > 0
    charged = res.summary["cost_breakdown_s"]["planning"] / 250e-6  # the last boundary's read precedes no forward
    assert charged == pytest.approx(round(charged)) and reads - 1 <= round(charged) <= reads


def test_more_warmup_requests_than_the_trace_warms_up_with_the_whole_trace():
    res = tiny_sim("pagedweight", kv_blocks=12, n=5, warmup_requests=8).run()
    assert res.summary["completed"] == 5


def test_a_progress_bar_shows_on_a_terminal_unless_turned_off(monkeypatch):
    import io
    import sys

    from pwsim.runner import run_simulation

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    for progress in (True, False):
        monkeypatch.setattr(sys, "stderr", Terminal())
        run_simulation(tiny_sim("pagedweight", kv_blocks=24, n=8), progress=progress)
        assert ("simulating" in sys.stderr.getvalue()) == progress


@pytest.mark.parametrize("field, value", [("budget_bytes", 0), ("block_size", 0), ("timeline_stride", 0),
                                          ("prefill_chunk_bytes", 0), ("warmup_requests", -1),
                                          ("activation_bytes", -1), ("max_concurrency", 0)])
def test_sim_config_refuses_each_bad_field_alone(field, value):
    from pwsim.engine import SimConfig
    with pytest.raises(ValueError, match=field):
        SimConfig(**{"budget_bytes": 1 << 30, field: value})
    if field == "max_concurrency":   # one request at a time is a concurrency
        assert SimConfig(budget_bytes=1 << 30, max_concurrency=1).max_concurrency == 1


def test_expert_lru_is_told_only_the_experts_a_step_routed_to():
    """One short request at a time (2-token prompts, top-2 of 8 experts): a step touches at most 4 experts a layer."""
    card = tiny_card()
    wl = tiny_workload(card, n=4, rate=5.0, prompt="fixed:2")
    sim = tiny_sim("expert-lru", kv_blocks=24, card=card, workload=wl)
    touched, touch = [], sim.policy.touch
    sim.policy.touch = lambda used: touched.append(np.asarray(used).copy()) or touch(used)
    assert sim.run().summary["completed"] == 4
    assert touched and all(0 < m.reshape(card.layers, -1).sum(axis=1).max() <= 4 for m in touched)


def test_a_planner_sees_the_budget_s_headroom_never_below_0():
    sim = tiny_sim("pagedweight", kv_blocks=16, n=20, slack=256 * 1024)
    seen, plan_step = [], sim.policy.plan_step
    sim.policy.plan_step = lambda table, obs: seen.append(obs.headroom_bytes) or plan_step(table, obs)
    sim.run()
    assert seen and min(seen) >= 0 and max(seen) > 0
