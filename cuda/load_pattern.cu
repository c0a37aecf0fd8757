// Load-only microbenchmark for cuda/NOTES.md: how fast 3 bit-planes of one block stream into registers
// with the AP kernel's access patterns and CTA shape (128 threads, 16 rows a warp, k-split warps), no
// decode. mode 0: lane (g, t) reads 8 bytes of rows g and g + 8 per plane (8-word chunks, 32 bytes a row);
// mode 1: a warp's 16 rows x 8 words are 512 contiguous bytes (a tiled layout); mode 2: 16 bytes a lane
// (16-word chunks, 64 bytes a row), the layout of today's q = 3 path. `out` accumulates (XOR) every word read.
#include "pw_common.cuh"

// modes 0 and 2: lane (g, t) reads WPL words of rows g and g + 8 per plane and chunk of 4 WPL words
template <int WPL>
__device__ __forceinline__ u32 xor_row_pairs(const u32* const (&planes)[3], int rbase, int g, int t, int W, int ks,
                                             int ksplit) {
    constexpr int CW = 4 * WPL;
    u32 acc = 0;
#pragma unroll(8 / WPL)
    for (int c = ks; c < W / CW; c += ksplit)
#pragma unroll
        for (int j = 0; j < 3; ++j) {
            const u32* r0 = planes[j] + (long long)(rbase + g) * W + c * CW + WPL * t;
            const u32* r1 = planes[j] + (long long)(rbase + g + 8) * W + c * CW + WPL * t;
            if constexpr (WPL == 2) {
                const u32x2 a = ldg_nc_v2(r0);
                const u32x2 b = ldg_nc_v2(r1);
                acc ^= a.x ^ a.y ^ b.x ^ b.y;
            } else {
                const u32x4 a = ldg_nc_v4(r0);
                const u32x4 b = ldg_nc_v4(r1);
                acc ^= a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w;
            }
        }
    return acc;
}

extern "C" __global__ void __launch_bounds__(128) pw_load_pattern(const u32* __restrict__ p0, const u32* __restrict__ p1,
                                                                 const u32* __restrict__ p2, int W, int ksplit,
                                                                 int mode, u32* __restrict__ out) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int rgs = 4 / ksplit, rg = warp / ksplit, ks = warp % ksplit;
    const int rbase = (blockIdx.x * rgs + rg) * 16;
    const u32* planes[3] = {p0, p1, p2};
    u32 acc = 0;
    if (mode == 0) {
        acc = xor_row_pairs<2>(planes, rbase, g, t, W, ks, ksplit);
    } else if (mode == 1) {
#pragma unroll 4
        for (int c = ks; c < W / 8; c += ksplit)
#pragma unroll
            for (int j = 0; j < 3; ++j) {
                const u32x4 a = ldg_nc_v4(planes[j] + ((long long)(rbase / 16) * (W / 8) + c) * 128 + lane * 4);
                acc ^= a.x ^ a.y ^ a.z ^ a.w;
            }
    } else {
        acc = xor_row_pairs<4>(planes, rbase, g, t, W, ks, ksplit);
    }
    // every word of the three planes is read exactly once over the grid (any mode, any k-split), so the XOR of
    // all of them is what the probe computes (pwruntime/kernels/reference.py checks it); one atomic a warp
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) acc ^= __shfl_xor_sync(0xffffffffu, acc, o);
    if (lane == 0) atomicXor(out, acc);
}
