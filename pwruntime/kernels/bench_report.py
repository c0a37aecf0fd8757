"""What `pwruntime bench kernels` makes of its measurements: the rooflines, the measured hardware profile in the
simulator's format (traces/hardware.py), where it is written, and the printed tables."""
from __future__ import annotations

from pathlib import Path

FP16_GEMV_FALLBACK_GBPS = 3960.0


def add_rooflines(res: dict) -> None:
    """fp16 GEMV bandwidth (T = 1) and, per MoE row, roofline time and measured/roofline."""
    gemv = [r["fp16_gbps"] for r in res["single_block"] if r["tokens"] == 1]
    res["fp16_gemv_gbps"] = max(gemv) if gemv else FP16_GEMV_FALLBACK_GBPS
    for r in res["moe"]:
        r["roofline_us"] = r["ap_bytes"] / res["fp16_gemv_gbps"] / 1e3
        r["vs_roofline"] = r["ap_us"] / r["roofline_us"]


def default_profile_path(res: dict, out: Path | None) -> Path:
    """Where `bench kernels` writes its profile without --profile-out: beside --out, named by the device, and by the
    dtype and routing when they are not fp16 and uniform, so that the runs of one session do not overwrite each
    other's profile."""
    suffix = "".join(f"-{slug(v)}" for v, default in ((res["dtype"], "fp16"), (res["routing"], "uniform"))
                     if v != default)
    return (out.parent if out else Path(".")) / f"hardware-profile-{slug(res['device'])}{suffix}.json"


def slug(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-").replace("nvidia-", "")


def measured_profile(res: dict, name: str):
    """Measured coefficients in traces.hardware's format; unmeasured fields keep the roofline profile's values."""
    from pwruntime.device_store import FUSED_MAX_TOKENS
    from pwruntime.kernels.moe import MAX_TOKENS
    from traces.hardware import HardwareProfile, load_profile
    base = load_profile("h200-roofline")
    hbm = res["copy"]["d2d_copy_gbps"]
    gemv_frac = min(1.0, res["fp16_gemv_gbps"] / hbm)
    attn_frac = min(1.0, res["paged_attention"]["gbps"] / hbm)
    moe_bw = hbm * gemv_frac
    def efficiency(b: int, t: int) -> float | None:  # mean over the models of the layer's GB/s over moe_bw
        rows = [r for r in res["moe"] if r["bits"] == b and r["tokens"] == t]
        return sum(r["ap_gbps"] for r in rows) / len(rows) / moe_bw if rows else None

    sizes = sorted({r["tokens"] for r in res["moe"]})
    eff = {b: efficiency(b, 1) or 1.0 for b in (3, 4, 5, 6, 7, 8)}
    by_tokens = {b: {t: round(e, 4) for t in sizes if (e := efficiency(b, t))} for b in (3, 4, 5, 6, 7, 8)}
    return HardwareProfile(
        name=name, device=res["device"],
        gpu_memory_bytes=int(res["gpu_memory_bytes"]),
        hbm_gbps=round(hbm, 1),
        achieved_bandwidth_fraction={"attention": round(attn_frac, 4), "kv": round(attn_frac, 4),
                                     "moe": round(gemv_frac, 4), "dense": round(gemv_frac, 4),
                                     "lm_head": round(gemv_frac, 4)},
        fp16_tflops=base.fp16_tflops,
        achieved_flops_fraction=round(min(1.0, res["fp16_gemm_tflops"] / base.fp16_tflops), 4),
        pcie_h2d_gbps=round(res["copy"]["h2d_pinned_gbps"], 2), pcie_d2h_gbps=round(res["copy"]["d2h_pinned_gbps"], 2),
        iteration_overhead_us=base.iteration_overhead_us, layer_overhead_us=base.layer_overhead_us,
        ap_kernel_efficiency={b: round(v, 4) for b, v in eff.items()}, ap_fused_max_tokens=FUSED_MAX_TOKENS,
        ap_fused_launch_tokens=MAX_TOKENS,
        ap_efficiency_by_tokens={b: t for b, t in by_tokens.items() if t},
        metadata={
            "measured": True,
            "note": ("Measured by `pwruntime bench kernels`. hbm_gbps is a device-to-device copy (bytes read + "
                     "written); moe/dense/lm_head fractions are torch's fp16 GEMV (Mixtral 14336x4096, T=1) over it; "
                     "attention/kv the paged-attention decode kernel; ap_kernel_efficiency[b] is the fused AP MoE "
                     "layer's bandwidth at T=1 and uniform b bits (mean over the benchmarked models) over the moe "
                     "bandwidth, ap_efficiency_by_tokens[b][T] the same at each benchmarked batch size T; "
                     "ap_fused_max_tokens is the runtime's limit for the fused kernel (larger batches dequantize). "
                     "iteration/layer overheads and fp16_tflops are not measured here (copied from h200-roofline)."),
            "command": res["command"], "fp16_gemm_tflops_measured": round(res["fp16_gemm_tflops"], 1),
            "fp16_gemv_gbps": round(res["fp16_gemv_gbps"], 1),
        })


def print_tables(res: dict) -> None:
    c = res["copy"]
    print(f"{res['device']}: pinned H2D {c['h2d_pinned_gbps']:.1f} GB/s, D2H {c['d2h_pinned_gbps']:.1f} GB/s, "
          f"device copy {c['d2d_copy_gbps']:.0f} GB/s, fp16 GEMM {res['fp16_gemm_tflops']:.0f} TFLOP/s, "
          f"fp16 GEMV {res['fp16_gemv_gbps']:.0f} GB/s")
    for key in ("paged_attention", "paged_attention_long"):
        if key in res:
            a = res[key]
            print(f"paged attention decode ({a['seqs']} seqs x {a['context']} tokens, {a['heads']}/{a['kv_heads']} "
                  f"heads): {a['us']:.1f} us, {a['gbps']:.0f} GB/s of KV")
    print(f"\none linear-block 14336x4096, {res.get('dtype', 'fp16')} activations (us; the fp16 columns are torch's "
          f"F.linear in that dtype)")
    print(f"{'T':>3} {'bits':>4} {'AP us':>8} {'AP GB/s':>8} {'fp16 us':>8} {'speedup':>7} {'fp16 same bytes us':>18}")
    for r in res["single_block"]:
        same = r.get("fp16_same_bytes_us")  # absent from runs before session 21
        print(f"{r['tokens']:>3} {r['bits']:>4} {r['ap_us']:>8.2f} {r['ap_gbps']:>8.0f} {r['fp16_us']:>8.2f} "
              f"{r['speedup_vs_fp16']:>7.2f} {'-' if same is None else f'{same:.2f}':>18}")
    print("\nMoE layer (us per layer; roofline = AP bytes / fp16 GEMV bandwidth; same bytes = torch's two dense GEMVs "
          "over each launch's bytes)")
    print(f"{'model':<20} {'T':>3} {'bits':>5} {'act':>4} {'AP us':>8} {'roofline':>8} {'x roof':>6} "
          f"{'AP GB/s':>8} {'fp16 loop':>9} {'fp16 bmm':>9} {'same bytes':>10}")
    for r in res["moe"]:
        bmm = f"{r['fp16_gathered_bmm_us']:.1f}" if r["fp16_gathered_bmm_us"] else "-"
        same = f"{r['fp16_same_bytes_us']:.1f}" if r.get("fp16_same_bytes_us") else "-"  # runs since session 21
        print(f"{r['model']:<20} {r['tokens']:>3} {str(r['bits']):>5} {r['active_experts']:>4} {r['ap_us']:>8.1f} "
              f"{r['roofline_us']:>8.1f} {r['vs_roofline']:>6.2f} {r['ap_gbps']:>8.0f} {r['fp16_loop_us']:>9.1f} "
              f"{bmm:>9} {same:>10}")
