"""Gemma 4's decoder layer (the MoE text model, google/gemma-4-26B-A4B): its router, its layer, and reading one layer
from a checkpoint. The semantics mirror transformers 5's Gemma4TextDecoderLayer (see pwruntime.model.config).

A layer runs attention between two norms, then a GELU MLP and the routed experts side by side on the same residual
stream, each between norms of its own, and scales its whole output by a per-layer scalar:

    x = x + post_attention_norm(attention(input_norm(x)))
    x = (x + post_feedforward_norm(post_feedforward_norm_1(mlp(pre_feedforward_norm(x)))
                                   + post_feedforward_norm_2(experts(pre_feedforward_norm_2(x), router(x)))))
        * layer_scalar

The router reads the unnormed stream: rms-normalised without a weight, times a learned scale and hidden ** -0.5,
projected to the experts' logits; softmax, top-k, renormalised, each weight times its expert's learned scale.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pwruntime.model.attention import Attention, read_attention
from pwruntime.model.config import ModelConfig
from pwruntime.model.experts import ExpertStore
from pwruntime.model.layers import DenseMLP, FloatRMSNorm
from pwruntime.model.moe_model import LayerRouting, SplitDecoderLayer, routed_experts

NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm",
         "pre_feedforward_layernorm_2", "post_feedforward_layernorm_1", "post_feedforward_layernorm_2")


class Gemma4Router(nn.Module):
    """The scaled router: (weights float32 [T, k], ids int64 [T, k]) of rows x [T, H]."""

    def __init__(self, proj: torch.Tensor, scale: torch.Tensor, per_expert_scale: torch.Tensor, top_k: int,
                 eps: float):
        super().__init__()
        self.proj = nn.Parameter(proj, requires_grad=False)
        self.scale = nn.Parameter(scale, requires_grad=False)
        self.per_expert_scale = nn.Parameter(per_expert_scale, requires_grad=False)
        self.norm, self.top_k = FloatRMSNorm(None, eps), top_k

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.norm(x) * self.scale * x.shape[-1] ** -0.5
        probs = torch.softmax(F.linear(h, self.proj), dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * self.per_expert_scale[ids], ids


class Gemma4DecoderLayer(SplitDecoderLayer):
    """One Gemma 4 decoder layer (module docstring), with DecoderLayer's call and parts: the stream enters as x + delta
    and leaves as (its new value, None), the layer scalar leaving nothing to fuse into the next norm."""

    def __init__(self, attn: Attention, mlp: DenseMLP, router: Gemma4Router, norms: dict[str, FloatRMSNorm],
                 layer_scalar: torch.Tensor, moe_index: int):
        super().__init__()
        self.attn, self.mlp, self.router, self.index = attn, mlp, router, moe_index
        self.norms = nn.ModuleDict(norms)
        self.layer_scalar = nn.Parameter(layer_scalar, requires_grad=False)

    def before_attention(self, x, delta, cos, sin, k_cache, v_cache, slots, kv_ptrs=None):
        """(x + delta, q, k, v): the input norm, the projections and rotary, the new K/V written."""
        x = x if delta is None else x + delta
        return (x, *self.attn.project(self.norms["input_layernorm"](x), cos, sin, k_cache, v_cache, slots, kv_ptrs))

    def after_attention(self, x, o, store: ExpertStore, records: list[LayerRouting] | None):
        """(the layer's output, None) from the attention core's output o [n, heads, d]."""
        n = self.norms
        x = x + n["post_attention_layernorm"](self.attn.output(o))
        dense = n["post_feedforward_layernorm_1"](self.mlp(n["pre_feedforward_layernorm"](x)))
        weights, ids = self.router(x)
        moe = routed_experts(store, self.index, n["pre_feedforward_layernorm_2"](x), ids, weights, records)
        x = x + n["post_feedforward_layernorm"](dense + n["post_feedforward_layernorm_2"](moe))
        return x * self.layer_scalar, None


def read_gemma4_layer(r, c: ModelConfig, i: int, with_experts: bool
                      ) -> tuple[Gemma4DecoderLayer, torch.Tensor | None, torch.Tensor | None]:
    """(decoder layer i, its experts' gate_up [E, 2I, H] and down [E, H, I], or None twice without `with_experts`)
    from a TensorReader `r`."""
    p = f"{c.weight_prefix}layers.{i}."
    inter, h = c.dense_intermediate, c.hidden
    mlp = DenseMLP(r.get(p + "mlp.gate_proj.weight", (inter, h)), r.get(p + "mlp.up_proj.weight", (inter, h)),
                   r.get(p + "mlp.down_proj.weight", (h, inter)), act=c.hidden_act)
    router = Gemma4Router(r.get(p + "router.proj.weight", (c.experts, h)), r.get(p + "router.scale", (h,)),
                          r.get(p + "router.per_expert_scale", (c.experts,)), c.top_k, c.rms_eps)
    norms = {name: FloatRMSNorm(r.get(p + name + ".weight", (h,)), c.rms_eps) for name in NORMS}
    layer = Gemma4DecoderLayer(read_attention(r, c, i), mlp, router, norms, r.get(p + "layer_scalar", (1,)),
                               c.moe_layers.index(i))
    if not with_experts:
        return layer, None, None
    e, ei = c.experts, c.expert_intermediate
    return (layer, r.get(p + "experts.gate_up_proj", (e, 2 * ei, h)), r.get(p + "experts.down_proj", (e, h, ei)))
