// Fused mixed-precision AP (bit-plane) MoE decode: gate_up + act*mul (SiLU, or GELU with PW_GELU), then down +
// weighted sum.
//
// Weights are AP layout v1 (policies/apformat.py): plane j of a block is [out, W] uint32 words,
// W = ceil(in / 32); bit (k % 32) of word k / 32 of row r is bit (7 - j) of W[r, k]'s 8-bit code;
// the b-bit code is the top b planes; LUT_b is [out, 2^b] fp16. On the device planes 0..2 are
// nibble-packed (pwruntime/kernels/device_table.py, ap_decode.cuh), so q >= 3. Every block is read at its own
// committed bits from the device page table: int64 rows [plane0..plane7, lut, bits] (10 columns),
// block index (layer * E + expert) * 2 + kind. Nothing here depends on the bits at launch time.
//
// Work decomposition. One CTA = 4 or 8 warps (PW_WARPS) handles (active expert a, row tile): WARPS / ksplit row
// groups of 16 m-rows, each group's K range split among ksplit warps. Each CTA derives the
// sorted list of active experts and the (token, slot) pairs routed to its expert from topk_ids
// (so a CUDA graph can be replayed for any routing). A warp computes one m16 tile of output rows
// for all tokens of its expert with mma.sync m16n8k16 (fp32 accumulators): the A fragment is
// decoded from the bit-planes in registers, the B fragment (activations) comes from shared memory
// where x is stored permuted to match the decode order. So an expert's planes are read once per
// launch no matter how many tokens it serves. Decoders:
//   q = 3, 4, one token (launches of one or two n-tiles): the binary tensor cores (ap_b1.cuh): the token's activations staged as
//          int16 bit-planes per 512-column chunk, counted with mma .b1 and.popc against the AND masks of
//          the LUT's Moebius terms (q = 3) or the codes' one-hot masks (q = 4);
//   q = 3: 8-entry LUT held in registers as byte tables, looked up with prmt (no shared memory);
//   q = 4: two 8-entry register tables (even and odd codes) selected by plane 3 through a prmt
//          sign-replicate mask;
//   q >= 5: an 8x8 bit transpose per byte lane of planes 3..q-1 plus the packed top code give byte
//            codes; the LUT lives in shared memory, replicated up to 4 times, laid out so that lookups
//            rarely (q <= 6: never) share a bank.
// Lane (g, t) of a warp owns m-rows g and g + 8 and, per chunk, words WPL t .. WPL t + WPL - 1 of the
// chunk's CW words (Geom<Q>: 16-word chunks and 16-byte loads at q = 3, so the 4 lanes of a row read
// 64 contiguous bytes per plane; 8-word chunks and 8-byte loads elsewhere). Plane words of the next
// chunk are in flight while a chunk is decoded (two register buffers used in alternation).
//
// Launch 1 (pw_moe_gate_up): m-rows 0..7 are gate rows, 8..15 the matching up rows, so
// act(gate) * up is formed in registers and written to act[slot, I] (activation dtype).
// Launch 2 (pw_moe_down): partial[slot, H] = w_slot * down_e(act[slot]); the last CTA to finish a
// row tile (arrival counter) sums the top-k slots of every token in slot order (deterministic),
// writes out[T, H] and re-arms the counter, so no memset or extra launch is needed.
// Launch 2 is a programmatic dependent launch: its CTAs start while launch 1 runs and read their
// routing, table rows, first plane chunk and LUT before waiting (griddepcontrol) for launch 1's act.
// Mode 2 (one linear-block) is a programmatic dependent launch too: its table row, first plane chunk and
// register LUT load while the kernel before it finishes (so that kernel must not write the table, planes or
// LUTs; copies do, and a copy is not a kernel), and it lets the next launch start at once.
#include "pw_common.cuh"
#include "ap_b1.cuh"
#include "ap_decode.cuh"
#include "ap_route.cuh"

#ifndef PW_BF16
#define PW_BF16 0
#endif
#ifndef PW_NT
#define PW_NT 1
#endif
#ifndef PW_OVERFLOW  // the launch has overflow slots (ap_route.cuh); their routing compiled into every build made the
#define PW_OVERFLOW 0   // one-token layers 0.5-1.8% slower (cuda/NOTES.md, session 17), so only such launches have it
#endif
#ifndef PW_WARPS  // warps per CTA
#define PW_WARPS 4
#endif
#ifndef PW_MINB  // CTAs per SM the register allocation must allow: 16, 12 or 8 warps (more n-tiles, more accumulators)
#define PW_MINB ((PW_NT <= 2 ? 16 : PW_NT == 4 ? 12 : 8) / PW_WARPS)
#endif

namespace {
constexpr bool BF = PW_BF16 != 0;
constexpr int NT = PW_NT;  // n-tiles of 8 tokens: up to 8 * NT tokens per expert
constexpr int ACCS = NT == 1 ? 2 : 1;  // with one n-tile, two accumulator sets halve the mma dependency chain
constexpr int WARPS = PW_WARPS;
constexpr int THREADS = 32 * WARPS;
constexpr int XS_ROW_PAD = 128;
constexpr int TABLE_COLS = 10;
constexpr int LUT_WARP_BYTES = 16 * LUT_SLICE_CODES * 2;  // one row group's byte-path LUT slice (ap_decode.cuh)
}  // namespace

// The byte-path LUT staging shared by a row group's k-split warps, with conflict-free stores, issued before the PDL
// wait (stage_lut below): compiled only into the single block's 16-warp build. In every build it made the 6-8-bit
// layers at one token 4-13% faster, but unrelated paths up to 4.7% slower (Mixtral's 3-bit one-token layer, whose code
// it does not run: the function's register allocation moved; cuda/NOTES.md, session 19).
#ifndef PW_LUTSTAGE
#define PW_LUTSTAGE (PW_WARPS == 16)
#endif

#ifndef PW_XSLUT  // q = 3, 4 stage activations into the byte-path LUT slices too (fewer segments)
#define PW_XSLUT 1
#endif

#ifndef PW_CW_NIB  // words per row and chunk at q = 3
#define PW_CW_NIB 16
#endif
#ifndef PW_CW_Q4  // at q = 4 (two 16-word chunks do not fit in the registers of a one-n-tile launch)
#define PW_CW_Q4 (PW_NT <= 2 ? 8 : 16)
#endif

// Chunk geometry of bits Q: a chunk is CW words (32 CW columns) of each of a warp's 16 m-rows; lane t holds
// words WPL t .. WPL t + WPL - 1 of its two rows, read with one WPL-word load per plane and row. At q = 3
// (and q = 4 where registers allow) a lane reads 16 bytes, 64 contiguous bytes a row and plane, which the
// memory system streams faster than 32 (measured: cuda/NOTES.md); the byte decoder keeps 8-byte loads, as
// two chunks of its planes would not fit in registers otherwise.
template <int Q>
struct Geom {
    static constexpr int CW = Q == 3 ? PW_CW_NIB : Q == 4 ? PW_CW_Q4 : 8;
    static constexpr int WPL = CW / 4;
    static constexpr int CK = 32 * CW;  // columns per chunk
    static constexpr int XB = 2 * CK;   // one token's activations of one chunk in shared memory, bytes
    static constexpr int GS = 8 * CW;   // bytes between element groups of a chunk in shared memory
};

struct BlockRef {
    const u32* planes[8];
    const u16* lut;
    int q;
};

__device__ __forceinline__ BlockRef read_block(const long long* table, long long b) {
    BlockRef k;
    const long long* row = table + b * TABLE_COLS;
#pragma unroll
    for (int j = 0; j < 8; ++j) k.planes[j] = reinterpret_cast<const u32*>(row[j]);
    k.lut = reinterpret_cast<const u16*>(row[8]);
    k.q = static_cast<int>(row[9]);
    return k;
}

// What one warp computes: 16 m-rows (m < 8 -> base0 + m, else base1 + m - 8; clamped to the
// limits for loads) against n_tok tokens whose activation rows are x + rows[n] / row_div * ldx.
struct Tile {
    int base0, lim0, base1, lim1;
    int W, K;
    int ks, ksplit;
    int n_tok;
    const u16* x;
    long long ldx;
    const int* rows;
    int row_div;
    bool x_vec;
    int xs_budget;  // shared-memory bytes for activations
};

__device__ __forceinline__ int mrow(const Tile& tl, int m) {
    int r = m < 8 ? tl.base0 + m : tl.base1 + (m - 8);
    int lim = m < 8 ? tl.lim0 : tl.lim1;
    return r < lim ? r : lim - 1;
}

// ---------------------------------------------------------------- activations -> shared memory
// Token n's row starts at n * pitch + swz(n); within a chunk: [group G 0..7][word 0..CW-1][4 halves].
// Path 0 (nibble decoders): group G = 2i + h holds elements i + 16h + 4s, s = 0..3.
// Path 1 (byte decoder):   group G = i holds elements i + 8s.
// The swizzle keeps the 16 lanes of a half-warp (tokens g, words WPL t + u) on distinct banks.
template <int WPL>
__device__ __forceinline__ int xs_swz(int n) {
    if constexpr (WPL == 2) return ((n & 1) << 3) | (((n >> 1) & 1) << 6);
    else return (n & 3) << 3;
}

// Dynamic shared memory: activations (and the k-split reduction) from 0, then one byte-path LUT slice per row
// group from this offset (the launch's smem, pwruntime/kernels/moe.py plan_launch, matches it).
__device__ __forceinline__ int lut_region(int xs_budget) { return max(xs_budget, NT * 512 * WARPS); }

// Chunks of K staged at once. When K takes several segments, a multiple of the k-split: warp ks of a row group
// decodes chunks ks, ks + ksplit, ..., so a segment of 3 chunks split 2 ways left one warp of each pair idle at the
// segment's barrier while the other decoded its second chunk (ncu at T = 8: barrier stalls 0.1 -> 0.7-1.1 an issue).
template <int Q>
__device__ __forceinline__ int chunks_per_segment(int xs_budget, int n_tok, int nchunks, int ksplit) {
    int cps = (xs_budget / (n_tok > 0 ? n_tok : 1) - XS_ROW_PAD) / Geom<Q>::XB;
    cps = cps < 1 ? 1 : cps;
    if (cps >= nchunks) return nchunks;
    return cps >= ksplit ? cps - cps % ksplit : cps;
}

template <int Q>
__device__ void fill_x(char* xs, const Tile& tl, int seg, int pitch, int cps, int nchunks) {
    using G_ = Geom<Q>;
    constexpr int PATH = (Q == 3 || Q == 4) ? 0 : 1;
    const int c0 = seg * cps;
    const int nch = min(cps, nchunks - c0);
    const int items = tl.n_tok * nch * G_::CW;
    for (int it = threadIdx.x; it < items; it += THREADS) {
        const int w8 = it % G_::CW;
        const int rest = it / G_::CW;
        const int cl = rest % nch;
        const int n = rest / nch;
        const int k0 = (c0 + cl) * G_::CK + w8 * 32;
        const u16* src = tl.x + (long long)(tl.rows[n] / tl.row_div) * tl.ldx + k0;
        u32 v[16];
        load_act32(src, tl.K - k0, tl.x_vec, v);
        char* dst = xs + n * pitch + xs_swz<G_::WPL>(n) + cl * G_::XB + w8 * 8;
#pragma unroll
        for (int G = 0; G < 8; ++G) {
            int e[4];
#pragma unroll
            for (int s = 0; s < 4; ++s) {
                if constexpr (PATH == 0) e[s] = (G >> 1) + 16 * (G & 1) + 4 * s;
                else e[s] = G + 8 * s;
            }
            u32x2 o;
            o.x = half_of(v, e[0]) | (half_of(v, e[1]) << 16);
            o.y = half_of(v, e[2]) | (half_of(v, e[3]) << 16);
            *reinterpret_cast<u32x2*>(dst + G * G_::GS) = o;
        }
    }
}

// ---------------------------------------------------------------- the m16 x (8 NT) x K tile
template <int SET>
__device__ __forceinline__ void mma_group(float (&acc)[NT * ACCS][4], int nt_act, const char* xs, const int (&xoff)[NT],
                                          int byte_off, u32 a0, u32 a1, u32 a2, u32 a3) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
        if (NT == 1 || nt < nt_act) {
            const u32x2 b = *reinterpret_cast<const u32x2*>(xs + xoff[nt] + byte_off);
            mma16816<BF>(acc[nt * ACCS + (SET % ACCS)], a0, a1, a2, a3, b.x, b.y);
        }
    }
}

template <int Q, int CW = Geom<Q>::CW>
__device__ __forceinline__ void load_chunk(u32 (&P)[2][Q][CW / 4], const BlockRef& blk, const Tile& tl,
                                           long long off0, long long off1, int c, int t) {
    constexpr int WPL = CW / 4;
    const int w = c * CW + WPL * t;
    const bool vec = (tl.W % WPL) == 0;  // rows start WPL-word aligned, and a lane's words are all in or all out
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
        const long long off = (rr ? off1 : off0) + w;
#pragma unroll
        for (int j = 0; j < Q; ++j) {
            if (vec) {
                if (w < tl.W) {
                    if constexpr (WPL == 4) {
                        const u32x4 v = ldg_plane_v4(blk.planes[j] + off);
                        P[rr][j][0] = v.x;
                        P[rr][j][1] = v.y;
                        P[rr][j][2] = v.z;
                        P[rr][j][3] = v.w;
                    } else {
                        const u32x2 v = ldg_plane_v2(blk.planes[j] + off);
                        P[rr][j][0] = v.x;
                        P[rr][j][1] = v.y;
                    }
                } else {
#pragma unroll
                    for (int u = 0; u < WPL; ++u) P[rr][j][u] = 0u;
                }
            } else {
#pragma unroll
                for (int u = 0; u < WPL; ++u) P[rr][j][u] = (w + u < tl.W) ? ldg_nc(blk.planes[j] + off + u) : 0u;
            }
        }
    }
}

template <int Q>
__device__ __forceinline__ void compute_chunk(const u32 (&P)[2][Q][Geom<Q>::WPL], const u32 (&L)[2][8],
                                              u32 lut_row, u32 lut_stride, float (&acc)[NT * ACCS][4], int nt_act,
                                              const char* xs, const int (&xoff)[NT], int cl, int t) {
    using G_ = Geom<Q>;
    constexpr int PATH = (Q == 3 || Q == 4) ? 0 : 1;
    constexpr int UNR = G_::WPL / 2;  // decode copies: the loop below runs twice (small code for the i-cache)
#pragma unroll 1
    for (int u2 = 0; u2 < 2; ++u2) {
#pragma unroll
    for (int k = 0; k < UNR; ++k) {
        const int u = u2 * UNR + k;
        u32 w0[Q], w1[Q];
#pragma unroll
        for (int j = 0; j < Q; ++j) {
            w0[j] = u2 ? P[0][j][UNR + k] : P[0][j][k];
            w1[j] = u2 ? P[1][j][UNR + k] : P[1][j][k];
        }
        const int base = cl * G_::XB + (G_::WPL * t + u) * 8;
        if constexpr (PATH == 0) {
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                u32 A0[4], A1[4];
                if constexpr (Q == 3) {
                    decode3(w0, i, L[0], A0);
                    decode3(w1, i, L[1], A1);
                } else {
                    decode4(w0, i, L[0], A0);
                    decode4(w1, i, L[1], A1);
                }
                mma_group<0>(acc, nt_act, xs, xoff, base + (2 * i) * G_::GS, A0[0], A1[0], A0[1], A1[1]);
                mma_group<1>(acc, nt_act, xs, xoff, base + (2 * i + 1) * G_::GS, A0[2], A1[2], A0[3], A1[3]);
            }
        } else {
            u32 C0[8], C1[8];
            byte_codes<Q>(w0, C0);
            byte_codes<Q>(w1, C1);
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                u32 A0[2], A1[2];
                decode_bytes(C0[i], lut_row, lut_stride, A0);
                decode_bytes(C1[i], lut_row + 2, lut_stride, A1);
                if (i & 1) mma_group<1>(acc, nt_act, xs, xoff, base + i * G_::GS, A0[0], A1[0], A0[1], A1[1]);
                else mma_group<0>(acc, nt_act, xs, xoff, base + i * G_::GS, A0[0], A1[0], A0[1], A1[1]);
            }
        }
    }
    }
}

// The constants of a byte-path LUT staging at Q bits, and the two rows' first codes of lane (m8, quarter qt).
template <int Q>
struct LutStage {
    static_assert(Q >= 5, "q = 3, 4 keep their LUTs in registers");
    static constexpr int R = lut_reps<Q>();             // replicas (ap_decode.cuh)
    static constexpr int CODES = (1 << Q) / 4;          // codes per lane and row
    static constexpr int LOADS = CODES / 8;             // 16-byte loads per row
    static constexpr int BATCH = LOADS < 4 ? LOADS : 4; // loads per row in flight at once
    static __device__ __forceinline__ const u16* src(const BlockRef& blk, const Tile& tl, int m, int qt) {
        return blk.lut + (long long)mrow(tl, m) * (1 << Q) + qt * CODES;
    }
};

// Stage LUT_Q of the warp's 16 m-rows into its shared-memory slice (byte path), converted to the activation
// dtype. Lane (m8 = lane & 7, quarter = lane >> 3) loads a quarter of the codes of rows m8
// and m8 + 8 with 16-byte loads, a batch of them in flight at once, and stores each (m8, m8 + 8) pair as one
// word into every replica. With PW_LUTSTAGE the row group's k-split warps share the work (warp ks the loads
// li = ks mod ksplit; with a single load, 5 bits, its groups of four stores), and store j of every four consecutive
// 32-byte slots goes to slot (j + quarter) % 4, so the 32 lanes of a store hit 32 banks; without it every warp of the
// group stores the whole slice, and the four lanes of a store that share m8 share a bank.
#if PW_LUTSTAGE
template <int Q>
__device__ __forceinline__ void stage_lut(const BlockRef& blk, const Tile& tl, u16* lut_s) {
    using S = LutStage<Q>;
    constexpr int R = S::R, CODES = S::CODES, LOADS = S::LOADS, BATCH = S::BATCH;
    const int lane = threadIdx.x & 31, m8 = lane & 7, qt = lane >> 3;
    const int kmask = tl.ksplit - 1, ks = tl.ks & kmask;  // an idle warp (tl.ks past K) stages as warp 0
    const u16* src0 = S::src(blk, tl, m8, qt);
    const u16* src1 = S::src(blk, tl, m8 + 8, qt);
    char* dst = reinterpret_cast<char*>(lut_s) + qt * CODES * R * 32 + m8 * 4;
#pragma unroll
    for (int b0 = 0; b0 < LOADS; b0 += BATCH) {
        u32x4 a[BATCH], b[BATCH];
#pragma unroll
        for (int i = 0; i < BATCH; ++i) {
            if (LOADS == 1 || ((b0 + i) & kmask) == ks) {
                a[i] = ldg_nc_v4(src0 + 8 * (b0 + i));
                b[i] = ldg_nc_v4(src1 + 8 * (b0 + i));
            }
        }
#pragma unroll
        for (int i = 0; i < BATCH; ++i) {
            const u32 av[4] = {a[i].x, a[i].y, a[i].z, a[i].w}, bv[4] = {b[i].x, b[i].y, b[i].z, b[i].w};
            char* d = dst + (b0 + i) * 8 * R * 32;  // the 8 R slots (code e, replica r at slot e R + r) of codes 8 li ..
#pragma unroll
            for (int grp = 0; grp < 2 * R; ++grp) {
                if (LOADS == 1 ? (grp & kmask) != ks : ((b0 + i) & kmask) != ks) continue;  // the k-split warps share
                constexpr int NE = 4 / R;  // codes of the group: 4 grp / R ..
                u32 w[NE];
#pragma unroll
                for (int k = 0; k < NE; ++k) {
                    const int e = 4 * grp / R + k;
                    const u32 lo = lut2act<BF>((u16)(e & 1 ? av[e >> 1] >> 16 : av[e >> 1] & 0xffffu));
                    const u32 hi = lut2act<BF>((u16)(e & 1 ? bv[e >> 1] >> 16 : bv[e >> 1] & 0xffffu));
                    w[k] = lo | (hi << 16);
                }
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    const int sl = (j + qt) & 3;  // store j of four consecutive slots goes to slot (j + qt) % 4
                    u32 v = w[0];
                    if constexpr (R == 2) v = (sl & 2) ? w[1] : w[0];
                    if constexpr (R == 1) v = (sl & 2) ? ((sl & 1) ? w[3] : w[2]) : ((sl & 1) ? w[1] : w[0]);
                    *reinterpret_cast<u32*>(d + (4 * grp + sl) * 32) = v;
                }
            }
        }
    }
    __syncwarp();
}
#else
template <int Q>
__device__ __forceinline__ void stage_lut(const BlockRef& blk, const Tile& tl, u16* lut_s) {
    using S = LutStage<Q>;
    constexpr int R = S::R, CODES = S::CODES, LOADS = S::LOADS, BATCH = S::BATCH;
    const int lane = threadIdx.x & 31, m8 = lane & 7, qt = lane >> 3;
    const u16* src0 = S::src(blk, tl, m8, qt);
    const u16* src1 = S::src(blk, tl, m8 + 8, qt);
    u32* dst = reinterpret_cast<u32*>(lut_s);
#pragma unroll
    for (int b0 = 0; b0 < LOADS; b0 += BATCH) {
        u32x4 a[BATCH], b[BATCH];
#pragma unroll
        for (int i = 0; i < BATCH; ++i) {
            a[i] = ldg_nc_v4(src0 + 8 * (b0 + i));
            b[i] = ldg_nc_v4(src1 + 8 * (b0 + i));
        }
#pragma unroll
        for (int i = 0; i < BATCH; ++i) {
            const u32 av[4] = {a[i].x, a[i].y, a[i].z, a[i].w}, bv[4] = {b[i].x, b[i].y, b[i].z, b[i].w};
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                const u32 lo = lut2act<BF>((u16)(e & 1 ? av[e >> 1] >> 16 : av[e >> 1] & 0xffffu));
                const u32 hi = lut2act<BF>((u16)(e & 1 ? bv[e >> 1] >> 16 : bv[e >> 1] & 0xffffu));
                const int code = qt * CODES + (b0 + i) * 8 + e;
#pragma unroll
                for (int r = 0; r < R; ++r) dst[(code * R + r) * 8 + m8] = lo | (hi << 16);
            }
        }
    }
    __syncwarp();
}

#endif

// Two register buffers of plane words, used in alternation through a phase: the next chunk is in flight while
// one is decoded (no register copies: a copy of a register whose load is still in flight would wait for it
// and serialize the pipeline). Deeper rotations (3, 4 buffers) were measured and were not faster.
constexpr int NB = 2;

template <int Q, int PH>
__device__ __forceinline__ void pipe_step(u32 (&P)[NB][2][Q][Geom<Q>::WPL], bool ld, int cn, int cl, const BlockRef& blk,
                                          const Tile& tl, long long off0, long long off1, const u32 (&L)[2][8],
                                          u32 lut_row, u32 lut_stride, float (&acc)[NT * ACCS][4], int nt_act, const char* xs,
                                          const int (&xoff)[NT], int t) {
    if (ld) load_chunk<Q>(P[(PH + NB - 1) % NB], blk, tl, off0, off1, cn, t);
    compute_chunk<Q>(P[PH], L, lut_row, lut_stride, acc, nt_act, xs, xoff, cl, t);
}

// Shared-memory bytes for activations: the register-LUT decoders (q = 3, 4) leave the byte-path LUT slices after the
// activation region free.
template <int PATH>
__device__ __forceinline__ int xs_room(const Tile& tl) {
    return PATH == 0 && PW_XSLUT ? lut_region(tl.xs_budget) + WARPS / tl.ksplit * LUT_WARP_BYTES : tl.xs_budget;
}

// Accumulate this warp's 16 m-rows x n_tok tokens over its share of K into acc.
template <int Q>
__device__ void ap_mma(const BlockRef& blk, const Tile& tl, char* xs, u16* lut_s, float (&acc)[NT * ACCS][4]) {
    constexpr int PATH = (Q == 3 || Q == 4) ? 0 : 1;
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int r0 = mrow(tl, g), r1 = mrow(tl, g + 8);
    const long long off0 = (long long)r0 * tl.W, off1 = (long long)r1 * tl.W;
    const int nt_act = (tl.n_tok + 7) >> 3;
    const int nchunks = (tl.W + Geom<Q>::CW - 1) / Geom<Q>::CW;
    const int cps = chunks_per_segment<Q>(xs_room<PATH>(tl), tl.n_tok, nchunks, tl.ksplit);
    const int pitch = cps * Geom<Q>::XB + XS_ROW_PAD;
    int xoff[NT];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
        // lanes of a token column past n_tok read the last token's row: a column of C only ever sees its own
        // B column, so the extra columns are finite and never stored, and the loads need no predicate
        const int n = max(0, min(nt * 8 + g, tl.n_tok - 1));
        xoff[nt] = n * pitch + xs_swz<Geom<Q>::WPL>(n);
    }

    // Prologue, ordered so its latencies overlap: the first chunk's plane loads, then the register LUT's
    // loads, then the first segment of activations (its loads wait while the others fly), then the LUT.
    const int n_my = nchunks > tl.ks ? (nchunks - 1 - tl.ks) / tl.ksplit + 1 : 0;
    u32 P[NB][2][Q][Geom<Q>::WPL];
    if (n_my > 0) load_chunk<Q>(P[0], blk, tl, off0, off1, tl.ks, t);

    u32 L[2][8];
    u32x4 raw[2][2];
    if constexpr (PATH == 0) {
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) {
            const u16* lr = blk.lut + (long long)(rr ? r1 : r0) * (1 << Q);
#pragma unroll
            for (int half = 0; half < Q - 2; ++half) raw[rr][half] = ldg_nc_v4(lr + 8 * half);  // entries 8*half..
        }
    }
    if constexpr (PATH == 1 && PW_LUTSTAGE) stage_lut<Q>(blk, tl, lut_s);  // the LUTs are never written by kernels
    pdl_wait();  // launch 2 (a block) may start while launch 1 (the previous kernel) runs: everything above overlaps it
    fill_x<Q>(xs, tl, 0, pitch, cps, nchunks);
#pragma unroll
    for (int rr = 0; rr < 2; ++rr)
#pragma unroll
        for (int k = 0; k < 8; ++k) L[rr][k] = 0u;
    if constexpr (PATH == 0) {
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) reg_lut<Q, BF>(raw[rr], L[rr]);
    } else if constexpr (!PW_LUTSTAGE) {
        stage_lut<Q>(blk, tl, lut_s);
    }
    __syncthreads();

    const u32 lut_row = static_cast<u32>(__cvta_generic_to_shared(lut_s)) + g * 4 + (t % lut_reps<Q>()) * 32;
    // bytes between a row's LUT entries, 32 R; K < 2^30, so the OR adds nothing but keeps the value in a register
    const u32 lut_stride = (32u * lut_reps<Q>()) | static_cast<u32>(tl.K >> 30);
    const int nseg = (nchunks + cps - 1) / cps;
    int my = 0, phase = 0;
    for (int seg = 0; seg < nseg; ++seg) {
        if (seg > 0) {
            __syncthreads();  // the previous segment's activations are no longer read
            fill_x<Q>(xs, tl, seg, pitch, cps, nchunks);
            __syncthreads();
        }
        const int cend = min(nchunks, (seg + 1) * cps);
        while (my < n_my && tl.ks + my * tl.ksplit < cend) {
            const int nxt = my + NB - 1;
            const bool ld = nxt < n_my;
            const int cn = tl.ks + nxt * tl.ksplit;
            const int cl = tl.ks + my * tl.ksplit - seg * cps;
            if (phase == 0) pipe_step<Q, 0>(P, ld, cn, cl, blk, tl, off0, off1, L, lut_row, lut_stride, acc, nt_act, xs, xoff, t);
            else pipe_step<Q, 1>(P, ld, cn, cl, blk, tl, off0, off1, L, lut_row, lut_stride, acc, nt_act, xs, xoff, t);
            phase ^= 1;
            ++my;
        }
    }
}

#if PW_B1
// One token at q = 3 or 4, on the binary tensor cores (ap_b1.cuh): the loads and k-split of ap_mma<3>, 16-word chunks at
// both widths; the token's activations staged as int16 bit-planes instead of 16-bit values; the result in acc[0] (row g,
// column 0 in [0], row g + 8 in [2]) for reduce_ksplit and the epilogue, which store column 0 only. One register
// buffer of plane words: each chunk's loads are issued after the previous chunk's decode (two buffers in alternation,
// as ap_mma keeps them, were measured 5-8% slower at q = 3: cuda/NOTES.md, session 15).
template <int Q>
__device__ void ap_b1(const BlockRef& blk, const Tile& tl, char* xs, float (&acc)[NT * ACCS][4]) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int r0 = mrow(tl, g), r1 = mrow(tl, g + 8);
    const long long off0 = (long long)r0 * tl.W, off1 = (long long)r1 * tl.W;
    const int nchunks = (tl.W + 15) / 16;
    const int n_my = nchunks > tl.ks ? (nchunks - 1 - tl.ks) / tl.ksplit + 1 : 0;
    u32 P[2][Q][4];
    if (n_my > 0) load_chunk<Q, 16>(P, blk, tl, off0, off1, tl.ks, t);
    char* lut_s = xs + b1::lut_offset(nchunks) + (threadIdx.x >> 5) * b1::LUT_BYTES;
    b1::lut_copy<Q>(lut_s, blk.lut, r0, r1);
    pdl_wait();  // as in ap_mma: the weights above may load while the kernel before this one finishes
    b1::stage_x<BF, THREADS, Q == 3>(xs, tl.x + (long long)(tl.rows[0] / tl.row_div) * tl.ldx, tl.K, tl.x_vec, nchunks);
    __syncthreads();
    float y[b1::Y<Q>][2], ysum = 0.f;
#pragma unroll
    for (int v = 0; v < b1::Y<Q>; ++v) y[v][0] = y[v][1] = 0.f;
    for (int my = 0; my < n_my; ++my) {
        if (my > 0) load_chunk<Q, 16>(P, blk, tl, off0, off1, tl.ks + my * tl.ksplit, t);
        b1::chunk<Q>(P, xs, nchunks, tl.ks + my * tl.ksplit, y, ysum);
    }
    float out[2];
    b1::finish<BF, Q>(y, ysum, lut_s, out);
#pragma unroll
    for (int k = 0; k < NT * ACCS; ++k)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[k][i] = 0.f;
    acc[0][0] = out[0];
    acc[0][2] = out[1];
}
#endif

__device__ __forceinline__ void ap_mma_any(const BlockRef& blk, const Tile& tl, char* xs, u16* lut_s, float (&acc)[NT * ACCS][4]) {
#if PW_B1
    if constexpr (NT <= 2) {  // one token of a launch of one or two n-tiles at 3 (4) bits, when its staged chunks fit
        if (blk.q <= PW_B1 && tl.n_tok == 1 && b1::smem_bytes((tl.W + 15) / 16, WARPS) <= xs_room<0>(tl)) {
            if (blk.q == 3) {
                ap_b1<3>(blk, tl, xs, acc);
                return;
            }
            if constexpr (PW_B1 >= 4) {
                if (blk.q == 4) {
                    ap_b1<4>(blk, tl, xs, acc);
                    return;
                }
            }
        }
    }
#endif
    switch (blk.q) {
        case 3: ap_mma<3>(blk, tl, xs, lut_s, acc); break;
        case 4: ap_mma<4>(blk, tl, xs, lut_s, acc); break;
        case 5: ap_mma<5>(blk, tl, xs, lut_s, acc); break;
        case 6: ap_mma<6>(blk, tl, xs, lut_s, acc); break;
        case 7: ap_mma<7>(blk, tl, xs, lut_s, acc); break;
        case 8: ap_mma<8>(blk, tl, xs, lut_s, acc); break;
        default: break;  // not resident (or below the 3-bit floor): contributes zero
    }
}

// Sum the k-slices of each row group into the ks == 0 warp (reuses the activation area).
__device__ void reduce_ksplit(float (&acc)[NT][4], char* smem, int warp, int ks, int ksplit) {
    __syncthreads();
    if (ksplit == 1) return;
    float* red = reinterpret_cast<float*>(smem);
    const int lane = threadIdx.x & 31;
    if (ks != 0) {
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int i = 0; i < 4; ++i) red[((warp * NT + nt) * 4 + i) * 32 + lane] = acc[nt][i];
    }
    __syncthreads();
    if (ks == 0) {
        for (int o = 1; o < ksplit; ++o)
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int i = 0; i < 4; ++i) acc[nt][i] += red[(((warp + o) * NT + nt) * 4 + i) * 32 + lane];
    }
}

// ---------------------------------------------------------------- the kernel
// One entry point for the three uses, so the decode loop is compiled once per module:
//   mode 0, gate_up: grid = (max_active + overflow) * n_tiles (expert slots x row tiles, ap_route.cuh);
//                    block = block_base + 2e; rows = I (gate) / I + r (up);
//                    x = hidden [T, H]; dst = act [T * topk, I] = act_f(gate x) * (up x).
//   mode 1, down:    block = block_base + 2e + 1; x = act; partial[slot, H]; dst = out [T, H].
//   mode 2, linear:  one block (block_base), all T tokens; dst = y [T, out_rows] (ld_dst). Row group rg of CTA c
//                    is 16-row group c + rg * gridDim.x (moe.linear_grid: one full wave where that is more CTAs).
// m_rows: I (mode 0) or the output rows (modes 1, 2); K: input features. A CTA serves up to 8 NT of its expert's
// tokens (one token group); the grid is one-dimensional.
extern "C" __global__ void __launch_bounds__(THREADS, PW_MINB) pw_ap_moe(
    int mode, const long long* __restrict__ table, long long block_base, const u16* __restrict__ x, long long ldx,
    int x_vec, const long long* __restrict__ topk_ids, const float* __restrict__ topk_w, int T, int topk, int E,
    int m_rows, int K, int ksplit, int n_tiles, int xs_budget, u16* __restrict__ dst, long long ld_dst,
    float* __restrict__ partial, int* __restrict__ counters) {
    extern __shared__ __align__(16) char smem[];
    __shared__ int s_ids[MAX_TK];
    __shared__ u32 s_bitmap[MAX_EXPERT_WORDS];
    __shared__ int s_slots[MAX_TOK];
    __shared__ int s_info[5];

    // the next launch (launch 2 after mode 0, another block after mode 2) may be scheduled as soon as every CTA
    // here runs; its CTAs take the SMs this launch leaves idle and load their weights while it finishes
    if (mode != 1) pdl_launch_dependents();
    const int tile = blockIdx.x % n_tiles;
    const int slot = blockIdx.x / n_tiles, primary = min(E, T * topk);  // expert slot; from `primary` on: overflow
    int e = 0, n_act = 1, n_tok, group = 0;
    if (mode == 2) {
        for (int i = threadIdx.x; i < MAX_TOK; i += THREADS) s_slots[i] = i;
        __syncthreads();
        n_tok = T < MAX_TOK ? T : MAX_TOK;
    } else {
        // the routing's counts go to the dynamic shared memory, which nothing uses yet (moe.py checks its size)
#if PW_OVERFLOW
        if (slot >= primary)
            route<THREADS, true>(topk_ids, T * topk, E, slot, primary, 8 * NT, reinterpret_cast<int*>(smem), s_ids,
                                 s_bitmap, s_slots, s_info);
        else
#endif
            route<THREADS, false>(topk_ids, T * topk, E, slot, primary, 8 * NT, nullptr, s_ids, s_bitmap, s_slots, s_info);
        e = s_info[0];
        n_act = s_info[1];
        n_tok = s_info[2];
#if PW_OVERFLOW
        group = s_info[4];
        if (e < 0 || n_tok == 0) {
            if (slot < primary || mode != 1) return;
            e = 0;  // an overflow slot of launch 2 without work still counts its arrival below
            n_tok = 0;
        }
#else
        if (e < 0 || n_tok == 0) return;
#endif
    }
    // token group `group`: the expert's tokens t0 .. t0 + 8 NT - 1 (the launch's NT fits the tokens an expert usually
    // gets; an expert that gets more is served by overflow slots, one a further group)
    // (blockIdx.y is 0: the grid has one row. Written as a constant 0, it made ptxas spill 16 more bytes in the one-n-tile
    // builds without overflow slots.)
    const int t0 = (PW_OVERFLOW ? group : (int)blockIdx.y) * 8 * NT;
    n_tok = min(n_tok - t0, 8 * NT);
    if (n_tok <= 0 && mode != 1) return;  // down CTAs of overflow slots without work still count below

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int rgs = WARPS / ksplit, rg = warp / ksplit, ks = warp % ksplit;
    const int rows_per_warp = mode == 0 ? 8 : 16;
    const int tile_rows = rows_per_warp * rgs;
    // mode 2: row group rg of CTA c is row group c + rg * gridDim.x, so any grid of at least n_tiles CTAs covers every
    // row, and a grid of one full wave (more CTAs, some with idle warps) spreads the row groups evenly over the SMs
    const int rbase = mode == 2 ? (blockIdx.x + rg * gridDim.x) * 16 : tile * tile_rows + rg * rows_per_warp;
    const bool idle = rbase >= m_rows;  // a warp past the last row: no chunks of K (it still stages and syncs)

    Tile tl;
    if (mode == 0) {
        tl.base0 = rbase;
        tl.lim0 = m_rows;
        tl.base1 = m_rows + rbase;
        tl.lim1 = 2 * m_rows;
    } else {
        tl.base0 = rbase;
        tl.lim0 = m_rows;
        tl.base1 = rbase + 8;
        tl.lim1 = m_rows;
    }
    tl.K = K;
    tl.W = (K + 31) >> 5;
    tl.ks = idle ? (1 << 24) : ks;  // an idle warp owns no chunk of K
    tl.ksplit = ksplit;
    tl.n_tok = n_tok;
    tl.x = x;
    tl.ldx = ldx;
    tl.rows = s_slots + t0;
    tl.row_div = mode == 0 ? topk : 1;
    tl.x_vec = x_vec != 0;
    tl.xs_budget = xs_budget;

    const BlockRef blk = read_block(table, mode == 2 ? block_base : block_base + 2LL * e + (mode == 1 ? 1 : 0));
    // one byte-path LUT slice per row group: the k-split warps of a group stage the same values into it
    // (before the barrier that ends the prologue), so the launch reserves WARPS / ksplit slices
    u16* lut_s = reinterpret_cast<u16*>(smem + lut_region(xs_budget) + rg * LUT_WARP_BYTES);

    if (n_tok > 0) {
        float sets[NT * ACCS][4];
#pragma unroll
        for (int k = 0; k < NT * ACCS; ++k)
#pragma unroll
            for (int i = 0; i < 4; ++i) sets[k][i] = 0.f;
        ap_mma_any(blk, tl, smem, lut_s, sets);
        float acc[NT][4];
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[nt][i] = ACCS == 2 ? sets[2 * nt][i] + sets[2 * nt + 1][i] : sets[nt][i];
        reduce_ksplit(acc, smem, warp, ks, ksplit);

        if (ks == 0) {
            const int ra = rbase + g, rb = rbase + 8 + g;
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int cc = 0; cc < 2; ++cc) {
                    const int n = nt * 8 + 2 * t + cc;
                    if (n >= n_tok) continue;
                    const int slot = tl.rows[n];
                    if (mode == 0) {
                        if (ra < m_rows)
                            dst[(long long)slot * m_rows + ra] = f2act<BF>(act_f(acc[nt][cc]) * acc[nt][2 + cc]);
                    } else if (mode == 1) {
                        const float wv = topk_w[slot];
                        if (ra < m_rows) partial[(long long)slot * m_rows + ra] = wv * acc[nt][cc];
                        if (rb < m_rows) partial[(long long)slot * m_rows + rb] = wv * acc[nt][2 + cc];
                    } else {
                        if (ra < m_rows) dst[(long long)slot * ld_dst + ra] = f2act<BF>(acc[nt][cc]);
                        if (rb < m_rows) dst[(long long)slot * ld_dst + rb] = f2act<BF>(acc[nt][2 + cc]);
                    }
                }
        }
    }
    if (mode != 1) return;

    // down: the last CTA of this row tile sums the top-k slots of every token and re-arms the counter
    __threadfence();
    __syncthreads();
    // every active expert's first slot and every overflow slot arrive at each row tile
    const int arrivals = PW_OVERFLOW ? n_act + (int)(gridDim.x / n_tiles) - primary : n_act;
    if (threadIdx.x == 0) s_info[3] = (atomicAdd(&counters[tile], 1) == arrivals - 1) ? 1 : 0;
    __syncthreads();
    if (s_info[3]) {
        __threadfence();
        const int r0 = tile * tile_rows;
        const int nrows = min(tile_rows, m_rows - r0);
#pragma unroll 4
        for (int idx = threadIdx.x; idx < T * nrows; idx += THREADS) {
            const int tt = idx / nrows, r = r0 + idx % nrows;
            const float* src = partial + (long long)tt * topk * m_rows + r;
            float s = 0.f;
            for (int j = 0; j < topk; ++j) s += ldcg_f32(src + (long long)j * m_rows);  // slot order
            dst[(long long)tt * m_rows + r] = f2act<BF>(s);
        }
        if (threadIdx.x == 0) counters[tile] = 0;
    }
}
