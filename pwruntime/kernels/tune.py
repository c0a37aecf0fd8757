"""Kernel tuning harness: time one AP linear-block and whole MoE layers for a few shapes, bits and T.

`python -m pwruntime.kernels.tune` prints a short table (median of CUDA-graph replays, rotated
copies so the L2 does not hold the weights) for the Mixtral-expert block (14336 x 4096) at T = 1
and 8, and optionally MoE layers; `--once` runs each case a single time (for `ncu`);
`--load-patterns` times cuda/load_pattern.cu, the block's 3-bit planes read with no decode;
`--attention` times paged-attention decode (the GQA kernel against the generic one) on a few batch
and context shapes, Gemma 4's among them (sliding layers' 256-wide heads within their window of 1024, global layers'
512-wide ones). It is the quick loop behind kernel changes; `pwruntime bench kernels` is the
full benchmark.
"""
from __future__ import annotations

import argparse

import torch

from pwruntime.kernels import bench as kb
from traces.clikit import write_json_atomic


def force_ksplit(ksplit: int | None, warps: int = 4) -> None:
    """Replace the launch planner (MoE launches and the single block alike) by one that always splits K `ksplit`
    ways in CTAs of `warps` warps (this process only). Without `ksplit` it keeps the planner's k-split, at most
    `warps` (both are powers of two, so the k-split still divides the CTA's warps)."""
    from pwruntime.kernels import moe
    plan = moe.plan_launch

    def forced(m_rows, k, tokens, rows_per_warp, ctas_per_tile, max_ctas_per_tile, sm_count=132, tile_tokens=None):
        p = plan(m_rows, k, tokens, rows_per_warp, ctas_per_tile, max_ctas_per_tile, sm_count, tile_tokens)
        return p.resplit(m_rows, rows_per_warp, warps, ksplit or min(p.ksplit, warps))

    moe.plan_launch = forced
    moe.single_block_plan = lambda out_f, in_f, tokens, sm_count=132: forced(out_f, in_f, tokens, 16, 1, 1, sm_count)


def force_gate_up_ksplit(ksplit: int) -> None:
    """Split the K of every MoE layer's first launch (gate_up) `ksplit` ways, same warps (this process only)."""
    from pwruntime.kernels import moe
    plans = moe.moe_plans

    def forced(shape, tokens, sm_count=132):
        p1, p2 = plans(shape, tokens, sm_count)
        return p1.resplit(shape.intermediate, 8, p1.warps, ksplit), p2

    moe.moe_plans = forced


def _extra_defines(extra: tuple[tuple[str, int], ...]) -> None:
    """Compile every kernel with these defines added (this process only)."""
    from pwruntime.kernels import compile as kc
    get = kc.get_kernel
    kc.get_kernel = lambda device, name, func, defines, dyn_smem=0: get(device, name, func,
                                                                          tuple(defines) + extra, dyn_smem)


def launch_load_pattern(planes, rows: int, words: int, ksplit: int, mode: int, sink: torch.Tensor) -> None:
    """One cuda/load_pattern.cu launch over 3 planes of rows x words int32 words (rows a multiple of 64, words
    of 16); it XORs every word it reads into sink[0] (`reference.load_pattern_ref`)."""
    from pwruntime.kernels import compile as kc
    kernel = kc.get_kernel(sink.device, "load_pattern.cu", "pw_load_pattern", ())
    grid = rows // (16 * (4 // ksplit))
    kc.launch(kernel, sink.device, (grid,), (128,), (kc.ptr(planes[0]), kc.ptr(planes[1]), kc.ptr(planes[2]),
                                                      kc.i32(words), kc.i32(ksplit), kc.i32(mode), kc.ptr(sink)))


def load_patterns(cfg: kb.BenchConfig, rows: int = 14336, words: int = 128, copies: int = 6) -> list[dict]:
    """Time cuda/load_pattern.cu: 3 planes of a rows x (32 words) block read in each access pattern and k-split."""
    gen = torch.Generator(device="cuda").manual_seed(cfg.seed)
    planes = [[torch.randint(0, 2 ** 31, (rows * words,), dtype=torch.int32, device="cuda", generator=gen)
               for _ in range(3)] for _ in range(copies)]
    sink = torch.zeros(1, dtype=torch.int32, device="cuda")
    nbytes = 3 * rows * words * 4
    out = []
    for mode in (0, 1, 2):
        for ksplit in (1, 2, 4):
            def launch_all() -> None:
                for p in planes:
                    launch_load_pattern(p, rows, words, ksplit, mode, sink)
            us = kb.graph_ms(kb.capture(launch_all), cfg) * 1000 / copies
            out.append({"mode": mode, "ksplit": ksplit, "us": us, "gbps": nbytes / us / 1e3})
    return out


# (sequences, context, heads, KV heads, head_dim, sliding window): head_dim 128, then Gemma 4's two layer geometries
ATTENTION_SHAPES = ((32, 2048, 32, 8, 128, None), (1, 32768, 32, 8, 128, None), (4, 8192, 32, 8, 128, None),
                    (1, 4096, 16, 16, 128, None), (64, 1024, 32, 4, 128, None), (8, 512, 16, 16, 128, None),
                    (8, 4096, 16, 8, 256, 1024), (1, 32768, 16, 8, 256, 1024), (64, 4096, 16, 8, 256, 1024),
                    (8, 4096, 16, 2, 512, None), (64, 2048, 16, 2, 512, None), (1, 32768, 16, 2, 512, None))


def attention_shapes(cfg: kb.BenchConfig) -> list[dict]:
    out = []
    for seqs, context, heads, kv_heads, dim, window in ATTENTION_SHAPES:
        gqa = kb.attention(cfg, seqs, context, heads, kv_heads, dim, window=window)
        generic = kb.attention(cfg, seqs, context, heads, kv_heads, dim, generic=True, window=window)
        out.append({**{k: gqa[k] for k in ("seqs", "context", "heads", "kv_heads", "head_dim", "window", "kv_bytes")},
                    "gqa_us": gqa["us"], "gqa_gbps": gqa["gbps"],
                    "generic_us": generic["us"], "generic_gbps": generic["gbps"]})
        torch.cuda.empty_cache()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bits", default="3,4,5,8")
    ap.add_argument("--tokens", default="1,8")
    ap.add_argument("--moe", default="", help="comma-separated model shapes for MoE-layer rows")
    ap.add_argument("--moe-tokens", default="1,16,64")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--once", action="store_true", help="run each block case once, untimed (for ncu)")
    ap.add_argument("--ksplit", type=int, default=None, choices=(1, 2, 4, 8),
                    help="force this k-split in every launch (experiments)")
    ap.add_argument("--warps", type=int, default=4, choices=(2, 4, 8, 16), help="warps per CTA (experiments; with --ksplit)")
    ap.add_argument("--wide-min-chunks", type=int, default=None,
                    help="8-warp CTAs (2..16 tokens) when each warp keeps this many 512-column chunks; a large "
                         "number turns them off (experiments)")
    ap.add_argument("--wide-max-nt", type=int, default=None,
                    help="8-warp CTAs for launches of up to this many n-tiles (experiments)")
    ap.add_argument("--define", action="append", default=[], metavar="NAME=VALUE",
                    help="extra compile-time define for every kernel (experiments), e.g. PW_MINB=5")
    ap.add_argument("--gate-up-ksplit", type=int, default=None, choices=(1, 2, 4, 8),
                    help="force this k-split in the MoE layers' first launch only (experiments)")
    ap.add_argument("--want", type=float, default=None,
                    help="CTAs an SM the k-split rule aims for at one token (default 2; experiments)")
    ap.add_argument("--xs-cap", type=int, default=None,
                    help="shared-memory bytes for staged activations when the whole K does not fit (experiments)")
    ap.add_argument("--block-xs-cap", type=int, default=None,
                    help="the same for the single block's 16-warp CTAs (experiments)")
    ap.add_argument("--xs-no-occupancy", action="store_true",
                    help="every MoE launch stages up to --xs-cap activations even where that costs a CTA an SM (experiments)")
    ap.add_argument("--driver-carveout", action="store_true",
                    help="leave each MoE launch's shared-memory configuration to the driver (experiments)")
    ap.add_argument("--load-patterns", action="store_true",
                    help="time the 3-bit block's planes read with no decode, per access pattern (cuda/load_pattern.cu)")
    ap.add_argument("--group-tokens", type=int, default=None, choices=(8, 16, 32, 64),
                    help="every MoE launch serves an expert's tokens in groups of this many (experiments)")
    ap.add_argument("--attention", action="store_true",
                    help="time paged-attention decode, GQA kernel vs generic kernel, on a few shapes")
    ap.add_argument("--dtype", default="fp16", choices=("fp16", "bf16"), help="activation dtype of blocks and layers")
    ap.add_argument("--routing", default="uniform", metavar="uniform|zipf:ALPHA",
                    help="MoE layers' routing: uniform, or each token's experts drawn with popularity 1 / rank^ALPHA")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.ksplit and args.warps % args.ksplit:
        ap.error(f"--ksplit {args.ksplit} does not divide the {args.warps} warps of a CTA; use --warps 8 or a smaller k-split")
    from pwruntime.kernels import moe   # the launch planner's constants, overridden for this process
    # the most activations a launch may stage next to its byte-path LUT slices (4 row groups a MoE CTA of 4 or 8
    # warps, 8 a block's 16-warp CTA)
    for flag, cap, groups, warps in (("--xs-cap", args.xs_cap, 4, 4), ("--block-xs-cap", args.block_xs_cap, 8, 16)):
        top = moe.SMEM_LIMIT - groups * moe.lut_slice_bytes(warps)
        if cap is not None and not moe.XS_CHUNK <= cap <= top:
            ap.error(f"{flag} {cap}: shared memory for activations must be {moe.XS_CHUNK}..{top} bytes "
                     f"(one token's 512-column chunk up to what the {groups} LUT slices leave)")
    try:
        kb.parse_routing(args.routing)
    except ValueError as e:
        ap.error(f"--routing: {e}")
    if not torch.cuda.is_available():
        ap.error("the kernel tuning harness needs a CUDA GPU (and CuPy); none is visible here")
    if args.define:
        _extra_defines(tuple((k, int(v)) for k, v in (d.split("=") for d in args.define)))
    if args.ksplit or args.warps != 4:
        force_ksplit(args.ksplit, args.warps)
    if args.group_tokens is not None:
        moe.GROUP_TOKENS = args.group_tokens
    if args.wide_min_chunks is not None:
        moe.WIDE_MIN_CHUNKS = args.wide_min_chunks
    if args.wide_max_nt is not None:
        moe.WIDE_MAX_NT = args.wide_max_nt
    if args.gate_up_ksplit is not None:
        force_gate_up_ksplit(args.gate_up_ksplit)
    if args.want is not None:
        moe.WANT_CTAS_PER_SM = args.want
    if args.xs_cap:
        moe.XS_CAP = args.xs_cap
    if args.block_xs_cap:
        moe.BLOCK_XS_CAP = args.block_xs_cap
    moe.OCCUPANCY_XS = not args.xs_no_occupancy
    moe.LAYER_CARVEOUT = not args.driver_carveout
    bits = tuple(int(b) for b in args.bits.split(","))
    tokens = tuple(int(t) for t in args.tokens.split(","))
    cfg = kb.BenchConfig(reps=args.reps, warmup=3, dtype=args.dtype)
    rows = []
    if args.attention:
        for r in attention_shapes(cfg):
            rows.append(r)
            window = f", window {r['window']}" if r["window"] else ""
            print(f"attention {r['seqs']:>3} x {r['context']:>5}, {r['heads']}/{r['kv_heads']} heads of "
                  f"{r['head_dim']}{window}: "
                  f"GQA {r['gqa_us']:7.1f} us {r['gqa_gbps']:5.0f} GB/s | generic {r['generic_us']:7.1f} us "
                  f"{r['generic_gbps']:5.0f} GB/s", flush=True)
    elif args.load_patterns:
        names = ("8 B a lane (v3)", "tiled 512 B a warp", "16 B a lane (v4, q=3)")
        for r in load_patterns(cfg):
            rows.append(r)
            print(f"load pattern {names[r['mode']]:>22s} ksplit {r['ksplit']}: {r['us']:6.1f} us {r['gbps']:6.0f} GB/s")
    elif args.once:
        kb.single_block_once(bits, tokens)
        torch.cuda.synchronize()
        return 0
    else:
        for r in kb.single_block(cfg, tokens=tokens, bits=bits):
            rows.append(r)
            print(f"block {r['out']}x{r['in']} {args.dtype} T={r['tokens']} b={r['bits']}: {r['ap_us']:7.1f} us "
                  f"{r['ap_gbps']:6.0f} GB/s   fp16 {r['fp16_us']:6.1f} us", flush=True)
        for m in filter(None, args.moe.split(",")):
            mcfg = kb.BenchConfig(models=(m,), tokens=tuple(int(t) for t in args.moe_tokens.split(",")),
                                  reps=args.reps, warmup=3, dtype=args.dtype, routing=args.routing)
            for r in kb.moe_layers(mcfg, m, bits=bits, baselines=False):
                rows.append(r)
                print(f"moe {m} {args.dtype} T={r['tokens']} b={r['bits']}: {r['ap_us']:7.1f} us {r['ap_gbps']:6.0f} GB/s "
                      f"(active {r['active_experts']})", flush=True)
            torch.cuda.empty_cache()
    if args.out:
        write_json_atomic(args.out, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
