// The one-token q = 3 and 4 decode on the binary tensor cores (mma .b1 .and.popc): activations staging and chunk math.
//
// For one token and a 3-bit row r, y_r = sum_k LUT_r[code_rk] x_k = sum_c LUT_r[c] S_rc, S_rc = sum of x_k over the
// columns whose code is c. Each 512-column chunk of x is quantized to int16, X = round(x / s) with s = max|x| / 32767,
// and split into 16 bit-planes (two's complement: plane m weighs 2^m, plane 15 -2^15). Then the chunk's part of S_rc
// is s * sum_m w_m popc(onehot_c(r) & xplane_m), and one m16n8k256 .b1 mma gives 16 rows x 8 planes of those
// popcounts for 256 columns. A chunk of 16 rows costs 8 codes x 2 steps x 2 n-tiles = 32 such mmas, the one-hot masks
// one LOP3 each from the three planes (unpacked from the device's nibble layout first): about 250 integer-pipe
// instructions and 90 IMAD against about 390 and 32 HMMA for the 16-bit decode (cuda/NOTES.md, session 15). At q = 4
// each mask is counted again ANDed with plane 3 (the code's lowest bit): 64 mmas a chunk against the 16-bit decode's
// 870 instructions (session 16). The int32 popcount sums are exact; the only rounding beyond fp32 is X's (half a step
// of max|x| / 32767 in each chunk).
#pragma once
#include "pw_common.cuh"

#ifndef PW_B1  // the widest bits whose one-token row groups take this decode (ap_moe.cu): 3 or 4; 0: none (16-bit decode)
#define PW_B1 4
#endif

namespace b1 {
constexpr int FRAG_BYTES = 1024;  // one chunk's B fragments: 2 steps x 32 lanes x 16 bytes
constexpr float QMAX = 32767.f;
constexpr float ROUND_MAGIC = 12582912.f;  // 1.5 * 2^23: v + this has round(v) in its low mantissa bits (|v| < 2^22)

constexpr int LUT_BYTES = 512;    // a warp's LUT rows in shared memory: 16 rows x up to 16 fp16 entries

// shared-memory bytes of one token's staged chunks: the fragments, then one fp32 scale per chunk
__host__ __device__ constexpr int stage_bytes(int nchunks) { return nchunks * (FRAG_BYTES + 4); }
// where the warps' LUT rows start (16-byte aligned, after the staged chunks), and all a launch needs
__host__ __device__ constexpr int lut_offset(int nchunks) { return (stage_bytes(nchunks) + 15) & ~15; }
__host__ __device__ constexpr int smem_bytes(int nchunks, int warps) { return lut_offset(nchunks) + warps * LUT_BYTES; }

// The LUT rows g and g + 8 of a warp's 16 (2^Q fp16 entries each, 8 per 16-byte piece) copied into its LUT_BYTES of
// shared memory with cp.async, piece h of row m at (m * (Q - 2) + h) * 16: lane (g, t) copies piece t of its two
// rows' 2 (Q - 2). No registers are held for them through the decode; `lut_piece` reads them after `lut_wait`.
template <int Q>
__device__ __forceinline__ void lut_copy(char* lut_s, const u16* lut, int r0, int r1) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    if (t < 2 * (Q - 2)) {
        const int rr = t / (Q - 2), h = t % (Q - 2);
        const u16* src = lut + ((long long)(rr ? r1 : r0) << Q) + 8 * h;
        const u32 dst = static_cast<u32>(__cvta_generic_to_shared(lut_s + ((g + 8 * rr) * (Q - 2) + h) * 16));
        asm volatile("cp.async.ca.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
    }
}
__device__ __forceinline__ void lut_wait() {
    asm volatile("cp.async.wait_all;" ::: "memory");
    __syncwarp();
}
template <int Q>
__device__ __forceinline__ u32x4 lut_piece(const char* lut_s, int m, int h) {
    return *reinterpret_cast<const u32x4*>(lut_s + (m * (Q - 2) + h) * 16);
}

// Stage one token's activations (columns 0..K-1; zeros past K up to the last chunk's end) into xs: the scale of chunk c
// at float index c after the fragments, and plane m = 8 nt + g of word w = 16 c + 4 t + 2 i + h (bit e = column 32 w + e)
// at u32 index ((c * 2 + i) * 32 + 4 g + t) * 4 + 2 nt + h, so lane 4 g + t of step i reads its B fragments of both
// n-tiles as one 16-byte load. Each thread converts one 32-column word at a time; the 16 lanes of a chunk agree on its
// scale with shuffles. The last loop trip of a warp may be partial: all its lanes still take part in the shuffles.
template <bool BF, int THREADS>
__device__ void stage_x(char* xs, const u16* src, int K, bool vec, int nchunks) {
    u32* frag = reinterpret_cast<u32*>(xs);
    float* scale = reinterpret_cast<float*>(xs + nchunks * FRAG_BYTES);
    const int lane = threadIdx.x & 31, nw = nchunks * 16;
    for (int base = threadIdx.x & ~31; base < nw; base += THREADS) {
        const int w = base + lane, k0 = 32 * w;
        u32 v[16];
        load_act32(src + k0, K - k0, vec, v);
        float m = 0.f;
#pragma unroll
        for (int e = 0; e < 32; ++e) m = fmaxf(m, fabsf(act2f<BF>((u16)half_of(v, e))));
#pragma unroll
        for (int o = 1; o < 16; o <<= 1) m = fmaxf(m, __shfl_xor_sync(PW_FULL_MASK, m, o));
        const float inv = m > 0.f ? QMAX / m : 0.f;
        u32 q[32];  // low 16 bits: X in two's complement
#pragma unroll
        for (int e = 0; e < 32; ++e) q[e] = __float_as_uint(fmaf(act2f<BF>((u16)half_of(v, e)), inv, ROUND_MAGIC));
        u32 lo[8], hi[8];  // byte b of lo[i] / hi[i]: the low / high byte of X of column i + 8 b
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const u32 a = prmt(q[i], q[i + 8], 0x5140u), b = prmt(q[i + 16], q[i + 24], 0x5140u);
            lo[i] = prmt(a, b, 0x5410u);
            hi[i] = prmt(a, b, 0x7632u);
        }
        transpose8x8(lo);  // lo[j] = plane j of the word, hi[j] = plane 8 + j
        transpose8x8(hi);
        if (w < nw) {
            const int c = w >> 4, t = (w >> 2) & 3, i = (w >> 1) & 1, h = w & 1;
            u32* d = frag + ((c * 2 + i) * 32 + t) * 4 + h;
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                d[16 * j] = lo[j];
                d[16 * j + 2] = hi[j];
            }
            if ((w & 15) == 0) scale[c] = m / QMAX;
        }
    }
}

// nibble-packed words 0..2 (pwruntime/kernels/device_table.py pack_top_planes) -> AP planes 0..2, in place
__device__ __forceinline__ void unnibble(u32& n0, u32& n1, u32& n2) {
    const u32 p0 = (n0 & 0x88888888u) | (n0 >> 2 & 0x11111111u) | (n1 >> 1 & 0x22222222u) | (n2 & 0x44444444u);
    const u32 p1 = (n1 & 0x88888888u) | (n0 >> 1 & 0x11111111u) | (n1 & 0x22222222u) | (n2 << 1 & 0x44444444u);
    const u32 p2 = (n2 & 0x88888888u) | (n0 & 0x11111111u) | (n1 << 1 & 0x22222222u) | (n2 << 2 & 0x44444444u);
    n0 = p0;
    n1 = p1;
    n2 = p2;
}

template <int C>  // columns whose 3-bit code (plane 0 its MSB) is C
__device__ __forceinline__ u32 onehot(u32 p0, u32 p1, u32 p2) {
    return ((C & 4) ? p0 : ~p0) & ((C & 2) ? p1 : ~p1) & ((C & 1) ? p2 : ~p2);
}

__device__ __forceinline__ void bmma(int (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k256.row.col.s32.b1.b1.s32.and.popc {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// code C of one chunk: y[0][C][rr] += s * (the lane's planes' weighted popcounts of row g + 8 rr) over the columns
// whose top-3 code is C; at Q = 4, y[1][C][rr] the same over those of them whose plane 3 (the code's LSB) is set. Lane
// (g, t) holds mma columns 2t, 2t + 1 of n-tiles 0 and 1, planes 2t, 2t + 1, 8 + 2t, 9 + 2t: weights 2^2t * (1, 2,
// 256, +-512), the factor 2^2t applied once at the end (b1::finish). P[rr][j][u]: plane j of row g + 8 rr, word 4t + u
// of the chunk.
template <int C, int Q>
__device__ __forceinline__ void code_step(const u32 (&P)[2][Q][4], const u32x4 (&B)[2], int w15, float s,
                                          float (&y)[Q - 2][8][2]) {
    int d[Q - 2][4], e[Q - 2][4];
#pragma unroll
    for (int v = 0; v < Q - 2; ++v)
#pragma unroll
        for (int k = 0; k < 4; ++k) d[v][k] = e[v][k] = 0;
#pragma unroll
    for (int i = 0; i < 2; ++i) {  // words 2i (k-slot t) and 2i + 1 (k-slot 4 + t) of the lane's four
        const u32 a[4] = {onehot<C>(P[0][0][2 * i], P[0][1][2 * i], P[0][2][2 * i]),
                          onehot<C>(P[1][0][2 * i], P[1][1][2 * i], P[1][2][2 * i]),
                          onehot<C>(P[0][0][2 * i + 1], P[0][1][2 * i + 1], P[0][2][2 * i + 1]),
                          onehot<C>(P[1][0][2 * i + 1], P[1][1][2 * i + 1], P[1][2][2 * i + 1])};
        bmma(d[0], a, B[i].x, B[i].y);
        bmma(e[0], a, B[i].z, B[i].w);
        if constexpr (Q == 4) {
            const u32 a3[4] = {a[0] & P[0][3][2 * i], a[1] & P[1][3][2 * i], a[2] & P[0][3][2 * i + 1],
                               a[3] & P[1][3][2 * i + 1]};
            bmma(d[1], a3, B[i].x, B[i].y);
            bmma(e[1], a3, B[i].z, B[i].w);
        }
    }
#pragma unroll
    for (int v = 0; v < Q - 2; ++v) {
        y[v][C][0] = fmaf(s, (float)(d[v][0] + 2 * d[v][1] + 256 * e[v][0] + w15 * e[v][1]), y[v][C][0]);
        y[v][C][1] = fmaf(s, (float)(d[v][2] + 2 * d[v][3] + 256 * e[v][2] + w15 * e[v][3]), y[v][C][1]);
    }
}

// One chunk (cl) of a warp's 16 rows: P holds its plane words, planes 0..2 nibble-packed (unpacked here, in place).
template <int Q>
__device__ __forceinline__ void chunk(u32 (&P)[2][Q][4], const char* xs, int nchunks, int cl, float (&y)[Q - 2][8][2]) {
    static_assert(Q == 3 || Q == 4, "the binary decode serves 3 and 4 bits");
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int rr = 0; rr < 2; ++rr)
#pragma unroll
        for (int u = 0; u < 4; ++u) unnibble(P[rr][0][u], P[rr][1][u], P[rr][2][u]);
    const u32x4* frag = reinterpret_cast<const u32x4*>(xs) + cl * 64 + lane;
    const u32x4 B[2] = {frag[0], frag[32]};
    const float s = reinterpret_cast<const float*>(xs + nchunks * FRAG_BYTES)[cl];
    const int w15 = (lane & 3) == 3 ? -512 : 512;  // plane 15 (lane t = 3, n-tile 1, column 1) is the sign
    code_step<0, Q>(P, B, w15, s, y);
    code_step<1, Q>(P, B, w15, s, y);
    code_step<2, Q>(P, B, w15, s, y);
    code_step<3, Q>(P, B, w15, s, y);
    code_step<4, Q>(P, B, w15, s, y);
    code_step<5, Q>(P, B, w15, s, y);
    code_step<6, Q>(P, B, w15, s, y);
    code_step<7, Q>(P, B, w15, s, y);
}

// entry c of 8 fp16 LUT entries (a 16-byte load) as a float in the activation dtype's precision
template <bool BF>
__device__ __forceinline__ float lut_entry(const u32x4& v, int c) {
    const u32 w[4] = {v.x, v.y, v.z, v.w};
    return act2f<BF>(lut2act<BF>((u16)((w[c >> 1] >> (16 * (c & 1))) & 0xffffu)));
}

// The warp's result for rows g and g + 8 (every lane of the row gets the sum of its four lanes), with the rows' LUTs in
// lut_s (`lut_copy`, in the activation dtype's precision, as the 16-bit decode uses them): at Q = 3
// sum_c LUT[c] y[0][c]; at Q = 4, where code 2C + 1 is top code C with plane 3 set,
// sum_C LUT[2C] y[0][C] + (LUT[2C + 1] - LUT[2C]) y[1][C].
template <bool BF, int Q>
__device__ __forceinline__ void finish(const float (&y)[Q - 2][8][2], const char* lut_s, float (&out)[2]) {
    const int g = (threadIdx.x & 31) >> 2;
    const float lane_weight = (float)(1 << (2 * (threadIdx.x & 3)));
    lut_wait();
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
        u32x4 lut[Q - 2];
#pragma unroll
        for (int h = 0; h < Q - 2; ++h) lut[h] = lut_piece<Q>(lut_s, g + 8 * rr, h);
        float acc = 0.f;
#pragma unroll
        for (int c = 0; c < 8; ++c) {
            if constexpr (Q == 3) {
                acc = fmaf(lut_entry<BF>(lut[0], c), y[0][c][rr], acc);
            } else {
                const int h = c >> 2, e = 2 * (c & 3);  // entries 2c, 2c + 1 in load h
                const float even = lut_entry<BF>(lut[h], e), odd = lut_entry<BF>(lut[h], e + 1);
                acc = fmaf(even, y[0][c][rr], acc);
                acc = fmaf(odd - even, y[1][c][rr], acc);
            }
        }
        acc *= lane_weight;
        acc += __shfl_xor_sync(PW_FULL_MASK, acc, 1);
        acc += __shfl_xor_sync(PW_FULL_MASK, acc, 2);
        out[rr] = acc;
    }
}
}  // namespace b1
