"""`pwruntime calibrate`: the planner's offline calibration (Omega_off) of a model and its AP checkpoint.

Runs calibration text through the full-precision model; measures every expert linear-block's output
error at every stored bitwidth of the AP checkpoint; writes the sensitivity table (Eq. 2), the
prompt-residual heads (Eqs. 5-6), routing buckets / multipliers / floors / depth caps / alpha chosen
by a small search on held-out text, the initial assignment and per-domain measured damages, as a
calibration directory (calibration.json + arrays.npz) stamped with the model's fingerprint.
--ap is required: the calibration must describe the very AP weights the runtime serves
(make them with `pwruntime quantize --model DIR --out AP`).
"""
from __future__ import annotations

import argparse
import json
import sys

from traces.clikit import UserError, check_seed


def register(subparsers) -> None:
    p = subparsers.add_parser("calibrate", help="offline calibration of the PagedWeight planner",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="full-precision HuggingFace checkpoint directory")
    p.add_argument("--ap", required=True, help="its AP checkpoint (from `pwruntime quantize`)")
    p.add_argument("--data", required=True, nargs="+", metavar="FILE",
                   help="calibration text files (UTF-8, optionally .gz); tokens are shared evenly among them")
    p.add_argument("--out", required=True, help="calibration directory to write (atomically)")
    p.add_argument("--domains", nargs="+", default=[], metavar="NAME=FILE",
                   help="held-out text per domain for the simulator's per-domain damages E_d")
    p.add_argument("--heldout-fraction", type=float, default=0.25,
                   help="fraction of calibration sequences held out for head confidence and the search (0.25)")
    p.add_argument("--tokens", type=int, default=16384, help="calibration tokens (default 16384)")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per calibration sequence (default 512)")
    p.add_argument("--domain-tokens", type=int, default=8192, help="tokens per --domains file (default 8192)")
    p.add_argument("--initial-mean-bits", type=float, default=8.0,
                   help="mean bitwidth of the sensitivity-optimal initial assignment (default 8: all blocks at "
                        "the top bitwidth; the planner lowers them under KV pressure)")
    p.add_argument("--search-bits", type=int, default=5,
                   help="the search's byte target frees what going from the initial assignment to uniform "
                        "SEARCH_BITS frees (default 5)")
    p.add_argument("--sensitivity", choices=["frequency", "routed"], default="frequency",
                   help="scale s[i, b] by the expert's calibration routing frequency (frequency, default) or keep "
                        "it per routed token (routed); see pwruntime.calibrate.global_sensitivity")
    p.add_argument("--seed", type=int, default=0, help="seed of the train/held-out split (default 0)")
    p.add_argument("--device", default="auto", help="cpu, cuda or cuda:N (auto: cuda if available)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out directory")
    p.add_argument("--json", action="store_true", help="print a JSON summary instead of text")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from pwruntime.calibrate import CalibrateOptions, calibrate
    from pwruntime.calibrate.inputs import parse_domains

    check_seed(args.seed)
    domains = parse_domains(args.domains)
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if not 0.0 < args.heldout_fraction < 1.0:
        raise UserError(f"--heldout-fraction must be between 0 and 1 (exclusive), got {args.heldout_fraction}")
    opts = CalibrateOptions(model=args.model, ap=args.ap, data=tuple(args.data), out=args.out,
                            domains=tuple((k, str(v)) for k, v in domains.items()),
                            heldout_fraction=args.heldout_fraction, tokens=args.tokens, seq_len=args.seq_len,
                            domain_tokens=args.domain_tokens, initial_mean_bits=args.initial_mean_bits,
                            search_bits=args.search_bits, sensitivity=args.sensitivity, seed=args.seed,
                            device=device, overwrite=args.overwrite)
    _, summary = calibrate(opts)
    if args.json:
        json.dump(summary, sys.stdout, indent=2)
        print()
        return 0
    ch = summary["chosen"]
    print(f"wrote {summary['out']}: {summary['blocks']} blocks, bits {summary['bits']}, fingerprint "
          f"{summary['fingerprint']}")
    print(f"sequences: {summary['sequences']['train']} train / {summary['sequences']['heldout']} held out "
          f"({summary['tokens']['train']} / {summary['tokens']['heldout']} tokens)")
    print(f"search ({summary['candidates']} candidates, target {summary['target_bytes']} B): alpha {ch['alpha']}, "
          f"buckets {ch['bucket_bounds']} x {ch['bucket_multipliers']}, floors {ch['floor_stages']}, "
          f"depth caps {ch['depth_caps']}; held-out damage {summary['chosen_score']:.4g}")
    for r in summary["references"]:
        print(f"  reference {r['reference']}: {r['score']:.4g} (frees {r['bytes_freed']} B)")
    conf = ", ".join(f"{k} {v:.2f}" for k, v in summary["head_confidence"].items())
    print(f"residual head confidence: {conf}")
    if summary["domains"]:
        print(f"per-domain damages: {', '.join(summary['domains'])}")
    print(f"wall time: {summary['wall_seconds']:.1f} s")
    return 0
