// Dequantize AP blocks (layout v1) at their committed bits into fp16/bf16 [n, out, in], for prefill GEMMs.
//
// The blocks come from the device page table (int64 rows [plane0..plane7, lut, bits]); one launch
// handles any number of same-shape blocks (grid.y = block). Each thread decodes one 32-column word
// of one row with the fused MoE kernel's decoders (ap_decode.cuh): a register LUT looked up with prmt
// at q = 3, 4; byte codes from the bit transpose and one L1 LUT load an element at q >= 5. The values
// come out in the decoders' mma order and are paired into 16 words of consecutive elements.
// When K is a multiple of 32 the 32 threads of a warp own 32 consecutive words, i.e. 2 KiB of contiguous
// output: each thread puts its 64 bytes in a shared-memory stage and the warp writes the 2 KiB with
// coalesced 16-byte stores (a thread storing its own 64 bytes makes every warp store touch 32 sectors
// for 128 useful bytes). Other K store per thread.
#include "pw_common.cuh"
#include "ap_decode.cuh"

#ifndef PW_BF16
#define PW_BF16 0
#endif

namespace {
constexpr bool BF = PW_BF16 != 0;
constexpr int THREADS = 128;
constexpr int TABLE_COLS = 10;

// Word wd of row r of a block at Q bits -> out[p] = elements 2p (low half) and 2p + 1 of the word.
template <int Q>
__device__ __forceinline__ void decode_word(const long long* row, int r, int W, int wd, u32 (&out)[16]) {
    const long long off = (long long)r * W + wd;
    const u16* lut = reinterpret_cast<const u16*>(row[8]) + (long long)r * (1 << Q);
    u32 w[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) w[j] = j < Q ? ldg_nc(reinterpret_cast<const u32*>(row[j]) + off) : 0u;
    u32 L[8] = {};
    if constexpr (Q <= 4) {
        u32x4 raw[2];
#pragma unroll
        for (int h = 0; h < Q - 2; ++h) raw[h] = ldg_nc_v4(lut + 8 * h);
        reg_lut<Q, BF>(raw, L);
    }
    decode_word32<Q>(w, L, [lut](u32 c) { return (u32)lut2act<BF>(ldg_nc_u16(lut + c)); }, out);
}
}  // namespace

// `skip` (nullable): when it points at a nonzero value the launch writes nothing (a captured prefill whose layer
// runs the fused AP GEMM instead, ap_gemm.cu, decides so on the device).
extern "C" __global__ void __launch_bounds__(THREADS) pw_ap_dequant(const long long* __restrict__ table,
                                                                    const long long* __restrict__ blocks,
                                                                    int out_rows, int K, u16* __restrict__ dst,
                                                                    const long long* __restrict__ skip) {
    if (skip != nullptr && *skip != 0) return;
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
        u32 out[16];
        switch ((int)row[9]) {
            case 3: decode_word<3>(row, r, W, wd, out); break;
            case 4: decode_word<4>(row, r, W, wd, out); break;
            case 5: decode_word<5>(row, r, W, wd, out); break;
            case 6: decode_word<6>(row, r, W, wd, out); break;
            case 7: decode_word<7>(row, r, W, wd, out); break;
            case 8: decode_word<8>(row, r, W, wd, out); break;
            default:  // not resident (or below the 3-bit floor): zeros
#pragma unroll
                for (int p = 0; p < 16; ++p) out[p] = 0u;
        }
        if (staged) {
#pragma unroll
            for (int p = 0; p < 16; p += 4)
                *reinterpret_cast<u32x4*>(mine + p) = u32x4{out[p], out[p + 1], out[p + 2], out[p + 3]};
        } else {
            u16* o = block_dst + (long long)r * K + wd * 32;
            const int ncol = min(32, K - wd * 32);
#pragma unroll
            for (int p = 0; p < 16; ++p) {
                if (2 * p + 1 < ncol && (K & 1) == 0) {
                    *reinterpret_cast<u32*>(o + 2 * p) = out[p];
                } else {
                    if (2 * p < ncol) o[2 * p] = (u16)(out[p] & 0xffffu);
                    if (2 * p + 1 < ncol) o[2 * p + 1] = (u16)(out[p] >> 16);
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
