"""AP (any-precision) storage sizes: the one place that says how many bytes a block takes.

Layout (version 1, shared with pwruntime/quant and cuda/): a linear-block `W[out, in]` is stored
as 8 bit-planes, MSB plane first. Plane j is one contiguous slab `[out, ceil(in / 32)]` of uint32
words: bit (k % 32) of word k // 32 of row r is bit (7 - j) of the 8-bit code of W[r, k]. The
b-bit code is the top b bits of the 8-bit code, so a b-bit matrix needs planes 0..b-1. Each
bitwidth b has its own lookup table `LUT_b[out, 2**b]` of fp16 centroids (LUTs are not nested).

`M[i, b]` (bytes resident on the GPU at b bits) = b planes + LUT_b. `M[i, 0] = 0` means the block
is not resident at all (only the expert-offloading baseline uses that state).
"""
from __future__ import annotations

import numpy as np

LAYOUT_VERSION = 1
MAX_BITS = 8
WORD_BITS = 32
LUT_DTYPE_BYTES = 2  # fp16 centroids


def plane_bytes(out_features: int, in_features: int) -> int:
    """Bytes of one bit-plane of a `[out, in]` matrix (rows padded to whole 32-bit words)."""
    if out_features <= 0 or in_features <= 0:
        raise ValueError(f"matrix shape must be positive, got [{out_features}, {in_features}]")
    words_per_row = -(-in_features // WORD_BITS)
    return out_features * words_per_row * (WORD_BITS // 8)


def lut_bytes(out_features: int, bits: int) -> int:
    """Bytes of LUT_b: one fp16 centroid per code per output row."""
    if not 1 <= bits <= MAX_BITS:
        raise ValueError(f"bits must be in 1..{MAX_BITS}, got {bits}")
    return out_features * (1 << bits) * LUT_DTYPE_BYTES


def lut_bytes_of(out_features: np.ndarray, bits: np.ndarray | int) -> np.ndarray:
    """Bytes of LUT_bits for rows of `out_features` (0 where bits is 0); vectorised `lut_bytes`."""
    bits = np.asarray(bits, dtype=np.int64)
    return np.where(bits > 0, out_features * (np.int64(1) << np.clip(bits, 0, MAX_BITS)) * LUT_DTYPE_BYTES, 0)


def ap_block_bytes(out_features: int, in_features: int, bits: int) -> int:
    """GPU bytes of a block at `bits`: planes 0..bits-1 plus LUT_bits; 0 bits means not resident."""
    if bits == 0:
        return 0
    return bits * plane_bytes(out_features, in_features) + lut_bytes(out_features, bits)


def byte_table(shapes: np.ndarray) -> np.ndarray:
    """`M[i, b]` for b = 0..8 given `shapes[i] = (out, in)`; int64, column 0 is zero.

    Vectorised form of `ap_block_bytes`; a test checks the two agree for every entry.
    """
    shapes = np.asarray(shapes, dtype=np.int64).reshape(-1, 2)
    if (shapes <= 0).any():
        raise ValueError("every block shape must be positive")
    out_f, in_f = shapes[:, 0], shapes[:, 1]
    planes = out_f * (-(-in_f // WORD_BITS)) * (WORD_BITS // 8)
    bits = np.arange(MAX_BITS + 1, dtype=np.int64)
    table = bits[None, :] * planes[:, None] + out_f[:, None] * (1 << bits)[None, :] * LUT_DTYPE_BYTES
    table[:, 0] = 0
    return table


def fp16_bytes(out_features: int, in_features: int) -> int:
    """Bytes of the same matrix in fp16, for comparison."""
    return out_features * in_features * 2
