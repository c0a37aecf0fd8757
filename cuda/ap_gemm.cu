// Grouped GEMM over AP blocks at their committed bits (prefill): y[rows of expert e] = x[those rows] W_e^T, each
// W_e decoded from its planes as its tiles are loaded, so no dequantized copy of the weights is ever written.
//
// x [M, K] holds rows sorted by expert and `ends` (int32 [E]) each expert's end row, as torch._grouped_mm's
// offsets; expert e's block is page-table row block0 + e * block_step (int64 [plane0..plane7, lut, bits], layout
// v1, the top three planes nibble-packed). A CTA computes one BM x BN tile of y: grid.x runs over the BN-column tiles,
// grid.y over the BM-row tiles of every expert in turn (its size an upper bound, ceil(M / BM) + E; CTAs past the
// last tile return at once). Each K step of BK = 64 columns, the CTA's threads decode the tile's BN weight rows
// (a row's two 32-column words a thread, ap_decode.cuh's decoders; q >= 5 looks codes up in a shared-memory copy
// of the tile's LUT rows) into shared memory; then, while the next step's x tile arrives by cp.async and its plane
// words by plain loads, four warps run mma.sync m16n8k16 over both, each a BM / 2 x 64 quarter of the tile, fp32
// accumulation. Rows of y past the last expert's end are not written. Needs K % 64 == 0 and N even. Tiles of
// BM = 64 rows (PW_BM) waste less on experts of few rows; 128 decode each weight half as often.
#include "pw_common.cuh"
#include "ap_decode.cuh"

#ifndef PW_BF16
#define PW_BF16 0
#endif

namespace {
constexpr bool BF = PW_BF16 != 0;
#ifndef PW_BM
#define PW_BM 128
#endif
constexpr int THREADS = 128;
constexpr int BM = PW_BM, BN = 128, BK = 64;
constexpr int MT = BM / 32;  // m16 tiles of a warp's BM / 2 rows
constexpr int TABLE_COLS = 10;
constexpr int X_BYTES = BM * BK * 2, W_BYTES = BN * BK * 2;  // an x tile, a weight tile (16-bit values)
static_assert((BM == 64 || BM == 128) && BN == THREADS, "a thread decodes one weight row of the tile");

// Byte offset of 16-byte chunk c (0..7) of row r in a tile. The chunks are XOR-swizzled by the row, so the eight
// rows an ldmatrix phase reads, and the eight a decoder warp's stores write, hit eight distinct bank groups.
__device__ __forceinline__ u32 tile_off(int r, int c) { return (u32)(r * (BK * 2) + ((c ^ (r & 7)) << 4)); }

// 16 bytes global -> shared; src_bytes 0 fills zeros and reads nothing
__device__ __forceinline__ void cp_async16(u32 dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_async_wait_all() {
    asm volatile("cp.async.commit_group;\ncp.async.wait_group 0;" ::: "memory");
}
__device__ __forceinline__ void ldmatrix_x4(u32 addr, u32 (&r)[4]) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void sts_v4(u32 addr, u32 a, u32 b, u32 c, u32 d) {
    asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(a), "r"(b), "r"(c), "r"(d) : "memory");
}

// The BM-row tile `tile` of the experts' tiles in id order (ceil(rows / BM) an expert): {expert, first row, end
// row}, or expert -1 past the last. Warp 0 scans the experts 32 at a time.
__device__ void find_tile(const int* __restrict__ ends, int E, int tile, int (&out)[3]) {
    const int lane = threadIdx.x & 31;
    if (lane == 0) out[0] = -1;
    __syncwarp();
    int before = 0;  // tiles of the experts already scanned
    for (int e0 = 0; e0 < E; e0 += 32) {
        const int e = e0 + lane;
        const int end = e < E ? ends[e] : 0, start = (e > 0 && e < E) ? ends[e - 1] : 0;
        const int mine = e < E ? (end - start + BM - 1) / BM : 0;
        int incl = mine;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int v = __shfl_up_sync(PW_FULL_MASK, incl, o);
            if (lane >= o) incl += v;
        }
        const int first = before + incl - mine;
        if (tile >= first && tile < first + mine) {
            out[0] = e;
            out[1] = start + (tile - first) * BM;
            out[2] = end;
        }
        before += __shfl_sync(PW_FULL_MASK, incl, 31);
    }
}

// SLUT: the tile's LUT rows staged in shared memory (q >= 5 and the launch's shared memory holds them), else
// looked up in global memory (through L1)
template <int Q, bool SLUT>
__device__ __forceinline__ void gemm_tile(const long long* __restrict__ trow, const u16* __restrict__ x, int K, int N,
                                          int row0, int rows, int n0, u16* __restrict__ y, char* smem) {
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int W = K >> 5;  // plane words a row
    const int steps = K / BK;
    const u32 xs = static_cast<u32>(__cvta_generic_to_shared(smem));  // x tiles [2], then weight tiles [2], LUT
    const u32 ws = xs + 2 * X_BYTES;
    // decoding: thread tid owns weight row n0 + tid of the tile (rows past N decode row N - 1 and are never stored)
    const int wrow = min(n0 + tid, N - 1);
    const u32* planes[Q];
#pragma unroll
    for (int j = 0; j < Q; ++j) planes[j] = reinterpret_cast<const u32*>(trow[j]) + (long long)wrow * W;
    const u16* lut = reinterpret_cast<const u16*>(trow[8]);
    u32 L[8] = {};
    u32 lut_row = 0;
    if constexpr (Q <= 4) {
        u32x4 raw[2];
#pragma unroll
        for (int h = 0; h < Q - 2; ++h) raw[h] = ldg_nc_v4(lut + ((long long)wrow << Q) + 8 * h);
        reg_lut<Q, BF>(raw, L);
    } else if constexpr (SLUT) {
        // the tile's LUT rows in the activation dtype, entry c of row r at (c * BN + r) * 2: the 32 rows of a
        // lookup's lanes fall on 16 banks (two lanes share a word's bank), whatever their codes
        u16* lut_s = reinterpret_cast<u16*>(smem + 2 * X_BYTES + 2 * W_BYTES);
        constexpr int PIECES = (BN << Q) / 8;  // 16-byte pieces of the tile's rows
        for (int p = tid; p < PIECES; p += THREADS) {
            const int r = p >> (Q - 3), c0 = (p & ((1 << (Q - 3)) - 1)) * 8;
            const u32x4 v = ldg_nc_v4(lut + ((long long)min(n0 + r, N - 1) << Q) + c0);
            const u32 e[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                lut_s[(c0 + 2 * i) * BN + r] = lut2act<BF>(e[i] & 0xffffu);
                lut_s[(c0 + 2 * i + 1) * BN + r] = lut2act<BF>(e[i] >> 16);
            }
        }
        lut_row = static_cast<u32>(__cvta_generic_to_shared(lut_s)) + tid * 2;
        __syncthreads();
    }
    const u16* lut_g = lut + ((long long)wrow << Q);
    const auto look = [lut_row, lut_g](u32 c) {
        if constexpr (SLUT) return lds_u16(lut_row + c * (BN * 2));
        else return (u32)lut2act<BF>(ldg_nc_u16(lut_g + c));
    };

    u32 pw[2][8] = {};  // this thread's plane words of the next step: [word][plane]
    const auto load_planes = [&](int s) {
#pragma unroll
        for (int j = 0; j < Q; ++j) {
            const u32x2 v = ldg_nc_v2(planes[j] + 2 * s);
            pw[0][j] = v.x;
            pw[1][j] = v.y;
        }
    };
    const auto load_x = [&](int s, int buf) {  // BM rows x 8 chunks of 16 bytes
#pragma unroll
        for (int i = 0; i < BM * 8 / THREADS; ++i) {
            const int c = tid + i * THREADS, r = c >> 3, ch = c & 7;
            const bool ok = r < rows;
            cp_async16(xs + buf * X_BYTES + tile_off(r, ch), x + (long long)(row0 + (ok ? r : 0)) * K + s * BK + ch * 8,
                       ok ? 16 : 0);
        }
    };
    const int wm = warp >> 1, wn = warp & 1;  // the warp's quarter: tile rows BM / 2 * wm.., columns 64 wn..
    float acc[MT][8][4] = {};
    load_planes(0);
    load_x(0, 0);
    for (int s = 0; s < steps; ++s) {
        const int buf = s & 1;
#pragma unroll
        for (int wd = 0; wd < 2; ++wd) {
            u32 out[16];
            decode_word32<Q>(pw[wd], L, look, out);
#pragma unroll
            for (int p = 0; p < 4; ++p)
                sts_v4(ws + buf * W_BYTES + tile_off(tid, 4 * wd + p), out[4 * p], out[4 * p + 1], out[4 * p + 2],
                       out[4 * p + 3]);
        }
        cp_async_wait_all();
        __syncthreads();  // this step's tiles are complete; every warp is done with the previous step's
        if (s + 1 < steps) {
            load_x(s + 1, buf ^ 1);
            load_planes(s + 1);
        }
        const u32 xt = xs + buf * X_BYTES, wt = ws + buf * W_BYTES;
#pragma unroll
        for (int kk = 0; kk < BK / 16; ++kk) {
            u32 a[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)  // rows 0-15 of the m-tile at k 0-7 (lanes 0-15), then at k 8-15
                ldmatrix_x4(xt + tile_off(BM / 2 * wm + 16 * mt + (lane & 15), 2 * kk + (lane >> 4)), a[mt]);
#pragma unroll
            for (int nb = 0; nb < 4; ++nb) {
                // matrices: (n 0-7, k 0-7), (n 0-7, k 8-15), (n 8-15, k 0-7), (n 8-15, k 8-15) of 16 columns
                const int m = lane >> 3;
                u32 b[4];
                ldmatrix_x4(wt + tile_off(64 * wn + 16 * nb + 8 * (m >> 1) + (lane & 7), 2 * kk + (m & 1)), b);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    mma16816<BF>(acc[mt][2 * nb], a[mt][0], a[mt][1], a[mt][2], a[mt][3], b[0], b[1]);
                    mma16816<BF>(acc[mt][2 * nb + 1], a[mt][0], a[mt][1], a[mt][2], a[mt][3], b[2], b[3]);
                }
            }
        }
    }
    // acc[mt][nt]: rows g and g + 8 of m-tile mt, columns 2t and 2t + 1 of n-tile nt
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) {
            const int col = n0 + 64 * wn + 8 * nt + 2 * t;
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int r = BM / 2 * wm + 16 * mt + g + 8 * h;
                if (r < rows && col < N)
                    *reinterpret_cast<u32*>(y + (long long)(row0 + r) * N + col) =
                        (u32)f2act<BF>(acc[mt][nt][2 * h]) | ((u32)f2act<BF>(acc[mt][nt][2 * h + 1]) << 16);
            }
        }
}
}  // namespace

// Dynamic shared memory: two x tiles and two weight tiles (2 BM BK + 2 BN BK 16-bit values), plus BN 2^lut_bits
// 16-bit LUT entries when lut_bits >= 5: blocks at 5 <= q <= lut_bits stage their tile's LUT rows there, blocks
// above it look their codes up in global memory. `on` (nullable): when it points at 0 the launch writes nothing.
extern "C" __global__ void __launch_bounds__(THREADS) pw_ap_grouped_gemm(
    const long long* __restrict__ table, long long block0, long long block_step, const int* __restrict__ ends, int E,
    const u16* __restrict__ x, int K, int N, u16* __restrict__ y, int lut_bits, const long long* __restrict__ on) {
    if (on != nullptr && *on == 0) return;  // the layer takes the dequantize path this time (decided on the device)
    extern __shared__ __align__(128) char smem[];
    __shared__ int tile[3];
    if (threadIdx.x < 32) find_tile(ends, E, blockIdx.y, tile);
    __syncthreads();
    const int e = tile[0];
    if (e < 0) return;  // uniform over the CTA
    const int row0 = tile[1], rows = min(BM, tile[2] - row0), n0 = blockIdx.x * BN;
    const long long* trow = table + (block0 + e * block_step) * TABLE_COLS;
    const int q = (int)trow[9];
    const bool slut = q <= lut_bits;
    switch (q) {
        case 3: gemm_tile<3, false>(trow, x, K, N, row0, rows, n0, y, smem); break;
        case 4: gemm_tile<4, false>(trow, x, K, N, row0, rows, n0, y, smem); break;
        case 5: slut ? gemm_tile<5, true>(trow, x, K, N, row0, rows, n0, y, smem)
                     : gemm_tile<5, false>(trow, x, K, N, row0, rows, n0, y, smem); break;
        case 6: slut ? gemm_tile<6, true>(trow, x, K, N, row0, rows, n0, y, smem)
                     : gemm_tile<6, false>(trow, x, K, N, row0, rows, n0, y, smem); break;
        case 7: slut ? gemm_tile<7, true>(trow, x, K, N, row0, rows, n0, y, smem)
                     : gemm_tile<7, false>(trow, x, K, N, row0, rows, n0, y, smem); break;
        case 8: slut ? gemm_tile<8, true>(trow, x, K, N, row0, rows, n0, y, smem)
                     : gemm_tile<8, false>(trow, x, K, N, row0, rows, n0, y, smem); break;
        default:  // not resident (or below the 3-bit floor): the block is zeros, so are its rows of y
            for (int i = threadIdx.x; i < rows * BN / 2; i += THREADS) {
                const int r = i / (BN / 2), col = n0 + 2 * (i % (BN / 2));
                if (col < N) *reinterpret_cast<u32*>(y + (long long)(row0 + r) * N + col) = 0u;
            }
    }
}
