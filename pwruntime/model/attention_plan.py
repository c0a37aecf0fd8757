"""What a forward derives from its batch once for every layer: the batch metadata (each KV group's block tables and
each new token's slot) and the attention plans built from it (pwruntime.model.attention computes with them).

Tokens of a batch are flattened (sequence 0's new tokens, then sequence 1's, ...). Each new token's K/V is written to
its slot (block_id * block_size + offset) first; then a token attends to its sequence's cached tokens plus the new
tokens up to itself (causal, optionally within a sliding window).

A plan holds what each path of `paged_attention` reads. The reference's groups: all decode tokens of the batch (query
length 1) form one group; each multi-token chunk is its own (`PrefillGroup` without cached context, else a
`GatherGroup` of cache blocks and masks). On CUDA in fp16/bf16 the decode sequences instead run the paged-attention
decode kernel over a `DecodeBatch` (block tables and sequence lengths as device tensors, nothing read back to the
host), and every multi-token chunk of a batch runs in one variable-length flash-attention call per layer
(`VarlenChunks`: the chunks' query rows, each one's keys gathered from the cache as slots, their cumulative lengths).
The decode gather group is then built only if a layer's heads have no kernel build, and the chunk groups only for
heads flash attention does not take (Gemma 4's 512-wide global heads). Everything is built on the host and copied to
the device (no read-back); hybrid KV groups of one block size and window build their plans together, each kind of
input in one copy (`AttentionPlan.build_all`, `layer_plans`).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import torch

from policies.kv_blocks import NULL_BLOCK
from policies.kv_groups import KVLayout
from pwruntime.block_tables import TableRows
from pwruntime.host_copy import to_device


@dataclass
class AttentionMetadata:
    query_lens: list[int]        # new tokens per sequence in this forward (sum == T)
    context_lens: list[int]      # tokens already in the cache per sequence before this forward
    block_tables: torch.Tensor   # [num_seqs, max_blocks] int32, padded with -1
    slot_mapping: torch.Tensor   # [T] int64: block_id * block_size + offset of each new token's K/V
    seq_lens: torch.Tensor | None = None   # pure decode only: [S] int32 device context_len + 1 (static graph input)
    host_tables: torch.Tensor | None = None  # block_tables on the host (batch_metadata keeps it: no read-back)

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)


def batch_metadata(seqs: list[tuple[int, int, Sequence[int]]], block_size: int,
                   device: str | torch.device = "cpu", window: int | None = None) -> AttentionMetadata:
    """Metadata for sequences given as (context_len, query_len, block ids): `table_metadata` of their tables."""
    return table_metadata([c for c, _, _ in seqs], [q for _, q, _ in seqs], TableRows.of([b for _, _, b in seqs]),
                          block_size, device, window)


def table_metadata(context_lens: Sequence[int], query_lens: Sequence[int], tables: TableRows, block_size: int,
                   device: str | torch.device = "cpu", window: int | None = None) -> AttentionMetadata:
    """Metadata for sequences of `context_lens` cached and `query_lens` new tokens over `tables` (a runner's
    BlockTables rows), which must cover every sequence's tokens. Built with a handful of numpy calls over all
    sequences (the tables gathered, each new token's slot looked up in them), not a loop over sequences and tokens.
    With the tables' sliding `window` (a hybrid KV group's) a sequence's entries before the block of its first query's
    earliest key are NULL (-1), as released ones are: nothing reads them, and a long context's table is not read
    whole."""
    n = len(tables)
    ctx = np.asarray(context_lens, np.int64)
    qlen = np.asarray(query_lens, np.int64)
    short = np.flatnonzero(tables.lengths * block_size < ctx + qlen)
    if short.size:
        s = int(short[0])
        raise ValueError(f"sequence {s}: {tables.lengths[s]} blocks of {block_size} cannot hold {ctx[s] + qlen[s]} "
                         "tokens")
    table = np.full((n, max(1, tables.max_blocks)), NULL_BLOCK, dtype=np.int32)
    place_block_tables(tables, table, block_size, window, ctx)
    seq_of = np.repeat(np.arange(n), qlen)                                   # each new token's sequence
    pos = np.arange(int(qlen.sum())) - np.repeat(np.cumsum(qlen) - qlen - ctx, qlen)   # and its position
    slots = table[seq_of, pos // block_size].astype(np.int64) * block_size + pos % block_size
    host = torch.from_numpy(table)
    return AttentionMetadata(qlen.tolist(), ctx.tolist(), to_device(host, device),
                             to_device(torch.from_numpy(slots), device), host_tables=host)


def place_block_tables(tables: TableRows, out: np.ndarray, block_size: int, window: int | None,
                       query_starts: np.ndarray) -> None:
    """Write batch row i's block ids into out[i], a gather of the tables' rows; with the tables' sliding `window`,
    only those from first[i] on, the block of the earliest key row i's first query (at position query_starts[i])
    reads (a window's released entries, which a BlockTables row keeps as they were, are before it). Every other entry
    of `out` is left as it is (the callers fill it first)."""
    n = len(tables)
    if not n:
        return
    if window:   # a window's few blocks a row, by flat index: not the whole table
        first = np.maximum(query_starts - window + 1, 0) // block_size
        kept = tables.lengths - first
        row = np.repeat(np.arange(n), kept)
        col = np.arange(row.size) + np.repeat(first - (np.cumsum(kept) - kept), kept)
        if not out.flags.c_contiguous:
            raise ValueError("place_block_tables writes a window's blocks into a C-contiguous array only")
        src = tables.index[row] * tables.ids.shape[1] + col
        out.reshape(-1)[row * out.shape[1] + col] = tables.ids.reshape(-1)[src]
        return
    width = max(1, tables.max_blocks)
    np.copyto(out[:n, :width], tables.ids[tables.index, :width], where=np.arange(width) < tables.lengths[:, None])


def _to_device_each(tensors: Sequence[torch.Tensor], device: torch.device,
                    dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    """Each tensor on `device` (as `dtype`): host tensors of one shape and dtype reach it in one copy."""
    on_host = all(t.device.type == "cpu" for t in tensors)
    if len(tensors) > 1 and on_host and len({(t.shape, t.dtype) for t in tensors}) == 1:
        return list(to_device(torch.stack(tensors), device, dtype).unbind(0))
    return [to_device(t, device, dtype) for t in tensors]


def prefill_metadata(num_tokens: int, block_size: int, device: str | torch.device = "cpu") -> AttentionMetadata:
    """One sequence of `num_tokens` new tokens in blocks 0, 1, 2, ... (a trivial block table)."""
    n_blocks = -(-num_tokens // block_size)
    return batch_metadata([(0, num_tokens, list(range(n_blocks)))], block_size, device)


@dataclass
class PrefillGroup:          # one sequence, no cached context: attend among its own new tokens
    start: int
    end: int


@dataclass
class GatherGroup:           # sequences whose keys are gathered from the paged cache, a block at a time
    token_idx: torch.Tensor   # [Tg] flat token positions in the batch
    dest: torch.Tensor        # [Tg] row in the padded [S*Qmax] query layout
    key_blocks: torch.Tensor  # [S, B] cache block of key positions b*block_size.. (0 past the sequence)
    key_valid: torch.Tensor   # [S, L = B*block_size] key position p is the sequence's
    q_pos: torch.Tensor       # [S, Qmax] absolute position of each padded query row
    q_valid: torch.Tensor     # [S, Qmax]
    masks: dict = field(default_factory=dict)   # window -> [S, Qmax, L] bool (built on first use)
    span: tuple[int, int, int] | None = None    # one sequence: its rows start..end of the batch, and its keys

    def mask(self, window: int | None) -> torch.Tensor:
        if window not in self.masks:
            k_pos = torch.arange(self.key_valid.shape[1], device=self.q_pos.device)
            m = (k_pos[None, None, :] <= self.q_pos[:, :, None]) & self.key_valid[:, None, :]
            if window is not None:
                m &= k_pos[None, None, :] > self.q_pos[:, :, None] - window
            m |= ~self.q_valid[:, :, None] & (k_pos == 0)[None, None, :]   # padded rows: no all-masked row
            self.masks[window] = m
        return self.masks[window]


DECODE_KERNEL_DTYPES = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class VarlenChunks:
    """A batch's multi-token chunks as one variable-length flash-attention call: their query rows, each chunk's
    keys (its cached context, then its own new tokens) as cache slots, and the cumulative lengths of both. For a
    sliding-window layer a chunk's keys start at the earliest position its first query sees."""
    rows: torch.Tensor       # [Tq] int64 flat rows of the chunks' queries, chunk after chunk
    key_slots: torch.Tensor  # [Tk] int64 cache slot of each chunk's key positions (first..context + query - 1)
    cu_q: torch.Tensor       # [G + 1] int32
    cu_k: torch.Tensor       # [G + 1] int32
    max_q: int
    max_k: int

    @staticmethod
    def applies(q: torch.Tensor) -> bool:
        """Whether these chunks run through flash attention here (else through the groups): CUDA, fp16/bf16, a
        head size flash attention takes."""
        return q.is_cuda and q.dtype in DECODE_KERNEL_DTYPES and VarlenChunks.takes(q.shape[-1])

    @staticmethod
    def takes(head_dim: int) -> bool:
        """Whether flash attention takes heads of this size (on CUDA in fp16/bf16)."""
        return head_dim % 8 == 0 and head_dim <= 256 and torch.backends.cuda.is_flash_attention_available()

    @classmethod
    def build(cls, meta: AttentionMetadata, block_size: int, device: torch.device,
              window: int | None = None) -> "VarlenChunks | None":
        """From the metadata on the host (`_key_slots`); None without chunks. Everything reaches the device in one
        copy. With a sliding `window` a chunk after a context of c tokens gathers keys from position c - window + 1
        on (bottom-right causal alignment keeps each query at its own position)."""
        return cls.build_all([meta], block_size, device, window)[0]

    @classmethod
    def build_all(cls, metas: Sequence[AttentionMetadata], block_size: int, device: torch.device,
                  window: int | None = None) -> list["VarlenChunks | None"]:
        """`build` for KV groups of one batch (metadata that differ only in block ids): the rows and lengths they
        share are made once, and every group's key slots reach the device in one copy with them."""
        meta = metas[0]
        seqs = [s for s, q in enumerate(meta.query_lens) if q > 1]
        if not seqs:
            return [None] * len(metas)
        starts = np.cumsum([0] + meta.query_lens)
        q_lens = np.array([meta.query_lens[s] for s in seqs], np.int64)
        ctx = np.array([meta.context_lens[s] for s in seqs], np.int64)
        rows = np.concatenate([np.arange(starts[s], starts[s + 1]) for s in seqs])
        first = np.maximum(ctx - window + 1, 0) if window else np.zeros_like(ctx)
        slots, in_seq = _key_slots(metas, seqs, torch.from_numpy(q_lens + ctx), block_size, torch.from_numpy(first))
        k_lens = q_lens + ctx - first
        cu = np.concatenate([[0], np.cumsum(q_lens), [0], np.cumsum(k_lens)])
        flat = to_device(torch.from_numpy(np.concatenate([rows, *(s[in_seq].numpy() for s in slots), cu])), device)
        tq, tk, g = len(rows), int(k_lens.sum()), len(seqs)
        cu_dev = flat[tq + len(metas) * tk:].to(torch.int32)
        max_q, max_k = int(q_lens.max()), int(k_lens.max())
        return [cls(flat[:tq], flat[tq + i * tk:tq + (i + 1) * tk], cu_dev[:g + 1], cu_dev[g + 1:], max_q, max_k)
                for i in range(len(metas))]

    def attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float,
                  window: int | None = None) -> torch.Tensor:
        """The chunks' rows of the attention output [Tq, heads, d] (GQA: flash attention takes fewer K/V heads). A
        sliding `window` W lets query position i see keys i - W + 1 .. i: flash attention's left window W - 1."""
        kv_heads, d = k_cache.shape[-2], k_cache.shape[-1]
        keys = k_cache.reshape(-1, kv_heads, d)[self.key_slots]
        values = v_cache.reshape(-1, kv_heads, d)[self.key_slots]
        left = {"window_size_left": window - 1, "window_size_right": 0} if window else {}
        return torch.ops.aten._flash_attention_forward(q[self.rows], keys, values, self.cu_q, self.cu_k, self.max_q,
                                                       self.max_k, 0.0, True, False, scale=scale, **left)[0]


@dataclass(frozen=True)
class DecodeBatch:
    """The batch's decode sequences (one new token each) as the paged-attention decode kernel reads them."""
    block_tables: torch.Tensor   # [S, max_blocks] int32
    seq_lens: torch.Tensor       # [S] int32: tokens each query attends to (its own K/V included)
    rows: torch.Tensor | None = None  # [S] int64 their rows of the flattened batch; None: every row is a decode row

    @staticmethod
    def kernel_applies(device_type: str, dtype: torch.dtype) -> bool:
        """Whether the kernel computes decode sequences' attention (else the gather reference does); it takes a
        sliding window too."""
        return device_type == "cuda" and dtype in DECODE_KERNEL_DTYPES


@dataclass
class AttentionPlan:
    """Everything derived from AttentionMetadata once per forward and shared by all layers.

    `decode` holds the batch's decode sequences (query length 1), if any, for the decode kernel; the other
    sequences (prefill chunks) always take the reference's groups (`chunk_groups`), and the decode sequences
    take `decode_group` where the kernel does not apply. Groups are built at `build` unless the kernel will
    serve the decode sequences, then only on first use.

    `window` is that of a hybrid KV group's tables (policies.kv_groups), every layer of which has it: their entries
    before each sequence's window may be released (NULL), and nothing reads them. None: the tables are whole.

    On CUDA in fp16/bf16 `build` makes the chunks' flash-attention inputs (`varlen`) for the windows of the layers
    that read the plan with heads flash attention takes (`reads`), and the groups where some layer's heads it does not
    take (Gemma 4's 512-wide global heads), so no step builds what none of its layers reads."""
    slot_mapping: torch.Tensor
    meta: AttentionMetadata
    block_size: int
    device: torch.device
    decode: DecodeBatch | None = None
    varlens: dict = field(default_factory=dict)   # sliding window (None: full causal) -> VarlenChunks | None
    window: int | None = None

    @classmethod
    def build(cls, meta: AttentionMetadata, block_size: int, device: torch.device,
              dtype: torch.dtype | None = None, window: int | None = None,
              reads: Sequence[tuple[int | None, int]] = ()) -> AttentionPlan:
        """`reads`: the (sliding window, head size) of each layer that reads the plan; empty: layers of the plan's
        window with heads flash attention takes."""
        return cls.build_all([meta], block_size, device, dtype, window, reads)[0]

    @classmethod
    def build_all(cls, metas: Sequence[AttentionMetadata], block_size: int, device: torch.device,
                  dtype: torch.dtype | None = None, window: int | None = None,
                  reads: Sequence[tuple[int | None, int]] = ()) -> list[AttentionPlan]:
        """`build` for KV groups of one block size and window over one batch (hybrid groups of a kind: their
        metadata differ only in block ids): what does not depend on the ids is made once, and each kind of input
        reaches the device in one copy for all of them. `reads`: those of every layer of these groups."""
        first = metas[0]
        if any(m.query_lens != first.query_lens or m.context_lens != first.context_lens for m in metas[1:]):
            raise ValueError("plans built together need one batch: the same query and context lengths")
        plans = [cls(slots, meta, block_size, device, decode, window=window) for slots, meta, decode in zip(
            _to_device_each([m.slot_mapping for m in metas], device, torch.int64), metas,
            cls._decode_batches(metas, device))]
        if device.type == "cuda" and dtype in DECODE_KERNEL_DTYPES:  # build (and validate the block tables) now
            flash = [w for w, d in reads if VarlenChunks.takes(d)] if reads else [window]
            for w in dict.fromkeys(flash):
                for plan, chunks in zip(plans, VarlenChunks.build_all(metas, block_size, device, w)):
                    plan.varlens[w] = chunks
            if len(flash) < len(reads):  # some layer's heads flash attention does not take
                for plan in plans:
                    plan.chunk_groups
        else:
            for plan in plans:
                plan.chunk_groups
        if plans[0].decode is None or not DecodeBatch.kernel_applies(device.type, dtype):
            for plan in plans:
                plan.decode_group
        return plans

    @staticmethod
    def _decode_batches(metas: Sequence[AttentionMetadata], device: torch.device) -> list[DecodeBatch | None]:
        """The decode sequences of one batch in each group's tables: their rows and lengths shared."""
        meta = metas[0]
        seqs = [s for s, q in enumerate(meta.query_lens) if q == 1]
        if not seqs:
            return [None] * len(metas)
        tables = _to_device_each([m.block_tables for m in metas], device, torch.int32)
        if len(seqs) == len(meta.query_lens):  # pure decode: every row, the tables as they are
            lens = None
            if any(m.seq_lens is None for m in metas):
                lens = to_device(torch.tensor([c + 1 for c in meta.context_lens], dtype=torch.int32), device)
            return [DecodeBatch(t, to_device(lens if m.seq_lens is None else m.seq_lens, device, torch.int32))
                    for t, m in zip(tables, metas)]
        starts = np.cumsum([0] + meta.query_lens)
        host = torch.from_numpy(np.array([seqs, [meta.context_lens[s] + 1 for s in seqs], starts[seqs]], np.int64))
        index, lens, rows = to_device(host, device).unbind(0)  # one copy to the device
        lens = lens.to(torch.int32)
        return [DecodeBatch(t[index], lens, rows) for t in tables]

    @cached_property
    def chunk_groups(self) -> list:
        """One group per sequence with more than one new token: plain prefill or gathered from the cache."""
        meta = self.meta
        starts = np.cumsum([0] + meta.query_lens).tolist()
        return [PrefillGroup(starts[s], starts[s + 1]) if meta.context_lens[s] == 0
                else self._gather(meta, [s], starts, self.block_size, self.device, self.window)
                for s, q in enumerate(meta.query_lens) if q > 1]

    def varlen(self, window: int | None) -> VarlenChunks | None:
        """The chunks as one flash-attention call (VarlenChunks) for layers of this sliding window, None when the batch
        has none; built on first use, once a window."""
        if window not in self.varlens:
            self.varlens[window] = VarlenChunks.build(self.meta, self.block_size, self.device, window)
        return self.varlens[window]

    @cached_property
    def decode_group(self) -> GatherGroup | None:
        meta = self.meta
        decode = [s for s, q in enumerate(meta.query_lens) if q == 1]
        starts = np.cumsum([0] + meta.query_lens).tolist()
        return self._gather(meta, decode, starts, self.block_size, self.device, self.window) if decode else None

    @property
    def groups(self) -> list:
        """Every sequence in the reference's groups."""
        return self.chunk_groups + ([self.decode_group] if self.decode_group is not None else [])

    @staticmethod
    def _gather(meta: AttentionMetadata, seqs: list[int], starts: list[int], block_size: int,
                device: torch.device, window: int | None = None) -> GatherGroup:
        """Built on the host (from meta.host_tables when present) and moved to the device: no read-back. With the
        tables' `window`, keys before a sequence's first query's window are not gathered (their blocks may be gone)."""
        q_lens = torch.tensor([meta.query_lens[s] for s in seqs])
        ctx = torch.tensor([meta.context_lens[s] for s in seqs])
        q_max = int(q_lens.max())
        first = (ctx - window + 1).clamp(min=0) if window else None
        (key_blocks,), in_seq = _key_blocks([meta], seqs, ctx + q_lens, block_size, first)
        qi = torch.arange(q_max)
        token_idx = torch.cat([torch.arange(starts[s], starts[s + 1]) for s in seqs])
        dest = torch.cat([g * q_max + torch.arange(meta.query_lens[s]) for g, s in enumerate(seqs)])
        to = lambda t: to_device(t, device)  # noqa: E731
        span = (starts[seqs[0]], starts[seqs[0] + 1], int(ctx[0] + q_lens[0])) if len(seqs) == 1 else None
        return GatherGroup(to(token_idx), to(dest), to(key_blocks), to(in_seq), to(ctx[:, None] + qi[None, :]),
                            to(qi[None, :] < q_lens[:, None]), span=span)


def group_metadata(meta: AttentionMetadata | Sequence[AttentionMetadata]) -> tuple[AttentionMetadata, ...]:
    """A batch's metadata for each KV group: `meta` itself when it is one (a cache of one group), else as given."""
    return (meta,) if isinstance(meta, AttentionMetadata) else tuple(meta)


def layer_plans(meta: AttentionMetadata | Sequence[AttentionMetadata], layout: KVLayout, device: torch.device,
                dtype: torch.dtype | None = None,
                reads: Sequence[tuple[int | None, int]] | None = None) -> list[AttentionPlan]:
    """Each decoder layer's AttentionPlan: a plan for each KV group of `layout` (a KV cache's: one group shares one
    plan by every layer; a hybrid layout's groups have their own tables and block sizes), from that group's metadata
    (`meta`: one for each group in the layout's order, or one AttentionMetadata for a single group). `reads`: each
    layer's (sliding window, head size), so each plan builds what its layers read (AttentionPlan.build)."""
    metas = group_metadata(meta)
    if len(metas) != len(layout.groups):
        raise ValueError(f"a cache of {len(layout.groups)} KV groups needs an AttentionMetadata for each, "
                         f"got {len(metas)}")
    kinds: dict[tuple[int, int | None], list[int]] = {}   # groups of one block size and window build together
    for g, group in enumerate(layout.groups):
        kinds.setdefault((group.block_size, group.window), []).append(g)
    plans: list[AttentionPlan | None] = [None] * len(metas)
    for (block_size, window), gs in kinds.items():
        kind_reads = [reads[i] for g in gs for i in layout.groups[g].layers] if reads is not None else ()
        for g, plan in zip(gs, AttentionPlan.build_all([metas[g] for g in gs], block_size, device, dtype, window,
                                                       kind_reads)):
            plans[g] = plan
    return [plans[g] for g in layout.group_of]


def _key_blocks(metas: Sequence[AttentionMetadata], seqs: list[int], lengths: torch.Tensor, block_size: int,
                first: torch.Tensor | None = None) -> tuple[list[torch.Tensor], torch.Tensor]:
    """On the host (meta.host_tables when present, else the tables read back), in each group's tables (`metas`, of
    one batch): the cache blocks holding key positions first[i]..lengths[i] - 1 of each sequence in `seqs` (`first`
    None: from 0), [S, B] int64 (B the longest one's blocks) with 0 for a block outside them; and which positions
    are keys, [S, B * block_size]. Raises when a block table does not cover those positions (a released block,
    NULL_BLOCK, may only lie before `first`)."""
    n_blocks = -(-int(lengths.max()) // block_size)
    block_start, pos = torch.arange(n_blocks)[None, :] * block_size, torch.arange(n_blocks * block_size)[None, :]
    needed = block_start < lengths[:, None]    # blocks holding some key position
    is_key = pos < lengths[:, None]
    if first is not None:
        needed &= block_start + block_size > first[:, None]
        is_key &= pos >= first[:, None]
    out = []
    for meta in metas:
        tables = meta.host_tables if meta.host_tables is not None else meta.block_tables.cpu()
        blocks = tables[seqs, :n_blocks].to(torch.int64)
        if blocks.shape[1] < n_blocks or bool((needed & (blocks < 0)).any()):
            raise ValueError("block table does not cover context_len + query_len tokens of every sequence")
        out.append(torch.where(needed, blocks, 0))
    return out, is_key


def _key_slots(metas: Sequence[AttentionMetadata], seqs: list[int], lengths: torch.Tensor, block_size: int,
               first: torch.Tensor | None = None) -> tuple[list[torch.Tensor], torch.Tensor]:
    """In each group's tables (`metas`, of one batch): the cache slot of key positions 0..lengths[i] - 1 of each
    sequence in `seqs`, [S, max length] int64 with 0 before first[i] and past a sequence's length; and which
    positions are keys (from `_key_blocks`)."""
    blocks, in_seq = _key_blocks(metas, seqs, lengths, block_size, first)
    length = int(lengths.max())
    in_seq = in_seq[:, :length]
    offsets = torch.arange(block_size)
    return [torch.where(in_seq, (b[:, :, None] * block_size + offsets).reshape(len(seqs), -1)[:, :length], 0)
            for b in blocks], in_seq
