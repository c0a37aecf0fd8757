"""Online routing statistics and the Observation an engine builds (prompt features: policies.features).

Numpy only; pwsim and pwruntime feed the same arrays (the runtime converts its tensors first), so a
planner sees identical observations from both.

Routing mass (DESIGN Eq. 1, made online): `acc[l, e]` accumulates the routing weight every token
gives expert `e` in MoE layer `l`. Before a step's tokens are added, `acc` decays by
`0.5 ** (T / half_life_tokens)` (T = tokens in the step), i.e. an exponential moving sum whose
half-life is counted in tokens, not iterations, so batch composition does not change its meaning.
`mass()` normalizes each layer's row to sum to 1 (all zeros before any token is seen).
`half_life_tokens=None` disables decay (the plain cumulative Eq. 1).

Prompt features phi (DESIGN Eq. 5): for linear-block `i = (l, e, kind)` and one sequence, over all
tokens the sequence has computed (prompt and outputs; a preempted sequence starts over, as its
recompute will show them again) with routing weight `r` to expert `e`:
mean = sum r*x / sum r, rms = sqrt(sum r*x^2 / sum r), max = max x, where `x` is the L2 norm of
the block's input row: for gate_up, the routed experts' input (one per token); for down, the
intermediate activation fed to that expert's down projection (one per token and top-k slot).
`BatchedPromptFeatures.merged(usage)` (policies.features) averages each block's phi over running sequences that routed to it, weighted by
their KV-block usage; blocks no running sequence routed to get zeros.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, Mapping, Sequence as Seq

import numpy as np

from policies.contract import Observation
from policies.features import BatchedPromptFeatures


def _as_lt(a, name: str, ndim: int) -> np.ndarray:
    arr = np.asarray(a)
    if arr.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dims [layers, tokens{', k' if ndim == 3 else ''}], "
                         f"got shape {arr.shape}")
    return arr


@dataclass
class RoutingMass:
    """Exponentially decayed routing mass per (layer, expert); see the module docstring."""

    layers: int
    experts: int
    half_life_tokens: float | None = 4096.0
    acc: np.ndarray = field(init=False)
    tokens_seen: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        if self.half_life_tokens is not None and self.half_life_tokens <= 0:
            raise ValueError("half_life_tokens must be positive or None")
        self.acc = np.zeros((self.layers, self.experts), dtype=np.float64)

    def update(self, topk_ids, topk_weights) -> None:
        """Add one step's routing: `topk_ids`, `topk_weights` shaped [layers, tokens, k]."""
        ids = _as_lt(topk_ids, "topk_ids", 3)
        w = _as_lt(topk_weights, "topk_weights", 3).astype(np.float64)
        if ids.shape != w.shape or ids.shape[0] != self.layers:
            raise ValueError(f"routing shapes {ids.shape} / {w.shape} do not match {self.layers} layers")
        t = ids.shape[1]
        if t == 0:
            return
        if self.half_life_tokens is not None:
            self.acc *= 0.5 ** (t / self.half_life_tokens)
        flat = (np.arange(self.layers)[:, None, None] * self.experts + ids).ravel()
        self.acc += np.bincount(flat, weights=w.ravel(), minlength=self.layers * self.experts).reshape(
            self.layers, self.experts)
        self.tokens_seen += t

    def mass(self) -> np.ndarray:
        """[layers, experts], each row sums to 1 (or is all zeros before any routing is seen)."""
        total = self.acc.sum(axis=1, keepdims=True)
        return np.divide(self.acc, total, out=np.zeros_like(self.acc), where=total > 0)


def split_tokens(query_lens: Seq[int]) -> list[tuple[int, int]]:
    """[start, end) of each sequence's tokens in a flattened batch."""
    bounds = np.concatenate([[0], np.cumsum(np.asarray(query_lens, dtype=np.int64))])
    return [(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]


def build_observation(*, step: int, time_s: float, pool, scheduler, kv_block_bytes: int,
                      free_block_threshold: int, routing: RoutingMass | None = None,
                      features: BatchedPromptFeatures | None = None, headroom_bytes: int = 0,
                      inflight_bytes: int = 0) -> Observation:
    """The Observation at the end of an iteration, from the shared pool and scheduler state."""
    return Observation(
        step=step, time_s=float(time_s),
        free_blocks=pool.num_free, total_blocks=pool.capacity,
        kv_block_bytes=int(kv_block_bytes), free_block_threshold=int(free_block_threshold),
        pending_kv_blocks=scheduler.pending_blocks(),
        headroom_bytes=int(headroom_bytes), inflight_bytes=int(inflight_bytes),
        num_running=len(scheduler.running), num_waiting=len(scheduler.waiting),
        routing_mass=None if routing is None else routing.mass(),
        prompt_features=None if features is None else features.merged(scheduler.block_usage()),
    )
