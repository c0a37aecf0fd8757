// Dequantize AP blocks (layout v1) at their committed bits into fp16/bf16 [n, out, in], for prefill GEMMs.
//
// The blocks come from the device page table (int64 rows [plane0..plane7, lut, bits]); one launch
// handles any number of same-shape blocks (grid.y = block). Each thread decodes one 32-column word
// of one row: q plane words (the top three unpacked from the device's nibble layout) -> 32 codes ->
// LUT_q lookups (the LUT row is tiny and L1-resident).
#include "pw_common.cuh"
#include "ap_decode.cuh"

#ifndef PW_BF16
#define PW_BF16 0
#endif

namespace {
constexpr bool BF = PW_BF16 != 0;
constexpr int THREADS = 128;
constexpr int TABLE_COLS = 10;
}  // namespace

extern "C" __global__ void __launch_bounds__(THREADS) pw_ap_dequant(const long long* __restrict__ table,
                                                                    const long long* __restrict__ blocks,
                                                                    int out_rows, int K, u16* __restrict__ dst) {
    const int W = (K + 31) >> 5;
    const long long idx = (long long)blockIdx.x * THREADS + threadIdx.x;
    if (idx >= (long long)out_rows * W) return;
    const int r = (int)(idx / W), wd = (int)(idx % W);
    const long long* row = table + blocks[blockIdx.y] * TABLE_COLS;
    const int q = (int)row[9];
    u16* o = dst + (long long)blockIdx.y * out_rows * K + (long long)r * K + wd * 32;
    const int ncol = min(32, K - wd * 32);
    if (q < 3 || q > 8) {  // not resident (or below the 3-bit floor): zeros
        for (int e = 0; e < ncol; ++e) o[e] = 0;
        return;
    }
    const u16* lut = reinterpret_cast<const u16*>(row[8]) + (long long)r * (1 << q);
    u32 w[8];
#pragma unroll
    for (int j = 0; j < 8; ++j)
        w[j] = j < q ? ldg_nc(reinterpret_cast<const u32*>(row[j]) + (long long)r * W + wd) : 0u;
    const u32 packed[3] = {w[0], w[1], w[2]};
#pragma unroll
    for (int k = 0; k < 3; ++k) w[k] = ap_plane(packed, k);
    const bool pairs = (K & 1) == 0;
#pragma unroll 4
    for (int e = 0; e < 32; e += 2) {
        u32 c0 = 0, c1 = 0;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            if (j < q) {
                c0 |= ((w[j] >> e) & 1u) << (q - 1 - j);
                c1 |= ((w[j] >> (e + 1)) & 1u) << (q - 1 - j);
            }
        }
        const u16 v0 = lut2act<BF>(lut[c0]), v1 = lut2act<BF>(lut[c1]);
        if (pairs && e + 1 < ncol) {
            *reinterpret_cast<u32*>(o + e) = (u32)v0 | ((u32)v1 << 16);
        } else {
            if (e < ncol) o[e] = v0;
            if (e + 1 < ncol) o[e + 1] = v1;
        }
    }
}
