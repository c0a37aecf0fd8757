"""ModelRunner: turns a ScheduledBatch into input ids, positions and AttentionMetadata, runs the model, samples.

The scheduler's pool already reserved every slot; the runner only reads block tables. It returns the
logits of the rows that sample (each sampling sequence's last new token) and, when asked, the batch's
routing on its way to the host (`RoutingCopy`; numpy arrays for the shared observation code, policies.observe).
`sample` turns those logits into tokens (pwruntime.sampling), through a captured graph after a decode replay.

With asynchronous scheduling the previous step's sampled tokens are still on the device when the next batch is
prepared: its sequences' last token is a `PENDING_TOKEN` on the host. `keep_sampled` holds a step's tokens in a
device buffer (`sampled`) and remembers which sequence sampled which row; every path (graphs or eager) then takes
those rows' input tokens from the buffer on the device (`cuda_graphs.take_sampled`), so nothing waits for them.

With `cuda_graphs` on a CUDA model and a capturable expert store, a batch in which every sequence adds
exactly one token replays a captured graph (pwruntime.cuda_graphs.DecodeGraphs), and any other batch of
up to max_num_batched_tokens tokens replays the piecewise graphs of its token bucket, its attention run
eagerly between them (pwruntime.mixed_graphs.MixedGraphs); everything else (CPU, a store that is not capturable, a
batch neither takes) runs the forward eagerly.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from policies.kv_blocks import BlockPool
from policies.kv_groups import GroupedBlockPool
from policies.scheduler import ScheduledBatch
from policies.sequence import PENDING_TOKEN
from pwruntime.block_tables import BlockTables, TableRows
from pwruntime.cuda_graphs import GRAPH_SIZES, DecodeGraphs, DecodeRows, take_sampled
from pwruntime.host_copy import to_device
from pwruntime.kernels.compile import compile_variants
from pwruntime.mixed_graphs import MixedGraphs
from pwruntime.kv_cache import KVCache
from pwruntime.model.attention_plan import AttentionMetadata, table_metadata
from pwruntime.model.moe_model import ForwardOutput, LayerRouting, pack_routing, routing_layout
from pwruntime.sampling import SamplingParams, row_values, sample_tensor


@dataclass(frozen=True)
class RoutingArrays:
    """One forward's routing, stacked over MoE layers (numpy, on the host)."""

    topk_ids: np.ndarray  # [L, T, k] int64
    topk_weights: np.ndarray  # [L, T, k] float32
    gate_up_in_norm: np.ndarray  # [L, T] float32
    down_in_norm: np.ndarray  # [L, T, k] float32
    query_lens: tuple[int, ...]  # tokens per batch entry (the flattening order)


@dataclass(frozen=True)
class RoutingCopy:
    """A forward's routing on its way to the host (`routing_to_host`): `arrays()` waits for the copy."""

    words: torch.Tensor  # int32 [T, W] on the host (pinned when the copy is from a GPU): moe_model.pack_routing's
    ready: torch.cuda.Event | None  # recorded after the copy (None: copied already)
    layers: int
    top_k: int
    query_lens: tuple[int, ...]

    def arrays(self) -> RoutingArrays:
        """The routing as numpy arrays: the words viewed back as their types (bits copied, never converted)."""
        if self.ready is not None:
            self.ready.synchronize()
        flat, out, at = self.words.numpy(), [], 0
        tokens, layers = flat.shape[0], self.layers
        for _, width, dtype in routing_layout(self.top_k):
            block = flat[:, at:at + layers * width].reshape(tokens, layers, width).transpose(1, 0, 2)
            field = np.ascontiguousarray(block).view(dtype)       # [L, T, words a token / words a value]
            out.append(field.reshape(layers, tokens) if width == 1 else field)
            at += layers * width
        return RoutingArrays(*out, self.query_lens)


@dataclass(frozen=True)
class StepOutput:
    logits: torch.Tensor  # [num_sampled, vocab] float32, in batch-entry order
    routing: RoutingCopy | None
    extra_hidden: torch.Tensor | None = None  # [len(extra_rows), H]: the final hidden states of `run`'s extra rows


class ModelRunner:
    """Runs one model over one paged KV cache."""

    def __init__(self, model, kv: KVCache, cuda_graphs: bool = False, max_num_seqs: int = GRAPH_SIZES[-1],
                 graph_settle_steps: int = 0, max_num_batched_tokens: int | None = None,
                 max_model_len: int | None = None) -> None:
        """`max_num_batched_tokens`: the largest batch the piecewise graphs take (None: no piecewise graphs);
        `max_model_len`: the positions a sequence may use (None: the model's), which the decode graphs' static block
        tables are wide enough for (a batch's tables are padded to that width and sent every step: Gemma 4's 262,144
        positions made them 4 MiB a KV group at 64 rows)."""
        self.model, self.kv = model, kv
        self.block_tables = BlockTables(len(kv.layout.groups))   # the pool's tables as arrays, updated each step
        self.sampled = torch.zeros(max_num_seqs, dtype=torch.long, device=model.device)  # see keep_sampled
        self._sampled_row: dict = {}  # seq_id -> its row in `sampled`
        graphs = cuda_graphs and model.device.type == "cuda"
        max_blocks = -(-max_model_len // kv.block_size) if max_model_len else None
        self.graphs = (DecodeGraphs(model, kv, max_num_seqs, max_blocks, settle_steps=graph_settle_steps,
                                    sampled=self.sampled) if graphs else None)
        self.mixed_graphs = (MixedGraphs(model, kv, max_num_batched_tokens, settle_steps=graph_settle_steps,
                                         sampled=self.sampled)
                             if graphs and max_num_batched_tokens else None)

    def keep_sampled(self, tokens: torch.Tensor, seq_ids: list) -> None:
        """Hold a step's sampled tokens (int64 [n] on the device, one per sequence in `seq_ids`) for the next batch,
        whose pending tokens they are (stream-ordered: the next forward reads them after this copy)."""
        if len(seq_ids) > self.sampled.shape[0]:
            raise ValueError(f"{len(seq_ids)} sampled tokens for a buffer of {self.sampled.shape[0]}")
        self.sampled[:len(seq_ids)].copy_(tokens, non_blocking=True)
        self._sampled_row = {sid: j for j, sid in enumerate(seq_ids)}

    def _token_src(self, batch: ScheduledBatch, ids: list[int], ends: list[int]) -> list[int] | None:
        """Per flat row, the `sampled` row that feeds it (-1: its id is on the host); None when no row is pending.
        `ends`: each entry's last flat row (only an entry's last token can be pending)."""
        src = None
        for e, end in zip(batch.entries, ends):
            if ids[end] == PENDING_TOKEN:
                if src is None:
                    src = [-1] * len(ids)
                row = self._sampled_row.get(e.seq.seq_id)
                if row is None:
                    raise RuntimeError(f"sequence {e.seq.seq_id!r} has a pending token but the last kept sample has "
                                       "none for it; keep_sampled must follow every step that samples")
                src[end], ids[end] = row, 0
        return src

    def compile_kernels(self) -> tuple[int, float]:
        """Compile every CUDA kernel build the model's forwards can launch (`MoEModel.kernel_variants`), or load it from
        CuPy's disk cache, before the first step: a build's first use would otherwise wait for NVRTC inside that step
        (7 s an ap_moe.cu build on the H200). Returns (builds, seconds); (0, 0.0) off CUDA."""
        wanted = self.model.kernel_variants()
        return len(wanted), (compile_variants(self.model.device, wanted) if wanted else 0.0)

    def capture_graphs(self, record: bool) -> None:
        """Capture every decode size and mixed-step bucket now (before serving) instead of on first use."""
        for graphs in (self.graphs, self.mixed_graphs):
            if graphs is not None:
                graphs.capture_all(record)

    def prepare(self, batch: ScheduledBatch, pool: BlockPool | GroupedBlockPool
                ) -> tuple[list[int], list[int], AttentionMetadata | tuple[AttentionMetadata, ...], list[int],
                           list[int] | None]:
        """Token ids and positions of the flattened batch, its metadata on the host (one for each KV group of a
        GroupedBlockPool: `_tables`), the flat row of each sampling entry and each row's token source
        (`_token_src`; pending ids become 0)."""
        ids: list[int] = []
        positions: list[int] = []
        sample_rows: list[int] = []
        ends: list[int] = []
        for e in batch.entries:
            end = e.start + e.num_new_tokens
            ids += e.seq.token_ids(e.start, end)
            positions += range(e.start, end)
            ends.append(len(ids) - 1)
            if e.sample:
                sample_rows.append(len(ids) - 1)
        src = self._token_src(batch, ids, ends)
        ctx, new = [e.start for e in batch.entries], [e.num_new_tokens for e in batch.entries]
        meta = tuple(table_metadata(ctx, new, tables, group.block_size, window=group.window)
                     for group, tables in zip(self.kv.layout.groups, self._tables(batch, pool)))
        return ids, positions, meta[0] if len(meta) == 1 else meta, sample_rows, src

    def _tables(self, batch: ScheduledBatch, pool: BlockPool | GroupedBlockPool) -> list[TableRows]:
        """Each KV group's block tables of the batch's sequences, from the runner's persistent copy of the pool's."""
        return self.block_tables.batch(pool, [e.seq.seq_id for e in batch.entries])

    def _graph_forward(self, batch: ScheduledBatch, pool: BlockPool, record: bool) -> ForwardOutput | None:
        """The forward through a captured decode graph, or None when this batch runs eagerly."""
        if self.graphs is None or any(e.num_new_tokens != 1 for e in batch.entries):
            return None
        ids = [e.seq.token_ids(e.start, e.start + 1)[0] for e in batch.entries]
        src = self._token_src(batch, ids, list(range(len(ids))))
        tables = self._tables(batch, pool)
        rows = DecodeRows(ids, [e.start for e in batch.entries], tables[0], src, tuple(tables[1:]))
        return self.graphs.forward(rows, record)

    def run(self, batch: ScheduledBatch, pool: BlockPool, record: bool = False,
            extra_rows: list[int] | None = None) -> StepOutput:
        """The forward of `batch`; `extra_rows`: flat rows (entries in order, each entry's new tokens in turn) whose
        final hidden states are returned too (a copy: a later replay cannot overwrite them)."""
        if pool.id_limit > self.kv.num_blocks:
            raise RuntimeError(f"KV cache backs {self.kv.num_blocks} blocks but the pool uses ids up to "
                               f"{pool.id_limit}; resize the cache after changing the pool")
        out = self._graph_forward(batch, pool, record)
        if out is None:
            input_ids, positions, meta, rows, src = self.prepare(batch, pool)
            if self.mixed_graphs is not None:
                out = self.mixed_graphs.forward(input_ids, positions, meta, record, src)
            if out is None:
                ids = to_device(torch.tensor(input_ids, dtype=torch.long), self.model.device)
                if src is not None:
                    src_ids = to_device(torch.tensor(src, dtype=torch.long), self.model.device)
                    ids = take_sampled(ids, src_ids, self.sampled)
                out = self.model.forward(ids, torch.tensor(positions, dtype=torch.long), self.kv, meta, record=record)
        else:  # one row per entry
            rows = [i for i, e in enumerate(batch.entries) if e.sample]
        logits = self.model.logits(_rows(out.hidden, rows)) if out.logits is None else _rows(out.logits, rows)
        routing = None
        if record and out.routing:
            routing = routing_to_host(out.routing, tuple(e.num_new_tokens for e in batch.entries), out.routing_words)
        extra = None
        if extra_rows:
            extra = out.hidden[to_device(torch.tensor(extra_rows, dtype=torch.long), out.hidden.device)]
        return StepOutput(logits, routing, extra)

    def sample(self, logits: torch.Tensor, params: list[SamplingParams], uniforms: list[float | None]) -> torch.Tensor:
        """The batch's tokens, as `sampling.sample_tensor` gives them: by the decode graphs' captured sampler when
        `logits` are a decode replay's as it left them and some row samples, else eagerly."""
        if self.graphs is not None and not all(p.greedy for p in params):
            vocab = logits.shape[-1]
            tokens = self.graphs.sample(logits, [row_values(p, u, vocab) for p, u in zip(params, uniforms)])
            if tokens is not None:
                return tokens
        return sample_tensor(logits, params, uniforms)

    def copy_blocks(self, moves: list[tuple[int, int]]) -> None:
        """Copy K/V of block src into dst for every (src, dst) (after BlockPool.compact)."""
        if not moves:
            return
        idx = to_device(torch.tensor(moves, dtype=torch.long).T.contiguous(), self.kv.device)
        self.kv.copy_blocks(idx[0], idx[1])


def _rows(hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """hidden[rows]: a view when the rows are 0..n-1 (every row of a decode batch samples), else a gather (which
    copies the indices to the device)."""
    if rows == list(range(len(rows))):
        return hidden[:len(rows)]
    return hidden[to_device(torch.tensor(rows, dtype=torch.long), hidden.device)]


def routing_to_host(layers: list[LayerRouting], query_lens: tuple[int, ...],
                    words: torch.Tensor | None = None) -> RoutingCopy:
    """A forward's routing on its way to the host in one copy: the layers' arrays packed into int32 words
    (`pack_routing`, one kernel; `words` when the forward packed them already, as a decode graph does) and copied
    into pinned memory without waiting, so the host can work while the GPU finishes the forward (RoutingCopy.arrays
    waits)."""
    flat, ready = to_host(pack_routing(layers) if words is None else words)
    return RoutingCopy(flat, ready, len(layers), layers[0].topk_ids.shape[1], query_lens)


def to_host(t: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """(a host copy of t, the event after which it is valid): from a GPU, a pinned copy queued without waiting;
    off it, t itself and None."""
    if not t.is_cuda:
        return t, None
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record()
    return host, ready
