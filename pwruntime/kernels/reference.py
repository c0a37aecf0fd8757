"""Pure-torch references of the CUDA kernels: what each kernel computes, used on CPU and in tests.

The references follow the kernels' numerics where the kernels round: weights are the LUT values
in the activation dtype (fp16 centroids, rounded to bf16 for bf16 activations), products are
accumulated in fp32 (one token at 3 or 4 bits: activations as int16 per 512-column chunk, exact integer
sums, `ap_linear_one_token_int16_ref`), the fused MoE stores the intermediate `silu(gate) * up` in the activation
dtype (it travels between the two launches), sums the per-slot outputs of a token in slot order,
and rounds the result to the activation dtype.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from pwruntime.quant.pack import dequantize


def dequantize_resident(rb, in_features: int, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """W_q [out, in] of a `device_table.ResidentBlock` at its committed bits, in `dtype`."""
    return dequantize(rb.stacked(), rb.lut, rb.out_features, in_features).to(dtype)


def ap_linear_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """y = x W^T with fp32 accumulation, rounded to x's dtype."""
    return (x.float() @ w.to(x.dtype).float().T).to(x.dtype)


B1_CHUNK = 512     # columns per activation scale in the one-token 3- and 4-bit decode (cuda/ap_b1.cuh)
B1_QMAX = 32767.0  # the largest |X| of a chunk


def int16_chunks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What the one-token 3- and 4-bit decode stages of x [K]: X (integer-valued float64 [K], |X| <= 32767) and the fp32 scale
    of each 512-column chunk, x ~ X * scale[k // 512]. As the kernel: scale = max|x| / 32767, X = x * (32767 / max|x|)
    rounded once to the nearest integer (ties to even); a chunk of zeros has scale 0."""
    xf = x.float().reshape(-1)
    k = xf.numel()
    n = -(-k // B1_CHUNK)
    chunks = torch.zeros(n * B1_CHUNK, dtype=torch.float32, device=x.device)
    chunks[:k] = xf
    chunks = chunks.view(n, B1_CHUNK)
    peak = chunks.abs().amax(dim=1)
    inv = torch.where(peak > 0, torch.full_like(peak, B1_QMAX) / peak, torch.zeros_like(peak))
    big = torch.round(chunks.double() * inv.double()[:, None])
    return big.reshape(-1)[:k], peak / B1_QMAX


def ap_linear_one_token_int16_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """What ap_linear (and each fused-MoE launch) computes for one token of a 3- or 4-bit block on CUDA: the weights (LUT
    values in x's dtype) times the int16 chunks of `int16_chunks`, each chunk's sum scaled by its scale, rounded to
    x's dtype. x [1, K], w [out, K]; returns [1, out]."""
    big, scale = int16_chunks(x[0])
    wd = w.to(x.dtype).double()
    y = torch.zeros(w.shape[0], dtype=torch.float64, device=x.device)
    for c in range(scale.numel()):
        cols = slice(c * B1_CHUNK, min((c + 1) * B1_CHUNK, x.shape[1]))
        y += float(scale[c]) * (wd[:, cols] @ big[cols])
    return y.to(x.dtype)[None]


# an expert's (or a dense MLP's) gate activation, by the name ModelConfig.hidden_act gives it
ACTIVATIONS = {"silu": F.silu, "gelu_tanh": lambda h: F.gelu(h, approximate="tanh")}


def gated(h: torch.Tensor, act: str = "silu") -> torch.Tensor:
    """act(gate) * up of h = [gate | up] [..., 2I] -> [..., I]."""
    inter = h.shape[-1] // 2
    return ACTIVATIONS[act](h[..., :inter]) * h[..., inter:]


def fused_moe_ref(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                  gate_up: Callable[[int], torch.Tensor], down: Callable[[int], torch.Tensor],
                  act: str = "silu") -> torch.Tensor:
    """out[t] = sum_j w[t, j] * down_e(act(gate_e x_t) * up_e x_t), e = topk_ids[t, j] (act: a key of ACTIVATIONS).

    gate_up(e) -> [2I, H] (gate rows first), down(e) -> [H, I]; weights are used in x's dtype.
    Experts are processed grouped (each expert's weights dequantized once), as the kernel does.
    """
    n_tok, k = topk_ids.shape
    hidden = x.shape[1]
    per_slot = torch.zeros(n_tok, k, hidden, dtype=torch.float32, device=x.device)
    ids = topk_ids.to(torch.int64)
    for e in torch.unique(ids).tolist():
        tok, slot = torch.nonzero(ids == e, as_tuple=True)
        wgu = gate_up(e).to(x.dtype).float()
        h = x[tok].float() @ wgu.T
        a = gated(h, act).to(x.dtype).float()
        y = a @ down(e).to(x.dtype).float().T
        per_slot[tok, slot] = y * topk_weights[tok, slot].float()[:, None]
    out = per_slot[:, 0]
    for j in range(1, k):  # slot order, like the kernel's reduction
        out = out + per_slot[:, j]
    return out.to(x.dtype)


def paged_attention_decode_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, context_lens: torch.Tensor,
                               scale: float, window: int | None = None) -> torch.Tensor:
    """Attention of one query token per sequence over its cached tokens, gathered through the block table.

    q [S, Hq, D]; caches [num_blocks, block_size, Hkv, D]; block_tables [S, max_blocks] (padded with -1);
    context_lens [S] tokens to attend to. Query head h reads KV head h // (Hq // Hkv). Returns [S, Hq, D].
    With a sliding `window` the query (the last of n tokens) sees only the last `window` of them: positions
    n - window .. n - 1, as a key at position p is seen from query position i when p > i - window.
    """
    n_seq, heads, dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = heads // kv_heads
    out = torch.zeros(n_seq, heads, dim, dtype=q.dtype, device=q.device)
    lens = [int(v) for v in context_lens.tolist()]
    for s in range(n_seq):
        n = lens[s]
        if n == 0:
            continue
        lo = max(0, n - window) if window else 0
        blocks = block_tables[s, :-(-n // block_size)].to(torch.int64)
        kk = k_cache[blocks].reshape(-1, kv_heads, dim)[lo:n].float().repeat_interleave(group, dim=1)
        vv = v_cache[blocks].reshape(-1, kv_heads, dim)[lo:n].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[s].float(), kk) * scale
        p = torch.softmax(scores, dim=-1)
        out[s] = torch.einsum("hn,nhd->hd", p, vv).to(q.dtype)
    return out


def load_pattern_ref(planes) -> int:
    """What cuda/load_pattern.cu leaves in its (zeroed) output word: the XOR of every 32-bit word of the planes."""
    acc = torch.cat([p.reshape(-1).view(torch.int32) for p in planes])
    while acc.numel() > 1:
        if acc.numel() % 2:
            acc = torch.cat([acc, acc.new_zeros(1)])
        acc = acc[0::2] ^ acc[1::2]
    return int(acc.item()) & 0xFFFFFFFF


# ------------------------------------------------ the decoder layer's small ops (cuda/layer_ops.cu)
def add_rms_norm_ref(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor | None,
                     eps: float, float_weight: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, weight * rms_norm(s)) with s = x + delta (x when delta is None): the norm in float32, cast back before the
    weight (as transformers does); with `float_weight` (Gemma 4's RMSNorm) the weight, if any, multiplies in float32
    and the product is cast back."""
    s = x if delta is None else x + delta
    if float_weight:
        w = None if weight is None else weight.float()
        return s, F.rms_norm(s.float(), (s.shape[-1],), weight=w, eps=eps).to(s.dtype)
    return s, weight * F.rms_norm(s.float(), (s.shape[-1],), eps=eps).to(s.dtype)


def rotary_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, rotate-half convention: x [T, heads, dim], cos and sin [T, 1, dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def route_topk_ref(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The router: softmax over the experts in float32, the top_k (descending), optionally renormalized over them.
    logits [T, E] -> (weights float32 [T, k], ids int64 [T, k])."""
    weights, ids = torch.topk(torch.softmax(logits.float(), dim=-1), top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def row_norms_ref(x: torch.Tensor) -> torch.Tensor:
    """The L2 norm of each row in float32: [..., C] -> [...]."""
    return x.float().norm(dim=-1)


def slot_combine_ref(rows: torch.Tensor, weights: torch.Tensor, where: torch.Tensor | None = None) -> torch.Tensor:
    """sum_j weights[t, j] * rows[s] over token t's slots s = t * k + j (rows [T * k, H] in slot order, or with
    `where` the row of each slot: rows[where[s]]), weights [T, k] -> [T, H] in the rows' dtype, accumulated in
    float32 slot by slot (no float32 copy of the rows)."""
    tokens, k = weights.shape
    by_slot = (rows if where is None else rows[where]).view(tokens, k, -1)
    w = weights.float()
    out = torch.zeros(tokens, by_slot.shape[2], dtype=torch.float32, device=rows.device)
    for j in range(k):
        out.addcmul_(by_slot[:, j], w[:, j, None])
    return out.to(rows.dtype)


def move_rows_ref(src: torch.Tensor, dst: torch.Tensor, src_index: torch.Tensor | None = None,
                  dst_index: torch.Tensor | None = None, count: torch.Tensor | None = None) -> torch.Tensor:
    """dst[dst_index[p]] = src[src_index[p]] for the moves p below `count` (layer_ops.move_rows's reference; an index
    None is the identity, the moves as many as src_index has values, else src rows); returns dst."""
    moves = src.shape[0] if src_index is None else src_index.shape[0]
    if count is not None:
        moves = min(moves, int(count))
    rows = src[:moves] if src_index is None else src[src_index[:moves]]
    if dst_index is None:
        dst[:moves] = rows
    else:
        dst.index_copy_(0, dst_index[:moves], rows)
    return dst


def act_mul_ref(h: torch.Tensor, act: str = "silu") -> torch.Tensor:
    """act(gate) * up of h = [gate | up] [..., 2I] -> [..., I] (layer_ops.act_mul's reference)."""
    return gated(h, act)


def gated_add_ref(out: torch.Tensor, gate: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
    """out + sigmoid(gate) * shared (Qwen2-MoE's shared expert): out, shared [T, H], gate [T, 1]."""
    return out + torch.sigmoid(gate) * shared
