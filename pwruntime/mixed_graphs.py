"""MixedGraphs: the forward of a batch that is not pure decode, captured piecewise in CUDA graphs per token bucket.

A mixed step (prefill chunks beside decode rows) cannot be one graph: its attention depends on how its tokens
split into sequences, which changes every step. As in vLLM's piecewise capture, everything else is captured for
a fixed number of tokens (the batch padded to a bucket, a multiple of 64) and the attention core runs eagerly
between the pieces. For a model of L layers a bucket holds L + 1 graphs:

    piece 0:  embedding, rotary tables, layer 0 before its attention core (norm, q/k/v, rotary, K/V written)
    piece i:  layer i-1 after its core (o_proj, norm, router, MoE, routing records), layer i before its core
    piece L:  layer L-1 after its core, the final norm, the routing packed into words (pack_routing)

and a replay is: stage the padded token ids, positions, K/V slots and token sources in one transfer, build the attention plan
(host work, as eagerly), then graph 0, core 0, graph 1, core 1, ..., graph L. With hybrid KV groups
(pwruntime.kv_cache) each group has its own row of slots, which its layers' pieces write K/V at, and its own plan.
The pieces meet the cores in boundary buffers (`Boundary`, the largest bucket's rows), one set for every layer of one
attention geometry (KV heads and head size: Gemma 4's sliding and global layers have two) and every bucket: a piece
copies its layer's q, k, v there and a core writes its output there (`Attention.core(..., out=)`), which the next
piece reads. Everything else a piece makes lives in the graphs' memory pool, where what one capture frees the next
reuses, so the buckets cost the boundaries, their routing records and their outputs, not a forward's activations each.
Padding rows are token 0 at position 0 with their K/V written to the KV cache's scratch block; no core reads them and
their attention rows keep what an earlier step left there (finite), so they never reach a real row.

What must hold for the pieces to be capturable is what `DecodeGraphs` needs (GraphSet.ready: the scratch
block, a decode-kernel dtype, a capturable store), and the store's MoE must read nothing back to the
host for a bucket's tokens (DeviceExpertStore does so inside a capture, `prefill_syncs`). Captures go stale, settle
and fail exactly as decode graphs do (GraphSet). The LM head is not captured: a mixed step samples few rows,
which the runner picks out of `hidden`.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields, replace

import torch

from pwruntime.cuda_graphs import GraphSet, padded_size, take_sampled
from pwruntime.kv_cache import KVCache
from pwruntime.model.attention_plan import AttentionMetadata, group_metadata, layer_plans
from pwruntime.model.moe_model import ForwardOutput, LayerRouting, pack_routing

MIXED_BUCKET = 64   # buckets are multiples of this (the fused MoE kernel's tokens per launch)


def mixed_sizes(max_num_batched_tokens: int) -> tuple[int, ...]:
    """Token buckets to capture: multiples of MIXED_BUCKET up to the first that holds max_num_batched_tokens."""
    if max_num_batched_tokens < 1:
        raise ValueError(f"max_num_batched_tokens must be >= 1, got {max_num_batched_tokens}")
    return tuple(range(MIXED_BUCKET, -(-max_num_batched_tokens // MIXED_BUCKET) * MIXED_BUCKET + 1, MIXED_BUCKET))


@dataclass(frozen=True)
class Boundary:
    """Where pieces and attention cores meet: q, k, v (a piece writes, the core reads) and the core's output (the
    next piece reads), rows for the largest bucket, one set for every layer of one geometry and every bucket (they
    run one at a time)."""
    q: torch.Tensor     # [rows, heads, d]
    k: torch.Tensor     # [rows, kv_heads, d]
    v: torch.Tensor     # [rows, kv_heads, d]
    out: torch.Tensor   # [rows, heads, d], zeros at first (padding rows keep finite values)

    @classmethod
    def alloc(cls, rows: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
              device: torch.device) -> "Boundary":
        new = lambda h: torch.zeros(rows, h, head_dim, dtype=dtype, device=device)  # noqa: E731
        return cls(new(heads), new(kv_heads), new(kv_heads), new(heads))


@dataclass
class _Pieces:
    """One bucket's graphs and what the last one leaves (hidden, routing, routing words of the bucket's rows)."""
    graphs: list[torch.cuda.CUDAGraph]
    out: ForwardOutput


class MixedGraphs(GraphSet):
    """Piecewise-captured forwards of one model over one KV cache (see the module docstring)."""

    def __init__(self, model, kv: KVCache, max_num_batched_tokens: int, settle_steps: int = 0,
                 sampled: torch.Tensor | None = None):
        super().__init__(model, kv, settle_steps, sampled)
        self.sizes = mixed_sizes(max_num_batched_tokens)
        n, cuda = self.sizes[-1], model.device.type == "cuda"
        self._group_of = kv.layout.group_of
        rows = 3 + len(kv.layout.groups)
        # token ids, positions, each KV group's K/V slots, the previous step's sampled row feeding each token (-1: none)
        self.inputs = torch.zeros(rows, n, dtype=torch.long, device=model.device)
        self.host = torch.zeros(rows, n, dtype=torch.long, pin_memory=cuda)  # staged here, sent in one copy
        c = model.config
        sets = {shape: Boundary.alloc(n, c.heads, *shape, model.dtype, model.device) for shape in set(c.kv_shapes)}
        self.boundaries = [sets[shape] for shape in c.kv_shapes]   # each layer's, by its (KV heads, head size)
        self._limit: tuple[object, float] = (None, 0.0)  # (the store it was asked of, its captured_tokens_limit)

    def supports(self, num_tokens: int) -> bool:
        """Whether a batch of this many tokens can run through the pieces (else the caller runs it eagerly): within
        the largest bucket and the store's `captured_tokens_limit` (where a captured MoE would be slower than eager)."""
        return 0 < num_tokens <= self.sizes[-1] and self.ready and num_tokens <= self._store_limit()

    def _store_limit(self) -> float:
        store = self.model.experts
        if self._limit[0] is not store:
            limit = getattr(store, "captured_tokens_limit", None)
            value = limit(self.model.dtype, self.model.config.top_k) if limit is not None else None
            self._limit = (store, float("inf") if value is None else value)
        return self._limit[1]

    # ------------------------------------------------------------ running
    @torch.inference_mode()
    def forward(self, input_ids: list[int], positions: list[int],
                meta: AttentionMetadata | Sequence[AttentionMetadata], record: bool = False,
                token_src: list[int] | None = None) -> ForwardOutput | None:
        """The forward of a batch by piecewise replay (views of its real rows, valid until the next replay), or
        None if it must run eagerly. `meta` is on the host (batch_metadata(..., "cpu"); one for each KV group of a
        hybrid cache); `token_src` as in DecodeRows (tokens >= 0 there come from the previous step's sampled
        tokens)."""
        self._drop_stale()
        metas = group_metadata(meta)
        t = metas[0].num_tokens
        if not self.supports(t):
            return None
        size = padded_size(t, self.sizes)
        settled = self._settled()
        pieces = self._graphs.get((size, record)) or (self._capture(size, record) if settled else None)
        if pieces is None:
            return None
        self._stage(input_ids, positions, [m.slot_mapping for m in metas], size, token_src)
        kv, layers = self.kv, self.model.layers
        staged = [replace(m, slot_mapping=self.inputs[2 + g, :t]) for g, m in enumerate(metas)]
        plans = layer_plans(staged, kv.layout, self.model.device, self.model.dtype, self.model.config.attention_reads)
        for i, (layer, b) in enumerate(zip(layers, self.boundaries)):
            pieces.graphs[i].replay()
            layer.attn.core(b.q[:t], b.k[:t], b.v[:t], kv.k[i], kv.v[i], plans[i], kv.layer_ptrs(i), out=b.out)
        pieces.graphs[-1].replay()
        self.replays += 1
        out = pieces.out
        routing = None
        if out.routing is not None:
            routing = [LayerRouting(**{f.name: getattr(r, f.name)[:t] for f in fields(r)}) for r in out.routing]
        return ForwardOutput(out.hidden[:t], routing, None if out.routing_words is None else out.routing_words[:t])

    def _stage(self, input_ids: list[int], positions: list[int], slots: Sequence[torch.Tensor], size: int,
               token_src: list[int] | None = None) -> None:
        """Token ids, positions, each KV group's slots and token sources padded to `size` (padding on the scratch
        block, no source) in one transfer."""
        def fill() -> None:
            t, host = len(input_ids), self.host.numpy()
            host[0, :t], host[1, :t], host[-1, :t] = input_ids, positions, -1 if token_src is None else token_src
            host[:2, t:size], host[-1, t:size] = 0, -1
            for g, (group, group_slots) in enumerate(zip(self.kv.layout.groups, slots, strict=True)):
                host[2 + g, :t] = group_slots.numpy()
                host[2 + g, t:size] = self.kv.scratch_block * group.block_size
            self.inputs.copy_(self.host, non_blocking=True)

        self._send(fill)

    # ------------------------------------------------------------ capturing
    def _capture(self, size: int, record: bool) -> _Pieces | None:
        """The L + 1 pieces of a bucket, captured in order, each over what the piece before left (its carry and
        the boundary); each captured piece is replayed once (on padding rows, the boundary's output standing in
        for the cores) so that the next one's warm-up reads real values, never uninitialized memory."""
        self._stage([], [], [torch.zeros(0, dtype=torch.long)] * len(self.kv.layout.groups), size)
        layers = len(self.model.layers)
        graphs, records, carry = [], [] if record else None, None
        try:
            with torch.inference_mode():
                for i in range(layers + 1):
                    graph, res = self._warm_and_capture(self._piece, i, size, carry, records)
                    graph.replay()
                    graphs.append(graph)
                    if i < layers:
                        carry, rec = res
                    else:
                        hidden, rec, words = res
                    if records is not None:
                        records += rec
        except Exception as e:  # noqa: BLE001 - any failure means: run mixed steps eagerly
            self._disable(f"the piecewise graphs of {size} tokens", e)
            return None
        self.captures += 1
        pieces = _Pieces(graphs, ForwardOutput(hidden, records, words))
        self._graphs[(size, record)] = pieces
        return pieces

    def _piece(self, i: int, size: int, carry: tuple | None, records: list[LayerRouting] | None):
        """Piece i over the first `size` rows of the static inputs. It reads `carry` (x, the ropes' cos and sin) and
        layer i - 1's core output, writes layer i's q, k, v to its boundary, and returns (carry, its routing records)
        for i < L; the last piece returns (the final norm's output, its records, the routing of `records` and its
        own packed into words)."""
        model, kv = self.model, self.kv
        ids, positions, src = self.inputs[0, :size], self.inputs[1, :size], self.inputs[-1, :size]
        rec = [] if records is not None else None
        if i == 0:
            x, rope = model.embed_tokens(take_sampled(ids, src, self.sampled), positions)
            delta = None
        else:
            x, rope = carry
            x, delta = model.layers[i - 1].after_attention(x, self.boundaries[i - 1].out[:size], model.experts, rec)
        if i == len(model.layers):
            every = None if records is None else records + rec
            return model.final_norm(x, delta), rec, pack_routing(every) if every else None
        cos, sin = rope[model.layer_rope[i]]
        slots = self.inputs[2 + self._group_of[i], :size]
        x, q, k, v = model.layers[i].before_attention(x, delta, cos, sin, kv.k[i], kv.v[i], slots, kv.layer_ptrs(i))
        b = self.boundaries[i]
        for dst, src in ((b.q, q), (b.k, k), (b.v, v)):
            dst[:size].copy_(src)
        return (x, rope), rec
