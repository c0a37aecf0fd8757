"""Paged-attention decode over the KV block table (GQA): CUDA kernel, pure-torch reference elsewhere."""
from __future__ import annotations

import math

import torch

from pwruntime.kernels import compile as kc
from pwruntime.kernels.reference import paged_attention_decode_ref

THREADS = 128
_DT = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}


def paged_attention_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor,
                           scale: float | None = None) -> torch.Tensor:
    """One query token per sequence: q [S, Hq, D] over caches [num_blocks, block_size, Hkv, D] -> [S, Hq, D].

    block_tables [S, max_blocks] int32 (padding -1 is never read), context_lens [S] int32 = tokens each
    query attends to (its own K/V already in the cache). scale defaults to 1/sqrt(D).
    """
    n_seq, heads, dim = q.shape
    kv_heads = k_cache.shape[2]
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads are not a multiple of {kv_heads} KV heads")
    scale = 1.0 / math.sqrt(dim) if scale is None else float(scale)
    usable = (q.is_cuda and q.dtype in _DT and dim % 32 == 0 and 32 <= dim <= 256 and k_cache.is_contiguous()
              and v_cache.is_contiguous() and k_cache.dtype == v_cache.dtype == q.dtype)
    if not usable:
        return paged_attention_decode_ref(q, k_cache, v_cache, block_tables, context_lens, scale)
    dev = q.device
    q = q.contiguous()
    bt = block_tables.to(device=dev, dtype=torch.int32).contiguous()
    cl = context_lens.to(device=dev, dtype=torch.int32).contiguous()
    out = torch.empty_like(q)
    k = kc.get_kernel(dev, "paged_attention.cu", "pw_paged_attention_decode",
                      (("PW_DT", _DT[q.dtype]), ("PW_DPL", dim // 32)))
    kc.launch(k, dev, (n_seq, heads), (THREADS,), (
        kc.ptr(q), kc.i64(heads * dim), kc.ptr(k_cache), kc.ptr(v_cache), kc.ptr(bt), kc.i32(bt.shape[1]),
        kc.ptr(cl), kc.i32(heads), kc.i32(kv_heads), kc.i32(k_cache.shape[1]), kc.f32(scale), kc.ptr(out),
        kc.i64(heads * dim)))
    return out
