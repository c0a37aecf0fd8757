"""Which prefill MoE layers skip dequantizing their experts: the fused AP GEMM's rule, shared by both engines.

A prefill layer (more tokens than the fused decode kernel takes) dequantizes its experts to 16 bits and multiplies
them with torch's grouped GEMM. Where its experts average few rows and every block of the layer is at
`FUSED_GEMM_MAX_BITS` or fewer, the runtime multiplies the rows by the AP planes directly instead, decoding them into
the GEMM's tiles (cuda/ap_gemm.cu: no 16-bit copy written and read back); the simulator's cost model prices the
same layers the same way. The bits are the committed ones at the step (the runtime reads them on the device, so a
captured step follows each replay's). Measured on an H100 (cuda/NOTES.md, session 70): 3-4-bit layers of Gemma 4
and Qwen3-MoE 1.4-2.8x faster at 32-128 rows an expert; at 256 rows and at 8 bits the dequantize path is faster.
"""
from __future__ import annotations

# Experts of more intermediate rows take padded batched GEMMs in the runtime, not torch's grouped GEMM (and so never
# the fused GEMM, which replaces the grouped path's): measured faster for Mixtral's 14336 (the runtime's
# `grouped_mm_prefill`, cuda/NOTES.md session 10).
GROUPED_MM_MAX_INTERMEDIATE = 4096
FUSED_GEMM_MAX_BITS = 4      # a layer takes the fused GEMM only if every block of it is at this many bits or fewer
FUSED_GEMM_MAX_ROWS = 128    # ... and its experts average at most this many routed rows
GEMM_STEP = 64               # the kernel's K step: in_features must be a multiple of it
TILE_ROWS = (64, 128)        # the kernel's tile rows: 64 where the experts average fewer than 64 rows


def fused_gemm_shapes_ok(in_features: int, out_features: int) -> bool:
    """Whether the fused GEMM takes blocks of this shape: whole K steps, an even number of rows."""
    return in_features % GEMM_STEP == 0 and out_features % 2 == 0


def fused_gemm_experts(hidden: int, intermediate: int) -> bool:
    """Whether the fused GEMM takes experts of hidden x intermediate: their two blocks' shapes, on the grouped path."""
    return (fused_gemm_shapes_ok(hidden, 2 * intermediate) and fused_gemm_shapes_ok(intermediate, hidden)
            and intermediate <= GROUPED_MM_MAX_INTERMEDIATE)


def fused_gemm_layer(rows: int, experts: int, hidden: int, intermediate: int) -> bool:
    """Whether a prefill layer of `rows` routed rows (tokens x top-k) over `experts` experts of hidden x intermediate
    may take the fused GEMM (it does where its blocks are all at FUSED_GEMM_MAX_BITS or fewer)."""
    return fused_gemm_experts(hidden, intermediate) and rows <= FUSED_GEMM_MAX_ROWS * experts


def fused_gemm_tile_rows(rows: int, experts: int) -> int:
    """The tile rows the fused GEMM takes for `rows` routed rows over `experts` experts."""
    return TILE_ROWS[0] if rows < TILE_ROWS[0] * experts else TILE_ROWS[1]
