"""Online routing statistics, per-sequence prompt features and the Observation an engine builds.

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
`merged(usage)` averages each block's phi over running sequences that routed to it, weighted by
their KV-block usage; blocks no running sequence routed to get zeros.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, Mapping, Sequence as Seq

import numpy as np

from policies.contract import Observation


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


@dataclass
class PromptFeatures:
    """Per-sequence accumulators of the phi features, one row per linear-block (page-table order)."""

    layers: int
    experts: int
    _acc: dict = field(init=False, default_factory=dict)  # seq_id -> [num_blocks, 4]: sum r, sum r*x, sum r*x^2, max x

    @property
    def num_blocks(self) -> int:
        return self.layers * self.experts * 2

    def update(self, seq_id: Hashable, topk_ids, topk_weights, gate_up_in_norm, down_in_norm) -> None:
        """Add one sequence's tokens: ids/weights/down norms [layers, n, k], gate_up norms [layers, n]."""
        ids = _as_lt(topk_ids, "topk_ids", 3)
        w = _as_lt(topk_weights, "topk_weights", 3).astype(np.float64)
        gu = _as_lt(gate_up_in_norm, "gate_up_in_norm", 2).astype(np.float64)
        dn = _as_lt(down_in_norm, "down_in_norm", 3).astype(np.float64)
        if not (ids.shape == w.shape == dn.shape and gu.shape == ids.shape[:2] and ids.shape[0] == self.layers):
            raise ValueError(f"feature shapes disagree: ids {ids.shape}, weights {w.shape}, "
                             f"gate_up norms {gu.shape}, down norms {dn.shape}, layers {self.layers}")
        if ids.shape[1] == 0:
            return
        acc = self._acc.get(seq_id)
        if acc is None:
            acc = self._acc[seq_id] = np.zeros((self.num_blocks, 4), dtype=np.float64)
        base = (np.arange(self.layers)[:, None, None] * self.experts + ids) * 2
        x_gu = np.broadcast_to(gu[:, :, None], ids.shape)
        for kind, x in ((0, x_gu), (1, dn)):
            idx = (base + kind).ravel()
            xr, wr = x.ravel(), w.ravel()
            acc[:, 0] += np.bincount(idx, weights=wr, minlength=self.num_blocks)
            acc[:, 1] += np.bincount(idx, weights=wr * xr, minlength=self.num_blocks)
            acc[:, 2] += np.bincount(idx, weights=wr * xr * xr, minlength=self.num_blocks)
            np.maximum.at(acc[:, 3], idx, xr)

    def drop(self, seq_id: Hashable) -> None:
        """Forget a sequence (finished, or preempted: its recompute will add its tokens again)."""
        self._acc.pop(seq_id, None)

    def sequences(self) -> list:
        return list(self._acc)

    def sequence_features(self, seq_id: Hashable) -> np.ndarray:
        """[num_blocks, 3] phi of one sequence (zeros for blocks it never routed to)."""
        acc = self._acc.get(seq_id)
        out = np.zeros((self.num_blocks, 3))
        if acc is None:
            return out
        seen = acc[:, 0] > 0
        out[seen, 0] = acc[seen, 1] / acc[seen, 0]
        out[seen, 1] = np.sqrt(acc[seen, 2] / acc[seen, 0])
        out[seen, 2] = acc[seen, 3]
        return out

    def merged(self, usage: Mapping[Hashable, int]) -> np.ndarray:
        """[num_blocks, 3] phi averaged over `usage`'s sequences, weighted by their KV blocks."""
        num = np.zeros((self.num_blocks, 3))
        den = np.zeros(self.num_blocks)
        for sid, blocks in usage.items():
            acc = self._acc.get(sid)
            if acc is None or blocks <= 0:
                continue
            seen = acc[:, 0] > 0
            num[seen] += blocks * self.sequence_features(sid)[seen]
            den[seen] += blocks
        return np.divide(num, den[:, None], out=np.zeros_like(num), where=den[:, None] > 0)


def split_tokens(query_lens: Seq[int]) -> list[tuple[int, int]]:
    """[start, end) of each sequence's tokens in a flattened batch."""
    bounds = np.concatenate([[0], np.cumsum(np.asarray(query_lens, dtype=np.int64))])
    return [(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]


def build_observation(*, step: int, time_s: float, pool, scheduler, kv_block_bytes: int,
                      free_block_threshold: int, routing: RoutingMass | None = None,
                      features: PromptFeatures | None = None, headroom_bytes: int = 0,
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
