"""Shared observe/plan/commit pieces: routing mass, prompt features, Observation, PlanLoop."""
from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

from policies.apformat import plane_bytes
import pytest

import policies
from policies.contract import Observation, Plan, Transition
from policies.kv_blocks import BlockPool
from policies.loop import ImmediateMover, PlanLoop, room_for
from policies.features import BatchedPromptFeatures
from policies.observe import RoutingMass, RoutingStats, build_observation, split_tokens
from policies.page_table import PageTable, PlaneState
from policies.scheduler import Scheduler
from policies.sequence import SequenceStatus, make_sequences


def _routing(rng, layers, tokens, experts, k):
    ids = np.stack([np.stack([rng.choice(experts, k, replace=False) for _ in range(tokens)]) for _ in range(layers)])
    w = rng.random((layers, tokens, k))
    return ids.reshape(layers, tokens, k), w / w.sum(-1, keepdims=True)


def test_routing_mass_matches_eq1_without_decay_and_rows_sum_to_one():
    rng = np.random.default_rng(0)
    rm = RoutingMass(3, 5, half_life_tokens=None)
    assert np.all(rm.mass() == 0)
    all_ids, all_w = [], []
    for t in (4, 1, 7):
        ids, w = _routing(rng, 3, t, 5, 2)
        rm.update(ids, w)
        all_ids.append(ids)
        all_w.append(w)
    ids, w = np.concatenate(all_ids, 1), np.concatenate(all_w, 1)
    expect = np.zeros((3, 5))
    for layer in range(3):
        for e in range(5):
            expect[layer, e] = w[layer][ids[layer] == e].sum() / w[layer].sum()
    np.testing.assert_allclose(rm.mass(), expect, rtol=1e-12)
    np.testing.assert_allclose(rm.mass().sum(1), 1.0)
    assert rm.tokens_seen == 12


def test_routing_mass_decays_by_tokens():
    rm = RoutingMass(1, 2, half_life_tokens=4.0)
    rm.update(np.zeros((1, 4, 1), int), np.ones((1, 4, 1)))  # 4 tokens to expert 0
    rm.update(np.ones((1, 4, 1), int), np.ones((1, 4, 1)))  # 4 tokens to expert 1: expert 0 halves first
    np.testing.assert_allclose(rm.mass(), [[2 / 6, 4 / 6]])
    with pytest.raises(ValueError):
        rm.update(np.zeros((2, 1, 1), int), np.ones((2, 1, 1)))


def test_prompt_features_against_direct_computation():
    rng = np.random.default_rng(1)
    layers, experts, k, n = 2, 4, 2, 6
    pf = BatchedPromptFeatures(layers, experts)
    ids, w = _routing(rng, layers, n, experts, k)
    gu = rng.random((layers, n)) + 0.5
    dn = rng.random((layers, n, k)) + 0.5
    pf.update("s", ids[:, :2], w[:, :2], gu[:, :2], dn[:, :2])
    pf.update("s", ids[:, 2:], w[:, 2:], gu[:, 2:], dn[:, 2:])  # accumulation over steps
    phi = pf.sequence_features("s")
    for layer in range(layers):
        for e in range(experts):
            sel = ids[layer] == e
            if not sel.any():
                assert np.all(phi[(layer * experts + e) * 2: (layer * experts + e) * 2 + 2] == 0)
                continue
            r = w[layer][sel]
            for kind, x in ((0, np.broadcast_to(gu[layer][:, None], (n, k))[sel]), (1, dn[layer][sel])):
                row = phi[(layer * experts + e) * 2 + kind]
                np.testing.assert_allclose(row, [(r * x).sum() / r.sum(), np.sqrt((r * x * x).sum() / r.sum()),
                                                 x.max()], rtol=1e-12)


def test_prompt_features_merge_weighted_by_kv_blocks():
    pf = BatchedPromptFeatures(1, 2)
    one = np.ones((1, 1, 1))
    pf.update("a", np.zeros((1, 1, 1), int), one, np.full((1, 1), 2.0), np.full((1, 1, 1), 4.0))
    pf.update("b", np.zeros((1, 1, 1), int), one, np.full((1, 1), 6.0), np.full((1, 1, 1), 8.0))
    pf.update("c", np.ones((1, 1, 1), int), one, np.full((1, 1), 1.0), np.full((1, 1, 1), 1.0))
    merged = pf.merged({"a": 3, "b": 1})  # c is not running
    np.testing.assert_allclose(merged[0], [3.0, 3.0, 3.0])  # (3*2 + 1*6) / 4
    np.testing.assert_allclose(merged[1], [5.0, 5.0, 5.0])
    assert np.all(merged[2:] == 0)  # expert 1 only seen by c
    pf.drop("a")
    np.testing.assert_allclose(pf.merged({"a": 3, "b": 1})[0], [6.0, 6.0, 6.0])


def test_build_observation_from_pool_and_scheduler():
    pool = BlockPool(10, 4)
    sched = Scheduler(pool, max_num_batched_tokens=64)
    for s in make_sequences([6, 3], [5, 5]):
        sched.add(s)
    batch = sched.schedule()
    sched.postprocess(batch, None)
    rs = RoutingStats(1, 2, features=False)
    rs.add([0, 1], [1, 2], np.array([[[0], [1], [1]]]), np.ones((1, 3, 1)))
    obs = build_observation(step=3, time_s=0.5, pool=pool, scheduler=sched, kv_block_bytes=128,
                            free_block_threshold=2, routing=rs)
    assert (obs.free_blocks, obs.total_blocks, obs.num_running, obs.num_waiting) == (7, 10, 2, 0)
    assert obs.pending_kv_blocks == 0  # 7 and 4 tokens fit in their blocks after one decode
    np.testing.assert_allclose(obs.routing_mass, [[1 / 3, 2 / 3]])
    assert obs.prompt_features is None
    assert split_tokens([2, 0, 3]) == [(0, 2), (2, 2), (2, 5)]


def _norms(rng, layers, tokens, k):
    return rng.random((layers, tokens)) + 0.5, rng.random((layers, tokens, k)) + 0.5


@pytest.mark.parametrize("hold_slots,read_at,E", [(1, None, 6), (40, 2, 6), (10_000, 2, 6), (10_000, None, 6),
                                                  (30, None, 6), (10_000, None, 40)])
def test_routing_stats_held_steps_equal_folding_each_step_with_drops_between(hold_slots, read_at, E):
    """Holding steps and folding them (once they route `hold_slots` slots, or on a read; in one batch, or a step at a
    time where experts outnumber the slots: E = 40) gives what folding each at once gives, up to rounding, including
    sequences dropped while their routing is held: finished (b, a), or preempted and recomputed in a later step (c,
    whose recompute's tokens count and its earlier ones do not)."""
    rng = np.random.default_rng(3)
    L, k = 2, 2
    held = RoutingStats(L, E, 64.0, hold_slots=hold_slots)
    ref_mass, ref = RoutingMass(L, E, 64.0), BatchedPromptFeatures(L, E)
    steps = [(["a", "b", "c"], [3, 1, 2]), (["a", "b", "c"], [1, 1, 1]), (["b", "c"], [1, 1]),
             (["a", "c", "d"], [4, 1, 2]), (["c", "d"], [1, 1]), (["d", "c"], [1, 1])]
    drops = {1: ["b"], 2: ["c"], 3: ["a"]}  # after step i: b finishes, c is preempted (recomputed in step 3), a ends
    for i, (seqs, lens) in enumerate(steps):
        n = sum(lens)
        ids, w = _routing(rng, L, n, E, k)
        gu, dn = _norms(rng, L, n, k)
        before = held._held_slots
        held.add(seqs, lens, ids, w, gu, dn)
        assert held._held_slots == ids.size + (0 if before >= hold_slots or i - 1 == read_at else before)
        assert len(held._held) == 1 or held._held_slots - ids.size < hold_slots
        ref_mass.update(ids, w)
        ref.update_batch(seqs, lens, ids, w, gu, dn)
        for s in drops.get(i, []):
            held.drop(s)
            ref.drop(s)
        if i == read_at:  # a read in the middle folds; later steps are held again
            np.testing.assert_allclose(held.sequence_features("d"), ref.sequence_features("d"), rtol=1e-12)
            assert held._held == []
    usage = {"c": 2, "d": 3, "a": 1}
    obs = held.readout(usage)
    np.testing.assert_allclose(obs.mass(), ref_mass.mass(), rtol=1e-12)
    np.testing.assert_allclose(obs.features(), ref.merged(usage), rtol=1e-12)
    for s in "abcd":
        np.testing.assert_allclose(held.sequence_features(s), ref.sequence_features(s), rtol=1e-12)
    assert not held.sequence_features("a").any() and held.sequence_features("c").any()
    assert held.routing.tokens_seen == ref_mass.tokens_seen


@pytest.mark.parametrize("E,updates", [(6, 1), (40, 4)])
def test_routing_stats_batch_held_steps_where_sequences_have_more_slots_than_experts(E, updates):
    """Four decode steps of two sequences fold in one feature update where the sequences' slots (4 tokens x 2 layers
    x top-2 each) reach their experts (2 layers x 6), and a step at a time where experts outnumber them (x 40)."""
    rng = np.random.default_rng(5)
    held, ref = RoutingStats(2, E), BatchedPromptFeatures(2, E)
    calls, update = [], held.prompt.update_batch
    held.prompt.update_batch = lambda *a: calls.append(1) or update(*a)
    for _ in range(4):
        step = (["x", "y"], [1, 1], *_routing(rng, 2, 2, E, 2), *_norms(rng, 2, 2, 2))
        held.add(*step)
        ref.update_batch(*step)
    np.testing.assert_allclose(held.readout({"x": 1, "y": 2}).features(), ref.merged({"x": 1, "y": 2}), rtol=1e-12)
    assert len(calls) == updates


def test_routing_mass_of_several_steps_at_once_is_one_update_a_step():
    """`update_steps` scales each step's weights by the decays after it: the sequential result to rounding, and one
    step bit for bit."""
    rng = np.random.default_rng(8)
    batch, each = RoutingMass(3, 5, 20.0), RoutingMass(3, 5, 20.0)
    steps = [_routing(rng, 3, n, 5, 2) if n else (np.zeros((3, 0, 2), np.int64), np.zeros((3, 0, 2)))
             for n in (4, 1, 0, 7, 2)]
    for ids, w in steps:
        each.update(ids, w)
    batch.update_steps(steps)
    np.testing.assert_allclose(batch.acc, each.acc, rtol=1e-13)
    assert batch.tokens_seen == each.tokens_seen == 14
    one, ref = RoutingMass(3, 5, 20.0), RoutingMass(3, 5, 20.0)
    one.update_steps(steps[:1])
    ref.update(*steps[0])
    np.testing.assert_array_equal(one.acc, ref.acc)
    with pytest.raises(ValueError, match="do not match"):
        batch.update_steps([steps[0], (steps[1][0][:2], steps[1][1][:2])])


def test_routing_stats_readout_is_lazy_and_refuses_a_later_step():
    rng = np.random.default_rng(4)
    rs = RoutingStats(1, 4)
    ids, w = _routing(rng, 1, 2, 4, 2)
    rs.add(["x", "y"], [1, 1], ids, w, *_norms(rng, 1, 2, 2))
    untouched = rs.readout({"x": 1, "y": 1})
    read = rs.readout({"x": 1, "y": 1})
    assert rs._held  # building readouts folds nothing
    phi = read.features()
    assert rs._held == [] and phi.shape == (8, 3) and (phi[:, 0] > 0).sum() >= 2
    assert read.features() is phi  # computed once
    rs.add(["x"], [1], *_routing(rng, 1, 1, 4, 2), *_norms(rng, 1, 1, 2))
    np.testing.assert_array_equal(read.features(), phi)  # read before the next step: kept
    with pytest.raises(RuntimeError, match="within the step"):
        untouched.mass()
    late = rs.readout({"x": 1})
    rs.drop("y")
    with pytest.raises(RuntimeError, match="within the step"):
        late.features()
    without = RoutingStats(1, 4, features=False)
    without.add(["x"], [1], *_routing(rng, 1, 1, 4, 2), *_norms(rng, 1, 1, 2))
    assert without.readout({}).features() is None and without.readout({}).mass().sum() == pytest.approx(1.0)


@dataclass
class ScriptedPolicy:
    """Returns a fixed plan per step (None when the script says so)."""

    script: list
    name: str = "scripted"
    seen: list = field(default_factory=list)

    def reset(self, table, calibration):
        return None

    def plan_step(self, table, observation):
        self.seen.append(observation.step)
        return self.script[observation.step] if observation.step < len(self.script) else None


def _obs(step):
    return Observation(step=step, time_s=0.0, free_blocks=1, total_blocks=4, kv_block_bytes=64,
                       free_block_threshold=2)


def test_plan_loop_offload_then_reload_with_immediate_mover():
    table = PageTable(1, 2, hidden=64, intermediate=32, initial_bits=8)
    off = Transition(0, 8, 4, int(table.M[0, 8] - table.M[0, 4]))
    stale = Transition(1, 6, 4, int(table.M[1, 6] - table.M[1, 4]))
    up = Transition(0, 4, 6, int(table.M[0, 4] - table.M[0, 6]))
    released = []
    asked = []
    loop = PlanLoop(ScriptedPolicy([Plan((off, stale)), None, Plan((up,))]), table, ImmediateMover(),
                    reserve=lambda b: asked.append(b) or True, release=released.append)
    r0 = loop.step(_obs(0))
    assert r0.started == (off,) and r0.rejected[0][0] == stale and "stale" in r0.rejected[0][1]
    # the offload first asks for room for LUT_4, then gives back the surplus planes and LUT_8
    lut4 = int(table.M[0, 4] - 4 * plane_bytes(*table.shapes[0]))
    assert asked == [lut4]
    assert r0.committed == (0,) and r0.released_bytes == released[0] == off.delta_bytes + lut4
    assert r0.reserved_bytes == 0   # an offload reserves nothing: its LUT's room is not a reload's bytes
    assert table.q[0] == 4 and not table.busy.any()
    assert np.all(table.planes[0, 4:] == PlaneState.CPU)
    assert loop.step(_obs(1)).plan is None
    r2 = loop.step(_obs(2))
    assert r2.committed == (0,) and table.q[0] == 6 and asked[-1] == r2.reserved_bytes == room_for(table, up) > 0
    # when the reload lands, the LUT it replaced (4 bits) goes back, not the one it brought
    assert r2.released_bytes == released[-1] == lut4
    table.check_invariants()


@pytest.mark.parametrize("start, to, why", [(4, 8, "no room for the reload"),
                                             (8, 4, "no room for the lower bitwidth's LUT")])
def test_plan_loop_refuses_a_transition_without_room(start, to, why):
    """The engine's `reserve` finds no room: a reload is refused, and so is an offload with no slack to borrow for its
    lower LUT (`lut_slack_bytes` 0)."""
    table = PageTable(1, 1, hidden=64, intermediate=32, initial_bits=start)
    t = Transition(0, start, to, int(table.M[0, start] - table.M[0, to]))
    loop = PlanLoop(ScriptedPolicy([Plan((t,))]), table, reserve=lambda b: False)
    r = loop.step(_obs(0))
    assert r.started == () and r.rejected[0][1] == why and table.q[0] == start and loop.lut_borrowed == 0



def test_room_left_counts_what_the_plan_still_asks_for():
    """While a plan is begun, `room_left` is the bytes its transitions not begun yet will ask `reserve` for (the one
    being reserved for included): reloads' planes and new LUT, offloads' new LUT; a refused one is no longer
    counted once refused, and nothing is outside a plan."""
    from policies.apformat import lut_bytes
    table = PageTable(1, 3, hidden=64, intermediate=32, initial_bits=6)
    table.initialize(np.array([6, 6, 4, 4, 8, 8]))
    def move(i, frm, to):
        return Transition(i, frm, to, int(table.M[i, frm] - table.M[i, to]))
    up0, up1 = move(2, 4, 6), move(3, 4, 5)
    down, stale = move(4, 8, 3), move(5, 7, 3)
    too_high, unsupported = Transition(1, 6, 9, 0), move(0, 6, 2)  # the table serves 3..8 bits
    seen = []
    loop = PlanLoop(ScriptedPolicy([Plan((up0, down, stale, too_high, unsupported, up1))]), table, ImmediateMover(),
                    reserve=lambda b: seen.append((b, loop.room_left())) or True)
    assert loop.room_left() == 0

    def reload(i, frm, to):
        out, inp = (int(x) for x in table.shapes[i])
        return (to - frm) * plane_bytes(out, inp) + lut_bytes(out, to)
    lut3 = lut_bytes(int(table.shapes[4][0]), 3)
    r = loop.step(_obs(0))
    assert r.started == (up0, down, up1) and [x[0] for x in r.rejected] == [stale, too_high, unsupported]
    # stale (block 5 is at 8 bits, not 7) and bits the table does not serve never ask, and are never counted (9 bits
    # once raised a ValueError out of room_left)
    assert seen == [(reload(2, 4, 6), reload(2, 4, 6) + lut3 + reload(3, 4, 5)),
                    (lut3, lut3 + reload(3, 4, 5)), (reload(3, 4, 5), reload(3, 4, 5))]
    assert loop.room_left() == 0


def test_room_left_leaves_out_a_reload_of_a_block_held_in_place():
    """A block that keeps its planes above q (commit_in_place) cannot reload, so `_begin` refuses it, and room_left
    no longer counts it (one check for both: the pool shrank for a reload that never began)."""
    table = PageTable(1, 2, hidden=64, intermediate=32, initial_bits=8)
    table.commit_in_place(0, 4)
    held, down = Transition(0, 4, 6, 0), Transition(2, 8, 4, 0)
    lut4 = room_for(table, down)  # the offload's new LUT, which it asks `reserve` for (no slack here)
    seen = []
    loop = PlanLoop(ScriptedPolicy([Plan((held, down))]), table, ImmediateMover(),
                    reserve=lambda b: seen.append((b, loop.room_left())) or True)
    r = loop.step(_obs(0))
    assert r.rejected[0][0].block == 0 and "cannot reload" in r.rejected[0][1]
    assert seen == [(lut4, lut4)]


def test_the_loop_reports_the_bytes_the_table_moves_not_the_planners_number():
    """A plan's `delta_bytes` are the table's M[from] - M[to] once the loop has it (0 in place), so the plan log and
    its byte totals count what moved whatever a planner wrote; a transition it refuses keeps the planner's."""
    table = PageTable(1, 2, hidden=64, intermediate=32, initial_bits=8)
    wrong, in_place, out = Transition(0, 8, 4, 5), Transition(1, 8, 6, 7, True), Transition(9, 8, 4, 3)
    loop = PlanLoop(ScriptedPolicy([Plan((wrong, in_place, out))]), table, ImmediateMover())
    r = loop.step(_obs(0))
    assert [t.delta_bytes for t in r.plan.transitions] == [int(table.M[0, 8] - table.M[0, 4]), 0, 3]
    assert r.started == r.plan.transitions[:2] and r.rejected[0][0] == out
    assert r.plan.bytes_freed == int(table.M[0, 8] - table.M[0, 4]) + 3


def test_kv_blocks_to_free_covers_the_rest_of_the_plan_as_far_as_free_blocks_go():
    """An engine's `reserve`: nothing from the pool when spare bytes hold the request, None when the free blocks
    cannot, else the blocks for every transition still to begin, capped at the free blocks (whole blocks, rounded
    up)."""
    table = PageTable(1, 1, hidden=64, intermediate=32, initial_bits=4)
    loop = PlanLoop(ScriptedPolicy([]), table)
    loop.room_left = lambda: 950
    assert loop.kv_blocks_to_free(300, 300, 100, 0) == 0
    assert loop.kv_blocks_to_free(300, 300, 100, 20) == 0   # spare bytes just enough: the pool keeps its blocks
    assert loop.kv_blocks_to_free(300, 0, 100, 3) == 3      # exactly the free blocks: granted, all of them
    assert loop.kv_blocks_to_free(300, 50, 100, 2) is None  # 3 blocks needed, 2 free
    assert loop.kv_blocks_to_free(300, 50, 100, 20) == 9  # the plan's 950 - 50 spare
    assert loop.kv_blocks_to_free(300, 50, 100, 5) == 5
    loop.room_left = lambda: 0  # outside a plan: this request alone
    assert loop.kv_blocks_to_free(301, 0, 100, 20) == 4


def test_offload_luts_borrow_the_slack_while_in_flight_and_repay_it_when_they_land():
    """With `lut_slack_bytes`, an offload's lower LUT is held by the slack while the offload is in flight, not asked of
    `reserve`: as far as the LUTs in flight fit (the one that does not asks, and `room_left` counts only it); when an
    offload lands, `release` gets what it frees less the LUT it borrowed, and the slack is whole again."""
    from policies.apformat import lut_bytes
    table = PageTable(1, 3, hidden=64, intermediate=32, initial_bits=8)
    lut = [lut_bytes(int(table.shapes[i][0]), 4) for i in range(3)]
    plan = Plan(tuple(Transition(i, 8, 4, int(table.M[i, 8] - table.M[i, 4])) for i in range(3)))
    asked, released, left = [], [], []
    loop = PlanLoop(ScriptedPolicy([plan, None]), table, _SlowMover(),
                    reserve=lambda b: asked.append(b) or left.append(loop.room_left()) or True,
                    release=released.append, lut_slack_bytes=lut[0] + lut[1])
    r0 = loop.step(_obs(0))
    assert r0.started == plan.transitions and r0.committed == ()
    assert asked == [lut[2]] and left == [lut[2]]  # blocks 0 and 1 borrowed theirs; block 2's did not fit
    assert loop.lut_borrowed == lut[0] + lut[1] and table.busy[:3].all()
    r1 = loop.step(_obs(1))
    assert r1.committed == (0, 1, 2) and loop.lut_borrowed == 0
    frees = sum(t.delta_bytes for t in plan.transitions)  # the surplus planes and LUT_8 less LUT_4, for each block
    assert released == [r1.released_bytes] and r1.released_bytes == frees + lut[2]
    table.check_invariants()
    with pytest.raises(ValueError, match="lut_slack_bytes"):
        PlanLoop(ScriptedPolicy([]), table, lut_slack_bytes=-1)


class _SlowMover:
    """Lands each transfer one step after it started (an async copy stream in miniature)."""

    def __init__(self):
        self.now, self.next = [], []

    def start(self, t, nbytes):
        self.next.append(t.block)

    def landed(self):
        out, self.now, self.next = self.now, self.next, []
        return out


def test_reload_commits_only_at_a_later_boundary():
    table = PageTable(1, 1, hidden=64, intermediate=32, initial_bits=4)
    up = Transition(0, 4, 6, int(table.M[0, 4] - table.M[0, 6]))
    loop = PlanLoop(ScriptedPolicy([Plan((up,)), None]), table, _SlowMover())
    r0 = loop.step(_obs(0))
    assert r0.started == (up,) and r0.committed == () and table.q[0] == 4 and table.busy[0]
    r1 = loop.step(_obs(1))
    assert r1.committed == (0,) and table.q[0] == 6 and not table.busy[0]


def test_a_block_offloading_to_0_bits_refuses_a_second_transition_before_asking_room():
    """Target 0 (an eviction in flight) is a transfer too: a fetch planned meanwhile is refused and reserves nothing."""
    table = PageTable(1, 1, hidden=64, intermediate=32, initial_bits=8)
    out, back = Transition(0, 8, 0, int(table.M[0, 8])), Transition(0, 0, 4, -int(table.M[0, 4]))
    asked = []
    loop = PlanLoop(ScriptedPolicy([Plan((out,)), Plan((back,))]), table, _SlowMover(),
                    reserve=lambda b: asked.append(b) or True, release=lambda b: None)
    assert loop.step(_obs(0)).started == (out,) and table.busy[0]
    r1 = loop.step(_obs(1))
    assert r1.rejected == ((back, "transfer already in flight"),) and asked == [] and r1.committed == (0,)


def test_in_place_transition_commits_without_moving_pages():
    table = PageTable(1, 1, hidden=64, intermediate=32, initial_bits=8)
    mover = ImmediateMover()
    down = Transition(0, 8, 5, 0, in_place=True)
    loop = PlanLoop(ScriptedPolicy([Plan((down,)), Plan((Transition(0, 5, 8, 0),))]), table, mover)
    r = loop.step(_obs(0))
    assert r.started == (down,) and r.committed == () and table.q[0] == 5 and mover.bytes_moved == 0
    assert np.all(table.planes[0] == PlaneState.GPU)  # every plane stays resident
    r1 = loop.step(_obs(1))  # a paged reload of a block held in place is refused, not raised
    assert r1.started == () and "in place" in r1.rejected[0][1] and table.q[0] == 5


def test_a_block_held_in_place_rises_in_place():
    """dp-llm raises a layer's bits again among the planes it kept: only a paged reload of a held block is refused."""
    table = PageTable(1, 1, hidden=64, intermediate=32, initial_bits=8)
    up = Transition(0, 5, 7, 0, in_place=True)
    loop = PlanLoop(ScriptedPolicy([Plan((Transition(0, 8, 5, 0, in_place=True),)), Plan((up,))]), table)
    loop.step(_obs(0))
    r1 = loop.step(_obs(1))
    assert r1.started == (up,) and r1.rejected == () and table.q[0] == 7 and table.held[0]


@pytest.mark.parametrize("t, why", [
    (Transition(0, 8, 8, 0), "no legal change 8 -> 8"),
    (Transition(0, 8, -1, 0), "no legal change 8 -> -1"),
    (Transition(0, 8, 2, 0), "2 bits not supported; supported: (3, 4, 5, 6, 7, 8)"),
    (Transition(0, 6, 4, 0), "stale plan: block is at 8 bits, not 6"),
])
def test_the_loop_names_why_it_refuses_a_transition(t, why):
    table = PageTable(1, 1, hidden=64, intermediate=32, initial_bits=8)
    r = PlanLoop(ScriptedPolicy([Plan((t,))]), table).step(_obs(0))
    assert r.started == () and [(x.from_bits, x.to_bits, reason) for x, reason in r.rejected] == \
        [(t.from_bits, t.to_bits, why)]
    assert table.q[0] == 8 and not table.busy.any()


def test_a_block_held_in_place_refuses_a_paged_reload():
    table = PageTable(1, 1, hidden=64, intermediate=32, initial_bits=8)
    up = Transition(0, 5, 7, 0)
    loop = PlanLoop(ScriptedPolicy([Plan((Transition(0, 8, 5, 0, in_place=True),)), Plan((up,))]), table)
    loop.step(_obs(0))
    r1 = loop.step(_obs(1))
    assert r1.started == () and [(x.to_bits, reason) for x, reason in r1.rejected] == \
        [(7, "block keeps planes in place (commit_in_place); it cannot reload")]
    assert table.q[0] == 5 and table.held[0]


def test_routing_stats_drop_stopped_forgets_only_sequences_that_no_longer_run():
    """Asynchronous scheduling: of a batch whose routing was just added, the sequences preempted or finished since
    it launched are dropped; those still running keep their features."""
    rng = np.random.default_rng(6)
    rs = RoutingStats(1, 4)
    seqs = make_sequences([2, 2, 2], [4, 4, 4])
    seqs[0].status, seqs[1].status = SequenceStatus.RUNNING, SequenceStatus.FINISHED  # seqs[2] was preempted
    rs.add([s.seq_id for s in seqs], [1, 1, 1], *_routing(rng, 1, 3, 4, 2), *_norms(rng, 1, 3, 2))
    rs.drop_stopped(seqs)
    assert rs.sequence_features(seqs[0].seq_id).any()
    assert not rs.sequence_features(seqs[1].seq_id).any() and not rs.sequence_features(seqs[2].seq_id).any()


@pytest.mark.parametrize("seq_ids, lens", [(["x", "y"], [1]), (["x"], [2]), (["x", "y"], [1, 2])])
def test_routing_stats_refuse_a_batch_whose_sequences_do_not_match_its_tokens(seq_ids, lens):
    rng = np.random.default_rng(7)
    with pytest.raises(ValueError, match="sequences with"):
        RoutingStats(1, 4).add(seq_ids, lens, *_routing(rng, 1, 1, 4, 2))


@dataclass
class _Misbehaving:
    """A planner of one's own that does what the contract forbids at step 0 (`how`)."""
    how: str
    name: str = "mine"

    def reset(self, table, calibration):
        return None

    def plan_step(self, table, observation):
        if self.how == "mutates":
            table.q[0] = 4
            return None
        if self.how == "list":
            return [Transition(0, 8, 4, 0)]
        if self.how == "tuples":
            return Plan(((0, 8, 4, 0),))
        return Plan((Transition(0, 8, 0, 0),))   # "absent": a block left at 0 bits


@pytest.mark.parametrize("how, message", [
    ("mutates", "plan_step changed the page table itself; return the moves as a policies.Plan"),
    ("list", "plan_step returned list; return a policies.Plan"),
    ("tuples", "a Plan's transitions must be a tuple of policies.Transition, got tuple"),
])
def test_a_plan_step_that_breaks_the_contract_is_one_policy_error(how, message):
    """Before, the simulator ran on with bits that never moved (and reported them), or both engines failed with an
    AttributeError deep in the loop."""
    table = PageTable(1, 2, hidden=64, intermediate=32, initial_bits=8)
    with pytest.raises(policies.PolicyError, match=re.escape(message)):
        PlanLoop(_Misbehaving(how), table).step(_obs(0))


class _BeginsReload:
    name = "mine"

    def reset(self, table, calibration):
        return None

    def plan_step(self, table, observation):
        table.begin_reload(0, 6)   # q stays until the reload lands: only the transfer in flight shows it
        return None


def test_a_plan_step_that_begins_a_transfer_itself_is_a_policy_error():
    table = PageTable(1, 2, hidden=64, intermediate=32, initial_bits=4)
    with pytest.raises(policies.PolicyError, match="plan_step changed the page table itself"):
        PlanLoop(_BeginsReload(), table).step(_obs(0))


def test_a_transition_of_a_block_past_the_table_is_refused():
    table = PageTable(1, 2, hidden=64, intermediate=32, initial_bits=8)
    t = Transition(table.num_blocks, 8, 4, 0)
    r = PlanLoop(ScriptedPolicy([Plan((t,))]), table).step(_obs(0))
    assert r.started == () and r.rejected == ((t, f"block {table.num_blocks} out of range"),)


def test_the_immediate_mover_counts_only_the_bytes_copied_to_the_gpu():
    """An offload copies nothing (the CPU keeps the 8-bit master); a reload copies its planes and LUT."""
    table = PageTable(1, 1, hidden=64, intermediate=32, initial_bits=8)
    off, up = Transition(0, 8, 4, 0), Transition(0, 4, 6, 0)
    mover = ImmediateMover()
    loop = PlanLoop(ScriptedPolicy([Plan((off,)), Plan((up,))]), table, mover)
    loop.step(_obs(0))
    assert mover.bytes_moved == 0
    loop.step(_obs(1))
    assert table.q[0] == 6 and mover.bytes_moved == room_for(table, up) > 0


class _ReportsTwice(ImmediateMover):
    def landed(self):
        out = super().landed()
        return out + out


def test_a_block_a_mover_reports_landed_twice_is_committed_once():
    table = PageTable(1, 1, hidden=64, intermediate=32, initial_bits=8)
    released = []
    loop = PlanLoop(ScriptedPolicy([Plan((Transition(0, 8, 4, 0),))]), table, _ReportsTwice(), release=released.append)
    r = loop.step(_obs(0))
    assert r.committed == (0,) and table.q[0] == 4 and released == [r.released_bytes] and not table.busy.any()


def test_an_engine_that_fetches_no_absent_expert_refuses_a_plan_to_0_bits():
    """The simulator models absent experts (fetched when routed to); the runtime does not, and says so."""
    sim = PageTable(1, 2, hidden=64, intermediate=32, initial_bits=8)
    assert PlanLoop(_Misbehaving("absent"), sim).step(_obs(0)).started and sim.q[0] == 0
    runtime = PageTable(1, 2, hidden=64, intermediate=32, initial_bits=8)
    with pytest.raises(policies.PolicyError, match="leaves L0.E0.gate_up at 0 bits .an absent expert.: the runtime"):
        PlanLoop(_Misbehaving("absent"), runtime, serves_absent=False).step(_obs(0))


def test_numpy_numbers_in_a_plan_become_ints():
    """They leaked into the engines' state (the KV pool's capacity) and broke `pwruntime generate --json`."""
    table = PageTable(1, 2, hidden=64, intermediate=32, initial_bits=8)
    t = Transition(np.int64(0), table.q[0], np.int64(4), np.int64(table.M[0, 8] - table.M[0, 4]))
    result = PlanLoop(ScriptedPolicy([Plan((t,))]), table).step(_obs(0))
    (started,) = result.started
    assert started == t and all(type(v) is int for v in (started.block, started.from_bits, started.to_bits,
                                                          started.delta_bytes))


def test_routing_mass_decay_counts_tokens_against_the_half_life():
    """4 tokens with an 8-token half-life decay the earlier mass by 0.5 ** 0.5, not 0.5 ** 2."""
    rm = RoutingMass(1, 2, half_life_tokens=8.0)
    rm.update(np.zeros((1, 4, 1), int), np.ones((1, 4, 1)))
    rm.update(np.ones((1, 4, 1), int), np.ones((1, 4, 1)))
    old = 4 * 0.5 ** 0.5
    np.testing.assert_allclose(rm.mass(), [[old / (old + 4), 4 / (old + 4)]])
    with pytest.raises(ValueError):
        RoutingMass(1, 2, half_life_tokens=0)


def test_routing_stats_folds_once_held_slots_reach_hold_slots_exactly():
    stats = RoutingStats(1, 2, half_life_tokens=None, features=False, hold_slots=4)
    step = (np.zeros((1, 4, 1), int), np.ones((1, 4, 1)))
    stats.add(["a"], [4], *step)
    assert stats.routing.tokens_seen == 0  # held, not folded yet
    stats.add(["a"], [4], *step)  # the held step routes exactly hold_slots slots: folded before holding this one
    assert stats.routing.tokens_seen == 4


def test_routing_stats_without_both_norms_keeps_only_the_routing_mass():
    """A step given only the gate_up norms keeps no prompt features (both norm arrays are needed)."""
    stats = RoutingStats(1, 2, half_life_tokens=None)
    stats.add(["a"], [2], np.zeros((1, 2, 1), int), np.ones((1, 2, 1)), gate_up_in_norm=np.ones((1, 2)))
    np.testing.assert_allclose(stats.mass(), [[1.0, 0.0]])
    assert np.all(stats.sequence_features("a") == 0)
