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
`BatchedPromptFeatures.merged(usage)` (policies.features) averages each block's phi over running sequences that
routed to it, weighted by their KV-block usage; blocks no running sequence routed to get zeros.

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
        self.update_steps([(topk_ids, topk_weights)])

    def update_steps(self, steps: Seq[tuple]) -> None:
        """Add several steps' routing at once, oldest first, each `(topk_ids, topk_weights)` as `update` takes them.

        One bincount for all: step s's weights are scaled by the decays of the steps after it and `acc` by all of
        them, so the result is what one `update` a step gives up to rounding (a single step: bit for bit)."""
        ids_all, w_all, counts = [], [], []
        for topk_ids, topk_weights in steps:
            ids, w = _as_lt(topk_ids, "topk_ids", 3), _as_lt(topk_weights, "topk_weights", 3)
            if ids.shape != w.shape or ids.shape[0] != self.layers:
                raise ValueError(f"routing shapes {ids.shape} / {w.shape} do not match {self.layers} layers")
            if ids.shape[1]:
                ids_all.append(ids)
                w_all.append(w)
                counts.append(ids.shape[1])
        if not ids_all:
            return
        ids = ids_all[0] if len(ids_all) == 1 else np.concatenate(ids_all, axis=1)
        w = (w_all[0] if len(w_all) == 1 else np.concatenate(w_all, axis=1)).astype(np.float64)
        if self.half_life_tokens is not None:
            decay = [0.5 ** (c / self.half_life_tokens) for c in counts]
            after = [1.0]  # step s: the product of the decays of the steps after it, last step first
            for d in decay[:0:-1]:
                after.append(after[-1] * d)
            after.reverse()
            self.acc *= after[0] * decay[0]
            if len(counts) > 1:
                w *= np.repeat(after, counts)[None, :, None]
        self.tokens_seen += sum(counts)
        flat = (np.arange(self.layers)[:, None, None] * self.experts + ids).ravel()
        self.acc += np.bincount(flat, weights=w.ravel(), minlength=self.layers * self.experts).reshape(
            self.layers, self.experts)

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

    `add` holds a step's routing; `fold` folds every held step now, in one batch (a few numpy calls whatever the
    number of steps: a small model's decode steps paid those calls' overhead a step); reading the mass, a sequence's
    features or a readout folds first, and `add` folds once the held steps route `hold_slots` (token, layer, top-k)
    slots or more (the runtime calls `fold_when_full` while the GPU runs the next forward, so that numpy work
    overlaps it). Where experts outnumber the held slots of the sequences (a large model's steps), the held steps
    still fold one at a time (`_batch_pays`). Sums come out as one fold a step gives up to rounding, maxima exactly;
    which steps a fold batches depends only on the steps and the reads, so the same run folds the same way. A sequence
    dropped while its routing is held is left out of the prompt features' fold of the steps held then, as dropping it
    after folding them would have removed it (it is in the steps added after the drop: a preempted sequence's
    recompute; the routing mass keeps every token, as it always did).

    `readout(usage)` is an Observation's RoutingReadout: the mass, and the features merged over `usage` (sequence ->
    KV blocks), each computed when first read. It holds until the next `add` or `drop`; reading it after one raises,
    since it would otherwise see a later step.
    """

    layers: int
    experts: int
    half_life_tokens: float | None = 4096.0
    features: bool = True
    hold_slots: int = 16384
    routing: RoutingMass = field(init=False)
    prompt: BatchedPromptFeatures | None = field(init=False)
    _held: list = field(init=False, default_factory=list)  # _HeldStep, oldest first
    _held_slots: int = field(init=False, default=0)  # their routing slots
    _dropped: dict = field(init=False, default_factory=dict)  # seq_id -> the held steps it is left out of (a count)
    _epoch: int = field(init=False, default=0)  # bumped by every add and drop: older readouts refuse to read

    def __post_init__(self) -> None:
        if self.hold_slots < 1:
            raise ValueError(f"hold_slots must be at least 1, got {self.hold_slots}")
        self.routing = RoutingMass(self.layers, self.experts, self.half_life_tokens)
        self.prompt = BatchedPromptFeatures(self.layers, self.experts) if self.features else None

    def add(self, seq_ids: Seq[Hashable], query_lens: Seq[int], topk_ids, topk_weights, gate_up_in_norm=None,
            down_in_norm=None) -> None:
        """Hold one step's flattened batch (ids/weights/down norms [layers, tokens, k], gate_up norms [layers,
        tokens]; without norms only the routing mass is kept). The arrays must not change until folded."""
        self.fold_when_full()
        lens = np.asarray(query_lens, dtype=np.int64)
        ids = _as_lt(topk_ids, "topk_ids", 3)
        if int(lens.sum()) != ids.shape[1] or len(lens) != len(seq_ids):
            raise ValueError(f"{len(seq_ids)} sequences with {int(lens.sum())} tokens for routing of {ids.shape[1]}")
        has_norms = gate_up_in_norm is not None and down_in_norm is not None
        self._held.append(_HeldStep(list(seq_ids), lens, ids, _as_lt(topk_weights, "topk_weights", 3),
                                    gate_up_in_norm if has_norms else None, down_in_norm if has_norms else None))
        self._held_slots += ids.size
        self._epoch += 1

    def fold_when_full(self) -> None:
        """Fold the held steps if they route `hold_slots` slots or more (what `add` does before holding one more)."""
        if self._held_slots >= self.hold_slots:
            self.fold()

    def fold(self) -> None:
        """Fold the held steps into the routing mass and prompt features (nothing when none is held)."""
        held, self._held, self._held_slots = self._held, [], 0
        dropped, self._dropped = self._dropped, {}
        if not held:
            return
        self.routing.update_steps([(h.topk_ids, h.topk_weights) for h in held])
        if self.prompt is None:
            return
        steps = []  # (seq ids, query lens, arrays) of the held steps with norms, their dropped sequences left out
        for i, h in enumerate(held):
            if h.gate_up_in_norm is None:
                continue
            step = (h.topk_ids, h.topk_weights, h.gate_up_in_norm, h.down_in_norm)
            ids, lens = h.seq_ids, h.query_lens
            keep = [dropped.get(s, 0) <= i for s in ids] if dropped else ()
            if not all(keep):
                keep = np.array(keep, dtype=bool)
                step = take_tokens(np.flatnonzero(np.repeat(keep, lens)), *step)
                ids, lens = [s for s, k in zip(ids, keep) if k], lens[keep]
            steps.append((ids, lens, step))
        if len(steps) > 1 and self._batch_pays(steps):
            seq_ids = [s for ids, _, _ in steps for s in ids]
            lens = np.concatenate([lens for _, lens, _ in steps])
            arrays = (np.concatenate(a, axis=1) for a in zip(*(step for *_, step in steps)))
            self.prompt.update_batch(seq_ids, lens, *arrays)
        else:
            for ids, lens, step in steps:
                self.prompt.update_batch(ids, lens, *step)

    def _batch_pays(self, steps: list) -> bool:
        """Whether one update of several steps costs less than one a step: the batch works on every expert of each
        sequence it touches (layers x experts a sequence), a step only on the slots it routes (tokens x layers x k),
        so a batch pays where its sequences came back for more tokens than they have experts (a small model's decode
        steps), not where experts outnumber them (a large model's)."""
        seqs = len({s for ids, _, _ in steps for s in ids})
        return seqs * self.layers * self.experts <= sum(step[0].size for _, _, step in steps)

    def drop(self, seq_id: Hashable) -> None:
        """Forget a sequence's prompt features (finished, or preempted: its recompute adds its tokens again)."""
        if self.prompt is not None:
            self.prompt.drop(seq_id)
            if self._held:
                self._dropped[seq_id] = len(self._held)
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
