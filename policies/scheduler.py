"""Continuous-batching scheduler: admission, chunked prefill, decode, preemption by recompute.

Pure python and deterministic (no clocks, no randomness), shared by pwsim and pwruntime: both call
`schedule()` once per iteration, run the batch (tensors or a cost model), then `advance()` (the computed tokens)
and `settle()` (the sampled ones): at once, or a step apart with asynchronous scheduling (`postprocess()` is the
two together).

Rules of one `schedule()` call, with a token budget of `max_num_batched_tokens`:

1. Running sequences, oldest admitted first, each get `min(uncomputed tokens, budget left)` new
   tokens: one for a decode, a chunk of the prompt for a sequence still in (chunked) prefill.
   When the pool cannot hold those tokens, the newest running sequence is preempted (its blocks
   freed, its progress reset to 0, its generated tokens kept, put back at the head of the waiting
   queue) until it can; if the sequence itself is the newest, it is preempted. A sequence that is
   alone in the batch is never preempted: the step stalls instead (see 3).
2. If nobody was preempted this step, waiting sequences are admitted first-come first-served
   while there is budget, fewer than `max_num_seqs` run, and the pool can hold the head's first
   chunk (`min(uncomputed, budget left)` tokens). The head blocks the queue (no overtaking).
   With a prefix-caching pool, a sequence with token ids (a length-only one has none) first shares
   the cached full blocks that prefix its known tokens (`Sequence.num_known_tokens`: prompt and
   outputs so far for a re-admitted runtime sequence, the prompt alone for a simulated one, whose
   outputs are `UNKNOWN_TOKEN`), but at least its last token is computed (the step that samples
   needs its logits): its chunk starts after them, and only the blocks it takes from the free list
   count against the pool. A sequence with `share_cached_prefix` off shares none.
3. A step that schedules nothing while requests are unfinished is a *stall* (the pool is too
   small for the oldest request on its own). An engine keeps calling (its planner may grow the
   pool meanwhile); after `stall_limit` consecutive stalls the blocking request is finished with
   reason "kv_capacity", keeping what it generated. So every request finishes.

`postprocess(batch, sampled)` advances `num_computed_tokens`, appends the sampled tokens
(`None` for a simulator: `UNKNOWN_TOKEN` each), applies the stops (EOS, stop tokens, max tokens,
then the engine's optional `stop(seq)` callback, e.g. for stop strings), and frees finished blocks.
With a prefix-caching pool it first registers each entry's newly full computed blocks that hold only
known tokens (a block holding an unknown output is never cached), so even a sequence that finishes in
this step leaves them cached.

`postprocess` is two halves, which an engine with asynchronous scheduling (vLLM's `--async-scheduling`) calls a
step apart: `advance(batch)` right after the batch is launched (progress, cached blocks, and a `PENDING_TOKEN` for
each token being sampled), so that the next `schedule()` can run while the device still computes this batch; then
`settle(batch, sampled)` once the sampled tokens reached the host (the pending tokens replaced, the stops applied).
A sequence whose pending token is its last (`max_tokens`) is not scheduled again; one that a settled token
finishes may have been scheduled once more meanwhile: its later pending tokens are dropped and the entry of it in
that batch is skipped when settled. Until every batch is settled, a schedule that finds nothing to run because
sequences await their last token is not a stall.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Hashable, Iterable, NamedTuple, Sequence as Seq

from policies.kv_blocks import BlockPool
from policies.sequence import PENDING_TOKEN, UNKNOWN_TOKEN, Sequence, SequenceStatus


class ScheduledSeq(NamedTuple):
    """One sequence's share of a step: tokens at positions [start, start + num_new_tokens).

    A named tuple (immutable, like the rest of a batch): a step makes one per running sequence, and a tuple is
    built several times faster than a frozen dataclass."""

    seq: Sequence
    num_new_tokens: int
    start: int  # tokens already in the cache (context length) before this step
    sample: bool  # this step reaches the sequence's last known token: sample the next one
    is_decode: bool = False  # one token after a complete context (not a prefill or recompute chunk)


@dataclass(frozen=True)
class ScheduledBatch:
    step: int
    entries: tuple[ScheduledSeq, ...]
    preempted: tuple[Sequence, ...] = ()
    aborted: tuple[Sequence, ...] = ()  # finished with "kv_capacity" by this call
    stalled: bool = False
    num_running: int = 0  # after scheduling
    num_waiting: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(e.num_new_tokens for e in self.entries)

    @property
    def num_decode_tokens(self) -> int:
        return sum(1 for e in self.entries if e.is_decode)

    @property
    def num_prefill_tokens(self) -> int:
        return self.num_tokens - self.num_decode_tokens

    @property
    def num_sampled(self) -> int:
        return sum(1 for e in self.entries if e.sample)

    @property
    def is_empty(self) -> bool:
        return not self.entries

    def mark_scheduled(self, now: float) -> None:
        """Note `now`, the engine's time of this batch, on the sequences it holds for the first time (a request's
        queueing delay is from its arrival to then)."""
        for e in self.entries:
            if e.seq.first_scheduled_time is None:
                e.seq.first_scheduled_time = now


@dataclass
class Scheduler:
    """Waiting/running queues over one BlockPool; see the module docstring for the rules."""

    pool: BlockPool
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    stall_limit: int = 8
    waiting: deque = field(default_factory=deque)
    running: list = field(default_factory=list)  # admission order, oldest first
    num_steps: int = 0
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # tokens admissions skipped because their blocks were cached (prefix caching)
    _stalls: int = 0
    _block_hashes: dict = field(default_factory=dict)  # seq_id -> chained hashes of its known full blocks (prefix caching)

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")

    # ------------------------------------------------------------------ queue
    def add(self, seq: Sequence) -> None:
        if seq.status != SequenceStatus.WAITING or seq.num_computed_tokens:
            raise ValueError(f"sequence {seq.seq_id!r} is not a fresh waiting sequence")
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, seq_id: Hashable) -> Sequence | None:
        """Finish a waiting or running sequence with reason "abort"; returns it (None if unknown)."""
        for seq in list(self.running) + list(self.waiting):
            if seq.seq_id == seq_id:
                self.finish(seq, "abort")
                return seq
        return None

    def finish(self, seq: Sequence, reason: str) -> None:
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status == SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.pool.free(seq.seq_id)
        self._block_hashes.pop(seq.seq_id, None)
        del seq.output_token_ids[seq.num_settled_outputs:]  # tokens still pending are never settled
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    # --------------------------------------------------------------- schedule
    def schedule(self) -> ScheduledBatch:
        budget = self.max_num_batched_tokens
        entries: list[ScheduledSeq] = []
        preempted: list[Sequence] = []
        blocked = False  # a running sequence could not grow: admit nobody this step
        awaiting = False  # a running sequence waits for its last (pending) token to settle
        running, try_allocate = self.running, self.pool.try_allocate
        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            if seq.awaits_last_token:
                awaiting = True
                i += 1
                continue
            start, total = seq.num_computed_tokens, seq.num_tokens
            n = min(total - start, budget)
            want = start + n
            fits = try_allocate(seq.seq_id, want)
            while not fits and running[-1] is not seq:
                preempted.append(self._preempt(running[-1]))
                fits = try_allocate(seq.seq_id, want)
            if not fits:
                if entries:  # older sequences run this step; give way to them
                    preempted.append(self._preempt(seq))
                blocked = True  # alone and still too big: a stall (handled below)
                break
            decode = n == 1 and total - start == 1 and bool(seq.output_token_ids)
            entries.append(ScheduledSeq(seq, n, start, want == total, decode))
            budget -= n
            i += 1
        if not preempted and not blocked:
            while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
                seq = self.waiting[0]
                prefix = self._cached_prefix(seq)
                start = self.pool.prefix_tokens(prefix)
                n = min(seq.num_tokens - start, budget)
                if not self.pool.can_allocate(seq.seq_id, start + n, prefix):
                    break
                self.waiting.popleft()
                self.pool.allocate(seq.seq_id, start + n, prefix)
                seq.num_computed_tokens = start
                self.num_cached_tokens += start
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)
                entries.append(ScheduledSeq(seq, n, start, start + n == seq.num_tokens))
                budget -= n
        aborted: list[Sequence] = []
        stalled = not entries and self.has_unfinished() and not awaiting
        self._stalls = self._stalls + 1 if stalled else 0
        if stalled and self._stalls > self.stall_limit:
            blocker = self.running[0] if self.running else self.waiting[0]
            self.finish(blocker, "kv_capacity")
            aborted.append(blocker)
            self._stalls = 0
        self.num_steps += 1
        return ScheduledBatch(self.num_steps - 1, tuple(entries), tuple(preempted), tuple(aborted), stalled,
                              len(self.running), len(self.waiting))

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """The cached blocks a waiting sequence can share: full blocks of its known tokens, all but its last token."""
        if not self.pool.prefix_caching or seq.prompt_token_ids is None or not seq.share_cached_prefix:
            return []
        known = seq.token_ids(0, min(seq.num_tokens - 1, seq.num_known_tokens))
        return self.pool.match_prefix(known, self._block_hashes.setdefault(seq.seq_id, []))

    def _preempt(self, seq: Sequence) -> Sequence:
        self.running.remove(seq)
        self.pool.free(seq.seq_id)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        return seq

    # ------------------------------------------------------------ postprocess
    def postprocess(self, batch: ScheduledBatch, sampled: Seq[int] | None = None,
                    stop: Callable[[Sequence], str | None] | None = None) -> list[Sequence]:
        """Advance the batch's sequences; `sampled` has one token per entry with `sample` (in order).

        Returns the sequences finished by this call (their blocks are freed). `advance` then `settle`.
        """
        self.advance(batch)
        return self.settle(batch, sampled, stop)

    def advance(self, batch: ScheduledBatch) -> None:
        """The first half of `postprocess`, once the batch runs: each entry's computed tokens (and, with prefix
        caching, its newly full blocks of known tokens), and a `PENDING_TOKEN` for each token it samples."""
        caching = self.pool.prefix_caching
        for e in batch.entries:
            seq = e.seq
            if seq.status != SequenceStatus.RUNNING:
                raise ValueError(f"sequence {seq.seq_id!r} is no longer running; postprocess each batch once")
            seq.num_computed_tokens = e.start + e.num_new_tokens
            if caching and seq.prompt_token_ids is not None:
                self._register(e)
            if e.sample:
                seq.output_token_ids.append(PENDING_TOKEN)

    def settle(self, batch: ScheduledBatch, sampled: Seq[int] | None = None,
               stop: Callable[[Sequence], str | None] | None = None) -> list[Sequence]:
        """The second half of `postprocess` (after `advance`, possibly after the next `schedule()`): the sampled
        tokens replace the pending ones and the stops apply; returns the sequences finished by this call. An entry
        of a sequence that finished since (aborted, or stopped by the token settled before) is skipped."""
        n_sample = batch.num_sampled
        if sampled is not None and len(sampled) != n_sample:
            raise ValueError(f"expected {n_sample} sampled tokens, got {len(sampled)}")
        tokens: Iterable[int] = iter(sampled) if sampled is not None else iter([UNKNOWN_TOKEN] * n_sample)
        finished: list[Sequence] = []
        for e in batch.entries:
            if not e.sample:
                continue
            token, seq = int(next(tokens)), e.seq
            if seq.is_finished:
                continue
            at = e.start + e.num_new_tokens - seq.prompt_len  # the output this entry sampled
            if seq.output_token_ids[at] != PENDING_TOKEN:
                raise ValueError(f"sequence {seq.seq_id!r} has no pending token at output {at}; settle each batch "
                                 "once, after advancing it")
            seq.output_token_ids[at] = token
            reason = seq.builtin_stop(token, at + 1)
            if reason is None and stop is not None:
                reason = stop(seq)
            if reason is not None:
                self.finish(seq, reason)
                finished.append(seq)
        return finished

    def _register(self, e: ScheduledSeq) -> None:
        """Register the entry's blocks that this step filled, those inside the known tokens (the ids are read only
        then)."""
        size, end = self.pool.block_size, e.start + e.num_new_tokens
        if end // size > e.start // size:
            known = min(end, e.seq.num_known_tokens) // size * size
            if known:
                self.pool.register(e.seq.seq_id, e.seq.token_ids(0, known), known,
                                   self._block_hashes.get(e.seq.seq_id, ()))

    # ------------------------------------------------------------------ views
    def pending_blocks(self) -> int:
        """Blocks the next step would newly need (its token budget applied): the running sequences'
        growth plus the first chunk of the next waiting sequence it could admit. Waiting demand is
        KV pressure too (without it a planner sees free blocks while requests queue), counted one
        request at a time so that a burst of arrivals does not strip every expert at once."""
        budget, need, seats = self.max_num_batched_tokens, 0, self.max_num_seqs - len(self.running)
        blocks_needed = self.pool.blocks_needed
        for seq in self.running:
            if budget <= 0:
                break
            if seq.awaits_last_token:  # not scheduled
                continue
            start = seq.num_computed_tokens
            n = min(seq.num_tokens - start, budget)
            need += blocks_needed(seq.seq_id, start + n)
            budget -= n
        if self.waiting and budget > 0 and seats > 0:  # the next request to admit (one at a time)
            seq = self.waiting[0]
            n = min(seq.num_uncomputed_tokens, budget)
            need += blocks_needed(seq.seq_id, seq.num_computed_tokens + n)
        return need

    def block_usage(self) -> dict[Hashable, int]:
        """KV blocks held by each running sequence (the weights of the prompt-feature merge)."""
        num_blocks_of = self.pool.num_blocks_of
        return {s.seq_id: num_blocks_of(s.seq_id) for s in self.running}
