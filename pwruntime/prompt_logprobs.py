"""Prompt log-probabilities: the rows of a step's batch that a request's prompt log-probabilities need, their records
computed on the device while the step's hidden states exist, and read back when the step settles.

A request whose SamplingParams ask `prompt_logprobs` = N gets, for every prompt token after the first, the
log-probability the model gives it after the tokens before it, and the N most likely tokens there (of the raw
logits, as `logprobs`: pwruntime.sampling.token_logprobs). The logits of prompt position j predict token j + 1, so
positions 0 .. len - 2 are needed, each once: the engine keeps, per asking request, how many positions it has asked
for already (its cursor), so a chunked prompt asks chunk by chunk and a preempted request's recompute asks nothing
twice. Cached tokens are never computed, so the engine keeps an asking request off the prefix cache until its
cursor reaches the prompt's end (`Sequence.share_cached_prefix`). The logits are made `SLICE_ROWS` rows at a time,
so a long prompt never holds [tokens, vocab] of them at once.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

import torch

from policies.scheduler import ScheduledBatch
from pwruntime.host_copy import to_device
from pwruntime.sampling import TokenLogprob, token_logprobs

SLICE_ROWS = 256


@dataclass(frozen=True)
class PromptRows:
    """What one step computes: the batch's flat rows, the prompt token each predicts, and whose they are."""
    rows: list[int]
    targets: list[int]
    owners: list[tuple[int, int, int, int]]  # (request id, first position, positions, top tokens asked), row order

    def cursors(self) -> dict[int, int]:
        """Each owner's cursor once this step has asked: the position after its last row."""
        return {rid: first + count for rid, first, count, _ in self.owners}


def needed_rows(batch: ScheduledBatch, cursors: Mapping[int, int]) -> PromptRows | None:
    """The rows of `batch` (flattened in entry order, each entry's new tokens in turn) whose logits the asking
    requests still need; `cursors`: request id -> positions asked for so far, for the requests that ask. None when
    no row is needed."""
    rows: list[int] = []
    targets: list[int] = []
    owners: list[tuple[int, int, int, int]] = []
    flat = 0
    for e in batch.entries:
        rid = e.seq.seq_id
        if rid in cursors:
            prompt = e.seq.prompt_token_ids
            first, end = max(e.start, cursors[rid]), min(e.start + e.num_new_tokens, len(prompt) - 1)
            if first < end:
                rows += range(flat + first - e.start, flat + end - e.start)
                targets += prompt[first + 1:end + 1]
                owners.append((rid, first, end - first, e.seq.params.prompt_logprobs))
        flat += e.num_new_tokens
    return PromptRows(rows, targets, owners) if rows else None


@dataclass(frozen=True)
class PendingPromptLogprobs:
    """One step's prompt records on the device; `records()` reads them back (waiting for them)."""
    needed: PromptRows
    chosen: torch.Tensor  # [rows] float32
    top_ids: torch.Tensor  # [rows, k] int64, most likely first
    top_logprobs: torch.Tensor
    ranks: torch.Tensor  # [rows] int64: 1 + the tokens with larger logits

    def records(self) -> list[tuple[int, list[TokenLogprob]]]:
        """(request id, its records in position order) per owner."""
        chosen, ids, lps = self.chosen.tolist(), self.top_ids.tolist(), self.top_logprobs.tolist()
        ranks, out, at = self.ranks.tolist(), [], 0
        for rid, _, count, k in self.needed.owners:
            recs = [TokenLogprob(self.needed.targets[j], chosen[j], tuple(zip(ids[j][:k], lps[j][:k])), ranks[j])
                    for j in range(at, at + count)]
            out.append((rid, recs))
            at += count
        return out


def on_device(logits_of: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
              needed: PromptRows) -> PendingPromptLogprobs:
    """The records of `needed`'s rows from their final hidden states `hidden` [rows, H] (`logits_of`: the model's
    head, hidden -> fp32 logits), queued on the device a slice of rows at a time."""
    targets = to_device(torch.tensor(needed.targets, dtype=torch.long), hidden.device)
    k = max(owner[3] for owner in needed.owners)
    parts = []
    for a in range(0, hidden.shape[0], SLICE_ROWS):
        logits, wanted = logits_of(hidden[a:a + SLICE_ROWS]), targets[a:a + SLICE_ROWS]
        rank = (logits > logits.gather(1, wanted[:, None])).sum(dim=1) + 1
        parts.append((*token_logprobs(logits, wanted, k), rank))
    return PendingPromptLogprobs(needed, *(torch.cat(p) for p in zip(*parts)))
