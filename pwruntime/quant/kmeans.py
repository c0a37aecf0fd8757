"""Per-row weighted 1-D k-means with incremental upscaling: the 8-bit codes and LUTs of an AP matrix.

For every output row r of `W[out, in]`:

1. sort the row, build weight / weighted-value prefix sums (float64);
2. seed: weighted k-means with `2**seed_bits` clusters (`flash1dkmeans`, k-means++ init + Lloyd);
3. upscale: for b = seed_bits .. 7, split every b-bit cluster (a contiguous range of the sorted
   row) in two with a weighted 2-means inside the cluster, giving the (b+1)-bit clusters.
   Child 2c is the lower half of cluster c and child 2c+1 the upper half, so the b-bit code of an
   element is the top b bits of its 8-bit code (codes are also monotone in the value);
4. `LUT_b[r, c]` is the weighted mean of the members of b-bit cluster c, rounded to fp16.

The weights (Fisher `grad^2`, Hessian diagonal `E[x_j^2]`, or none) only change which clusters are
found and where their centroids sit; they are normalised per row (only relative weights inside a
row matter) and floored at `1e-6` of the row mean so a zero weight never makes a cluster undefined.
Rows run in parallel with numba `prange`; each row re-seeds its RNG from (seed, row), so results do
not depend on the thread count.
"""
from __future__ import annotations

from dataclasses import dataclass

import numba
import numpy as np
from flash1dkmeans import numba_kmeans_1d_k_cluster, numba_kmeans_1d_two_cluster

from policies.apformat import MAX_BITS

LUT_WIDTH = sum(1 << b for b in range(1, MAX_BITS + 1))  # concatenated LUTs for b = 1..8 (510)
WEIGHT_FLOOR = 1e-6


@dataclass(frozen=True)
class QuantizedMatrix:
    """8-bit codes and per-bitwidth LUTs of one `[out, in]` matrix."""

    codes: np.ndarray  # uint8 [out, in]: the 8-bit code; the b-bit code is codes >> (8 - b)
    luts: dict[int, np.ndarray]  # b -> float16 [out, 2**b], for b = seed_bits..8

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)  # type: ignore[return-value]

    @property
    def bits(self) -> tuple[int, ...]:
        return tuple(sorted(self.luts))

    def codes_at(self, bits: int) -> np.ndarray:
        """The b-bit codes (top b bits of the 8-bit code), uint8 [out, in]."""
        return (self.codes >> np.uint8(MAX_BITS - bits)).astype(np.uint8)

    def reconstruct(self, bits: int) -> np.ndarray:
        """W_b as float32 [out, in]: a direct LUT lookup (the numpy reference)."""
        if bits not in self.luts:
            raise ValueError(f"no LUT for {bits} bits; have {self.bits}")
        lut = self.luts[bits].astype(np.float32)
        return np.take_along_axis(lut, self.codes_at(bits).astype(np.int64), axis=1)


def _lut_offset(bits: int) -> int:
    return sum(1 << b for b in range(1, bits))


@numba.njit(cache=True)
def _range_mean(sx, sw, s, e):
    n = sx.shape[0]
    if e <= s:  # empty cluster: any value between its neighbours; never looked up
        return sx[s] if s < n else sx[n - 1]
    tw = 0.0
    twx = 0.0
    for p in range(s, e):
        tw += sw[p]
        twx += sw[p] * sx[p]
    if tw > 0.0:
        return twx / tw
    return sx[s:e].mean()


@numba.njit(cache=True)
def _quantize_row(x, w, seed_bits, max_iter, random_state, codes_out, lut_out):
    """One row: fills codes_out[in] (uint8, original order) and lut_out[LUT_WIDTH] (b = 1..8 concat)."""
    n = x.shape[0]
    order = np.argsort(x, kind="mergesort")
    sx = x[order]
    sw = w[order]
    wps = np.cumsum(sw)
    wxps = np.cumsum(sx * sw)
    wx2ps = np.cumsum(sx * sx * sw)
    top = 1 << 8
    bnd = np.empty(top + 1, dtype=np.int64)  # borders at 8-bit granularity
    k = 1 << seed_bits
    step = top // k
    if n <= k:  # fewer elements than clusters: one element per cluster, the rest empty
        for c in range(k + 1):
            bnd[c * step] = min(c, n)
    else:
        _, seed_b = numba_kmeans_1d_k_cluster(sx, k, max_iter, wps, wxps, wx2ps, 0, n, random_state)
        for c in range(k + 1):
            bnd[c * step] = seed_b[c]
    # upscaling: split each cluster of the current level with a weighted 2-means
    while step > 1:
        half = step // 2
        for c in range(0, top, step):
            s = bnd[c]
            e = bnd[c + step]
            if e - s >= 2:
                _, b2 = numba_kmeans_1d_two_cluster(sx, wps, wxps, s, e)
                bnd[c + half] = b2[1]
            else:
                bnd[c + half] = e
        step = half
    sorted_codes = np.empty(n, dtype=np.uint8)
    for c in range(top):
        for p in range(bnd[c], bnd[c + 1]):
            sorted_codes[p] = c
    for p in range(n):
        codes_out[order[p]] = sorted_codes[p]
    off = 0
    for b in range(1, 9):
        kb = 1 << b
        st = top // kb
        for c in range(kb):
            if b < seed_bits:
                lut_out[off + c] = 0.0
            else:
                lut_out[off + c] = _range_mean(sx, sw, bnd[c * st], bnd[(c + 1) * st])
        off += kb


@numba.njit(cache=True, parallel=True)
def _quantize_rows(W, Wt, seed_bits, max_iter, seed, codes, luts):
    for r in numba.prange(W.shape[0]):
        _quantize_row(W[r], Wt[r], seed_bits, max_iter, (seed * 1000003 + r) % 2147483647, codes[r], luts[r])


def normalize_weights(weights: np.ndarray | None, shape: tuple[int, int]) -> np.ndarray:
    """Per-row weights as float64 [out, in]: scaled to row mean 1 and floored at WEIGHT_FLOOR.

    `weights` may be None (unweighted) or anything broadcastable to `shape` (e.g. a per-column
    Hessian diagonal [in]). Raises ValueError on negative or non-finite weights.
    """
    if weights is None:
        return np.ones(shape, dtype=np.float64)
    w = np.broadcast_to(np.asarray(weights, dtype=np.float64), shape)
    if not np.isfinite(w).all() or (w < 0).any():
        raise ValueError("k-means weights must be finite and non-negative")
    mean = w.mean(axis=1, keepdims=True)
    w = np.where(mean > 0, w / np.where(mean > 0, mean, 1.0), 1.0)
    return np.maximum(w, WEIGHT_FLOOR)


def quantize_matrix(
    w: np.ndarray,
    weights: np.ndarray | None = None,
    *,
    seed_bits: int = 3,
    seed: int = 0,
    max_iter: int = 300,
) -> QuantizedMatrix:
    """Quantize `w[out, in]` to 8-bit codes and LUT_b for b = seed_bits..8 (see module docstring)."""
    w = np.asarray(w)
    if w.ndim != 2 or w.shape[0] == 0 or w.shape[1] == 0:
        raise ValueError(f"expected a non-empty 2-D matrix, got shape {w.shape}")
    if not 1 <= seed_bits <= MAX_BITS:
        raise ValueError(f"seed_bits must be in 1..{MAX_BITS}, got {seed_bits}")
    x = np.ascontiguousarray(w, dtype=np.float64)
    if not np.isfinite(x).all():
        raise ValueError("matrix has non-finite values")
    wt = np.ascontiguousarray(normalize_weights(weights, x.shape))
    out, n = x.shape
    codes = np.empty((out, n), dtype=np.uint8)
    luts = np.empty((out, LUT_WIDTH), dtype=np.float64)
    _quantize_rows(x, wt, seed_bits, max_iter, int(seed) % 2147483647, codes, luts)
    lut_dict = {
        b: luts[:, _lut_offset(b):_lut_offset(b) + (1 << b)].astype(np.float16)
        for b in range(seed_bits, MAX_BITS + 1)
    }
    return QuantizedMatrix(codes=codes, luts=lut_dict)


def weighted_error(w: np.ndarray, weights: np.ndarray | None, q: QuantizedMatrix, bits: int) -> float:
    """`sum weights * (W - W_b)^2` (unweighted when weights is None), in float64."""
    diff = np.asarray(w, dtype=np.float64) - q.reconstruct(bits).astype(np.float64)
    wt = 1.0 if weights is None else np.broadcast_to(np.asarray(weights, dtype=np.float64), diff.shape)
    return float((wt * diff * diff).sum())
