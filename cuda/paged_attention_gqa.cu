// Paged-attention decode for fp16/bf16 caches, one CTA per (sequence, KV head, head slice, context part):
// the CTA serves G query heads of its KV head (all of them, or a slice when the group is larger than the
// registers allow), so each K/V row is read once or once per slice (cuda/paged_attention.cu, the fallback
// for fp32 and other shapes, reads it once per query head).
//
// Cache layout as in paged_attention.cu; the caches' addresses come from `kv_ptrs` (two u64: K, V) when it is not
// null, else from kc_arg / vc_arg. LPT = D / EPL lanes read one token's K and V rows, EPL elements a lane in
// 16-byte loads (8 elements: one load; 512-wide heads, Gemma 4's global layers: 16, two loads); a warp takes
// TPW = 32 / LPT tokens a step and UNROLL steps are loaded before the first use.
// Each (lane group, head) keeps an online softmax; the warp's token groups merge by shuffles and the
// warps through shared memory. With gridDim.z = P > 1 the context is cut into P parts of part_tokens
// (flash-decoding, for few sequences over long contexts): each part writes its max, sum and normalized
// output in fp32 and pw_paged_attention_merge combines them. `window` > 0 (a sliding-window layer) keeps only a
// context's last `window` tokens (the parts then cut those), 0 all of them. fp32 math throughout.
// Compile-time: PW_DT (0 fp16, 1 bf16), PW_D (64, 128, 256, 512), PW_G (query heads a CTA serves); at run time
// `group` = query heads per KV head, a multiple of PW_G; gridDim.y = kv_heads * group / PW_G.
#include "pw_common.cuh"

#ifndef PW_DT
#define PW_DT 0
#endif
#ifndef PW_D
#define PW_D 128
#endif
#ifndef PW_G
#define PW_G 4
#endif

namespace {
constexpr bool BFA = PW_DT == 1;
constexpr int D = PW_D, G = PW_G;
constexpr int WARPS = 8;
// token steps loaded before the first use: 512-wide heads keep 2, so a CTA fits in 128 registers and two share an SM
// (4 took 174 and one CTA an SM); 256-wide heads 8 at G <= 2 (127 registers, still two CTAs; session 48's sweep,
// cuda/NOTES.md), but 4 at G 3 and 4, where 8 took 152-172 registers (nvcc 13.0) and one CTA an SM
constexpr int UNROLL = D == 512 ? 2 : D == 256 ? (G <= 2 ? 8 : 4) : 4;
constexpr int THREADS = 32 * WARPS;
constexpr int EPL = D > 256 ? D / 32 : 8;   // elements a lane holds of a row
constexpr int VEC = EPL / 8;                 // its 16-byte loads a row
constexpr int LPT = D / EPL;                 // lanes per token row
constexpr int TPW = 32 / LPT;                // tokens per warp step
static_assert(D == 64 || D == 128 || D == 256 || D == 512, "PW_D must be 64, 128, 256 or 512");
static_assert(WARPS * G * D * 4 <= 32768, "shared merge buffer too large: use the generic kernel");
}  // namespace
#define NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ void unpack8(const u32x4 v, float (&f)[8]) {
    const u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        f[2 * i] = act2f<BFA>((u16)(w[i] & 0xffffu));
        f[2 * i + 1] = act2f<BFA>((u16)(w[i] >> 16));
    }
}

extern "C" __global__ void __launch_bounds__(THREADS) pw_paged_attention_gqa(
    const u16* __restrict__ q, long long q_stride, const u16* kc_arg, const u16* vc_arg,
    const u64* __restrict__ kv_ptrs, const int* __restrict__ block_tables, int max_blocks,
    const int* __restrict__ context_lens, int kv_heads, int group, int block_size, float scale,
    u16* __restrict__ out, long long out_stride, int part_tokens, float* __restrict__ part_ml,
    float* __restrict__ part_o, int window) {
    // the caches through the pointer table when given (KVCache.ptrs: a captured graph survives a resize)
    const u16* __restrict__ kc = kv_ptrs ? reinterpret_cast<const u16*>(kv_ptrs[0]) : kc_arg;
    const u16* __restrict__ vc = kv_ptrs ? reinterpret_cast<const u16*>(kv_ptrs[1]) : vc_arg;
    __shared__ float s_m[WARPS][G], s_l[WARPS][G];
    __shared__ float s_acc[WARPS][G][D];
    const int s = blockIdx.x, kvh = blockIdx.y / (group / G), h0 = kvh * group + blockIdx.y % (group / G) * G;
    const int part = blockIdx.z, parts = gridDim.z;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, sub = lane / LPT, hl = lane % LPT;
    const int L = context_lens[s];
    const int first = window > 0 ? max(0, L - window) : 0;   // the earliest token the query sees
    const int begin = first + (parts > 1 ? part * part_tokens : 0);
    const int end = parts > 1 ? min(L, begin + part_tokens) : L;

    float qv[G][EPL], m[G], l[G], acc[G][EPL];
#pragma unroll
    for (int g = 0; g < G; ++g) {
#pragma unroll
        for (int c = 0; c < VEC; ++c) {
            float f[8];
            unpack8(ldg_nc_v4(q + (long long)s * q_stride + (long long)(h0 + g) * D + hl * EPL + c * 8), f);
#pragma unroll
            for (int i = 0; i < 8; ++i) qv[g][c * 8 + i] = f[i] * scale, acc[g][c * 8 + i] = 0.f;
        }
        m[g] = NEG_INF;
        l[g] = 0.f;
    }

    const long long row_stride = (long long)kv_heads * D;
    const int* table = block_tables + (long long)s * max_blocks;
    for (int base = begin + warp * TPW * UNROLL; base < end; base += WARPS * TPW * UNROLL) {  // warp-uniform
        u32x4 kr[UNROLL][VEC], vr[UNROLL][VEC];
        bool valid[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {  // every load of the step first
            const int tok = base + u * TPW + sub;
            valid[u] = tok < end;
#pragma unroll
            for (int c = 0; c < VEC; ++c) kr[u][c] = vr[u][c] = u32x4{0u, 0u, 0u, 0u};
            if (valid[u]) {
                const long long off = ((long long)table[tok / block_size] * block_size + tok % block_size) * row_stride +
                                      (long long)kvh * D + hl * EPL;
#pragma unroll
                for (int c = 0; c < VEC; ++c) {
                    kr[u][c] = ldg_nc_v4(kc + off + c * 8);
                    vr[u][c] = ldg_nc_v4(vc + off + c * 8);
                }
            }
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            float kf[EPL], vf[EPL];
#pragma unroll
            for (int c = 0; c < VEC; ++c) {
                float fk[8], fv[8];
                unpack8(kr[u][c], fk);
                unpack8(vr[u][c], fv);
#pragma unroll
                for (int i = 0; i < 8; ++i) kf[c * 8 + i] = fk[i], vf[c * 8 + i] = fv[i];
            }
#pragma unroll
            for (int g = 0; g < G; ++g) {
                float dot = 0.f;
#pragma unroll
                for (int i = 0; i < EPL; ++i) dot += qv[g][i] * kf[i];
#pragma unroll
                for (int o = LPT / 2; o > 0; o >>= 1) dot += __shfl_xor_sync(PW_FULL_MASK, dot, o);
                if (valid[u]) {
                    const float m_new = fmaxf(m[g], dot);
                    const float corr = __expf(m[g] - m_new), p = __expf(dot - m_new);
                    l[g] = l[g] * corr + p;
#pragma unroll
                    for (int i = 0; i < EPL; ++i) acc[g][i] = acc[g][i] * corr + p * vf[i];
                    m[g] = m_new;
                }
            }
        }
    }

    // merge the warp's token groups (lanes with the same hl), then the warps
#pragma unroll
    for (int o = LPT; o < 32; o <<= 1)
#pragma unroll
        for (int g = 0; g < G; ++g) {
            const float mo = __shfl_xor_sync(PW_FULL_MASK, m[g], o), lo = __shfl_xor_sync(PW_FULL_MASK, l[g], o);
            const float mn = fmaxf(m[g], mo);
            const float fs = l[g] > 0.f ? __expf(m[g] - mn) : 0.f, fo = lo > 0.f ? __expf(mo - mn) : 0.f;
            l[g] = l[g] * fs + lo * fo;
#pragma unroll
            for (int i = 0; i < EPL; ++i) acc[g][i] = acc[g][i] * fs + __shfl_xor_sync(PW_FULL_MASK, acc[g][i], o) * fo;
            m[g] = mn;
        }
    if (sub == 0) {
#pragma unroll
        for (int g = 0; g < G; ++g) {
            if (hl == 0) s_m[warp][g] = m[g], s_l[warp][g] = l[g];
#pragma unroll
            for (int i = 0; i < EPL; ++i) s_acc[warp][g][hl * EPL + i] = acc[g][i];
        }
    }
    __syncthreads();
    const int heads = kv_heads * group;
    for (int idx = threadIdx.x; idx < G * D; idx += THREADS) {
        const int g = idx / D, d = idx % D;
        float mt = NEG_INF;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) mt = fmaxf(mt, s_m[w][g]);
        float lt = 0.f, o = 0.f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) {
            const float f = s_l[w][g] > 0.f ? __expf(s_m[w][g] - mt) : 0.f;
            lt += s_l[w][g] * f;
            o += s_acc[w][g][d] * f;
        }
        const float val = lt > 0.f ? o / lt : 0.f;
        const int h = h0 + g;
        if (parts == 1) {
            out[(long long)s * out_stride + (long long)h * D + d] = f2act<BFA>(val);
        } else {
            const long long row = ((long long)s * heads + h) * parts + part;
            part_o[row * D + d] = val;
            if (d == 0) part_ml[2 * row] = mt, part_ml[2 * row + 1] = lt;
        }
    }
}

// Combines the P parts of each (sequence, head): out = sum_p w_p o_p / sum_p w_p, w_p = l_p exp(m_p - max m).
extern "C" __global__ void __launch_bounds__(D) pw_paged_attention_merge(
    const float* __restrict__ part_ml, const float* __restrict__ part_o, int parts, u16* __restrict__ out,
    long long out_stride) {
    const int s = blockIdx.x, h = blockIdx.y, heads = gridDim.y, d = threadIdx.x;
    const long long row0 = ((long long)s * heads + h) * parts;
    float mt = NEG_INF;
    int seen = 0, only = 0;   // parts that saw keys, and the last of them
    for (int p = 0; p < parts; ++p)
        if (part_ml[2 * (row0 + p) + 1] > 0.f) mt = fmaxf(mt, part_ml[2 * (row0 + p)]), ++seen, only = p;
    if (seen == 1) {   // its output as a kernel of one part writes it: (l o) / l may round o in its last bit
        out[(long long)s * out_stride + (long long)h * D + d] = f2act<BFA>(part_o[(row0 + only) * D + d]);
        return;
    }
    float wt = 0.f, o = 0.f;
    for (int p = 0; p < parts; ++p) {
        const float lp = part_ml[2 * (row0 + p) + 1];
        if (lp > 0.f) {
            const float w = lp * __expf(part_ml[2 * (row0 + p)] - mt);
            wt += w;
            o += w * part_o[(row0 + p) * D + d];
        }
    }
    out[(long long)s * out_stride + (long long)h * D + d] = f2act<BFA>(wt > 0.f ? o / wt : 0.f);
}
