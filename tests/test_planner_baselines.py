"""Baselines: fp16, uniform-<b>, static-mixed, dp-llm (in-place precision), expert-lru; the allocation solver."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from policies import Observation, PageTable, PageTableError, Plan, PolicyError, RoutingReadout, Transition, get
from policies.apformat import fp16_bytes, lut_bytes
from policies.planners import apply_plan_now, sensitivity_optimal_bits, weight_bytes
from policies.planners.base import make_plan, never_plans
from policies.planners.expert_lru import routed_since
from policies.synthetic import synthetic_calibration, synthetic_features, synthetic_routing_mass

BITS = (3, 4, 5, 6, 7, 8)


def obs(step=1, free=0, routing_mass=None, prompt_features=None) -> Observation:
    return Observation(step=step, time_s=0.0, free_blocks=free, total_blocks=100, kv_block_bytes=10**6,
                       free_block_threshold=8, routing=RoutingReadout(routing_mass, prompt_features))


@pytest.fixture
def setup():
    table = PageTable(3, 4, 256, 128, bits=BITS)
    return table, synthetic_calibration(table, seed=2, initial_mean_bits=6.0)


def test_fp16_is_the_full_precision_reference(setup):
    table, cal = setup
    pol = get("fp16")
    pol.reset(table, None)
    assert (table.q == 8).all() and pol.full_precision
    assert weight_bytes(pol, table) == sum(fp16_bytes(int(o), int(i)) for o, i in table.shapes)
    assert pol.plan_step(table, obs()) is None


@pytest.mark.parametrize("b", BITS)
def test_uniform_is_static(setup, b):
    table, cal = setup
    pol = get(f"uniform-{b}")
    pol.reset(table, cal)
    assert (table.q == b).all() and weight_bytes(pol, table) == table.resident_bytes()
    assert pol.plan_step(table, obs()) is None


def test_uniform_rejects_unsupported_bits():
    with pytest.raises(PolicyError, match="4 bits not supported"):
        get("uniform-4").reset(PageTable(1, 2, 64, 32, bits=(3, 8)), None)


def test_static_mixed_meets_the_mean_and_beats_uniform(setup):
    table, cal = setup
    pol = get("static-mixed", target_bits=4.5)
    pol.reset(table, cal)
    params = table.shapes[:, 0] * table.shapes[:, 1]
    assert np.dot(params, table.q) / params.sum() <= 4.5
    assert pol.plan_step(table, obs()) is None
    s = cal.sensitivity  # convex chains: a Lagrangian optimum, so better than uniform 4 bits (fewer bits used)
    assert s[np.arange(table.num_blocks), table.q].sum() < s[:, 4].sum()


def test_allocation_is_optimal_on_tiny_convex_problems():
    """On convex chains the greedy is a Lagrangian optimum: no assignment using no more bytes is better."""
    table = PageTable(1, 2, 64, 32, bits=(3, 4, 5, 6), initial_bits=6)
    rng = np.random.default_rng(0)
    rows = np.arange(4)
    for _ in range(30):
        s = np.full((4, 9), np.nan)
        s[:, 6] = rng.lognormal(0, 1, 4)
        for b in (5, 4, 3):
            s[:, b] = s[:, b + 1] * rng.uniform(2, 6, 4)
        budget = int(rng.uniform(table.M[:, 3].sum(), table.M[:, 6].sum()))
        bits = sensitivity_optimal_bits(table, s, budget_bytes=budget)
        used = table.M[rows, bits].sum()
        assert used <= budget
        best = min(s[rows, list(c)].sum() for c in itertools.product((3, 4, 5, 6), repeat=4)
                   if table.M[rows, list(c)].sum() <= used)
        assert s[rows, bits].sum() <= best * (1 + 1e-12)


def test_allocation_to_a_mean_counts_the_bits_each_step_drops():
    """With bitwidths (4, 8) one step drops 4 bits a parameter: a mean of 6 is met, not undershot to 4."""
    table = PageTable(1, 2, 64, 32, bits=(4, 8), initial_bits=8)
    params = (table.shapes[:, 0] * table.shapes[:, 1]).astype(float)
    for target in (6.0, 7.0):
        bits = sensitivity_optimal_bits(table, np.ones((4, 9)), target_mean_bits=target)
        mean = float((bits * params).sum() / params.sum())
        assert 4.0 < mean <= target
    assert (sensitivity_optimal_bits(table, np.ones((4, 9)), target_mean_bits=4) == 4).all()  # the lowest: allowed


def test_allocation_errors():
    table = PageTable(1, 2, 64, 32, bits=BITS)
    s = np.ones((4, 9))
    with pytest.raises(PolicyError, match="below"):
        sensitivity_optimal_bits(table, s, budget_bytes=10)
    with pytest.raises(PolicyError, match="exactly one"):
        sensitivity_optimal_bits(table, s)
    floor = int(table.M[:, 3].sum())  # a budget of exactly the lowest bits' bytes is met, not refused
    assert (sensitivity_optimal_bits(table, s, budget_bytes=floor) == 3).all()


# --------------------------------------------------------------------------------------- dp-llm
def test_dp_llm_changes_precision_in_place(setup):
    table, cal = setup
    pol = get("dp-llm", target_bits=5.0)
    pol.reset(table, cal)
    assert (table.planes == 1).all()  # every plane resident
    per_layer = table.q.reshape(table.layers, -1)
    assert (per_layer == per_layer[:, :1]).all() and per_layer[:, 0].mean() <= 5.0
    real = weight_bytes(pol, table)
    luts = sum(lut_bytes(int(o), b) for o, _ in table.shapes for b in BITS if b != 8)
    assert real == table.M[:, 8].sum() + luts and pol.theoretical_weight_bytes(table) == table.committed_bytes()
    rms_boost = synthetic_features(table.num_blocks, seed=0)
    rms_boost[table.layer == 2, 1] *= 20  # layer 2 sees much larger inputs now
    plan = pol.plan_step(table, obs(prompt_features=rms_boost))
    assert plan is not None and all(t.in_place and t.delta_bytes == 0 for t in plan.transitions)
    before = table.q.copy()
    apply_plan_now(table, plan)
    table.check_invariants()
    assert (table.planes == 1).all() and weight_bytes(pol, table) == real  # nothing moved
    assert table.q[table.layer == 2].mean() > before[table.layer == 2].mean()
    assert table.q.reshape(table.layers, -1)[:, 0].mean() <= 5.0


def test_dp_llm_weighs_an_unobserved_layer_as_one_and_chooses_every_update_interval(setup, monkeypatch):
    """A layer no token was routed in has no evidence: weight 1 (as the docstring says), not 0, which would make it
    the first to lose bits; `update_interval` 3 re-chooses at steps 0, 3 and 6 only."""
    table, cal = setup
    pol = get("dp-llm", target_bits=5.0, update_interval=3, use_features=False)
    pol.reset(table, cal)
    mass = np.zeros((3, 4))
    mass[1], mass[2] = [0.7, 0.1, 0.1, 0.1], 0.25
    w = pol.block_weights(table, obs(routing_mass=mass))
    assert (w[table.layer == 0] == 1).all()
    np.testing.assert_allclose(w[table.layer == 1], np.repeat([2.8, 0.4, 0.4, 0.4], 2))
    np.testing.assert_allclose(w[table.layer == 2], 1.0)
    chose = []
    monkeypatch.setattr(pol, "choose", lambda t, o: chose.append(o.step) or pol.layer_bits)
    for step in range(7):
        pol.plan_step(table, obs(step=step, routing_mass=mass))
    assert chose == [0, 3, 6]


def test_a_re_initialized_table_forgets_blocks_held_in_place():
    table = PageTable(1, 2, 64, 32, bits=BITS, initial_bits=8)
    table.commit_in_place(0, 4)
    assert table.held[0]
    table.initialize(8)
    assert not table.held.any() and table.begin_offload(0, 4) > 0


def test_make_plan_leaves_out_blocks_already_at_their_bits():
    table = PageTable(1, 2, 64, 32, bits=BITS, initial_bits=8)
    assert make_plan(table, [0, 1, 2], [8, 8, 8], 0.0, "none") is None
    plan = make_plan(table, [0, 1, 2], [8, 4, 8], 0.0, "one")
    assert [(t.block, t.from_bits, t.to_bits, t.delta_bytes) for t in plan.transitions] == [
        (1, 8, 4, int(table.M[1, 8] - table.M[1, 4]))]


@pytest.mark.parametrize("name, never", [("noop", True), ("fp16", True), ("uniform-4", True), ("static-mixed", True),
                                         ("pagedweight", False), ("dp-llm", False), ("expert-lru", False)])
def test_engines_skip_routing_statistics_only_for_policies_that_never_plan(name, never):
    assert never_plans(get(name)) is never


def test_apply_plan_now_returns_the_bytes_freed_negative_for_a_reload():
    table = PageTable(1, 1, 64, 32, bits=BITS, initial_bits=8)
    def move(frm, to):
        return Plan((Transition(0, frm, to, int(table.M[0, frm] - table.M[0, to])),))
    assert apply_plan_now(table, move(8, 4)) == int(table.M[0, 8] - table.M[0, 4]) > 0
    assert apply_plan_now(table, move(4, 6)) == -int(table.M[0, 6] - table.M[0, 4]) < 0
    assert apply_plan_now(table, None) == 0 and table.q[0] == 6


def test_routed_since_counts_every_expert_of_a_layer_that_had_no_mass_before():
    prev = np.array([[0.0, 0.0, 0.0], [0.5, 0.5, 0.0]])
    cur = np.array([[0.6, 0.4, 0.0], [0.5, 0.5, 0.0]])
    assert routed_since(prev, cur).tolist() == [[True, True, False], [False, False, False]]


def test_in_place_blocks_refuse_page_moves(setup):
    table, cal = setup
    pol = get("dp-llm", target_bits=4.0)
    pol.reset(table, cal)
    i = int(np.flatnonzero(table.q < 8)[0])
    with pytest.raises(PageTableError, match="in place"):
        table.begin_offload(i, 3)
    with pytest.raises(PageTableError, match="in place"):
        table.begin_reload(i, 8)
    table2 = PageTable(1, 2, 64, 32, bits=BITS, initial_bits=5)
    with pytest.raises(PageTableError, match="only 5 leading planes"):
        table2.commit_in_place(0, 6)


@pytest.mark.parametrize("name, key, ends, past", [("dp-llm", "target_bits", (1.0, 8.0), (0.99, 8.01)),
                                                    ("expert-lru", "bits", (1, 8), (0, 9))])
def test_a_baseline_s_bits_take_their_end_values_and_refuse_past_them(name, key, ends, past):
    for ok in ends:
        assert getattr(get(name, **{key: ok}).params, key) == ok
    for bad in past:
        with pytest.raises(ValueError, match=f"{key} must be in 1..8"):
            get(name, **{key: bad})


@pytest.mark.parametrize("name, bad, needle", [("dp-llm", {"update_interval": 0}, "update_interval must be >= 1"),
                                               ("expert-lru", {"budget_bytes": -1}, "must be >= 0"),
                                               ("expert-lru", {"max_fetch_per_step": -1}, "must be >= 0")])
def test_each_other_bad_baseline_parameter_alone_is_refused(name, bad, needle):
    with pytest.raises(ValueError, match=needle):
        get(name, **bad)


def test_dp_llm_at_the_lowest_bitwidth_puts_every_layer_there_and_at_the_top_none(setup):
    table, cal = setup
    get("dp-llm", target_bits=3.0).reset(table, cal)  # the target may equal the lowest supported bitwidth
    assert (table.q == 3).all()
    get("dp-llm", target_bits=8.0).reset(table, cal)
    assert (table.q == 8).all()


def test_dp_llm_features_off_ignores_them_and_unused_blocks_weigh_nothing(setup):
    """With `use_features` off the prompt features change nothing; with it on, a block no running request uses
    (RMS 0) weighs 0 and the used ones are scaled to a mean of 1 among themselves."""
    table, cal = setup
    feats = synthetic_features(table.num_blocks, seed=1)
    feats[table.layer == 0, 1] = 0.0
    pol = get("dp-llm", use_features=False)
    pol.reset(table, cal)
    assert (pol.block_weights(table, obs(prompt_features=feats)) == 1).all()
    pol = get("dp-llm")
    pol.reset(table, cal)
    w = pol.block_weights(table, obs(prompt_features=feats))
    assert (w[table.layer == 0] == 0).all()
    np.testing.assert_allclose(w[table.layer != 0].mean(), 1.0)


def test_dp_llm_lowers_a_layer_no_request_uses_even_where_its_error_is_unknown(setup):
    """A block of weight 0 adds nothing to its layer's error, even at a bitwidth its sensitivity leaves unknown (NaN,
    read as infinite): 0 * inf must not make the layer unlowerable. Layer 0, unused, gives all 5 bits asked for."""
    table, cal = setup
    cal.sensitivity[table.layer == 0, 3] = np.nan
    pol = get("dp-llm", target_bits=8 - 4.5 / 3, use_routing=False)
    pol.reset(table, cal)
    feats = synthetic_features(table.num_blocks, seed=1)
    feats[table.layer == 0, 1] = 0.0
    assert pol.choose(table, obs(prompt_features=feats)).tolist() == [3, 8, 8]


# --------------------------------------------------------------------------------------- expert-lru
def test_routed_since_reads_routing_mass_updates():
    from policies.observe import RoutingMass
    rm = RoutingMass(2, 6, half_life_tokens=64.0)
    rng = np.random.default_rng(0)
    prev = None
    for _ in range(30):
        ids = rng.integers(0, 6, (2, 3, 2))
        rm.update(ids, rng.uniform(0.1, 1.0, (2, 3, 2)))
        used = routed_since(prev, rm.mass())
        truth = np.zeros((2, 6), bool)
        for l in range(2):
            truth[l, np.unique(ids[l])] = True
        if prev is not None and not truth.all(axis=1).any():
            assert (used == truth).all()
        prev = rm.mass()


def test_expert_lru_misses_fetch_and_evict_lru():
    table = PageTable(1, 6, 256, 128, bits=BITS)
    per_expert = int(table.M[0, 4] + table.M[1, 4])
    pol = get("expert-lru", bits=4, budget_bytes=3 * per_expert)
    pol.reset(table, None)
    resident = lambda: set(np.flatnonzero(table.q[0::2] > 0).tolist())  # noqa: E731
    assert resident() == {0, 1, 2} and table.resident_bytes() == 3 * per_expert
    used = np.zeros((1, 6), bool)
    for step, experts in enumerate([[0], [1], [3], [4], [0], [5]]):
        used[:] = False
        used[0, experts] = True
        pol.touch(used)
        plan = pol.plan_step(table, obs(step=step))
        if plan is not None:
            offs = [t for t in plan.transitions if t.is_offload]
            assert plan.transitions[: len(offs)] == tuple(offs)  # evictions first
        apply_plan_now(table, plan)
        table.check_invariants()
        assert len(resident()) <= 3 and set(experts) <= resident()
    # 3 evicts 2 (never used), 4 evicts 0 (used at step 0), 0 comes back evicting 1, 5 evicts 3
    assert resident() == {0, 4, 5}
    assert pol.misses == 4 and pol.last_used.tolist() == [[4, 1, -1, 2, 3, 5]]
    assert table.resident_bytes() <= 3 * per_expert


def _lru(experts: int, capacity: int, **params):
    table = PageTable(1, experts, 256, 128, bits=BITS)
    pol = get("expert-lru", bits=4, budget_bytes=capacity * int(table.M[0, 4] + table.M[1, 4]), **params)
    pol.reset(table, None)
    return table, pol


def _touch(pol, experts: int, used: list[int]) -> None:
    mask = np.zeros((1, experts), bool)
    mask[0, used] = True
    pol.touch(mask)


def test_expert_lru_counts_a_fetch_in_flight_against_its_capacity():
    table, pol = _lru(6, 3)   # 0, 1, 2 resident
    _touch(pol, 6, [3])
    for t in pol.plan_step(table, obs(step=0)).transitions:   # the eviction lands, the fetch of 3 is still copying
        (table.begin_offload if t.is_offload else table.begin_reload)(t.block, t.to_bits)
        if t.is_offload:
            table.finish_offload(t.block)
    _touch(pol, 6, [4])
    plan = pol.plan_step(table, obs(step=1))
    assert sum(t.is_offload for t in plan.transitions) == 2   # room for 4: one more expert out
    apply_plan_now(table, plan)
    assert int(((table.q[0::2] > 0) | (table.target[0::2] > 0)).sum()) == 3


def test_expert_lru_warms_the_lowest_experts_of_every_layer_round_robin():
    table = PageTable(2, 4, 256, 128, bits=BITS)
    pol = get("expert-lru", bits=4, budget_bytes=4 * int(table.M[0, 4] + table.M[1, 4]))
    pol.reset(table, None)
    assert (table.q[0::2] > 0).reshape(2, 4).tolist() == [[True, True, False, False]] * 2


def test_expert_lru_does_not_fetch_an_expert_whose_eviction_is_in_flight():
    table, pol = _lru(4, 2)   # 0, 1 resident
    _touch(pol, 4, [2])
    for t in pol.plan_step(table, obs(step=0)).transitions:   # 0 is evicted; nothing lands yet
        (table.begin_offload if t.is_offload else table.begin_reload)(t.block, t.to_bits)
    _touch(pol, 4, [0])
    assert pol.plan_step(table, obs(step=1)) is None and pol.misses == 1   # 0 is fetched once its eviction lands


def test_expert_lru_evicts_the_least_recently_used_whatever_its_routing_mass():
    table, pol = _lru(4, 2)   # 0, 1 resident
    mass = np.array([[0.7, 0.1, 0.1, 0.1]])
    for step, used in enumerate([[0], [1], [2]]):   # 0 is the least recently used when 2 comes, for all its mass
        _touch(pol, 4, used)
        apply_plan_now(table, pol.plan_step(table, obs(step=step, routing_mass=mass)))
    assert set(np.flatnonzero(table.q[0::2] > 0).tolist()) == {1, 2}


def test_expert_lru_fetches_the_most_routed_misses_first():
    table, pol = _lru(4, 2, max_fetch_per_step=1)   # 0, 1 resident
    _touch(pol, 4, [2, 3])
    plan = pol.plan_step(table, obs(routing_mass=np.array([[0.1, 0.1, 0.2, 0.6]])))
    assert {t.block // 2 for t in plan.transitions if not t.is_offload} == {3}


def test_expert_lru_budget_errors():
    with pytest.raises(PolicyError, match="holds no expert"):
        get("expert-lru", budget_bytes=10).reset(PageTable(1, 2, 64, 32), None)


def test_expert_lru_from_routing_mass_only():
    table = PageTable(2, 8, 256, 128, bits=BITS)
    per_expert = int(table.M[0, 4] + table.M[1, 4])
    pol = get("expert-lru", budget_bytes=6 * per_expert)
    pol.reset(table, None)
    for step in range(20):
        m = synthetic_routing_mass(2, 8, seed=step % 3)
        apply_plan_now(table, pol.plan_step(table, obs(step=step, routing_mass=m)))
        table.check_invariants()
        assert int((table.q[0::2] > 0).sum()) <= 6


def test_expert_lru_budget_of_exactly_one_expert_caches_one():
    table, pol = _lru(4, 1)
    assert pol.capacity == 1 and int((table.q[0::2] > 0).sum()) == 1


def test_routed_since_without_a_previous_observation_is_every_expert_with_mass():
    cur = np.array([[0.6, 0.0, 0.4], [0.0, 1.0, 0.0]])
    assert routed_since(None, cur).tolist() == [[True, False, True], [False, True, False]]
    assert routed_since(cur, None) is None


def test_routed_since_ignores_an_expert_never_routed_when_finding_the_decay():
    """Expert 2 has no mass before or after; the layer's decay is read off the experts that had mass, so expert 1
    (whose share grew) was routed and expert 0 (whose share shrank) was not."""
    prev = np.array([[0.5, 0.5, 0.0]])
    cur = np.array([[0.25, 0.75, 0.0]])
    assert routed_since(prev, cur).tolist() == [[False, True, False]]


@pytest.mark.parametrize("lands", [0, 1], ids=["gate-landed", "down-landed"])
def test_expert_lru_waits_while_either_block_of_an_evicted_expert_is_in_flight(lands):
    table, pol = _lru(4, 2)   # 0, 1 resident
    _touch(pol, 4, [2])
    for t in pol.plan_step(table, obs(step=0)).transitions:   # 0 is evicted; only one of its blocks lands
        (table.begin_offload if t.is_offload else table.begin_reload)(t.block, t.to_bits)
    table.finish_offload(lands)
    _touch(pol, 4, [0])
    assert pol.plan_step(table, obs(step=1)) is None and pol.misses == 1
