"""`pwsim prefill-fit`: the cost model's prefill MoE layer against `pwruntime bench prefill`, and its fixed costs.

For each bench row (one MoE layer on the dequantize path, timed on the runtime's wall clock) it prices
the same layer with the hardware profile's cost model and fits `prefill_layer_overhead_us`, the fixed
cost of such a layer (the runtime's host work and launches), and `prefill_chunk_overhead_us`, what each
chunk of experts after the first adds (from rows benched at two `--prefill-chunk` sizes), as median gaps
(pwsim/prefill_fit.py). It writes `prefill_fit.json` (rows, ratios modeled / measured before and after the
fit, the fitted values, inputs) and `prefill_fit.png` (modeled against measured per row, y = x) into --out;
with --fit-profile also the hardware profile with the fitted values, for `pwsim run --hardware JSON`.
"""
from __future__ import annotations

import argparse
import shlex
from pathlib import Path

from traces.clikit import UserError


def register(subparsers) -> None:
    p = subparsers.add_parser("prefill-fit", help="fit a prefill MoE layer's fixed costs to `pwruntime bench prefill`",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bench", default=None, action="append", metavar="JSON",
                   help="what `pwruntime bench prefill --out` wrote (default: pwruntime/assets/prefill_bench.json); "
                        "again for another run on the same device (runs at two --prefill-chunk sizes fit the chunk "
                        "cost)")
    p.add_argument("--hardware", default="h200-measured", metavar="NAME_OR_JSON",
                   help="hardware profile to fit (bundled name or JSON path; default h200-measured)")
    p.add_argument("--out", default="runs/prefill-fit", help="directory for prefill_fit.json and prefill_fit.png")
    p.add_argument("--force", action="store_true", help="write into a non-empty --out that holds no prefill_fit.json")
    p.add_argument("--fit-profile", default=None, metavar="JSON",
                   help="also write the hardware profile with the fitted prefill overheads")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=run)


def _shown(path: Path) -> str:
    """`path` relative to the working directory when it lies under it (a command one can paste), else absolute."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path.resolve())


def _table(report: dict) -> str:
    head = (f"{'model':<20} {'T':>5} {'bits':>4} {'active':>6} {'chunks':>6} {'measured':>9} {'modeled':>8} "
            f"{'ratio':>6} {'fitted':>7} {'ratio':>6}")
    lines = [head]
    for r in report["rows"]:
        lines.append(f"{r['model']:<20} {r['tokens']:>5} {r['bits']:>4} {r['active_experts']:>6} {r['chunks']:>6} "
                     f"{r['measured_ms']:>9.3f} {r['modeled_ms']:>8.3f} {r['ratio']:>6.2f} {r['fitted_ms']:>7.3f} "
                     f"{r['fitted_ratio']:>6.2f}")
    return "\n".join(lines)


def run(args) -> int:
    from pwsim import plots
    from pwsim.output import write_report
    from pwsim.prefill_fit import DEFAULT_BENCH, fit, fitted_profile, read_benches
    from traces.hardware import load_profile
    from traces.results import dumps, prepare_dir

    if args.bench is None and not DEFAULT_BENCH.is_file():
        raise UserError(f"the bundled bench {DEFAULT_BENCH} is not here (an installed package leaves it out); pass "
                        "--bench FILE written by `pwruntime bench prefill --out FILE`")
    benches = [Path(b) for b in args.bench] if args.bench else [DEFAULT_BENCH]
    out = prepare_dir(args.out, args.force, "pwsim prefill-fit", "prefill_fit.json")
    device, commands, rows = read_benches(benches)
    profile = load_profile(args.hardware)
    report = fit(rows, profile)
    command = shlex.join(["pwsim", "prefill-fit", *(a for b in benches for a in ("--bench", _shown(b))),
                          "--hardware", args.hardware, "--out", str(args.out),
                          *(["--fit-profile", args.fit_profile] if args.fit_profile else [])])
    report["inputs"] = {"bench": [_shown(b) for b in benches], "bench_device": device, "bench_command": commands,
                        "hardware": args.hardware}
    report["command"] = command
    fitted = None
    if args.fit_profile:
        r = report["ratios"]
        note = (f"prefill_layer_overhead_us, prefill_chunk_overhead_us and ap_gemm_layer_overhead_us fitted by "
                f"`{command}` from "
                f"{len(report['rows'])} rows of {' and '.join(f'`{c}`' for c in commands)} "
                f"({device or 'device not recorded'}, {report['fit']['chunk_pairs']} pairs of rows at two "
                "chunk sizes): the medians of the measured minus the modeled wall time of one prefill MoE layer (the "
                "runtime's host work and launches for the layer, for each chunk of experts after its first, and for "
                "a layer on the fused AP GEMM); "
                f"modeled / measured {r['before']['min']:.2f}-"
                f"{r['before']['max']:.2f} before, {r['after']['min']:.2f}-{r['after']['max']:.2f} after."
                + (f" ap_gemm_tflops from the {report['fit']['ap_gemm_rows']} rows that timed the fused AP GEMM's "
                   "kernels: the median FLOPs a second over its padded tiles."
                   if report["fit"]["ap_gemm_rows"] else ""))
        fitted = fitted_profile(profile, report, note)
        report["fitted_profile"] = {"path": str(args.fit_profile), "name": fitted.name,
                                    "prefill_layer_overhead_us": fitted.prefill_layer_overhead_us,
                                    "prefill_chunk_overhead_us": fitted.prefill_chunk_overhead_us,
                                    "ap_gemm_layer_overhead_us": fitted.ap_gemm_layer_overhead_us,
                                    "ap_gemm_tflops": fitted.to_json()["ap_gemm_tflops"]}
    write_report(out, "prefill_fit", report, lambda png: plots.prefill_fit(report, png), fitted, args.fit_profile)
    if args.json:
        print(dumps(report))
        return 0
    value = report["fit"]
    print(_table(report))
    pairs = value["chunk_pairs"]
    print(f"prefill_layer_overhead_us {value['previous_us']:.1f} -> {value['prefill_layer_overhead_us']:.1f} us, "
          f"prefill_chunk_overhead_us {value['previous_chunk_us']:.1f} -> {value['prefill_chunk_overhead_us']:.1f} us "
          f"({f'{pairs} pairs of rows at two chunk sizes' if pairs else 'kept: no rows at two chunk sizes'}) on "
          f"{profile.name}; modeled / measured " + ", ".join(
              f"{when}: min {r['min']:.2f} median {r['median']:.2f} max {r['max']:.2f}"
              for when, r in ((w, report["ratios"][w]) for w in ("before", "after"))))
    if value["ap_gemm_rows"]:
        print(f"ap_gemm_layer_overhead_us {value['previous_ap_gemm_layer_us']:.1f} -> "
              f"{value['ap_gemm_layer_overhead_us']:.1f} us (the fixed cost of a layer on the fused AP GEMM)")
    for bits, tiles in value["ap_gemm_tflops"].items():
        rates = ", ".join(f"{v:.0f} TFLOP/s at {t}-row tiles" for t, v in tiles.items())
        print(f"ap_gemm_tflops at {bits} bits: {rates} (from {value['ap_gemm_rows']} rows that timed the fused AP "
              "GEMM)")
    if report["skipped_fused_rows"]:
        print(f"{report['skipped_fused_rows']} rows of at most {profile.ap_fused_max_tokens} tokens ran the fused kernel: "
              "left out of the fit")
    print(f"wrote {out / 'prefill_fit.json'} and {out / 'prefill_fit.png'}"
          + (f"; the fitted profile to {args.fit_profile}" if fitted is not None else ""))
    print(f"reproduce: {command}")
    return 0
