"""MoEModel: the decoder stack (attention + MoE or dense MLP per layer) over a paged KV cache.

forward(input_ids [T], positions [T], kv, meta, record) runs T flattened tokens of a batch and returns the
final-norm hidden states; logits(hidden) applies the LM head (the engine asks only for the rows it samples).
Routed experts are reached only through `self.experts` (an ExpertStore), so another store (any-precision
weights, a fused kernel) can replace DenseExpertStore without touching this file.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from policies.kv_groups import KVLayout
from pwruntime.host_copy import to_device
from pwruntime.kernels import layer_ops
from pwruntime.kernels.attention import KV_WRITE, decode_variant
from pwruntime.kernels.layer_ops import gated_add, route_topk, row_norms
from pwruntime.kv_cache import KVCache
from pwruntime.model.attention import Attention
from pwruntime.model.attention_plan import AttentionMetadata, group_metadata, layer_plans
from pwruntime.model.config import ModelConfig
from pwruntime.model.experts import ExpertStore
from pwruntime.model.layers import DenseMLP, Linear, RMSNorm, Rotary
from pwruntime.model.tokenizer import Tokenizer


@dataclass(frozen=True)
class LayerRouting:
    """What one MoE layer did to the T tokens of a forward."""
    topk_ids: torch.Tensor          # [T, k] int64
    topk_weights: torch.Tensor      # [T, k] float32, the weights actually applied
    gate_up_in_norm: torch.Tensor   # [T] float32, L2 norm of the routed experts' input row
    down_in_norm: torch.Tensor      # [T, k] float32, L2 norm of the activation fed to each selected down


def routing_layout(top_k: int) -> tuple[tuple[str, int, type], ...]:
    """LayerRouting's fields as `pack_routing` lays them out: (field, 32-bit words a token, its numpy type)."""
    return (("topk_ids", 2 * top_k, np.int64), ("topk_weights", top_k, np.float32), ("gate_up_in_norm", 1, np.float32),
            ("down_in_norm", top_k, np.float32))


def pack_routing(layers: list[LayerRouting]) -> torch.Tensor:
    """A forward's routing as int32 words [T, W], a row a token (the first n rows are the first n tokens'): field by
    field in `routing_layout` order, each field's layers side by side, bits as they are (an int64 id is two words).
    One kernel; a decode graph runs it inside the capture, so a replay's routing leaves in one copy."""
    t, k = layers[0].topk_ids.shape
    return torch.cat([getattr(x, name).to(torch.int64 if dtype is np.int64 else torch.float32).reshape(t, -1)
                      .contiguous().view(torch.int32) for name, _, dtype in routing_layout(k) for x in layers], dim=1)


@dataclass(frozen=True)
class ForwardOutput:
    hidden: torch.Tensor                        # [T, H] final-norm output
    routing: list[LayerRouting] | None = None   # one per MoE layer when record=True
    routing_words: torch.Tensor | None = None   # pack_routing(routing) when the forward made it (decode graphs)
    logits: torch.Tensor | None = None          # logits(hidden) of every row when the forward made them (decode graphs)


def routed_experts(store: ExpertStore, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                   records: list[LayerRouting] | None) -> torch.Tensor:
    """MoE layer `layer`'s routed experts on rows x [T, H] (store.moe), what they did appended to `records` (when
    given)."""
    if records is None:
        return store.moe(layer, x, ids, weights)
    down_norm = torch.empty(ids.shape, dtype=torch.float32, device=x.device)
    out = store.moe(layer, x, ids, weights, down_in_norm=down_norm)
    records.append(LayerRouting(ids, weights, row_norms(x), down_norm))
    return out


class MoEBlock(nn.Module):
    """Softmax top-k router + routed experts (through the store) + optional sigmoid-gated shared expert."""

    def __init__(self, cfg: ModelConfig, moe_index: int, router: torch.Tensor,
                 shared: DenseMLP | None = None, shared_gate: torch.Tensor | None = None):
        super().__init__()
        self.index, self.top_k, self.norm_topk = moe_index, cfg.top_k, cfg.norm_topk_prob
        self.router = Linear(router)
        self.shared = shared
        self.shared_gate = Linear(shared_gate) if shared_gate is not None else None

    def forward(self, x: torch.Tensor, store: ExpertStore, records: list[LayerRouting] | None) -> torch.Tensor:
        weights, ids = route_topk(self.router(x), self.top_k, self.norm_topk)
        out = routed_experts(store, self.index, x, ids, weights, records)
        if self.shared is not None:
            out = gated_add(out, self.shared_gate(x), self.shared(x))
        return out


class SplitDecoderLayer(nn.Module):
    """A decoder layer in three parts, which a mixed step's piecewise graphs run apart (pwruntime.mixed_graphs):
    everything before the attention core (`before_attention`, which a subclass defines), the core (`attn.core`),
    everything after it (`after_attention`, likewise)."""

    def forward(self, x, delta, cos, sin, k_cache, v_cache, plan, store, records, kv_ptrs=None):
        x, q, k, v = self.before_attention(x, delta, cos, sin, k_cache, v_cache, plan.slot_mapping, kv_ptrs)
        return self.after_attention(x, self.attn.core(q, k, v, k_cache, v_cache, plan, kv_ptrs), store, records)


class DecoderLayer(SplitDecoderLayer):
    """The layer of Mixtral, Qwen2-MoE, OLMoE and Qwen3-MoE. The residual stream enters as x + delta (delta None: x
    alone) and leaves the same way, (x, the MLP's output), so that each residual add runs inside the RMSNorm after it
    (one kernel on CUDA)."""

    def __init__(self, attn: Attention, mlp: MoEBlock | DenseMLP, input_norm: RMSNorm, post_norm: RMSNorm):
        super().__init__()
        self.attn, self.mlp, self.input_norm, self.post_norm = attn, mlp, input_norm, post_norm

    def before_attention(self, x, delta, cos, sin, k_cache, v_cache, slots, kv_ptrs=None):
        """(x + delta, q, k, v): the residual add, the norm, the projections and rotary, the new K/V written."""
        x, h = self.input_norm.add(x, delta)
        return (x, *self.attn.project(h, cos, sin, k_cache, v_cache, slots, kv_ptrs))

    def after_attention(self, x, o, store, records):
        """(x + attention output, the MLP's output) from the attention core's output o [n, heads, d]."""
        x, h = self.post_norm.add(x, self.attn.output(o))
        if isinstance(self.mlp, MoEBlock):
            return x, self.mlp(h, store, records)
        return x, self.mlp(h)


class MoEModel(nn.Module):
    def __init__(self, config: ModelConfig, tokenizer: Tokenizer, embed: torch.Tensor,
                 layers: list[DecoderLayer], norm: RMSNorm, lm_head: torch.Tensor, experts: ExpertStore):
        super().__init__()
        self.config, self.tokenizer, self.experts = config, tokenizer, experts
        self.embed = nn.Parameter(embed, requires_grad=False)
        self.layers = nn.ModuleList(layers)
        self.norm = norm
        self.lm_head = nn.Parameter(lm_head, requires_grad=False)
        c = config
        ropes = [Rotary(c.head_dim, c.rope_theta, c.rope_linear_factor, device=embed.device)]
        if c.global_layers:   # Gemma 4's global layers: a rope of their own
            ropes.append(Rotary(c.global_head_dim, c.global_rope_theta, c.global_rope_factor, embed.device,
                                c.global_rope_fraction))
        self.ropes = nn.ModuleList(ropes)
        self.layer_rope = [int(i in c.global_layers) for i in range(c.layers)]   # each layer's index in ropes
        # Gemma 4 scales the embeddings by sqrt(hidden), rounded to the weights' dtype (as transformers does)
        scale = torch.tensor(c.hidden ** 0.5, dtype=embed.dtype, device=embed.device) if c.arch == "gemma4" else None
        self.register_buffer("embed_scale", scale, persistent=False)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.device

    def weight_bytes(self) -> int:
        """Bytes of the model's own tensors: every weight but the routed experts (its expert store holds those),
        a tensor shared by two names (tied embeddings) once."""
        storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in self.parameters()}
        return sum(storages.values())

    def kernel_variants(self) -> set:
        """Every CUDA kernel build (`kernels.compile.Variant`) a forward of this model can launch: the layers' ops, the
        paged-attention decode and K/V write of its dtype and heads, and its expert store's (none off CUDA)."""
        c, dtype = self.config, self.dtype
        if self.device.type != "cuda":
            return set()
        out = set(self._decode_variants()) - {None}   # a layer geometry without a build runs the reference
        if dtype in (torch.float16, torch.bfloat16):
            out |= {layer_ops.variant(dtype), KV_WRITE}
        store_variants = getattr(self.experts, "kernel_variants", None)
        return out | (store_variants(c.top_k) if store_variants is not None else set())

    @property
    def graph_attention(self) -> bool:
        """Whether a decode step's attention can be captured in a CUDA graph: the paged-attention kernel takes every
        layer's heads (else the reference runs, built on the host)."""
        return None not in self._decode_variants()

    def _decode_variants(self) -> list:
        """The paged-attention decode build of each layer geometry (None where the reference runs)."""
        return [decode_variant(self.dtype, d, self.config.heads // h) for h, d in set(self.config.kv_shapes)]

    def new_kv_cache(self, num_blocks: int, block_size: int = 16, scratch: bool = False,
                     growable: bool | None = None, hybrid: bool = False) -> KVCache:
        """An empty paged KV cache for this model (its dtype and device); `scratch` adds the padding block
        CUDA-graph decode batches need, `growable` picks its memory (see KVCache), `hybrid` gives sliding-window
        and global layers KV groups of their own where the model mixes them (`kv_layout`; blocks are then pages)."""
        c = self.config
        layout = self.kv_layout(block_size, hybrid)
        return KVCache(c.layers, num_blocks, block_size, c.kv_heads, c.head_dim, self.dtype, self.device, scratch,
                       growable, layer_shapes=c.kv_shapes, layout=layout)

    def kv_layout(self, block_size: int, hybrid: bool = False) -> KVLayout:
        """The KV groups of this model's layers at its dtype (ModelConfig.kv_layout)."""
        return self.config.kv_layout(block_size, self.dtype.itemsize, hybrid)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv: KVCache,
                meta: AttentionMetadata | Sequence[AttentionMetadata], record: bool = False) -> ForwardOutput:
        """`meta`: the batch's metadata, or one for each KV group of a hybrid `kv` (`layer_plans`)."""
        tokens = group_metadata(meta)[0].num_tokens
        if input_ids.shape[0] != tokens or positions.shape != input_ids.shape:
            raise ValueError(f"{input_ids.shape[0]} input ids and {positions.shape[0]} positions for "
                             f"{tokens} tokens in the metadata")
        dev = self.device
        plans = layer_plans(meta, kv.layout, dev, self.dtype, self.config.attention_reads)
        x, rope = self.embed_tokens(to_device(input_ids, dev), to_device(positions, dev))
        records: list[LayerRouting] | None = [] if record else None
        delta = None
        for i, layer in enumerate(self.layers):
            cos, sin = rope[self.layer_rope[i]]
            x, delta = layer(x, delta, cos, sin, kv.k[i], kv.v[i], plans[i], self.experts, records,
                             kv.layer_ptrs(i))
        return ForwardOutput(self.final_norm(x, delta), records)

    def embed_tokens(self, input_ids: torch.Tensor, positions: torch.Tensor
                     ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """(the tokens' embeddings [T, H], each rope's cos and sin of their positions: layer i takes
        `layer_rope[i]`)."""
        x = F.embedding(input_ids, self.embed)
        if self.embed_scale is not None:
            x = x * self.embed_scale
        return x, [r.cos_sin(positions, self.dtype) for r in self.ropes]

    def final_norm(self, x: torch.Tensor, delta: torch.Tensor | None) -> torch.Tensor:
        """The final RMSNorm of the residual stream x + delta."""
        return self.norm.add(x, delta)[1]

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, H] -> [n, vocab] float32 (soft-capped: cap * tanh(logits / cap), where the model has a cap)."""
        logits = F.linear(hidden, self.lm_head).float()
        cap = self.config.final_logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap
