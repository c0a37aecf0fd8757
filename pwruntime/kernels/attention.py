"""Paged-attention decode over the KV block table (GQA): CUDA kernels, pure-torch reference elsewhere.

fp16/bf16 caches with head_dim 64, 128, 256 or 512 use cuda/paged_attention_gqa.cu: a CTA serves up to
GQA_HEADS_PER_CTA query heads of one KV head, so each K/V row is read once per KV head (per slice of a
larger group), and long contexts over few sequences are split into parts and merged. Other CUDA caches
(fp32, other head sizes) use the generic cuda/paged_attention.cu.

Given `kv_ptrs` (the layer's row of KVCache.ptrs), the kernels read the caches' addresses from the device at run time,
and `write_kv` writes the new tokens' K/V the same way (cuda/kv_write.cu), so a captured decode graph stays valid
when the cache is resized.
"""
from __future__ import annotations

import math

import torch

from pwruntime.kernels import compile as kc
from pwruntime.kernels.reference import paged_attention_decode_ref

THREADS = 128                    # the generic kernel (cuda/paged_attention.cu)
GQA_WARPS = 8                    # cuda/paged_attention_gqa.cu (WARPS there)
GQA_THREADS = 32 * GQA_WARPS
GQA_MERGE_BYTES = 32768          # its shared merge buffer: fp32 [warps][heads a CTA][head_dim] (static_assert there)
GQA_DIMS = (64, 128, 256, 512)
GENERIC_MAX_DIM = 512            # the generic kernel's widest heads (16 elements a lane)
GQA_HEADS_PER_CTA = 4            # query heads a GQA-kernel CTA keeps in registers (larger groups are sliced)
PART_MIN_TOKENS = 256            # a context part of the split (flash-decoding) path is at least this long
_DT = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}


def gqa_kernel_applies(dtype: torch.dtype, dim: int) -> bool:
    """Whether the GQA kernel serves this cache (else the generic kernel does)."""
    return dtype in (torch.float16, torch.bfloat16) and dim in GQA_DIMS


def heads_per_cta(group: int, dim: int) -> int:
    """The largest divisor of the GQA group that fits a CTA's registers and its 32 KiB merge buffer."""
    cap = min(GQA_HEADS_PER_CTA, GQA_MERGE_BYTES // (GQA_WARPS * dim * 4))
    return max(g for g in range(1, cap + 1) if group % g == 0)


def decode_variant(dtype: torch.dtype, dim: int, group: int, generic: bool = False) -> kc.Variant | None:
    """The build `paged_attention_decode` runs on CUDA over a `dtype` cache of `dim`-wide heads with `group` query heads
    a KV head: the GQA kernel where it applies, else the generic one (fp32 caches, head sizes the GQA kernel has no
    lane split for); None where the reference runs (a dtype other than fp16, bf16 and fp32, or dim not a multiple of
    32 in 32..512)."""
    if dtype not in _DT or dim % 32 or not 32 <= dim <= GENERIC_MAX_DIM:
        return None
    if gqa_kernel_applies(dtype, dim) and not generic:
        return "paged_attention_gqa.cu", (("PW_DT", _DT[dtype]), ("PW_D", dim), ("PW_G", heads_per_cta(group, dim)))
    return "paged_attention.cu", (("PW_DT", _DT[dtype]), ("PW_DPL", dim // 32))


KV_WRITE: kc.Variant = ("kv_write.cu", ())  # write_kv's kernel


def context_parts(ctas: int, max_tokens: int, num_sms: int) -> int:
    """Parts to cut each context into so that `ctas` (sequence, head-slice) CTAs still fill the GPU (1 = no split).

    Decided from shapes only (the block-table width bounds every context), so a captured CUDA graph
    keeps its launch configuration whatever the sequence lengths are at replay.
    """
    if ctas >= num_sms:
        return 1
    return max(1, min(-(-2 * num_sms // ctas), max_tokens // PART_MIN_TOKENS))


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
             kv_ptrs: torch.Tensor | None = None) -> None:
    """k, v [T, Hkv, D] into the caches' rows `slots` [T] int64 (block * block_size + offset).

    With `kv_ptrs` on CUDA and 16-bit caches the kernel writes through the pointer table (the caches' tensors are
    then only read for their shape); elsewhere torch's index_copy_, the reference."""
    heads, dim = k_cache.shape[2], k_cache.shape[3]
    if kv_ptrs is None or not k.is_cuda or k_cache.element_size() != 2:
        k_cache.view(-1, heads, dim).index_copy_(0, slots, k.to(k_cache.dtype))
        v_cache.view(-1, heads, dim).index_copy_(0, slots, v.to(v_cache.dtype))
        return
    k, v = (t.to(k_cache.dtype) if t.stride(-1) == 1 else t.to(k_cache.dtype).contiguous() for t in (k, v))
    if not k.shape[0]:
        return
    name, defines = KV_WRITE
    fn = kc.get_kernel(k.device, name, "pw_kv_write", defines)
    kc.launch(fn, k.device, (k.shape[0],), (128,), (
        kc.ptr(k), kc.i64(k.stride(0)), kc.i64(k.stride(1)), kc.ptr(v), kc.i64(v.stride(0)), kc.i64(v.stride(1)),
        kc.ptr(slots), kc.ptr(kv_ptrs), kc.i32(heads), kc.i32(dim)))


def paged_attention_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor,
                           scale: float | None = None, generic: bool = False,
                           kv_ptrs: torch.Tensor | None = None, window: int | None = None) -> torch.Tensor:
    """One query token per sequence: q [S, Hq, D] over caches [num_blocks, block_size, Hkv, D] -> [S, Hq, D].

    block_tables [S, max_blocks] int32 (padding -1 is never read), context_lens [S] int32 = tokens each
    query attends to (its own K/V already in the cache). scale defaults to 1/sqrt(D). `generic` forces
    the generic kernel (for comparisons: `python -m pwruntime.kernels.tune --attention`). `kv_ptrs` (int64 [2] on
    the device: the caches' addresses, KVCache.layer_ptrs) makes the kernels read the addresses from there. A sliding
    `window` (a layer's `sliding_windows` entry) keeps each context's last `window` tokens, as the reference does.
    """
    n_seq, heads, dim = q.shape
    kv_heads = k_cache.shape[2]
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads are not a multiple of {kv_heads} KV heads")
    scale = 1.0 / math.sqrt(dim) if scale is None else float(scale)
    variant = decode_variant(q.dtype, dim, heads // kv_heads, generic) if q.is_cuda else None
    if variant is None or not (k_cache.is_contiguous() and v_cache.is_contiguous()
                               and k_cache.dtype == v_cache.dtype == q.dtype):
        return paged_attention_decode_ref(q, k_cache, v_cache, block_tables, context_lens, scale, window)
    dev = q.device
    q = q.contiguous()
    bt = block_tables.to(device=dev, dtype=torch.int32).contiguous()
    cl = context_lens.to(device=dev, dtype=torch.int32).contiguous()
    out = torch.empty_like(q)
    common = (kc.ptr(q), kc.i64(heads * dim), kc.ptr(k_cache), kc.ptr(v_cache), kc.ptr(kv_ptrs), kc.ptr(bt),
              kc.i32(bt.shape[1]), kc.ptr(cl))
    name, defines = variant
    window = int(window or 0)
    if name == "paged_attention_gqa.cu":
        _gqa(q, k_cache, bt, out, common, scale, heads // kv_heads, defines, window)
        return out
    k = kc.get_kernel(dev, name, "pw_paged_attention_decode", defines)
    kc.launch(k, dev, (n_seq, heads), (THREADS,), common + (
        kc.i32(heads), kc.i32(kv_heads), kc.i32(k_cache.shape[1]), kc.f32(scale), kc.ptr(out), kc.i64(heads * dim),
        kc.i32(window)))
    return out


def _gqa(q: torch.Tensor, k_cache: torch.Tensor, bt: torch.Tensor, out: torch.Tensor, common: tuple,
         scale: float, group: int, defines: tuple, window: int) -> None:
    n_seq, heads, dim = q.shape
    kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    dev = q.device
    per_cta = heads_per_cta(group, dim)
    max_tokens = bt.shape[1] * block_size   # the most tokens any query sees: the table's width, or the window
    if window:
        max_tokens = min(max_tokens, window)
    slices = kv_heads * (group // per_cta)
    parts = context_parts(n_seq * slices, max_tokens, torch.cuda.get_device_properties(dev).multi_processor_count)
    part_tokens = -(-max_tokens // parts)
    ml = o = None
    if parts > 1:
        ml = torch.empty(n_seq, heads, parts, 2, device=dev, dtype=torch.float32)
        o = torch.empty(n_seq, heads, parts, dim, device=dev, dtype=torch.float32)
    k = kc.get_kernel(dev, "paged_attention_gqa.cu", "pw_paged_attention_gqa", defines)
    kc.launch(k, dev, (n_seq, slices, parts), (GQA_THREADS,), common + (
        kc.i32(kv_heads), kc.i32(group), kc.i32(block_size), kc.f32(scale), kc.ptr(out), kc.i64(heads * dim), kc.i32(part_tokens),
        kc.ptr(ml), kc.ptr(o), kc.i32(window)))
    if parts > 1:
        merge = kc.get_kernel(dev, "paged_attention_gqa.cu", "pw_paged_attention_merge", defines)
        kc.launch(merge, dev, (n_seq, heads), (dim,), (kc.ptr(ml), kc.ptr(o), kc.i32(parts), kc.ptr(out),
                                                        kc.i64(heads * dim)))
