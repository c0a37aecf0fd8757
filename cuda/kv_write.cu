// The new tokens' K and V rows into the paged cache through its pointer table (KVCache.ptrs: two u64 per layer,
// K then V), so a decode step captured in a CUDA graph keeps writing to the right tensors after the cache was
// resized and its tensors replaced: the resize rewrites the table, never the graph.
//
// Cache layout as in paged_attention.cu: slot s = block * block_size + offset holds row s of [heads * dim]
// 16-bit values (fp16 or bf16; the bits are copied). k and v are [tokens, heads, dim] with any row and head
// stride and dim contiguous (views of the fused q/k/v projection). One CTA per token, K and V together.
#include "pw_common.cuh"

extern "C" __global__ void __launch_bounds__(128) pw_kv_write(
    const u16* __restrict__ k, long long k_row, long long k_head, const u16* __restrict__ v, long long v_row,
    long long v_head, const long long* __restrict__ slots, const u64* __restrict__ kv_ptrs, int heads, int dim) {
    const int t = blockIdx.x;
    const long long row = (long long)heads * dim, dst = slots[t] * row;
    u16* __restrict__ kc = reinterpret_cast<u16*>(kv_ptrs[0]);
    u16* __restrict__ vc = reinterpret_cast<u16*>(kv_ptrs[1]);
    for (int i = threadIdx.x; i < heads * dim; i += blockDim.x) {
        const int h = i / dim, d = i - h * dim;
        kc[dst + i] = k[t * k_row + h * k_head + d];
        vc[dst + i] = v[t * v_row + h * v_head + d];
    }
}
