"""`pwruntime quality-table`: perplexity per domain and weight bytes at full precision and uniform AP bits.

Rows: the full-precision model, then its AP checkpoint with every expert block at each of --bits
(through APExpertStore). Bytes: routed experts at b bits from the page table (planes + LUT_b),
every other tensor in fp16; the full-precision row counts the experts in fp16. Prints a markdown
table (the README's), or JSON with --json. With --calibration (the model's `pwruntime calibrate`
output), rows also carry the simulator's expected damage per token and --fit-out writes the
(damage, perplexity) points in pwsim's quality-fit format.
"""
from __future__ import annotations

import argparse
import json
import sys

from traces.clikit import UserError, check_output, write_json_atomic


def register(subparsers) -> None:
    p = subparsers.add_parser("quality-table", help="perplexity and weight bytes at fp and uniform AP bitwidths",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="full-precision HuggingFace checkpoint directory")
    p.add_argument("--ap", required=True, help="its AP checkpoint (from `pwruntime quantize`)")
    p.add_argument("--data", required=True, nargs="+", metavar="NAME=FILE", help="text per domain (UTF-8 or .gz)")
    p.add_argument("--bits", default="8,6,5,4,3", help="uniform bitwidths to evaluate (default 8,6,5,4,3)")
    p.add_argument("--context", type=int, default=None, help="window length (default min(512, max positions))")
    p.add_argument("--stride", type=int, default=None, help="tokens between windows (default context/2)")
    p.add_argument("--max-tokens", type=int, default=32768, help="first N tokens of each file (default 32768)")
    p.add_argument("--calibration", default=None, help="the model's calibration directory (adds damage per token)")
    p.add_argument("--fit-out", default=None, help="write (damage, ppl) points for pwsim (needs --calibration)")
    p.add_argument("--dtype", default="auto", choices=["auto", "fp32", "fp16", "bf16"],
                   help="compute dtype (auto: fp32 on cpu, bf16 on cuda)")
    p.add_argument("--device", default="auto", help="cpu, cuda or cuda:N (auto: cuda if available)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from pwruntime.calibrate.inputs import parse_domains
    from pwruntime.calibrate.quality import quality_table
    from pwruntime.cmd_quantize import parse_bits

    files = parse_domains(args.data, "--data")
    bits = tuple(sorted(parse_bits(args.bits), reverse=True))
    if args.fit_out and not args.calibration:
        raise UserError("--fit-out needs --calibration DIR (the damages come from the calibration)")
    if args.fit_out:
        check_output(args.fit_out, "--fit-out", directory=False)
    if args.max_tokens is not None and args.max_tokens < 2:
        raise UserError(f"--max-tokens must be at least 2, got {args.max_tokens}")
    if args.context is not None and args.context < 2:
        raise UserError(f"--context must be at least 2, got {args.context}")
    if args.stride is not None and args.stride < 1:
        raise UserError(f"--stride must be at least 1, got {args.stride}")
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = args.dtype if args.dtype != "auto" else ("fp32" if device.startswith("cpu") else "bf16")
    result = quality_table(args.model, args.ap, files, bits=bits, context=args.context, stride=args.stride,
                           max_tokens=args.max_tokens, device=device, dtype=dtype, calibration=args.calibration)
    if args.fit_out:
        write_json_atomic(args.fit_out, {"points": result["fit_points"],
                                         "source": f"pwruntime quality-table {args.model}"})
    if args.json:
        json.dump(result, sys.stdout, indent=2)
        print()
    else:
        print(result["markdown"])
        print(f"wall time: {result['seconds']:.1f} s")
    return 0
