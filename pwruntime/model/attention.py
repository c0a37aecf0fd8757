"""Paged attention's computation: the pure-torch reference, `paged_attention` (the decode kernel, flash chunks and
the reference, as a step's plan says: pwruntime.model.attention_plan) and the attention module.

The reference gathers K/V through the block tables, a cache block at a time and vectorised over sequences, and runs
scaled_dot_product_attention over them in fp32 with the group's mask. A chunk with no cached context (plain prefill)
uses torch's scaled_dot_product_attention on its own K/V, which is the same math, and so does a chunk after its cached
context (no sliding window): its keys gathered from the cache in one index each, the causal mask aligned to the bottom
right. The group reference is the CPU path of the decode rows and the reference a CUDA paged-attention kernel must
match.

On CUDA in fp16/bf16 the decode sequences run `kernels.attention.paged_attention_decode`: a pure-decode batch entirely,
so the forward can be captured in a CUDA graph, and the decode rows of a mixed batch beside the chunks; the kernel
keeps a sliding-window layer's last `window` tokens itself. Where a layer's heads have no kernel build
(`decode_variant`) the reference serves them, which cannot happen inside a graph (`MoEModel.graph_attention` gates the
graphs). Every multi-token chunk runs in one variable-length flash-attention call per layer (`VarlenChunks`, causal
aligned to the bottom right, a sliding window as flash attention's left window) instead of one SDPA call and its
reshapes per chunk: a mixed step's attention is eager host work between its piecewise graphs, and this is most of it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from pwruntime.kernels.attention import decode_variant, paged_attention_decode
from pwruntime.kernels.layer_ops import rotary_kv
from pwruntime.model.attention_plan import AttentionPlan, GatherGroup, PrefillGroup, VarlenChunks
from pwruntime.model.config import ModelConfig
from pwruntime.model.layers import FloatRMSNorm, Linear, RMSNorm


def _gathered_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, g: GatherGroup,
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
        if isinstance(g, PrefillGroup):
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
