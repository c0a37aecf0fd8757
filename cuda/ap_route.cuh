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
// Active experts sorted ascending. Expert slot `a` (a CTA's blockIdx.x / n_tiles) below `primary` (min(E, T top-k))
// takes the a-th active expert's first token group; a slot from `primary` on (an overflow slot) takes, in order, the
// further groups of `G` tokens of the active experts in ascending order, counted in s_cnt (E ints of shared memory,
// touched only by overflow slots). So a launch of T tokens needs min(E, T top-k) slots plus at most
// (T top-k - 1) / G overflow slots, however the tokens are routed (pwruntime/kernels/moe.py overflow_slots), instead
// of a full set of slots for every token group. An expert's slots (t * topk + j) are listed in ascending order.
// info: [0] expert (-1: no work for this slot), [1] number of active experts, [2] tokens of the expert, [4] the
// slot's token group.
__device__ __forceinline__ int extra_groups(int n, int G) { return n > 0 ? (min(n, MAX_TOK) - 1) / G : 0; }

// the sum of v over lanes 0..lane (all 32 lanes call it)
__device__ __forceinline__ int warp_inclusive_sum(int v, int lane) {
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int u = __shfl_up_sync(PW_FULL_MASK, v, o);
        if (lane >= o) v += u;
    }
    return v;
}

// OVER: the slot is an overflow slot (a >= primary); the two cases are compiled apart, so a first-group slot runs
// exactly the prologue it ran before overflow slots existed.
template <int THREADS, bool OVER>
__device__ void route(const long long* __restrict__ topk_ids, int TK, int E, int a, int primary, int G, int* s_cnt,
                      int* s_ids, u32* s_bitmap, int* s_slots, int* s_info) {
    const int tid = threadIdx.x;
    const int nwords = (E + 31) >> 5;
    for (int i = tid; i < MAX_EXPERT_WORDS; i += THREADS) s_bitmap[i] = 0u;
    if constexpr (OVER)
        for (int i = tid; i < E; i += THREADS) s_cnt[i] = 0;
    __syncthreads();
    for (int i = tid; i < TK; i += THREADS) {
        const int e = static_cast<int>(topk_ids[i]);
        s_ids[i] = e;
        if (e >= 0 && e < E) {
            atomicOr(&s_bitmap[e >> 5], 1u << (e & 31));
            if constexpr (OVER) atomicAdd(&s_cnt[e], 1);
        }
    }
    __syncthreads();
    if (tid < 32) {
        const int lane = tid;
        const u32 w = lane < nwords ? s_bitmap[lane] : 0u;
        const int pc = __popc(w);
        const int incl = warp_inclusive_sum(pc, lane);
        const int total = __shfl_sync(PW_FULL_MASK, incl, 31);
        int e = -1, group = 0;
        bool mine;  // this lane found the slot's expert (in its bitmap word, or among its experts' further groups)
        if constexpr (!OVER) {
            const int excl = incl - pc;
            mine = a >= excl && a < incl;
            if (mine) {
                u32 ww = w;
                for (int r = a - excl; r > 0; --r) ww &= ww - 1u;
                e = lane * 32 + __ffs(ww) - 1;
            }
        } else {
            // lane l sums the extra groups of experts l * per .. l * per + per - 1; a scan finds the lane, then the
            // expert, whose groups hold overflow slot j
            const int per = (E + 31) >> 5, lo = min(E, lane * per), hi = min(E, lo + per), j = a - primary;
            int n = 0;
            for (int k = lo; k < hi; ++k) n += extra_groups(s_cnt[k], G);
            const int in = warp_inclusive_sum(n, lane);
            mine = j >= in - n && j < in;
            if (mine) {
                int r = j - (in - n);
                for (int k = lo; k < hi; ++k) {
                    const int x = extra_groups(s_cnt[k], G);
                    if (r < x) {
                        e = k;
                        group = 1 + r;
                        break;
                    }
                    r -= x;
                }
            }
        }
        const u32 who = __ballot_sync(PW_FULL_MASK, mine);
        e = who ? __shfl_sync(PW_FULL_MASK, e, __ffs(who) - 1) : -1;
        if constexpr (OVER) group = who ? __shfl_sync(PW_FULL_MASK, group, __ffs(who) - 1) : 0;
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
            s_info[4] = group;
        }
    }
    __syncthreads();
}
