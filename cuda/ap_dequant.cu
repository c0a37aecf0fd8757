// Dequantize AP blocks (layout v1) at their committed bits into fp16/bf16 [n, out, in], for prefill GEMMs.
//
// The blocks come from the device page table (int64 rows [plane0..plane7, lut, bits]); one launch
// handles any number of same-shape blocks (grid.y = block). Each thread decodes one 32-column word
// of one row: q plane words (the top three unpacked from the device's nibble layout) -> 32 codes ->
// LUT_q lookups (the LUT row is tiny and L1-resident). When K is a multiple of 32 the 32 threads of a
// warp own 32 consecutive words, i.e. 2 KiB of contiguous output: each thread puts its 64 bytes in a
// shared-memory stage and the warp writes the 2 KiB with coalesced 16-byte stores (a thread storing its
// own 64 bytes makes every warp store touch 32 sectors for 128 useful bytes).
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
    constexpr int LANE_WORDS = 20;  // a thread's 16 output words, padded by 4: its 16-byte writes hit distinct banks
    __shared__ __align__(16) u32 stage[THREADS / 32][32 * LANE_WORDS];
    const int W = (K + 31) >> 5;
    const long long total = (long long)out_rows * W;
    const long long idx = (long long)blockIdx.x * THREADS + threadIdx.x;
    const int lane = threadIdx.x & 31;
    const bool staged = (K & 31) == 0;  // then output word idx starts at element 32 * idx of this block
    u16* const block_dst = dst + (long long)blockIdx.y * out_rows * K;
    u32* const mine = stage[threadIdx.x >> 5] + lane * LANE_WORDS;
    if (idx < total) {
        const int r = (int)(idx / W), wd = (int)(idx % W);
        const long long* row = table + blocks[blockIdx.y] * TABLE_COLS;
        const int q = (int)row[9];
        u16* o = block_dst + (long long)r * K + wd * 32;
        const int ncol = min(32, K - wd * 32);
        if (q < 3 || q > 8) {  // not resident (or below the 3-bit floor): zeros
            if (staged) {
                for (int e = 0; e < 16; ++e) mine[e] = 0u;
            } else {
                for (int e = 0; e < ncol; ++e) o[e] = 0;
            }
        } else {
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
                if (staged) {
                    mine[e >> 1] = (u32)v0 | ((u32)v1 << 16);
                } else if (pairs && e + 1 < ncol) {
                    *reinterpret_cast<u32*>(o + e) = (u32)v0 | ((u32)v1 << 16);
                } else {
                    if (e < ncol) o[e] = v0;
                    if (e + 1 < ncol) o[e + 1] = v1;
                }
            }
        }
    }
    if (!staged) return;  // uniform over the grid
    __syncwarp();
    const long long warp_first = idx - lane;  // the warp's first output word
    const u32* warp_stage = stage[threadIdx.x >> 5];
    uint4* out = reinterpret_cast<uint4*>(block_dst + warp_first * 32);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int c = i * 32 + lane;  // 16-byte chunk c of the warp's 2 KiB: thread c / 4's bytes 16 (c % 4)...
        if (warp_first + (c >> 2) < total)
            out[c] = *reinterpret_cast<const uint4*>(warp_stage + (c >> 2) * LANE_WORDS + (c & 3) * 4);
    }
}
