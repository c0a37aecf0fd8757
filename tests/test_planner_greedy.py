"""The PagedWeight planner against a literal, slow re-implementation of Algorithm 1 on small tables.

The reference below is written from the equations (DESIGN "The method's equations") in plain
Python: per stage, repeatedly take the single cheapest next step (damage per released byte, ties
by lower block index) among idle blocks until the byte target is met; then the first stage that
meets the target, else the plan freeing the most bytes. The planner must return exactly its plan.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies import Calibration, Observation, PageTable, RoutingReadout, get
from policies.calibration import NB
from policies.planners.scoring import MatrixChains, chain_greedy_stages, chain_keys, expert_buckets, fit_in_order

BITS = (3, 4, 5, 6, 7, 8)


# ---------------------------------------------------------------------------- the reference
def ref_buckets(mass, layers, experts, bounds):
    last = len(bounds) - 1
    out = [[last] * experts for _ in range(layers)]
    if mass is None:
        return out
    cuts = [int(math.floor(b * experts + 0.5)) for b in bounds]
    for l in range(layers):
        if sum(mass[l]) <= 0:
            continue
        order = sorted(range(experts), key=lambda e: (-mass[l][e], e))
        for r, e in enumerate(order):
            out[l][e] = min(next((k for k, c in enumerate(cuts) if r < c), last), last)
    return out


def ref_step_damage(cal, table, i, b, b2, mu, phi, alpha):
    s = cal.sensitivity
    g = max(float(s[i, b2]) - float(s[i, b]), 0.0)
    eta = 1.0
    if phi is not None:
        k = int(table.kind[i])
        rho = sum(float(cal.residual_weights[k, b, b2, f]) * float(phi[i, f]) for f in range(3))
        rho += float(cal.residual_bias[k, b, b2])
        lo, hi = (float(x) for x in cal.residual_clip[k, b, b2])
        rho = min(max(rho, lo), hi)
        eta = math.exp(alpha * float(cal.residual_confidence[k, b, b2]) * rho)
    return max(cal.epsilon, mu * g * eta)


def ref_plan(table, cal, obs, start):
    """({block: to_bits}, predicted damage) of the plan Algorithm 1 returns (empty dict: no plan)."""
    T, B = obs.free_block_threshold, obs.kv_block_bytes
    free = obs.free_blocks - obs.pending_kv_blocks
    raw = max(0, T + 1 - free) * B
    if raw == 0:
        return {}, 0.0
    flight = table.in_flight_bytes()
    releasing = sum(int(flight[i]) for i in range(table.num_blocks) if table.busy[i] and table.target[i] == table.q[i])
    target = max(0, raw - releasing - obs.headroom_bytes)
    if target == 0:
        return {}, 0.0
    buckets = ref_buckets(None if obs.routing_mass is None else obs.routing_mass.tolist(), table.layers,
                          table.experts, cal.bucket_bounds)
    bits = sorted(table.bits)
    prev = {b: bits[k - 1] for k, b in enumerate(bits) if k > 0}
    plans = []
    for stage, (floors, cap) in enumerate(zip(cal.floor_stages, cal.depth_caps)):
        at = {i: int(table.q[i]) for i in range(table.num_blocks)}
        freed, damage = 0, 0.0
        while freed < target:
            best = None
            for i in range(table.num_blocks):
                if table.busy[i] or at[i] not in prev:
                    continue
                b, b2 = at[i], prev[at[i]]
                bucket = buckets[int(table.layer[i])][int(table.expert[i])]
                if b2 < max(floors[bucket], int(start[i]) - cap):
                    continue
                d = ref_step_damage(cal, table, i, b, b2, cal.bucket_multipliers[bucket], obs.prompt_features, cal.alpha)
                delta = int(table.M[i, b] - table.M[i, b2])
                key = (d / delta, i)
                if best is None or key < best[0]:
                    best = (key, i, b2, delta, d)
            if best is None:
                break
            _, i, b2, delta, d = best
            at[i], freed, damage = b2, freed + delta, damage + d
        moves = {i: b for i, b in at.items() if b != int(table.q[i])}
        if moves:
            plans.append((stage, moves, freed, damage))
    if not plans:
        return {}, 0.0
    meeting = [p for p in plans if p[2] >= target]
    best = meeting[0] if meeting else max(plans, key=lambda p: (p[2], -p[3], -p[0]))
    return best[1], best[3]


# ---------------------------------------------------------------------------- random cases
def random_case(seed: int, ties: bool, **policy_kw):
    rng = np.random.default_rng(seed)
    layers, experts = int(rng.integers(1, 3)), int(rng.integers(2, 5))
    hidden, inter = int(rng.choice([32, 64, 96])), int(rng.choice([16, 32, 48]))
    table = PageTable(layers, experts, hidden, inter, bits=BITS)
    n = table.num_blocks
    sens = np.full((n, NB), np.nan)
    if ties:  # few distinct values: exact ties in damage per byte, non-monotone chains
        sens[:, 3:] = rng.integers(0, 4, (n, 6)).astype(float)
    else:
        sens[:, 3:] = np.sort(rng.lognormal(0, 2, (n, 6)), axis=1)[:, ::-1] * rng.lognormal(0, 1, (n, 1))
        if rng.random() < 0.5:  # some non-monotone rows
            sens[:, 3:] += rng.random((n, 6)) * sens[:, 3:].mean()
    n_buckets = int(rng.integers(1, 4))
    bounds = tuple(sorted(rng.uniform(0.1, 0.9, n_buckets - 1))) + (1.0,)
    mult = tuple(sorted(rng.uniform(0.5, 5.0, n_buckets), reverse=True))
    stages = tuple(tuple(int(x) for x in sorted(rng.integers(3, 7, n_buckets), reverse=True))
                   for _ in range(int(rng.integers(1, 4))))
    caps = tuple(int(x) for x in sorted(rng.integers(1, 6, len(stages))))
    kw = {}
    if not ties and rng.random() < 0.7:  # residual heads
        kw = dict(residual_weights=rng.normal(0, 0.5, (2, NB, NB, 3)), residual_bias=rng.normal(0, 0.3, (2, NB, NB)),
                  residual_confidence=rng.uniform(0, 1, (2, NB, NB)),
                  residual_clip=np.stack([np.full((2, NB, NB), -0.7), np.full((2, NB, NB), 0.9)], axis=-1))
    start = rng.integers(5, 9, n)
    cal = Calibration(fingerprint="arch:test", layers=layers, experts=experts, bits=BITS, sensitivity=sens,
                      initial_bits=start, bucket_bounds=bounds, bucket_multipliers=mult, floor_stages=stages,
                      depth_caps=caps, alpha=float(rng.uniform(0.2, 1.5)), epsilon=1e-9, **kw)
    policy = get("pagedweight", **policy_kw)
    policy.reset(table, cal)
    # move the table away from the start: some blocks lower, some transfers in flight
    for i in range(n):
        r = rng.random()
        lower = [b for b in BITS if b < table.q[i]]
        if r < 0.3 and lower:
            table.begin_offload(i, int(rng.choice(lower)))
            table.finish_offload(i)
        elif r < 0.4 and lower:
            table.begin_offload(i, int(rng.choice(lower)))  # still in flight: busy
    mass = None
    if rng.random() < 0.8:
        mass = rng.integers(0, 5, (layers, experts)).astype(float) if ties else rng.random((layers, experts))
        mass /= np.maximum(mass.sum(axis=1, keepdims=True), 1e-12)
    phi = rng.lognormal(0, 0.5, (n, 3)) if kw and rng.random() < 0.8 else None
    step = int((table.M[:, 8] - table.M[:, 7]).mean())
    T = int(rng.integers(0, 8))
    B = int(step * rng.uniform(0.1, 2.0))
    obs = Observation(step=1, time_s=0.0, free_blocks=int(rng.integers(0, T + 3)), total_blocks=100, kv_block_bytes=B,
                      free_block_threshold=T, pending_kv_blocks=int(rng.integers(0, 3)),
                      headroom_bytes=int(rng.integers(0, B)), routing=RoutingReadout(mass, phi))
    return table, cal, policy, obs, start


@pytest.mark.parametrize("ties", [False, True])
def test_planner_equals_reference_greedy(ties):
    checked = 0
    for seed in range(150):
        table, cal, policy, obs, start = random_case(seed, ties)
        plan = policy.plan_step(table, obs)
        expected, damage = ref_plan(table, cal, obs, start)
        got = {} if plan is None else {t.block: t.to_bits for t in plan.transitions}
        assert got == expected, f"seed {seed}: planner {got} != reference {expected}"
        if plan is not None:
            checked += 1
            assert plan.predicted_damage == pytest.approx(damage, rel=1e-9)
            for t in plan.transitions:
                assert t.from_bits == table.q[t.block] and not table.busy[t.block]
                assert t.delta_bytes == table.M[t.block, t.from_bits] - table.M[t.block, t.to_bits]
    assert checked > 75  # the cases exercise real plans, not just "no pressure"


def test_planner_equals_reference_with_a_negative_residual_strength():
    """Eq. 6 clips rho before scaling it: with alpha < 0 (a `--policy-arg alpha=`) the bounds of log eta swap."""
    checked = 0
    for seed in range(150):
        table, cal, policy, obs, start = random_case(seed, False, alpha=-0.8)
        if obs.prompt_features is None:
            continue
        plan = policy.plan_step(table, obs)
        expected, _ = ref_plan(table, dataclasses.replace(cal, alpha=-0.8), obs, start)
        assert ({} if plan is None else {t.block: t.to_bits for t in plan.transitions}) == expected, f"seed {seed}"
        checked += plan is not None
    assert checked > 20


def test_reload_reports_the_damage_it_recovers():
    """A reload's predicted damage is minus Eq. 8 of each raised step, each block scored with its own kind's head."""
    checked = 0
    for seed in range(120):
        table, cal, policy, obs, start = random_case(seed, False, reload_threshold=6)
        if obs.prompt_features is None:
            continue
        o = Observation(step=2, time_s=0.0, free_blocks=200, total_blocks=200, kv_block_bytes=10**9,
                        free_block_threshold=obs.free_block_threshold, routing=obs.routing)
        plan = policy.plan_step(table, o)
        if plan is None:
            continue
        mass = None if o.routing_mass is None else o.routing_mass.tolist()
        buckets = ref_buckets(mass, table.layers, table.experts, cal.bucket_bounds)
        mu = [cal.bucket_multipliers[buckets[int(table.layer[t.block])][int(table.expert[t.block])]]
              for t in plan.transitions]
        want = sum(ref_step_damage(cal, table, t.block, t.to_bits, t.from_bits, m, o.prompt_features, cal.alpha)
                   for t, m in zip(plan.transitions, mu))
        assert plan.predicted_damage == pytest.approx(-want, rel=1e-9), f"seed {seed}"
        checked += 1
    assert checked > 10


# ---------------------------------------------------------------------------- the selection kernels
def brute_chain_greedy(ratio, weight, first, last, target):
    """Literal frontier loop on [n, S] block-major arrays; returns picks as (row, col) in order."""
    n, S = ratio.shape
    nxt = list(first)
    picks, acc = [], 0
    while acc < target:
        cand = [(ratio[j, nxt[j]], j) for j in range(n) if nxt[j] <= last[j]]
        if not cand:
            break
        _, j = min(cand)
        picks.append((j, nxt[j]))
        acc += weight[j, nxt[j]]
        nxt[j] += 1
    return picks


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_chain_greedy_stages_matches_the_frontier_loop(data):
    n = data.draw(st.integers(1, 7))
    S = data.draw(st.integers(1, 5))
    ratio = np.array(data.draw(st.lists(st.integers(1, 6), min_size=n * S, max_size=n * S)), float).reshape(n, S)
    weight = np.array(data.draw(st.lists(st.integers(1, 5), min_size=n * S, max_size=n * S))).reshape(n, S)
    first = np.array(data.draw(st.lists(st.integers(0, S), min_size=n, max_size=n)))
    stages = data.draw(st.integers(1, 3))
    lasts = [np.array(data.draw(st.lists(st.integers(-1, S - 1), min_size=n, max_size=n))) for _ in range(stages)]
    target = data.draw(st.integers(0, 3 * n * S))  # 0: nothing to free, no pick
    keys = chain_keys(np.ascontiguousarray(ratio.T), first)
    out = chain_greedy_stages(MatrixChains(keys, np.ascontiguousarray(weight.T)), np.arange(n), first, lasts, target)
    for s, last in enumerate(lasts):
        cols, rows = out[s]
        assert list(zip(rows.tolist(), cols.tolist())) == brute_chain_greedy(ratio, weight, first, last, target)


def test_chain_greedy_stages_matches_the_frontier_loop_over_many_tied_chains():
    """More chains than the target needs, so only a partial sort runs: chains whose first key ties the bound count."""
    rng = np.random.default_rng(0)
    for _ in range(400):
        n, S = int(rng.integers(8, 30)), int(rng.integers(1, 6))
        ratio, weight = rng.integers(1, 4, (n, S)).astype(float), rng.integers(1, 6, (n, S))
        first, last = rng.integers(0, S + 1, n), rng.integers(-1, S, n)
        target = int(rng.integers(1, 3 * n))
        keys = chain_keys(np.ascontiguousarray(ratio.T), first)
        cols, rows = chain_greedy_stages(MatrixChains(keys, np.ascontiguousarray(weight.T)), np.arange(n), first,
                                         [last], target)[0]
        assert list(zip(rows.tolist(), cols.tolist())) == brute_chain_greedy(ratio, weight, first, last, target)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 9), min_size=0, max_size=12), st.integers(0, 30))
def test_fit_in_order_is_the_skip_loop(costs, budget):
    cost = np.array(costs, dtype=np.int64)
    order = np.arange(cost.size)[::-1]
    expected, left = [], budget
    for i in order:
        if cost[i] <= left:
            expected.append(int(i))
            left -= cost[i]
    assert fit_in_order(order, cost, budget).tolist() == expected


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_expert_buckets_match_sorted_ranks(data):
    layers, experts = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 9))
    mass = np.array(data.draw(st.lists(st.integers(0, 3), min_size=layers * experts, max_size=layers * experts)),
                    float).reshape(layers, experts)
    k = data.draw(st.integers(0, 3))
    bounds = tuple(sorted(data.draw(st.lists(st.floats(0.0, 1.0), min_size=k, max_size=k)))) + (1.0,)
    assert expert_buckets(mass, layers, experts, bounds).tolist() == ref_buckets(mass.tolist(), layers, experts, bounds)


def ref_reload(table, cal, obs, margin, threshold, ceiling):
    """{block: to_bits} of a reload: one supported bitwidth up, most damage recovered per byte first."""
    T, B = obs.free_block_threshold, obs.kv_block_bytes
    free = obs.free_blocks - obs.pending_kv_blocks
    keep = T + 1 + margin
    if free <= max(threshold, keep):
        return {}
    flight = table.in_flight_bytes()
    reloading = sum(int(flight[i]) for i in range(table.num_blocks) if table.busy[i] and table.target[i] > table.q[i])
    budget = (free - keep) * B + obs.headroom_bytes - reloading
    buckets = ref_buckets(None if obs.routing_mass is None else obs.routing_mass.tolist(), table.layers,
                          table.experts, cal.bucket_bounds)
    cands = []
    for i in range(table.num_blocks):
        q = int(table.q[i])
        up = [b for b in sorted(table.bits) if b > q]
        if table.busy[i] or not up or up[0] > ceiling[i]:
            continue
        u = up[0]
        bucket = buckets[int(table.layer[i])][int(table.expert[i])]
        d = ref_step_damage(cal, table, i, u, q, cal.bucket_multipliers[bucket], obs.prompt_features, cal.alpha)
        out_f, in_f = (int(x) for x in table.shapes[i])
        cost = (u - q) * out_f * (-(-in_f // 32)) * 4 + out_f * 2 ** u * 2
        cands.append((-d / cost, i, u, cost))
    got = {}
    for _, i, u, cost in sorted(cands):
        if cost <= budget:
            got[i] = u
            budget -= cost
    return got


def test_reload_equals_reference():
    checked = partial = 0
    for seed in range(120):
        table, cal, policy, obs, start = random_case(seed, ties=seed % 2 == 1, reload_threshold=6)
        rng = np.random.default_rng(seed)
        for i in np.flatnonzero(~table.busy & (table.q < 8)):  # some reloads in flight too
            if rng.random() < 0.15:
                table.begin_reload(int(i), int(table.q[i]) + 1)
        free = int(max(6, obs.free_block_threshold + 5) + rng.integers(1, 5))
        B = int(table.M[:, 8].mean() * rng.uniform(0.1, 1.0))  # budgets that bind: order and skips matter
        o = Observation(step=2, time_s=0.0, free_blocks=free, total_blocks=200, kv_block_bytes=B,
                        free_block_threshold=obs.free_block_threshold, pending_kv_blocks=int(rng.integers(0, 3)),
                        headroom_bytes=int(rng.integers(0, B)), routing=obs.routing)
        plan = policy.plan_step(table, o)
        got = {} if plan is None else {t.block: t.to_bits for t in plan.transitions}
        assert got == ref_reload(table, cal, o, policy.params.reload_margin_blocks, 6, start), f"seed {seed}"
        checked += plan is not None
        partial += plan is not None and len(plan) < int(((table.q < start) & ~table.busy).sum())
    assert checked > 40 and partial > 10  # plans where the budget binds, so order and skipping matter
