// The decoder layer's small operations, fused: residual add + RMSNorm, rotary embedding + the K/V cache write, the
// router's softmax + top-k, row L2 norms, activation-and-multiply, the shared expert's sigmoid-gated add, the MoE
// dispatch's weighted sum of each token's expert outputs, and its row moves (a gather and a scatter in one kernel).
//
// Each replaces a run of torch's elementwise and reduction kernels (a decode step of the demo model ran 180
// kernels, most of them these), and each rounds to the activation dtype wherever torch's sequence of ops rounds,
// so results equal the pure-torch references (pwruntime/kernels/reference.py) up to the order of fp32 sums.
// Activations are fp16 or bf16 (PW_BF16), passed as raw 16-bit patterns; a row may have any stride, its last
// dimension contiguous. Outputs are contiguous.
#include "pw_common.cuh"

#ifndef PW_BF16
#define PW_BF16 0
#endif
#define PW_ROUTE_PER_LANE 8  // experts one lane of the router holds: up to 256 experts
#define PW_NEG_INF __int_as_float(0xff800000u)

constexpr bool BF = PW_BF16 != 0;
typedef long long ll;

__device__ __forceinline__ float ld(const u16* p) { return act2f<BF>(*p); }
__device__ __forceinline__ u16 st(float v) { return f2act<BF>(v); }
__device__ __forceinline__ float rnd(float v) { return act2f<BF>(f2act<BF>(v)); }  // rounded to the dtype

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(PW_FULL_MASK, v, o);
    return v;
}

// the CTA's sum of v on every thread, in a fixed order (blockDim.x a multiple of 32); call once a kernel
__device__ __forceinline__ float block_sum(float v) {
    __shared__ float partial[32];
    v = warp_sum(v);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    return warp_sum(lane < (int)(blockDim.x >> 5) ? partial[lane] : 0.f);
}

// out = weight * rms_norm(s), s = x + delta (or x when delta is null), s also stored to sum_out: torch's
// `s = x + delta; weight * F.rms_norm(s.float(), eps).to(dtype)`; with float_weight (Gemma 4's order) the weight
// multiplies in float32 before the one rounding, `F.rms_norm(s.float(), weight=weight.float(), eps).to(dtype)`, and
// may be null (no weight). One CTA a row.
extern "C" __global__ void __launch_bounds__(256) pw_add_rms_norm(
    const u16* __restrict__ x, ll x_row, const u16* __restrict__ delta, ll delta_row, u16* __restrict__ sum_out,
    const u16* __restrict__ weight, u16* __restrict__ out, int cols, float eps, int float_weight) {
    const ll r = blockIdx.x;
    const u16* xr = x + r * x_row;
    const u16* dr = delta ? delta + r * delta_row : nullptr;
    float ss = 0.f;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        float s = ld(xr + c);
        if (dr) {
            s = rnd(s + ld(dr + c));
            sum_out[r * cols + c] = st(s);
        }
        ss += s * s;
    }
    const float inv = rsqrtf(block_sum(ss) / (float)cols + eps);
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        const float s = dr ? rnd(ld(xr + c) + ld(dr + c)) : ld(xr + c);
        if (float_weight)
            out[r * cols + c] = st(weight ? s * inv * ld(weight + c) : s * inv);
        else
            out[r * cols + c] = st(ld(weight + c) * rnd(s * inv));
    }
}

// q and k rotated (rotate-half: torch's `x * cos + cat(-x2, x1) * sin`, both products and the sum rounded) into
// q_out [T, heads, dim] and k_out [T, kv_heads, dim]; with a pointer table (KVCache.ptrs, K then V) the rotated k
// and v as it is also go to the paged cache rows `slots` (kv_write.cu's layout). cos, sin [T, dim]. A CTA a token.
extern "C" __global__ void __launch_bounds__(128) pw_rotary_kv(
    const u16* __restrict__ q, ll q_row, ll q_head, const u16* __restrict__ k, ll k_row, ll k_head,
    const u16* __restrict__ v, ll v_row, ll v_head, const u16* __restrict__ cos, const u16* __restrict__ sin,
    int heads, int kv_heads, int dim, u16* __restrict__ q_out, u16* __restrict__ k_out,
    const ll* __restrict__ slots, const u64* __restrict__ kv_ptrs) {
    const ll t = blockIdx.x;
    const int half = dim >> 1, kv_row = kv_heads * dim;
    const u16* ct = cos + t * dim;
    const u16* sn = sin + t * dim;
    u16* kc = kv_ptrs ? reinterpret_cast<u16*>(kv_ptrs[0]) + slots[t] * kv_row : nullptr;
    for (int i = threadIdx.x; i < (heads + kv_heads) * dim; i += blockDim.x) {
        const int h = i / dim, d = i - h * dim;
        const bool is_q = h < heads;
        const u16* src = is_q ? q + t * q_row + h * q_head : k + t * k_row + (h - heads) * k_head;
        const float other = d < half ? -ld(src + d + half) : ld(src + d - half);
        const u16 o = st(rnd(ld(src + d) * ld(ct + d)) + rnd(other * ld(sn + d)));
        if (is_q) {
            q_out[t * heads * dim + i] = o;
        } else {
            const int j = i - heads * dim;
            k_out[t * kv_row + j] = o;
            if (kc) kc[j] = o;
        }
    }
    if (!kv_ptrs) return;
    u16* vc = reinterpret_cast<u16*>(kv_ptrs[1]) + slots[t] * kv_row;
    for (int j = threadIdx.x; j < kv_row; j += blockDim.x) {
        const int h = j / dim;
        vc[j] = v[t * v_row + h * v_head + (j - h * dim)];
    }
}

// torch's `softmax(logits.float())` then `topk(k)` (descending; equal weights in ascending expert id), renormalized
// over the k when `renorm`: weights fp32 [T, k], ids int64 [T, k]. A warp a token, lane l holding experts l, l + 32..
extern "C" __global__ void __launch_bounds__(128) pw_route_topk(
    const u16* __restrict__ logits, ll row, int tokens, int experts, int k, int renorm, float* __restrict__ weights,
    ll* __restrict__ ids) {
    const int t = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (t >= tokens) return;
    float p[PW_ROUTE_PER_LANE];
    float m = PW_NEG_INF;
#pragma unroll
    for (int j = 0; j < PW_ROUTE_PER_LANE; ++j) {
        const int e = j * 32 + lane;
        p[j] = e < experts ? ld(logits + t * row + e) : PW_NEG_INF;
        m = fmaxf(m, p[j]);
    }
    for (int o = 16; o; o >>= 1) m = fmaxf(m, __shfl_xor_sync(PW_FULL_MASK, m, o));
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < PW_ROUTE_PER_LANE; ++j) {
        p[j] = j * 32 + lane < experts ? expf(p[j] - m) : 0.f;
        sum += p[j];
    }
    sum = warp_sum(sum);
#pragma unroll
    for (int j = 0; j < PW_ROUTE_PER_LANE; ++j) p[j] = j * 32 + lane < experts ? p[j] / sum : -2.f;  // -2: no expert
    float total = 0.f;
    for (int i = 0; i < k; ++i) {
        float best = -1.f;
        int arg = 0x7fffffff;
#pragma unroll
        for (int j = 0; j < PW_ROUTE_PER_LANE; ++j)
            if (p[j] > best) best = p[j], arg = j * 32 + lane;   // ascending ids in a lane: strict > keeps the lower
        for (int o = 16; o; o >>= 1) {
            const float ob = __shfl_xor_sync(PW_FULL_MASK, best, o);
            const int oa = __shfl_xor_sync(PW_FULL_MASK, arg, o);
            if (ob > best || (ob == best && oa < arg)) best = ob, arg = oa;
        }
#pragma unroll
        for (int j = 0; j < PW_ROUTE_PER_LANE; ++j)
            if (j * 32 + lane == arg) p[j] = -2.f;               // taken
        if (lane == 0) weights[(ll)t * k + i] = best, ids[(ll)t * k + i] = arg;
        total += best;
    }
    if (renorm && lane == 0)
        for (int i = 0; i < k; ++i) weights[(ll)t * k + i] /= total;
}

// out[r] = sqrt(sum_c x[r, c]^2) in fp32 (torch's `x.float().norm(dim=-1)`). A warp a row.
// `count` (non-null: an int64 on the device) bounds the rows: rows from *count on write nothing. Row r's norm goes to
// out[out_index[r]] where `out_index` is non-null, else to out[r].
extern "C" __global__ void __launch_bounds__(128) pw_row_norms(const u16* __restrict__ x, ll row, int rows, int cols,
                                                              const ll* __restrict__ count,
                                                              const ll* __restrict__ out_index, float* __restrict__ out) {
    const int r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (r >= rows || (count && r >= *count)) return;
    float ss = 0.f;
    for (int c = lane; c < cols; c += 32) {
        const float v = ld(x + r * row + c);
        ss += v * v;
    }
    ss = warp_sum(ss);
    if (lane == 0) out[out_index ? out_index[r] : r] = sqrtf(ss);
}

// act[r, i] = f(h[r, i]) * h[r, inter + i]: torch's `F.silu(gate) * up`, or with gelu `F.gelu(gate, approximate="tanh")
// * up` (torch's formula: 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3)))); f rounded, then the product. With
// `count` non-null only rows below *count (an int64 on the device).
extern "C" __global__ void pw_act_mul(const u16* __restrict__ h, ll h_row, int inter, ll total, int gelu,
                                      const ll* __restrict__ count, u16* __restrict__ act) {
    const float beta = 0.7978845608028654f, kappa = 0.044715f;
    if (count) total = min(total, *count * inter);
    for (ll n = blockIdx.x * (ll)blockDim.x + threadIdx.x; n < total; n += (ll)gridDim.x * blockDim.x) {
        const ll r = n / inter;
        const int i = (int)(n - r * inter);
        const float g = ld(h + r * h_row + i);
        const float f = gelu ? 0.5f * g * (1.f + tanhf(beta * (g + kappa * (g * g * g)))) : g / (1.f + expf(-g));
        act[n] = st(rnd(f) * ld(h + r * h_row + inter + i));
    }
}

// res = out + sigmoid(gate) * shared, gate [T, 1]: torch's `out + torch.sigmoid(gate) * shared` (each op rounded).
extern "C" __global__ void pw_gated_add(const u16* __restrict__ out, const u16* __restrict__ gate, ll gate_row,
                                        const u16* __restrict__ shared, int cols, ll total, u16* __restrict__ res) {
    for (ll n = blockIdx.x * (ll)blockDim.x + threadIdx.x; n < total; n += (ll)gridDim.x * blockDim.x) {
        const ll r = n / cols;
        const float s = rnd(1.f / (1.f + expf(-ld(gate + r * gate_row))));
        res[n] = st(ld(out + n) + rnd(s * ld(shared + n)));
    }
}

// out[t] = sum_j w[t, j] * rows[r(t * k + j)] (w float32 [T, k]; r the identity, slot order, or with `where` non-null
// where[s], the row of slot s), summed in fp32 slot by slot and rounded once: torch's float32 `addcmul_` over the
// slots, then `.to(dtype)`. 8 columns a thread (cols a multiple of 8, rows 16-byte aligned), so a token's k rows are
// read once; grid (tokens, column blocks).
extern "C" __global__ void __launch_bounds__(128) pw_slot_combine(const u16* __restrict__ rows,
                                                                 const float* __restrict__ w,
                                                                 const ll* __restrict__ where, int k, int cols,
                                                                 u16* __restrict__ out) {
    const ll t = blockIdx.x;
    const int c = (blockIdx.y * blockDim.x + threadIdx.x) * 8;
    if (c >= cols) return;
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (int j = 0; j < k; ++j) {
        const float wj = w[t * k + j];
        const ll row = where ? where[t * k + j] : t * k + j;
        const u32x4 v = ldg_nc_v4(rows + row * cols + c);
        const u32 words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            acc[2 * q] = fmaf(act2f<BF>((u16)(words[q] & 0xffffu)), wj, acc[2 * q]);
            acc[2 * q + 1] = fmaf(act2f<BF>((u16)(words[q] >> 16)), wj, acc[2 * q + 1]);
        }
    }
    const auto pair = [&acc](int q) { return (u32)st(acc[2 * q]) | ((u32)st(acc[2 * q + 1]) << 16); };
    *reinterpret_cast<u32x4*>(out + t * cols + c) = u32x4{pair(0), pair(1), pair(2), pair(3)};
}

// dst[d(p)] = src[s(p)] for each move p, a CTA row of the grid (moves, column blocks), those from *count on skipped
// where `count` is non-null (an int64 on the device): s(p) = src_index[p] and d(p) = dst_index[p], each the identity
// where its index is null. 8 columns a thread (cols a multiple of 8, both 16-byte aligned and contiguous, not
// overlapping). A gather and a scatter at the bandwidth of a copy (torch's index_put_ of rows runs an element a thread
// at about a third of it), and a move bounded on the device does no work for the rows past its bound.
extern "C" __global__ void __launch_bounds__(128) pw_move_rows(const u16* __restrict__ src,
                                                              const ll* __restrict__ src_index,
                                                              u16* __restrict__ dst, const ll* __restrict__ dst_index,
                                                              const ll* __restrict__ count, int cols) {
    const ll p = blockIdx.x;
    const int c = (blockIdx.y * blockDim.x + threadIdx.x) * 8;
    if (c >= cols || (count && p >= *count)) return;
    const ll s = src_index ? src_index[p] : p, d = dst_index ? dst_index[p] : p;
    *reinterpret_cast<u32x4*>(dst + d * cols + c) = ldg_nc_v4(src + s * cols + c);
}
