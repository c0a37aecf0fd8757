"""`pwruntime quantize`: turn a HuggingFace MoE checkpoint into an AP checkpoint (pwruntime.quant).

Routed experts become 8 bit-planes + LUT_b per linear-block (per-row weighted k-means seeded at the
lowest requested bitwidth, upscaled to 8 bits); everything else is copied through at full precision.
Weighting: `hessian` (E[x_j^2] of each block's inputs on calibration text), `fisher` (sum of squared
LM-loss gradients on calibration text), or `none`; `auto` is hessian when --calib-data is given,
else none.

`--load-format dummy` (vLLM's name) reads no weights: the experts get random codes and LUTs, the rest random
weights (pwruntime.quant.dummy), from --model's config.json and tokenizer, or from a bundled model card named by
--model (`pwsim models`; the demo model's tokenizer): a checkpoint of a real model's size in seconds, to benchmark
serving, paging and planning at that size (with `--calibration synthetic`) without its weights or a k-means pass.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from policies.apformat import MAX_BITS
from pwruntime.calibrate.inputs import check_files
from traces.clikit import UserError, check_output, check_seed

WEIGHTINGS = ("auto", "hessian", "fisher", "none")


def parse_bits(text: str) -> tuple[int, ...]:
    """'3..8' or '3,4,6,8' -> sorted tuple of distinct bitwidths in 1..8."""
    try:
        if ".." in text:
            lo, hi = (int(x) for x in text.split(".."))
            listed = list(range(lo, hi + 1))
        else:
            listed = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"--bits {text!r} is not a range LO..HI or a comma list, e.g. 3..8") from None
    bits = tuple(sorted(set(listed)))
    if not bits or min(bits) < 1 or max(bits) > MAX_BITS:
        raise UserError(f"--bits {text!r} must name bitwidths in 1..{MAX_BITS}, e.g. 3..{MAX_BITS}")
    if len(bits) < len(listed):
        raise UserError(f"--bits {text!r} names a bitwidth more than once; list each once, e.g. 3,4,{MAX_BITS}")
    return bits


def register(subparsers) -> None:
    p = subparsers.add_parser("quantize", help="quantize a model's routed experts into an AP checkpoint",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True,
                   help="source HuggingFace checkpoint directory (with --load-format dummy: config.json and "
                        "tokenizer.json are enough, or a bundled model card's name)")
    p.add_argument("--load-format", choices=("auto", "dummy"), default="auto",
                   help="auto: read --model's weights; dummy: random weights of --model's shapes, no k-means "
                        "(for benchmarks; default auto)")
    p.add_argument("--out", required=True, help="output AP checkpoint directory (written atomically)")
    p.add_argument("--weighting", choices=WEIGHTINGS, default="auto", help="k-means weights (default: auto)")
    p.add_argument("--calib-data", nargs="+", default=[], metavar="FILE",
                   help="calibration text files (UTF-8, optionally .gz) for hessian/fisher weighting")
    p.add_argument("--calib-tokens", type=int, default=16384, help="calibration tokens to use (default 16384)")
    p.add_argument("--calib-seq-len", type=int, default=512, help="tokens per calibration sequence (default 512)")
    p.add_argument("--bits", default="3..8", help="stored bitwidths, LO..HI or a list (default 3..8)")
    p.add_argument("--seed", type=int, default=0, help="k-means++ seed (default 0)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out directory")
    p.add_argument("--json", action="store_true", help="print a JSON summary instead of text")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    bits = parse_bits(args.bits)
    if MAX_BITS not in bits:  # every AP store starts its blocks there (pwruntime.quant.store)
        raise UserError(f"--bits {args.bits!r} must include {MAX_BITS}, the AP checkpoint's top bitwidth that "
                        f"serving starts from, e.g. {','.join(map(str, bits))},{MAX_BITS} or 3..{MAX_BITS}")
    check_seed(args.seed)
    write = _dummy(args, bits) if args.load_format == "dummy" else _kmeans(args, bits)
    check_output(args.out)
    if Path(args.model).is_dir() and Path(args.out).resolve() == Path(args.model).resolve():
        raise UserError(f"--out {args.out} is the --model directory; write the AP checkpoint to another directory")
    summary = write()
    if args.json:
        json.dump(summary, sys.stdout, indent=2)
        print()
    elif args.load_format == "dummy":
        print(f"wrote {summary['out']}: {summary['blocks']} expert blocks at bits {summary['bits']}, random (dummy) "
              f"weights, in {summary['total_seconds']:.1f} s")
    else:
        print(f"wrote {summary['out']}: {summary['blocks']} expert blocks at bits {summary['bits']} "
              f"({summary['weighting']} weighting)")
        print(f"time to quantize: {summary['quantize_seconds']:.1f} s (k-means {summary['kmeans_seconds']:.1f} s, "
              f"weights {summary['weighting_seconds']:.1f} s, total {summary['total_seconds']:.1f} s)")
    return 0


def _kmeans(args: argparse.Namespace, bits: tuple[int, ...]):
    """The checked options of a quantization of --model's weights, as a call that writes it (pwruntime.quant.build)."""
    from pwruntime.quant.build import QuantizeOptions, quantize_checkpoint

    weighting = args.weighting
    if weighting == "auto":
        weighting = "hessian" if args.calib_data else "none"
    if weighting != "none" and not args.calib_data:
        raise UserError(f"--weighting {weighting} needs calibration text: pass --calib-data FILE...")
    if weighting == "none" and args.calib_data:
        raise UserError("--weighting none reads no calibration text: drop --calib-data, or weight the k-means by it "
                        "with --weighting hessian or fisher")
    if args.calib_tokens < 2 or args.calib_seq_len < 2:
        raise UserError("--calib-tokens and --calib-seq-len must be at least 2")
    check_files(args.calib_data, "calibration file", "--calib-data")
    opts = QuantizeOptions(bits=bits, weighting=weighting, calib_files=tuple(args.calib_data),
                           calib_tokens=args.calib_tokens, calib_seq_len=args.calib_seq_len, seed=args.seed,
                           overwrite=args.overwrite)
    return lambda: quantize_checkpoint(args.model, args.out, opts)


def _dummy(args: argparse.Namespace, bits: tuple[int, ...]):
    """`--load-format dummy`: random experts and weights of --model's shapes (pwruntime.quant.dummy), as a call."""
    from pwruntime.quant.dummy import write_dummy_checkpoint

    if args.weighting not in ("auto", "none") or args.calib_data:
        raise UserError("--load-format dummy makes random weights, which no k-means weighting applies to: drop "
                        "--weighting and --calib-data")
    return lambda: write_dummy_checkpoint(args.model, args.out, bits=bits, seed=args.seed, overwrite=args.overwrite)
