// Routing prologue of the AP MoE kernel: from topk_ids, a CTA finds its active expert and the (token, slot)
// pairs routed to it, in shared memory, so one launch configuration serves any routing (CUDA graphs).
#pragma once
#include "pw_common.cuh"

namespace {
constexpr int MAX_TK = 1024;           // T * top-k slots held in shared memory
constexpr int MAX_EXPERT_WORDS = 32;   // bitmap words: E <= 1024
constexpr int MAX_TOK = 64;            // tokens per expert and launch
}  // namespace

// ---------------------------------------------------------------- routing prologue
// Active experts sorted ascending; CTA `a` takes the a-th. Its slots (t * topk + j) in ascending order.
// info: [0] expert (-1 if a >= number active), [1] number of active experts, [2] tokens of the expert.
template <int THREADS>
__device__ void route(const long long* __restrict__ topk_ids, int TK, int E, int a, int* s_ids, u32* s_bitmap,
                      int* s_slots, int* s_info) {
    const int tid = threadIdx.x;
    const int nwords = (E + 31) >> 5;
    for (int i = tid; i < MAX_EXPERT_WORDS; i += THREADS) s_bitmap[i] = 0u;
    __syncthreads();
    for (int i = tid; i < TK; i += THREADS) {
        const int e = static_cast<int>(topk_ids[i]);
        s_ids[i] = e;
        if (e >= 0 && e < E) atomicOr(&s_bitmap[e >> 5], 1u << (e & 31));
    }
    __syncthreads();
    if (tid < 32) {
        const int lane = tid;
        const u32 w = lane < nwords ? s_bitmap[lane] : 0u;
        const int pc = __popc(w);
        int incl = pc;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int v = __shfl_up_sync(PW_FULL_MASK, incl, o);
            if (lane >= o) incl += v;
        }
        const int total = __shfl_sync(PW_FULL_MASK, incl, 31);
        const int excl = incl - pc;
        const bool mine = a >= excl && a < incl;
        int e = -1;
        if (mine) {
            u32 ww = w;
            for (int r = a - excl; r > 0; --r) ww &= ww - 1u;
            e = lane * 32 + __ffs(ww) - 1;
        }
        const u32 who = __ballot_sync(PW_FULL_MASK, mine);
        e = who ? __shfl_sync(PW_FULL_MASK, e, __ffs(who) - 1) : -1;
        int cnt = 0;
        if (e >= 0) {
            for (int base = 0; base < TK; base += 32) {
                const int s = base + lane;
                const bool f = s < TK && s_ids[s] == e;
                const u32 m = __ballot_sync(PW_FULL_MASK, f);
                if (f) {
                    const int pos = cnt + __popc(m & ((1u << lane) - 1u));
                    if (pos < MAX_TOK) s_slots[pos] = s;
                }
                cnt += __popc(m);
            }
        }
        if (lane == 0) {
            s_info[0] = e;
            s_info[1] = total;
            s_info[2] = cnt < MAX_TOK ? cnt : MAX_TOK;
        }
    }
    __syncthreads();
}
