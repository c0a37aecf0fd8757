"""One request's serving state: its tokens (or just their count), status and progress.

Pure python, shared by pwsim and pwruntime. A simulator that has no token ids creates sequences
from a prompt *length* (`prompt_token_ids=None`) and appends `UNKNOWN_TOKEN` for each generated
token; only counts matter to the scheduler and the block pool. The runtime passes real ids.

`num_tokens = prompt_len + len(output_token_ids)`; `num_computed_tokens` of them have K/V in the
cache. A sequence samples its next token in a step that brings `num_computed_tokens` up to
`num_tokens`. Preemption by recompute sets `num_computed_tokens` back to 0 and keeps the
generated tokens, so the next prefill recomputes prompt and outputs together.

`num_known_tokens` counts the leading tokens whose ids are known: none without prompt ids, the
prompt when the outputs are `UNKNOWN_TOKEN` (a simulator that has prompt ids), every token in the
runtime but those still `PENDING_TOKEN`. Prefix caching hashes and matches only known tokens (policies.scheduler).

With asynchronous scheduling (policies.scheduler: `advance` now, `settle` a step later) an output the device is
still sampling is held by a `PENDING_TOKEN`; pending tokens only ever trail the outputs, and `num_settled_outputs`
counts the outputs before them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, Hashable, Sequence as Seq

UNKNOWN_TOKEN = -1  # a generated token whose id a simulator does not know
PENDING_TOKEN = -2  # a token being sampled on the device, not yet on the host (asynchronous scheduling)


class SequenceStatus(IntEnum):
    WAITING = 0
    RUNNING = 1
    FINISHED = 2


@dataclass(eq=False)
class Sequence:
    """A request as the scheduler sees it. Identity (not value) equality."""

    seq_id: Hashable
    prompt_token_ids: list[int] | None = None  # None: only `prompt_len` is known (simulator)
    prompt_len: int = -1  # derived from prompt_token_ids when given
    max_tokens: int = 16  # most tokens to generate (stop at this count)
    eos_token_id: int | None = None  # None or ignore_eos: never stop on EOS
    stop_token_ids: tuple[int, ...] = ()
    params: Any = None  # the engine's sampling parameters (opaque here)
    arrival_time: float = 0.0  # given by the engine (simulated or wall time); unused by the scheduler
    first_scheduled_time: float | None = None  # when a batch first held it (`ScheduledBatch.mark_scheduled`)
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    num_preemptions: int = 0
    finish_reason: str | None = None  # "stop" (EOS / stop token / stop string), "length", "kv_capacity", "abort"
    share_cached_prefix: bool = True  # False: admitted without cached blocks (its engine needs every prompt position
    # computed, e.g. for prompt log-probabilities); it still leaves its own blocks cached

    def __post_init__(self) -> None:
        if self.prompt_token_ids is not None:
            self.prompt_token_ids = list(self.prompt_token_ids)
            if self.prompt_len not in (-1, len(self.prompt_token_ids)):
                raise ValueError(f"prompt_len {self.prompt_len} != {len(self.prompt_token_ids)} prompt ids")
            self.prompt_len = len(self.prompt_token_ids)
        if self.prompt_len < 1:
            raise ValueError(f"sequence {self.seq_id!r} needs a prompt of at least one token")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return self.prompt_len + len(self.output_token_ids)

    @property
    def num_known_tokens(self) -> int:
        """Leading tokens with known ids: 0 without prompt ids, else the prompt and the outputs before the first
        `UNKNOWN_TOKEN` (a simulator's outputs are all unknown, the runtime's all known)."""
        if self.prompt_token_ids is None:
            return 0
        out = self.output_token_ids
        known = len(out)
        for marker in (UNKNOWN_TOKEN, PENDING_TOKEN):
            if marker in out:
                known = min(known, out.index(marker))
        return self.prompt_len + known

    @property
    def num_settled_outputs(self) -> int:
        """Output tokens before the trailing `PENDING_TOKEN`s (all of them without asynchronous scheduling)."""
        out, n = self.output_token_ids, len(self.output_token_ids)
        while n and out[n - 1] == PENDING_TOKEN:
            n -= 1
        return n

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.prompt_len + len(self.output_token_ids) - self.num_computed_tokens  # num_tokens, inlined (hot)

    @property
    def awaits_last_token(self) -> bool:
        """Its outputs reached `max_tokens` with the last one still pending (asynchronous scheduling): nothing is left
        to schedule for it (a running sequence is otherwise finished as soon as its last token settles)."""
        return len(self.output_token_ids) >= self.max_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def token_ids(self, start: int, end: int) -> list[int]:
        """Token ids at positions [start, end) (prompt then outputs); needs real prompt ids."""
        if self.prompt_token_ids is None:
            raise ValueError(f"sequence {self.seq_id!r} has no token ids (length-only)")
        p = self.prompt_len
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p:end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - p]

    def builtin_stop(self, token: int, num_outputs: int | None = None) -> str | None:
        """The finish reason the token triggers by itself (EOS, stop token, max tokens), or None; `num_outputs`:
        the outputs up to and including it (default all, which differs only while later ones are pending)."""
        if self.eos_token_id is not None and token == self.eos_token_id:
            return "stop"
        if token in self.stop_token_ids:
            return "stop"
        if (len(self.output_token_ids) if num_outputs is None else num_outputs) >= self.max_tokens:
            return "length"
        return None


def make_sequences(prompt_lens: Seq[int], max_tokens: Seq[int], start_id: int = 0) -> list[Sequence]:
    """Length-only sequences for a simulator: ids start_id, start_id+1, ..."""
    return [Sequence(start_id + i, prompt_len=int(p), max_tokens=int(m))
            for i, (p, m) in enumerate(zip(prompt_lens, max_tokens, strict=True))]
