"""Quantize one linear-block or one MoE layer's experts into packed AP form (codes -> planes + LUTs)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from policies.apformat import MAX_BITS
from pwruntime.quant.ap_checkpoint import LayerBlocks
from pwruntime.quant.kmeans import QuantizedMatrix, quantize_matrix
from pwruntime.quant.pack import pack_planes


@dataclass(frozen=True)
class PackedBlock:
    """One linear-block in layout v1: planes uint32 [8, out, words], LUT_b float16 [out, 2**b]."""

    planes: np.ndarray
    luts: dict[int, np.ndarray]

    def stored_bytes(self, bits: int) -> int:
        """Bytes a GPU holds at `bits`: the top `bits` planes and LUT_bits (== apformat.ap_block_bytes)."""
        return int(self.planes[:bits].nbytes + self.luts[bits].nbytes)


def pack_quantized(q: QuantizedMatrix, bits: tuple[int, ...]) -> PackedBlock:
    missing = [b for b in bits if b not in q.luts]
    if missing:
        raise ValueError(f"quantized matrix has no LUT for bits {missing} (seed bits too high?)")
    return PackedBlock(planes=pack_planes(q.codes), luts={b: q.luts[b] for b in bits})


def quantize_block(w: np.ndarray, weights: np.ndarray | None = None, *, bits: tuple[int, ...] = (3, 4, 5, 6, 7, 8),
                   seed: int = 0) -> PackedBlock:
    """k-means seed at min(bits), upscale to 8 bits, pack; keeps LUTs for `bits` only."""
    if not bits or max(bits) > MAX_BITS or min(bits) < 1:
        raise ValueError(f"bits must lie in 1..{MAX_BITS}, got {bits}")
    q = quantize_matrix(w, weights, seed_bits=min(bits), seed=seed)
    return pack_quantized(q, tuple(sorted(bits)))


def stack_blocks(blocks: list[PackedBlock], bits: tuple[int, ...]) -> LayerBlocks:
    """Per-expert packed blocks of one kind -> LayerBlocks with planes [E, 8, out, words], LUTs [E, out, 2**b]."""
    return LayerBlocks(planes=np.stack([b.planes for b in blocks]),
                       luts={b: np.stack([blk.luts[b] for blk in blocks]) for b in bits})
