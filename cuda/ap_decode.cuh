// Bit-plane decoders of the AP MoE kernel: plane words (top three nibble-packed) -> 16-bit mma A-fragment
// values (register LUTs looked up with prmt at q = 3, 4; byte codes and a shared-memory LUT otherwise).
#pragma once
#include "pw_common.cuh"

__device__ __forceinline__ u32 shr_rt(u32 w, int s) { return s >= 0 ? (w >> s) : (w << (-s)); }

// ---------------------------------------------------------------- decoders
// Planes 0..2 are nibble-packed on the device (pwruntime/kernels/device_table.py): w[j], j < 3, holds in
// nibble s the 3-bit top code (plane 0 its MSB) of element j + 4s, and in bit 3 of nibble s plane j's bit of
// element 3 + 4s. Planes 3..7 are AP plane words (bit e = element e).

// nibble codes of the top three planes: element i + 4s -> nibble s (one AND for three phases of four)
__device__ __forceinline__ u32 top3(const u32* w, int i) {
    if (i < 3) return w[i] & 0x77777777u;
    return ((w[0] >> 1) & 0x44444444u) | ((w[1] >> 2) & 0x22222222u) | ((w[2] >> 3) & 0x11111111u);
}

// The register LUT of one row for decode3 / decode4 from its 2^Q entries (raw[h] = entries 8h..8h+7, Q - 2 of
// them loaded), each rounded to bf16 first for bf16 activations.
// q = 3: L[0..1] the low bytes of entries 0..3 and 4..7, L[2..3] their high bytes, L[4..7] unused (zero).
// q = 4: the table of the even codes (LUT[2c]) in L[0..3] and of the odd codes (LUT[2c + 1]) in L[4..7],
// each as low bytes of c = 0..3, 4..7 then high bytes; word u of raw[h] holds entries 2u, 2u + 1 of its 8,
// so byte sel of each word picks one parity.
template <int Q, bool BF>
__device__ __forceinline__ void reg_lut(const u32x4 (&raw)[2], u32 (&L)[8]) {
    static_assert(Q == 3 || Q == 4, "register LUTs serve q = 3 and 4");
    u32x4 e[2];
#pragma unroll
    for (int h = 0; h < Q - 2; ++h) {
        e[h] = raw[h];
        if constexpr (BF) {
            e[h].x = lut2act<BF>(e[h].x & 0xffffu) | ((u32)lut2act<BF>(e[h].x >> 16) << 16);
            e[h].y = lut2act<BF>(e[h].y & 0xffffu) | ((u32)lut2act<BF>(e[h].y >> 16) << 16);
            e[h].z = lut2act<BF>(e[h].z & 0xffffu) | ((u32)lut2act<BF>(e[h].z >> 16) << 16);
            e[h].w = lut2act<BF>(e[h].w & 0xffffu) | ((u32)lut2act<BF>(e[h].w >> 16) << 16);
        }
    }
    if constexpr (Q == 3) {
        L[0] = prmt(e[0].x, e[0].y, 0x6420u);  // low bytes of entries 0..3
        L[1] = prmt(e[0].z, e[0].w, 0x6420u);  // low bytes of entries 4..7
        L[2] = prmt(e[0].x, e[0].y, 0x7531u);  // high bytes of entries 0..3
        L[3] = prmt(e[0].z, e[0].w, 0x7531u);  // high bytes of entries 4..7
#pragma unroll
        for (int k = 4; k < 8; ++k) L[k] = 0u;
    } else {
        const auto gather = [](const u32x4& v, u32 sel) { return prmt(prmt(v.x, v.y, sel), prmt(v.z, v.w, sel), 0x5410u); };
#pragma unroll
        for (int t4 = 0; t4 < 4; ++t4) {  // even low, even high, odd low, odd high bytes
            const u32 sel = 0x0040u + 0x0011u * t4;
            L[2 * t4] = gather(e[0], sel);      // codes of c = 0..3
            L[2 * t4 + 1] = gather(e[1], sel);  // c = 4..7
        }
    }
}

// q = 3: A[0..1] = pairs (s0,s1), (s2,s3) of elements i + 4s, s = 0..3; A[2..3] the same for s = 4..7
__device__ __forceinline__ void decode3(const u32* w, int i, const u32 (&L)[8], u32 (&A)[4]) {
    const u32 n = top3(w, i);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const u32 s = h ? (n >> 16) : n;
        const u32 lo = prmt(L[0], L[1], s), hi = prmt(L[2], L[3], s);
        A[2 * h] = prmt(lo, hi, 0x5140u);
        A[2 * h + 1] = prmt(lo, hi, 0x7362u);
    }
}

// q = 4: code = 2 * top3 + plane 3, so plane 3 selects between the tables of the even codes (L[0..3], entry c
// = LUT[2c]) and the odd codes (L[4..7], LUT[2c + 1]), both indexed by the top code.
// P1 = w3 << (7 - i) puts element i + 8b at the sign of byte b, P2 = w3 << (3 - i) element i + 4 + 8b;
// prmt with sign-replicating selectors turns them into per-byte masks in nibble order.
__device__ __forceinline__ void decode4(const u32* w, int i, const u32 (&L)[8], u32 (&A)[4]) {
    const u32 n = top3(w, i);
    const u32 p1 = w[3] << (7 - i), p2 = w[3] << (3 - i);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const u32 s = h ? (n >> 16) : n;
        const u32 m = prmt(p1, p2, h ? 0xFBEAu : 0xD9C8u);
        const u32 lo = (prmt(L[0], L[1], s) & ~m) | (prmt(L[4], L[5], s) & m);
        const u32 hi = (prmt(L[2], L[3], s) & ~m) | (prmt(L[6], L[7], s) & m);
        A[2 * h] = prmt(lo, hi, 0x5140u);
        A[2 * h + 1] = prmt(lo, hi, 0x7362u);
    }
}

// q >= 5: byte b of C[i] = the q-bit code of element i + 8b. The low q - 3 code bits come from an 8x8 bit
// transpose inside each byte lane (SWAR over the 4 bytes of a word) of planes 3..q-1, fed MSB-last so row k
// of the matrix is code bit k (rows q-3..7 are zero and fold away); the top three bits come straight from
// the packed words: element i + 8b sits in nibble 2b + i / 4 of w[i % 4] (bit 3 of the nibbles of w[0..2]
// when i % 4 == 3).
template <int Q>
__device__ __forceinline__ void byte_codes(const u32* w, u32 (&r)[8]) {
#pragma unroll
    for (int k = 0; k < 8; ++k) r[k] = k < Q - 3 ? w[Q - 1 - k] : 0u;
    transpose8x8(r);
    constexpr int LO = Q - 3;  // the top code's shift inside a byte
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const int sh = 4 * (i >> 2) - LO;  // one shift + one AND-OR a term
        if ((i & 3) < 3) {
            r[i] |= shr_rt(w[i & 3], sh) & (0x07070707u << LO);
        } else {
            r[i] |= shr_rt(w[0], sh + 1) & (0x04040404u << LO);
            r[i] |= shr_rt(w[1], sh + 2) & (0x02020202u << LO);
            r[i] |= shr_rt(w[2], sh + 3) & (0x01010101u << LO);
        }
    }
}

// Shared-memory LUT of one warp (byte path): entry `code` of m-row m, replica r, at byte code * 32 R + r * 32 +
// (m & 7) * 4 + (m >> 3) * 2, so row g (and g + 8) of replica r lives in bank 8 r + g (mod 32) only. Lane (g, t)
// reads replica t % R: with R = 4 the 32 lanes of a lookup hit 32 distinct banks; with R = 1 the 4 lanes of
// one row share 4 banks (about 2-way conflicts on random codes). A row group's 8 KiB slice holds 256 / 2^Q
// replicas at Q bits, so R = 4 up to 6 bits, 2 at 7 and 1 at 8 (a 16 KiB one: 4 at 7, 2 at 8).
#ifndef PW_LUTREP
#define PW_LUTREP 1
#endif
// Slices of 16 KiB (PW_LUTWIDE): twice the replicas at 7-8 bits. Only the single block's 16-warp build has them: its CTA
// holds its SM alone whatever its shared memory (moe.BLOCK_LUT_SLICE must match).
#ifndef PW_LUTWIDE
#if defined(PW_WARPS) && PW_WARPS == 16
#define PW_LUTWIDE 1
#else
#define PW_LUTWIDE 0
#endif
#endif
constexpr int LUT_SLICE_CODES = PW_LUTWIDE ? 512 : 256;  // codes x replicas a slice holds
template <int Q>
__host__ __device__ constexpr int lut_reps() {
    return (PW_LUTREP && Q >= 5) ? ((LUT_SLICE_CODES >> Q) < 4 ? (LUT_SLICE_CODES >> Q) : 4) : 1;
}

// The lookup address is code * stride + row_base: a 32-bit shared-window address and the stride (32 R bytes) in
// a register the caller keeps opaque to the compiler, so it is one IMAD, where a generic pointer cost a shift
// and a three-input add with the window base (one instruction fewer a lookup: 5-6 bits 7-11% faster, NOTES).
__device__ __forceinline__ u32 lut_lookup(u32 row_base, u32 stride, u32 C, int b) {
    const u32 code = prmt(C, 0u, 0x4440u | b);  // byte b, zero-extended
    return lds_u16(code * stride + row_base);
}

__device__ __forceinline__ void decode_bytes(const u32 C, u32 row_base, u32 stride, u32 (&A)[2]) {
    A[0] = lut_lookup(row_base, stride, C, 0) | (lut_lookup(row_base, stride, C, 1) << 16);
    A[1] = lut_lookup(row_base, stride, C, 2) | (lut_lookup(row_base, stride, C, 3) << 16);
}

// One 32-column word of a row -> its 32 values in the activation dtype as 16 pairs of consecutive elements (out[p]:
// element 2p in the low half, 2p + 1 in the high). w: the row's plane words of that word (the top three
// nibble-packed; w[Q..7] unused). q = 3, 4 look codes up in the row's register LUT L (reg_lut); q >= 5 call
// look(code), which gives the entry of a code (0 .. 2^Q - 1) in the activation dtype.
template <int Q, typename Look>
__device__ __forceinline__ void decode_word32(const u32 (&w)[8], const u32 (&L)[8], Look look, u32 (&out)[16]) {
    if constexpr (Q <= 4) {
        u32 A[4][4];  // A[i][h]: elements i + 8h (low half) and i + 8h + 4
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            if constexpr (Q == 3) decode3(w, i, L, A[i]);
            else decode4(w, i, L, A[i]);
        }
#pragma unroll
        for (int i0 = 0; i0 < 4; i0 += 2)
#pragma unroll
            for (int h = 0; h < 4; ++h) {
                out[i0 / 2 + 4 * h] = prmt(A[i0][h], A[i0 + 1][h], 0x5410u);      // elements i0 + 8h, +1
                out[i0 / 2 + 4 * h + 2] = prmt(A[i0][h], A[i0 + 1][h], 0x7632u);  // elements i0 + 8h + 4, +5
            }
    } else {
        u32 C[8];  // byte b of C[i]: the code of element i + 8b
        byte_codes<Q>(w, C);
#pragma unroll
        for (int i = 0; i < 8; i += 2)
#pragma unroll
            for (int b = 0; b < 4; ++b)
                out[i / 2 + 4 * b] = look((C[i] >> (8 * b)) & 0xffu) | (look((C[i + 1] >> (8 * b)) & 0xffu) << 16);
    }
}
