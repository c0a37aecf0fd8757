"""Prefill MoE measurements behind `pwruntime bench prefill`: the runtime's batched path against one launch set per expert.

Each case is one MoE layer of random AP experts (all planes resident, every block at `bits`) and T prompt
tokens routed uniformly at random to the model's top-k. Two paths compute the same layer:
- `padded`: `device_store.prefill_moe`, what the runtime runs above 64 tokens (the active experts
  dequantized a group at a time, each group two batched GEMMs through `padded_moe`);
- `per_expert`: the same dequantized weights, then `grouped_moe`'s set of launches per active expert (what
  the runtime ran before).
The paths read the experts' row counts back to the host, so they cannot be captured in a CUDA graph: a time
is the wall-clock median over `reps` calls with the device synchronized around each, launch costs included
(which is what the batched path saves). Their outputs are compared (`max_rel_diff`).
`dequant_ms` times the dequantize kernel alone over the layer's active experts (the part of `padded` that
is not GEMM), and `dequant_gbps` is its effective bandwidth: the AP bytes read (planes and LUTs at `bits`)
plus the fp16 bytes written, over that time.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from pwruntime.device_store import dequantize_experts, prefill_group_limits, prefill_moe
from pwruntime.kernels.bench import ARCHS, APLayers, BenchConfig, random_routing
from pwruntime.kernels.moe import MoEShape
from pwruntime.model.experts import block_shape, expert_groups, expert_mlp, grouped_moe
from policies.apformat import ap_block_bytes


def wall_ms(fn: Callable[[], object], reps: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _per_expert(table, shape: MoEShape, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    active = sorted(set(ids.reshape(-1).tolist()))
    gate_up, down = dequantize_experts(table, shape, 0, active, x.dtype)
    slot = {e: j for j, e in enumerate(active)}
    return grouped_moe(x, ids, w, shape.num_experts, lambda e, rows: expert_mlp(rows, gate_up[slot[e]], down[slot[e]]))


def dequant_bytes(shape: MoEShape, experts: int, bits: int, elem_bytes: int) -> int:
    """Bytes the dequantize kernel moves for `experts` experts at `bits`: AP planes and LUTs read, 16-bit weights written."""
    per_expert = 0
    for kind in (0, 1):
        out_f, in_f = block_shape(kind, shape.hidden, shape.intermediate)
        per_expert += ap_block_bytes(out_f, in_f, bits) + out_f * in_f * elem_bytes
    return experts * per_expert


def prefill_layers(cfg: BenchConfig, name: str, bits: int) -> list[dict]:
    """One row per prompt size in cfg.tokens for model shape `name` (see the module docstring)."""
    h, inter, experts, k = ARCHS[name]
    shape = MoEShape(experts, h, inter, k)
    gen = torch.Generator(device="cuda").manual_seed(cfg.seed)
    ap = APLayers(shape, 1, gen)
    ap.set_bits(lambda layer, e, kind: bits)
    rows = []
    for t in cfg.tokens:
        ids, w = random_routing(shape, t, gen)
        x = torch.randn(t, h, device="cuda", generator=gen, dtype=torch.float16)
        padded = lambda: prefill_moe(ap.table, shape, 0, x, ids, w)  # noqa: E731
        per_expert = lambda: _per_expert(ap.table, shape, x, ids, w)  # noqa: E731
        a, b = padded().float(), per_expert().float()
        counts = torch.bincount(ids.reshape(-1), minlength=experts).tolist()
        active = [e for e, c in enumerate(counts) if c > 0]
        groups = expert_groups(counts, *prefill_group_limits(shape, x.element_size()))
        dequant = lambda: dequantize_experts(ap.table, shape, 0, active, x.dtype)  # noqa: E731
        row = {"model": name, "tokens": t, "bits": bits, "active_experts": len(active),
               "padded_groups": len(groups), "max_rel_diff": float((a - b).abs().max() / b.abs().max()),
               "padded_ms": wall_ms(padded, cfg.reps, cfg.warmup),
               "per_expert_ms": wall_ms(per_expert, cfg.reps, cfg.warmup),
               "dequant_ms": wall_ms(dequant, cfg.reps, cfg.warmup)}
        row["speedup"] = row["per_expert_ms"] / row["padded_ms"]
        row["dequant_gbps"] = dequant_bytes(shape, len(active), bits, x.element_size()) / row["dequant_ms"] / 1e6
        rows.append(row)
    return rows


def print_table(res: dict) -> None:
    print(f"{res['device']}: one prefill MoE layer, wall ms (median of {res['reps']}), experts at {res['bits']} bits")
    print(f"{'model':<20} {'T':>5} {'active':>6} {'groups':>6} {'padded':>8} {'per expert':>10} {'speedup':>7} "
          f"{'dequant':>8} {'GB/s':>6}")
    for r in res["rows"]:
        print(f"{r['model']:<20} {r['tokens']:>5} {r['active_experts']:>6} {r['padded_groups']:>6} "
              f"{r['padded_ms']:>8.2f} {r['per_expert_ms']:>10.2f} {r['speedup']:>7.2f} "
              f"{r['dequant_ms']:>8.2f} {r['dequant_gbps']:>6.0f}")


def plot(res: dict, png: Path) -> Path:
    """Grouped bars per model and prompt size: the two paths' times."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = res["rows"]
    labels = [f"{r['model']}\nT={r['tokens']}" for r in rows]
    pos = range(len(rows))
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(rows)), 4.6))
    ax.bar([p - 0.2 for p in pos], [r["per_expert_ms"] for r in rows], 0.4, label="launches per expert")
    ax.bar([p + 0.2 for p in pos], [r["padded_ms"] for r in rows], 0.4, label="padded groups (runtime)")
    ax.bar([p + 0.2 for p in pos], [r["dequant_ms"] for r in rows], 0.4, fill=False, hatch="//",
           label="of which dequantize")
    ax.set_xticks(list(pos), labels, fontsize=7, rotation=30, ha="right")
    ax.set_ylabel("ms per layer (wall, launches included)")
    ax.set_title(f"Prefill MoE layer, experts at {res['bits']} bits ({res['device']})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return png
