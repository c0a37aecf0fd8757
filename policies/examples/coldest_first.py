"""An example planner of one's own: under KV pressure, lower the least-routed experts' blocks first.

It is a template for writing a planner, not a tuned one (PagedWeight, policies/planners/pagedweight.py, weighs each
step's predicted damage). Any dataclass with a `name`, `reset(table, calibration)` and `plan_step(table,
observation)` is a planner; its fields are its `--policy-arg` parameters. Both engines run it by file name, unchanged:

    pwsim policies policies/examples/coldest_first.py:ColdestFirst
    pwsim run --policy policies/examples/coldest_first.py:ColdestFirst --budget 24MiB --out runs/coldest
    pwruntime replay --trace traces/bundled/demo-trace --ap runs/demo_ap --calibration traces/bundled/demo-calibration \\
        --policy policies/examples/coldest_first.py:ColdestFirst --gpu-memory-budget 24MiB --out runs/coldest-replay

A plan is a set of transitions (`policies.Transition`) that the engines begin at the iteration boundary; the page
table's `q` (committed bits) and `target` (bits of a transfer in flight, -1 for none) are what it reads.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from policies.contract import Observation, Plan
from policies.page_table import PageTable
from policies.planners.base import PolicyError, in_flight_split, make_plan


@dataclass
class ColdestFirst:
    """Under KV pressure, lower the least-routed experts' blocks a bitwidth at a time; raise the hottest back after."""

    name: ClassVar[str] = "coldest-first"
    floor_bits: int = 3  # no block goes below this
    reload_margin_blocks: int = 16  # free KV blocks above the engine's threshold before anything is raised again

    def reset(self, table: PageTable, calibration) -> None:
        """Start where the calibration starts its blocks (as PagedWeight does), else where the table has them."""
        if self.floor_bits not in table.bits:
            raise PolicyError(f"floor_bits {self.floor_bits} is not a supported bitwidth {table.bits}")
        if calibration is not None:
            table.initialize(np.asarray(calibration.initial_bits))
        self._start = table.q.copy()  # what a block is raised back to: the bits it started at
        bits = np.array([b for b in table.bits if b >= self.floor_bits])
        # for every bitwidth b: the next supported one below it (0 when none) and above it (8 when none)
        self._down = np.array([bits[bits < b].max(initial=0) for b in range(9)])
        self._up = np.array([bits[bits > b].min(initial=8) for b in range(9)])

    def plan_step(self, table: PageTable, observation: Observation) -> Plan | None:
        obs = observation
        free = obs.free_blocks - obs.pending_kv_blocks
        idle = table.target < 0
        short = (obs.free_block_threshold + 1 - free) * obs.kv_block_bytes
        if short > 0:  # pressure: free `need` bytes, counting what offloads in flight will release and spare bytes
            need = short - in_flight_split(table)[0] - max(0, obs.headroom_bytes)
            lower = np.flatnonzero(idle & (self._down[table.q] > 0))
            if need <= 0 or lower.size == 0:
                return None
            order = lower[np.argsort(self._heat(table, obs)[lower], kind="stable")]  # coldest first
            to = self._down[table.q[order]]
            freed = np.cumsum(table.M[order, table.q[order]] - table.M[order, to])
            k = int(np.searchsorted(freed, need)) + 1  # the fewest coldest blocks that free `need`
            return make_plan(table, order[:k], to[:k], 0.0, f"coldest-first: {need} bytes")
        room = (free - obs.free_block_threshold - self.reload_margin_blocks) * obs.kv_block_bytes
        raise_ = np.flatnonzero(idle & (table.q < self._start))
        to = np.minimum(self._up[table.q[raise_]], self._start[raise_])
        cost = table.M[raise_, to] - table.M[raise_, table.q[raise_]]
        if room <= 0 or raise_.size == 0 or cost.min() > room:
            return None  # decided without the routing statistics, which cost an engine a read
        order = np.argsort(-self._heat(table, obs)[raise_], kind="stable")  # hottest first
        k = int(np.searchsorted(np.cumsum(cost[order]), room, side="right"))  # as many as the room holds
        return make_plan(table, raise_[order[:k]], to[order[:k]], 0.0, "coldest-first: reload")

    @staticmethod
    def _heat(table: PageTable, obs: Observation) -> np.ndarray:
        """Per block: its expert's share of the recent routing (zeros when the engine keeps none)."""
        mass = obs.routing_mass
        if mass is None:
            return np.zeros(table.num_blocks)
        return np.asarray(mass)[table.layer, table.expert]
