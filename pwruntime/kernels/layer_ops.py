"""The decoder layer's small operations: fused CUDA kernels (cuda/layer_ops.cu) for fp16/bf16 on a GPU, their pure-torch
references (pwruntime.kernels.reference) everywhere else.

Each function is one launch on CUDA where torch runs several: the residual add with the RMSNorm after it, rotary
embedding of q and k with the K/V cache write, the router's softmax and top-k (and renormalization), the rows' L2 norms
of the routing records, an activation (SiLU or tanh GELU) and multiply, Qwen2-MoE's sigmoid-gated shared-expert add,
the MoE dispatch's weighted sum of each token's expert outputs, and its moves of rows (a gather, a scatter). The
kernels round to the activation dtype wherever the references' torch ops do, so the two paths differ only in the order
of float32 sums.

A `count` (an int64 tensor of one value, on the device) bounds the rows a kernel works on without the host reading it:
the MoE dispatch's chunks of experts (`grouped_mm_moe`) know how many rows a chunk has only on the device. Rows from
the count on are left as they are (unwritten, in a new output); the references compute every row.
"""
from __future__ import annotations

import torch

from pwruntime.kernels import compile as kc
from pwruntime.kernels.attention import write_kv
from pwruntime.kernels.reference import (add_rms_norm_ref, gated_add_ref, move_rows_ref, rotary_ref, route_topk_ref,
                                         row_norms_ref, act_mul_ref, slot_combine_ref)

ROUTE_MAX_EXPERTS = 256     # 32 lanes x PW_ROUTE_PER_LANE in cuda/layer_ops.cu
_DTYPES = (torch.float16, torch.bfloat16)
_ELEMENTWISE_THREADS = 256


def _applies(*tensors: torch.Tensor) -> bool:
    """Whether the kernels serve these tensors: all on CUDA, all in one 16-bit float dtype."""
    first = tensors[0]
    return first.is_cuda and first.dtype in _DTYPES and all(t.is_cuda and t.dtype == first.dtype for t in tensors)


def variant(dtype: torch.dtype) -> kc.Variant:
    """The cuda/layer_ops.cu build for activations of `dtype`."""
    return "layer_ops.cu", (("PW_BF16", int(dtype == torch.bfloat16)),)


def _kernel(t: torch.Tensor, func: str):
    name, defines = variant(t.dtype)
    return kc.get_kernel(t.device, name, func, defines)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t as [rows, cols] with the last dimension contiguous: a view where one exists, else a copy."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 or t2.shape[-1] == 1 else t2.contiguous()


def _count_ptr(count: torch.Tensor | None, device: torch.device):
    """The device pointer of a row bound (null for none); raises ValueError for one not an int64 value on `device`."""
    if count is None:
        return kc.ptr(None)
    if count.dtype != torch.int64 or count.numel() != 1 or count.device != device:
        raise ValueError(f"count must be one int64 value on {device}, got {count.dtype} {list(count.shape)} on "
                         f"{count.device}")
    return kc.ptr(count)


def _elementwise_grid(total: int) -> tuple[int]:
    """CTAs of a grid-stride elementwise kernel: one per 256 elements, at most 1024 (under 8 an SM on the H200)."""
    return (max(1, min(-(-total // _ELEMENTWISE_THREADS), 1024)),)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor | None,
                 eps: float, float_weight: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, weight * rms_norm(s)) with s = x + delta (s = x when delta is None): the residual add fused into the norm.
    `float_weight`: Gemma 4's order, the weight (None: none) multiplied in float32 before the cast back."""
    if weight is None and not float_weight:
        raise ValueError("an RMSNorm without a weight is Gemma 4's: pass float_weight=True")
    operands = (x,) + (() if weight is None else (weight,)) + (() if delta is None else (delta,))
    if not _applies(*operands):
        return add_rms_norm_ref(x, delta, weight, eps, float_weight)
    if delta is not None and delta.shape != x.shape:
        raise ValueError(f"residual add of {tuple(delta.shape)} to {tuple(x.shape)}")
    cols = x.shape[-1]
    if weight is not None and weight.shape != (cols,):
        raise ValueError(f"RMSNorm weight {tuple(weight.shape)} for rows of {cols}")
    x2 = _rows(x)
    d2 = None if delta is None else _rows(delta)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    s = x if delta is None else torch.empty_like(out)
    if x2.shape[0]:
        threads = min(256, 32 * -(-cols // 32))
        kc.launch(_kernel(x, "pw_add_rms_norm"), x.device, (x2.shape[0],), (threads,), (
            kc.ptr(x2), kc.i64(x2.stride(0)), kc.ptr(d2), kc.i64(0 if d2 is None else d2.stride(0)),
            kc.ptr(None if delta is None else s), kc.ptr(None if weight is None else weight.contiguous()), kc.ptr(out),
            kc.i32(cols), kc.f32(eps), kc.i32(int(float_weight))))
    return s, out


def rotary_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              k_cache: torch.Tensor | None = None, v_cache: torch.Tensor | None = None,
              slots: torch.Tensor | None = None,
              kv_ptrs: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, heads, dim] and k [T, kv_heads, dim] rotated (cos, sin [T, 1, dim]); given the caches and `slots`, the
    rotated k and v [T, kv_heads, dim] are also written to the caches' rows `slots` (kernels.attention.write_kv),
    in the same launch when `kv_ptrs` (KVCache.layer_ptrs) is given. Returns contiguous (q, k)."""
    tokens, heads, dim = q.shape
    kv_heads = k.shape[1]
    fused = (_applies(q, k, v, cos, sin) and dim % 2 == 0 and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
             and cos.shape == sin.shape == (tokens, 1, dim) and cos.is_contiguous() and sin.is_contiguous())
    if not fused:
        q_rot, k_rot = rotary_ref(q, cos, sin), rotary_ref(k, cos, sin)
        if slots is not None:
            write_kv(k_rot, v, k_cache, v_cache, slots, kv_ptrs)
        return q_rot, k_rot
    through_table = slots is not None and kv_ptrs is not None and k_cache.dtype == v_cache.dtype == q.dtype
    if through_table:
        slots = slots.to(device=q.device, dtype=torch.int64).contiguous()   # the kernel reads int64 slots
    q_rot = torch.empty(tokens, heads, dim, dtype=q.dtype, device=q.device)
    k_rot = torch.empty(tokens, kv_heads, dim, dtype=q.dtype, device=q.device)
    if tokens:
        kc.launch(_kernel(q, "pw_rotary_kv"), q.device, (tokens,), (128,), (
            kc.ptr(q), kc.i64(q.stride(0)), kc.i64(q.stride(1)), kc.ptr(k), kc.i64(k.stride(0)), kc.i64(k.stride(1)),
            kc.ptr(v), kc.i64(v.stride(0)), kc.i64(v.stride(1)), kc.ptr(cos), kc.ptr(sin), kc.i32(heads),
            kc.i32(kv_heads), kc.i32(dim), kc.ptr(q_rot), kc.ptr(k_rot), kc.ptr(slots if through_table else None),
            kc.ptr(kv_ptrs if through_table else None)))
    if slots is not None and not through_table:
        write_kv(k_rot, v, k_cache, v_cache, slots, kv_ptrs)
    return q_rot, k_rot


def route_topk(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The router on logits [T, E]: softmax in float32, the top_k descending (weights float32 [T, k], ids int64
    [T, k]), renormalized over the k when `renormalize`."""
    tokens, experts = logits.shape
    if not 1 <= top_k <= experts:
        raise ValueError(f"top_k must be in 1..{experts} (the experts), got {top_k}")
    if not _applies(logits) or experts > ROUTE_MAX_EXPERTS or logits.stride(-1) != 1:
        return route_topk_ref(logits, top_k, renormalize)
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(tokens, top_k, dtype=torch.int64, device=logits.device)
    if tokens:
        kc.launch(_kernel(logits, "pw_route_topk"), logits.device, (-(-tokens // 4),), (128,), (
            kc.ptr(logits), kc.i64(logits.stride(0)), kc.i32(tokens), kc.i32(experts), kc.i32(top_k),
            kc.i32(int(renormalize)), kc.ptr(weights), kc.ptr(ids)))
    return weights, ids


def row_norms(x: torch.Tensor, out: torch.Tensor | None = None, count: torch.Tensor | None = None,
              out_index: torch.Tensor | None = None) -> torch.Tensor:
    """The float32 L2 norm of each row of x [..., C]: shape x.shape[:-1], or written into `out` (float32, contiguous:
    one value a row, or with `out_index`, int64 [rows], row r's norm at out.view(-1)[out_index[r]]) and returned;
    with `count` only the rows below it (the references compute every row, but write those only where an index
    places them)."""
    rows = x[..., 0].numel()
    if out is not None and (out.dtype != torch.float32 or not out.is_contiguous()
                            or (out_index is None and out.numel() != rows)):
        raise ValueError(f"out must be a contiguous float32 tensor of {rows} values")
    if out_index is not None and (out is None or out_index.dtype != torch.int64 or out_index.shape != (rows,)):
        raise ValueError(f"out_index needs an out, and must be int64 [{rows}]")
    if not _applies(x) or (out is not None and not out.is_cuda):
        norms = row_norms_ref(x)
        if out_index is None:
            return norms if out is None else out.copy_(norms.view(out.shape))
        move_rows_ref(norms.reshape(-1, 1), out.view(-1, 1), dst_index=out_index, count=count)   # the bounded scatter
        return out
    x2 = _rows(x)
    res = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device) if out is None else out
    if x2.shape[0]:
        kc.launch(_kernel(x, "pw_row_norms"), x.device, (-(-x2.shape[0] // 4),), (128,), (
            kc.ptr(x2), kc.i64(x2.stride(0)), kc.i32(x2.shape[0]), kc.i32(x2.shape[1]), _count_ptr(count, x.device),
            kc.ptr(None if out_index is None else out_index.contiguous()), kc.ptr(res)))
    return res


ACT_MUL = ("silu", "gelu_tanh")   # the activations pw_act_mul computes (keys of reference.ACTIVATIONS)


def act_mul(h: torch.Tensor, act: str = "silu", count: torch.Tensor | None = None) -> torch.Tensor:
    """act(gate) * up of h = [gate | up] [..., 2I] (the gate_up GEMM's output) -> [..., I]; act SiLU or tanh GELU;
    with `count` only the rows below it on a GPU."""
    if not _applies(h) or h.shape[-1] % 2 or act not in ACT_MUL:
        return act_mul_ref(h, act)
    inter = h.shape[-1] // 2
    h2 = _rows(h)
    out = torch.empty(*h.shape[:-1], inter, dtype=h.dtype, device=h.device)
    total = out.numel()
    if total:
        kc.launch(_kernel(h, "pw_act_mul"), h.device, _elementwise_grid(total), (_ELEMENTWISE_THREADS,), (
            kc.ptr(h2), kc.i64(h2.stride(0)), kc.i32(inter), kc.i64(total), kc.i32(int(act == "gelu_tanh")),
            _count_ptr(count, h.device), kc.ptr(out)))
    return out


def gated_add(out: torch.Tensor, gate: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
    """out + sigmoid(gate) * shared: out, shared [T, H], gate [T, 1] (Qwen2-MoE's shared expert)."""
    if not _applies(out, gate, shared) or gate.shape != (out.shape[0], 1) or shared.shape != out.shape:
        return gated_add_ref(out, gate, shared)
    out, shared = out.contiguous(), shared.contiguous()
    res = torch.empty_like(out)
    total = out.numel()
    if total:
        kc.launch(_kernel(out, "pw_gated_add"), out.device, _elementwise_grid(total),
                  (_ELEMENTWISE_THREADS,), (kc.ptr(out), kc.ptr(gate), kc.i64(gate.stride(0)), kc.ptr(shared),
                                            kc.i32(out.shape[-1]), kc.i64(total), kc.ptr(res)))
    return res


def slot_combine(rows: torch.Tensor, weights: torch.Tensor, where: torch.Tensor | None = None) -> torch.Tensor:
    """sum_j weights[t, j] * rows[s] over token t's slots s = t * k + j: rows [T * k, H] (expert outputs in slot
    order) or, with `where` (int64 [T * k], the row of each slot), rows [N, H] in any order, each slot's read at
    where[s]; weights [T, k] (float32 routing weights) -> [T, H] in the rows' dtype, summed in float32, each
    token's rows read once (the reference makes k float32 passes over the output)."""
    tokens, k = weights.shape
    if where is None and rows.shape[0] != tokens * k:
        raise ValueError(f"{rows.shape[0]} rows for {tokens} tokens of {k} slots")
    if where is not None and (where.dtype != torch.int64 or where.shape != (tokens * k,)):
        raise ValueError(f"where must be int64 [{tokens * k}] (a row per slot), got {where.dtype} {list(where.shape)}")
    cols = rows.shape[-1]
    if not (_applies(rows) and weights.is_cuda and rows.is_contiguous() and cols % 8 == 0
            and rows.data_ptr() % 16 == 0):
        return slot_combine_ref(rows, weights, where)
    w = weights.to(torch.float32).contiguous()
    out = torch.empty(tokens, cols, dtype=rows.dtype, device=rows.device)
    if tokens and cols:
        threads = min(128, 32 * -(-cols // 256))
        kc.launch(_kernel(rows, "pw_slot_combine"), rows.device, (tokens, -(-cols // (8 * threads))), (threads,),
                  (kc.ptr(rows), kc.ptr(w), kc.ptr(None if where is None else where.contiguous()), kc.i32(k),
                   kc.i32(cols), kc.ptr(out)))
    return out


def move_rows(src: torch.Tensor, dst: torch.Tensor, src_index: torch.Tensor | None = None,
              dst_index: torch.Tensor | None = None, count: torch.Tensor | None = None) -> torch.Tensor:
    """dst[dst_index[p]] = src[src_index[p]] for each move p (an index None: the identity), as many moves as
    src_index has values (else src has rows), only those below `count` where it is given; returns dst. src [N, C]
    and dst [M, C] in one dtype, not overlapping; the indices int64, dst_index without repeats."""
    moves = src.shape[0] if src_index is None else src_index.shape[0]
    for name, index in (("src_index", src_index), ("dst_index", dst_index)):
        if index is not None and (index.dtype != torch.int64 or index.dim() != 1 or index.shape[0] < moves):
            raise ValueError(f"{name} must be int64 [{moves}] or longer, got {index.dtype} {list(index.shape)}")
    cols = src.shape[-1]
    if not (_applies(src, dst) and src.is_contiguous() and dst.is_contiguous() and dst.shape[-1] == cols
            and cols % 8 == 0 and src.data_ptr() % 16 == 0 and dst.data_ptr() % 16 == 0):
        return move_rows_ref(src, dst, src_index, dst_index, count)
    if moves and cols:
        threads = min(128, 32 * -(-cols // 256))
        kc.launch(_kernel(src, "pw_move_rows"), src.device, (moves, -(-cols // (8 * threads))), (threads,),
                  (kc.ptr(src), kc.ptr(None if src_index is None else src_index.contiguous()), kc.ptr(dst),
                   kc.ptr(None if dst_index is None else dst_index.contiguous()), _count_ptr(count, src.device),
                   kc.i32(cols)))
    return dst
