// Paged-attention decode (one new query token per sequence) over the KV block table, with GQA.
//
// Cache layout (pwruntime/kv_cache.py): K, V [num_blocks, block_size, kv_heads, head_dim] per layer;
// block_tables [seqs, max_blocks] int32; context_lens [seqs] int32 = tokens to attend to (the new
// token's K/V already written); `window` > 0 (a sliding-window layer) keeps only the last `window` of them, 0 all.
// One CTA per (sequence, query head); its 4 warps take tokens
// round-robin with an online softmax each, then merge. Lane l holds head_dim/32 = DPL consecutive
// elements of q, of each K/V row and of the output. fp32 math; PW_DT: 0 fp16, 1 bf16, 2 fp32. The caches'
// addresses come from `kv_ptrs` (K, V) when it is not null (KVCache.ptrs), else from kc_arg / vc_arg.
#include "pw_common.cuh"

#ifndef PW_DT
#define PW_DT 0
#endif
#ifndef PW_DPL
#define PW_DPL 4
#endif

namespace {
constexpr int DPL = PW_DPL;
constexpr int WARPS = 4;
constexpr int THREADS = 32 * WARPS;
#if PW_DT == 2
typedef float elem_t;
__device__ __forceinline__ float to_f(float v) { return v; }
__device__ __forceinline__ float from_f(float v) { return v; }
#else
typedef u16 elem_t;
__device__ __forceinline__ float to_f(u16 v) { return act2f<PW_DT == 1>(v); }
__device__ __forceinline__ u16 from_f(float v) { return f2act<PW_DT == 1>(v); }
#endif
}  // namespace

extern "C" __global__ void __launch_bounds__(THREADS) pw_paged_attention_decode(
    const elem_t* __restrict__ q, long long q_stride, const elem_t* kc_arg, const elem_t* vc_arg,
    const unsigned long long* __restrict__ kv_ptrs, const int* __restrict__ block_tables, int max_blocks,
    const int* __restrict__ context_lens, int heads, int kv_heads, int block_size, float scale,
    elem_t* __restrict__ out, long long out_stride, int window) {
    // the caches through the pointer table when given (KVCache.ptrs: a captured graph survives a resize)
    const elem_t* __restrict__ kc = kv_ptrs ? reinterpret_cast<const elem_t*>(kv_ptrs[0]) : kc_arg;
    const elem_t* __restrict__ vc = kv_ptrs ? reinterpret_cast<const elem_t*>(kv_ptrs[1]) : vc_arg;
    constexpr int D = 32 * DPL;
    __shared__ float s_m[WARPS], s_l[WARPS];
    __shared__ float s_acc[WARPS][D];

    const int s = blockIdx.x, h = blockIdx.y;
    const int kvh = h / (heads / kv_heads);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int L = context_lens[s];
    const int first = window > 0 ? max(0, L - window) : 0;   // the earliest token the query sees

    float qv[DPL];
    const elem_t* qp = q + (long long)s * q_stride + (long long)h * D + lane * DPL;
#pragma unroll
    for (int i = 0; i < DPL; ++i) qv[i] = to_f(qp[i]) * scale;

    float m = __int_as_float(0xff800000), l = 0.f, acc[DPL];
#pragma unroll
    for (int i = 0; i < DPL; ++i) acc[i] = 0.f;

    const long long row_stride = (long long)kv_heads * D;
    for (int tok = first + warp; tok < L; tok += WARPS) {
        const int blk = block_tables[(long long)s * max_blocks + tok / block_size];
        const long long base = ((long long)blk * block_size + tok % block_size) * row_stride + (long long)kvh * D +
                               lane * DPL;
        float dot = 0.f;
#pragma unroll
        for (int i = 0; i < DPL; ++i) dot += qv[i] * to_f(kc[base + i]);
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) dot += __shfl_xor_sync(PW_FULL_MASK, dot, o);
        const float m_new = fmaxf(m, dot);
        const float corr = __expf(m - m_new);
        const float p = __expf(dot - m_new);
        l = l * corr + p;
#pragma unroll
        for (int i = 0; i < DPL; ++i) acc[i] = acc[i] * corr + p * to_f(vc[base + i]);
        m = m_new;
    }
    if (lane == 0) {
        s_m[warp] = m;
        s_l[warp] = l;
    }
#pragma unroll
    for (int i = 0; i < DPL; ++i) s_acc[warp][lane * DPL + i] = acc[i];
    __syncthreads();
    if (warp == 0) {
        float mt = __int_as_float(0xff800000);
#pragma unroll
        for (int w = 0; w < WARPS; ++w) mt = fmaxf(mt, s_m[w]);
        float lt = 0.f, o[DPL];
#pragma unroll
        for (int i = 0; i < DPL; ++i) o[i] = 0.f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) {
            const float f = s_l[w] > 0.f ? __expf(s_m[w] - mt) : 0.f;
            lt += s_l[w] * f;
#pragma unroll
            for (int i = 0; i < DPL; ++i) o[i] += s_acc[w][lane * DPL + i] * f;
        }
        const float inv = lt > 0.f ? 1.f / lt : 0.f;
        elem_t* op = out + (long long)s * out_stride + (long long)h * D + lane * DPL;
#pragma unroll
        for (int i = 0; i < DPL; ++i) op[i] = from_f(o[i] * inv);
    }
}
