"""Bit-plane packing of 8-bit codes (layout v1) and the pure-torch dequantize reference.

Layout v1 (the one `policies.apformat` sizes): planes `[8, out, ceil(in/32)]`, plane-major, MSB
plane first. Bit (k % 32) of word k // 32 of row r in plane j is bit (7 - j) of the 8-bit code of
W[r, k]. Padding bits (columns in..32*words-1 of the last word) are zero. Words are uint32; in
torch they travel as `torch.uint32` on disk and are viewed as `torch.int32` for bit arithmetic
(torch has no shifts on uint32), which keeps the bit pattern.

`dequantize(planes[:b], lut_b, out, in)` is the reference every CUDA kernel is tested against:
code = sum_j bit_j << (b - 1 - j), W_b[r, k] = LUT_b[r, code].
"""
from __future__ import annotations

import numpy as np
import torch

from policies.apformat import MAX_BITS, WORD_BITS


def words_per_row(in_features: int) -> int:
    return -(-in_features // WORD_BITS)


# ------------------------------------------------------------------ numpy
def pack_planes(codes: np.ndarray) -> np.ndarray:
    """8-bit codes uint8 [out, in] -> planes uint32 [8, out, ceil(in/32)] (layout v1)."""
    codes = np.asarray(codes)
    if codes.ndim != 2 or codes.dtype != np.uint8:
        raise ValueError(f"codes must be uint8 [out, in], got {codes.dtype} {codes.shape}")
    out, n = codes.shape
    wpr = words_per_row(n)
    planes = np.empty((MAX_BITS, out, wpr), dtype=np.uint32)
    for j in range(MAX_BITS):
        bits = np.zeros((out, wpr * WORD_BITS), dtype=np.uint8)
        bits[:, :n] = (codes >> (MAX_BITS - 1 - j)) & 1
        # little bit order: element k goes to bit k % 8 of byte k // 8; 4 bytes -> little-endian word
        packed = np.packbits(bits, axis=1, bitorder="little")
        planes[j] = packed.view("<u4").astype(np.uint32, copy=False).reshape(out, wpr)
    return planes


def unpack_codes(planes: np.ndarray, bits: int, in_features: int) -> np.ndarray:
    """Top `bits` planes of `planes[>=bits, out, words]` -> b-bit codes uint8 [out, in_features]."""
    planes = np.asarray(planes)
    _check_planes_shape(tuple(planes.shape), bits, in_features)
    out = planes.shape[1]
    codes = np.zeros((out, in_features), dtype=np.uint8)
    for j in range(bits):
        raw = np.ascontiguousarray(planes[j].astype("<u4")).view(np.uint8)
        plane_bits = np.unpackbits(raw, axis=1, bitorder="little")[:, :in_features]
        codes |= plane_bits << np.uint8(bits - 1 - j)
    return codes


def _check_planes_shape(shape: tuple, bits: int, in_features: int) -> None:
    if len(shape) != 3:
        raise ValueError(f"planes must be [planes, out, words], got shape {shape}")
    if not 1 <= bits <= min(MAX_BITS, shape[0]):
        raise ValueError(f"bits must be in 1..{min(MAX_BITS, shape[0])} for {shape[0]} planes, got {bits}")
    if shape[2] != words_per_row(in_features):
        raise ValueError(f"planes have {shape[2]} words per row; in_features={in_features} needs "
                         f"{words_per_row(in_features)}")


# ------------------------------------------------------------------ torch
def as_int32_words(planes: torch.Tensor) -> torch.Tensor:
    """View uint32 words as int32 (same bits); int32 passes through."""
    if planes.dtype == torch.uint32:
        return planes.view(torch.int32)
    if planes.dtype != torch.int32:
        raise ValueError(f"planes must be uint32 or int32 words, got {planes.dtype}")
    return planes


def pack_planes_torch(codes: torch.Tensor) -> torch.Tensor:
    """8-bit codes [out, in] (uint8) -> planes uint32 [8, out, ceil(in/32)], vectorised, on codes' device."""
    if codes.ndim != 2 or codes.dtype != torch.uint8:
        raise ValueError(f"codes must be uint8 [out, in], got {codes.dtype} {tuple(codes.shape)}")
    out, n = codes.shape
    wpr = words_per_row(n)
    c = torch.zeros((out, wpr * WORD_BITS), dtype=torch.int64, device=codes.device)
    c[:, :n] = codes.to(torch.int64)
    shifts = torch.arange(MAX_BITS - 1, -1, -1, device=codes.device)  # plane j takes bit 7 - j
    bits = (c.unsqueeze(0) >> shifts.view(-1, 1, 1)) & 1  # [8, out, wpr*32]
    pos = torch.arange(WORD_BITS, device=codes.device, dtype=torch.int64)
    words = (bits.view(MAX_BITS, out, wpr, WORD_BITS) << pos).sum(-1)  # [8, out, wpr], 0..2^32-1
    words = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
    return words.view(torch.uint32)


def unpack_codes_torch(planes: torch.Tensor, bits: int, in_features: int) -> torch.Tensor:
    """Top `bits` planes -> b-bit codes int64 [out, in_features] (ready for gather)."""
    _check_planes_shape(tuple(planes.shape), bits, in_features)
    words = as_int32_words(planes[:bits])
    out, wpr = words.shape[1], words.shape[2]
    pos = torch.arange(WORD_BITS, device=words.device, dtype=torch.int32)
    codes = torch.zeros((out, in_features), dtype=torch.int64, device=words.device)
    for j in range(bits):  # one plane at a time keeps the temporary at [out, in] int32
        plane_bits = ((words[j].unsqueeze(-1) >> pos) & 1).reshape(out, wpr * WORD_BITS)[:, :in_features]
        codes |= plane_bits.to(torch.int64) << (bits - 1 - j)
    return codes


def dequantize(planes: torch.Tensor, lut: torch.Tensor, out_features: int, in_features: int,
               dtype: torch.dtype | None = None) -> torch.Tensor:
    """Reference dequantize: `planes[b, out, words]` (exactly the top b planes) and `LUT_b[out, 2**b]`.

    Returns W_b [out, in] in `dtype` (default the LUT's dtype). The bitwidth b is planes.shape[0].
    """
    bits = planes.shape[0]
    if tuple(lut.shape) != (out_features, 1 << bits):
        raise ValueError(f"LUT shape {tuple(lut.shape)} does not match {bits} planes of a "
                         f"[{out_features}, {in_features}] matrix (expected {(out_features, 1 << bits)})")
    if planes.shape[1] != out_features:
        raise ValueError(f"planes have {planes.shape[1]} rows, expected {out_features}")
    codes = unpack_codes_torch(planes, bits, in_features)
    w = torch.gather(lut, 1, codes)
    return w if dtype is None else w.to(dtype)
