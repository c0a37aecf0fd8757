// The one-token q = 3 and 4 decode on the binary tensor cores (mma .b1 .and.popc): activations staging and chunk math.
//
// For one token and a 3-bit row r, y_r = sum_k LUT_r[code_rk] x_k. Write the LUT in its Moebius basis over the code
// bits: LUT[c] = sum over the subsets T of c's set bits of a_T, with a_T = sum over U in T of (-1)^|T - U| LUT[U]. Then
// y_r = sum_T a_T Y_rT, where Y_rT sums x_k over the columns whose planes of T are all set. Y_r{} = sum_k x_k is the
// same for every row (the staging computes it once a chunk), and the 7 other Y_rT need only the AND of T's planes as
// their mask: no mask at all for the 3 single planes. Each 512-column chunk of x is quantized to int16,
// X = round(x / s) with s = max|x| / 32767, and split into 16 bit-planes (two's complement: plane m weighs 2^m,
// plane 15 -2^15), so the chunk's part of Y_rT is s * sum_m w_m popc(mask_T(r) & xplane_m), and one m16n8k256 .b1 mma
// gives 16 rows x 8 planes of those popcounts for 256 columns. A chunk of 16 rows costs 7 terms x 2 steps x 2 n-tiles
// = 28 such mmas and four LOP3 a plane word (the three top planes are unpacked from the device's nibble layout first);
// one-hot masks of the eight codes took 32 mmas and eight LOP3 (cuda/NOTES.md, sessions 15 and 18). At q = 4 the
// one-hot masks stay: each code's mask is counted again ANDed with plane 3 (the code's lowest bit), 64 mmas a chunk
// against the 16-bit decode's 870 instructions (session 16); the 15-term Moebius form made the kernel spill
// (session 18). The int32 popcount sums are exact; the only rounding beyond fp32 is X's (half a step of
// max|x| / 32767 in each chunk) and fp32's in the sums a lane keeps.
#pragma once
#include "pw_common.cuh"

#ifndef PW_B1  // the widest bits whose one-token row groups take this decode (ap_moe.cu): 3 or 4; 0: none (16-bit decode)
#define PW_B1 4
#endif

namespace b1 {
constexpr int FRAG_BYTES = 1024;  // one chunk's B fragments: 2 steps x 32 lanes x 16 bytes
constexpr float QMAX = 32767.f;
constexpr float ROUND_MAGIC = 12582912.f;  // 1.5 * 2^23: v + this has round(v) in its low mantissa bits (|v| < 2^22)
constexpr int ROUND_BITS = 0x4B400000;     // ROUND_MAGIC's bits: the bits of ROUND_MAGIC + X are ROUND_BITS + X

constexpr int LUT_BYTES = 512;    // a warp's LUT rows in shared memory: 16 rows x up to 16 fp16 entries

// a lane's fp32 sums for its two rows: the 7 Moebius terms at q = 3; at q = 4 the 8 top codes, then those with plane 3
template <int Q>
constexpr int Y = Q == 3 ? 7 : 16;

// shared-memory bytes of one token's staged chunks: the fragments, then per chunk its fp32 scale s, then s * sum_k X_k
__host__ __device__ constexpr int stage_bytes(int nchunks) { return nchunks * (FRAG_BYTES + 8); }
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
// at float index c after the fragments, with SUMS (q = 3) its s * sum_k X_k at float index nchunks + c, and plane
// m = 8 nt + g of word w = 16 c + 4 t + 2 i + h (bit e = column 32 w + e) at u32 index
// ((c * 2 + i) * 32 + 4 g + t) * 4 + 2 nt + h, so lane 4 g + t of step i reads its B fragments of both n-tiles as one
// 16-byte load. Each thread converts one 32-column word at a time; the 16 lanes of a chunk agree on its scale (and add
// up its X) with shuffles. The last loop trip of a warp may be partial: all its lanes still take part in the shuffles.
template <bool BF, int THREADS, bool SUMS>
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
        u32 q[32];  // low 16 bits: X in two's complement; as an int, ROUND_BITS + X
#pragma unroll
        for (int e = 0; e < 32; ++e) q[e] = __float_as_uint(fmaf(act2f<BF>((u16)half_of(v, e)), inv, ROUND_MAGIC));
        int xsum = 0;  // with SUMS, sum_k X_k of the chunk: at most 512 x 32767 < 2^24, exact as a float
        if constexpr (SUMS) {
            u32 all = 0;  // the q add up to 32 ROUND_BITS + sum X, modulo 2^32
#pragma unroll
            for (int e = 0; e < 32; ++e) all += q[e];
            xsum = static_cast<int>(all - 32u * static_cast<u32>(ROUND_BITS));
#pragma unroll
            for (int o = 1; o < 16; o <<= 1) xsum += __shfl_xor_sync(PW_FULL_MASK, xsum, o);
        }
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
            if ((w & 15) == 0) {
                scale[c] = m / QMAX;
                if constexpr (SUMS) scale[nchunks + c] = m / QMAX * static_cast<float>(xsum);
            }
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

// Term T's mask for one mma A fragment (the Moebius form, used at Q = 3): the AND of the planes of T's code bits (code
// bit b is plane Q - 1 - b; plane 0 is the code's MSB). A[j]: plane j's four words of the fragment.
template <int T, int Q>
__device__ __forceinline__ void term_mask(const u32 (&A)[Q][4], u32 (&a)[4]) {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        u32 m = ~0u;
#pragma unroll
        for (int b = 0; b < Q; ++b)
            if (T >> b & 1) m &= A[Q - 1 - b][k];
        a[k] = m;
    }
}

__device__ __forceinline__ void bmma(int (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k256.row.col.s32.b1.b1.s32.and.popc {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Term T (1 .. 7) of one chunk at Q = 3: y[T - 1][rr] += s * (the lane's planes' weighted popcounts of row g + 8 rr) over
// the columns of T's mask. Lane (g, t) holds mma columns 2t, 2t + 1 of n-tiles 0 and 1, planes 2t, 2t + 1, 8 + 2t,
// 9 + 2t: weights 2^2t * (1, 2, 256, +-512), the factor 2^2t applied once at the end (b1::finish). A[i][j]: plane j's
// words of step i's fragment.
template <int T, int Q>
__device__ __forceinline__ void term_step(const u32 (&A)[2][Q][4], const u32x4 (&B)[2], int w15, float s,
                                          float (&y)[Y<Q>][2]) {
    static_assert(Q == 3, "q = 4 keeps the one-hot form (code_step)");
    int d[4] = {0, 0, 0, 0}, e[4] = {0, 0, 0, 0};
#pragma unroll
    for (int i = 0; i < 2; ++i) {  // words 2i (k-slot t) and 2i + 1 (k-slot 4 + t) of the lane's four
        u32 a[4];
        term_mask<T, Q>(A[i], a);
        bmma(d, a, B[i].x, B[i].y);
        bmma(e, a, B[i].z, B[i].w);
    }
    y[T - 1][0] = fmaf(s, (float)(d[0] + 2 * d[1] + 256 * e[0] + w15 * e[1]), y[T - 1][0]);
    y[T - 1][1] = fmaf(s, (float)(d[2] + 2 * d[3] + 256 * e[2] + w15 * e[3]), y[T - 1][1]);
    if constexpr (T + 1 < (1 << Q)) term_step<T + 1, Q>(A, B, w15, s, y);
}

template <int C>  // columns whose 3-bit code (plane 0 its MSB) is C
__device__ __forceinline__ u32 onehot(u32 p0, u32 p1, u32 p2) {
    return ((C & 4) ? p0 : ~p0) & ((C & 2) ? p1 : ~p1) & ((C & 1) ? p2 : ~p2);
}

// code C of one chunk (the one-hot form, used at Q = 4): y[C][rr] += s * (the lane's planes' weighted popcounts of row
// g + 8 rr) over the columns whose top-3 code is C, y[8 + C][rr] the same over those of them whose plane 3 (the code's
// LSB) is set. Lanes and weights as in term_step. P[rr][j][u]: plane j of row g + 8 rr, word 4t + u of the chunk.
template <int C>
__device__ __forceinline__ void code_step(const u32 (&P)[2][4][4], const u32x4 (&B)[2], int w15, float s,
                                          float (&y)[Y<4>][2]) {
    int d[2][4] = {}, e[2][4] = {};
#pragma unroll
    for (int i = 0; i < 2; ++i) {  // words 2i (k-slot t) and 2i + 1 (k-slot 4 + t) of the lane's four
        const u32 a[4] = {onehot<C>(P[0][0][2 * i], P[0][1][2 * i], P[0][2][2 * i]),
                          onehot<C>(P[1][0][2 * i], P[1][1][2 * i], P[1][2][2 * i]),
                          onehot<C>(P[0][0][2 * i + 1], P[0][1][2 * i + 1], P[0][2][2 * i + 1]),
                          onehot<C>(P[1][0][2 * i + 1], P[1][1][2 * i + 1], P[1][2][2 * i + 1])};
        bmma(d[0], a, B[i].x, B[i].y);
        bmma(e[0], a, B[i].z, B[i].w);
        const u32 a3[4] = {a[0] & P[0][3][2 * i], a[1] & P[1][3][2 * i], a[2] & P[0][3][2 * i + 1],
                           a[3] & P[1][3][2 * i + 1]};
        bmma(d[1], a3, B[i].x, B[i].y);
        bmma(e[1], a3, B[i].z, B[i].w);
    }
#pragma unroll
    for (int v = 0; v < 2; ++v) {
        y[8 * v + C][0] = fmaf(s, (float)(d[v][0] + 2 * d[v][1] + 256 * e[v][0] + w15 * e[v][1]), y[8 * v + C][0]);
        y[8 * v + C][1] = fmaf(s, (float)(d[v][2] + 2 * d[v][3] + 256 * e[v][2] + w15 * e[v][3]), y[8 * v + C][1]);
    }
}

// One chunk (cl) of a warp's 16 rows: P holds its plane words, planes 0..2 nibble-packed (unpacked here, in place at
// Q = 4); at Q = 3 ysum gathers the chunks' s * sum_k X_k.
template <int Q>
__device__ __forceinline__ void chunk(u32 (&P)[2][Q][4], const char* xs, int nchunks, int cl, float (&y)[Y<Q>][2],
                                      float& ysum) {
    static_assert(Q == 3 || Q == 4, "the binary decode serves 3 and 4 bits");
    const int lane = threadIdx.x & 31;
    const u32x4* frag = reinterpret_cast<const u32x4*>(xs) + cl * 64 + lane;
    const u32x4 B[2] = {frag[0], frag[32]};
    const float* scale = reinterpret_cast<const float*>(xs + nchunks * FRAG_BYTES);
    const float s = scale[cl];
    const int w15 = (lane & 3) == 3 ? -512 : 512;  // plane 15 (lane t = 3, n-tile 1, column 1) is the sign
    if constexpr (Q == 3) {
        ysum += scale[nchunks + cl];
        u32 A[2][Q][4];  // A[i][j]: plane j's words of step i's fragment: rows g, g + 8 of words 2i, then of 2i + 1
#pragma unroll
        for (int i = 0; i < 2; ++i)
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                const int rr = k & 1, u = 2 * i + (k >> 1);
                u32 n0 = P[rr][0][u], n1 = P[rr][1][u], n2 = P[rr][2][u];
                unnibble(n0, n1, n2);
                A[i][0][k] = n0;
                A[i][1][k] = n1;
                A[i][2][k] = n2;
            }
        term_step<1, Q>(A, B, w15, s, y);
    } else {
#pragma unroll
        for (int rr = 0; rr < 2; ++rr)
#pragma unroll
            for (int u = 0; u < 4; ++u) unnibble(P[rr][0][u], P[rr][1][u], P[rr][2][u]);
        code_step<0>(P, B, w15, s, y);
        code_step<1>(P, B, w15, s, y);
        code_step<2>(P, B, w15, s, y);
        code_step<3>(P, B, w15, s, y);
        code_step<4>(P, B, w15, s, y);
        code_step<5>(P, B, w15, s, y);
        code_step<6>(P, B, w15, s, y);
        code_step<7>(P, B, w15, s, y);
    }
}

// entry c of 8 fp16 LUT entries (a 16-byte load) as a float in the activation dtype's precision
template <bool BF>
__device__ __forceinline__ float lut_entry(const u32x4& v, int c) {
    const u32 w[4] = {v.x, v.y, v.z, v.w};
    return act2f<BF>(lut2act<BF>((u16)((w[c >> 1] >> (16 * (c & 1))) & 0xffffu)));
}

// The warp's result for rows g and g + 8 (every lane of the row gets the sum of its four lanes), with the rows' LUTs in
// lut_s (`lut_copy`, in the activation dtype's precision, as the 16-bit decode uses them). At Q = 3 each row's LUT is
// turned into its Moebius coefficients a_T in place and the result is sum_T a_T y[T - 1] + a_{} ysum. At Q = 4, where
// code 2C + 1 is top code C with plane 3 set, it is sum_C LUT[2C] y[C] + (LUT[2C + 1] - LUT[2C]) y[8 + C].
template <bool BF, int Q>
__device__ __forceinline__ void finish(const float (&y)[Y<Q>][2], float ysum, const char* lut_s, float (&out)[2]) {
    const int g = (threadIdx.x & 31) >> 2;
    const float lane_weight = (float)(1 << (2 * (threadIdx.x & 3)));
    lut_wait();
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
        float a[1 << Q];
#pragma unroll
        for (int h = 0; h < Q - 2; ++h) {
            const u32x4 piece = lut_piece<Q>(lut_s, g + 8 * rr, h);
#pragma unroll
            for (int c = 0; c < 8; ++c) a[8 * h + c] = lut_entry<BF>(piece, c);
        }
        float acc = 0.f;
        if constexpr (Q == 3) {
#pragma unroll
            for (int b = 1; b < 8; b <<= 1)
#pragma unroll
                for (int c = 0; c < 8; ++c)
                    if (c & b) a[c] -= a[c ^ b];
#pragma unroll
            for (int t = 1; t < 8; ++t) acc = fmaf(a[t], y[t - 1][rr], acc);
        } else {
#pragma unroll
            for (int c = 0; c < 8; ++c) {
                acc = fmaf(a[2 * c], y[c][rr], acc);
                acc = fmaf(a[2 * c + 1] - a[2 * c], y[8 + c][rr], acc);
            }
        }
        acc *= lane_weight;
        acc += __shfl_xor_sync(PW_FULL_MASK, acc, 1);
        acc += __shfl_xor_sync(PW_FULL_MASK, acc, 2);
        out[rr] = Q == 3 ? fmaf(a[0], ysum, acc) : acc;
    }
}
}  // namespace b1
