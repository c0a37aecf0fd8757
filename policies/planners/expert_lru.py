"""The expert-lru baseline: whole experts at one bitwidth cached on the GPU, least recently used out.

Like expert-offloading runtimes: both blocks of an expert are either resident at `bits` or absent
(0 bits, nothing on the GPU), the cache holds `budget_bytes // expert bytes` experts, and an
expert the router picks that is absent is a miss, fetched from the CPU master copy while the least
recently used resident experts are evicted to make room (evictions come first in the plan, so the
bytes are free before the fetches need them). It ignores KV pressure: its budget is fixed.

Which experts were used at a step: engines that know the exact routing call `touch(used)` before
`plan_step`; otherwise it is read off the routing mass. With `policies.observe.RoutingMass`
(decayed or cumulative sums, normalised per layer), every expert not routed since the previous
observation has its share scaled by the same factor, and a routed one by more; so the experts whose
share ratio exceeds the layer's smallest ratio (or that appear from zero) were routed. Engines
must stall a forward that routes to an absent expert until its fetch lands (mechanism, not policy).
Initial cache: the experts with the lowest index in every layer, round robin over layers.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from policies.contract import Observation, Plan, Transition
from policies.planners.base import PolicyError


@dataclass(frozen=True)
class ExpertLruParams:
    bits: int = 4
    budget_bytes: int = 0  # GPU bytes for cached experts; 0 = room for every expert
    max_fetch_per_step: int = 0  # 0 = no limit

    def __post_init__(self) -> None:
        if not 1 <= self.bits <= 8:
            raise ValueError(f"bits must be in 1..8, got {self.bits}")
        if self.budget_bytes < 0 or self.max_fetch_per_step < 0:
            raise ValueError("budget_bytes and max_fetch_per_step must be >= 0")


def routed_since(prev: np.ndarray | None, cur: np.ndarray | None, rtol: float = 1e-9) -> np.ndarray | None:
    """[layers, experts] experts routed between two normalised routing-mass observations."""
    if cur is None:
        return None
    cur = np.asarray(cur, dtype=np.float64)
    if prev is None:
        return cur > 0
    prev = np.asarray(prev, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(prev > 0, cur / prev, np.inf)
    base = np.where(prev > 0, ratio, np.inf).min(axis=1, keepdims=True)
    changed = ~(cur == prev).all(axis=1, keepdims=True)
    return changed & (cur > 0) & ((prev <= 0) | (ratio > base * (1 + rtol)))


@dataclass
class ExpertLruPolicy:
    params: ExpertLruParams = field(default_factory=ExpertLruParams)
    name: str = "expert-lru"
    capacity: int = 0
    last_used: np.ndarray | None = None  # [layers, experts] step of last use, -1 never
    misses: int = 0
    _prev_mass: np.ndarray | None = None
    _touched: np.ndarray | None = None

    def reset(self, table, calibration) -> None:
        b = self.params.bits
        if b not in table.bits:
            raise PolicyError(f"expert-lru: {b} bits not supported by the page table {table.bits}")
        per_expert = int(table.M[0, b] + table.M[1, b])
        total = table.layers * table.experts
        cap = total if self.params.budget_bytes == 0 else self.params.budget_bytes // per_expert
        if cap < 1:
            raise PolicyError(f"expert-lru budget {self.params.budget_bytes} B holds no expert "
                              f"(one expert at {b} bits is {per_expert} B); raise budget_bytes")
        self.capacity = int(min(cap, total))
        warm = np.argsort(_round_robin(table.layers, table.experts), kind="stable")[: self.capacity]
        resident = np.zeros(total, dtype=bool)
        resident[warm] = True
        table.initialize(np.repeat(np.where(resident, b, 0), 2))
        self.last_used = np.full((table.layers, table.experts), -1, dtype=np.int64)
        self.misses, self._prev_mass, self._touched = 0, None, None

    def touch(self, used: np.ndarray) -> None:
        """Tell the policy exactly which experts the last step routed to ([layers, experts] bool)."""
        self._touched = np.asarray(used, dtype=bool)

    def plan_step(self, table, observation: Observation) -> Plan | None:
        if self.last_used is None:
            raise PolicyError("policy 'expert-lru': call reset(table, calibration) before plan_step")
        L, E, b = table.layers, table.experts, self.params.bits
        mass = observation.routing_mass
        used = self._touched if self._touched is not None else routed_since(self._prev_mass, mass)
        self._touched = None
        self._prev_mass = None if mass is None else np.array(mass, dtype=np.float64)
        if used is None:
            return None
        used = used.reshape(-1)
        self.last_used.reshape(-1)[used] = observation.step
        gu, dn = slice(0, None, 2), slice(1, None, 2)
        busy = (table.target[gu] >= 0) | (table.target[dn] >= 0)
        resident = (table.q[gu] > 0) | (table.target[gu] > 0)
        mass_flat = np.zeros(L * E) if mass is None else np.asarray(mass, dtype=np.float64).reshape(-1)
        miss = np.flatnonzero(used & ~resident & ~busy)
        self.misses += int(miss.size)
        fetch = miss[np.lexsort((miss, -mass_flat[miss]))]
        if self.params.max_fetch_per_step:
            fetch = fetch[: self.params.max_fetch_per_step]
        evictable = np.flatnonzero(resident & ~used & ~busy)
        evictable = evictable[np.lexsort((evictable, mass_flat[evictable], self.last_used.reshape(-1)[evictable]))]
        n_res = int(resident.sum())
        n_evict = min(max(0, n_res + fetch.size - self.capacity), evictable.size)
        fetch = fetch[: max(0, self.capacity - n_res + n_evict)]
        trans = []
        for e in np.sort(evictable[:n_evict]):
            for i in (2 * int(e), 2 * int(e) + 1):
                trans.append(Transition(i, int(table.q[i]), 0, int(table.M[i, table.q[i]])))
        for e in np.sort(fetch):
            for i in (2 * int(e), 2 * int(e) + 1):
                trans.append(Transition(i, 0, b, -int(table.M[i, b])))
        if not trans:
            return None
        return Plan(tuple(trans), 0.0, f"expert-lru: {n_evict} evicted, {fetch.size} fetched")


def _round_robin(layers: int, experts: int) -> np.ndarray:
    """Rank of each (layer, expert) in the warm-up order: expert 0 of every layer, then expert 1..."""
    e = np.arange(experts)[None, :].repeat(layers, 0)
    l_ = np.arange(layers)[:, None].repeat(experts, 1)
    return (e * layers + l_).reshape(-1)
