// Shared device helpers for PagedWeight kernels: 16-bit float conversions, prmt, mma, loads.
//
// No CUDA headers are included on purpose: the sources compile the same under NVRTC (CuPy
// RawModule) and nvcc, and fp16/bf16 values travel as raw 16-bit patterns (unsigned short).
// Activation dtype is chosen at compile time with PW_BF16 (0 = fp16, 1 = bf16).
#pragma once

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned long long u64;

struct alignas(8) u32x2 { u32 x, y; };
struct alignas(16) u32x4 { u32 x, y, z, w; };

#define PW_FULL_MASK 0xffffffffu

__device__ __forceinline__ float h2f(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
__device__ __forceinline__ u16 f2h(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
__device__ __forceinline__ float bf2f(u16 h) { return __uint_as_float(((u32)h) << 16); }
__device__ __forceinline__ u16 f2bf(float f) {
    u16 h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

// activation <-> float for the compile-time activation dtype
template <bool BF> __device__ __forceinline__ float act2f(u16 v) { return BF ? bf2f(v) : h2f(v); }
template <bool BF> __device__ __forceinline__ u16 f2act(float v) { return BF ? f2bf(v) : f2h(v); }
// an fp16 LUT entry in the activation dtype (bf16 activations: the centroid rounded to bf16)
template <bool BF> __device__ __forceinline__ u16 lut2act(u16 h) { return BF ? f2bf(h2f(h)) : h; }

// prmt.b32 in its default mode: selector nibble bit 3 replicates the selected byte's sign bit.
__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 sel) {
    u32 r;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
    return r;
}

// compile-time signed shift: right by S (left when S < 0)
template <int S> __device__ __forceinline__ u32 shr(u32 w) {
    if constexpr (S >= 0) return w >> S;
    else return w << (-S);
}

// read-only global loads (plane words are immutable while a kernel runs)
__device__ __forceinline__ u32x2 ldg_nc_v2(const u32* p) {
    u32x2 r;
    asm("ld.global.nc.v2.u32 {%0, %1}, [%2];" : "=r"(r.x), "=r"(r.y) : "l"(p));
    return r;
}
__device__ __forceinline__ u16 ldg_nc_u16(const u16* p) {
    u16 r;
    asm("ld.global.nc.u16 %0, [%1];" : "=h"(r) : "l"(p));
    return r;
}
__device__ __forceinline__ u32 ldg_nc(const u32* p) {
    u32 r;
    asm("ld.global.nc.u32 %0, [%1];" : "=r"(r) : "l"(p));
    return r;
}
__device__ __forceinline__ u32x4 ldg_nc_v4(const void* p) {
    u32x4 r;
    asm("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    return r;
}
// plane-word loads with an L2 prefetch-size hint (PW_L2PF bytes: 0 = none, 64, 128 or 256): a warp reads
// 32 or 64 bytes of a row per load and the rest of the row soon after, so a larger L2 fill turns the later
// reads into L2 hits and the DRAM sees longer bursts
#ifndef PW_L2PF  // 128 measured a few percent faster than none or 256 on the H200 (cuda/NOTES.md)
#define PW_L2PF 128
#endif
#if PW_L2PF == 0
#define PW_PF_HINT ""
#elif PW_L2PF == 64
#define PW_PF_HINT ".L2::64B"
#elif PW_L2PF == 128
#define PW_PF_HINT ".L2::128B"
#else
#define PW_PF_HINT ".L2::256B"
#endif
__device__ __forceinline__ u32x4 ldg_plane_v4(const u32* p) {
    u32x4 r;
    asm("ld.global.nc" PW_PF_HINT ".v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    return r;
}
__device__ __forceinline__ u32x2 ldg_plane_v2(const u32* p) {
    u32x2 r;
    asm("ld.global.nc" PW_PF_HINT ".v2.u32 {%0, %1}, [%2];" : "=r"(r.x), "=r"(r.y) : "l"(p));
    return r;
}

// element e of 32 16-bit values held as 16 pairs (element 2i in the low half of v[i]), zero-extended
__device__ __forceinline__ u32 half_of(const u32 (&v)[16], int e) {
    return (e & 1) ? (v[e >> 1] >> 16) : (v[e >> 1] & 0xffffu);
}

// 32 consecutive 16-bit activations as 16 pairs (element 2i in the low half of v[i]); elements at or past n_valid read
// as zero. `vec`: p is 16-byte aligned, so a full run is four 16-byte loads.
__device__ __forceinline__ void load_act32(const u16* p, int n_valid, bool vec, u32 (&v)[16]) {
    if (vec && n_valid >= 32) {
#pragma unroll
        for (int q4 = 0; q4 < 4; ++q4) {
            const u32x4 r = ldg_nc_v4(p + 8 * q4);
            v[4 * q4 + 0] = r.x;
            v[4 * q4 + 1] = r.y;
            v[4 * q4 + 2] = r.z;
            v[4 * q4 + 3] = r.w;
        }
    } else {
#pragma unroll
        for (int e = 0; e < 32; e += 2) {
            const u32 lo = e < n_valid ? (u32)p[e] : 0u;
            const u32 hi = e + 1 < n_valid ? (u32)p[e + 1] : 0u;
            v[e >> 1] = lo | (hi << 16);
        }
    }
}

// 8x8 bit transpose inside each byte lane of r[0..7] (SWAR over the 4 bytes of a word): bit j of byte b of r[i]
// <-> bit i of byte b of r[j]
__device__ __forceinline__ void transpose8x8(u32 (&r)[8]) {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        const u32 x = ((r[k] >> 4) ^ r[k + 4]) & 0x0F0F0F0Fu;
        r[k + 4] ^= x;
        r[k] ^= x << 4;
    }
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        if (k & 2) continue;
        const u32 x = ((r[k] >> 2) ^ r[k + 2]) & 0x33333333u;
        r[k + 2] ^= x;
        r[k] ^= x << 2;
    }
#pragma unroll
    for (int k = 0; k < 8; k += 2) {
        const u32 x = ((r[k] >> 1) ^ r[k + 1]) & 0x55555555u;
        r[k + 1] ^= x;
        r[k] ^= x << 1;
    }
}

// loads that bypass L1 (data written by other blocks of the same launch): the builtin is an
// ordinary load to the compiler, so __threadfence/__syncthreads order it and independent ones overlap
__device__ __forceinline__ float ldcg_f32(const float* p) { return __ldcg(p); }

// 16-bit shared-memory load at a 32-bit shared-window address, zero-extended (volatile: kept after the
// barrier that publishes what it reads)
__device__ __forceinline__ u32 lds_u16(u32 addr) {
    u32 v;
    asm volatile("ld.shared.u16 %0, [%1];" : "=r"(v) : "r"(addr));
    return v;
}

// D = A * B + D, m16n8k16, fp32 accumulators; A row-major (4 regs), B col-major (2 regs)
template <bool BF>
__device__ __forceinline__ void mma16816(float (&c)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    if constexpr (BF) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%0,%1,%2,%3};"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    } else {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%0,%1,%2,%3};"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    }
}

// Programmatic dependent launch (sm_90; no-ops when the launch did not ask for it): a kernel lets the next
// one start early, and the next one waits here before it reads what the first one writes.
__device__ __forceinline__ void pdl_launch_dependents() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }
__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }

__device__ __forceinline__ float silu_f(float g) { return g / (1.0f + __expf(-g)); }

// The experts' gate activation: SiLU, or with PW_GELU the tanh-approximated GELU (Gemma 4; torch's
// F.gelu(g, approximate="tanh")).
#ifndef PW_GELU
#define PW_GELU 0
#endif
__device__ __forceinline__ float act_f(float g) {
#if PW_GELU
    return 0.5f * g * (1.0f + tanhf(0.7978845608028654f * (g + 0.044715f * g * g * g)));
#else
    return silu_f(g);
#endif
}
