"""ModelRunner: turns a ScheduledBatch into input ids, positions and AttentionMetadata, runs the model.

The scheduler's pool already reserved every slot; the runner only reads block tables. It returns the
logits of the rows that sample (each sampling sequence's last new token) and, when asked, the batch's
routing as numpy arrays for the shared observation code (policies.observe).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from policies.kv_blocks import BlockPool
from policies.scheduler import ScheduledBatch
from pwruntime.kv_cache import KVCache
from pwruntime.model.attention import AttentionMetadata, batch_metadata


@dataclass(frozen=True)
class RoutingArrays:
    """One forward's routing, stacked over MoE layers (numpy, on the host)."""

    topk_ids: np.ndarray  # [L, T, k] int64
    topk_weights: np.ndarray  # [L, T, k] float32
    gate_up_in_norm: np.ndarray  # [L, T] float32
    down_in_norm: np.ndarray  # [L, T, k] float32
    query_lens: tuple[int, ...]  # tokens per batch entry (the flattening order)


@dataclass(frozen=True)
class StepOutput:
    logits: torch.Tensor  # [num_sampled, vocab] float32, in batch-entry order
    routing: RoutingArrays | None


class ModelRunner:
    """Runs one model over one paged KV cache."""

    def __init__(self, model, kv: KVCache) -> None:
        self.model, self.kv = model, kv

    def prepare(self, batch: ScheduledBatch, pool: BlockPool) -> tuple[torch.Tensor, torch.Tensor,
                                                                        AttentionMetadata, list[int]]:
        """input_ids [T], positions [T], metadata, and the flat row of each sampling entry."""
        ids: list[int] = []
        positions: list[int] = []
        seqs: list[tuple[int, int, list[int]]] = []
        sample_rows: list[int] = []
        for e in batch.entries:
            end = e.start + e.num_new_tokens
            ids += e.seq.token_ids(e.start, end)
            positions += range(e.start, end)
            seqs.append((e.start, e.num_new_tokens, pool.block_table(e.seq.seq_id)))
            if e.sample:
                sample_rows.append(len(ids) - 1)
        dev = self.model.device
        meta = batch_metadata(seqs, pool.block_size, dev)
        return (torch.tensor(ids, dtype=torch.long, device=dev), torch.tensor(positions, dtype=torch.long, device=dev),
                meta, sample_rows)

    def run(self, batch: ScheduledBatch, pool: BlockPool, record: bool = False) -> StepOutput:
        if pool.id_limit > self.kv.num_blocks:
            raise RuntimeError(f"KV cache backs {self.kv.num_blocks} blocks but the pool uses ids up to "
                               f"{pool.id_limit}; resize the cache after changing the pool")
        input_ids, positions, meta, rows = self.prepare(batch, pool)
        out = self.model.forward(input_ids, positions, self.kv, meta, record=record)
        logits = self.model.logits(out.hidden[torch.tensor(rows, dtype=torch.long, device=out.hidden.device)])
        routing = None
        if record and out.routing:
            r = out.routing
            routing = RoutingArrays(
                torch.stack([x.topk_ids for x in r]).cpu().numpy(),
                torch.stack([x.topk_weights for x in r]).float().cpu().numpy(),
                torch.stack([x.gate_up_in_norm for x in r]).float().cpu().numpy(),
                torch.stack([x.down_in_norm for x in r]).float().cpu().numpy(),
                tuple(meta.query_lens))
        return StepOutput(logits, routing)

    def copy_blocks(self, moves: list[tuple[int, int]]) -> None:
        """Copy K/V of block src into dst for every (src, dst) (after BlockPool.compact)."""
        if not moves:
            return
        dev = self.kv.k[0].device if self.kv.k else "cpu"
        src = torch.tensor([m[0] for m in moves], dtype=torch.long, device=dev)
        dst = torch.tensor([m[1] for m in moves], dtype=torch.long, device=dev)
        for tensors in (self.kv.k, self.kv.v):
            for t in tensors:
                t[dst] = t[src]
