"""Parity: the planner decisions the simulator makes equal those of a runtime-style driver of the same loop.

The simulator runs the shared `policies.loop.PlanLoop`. Here a model-free driver, built the way
pwruntime's engine builds its loop (a fresh page table, the policy reset on it, a mover, a reserve
callback), is fed the very observations the simulator produced, with transfers landing at the
same boundaries and the same answers to its memory reservations. Every plan, every begun and
refused transition and every commit must be identical, step for step.
"""
from __future__ import annotations

import numpy as np
import pytest

import policies
from policies.loop import PlanLoop
from sim_fixtures import tiny_sim


class ScriptedMover:
    """The runtime side's mover: lands the blocks the simulator's link landed at each boundary."""

    def __init__(self, schedule: list[list[int]]) -> None:
        self.schedule, self.k, self.started = schedule, 0, []

    def start(self, t, nbytes: int) -> None:
        self.started.append((t.block, t.to_bits, nbytes))

    def landed(self) -> list[int]:
        out = self.schedule[self.k]
        self.k += 1
        return list(out)


def _record(sim):
    """Wrap the simulator's loop: observations, results, landings and reservation answers per step."""
    log = {"obs": [], "res": [], "landed": [], "reserve": [], "started": []}
    landed, reserve, step = sim.mover.landed, sim._reserve, sim.loop.step
    start = sim.mover.start

    def landed_logged():
        out = landed()
        log["landed"].append(list(out))
        return out

    def reserve_logged(nbytes):
        ok = reserve(nbytes)
        log["reserve"].append((nbytes, ok))
        return ok

    def start_logged(t, nbytes):
        log["started"].append((t.block, t.to_bits, nbytes))
        return start(t, nbytes)

    def step_logged(obs):
        log["obs"].append(obs)
        res = step(obs)
        log["res"].append(res)
        return res

    sim.mover.landed, sim.mover.start = landed_logged, start_logged
    sim.loop._reserve, sim.loop.step = reserve_logged, step_logged
    return log


@pytest.mark.parametrize("policy,params", [("pagedweight", {}), ("pagedweight-no-routing", {}),
                                           ("dp-llm", {"target_bits": 5.0})])
def test_planner_decisions_match_a_runtime_driver_of_the_same_loop(policy, params):
    extra = 600 if policy == "dp-llm" else 16  # dp-llm keeps every plane resident: give it the room
    sim = tiny_sim(policy, kv_blocks=extra, n=40, slack=256 * 1024, params=params)
    log = _record(sim)
    sim.run()
    assert len(log["obs"]) > 20 and any(r.plan is not None for r in log["res"]), "the scenario must plan"

    # the runtime side: its own table and policy, the same loop class, scripted mechanism
    table = sim.card.page_table(bits=sim.cal.bits)
    pol = policies.get(policy, **params)
    pol.reset(table, sim.cal)
    answers = iter(log["reserve"])

    def reserve(nbytes):
        want, ok = next(answers)
        assert want == nbytes, "the runtime driver asked for different reload room"
        return ok

    mover = ScriptedMover(log["landed"])
    loop = PlanLoop(pol, table, mover, reserve=reserve, lut_slack_bytes=sim.loop.lut_slack_bytes)
    for k, (obs, sim_res) in enumerate(zip(log["obs"], log["res"])):
        res = loop.step(obs)
        assert res.plan == sim_res.plan, f"step {k}: plans differ"
        assert res.started == sim_res.started and res.rejected == sim_res.rejected, f"step {k}"
        assert res.committed == sim_res.committed, f"step {k}: commits differ"
    assert mover.started == log["started"]
    assert np.array_equal(table.q, sim.table.q) and np.array_equal(table.planes, sim.table.planes)
    assert next(answers, None) is None
