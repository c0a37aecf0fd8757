"""Paged attention: batch metadata, the per-forward attention plan, the pure-torch reference, the attention module.

Tokens of a batch are flattened (sequence 0's new tokens, then sequence 1's, ...). Each new token's K/V
is written to its slot (block_id * block_size + offset) first; then a token attends to its sequence's
cached tokens plus the new tokens up to itself (causal, optionally within a sliding window).

The reference gathers K/V through the block tables, a cache block at a time and vectorised over sequences, and
runs scaled_dot_product_attention over them in fp32 with the group's mask: all decode tokens of the batch (query
length 1) form one group; each multi-token chunk is its own group. A chunk with no cached
context (plain prefill) uses torch's scaled_dot_product_attention on its own K/V, which is the same
math, and so does a chunk after its cached context (no sliding window): its keys gathered from the cache in
one index each, the causal mask aligned to the bottom right. The group reference is the CPU path of the
decode rows and the reference a CUDA paged-attention kernel must match.

On CUDA in fp16/bf16 the decode sequences instead run `kernels.attention.paged_attention_decode` over a
`DecodeBatch` (block tables and sequence lengths as device tensors, nothing read back to the host): a
pure-decode batch entirely, so the forward can be captured in a CUDA graph, and the decode rows of a
mixed batch beside the chunks' groups; the kernel keeps a sliding-window layer's last `window` tokens itself. The
decode gather group is then built only if a layer's heads have no kernel build (`decode_variant`), which cannot
happen inside a graph (`MoEModel.graph_attention` gates the graphs). Groups are built on the host and copied to the
device (no read-back).

There, too, every multi-token chunk of a batch (plain prefill or after its cached context) runs in one
variable-length flash-attention call per layer (`VarlenChunks`: the chunks' query rows, each one's keys gathered from
the cache, causal aligned to the bottom right, a sliding window as flash attention's left window) instead of one
SDPA call and its reshapes per chunk: a mixed step's attention is eager host work between its piecewise graphs, and
this is most of it. The chunk groups are then built only for heads flash attention does not take (Gemma 4's
512-wide global heads).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from itertools import chain

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from policies.kv_groups import KVLayout
from pwruntime.host_copy import to_device
from pwruntime.kernels.attention import decode_variant, paged_attention_decode
from pwruntime.kernels.layer_ops import rotary_kv
from pwruntime.model.config import ModelConfig
from pwruntime.model.layers import FloatRMSNorm, Linear, RMSNorm


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


def batch_metadata(seqs: list[tuple[int, int, list[int]]], block_size: int,
                   device: str | torch.device = "cpu", window: int | None = None) -> AttentionMetadata:
    """Metadata for sequences given as (context_len, query_len, block ids); the blocks must cover
    context_len + query_len tokens. Built with a handful of numpy calls over all sequences (the block ids
    flattened, each new token's slot looked up in them), not a loop over sequences and tokens. With the tables'
    sliding `window` (a hybrid KV group's) a sequence's entries before the block of its first query's earliest key
    are left NULL (-1), as released ones are: nothing reads them, and a long context's table is not read whole."""
    n = len(seqs)
    ctx = np.fromiter((c for c, _, _ in seqs), np.int64, n)
    qlen = np.fromiter((q for _, q, _ in seqs), np.int64, n)
    lengths = np.fromiter((len(b) for _, _, b in seqs), np.int64, n)
    short = np.flatnonzero(lengths * block_size < ctx + qlen)
    if short.size:
        s = int(short[0])
        raise ValueError(f"sequence {s}: {lengths[s]} blocks of {block_size} cannot hold {ctx[s] + qlen[s]} tokens")
    table = np.full((n, max(1, int(lengths.max(initial=0)))), -1, dtype=np.int32)
    flat, offset = place_block_tables([b for _, _, b in seqs], lengths, table, block_size, window, ctx)
    seq_of = np.repeat(np.arange(n), qlen)                                   # each new token's sequence
    pos = np.arange(int(qlen.sum())) - np.repeat(np.cumsum(qlen) - qlen - ctx, qlen)   # and its position
    slots = flat[offset[seq_of] + pos // block_size] * block_size + pos % block_size
    host = torch.from_numpy(table)
    return AttentionMetadata(qlen.tolist(), ctx.tolist(), to_device(host, device),
                             to_device(torch.from_numpy(slots), device), host_tables=host)


def place_block_tables(tables: Sequence[list[int]], lengths: np.ndarray, out: np.ndarray, block_size: int,
                       window: int | None, query_starts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Write row i's block ids (its `lengths[i]`) into out[i] in a handful of numpy calls: with the tables' sliding
    `window`, only from first[i], the block of the earliest key row i's first query (at position query_starts[i])
    reads, the columns before it left as `out` has them. Returns the ids written, flattened, and each row's offset
    in them: flat[offset[i] + b] is row i's block b (for b >= first[i])."""
    n = len(tables)
    first = np.maximum(query_starts - window + 1, 0) // block_size if window else np.zeros(n, np.int64)
    trim = bool(first.any())
    kept = lengths - first
    tails = (t[f:] for t, f in zip(tables, first.tolist())) if trim else tables
    flat = np.fromiter(chain.from_iterable(tails), np.int64, int(kept.sum()))
    start = np.cumsum(kept) - kept   # each row's first entry in `flat`
    if trim:   # placed by index: a mask over every column costs more than the few ids kept
        out.flat[np.repeat(np.arange(n) * out.shape[1] + first - start, kept) + np.arange(flat.size)] = flat
    else:
        out[:n][np.arange(out.shape[1]) < lengths[:, None]] = flat
    return flat, start - first


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
class _PrefillGroup:          # one sequence, no cached context: attend among its own new tokens
    start: int
    end: int


@dataclass
class _GatherGroup:           # sequences whose keys are gathered from the paged cache, a block at a time
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
        return [_PrefillGroup(starts[s], starts[s + 1]) if meta.context_lens[s] == 0
                else self._gather(meta, [s], starts, self.block_size, self.device, self.window)
                for s, q in enumerate(meta.query_lens) if q > 1]

    def varlen(self, window: int | None) -> VarlenChunks | None:
        """The chunks as one flash-attention call (VarlenChunks) for layers of this sliding window, None when the batch
        has none; built on first use, once a window."""
        if window not in self.varlens:
            self.varlens[window] = VarlenChunks.build(self.meta, self.block_size, self.device, window)
        return self.varlens[window]

    @cached_property
    def decode_group(self) -> _GatherGroup | None:
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
                device: torch.device, window: int | None = None) -> _GatherGroup:
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
        return _GatherGroup(to(token_idx), to(dest), to(key_blocks), to(in_seq), to(ctx[:, None] + qi[None, :]),
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


def _gathered_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, g: _GatherGroup,
                        scale: float, window: int | None) -> torch.Tensor:
    """Reference paged attention (GQA) for one group, in fp32; q [Tg, heads, d] -> [Tg, heads, d]. Keys and values
    are gathered a cache block at a time (a block's rows are contiguous) and go through scaled_dot_product_attention
    with the group's mask, its query heads sharing each key head (`enable_gqa`)."""
    n_seq, q_max = g.q_pos.shape
    heads, d = q.shape[1], q.shape[2]
    keys = k_cache[g.key_blocks].flatten(1, 2).transpose(1, 2).float()     # [S, kvh, L, d]
    values = v_cache[g.key_blocks].flatten(1, 2).transpose(1, 2).float()
    qp = q.new_zeros(n_seq * q_max, heads, d, dtype=torch.float32)
    qp[g.dest] = q.float()
    qp = qp.view(n_seq, q_max, heads, d).transpose(1, 2)                    # [S, heads, Q, d]
    with sdpa_kernel(_SDPA_BACKENDS):   # (not cuDNN's: a new plan for every new key length)
        out = F.scaled_dot_product_attention(qp, keys, values, attn_mask=g.mask(window)[:, None], scale=scale,
                                             enable_gqa=True)
    return out.transpose(1, 2).reshape(n_seq * q_max, heads, d)[g.dest].to(q.dtype)


# SDPA backends (prefill and the gathered reference): not cuDNN's, which on the H200 built a new plan for every new
# prompt length (about 10 ms a call, most of a mixed step's time in `pwruntime replay` of the demo trace; README, "Sim
# against runtime").
_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def _prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                       window: int | None) -> torch.Tensor:
    """Causal attention of n queries, the last n of m >= n keys; q [n, heads, d], k/v [m, kv_heads, d]. With m > n
    (a chunk after its cached context, `window` None) the causal mask is aligned to the bottom right: query i sees
    keys 0..m - n + i."""
    groups = q.shape[1] // k.shape[1]
    qt = q.transpose(0, 1)[None]
    kt = k.repeat_interleave(groups, dim=1).transpose(0, 1)[None]
    vt = v.repeat_interleave(groups, dim=1).transpose(0, 1)[None]
    with sdpa_kernel(_SDPA_BACKENDS):
        if k.shape[0] > q.shape[0]:
            out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=causal_lower_right(q.shape[0], k.shape[0]),
                                                 scale=scale)
        elif window is None:
            out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale)
        else:
            pos = torch.arange(q.shape[0], device=q.device)
            mask = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - window)
            out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale)
    return out[0].transpose(0, 1)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, plan: AttentionPlan, scale: float,
                    window: int | None = None, kv_ptrs: torch.Tensor | None = None,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """Attention output [T, heads, d] for the batch; k/v are this batch's new K/V (already in the cache). The decode
    kernel reads the caches through `kv_ptrs` when given (KVCache.layer_ptrs). With `out` (at least T rows; a
    piecewise graph's static buffer) the T rows are written there and `out` is returned; rows past T are left as
    they are."""
    d = plan.decode
    kernel = (d is not None and d.kernel_applies(q.device.type, q.dtype)  # and the kernel takes the heads
              and decode_variant(q.dtype, q.shape[-1], q.shape[1] // k_cache.shape[2]) is not None)
    if kernel and d.rows is None and out is None:
        return paged_attention_decode(q, k_cache, v_cache, d.block_tables, d.seq_lens, scale, kv_ptrs=kv_ptrs,
                                      window=window)
    if out is None:
        out = torch.empty_like(q)
    if kernel and d.rows is None:
        out[:q.shape[0]] = paged_attention_decode(q, k_cache, v_cache, d.block_tables, d.seq_lens, scale,
                                                  kv_ptrs=kv_ptrs, window=window)
        return out
    if kernel:
        out[d.rows] = paged_attention_decode(q[d.rows], k_cache, v_cache, d.block_tables, d.seq_lens, scale,
                                             kv_ptrs=kv_ptrs, window=window)
    chunks = plan.varlen(window) if VarlenChunks.applies(q) else None
    if chunks is not None:
        out[chunks.rows] = chunks.attention(q, k_cache, v_cache, scale, window)
        groups = [] if kernel or plan.decode_group is None else [plan.decode_group]
    else:
        groups = plan.chunk_groups if kernel else plan.groups
    for g in groups:
        if isinstance(g, _PrefillGroup):
            out[g.start:g.end] = _prefill_attention(q[g.start:g.end], k[g.start:g.end], v[g.start:g.end],
                                                    scale, window)
        elif g.span is not None and window is None:   # one chunk after its context: SDPA over its gathered keys
            a, b, n = g.span
            rows_of = lambda cache: cache[g.key_blocks[0]].flatten(0, 1)[:n]  # noqa: E731 - [n, kvh, d]
            out[a:b] = _prefill_attention(q[a:b], rows_of(k_cache), rows_of(v_cache), scale, None)
        else:
            out[g.token_idx] = _gathered_attention(q[g.token_idx], k_cache, v_cache, g, scale, window)
    return out


class Attention(nn.Module):
    """q/k/v projections (+ optional q/k RMSNorm), rotary, paged attention, output projection, for decoder layer
    `layer` (its KV heads, head size and sliding window). Gemma 4 adds a scale-less V norm and, where `w` has no
    "v" (its global layers), takes V from the K projection."""

    def __init__(self, cfg: ModelConfig, w: dict[str, torch.Tensor | None], layer: int):
        super().__init__()
        self.heads, (self.kv_heads, self.head_dim) = cfg.heads, cfg.kv_shape(layer)
        self.window, self.qk_norm, self.clip = cfg.sliding_windows[layer], cfg.qk_norm, cfg.clip_qkv
        self.scale = self.head_dim ** -0.5 if cfg.attention_scale is None else cfg.attention_scale
        # q, k and v in one GEMM (weights stacked; a missing bias of a biased model is zeros)
        self.q_size, self.kv_size = w["q"].shape[0], w["k"].shape[0]
        self.v_is_k = w.get("v") is None
        names = "qk" if self.v_is_k else "qkv"
        biases = [w.get(f"{n}_bias") for n in names]
        bias = None if all(b is None for b in biases) else torch.cat(
            [b if b is not None else w[n].new_zeros(w[n].shape[0]) for n, b in zip(names, biases)])
        self.qkv_proj = Linear(torch.cat([w[n] for n in names]), bias)
        self.o_proj = Linear(w["o"], w.get("o_bias"))
        norm = FloatRMSNorm if cfg.arch == "gemma4" else RMSNorm
        if cfg.qk_norm != "none":
            self.q_norm, self.k_norm = norm(w["q_norm"], cfg.rms_eps), norm(w["k_norm"], cfg.rms_eps)
        self.v_norm = FloatRMSNorm(None, cfg.rms_eps) if cfg.arch == "gemma4" else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, plan: AttentionPlan, kv_ptrs: torch.Tensor | None = None) -> torch.Tensor:
        """`kv_ptrs`: the layer's cache addresses on the device (KVCache.layer_ptrs), through which the K/V writes
        and the decode kernel reach the caches on CUDA (what keeps a captured graph valid across resizes)."""
        q, k, v = self.project(x, cos, sin, k_cache, v_cache, plan.slot_mapping, kv_ptrs)
        return self.output(self.core(q, k, v, k_cache, v_cache, plan, kv_ptrs))

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             plan: AttentionPlan, kv_ptrs: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """The attention itself over the paged cache ([T, heads, d]; `out` as in paged_attention): the part of the
        layer a piecewise graph of a mixed step leaves eager (pwruntime.mixed_graphs)."""
        return paged_attention(q, k, v, k_cache, v_cache, plan, self.scale, self.window, kv_ptrs, out)

    def output(self, o: torch.Tensor) -> torch.Tensor:
        """o_proj of the attention output [n, heads, d] -> [n, hidden]."""
        return self.o_proj(o.reshape(o.shape[0], self.heads * self.head_dim))

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, slots: torch.Tensor, kv_ptrs: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k (rotated) and v [n, heads or kv_heads, d] of x, the new K/V written to the cache at `slots`."""
        n, qs, kvs = x.shape[0], self.q_size, self.kv_size
        qkv = self.qkv_proj(x)
        if self.v_is_k:
            (q, k), v = qkv.split([qs, kvs], dim=-1), qkv[:, qs:]
        else:
            q, k, v = qkv.split([qs, kvs, kvs], dim=-1)
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip is not None:
            q, k, v = (t.clamp(-self.clip, self.clip) for t in (q, k, v))
        q = q.view(n, self.heads, self.head_dim)
        k = k.view(n, self.kv_heads, self.head_dim)
        v = v.view(n, self.kv_heads, self.head_dim)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.v_norm is not None:
            v = self.v_norm(v)
        q, k = rotary_kv(q, k, v, cos, sin, k_cache, v_cache, slots, kv_ptrs)
        return q, k, v


def read_attention(r, c: ModelConfig, i: int) -> Attention:
    """Decoder layer i's attention from a TensorReader `r`, at the layer's own KV heads and head size; no v_proj where
    V is the K projection (Gemma 4's global layers with attention_k_eq_v)."""
    p = f"{c.weight_prefix}layers.{i}.self_attn."
    kv_heads, head_dim = c.kv_shape(i)
    q_out, kv_out = c.heads * head_dim, kv_heads * head_dim
    v_is_k = i in c.global_layers and c.global_k_eq_v
    w = {"q": r.get(p + "q_proj.weight", (q_out, c.hidden)), "k": r.get(p + "k_proj.weight", (kv_out, c.hidden)),
         "v": None if v_is_k else r.get(p + "v_proj.weight", (kv_out, c.hidden)),
         "o": r.get(p + "o_proj.weight", (c.hidden, q_out))}
    if c.qkv_bias:
        w.update(q_bias=r.get(p + "q_proj.bias", (q_out,)), k_bias=r.get(p + "k_proj.bias", (kv_out,)))
        if not v_is_k:
            w["v_bias"] = r.get(p + "v_proj.bias", (kv_out,))
    if c.o_bias:
        w["o_bias"] = r.get(p + "o_proj.bias", (c.hidden,))
    if c.qk_norm == "full":
        w.update(q_norm=r.get(p + "q_norm.weight", (q_out,)), k_norm=r.get(p + "k_norm.weight", (kv_out,)))
    elif c.qk_norm == "head":
        w.update(q_norm=r.get(p + "q_norm.weight", (head_dim,)), k_norm=r.get(p + "k_norm.weight", (head_dim,)))
    return Attention(c, w, i)
