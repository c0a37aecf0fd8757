"""The grouped GEMM over AP blocks at their committed bits (prefill with no dequantized copy of the weights).

`ap_grouped_mm` multiplies rows sorted by expert by each expert's block, decoding the planes into the GEMM's tiles
(cuda/ap_gemm.cu), where the dequantize path (`dequant.dequantize_blocks`, then torch's grouped GEMM) writes every
block in 16 bits first and reads it back. Nothing is read back to the host: a launch is capturable in a CUDA graph.
Its mma.sync tiles reach a fraction of torch's grouped GEMM's rate, and decoding 5-8-bit codes (a lookup each) in
every tile costs more than dequantizing once, so the runtime takes it for layers of few rows an expert at 3-4 bits
only (`policies.prefill_path`, `prefill_layer.prefill_moe`, cuda/NOTES.md session 70).
"""
from __future__ import annotations

import torch

from policies.prefill_path import GEMM_STEP, TILE_ROWS, fused_gemm_shapes_ok
from pwruntime.kernels import compile as kc
from pwruntime.kernels.device_table import DeviceWeightTable
from pwruntime.kernels.reference import dequantize_resident

THREADS, TILE_COLS = 128, 128  # a CTA's threads, its tile's columns of y (its rows: TILE_ROWS, the builds' PW_BM)


def smem_bytes(max_bits: int, tile_rows: int) -> int:
    """A CTA's dynamic shared memory: two x tiles and two weight tiles in 16 bits, and from 5 bits on the tile's LUT
    rows at `max_bits` (blocks above it look their codes up in global memory)."""
    tiles = 2 * (tile_rows + TILE_COLS) * GEMM_STEP * 2
    return tiles + (TILE_COLS << max_bits) * 2 if max_bits >= 5 else tiles


def variant(dtype: torch.dtype, tile_rows: int) -> kc.Variant:
    """The cuda/ap_gemm.cu build for activations of `dtype` and tiles of `tile_rows` rows."""
    return "ap_gemm.cu", (("PW_BF16", int(dtype == torch.bfloat16)), ("PW_BM", int(tile_rows)))


def ap_grouped_mm(table: DeviceWeightTable, blocks: range, x: torch.Tensor, ends: torch.Tensor, out_features: int,
                  max_bits: int = 8, tile_rows: int = 128, out: torch.Tensor | None = None,
                  on: torch.Tensor | None = None) -> torch.Tensor:
    """y [M, out_features] = the rows of x [M, K] sorted by expert, each times its expert's block transposed:
    expert e owns rows ends[e - 1] .. ends[e] - 1 (`ends` int32 [E] on x's device, torch._grouped_mm's offsets) and
    block `blocks[e]` (a run of page-table rows, each of shape [out_features, K]) at its committed bits, a block at 0
    bits giving zeros. fp32 accumulation, rounded to x's dtype (fp16 or bf16 on CUDA). Rows from ends[-1] on are not
    written (their values are undefined, as torch._grouped_mm leaves them).

    `max_bits`: the most bits the blocks have when the kernel runs (any is correct; 4 or fewer takes less shared
    memory, so more CTAs an SM). `tile_rows`: 64 or 128 (64 wastes less on experts of few rows). `out`: written in
    place of a new tensor. `on` (int64 [1] on the device): when it holds 0 nothing is written."""
    m, k = x.shape
    if len(blocks) != ends.numel() or ends.dim() != 1:
        raise ValueError(f"blocks and ends need one entry per expert, got {len(blocks)} blocks and ends of shape "
                         f"{tuple(ends.shape)}")
    if not fused_gemm_shapes_ok(k, out_features):
        raise ValueError(f"ap_grouped_mm needs K % {GEMM_STEP} == 0 and an even out_features, got K={k}, "
                         f"out_features={out_features}; use dequantize_blocks and a torch GEMM")
    if on is not None and on.dtype != torch.int64:
        raise ValueError(f"on must be an int64 tensor, got {on.dtype}")
    if tile_rows not in TILE_ROWS:
        raise ValueError(f"tile_rows must be one of {TILE_ROWS}, got {tile_rows}")
    y = torch.empty(m, out_features, dtype=x.dtype, device=x.device) if out is None else out
    if not m or not len(blocks):
        return y
    if x.device.type != "cuda" or x.dtype not in (torch.float16, torch.bfloat16):
        if on is None or int(on.reshape(-1)[0]):
            ap_grouped_mm_ref(table, blocks, x, ends, out_features, out=y)
        return y
    name, defines = variant(x.dtype, tile_rows)
    smem = smem_bytes(max_bits, tile_rows)
    kern = kc.get_kernel(x.device, name, "pw_ap_grouped_gemm", defines, smem)
    grid = (-(-out_features // TILE_COLS), -(-m // tile_rows) + len(blocks))   # every expert's last tile may be partial
    ends = ends.to(torch.int32).contiguous()
    kc.launch(kern, x.device, grid, (THREADS,),
              (kc.ptr(table.table), kc.i64(blocks.start), kc.i64(blocks.step), kc.ptr(ends), kc.i32(len(blocks)),
               kc.ptr(x.contiguous()), kc.i32(k), kc.i32(out_features), kc.ptr(y), kc.i32(max_bits), kc.ptr(on)),
              shared_mem=smem)
    return y


def ap_grouped_mm_ref(table: DeviceWeightTable, blocks: range, x: torch.Tensor, ends: torch.Tensor,
                      out_features: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """ap_grouped_mm in plain torch: each expert's block dequantized (`reference.dequantize_resident`, in x's dtype)
    and its rows multiplied in float32; rows from ends[-1] on are zeros (in `out` when given)."""
    y = torch.zeros(x.shape[0], out_features, dtype=x.dtype, device=x.device) if out is None else out.zero_()
    start = 0
    for b, end in zip(blocks, ends.tolist()):
        rb = table.resident(b)
        if end > start and rb is not None:
            w = dequantize_resident(rb, x.shape[1], x.dtype).to(x.device)
            y[start:end] = (x[start:end].float() @ w.float().T).to(x.dtype)
        start = end
    return y
