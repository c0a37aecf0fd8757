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

`RoutingStats` is what an engine keeps: both, with each step's routing held until it is needed, so an Observation
computes them only when a planner reads them (`policies.contract.RoutingReadout`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, Iterable, Mapping, Sequence as Seq

import numpy as np

from policies.contract import Observation, RoutingReadout
from policies.features import BatchedPromptFeatures, take_tokens
from policies.sequence import Sequence, SequenceStatus


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


@dataclass(frozen=True)
class _HeldStep:
    """One step's routing, not yet folded into the statistics (arrays as `RoutingStats.add` takes them)."""

    seq_ids: list
    query_lens: np.ndarray
    topk_ids: np.ndarray
    topk_weights: np.ndarray
    gate_up_in_norm: np.ndarray | None
    down_in_norm: np.ndarray | None


@dataclass
class RoutingStats:
    """An engine's routing statistics: the routing mass and (with `features`) the prompt features.

    `add` holds a step's routing and folds the step held before it; `fold` folds it now (the runtime calls it while
    the GPU runs the next forward, so this numpy work overlaps it); reading the mass, a sequence's features or a
    readout folds first. Folding later runs the same numpy calls in the same order as folding each step as it comes,
    so when the work happens never changes what a planner sees. A sequence dropped while its routing is held is left
    out of the prompt features' fold, as dropping it after the fold would have removed it (the routing mass keeps
    every token, as it always did).

    `readout(usage)` is an Observation's RoutingReadout: the mass, and the features merged over `usage` (sequence ->
    KV blocks), each computed when first read. It holds until the next `add` or `drop`; reading it after one raises,
    since it would otherwise see a later step.
    """

    layers: int
    experts: int
    half_life_tokens: float | None = 4096.0
    features: bool = True
    routing: RoutingMass = field(init=False)
    prompt: BatchedPromptFeatures | None = field(init=False)
    _held: _HeldStep | None = field(init=False, default=None)
    _dropped: set = field(init=False, default_factory=set)  # dropped while their routing is held
    _epoch: int = field(init=False, default=0)  # bumped by every add and drop: older readouts refuse to read

    def __post_init__(self) -> None:
        self.routing = RoutingMass(self.layers, self.experts, self.half_life_tokens)
        self.prompt = BatchedPromptFeatures(self.layers, self.experts) if self.features else None

    def add(self, seq_ids: Seq[Hashable], query_lens: Seq[int], topk_ids, topk_weights, gate_up_in_norm=None,
            down_in_norm=None) -> None:
        """Hold one step's flattened batch (ids/weights/down norms [layers, tokens, k], gate_up norms [layers,
        tokens]; without norms only the routing mass is kept). The arrays must not change until folded."""
        self.fold()
        lens = np.asarray(query_lens, dtype=np.int64)
        ids = _as_lt(topk_ids, "topk_ids", 3)
        if int(lens.sum()) != ids.shape[1] or len(lens) != len(seq_ids):
            raise ValueError(f"{len(seq_ids)} sequences with {int(lens.sum())} tokens for routing of {ids.shape[1]}")
        has_norms = gate_up_in_norm is not None and down_in_norm is not None
        self._held = _HeldStep(list(seq_ids), lens, ids, _as_lt(topk_weights, "topk_weights", 3),
                               gate_up_in_norm if has_norms else None, down_in_norm if has_norms else None)
        self._epoch += 1

    def fold(self) -> None:
        """Fold the held step into the routing mass and prompt features (nothing when none is held)."""
        held, self._held = self._held, None
        if held is None:
            return
        self.routing.update(held.topk_ids, held.topk_weights)
        if self.prompt is not None and held.gate_up_in_norm is not None:
            arrays = (held.topk_ids, held.topk_weights, held.gate_up_in_norm, held.down_in_norm)
            seq_ids, lens = held.seq_ids, held.query_lens
            if self._dropped:
                keep = np.array([s not in self._dropped for s in seq_ids], dtype=bool)
                arrays = take_tokens(np.flatnonzero(np.repeat(keep, lens)), *arrays)
                seq_ids, lens = [s for s, k in zip(seq_ids, keep) if k], lens[keep]
            self.prompt.update_batch(seq_ids, lens, *arrays)
        self._dropped.clear()

    def drop(self, seq_id: Hashable) -> None:
        """Forget a sequence's prompt features (finished, or preempted: its recompute adds its tokens again)."""
        if self.prompt is not None:
            self.prompt.drop(seq_id)
            if self._held is not None:
                self._dropped.add(seq_id)
        self._epoch += 1

    def drop_stopped(self, seqs: Iterable[Sequence]) -> None:
        """Drop the sequences among `seqs` that no longer run: those of a batch whose routing was just added that were
        preempted or finished since it was launched (asynchronous scheduling), as if dropped after it."""
        for seq in seqs:
            if seq.status != SequenceStatus.RUNNING:
                self.drop(seq.seq_id)

    def mass(self) -> np.ndarray:
        """RoutingMass.mass() with every step added so far."""
        self.fold()
        return self.routing.mass()

    def sequence_features(self, seq_id: Hashable) -> np.ndarray:
        """BatchedPromptFeatures.sequence_features with every step added so far (zeros without features)."""
        self.fold()
        return (np.zeros((2 * self.layers * self.experts, 3)) if self.prompt is None
                else self.prompt.sequence_features(seq_id))

    def readout(self, usage: Mapping[Hashable, int]) -> RoutingReadout:
        """The routing mass and the prompt features merged over `usage`, computed when first read."""
        epoch = self._epoch

        def current() -> None:
            if self._epoch != epoch:
                raise RuntimeError("an Observation's routing was read after its engine added or dropped routing; "
                                   "read it within the step that built it")
            self.fold()

        def mass() -> np.ndarray:
            current()
            return self.routing.mass()

        def features() -> np.ndarray | None:
            current()
            return None if self.prompt is None else self.prompt.merged(usage)

        return RoutingReadout(mass, features)


def split_tokens(query_lens: Seq[int]) -> list[tuple[int, int]]:
    """[start, end) of each sequence's tokens in a flattened batch."""
    bounds = np.concatenate([[0], np.cumsum(np.asarray(query_lens, dtype=np.int64))])
    return [(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]


def build_observation(*, step: int, time_s: float, pool, scheduler, kv_block_bytes: int,
                      free_block_threshold: int, routing: RoutingStats | None = None, headroom_bytes: int = 0,
                      inflight_bytes: int = 0) -> Observation:
    """The Observation at the end of an iteration, from the shared pool and scheduler state; its routing mass and
    prompt features (when `routing` is given) are computed if a planner reads them."""
    return Observation(
        step=step, time_s=float(time_s),
        free_blocks=pool.num_free, total_blocks=pool.capacity,
        kv_block_bytes=int(kv_block_bytes), free_block_threshold=int(free_block_threshold),
        pending_kv_blocks=scheduler.pending_blocks(),
        headroom_bytes=int(headroom_bytes), inflight_bytes=int(inflight_bytes),
        num_running=len(scheduler.running), num_waiting=len(scheduler.waiting),
        routing=None if routing is None else routing.readout({} if routing.prompt is None else scheduler.block_usage()),
    )
