"""Prefill MoE measurements behind `pwruntime bench prefill`: the runtime's paths against one launch set per expert.

Each case is one MoE layer of random AP experts (all planes resident, every block at `bits`) and T prompt
tokens routed uniformly at random to the model's top-k, in the activation dtype asked (bf16 by default, what
the runtime serves on CUDA), at a shape of `kernels.bench.MODEL_SHAPES` with its experts' gate activation.
The dequantize paths hold at most `chunk_bytes` of dequantized experts at once (the runtime's
`--prefill-chunk`; `chunks` is how many pieces `grouped_mm_moe` takes the experts in). Five paths compute the
same layer:
- `fused`: the fused AP kernel, a launch set per 64 tokens (`fused_moe`), reading the planes at every launch;
- `padded`: `padded_moe`, the active experts dequantized and in groups of similar row counts, each group two
  batched GEMMs;
- `grouped`: `grouped_mm_moe`, the dequantized experts through torch's grouped GEMM over the unpadded rows
  (None where torch lacks it);
- `ap_gemm`: `grouped_mm_moe` with the fused AP GEMM in place of the dequantization and torch's GEMMs
  (`prefill_layer.FusedGemmLayer`, chosen by the host as in an eager step), where the runtime's grouped path runs and
  the experts are at 3-4 bits (`policies.prefill_path`; None elsewhere);
- `per_expert`: `grouped_moe`'s set of launches per active expert (what the runtime ran before session 9).
`runtime_path` is the one `DeviceExpertStore.moe` takes for these activations (`runtime_path`: the fused kernel
up to FUSED_MAX_TOKENS, then `grouped_mm_prefill`'s choice, the fused AP GEMM where `fused_gemm_prefill` says so at
3-4 bits), and `runtime_ms` its time. Most paths read the experts' row counts back to the host, so none is captured
in a CUDA graph: a time is the wall-clock median over `reps` calls with the device synchronized around
each, the dequantize kernel and launch costs included. `max_rel_diff` is the largest difference of a
batched path's output from the per-expert one, relative to its largest value.
`dequant_ms` times the dequantize kernel alone over the layer's active experts (the part of every path that
is not GEMM), and `dequant_gbps` is its effective bandwidth: the AP bytes read (planes and LUTs at `bits`)
plus the 16-bit weights written, over that time. Where `ap_gemm` runs, `ap_gemm_kernel_ms` is the GPU time of its
two kernels alone (CUDA events, median of `reps`) and `ap_gemm_tile_rows` their tile size: what `pwsim prefill-fit`
fits the simulator's `ap_gemm_tflops` on.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from policies.prefill_path import FUSED_GEMM_MAX_BITS, fused_gemm_experts
from pwruntime.device_store import DEFAULT_PREFILL_CHUNK_BYTES, FUSED_MAX_TOKENS
from pwruntime.kernels.bench import APLayers, BenchConfig, events_ms, model_shape, random_routing
from pwruntime.kernels.moe import MoEShape, MoEWorkspace, fused_moe
from pwruntime.kernels.moe import MAX_TOKENS as FUSED_LAUNCH_TOKENS
from pwruntime.model.experts import block_shape, expert_groups, expert_mlp, grouped_mm_moe, grouped_moe, padded_moe
from pwruntime.prefill_layer import (FusedGemmLayer, dequantize_experts, fused_gemm_prefill, grouped_mm_prefill,
                                     prefill_group_limits)
from policies.apformat import ap_block_bytes
from policies.memory_budget import prefill_chunks
from traces.clikit import pyplot, write_png


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
    return grouped_moe(x, ids, w, shape.num_experts,
                       lambda e, rows: expert_mlp(rows, gate_up[slot[e]], down[slot[e]], act=shape.activation))


def ap_gemm_kernels_ms(fused: FusedGemmLayer, x: torch.Tensor, ids: torch.Tensor, shape: MoEShape, reps: int,
                       warmup: int, gen: torch.Generator) -> float:
    """GPU ms of the fused AP GEMM's two launches over the layer's rows sorted by expert: gate_up over the tokens'
    rows, down over activations as many."""
    flat = ids.reshape(-1)
    rows = x[torch.argsort(flat, stable=True) // shape.top_k]
    ends = torch.cumsum(torch.bincount(flat, minlength=shape.num_experts), 0).to(torch.int32)
    act = torch.randn(rows.shape[0], shape.intermediate, device=x.device, generator=gen).to(x.dtype)
    return events_ms(lambda: (fused.mm(0, rows, ends), fused.mm(1, act, ends)), reps, warmup)


def dequant_bytes(shape: MoEShape, experts: int, bits: int, elem_bytes: int) -> int:
    """Bytes the dequantize kernel moves for `experts` experts at `bits`: AP planes and LUTs read, 16-bit weights written."""
    per_expert = 0
    for kind in (0, 1):
        out_f, in_f = block_shape(kind, shape.hidden, shape.intermediate)
        per_expert += ap_block_bytes(out_f, in_f, bits) + out_f * in_f * elem_bytes
    return experts * per_expert


PATHS = ("per_expert", "padded", "grouped", "ap_gemm", "fused")


def runtime_path(x: torch.Tensor, shape: MoEShape, bits: int) -> str:
    """The path `DeviceExpertStore.moe` takes for these activations on CUDA, every block at `bits`."""
    if x.shape[0] <= FUSED_MAX_TOKENS:
        return "fused"
    if not grouped_mm_prefill(x, shape):
        return "padded"
    return "ap_gemm" if fused_gemm_prefill(x, shape) and bits <= FUSED_GEMM_MAX_BITS else "grouped"


def ap_gemm_runs(x: torch.Tensor, shape: MoEShape, bits: int) -> bool:
    """Whether the `ap_gemm` path is timed: the grouped path, 3-4 bits, experts the kernel takes (any rows)."""
    return (bits <= FUSED_GEMM_MAX_BITS and grouped_mm_prefill(x, shape)
            and fused_gemm_experts(shape.hidden, shape.intermediate))


def prefill_layers(cfg: BenchConfig, name: str, bits: int, dtype: torch.dtype = torch.bfloat16,
                   chunk_bytes: int = DEFAULT_PREFILL_CHUNK_BYTES) -> list[dict]:
    """One row per prompt size in cfg.tokens for model shape `name` (see the module docstring)."""
    shape = model_shape(name)
    h, experts = shape.hidden, shape.num_experts
    gen = torch.Generator(device="cuda").manual_seed(cfg.seed)
    ap = APLayers(shape, 1, gen)
    ap.set_bits(lambda layer, e, kind: bits)
    rows = []
    for t in cfg.tokens:
        ids, w = random_routing(shape, t, gen)
        x = torch.randn(t, h, device="cuda", generator=gen).to(dtype)
        max_experts, max_pad_rows = prefill_group_limits(shape, x.element_size(), chunk_bytes)
        weights_of = lambda group: dequantize_experts(ap.table, shape, 0, group, dtype)  # noqa: E731
        paths = {"padded": lambda: padded_moe(x, ids, w, experts, weights_of, max_experts, max_pad_rows,
                                              act=shape.activation),
                 "per_expert": lambda: _per_expert(ap.table, shape, x, ids, w)}
        if hasattr(torch, "_grouped_mm"):
            paths["grouped"] = lambda: grouped_mm_moe(x, ids, w, experts, weights_of, max_experts,
                                                      act=shape.activation)
        if ap_gemm_runs(x, shape, bits):
            fused = FusedGemmLayer.of(ap.table, shape, 0, t * shape.top_k, on_device=False)  # as eagerly
            paths["ap_gemm"] = lambda: grouped_mm_moe(x, ids, w, experts, weights_of, max_experts,
                                                      act=shape.activation, fused=fused)
        ws = MoEWorkspace.create(shape, min(t, FUSED_LAUNCH_TOKENS), dtype, x.device)
        paths["fused"] = lambda: fused_moe(ap.table, 0, x, ids, w, shape, ws)
        want = paths["per_expert"]().float()
        diff = max(float((paths[p]().float() - want).abs().max() / want.abs().max()) for p in paths if p != "per_expert")
        counts = torch.bincount(ids.reshape(-1), minlength=experts).tolist()
        active = [e for e, c in enumerate(counts) if c > 0]
        row = {"model": name, "tokens": t, "bits": bits, "dtype": str(dtype).removeprefix("torch."),
               "activation": shape.activation, "prefill_chunk_bytes": chunk_bytes,
               "chunks": prefill_chunks(experts, h, shape.intermediate, x.element_size(), chunk_bytes),
               "active_experts": len(active), "padded_groups": len(expert_groups(counts, max_experts, max_pad_rows)),
               "runtime_path": runtime_path(x, shape, bits), "max_rel_diff": diff}
        for p in PATHS:
            row[f"{p}_ms"] = wall_ms(paths[p], cfg.reps, cfg.warmup) if p in paths else None
        row["runtime_ms"] = row[f"{row['runtime_path']}_ms"]
        row["speedup"] = row["per_expert_ms"] / row["runtime_ms"]
        row["dequant_ms"] = wall_ms(lambda: dequantize_experts(ap.table, shape, 0, active, dtype), cfg.reps, cfg.warmup)
        row["dequant_gbps"] = dequant_bytes(shape, len(active), bits, x.element_size()) / row["dequant_ms"] / 1e6
        if "ap_gemm" in paths:
            row["ap_gemm_kernel_ms"] = ap_gemm_kernels_ms(fused, x, ids, shape, cfg.reps, cfg.warmup, gen)
            row["ap_gemm_tile_rows"] = fused.tile_rows
        rows.append(row)
    return rows


def print_table(res: dict) -> None:
    def ms(v):
        return f"{v:>8.2f}" if v is not None else f"{'n/a':>8}"

    print(f"{res['device']}: one prefill MoE layer, wall ms (median of {res['reps']}), experts at {res['bits']} bits, "
          f"{res.get('dtype', 'float16')} activations; * marks the runtime's path")
    print(f"{'model':<20} {'T':>5} {'active':>6} {'chunks':>6} {'per expert':>10} {'padded':>9} {'grouped':>9} "
          f"{'AP GEMM':>9} {'fused':>9} {'speedup':>7} {'dequant':>8} {'GB/s':>6}")
    for r in res["rows"]:
        star = {p: "*" if r.get("runtime_path", "padded") == p else " " for p in PATHS}
        print(f"{r['model']:<20} {r['tokens']:>5} {r['active_experts']:>6} {r.get('chunks', '-'):>6} "
              f"{r['per_expert_ms']:>10.2f} "
              + " ".join(f"{ms(r.get(f'{p}_ms'))}{star[p]}" for p in PATHS[1:])
              + f" {r['speedup']:>7.2f} {r['dequant_ms']:>8.2f} {r['dequant_gbps']:>6.0f}")


def plot(res: dict, png: Path) -> Path:
    """Grouped bars per model and prompt size: each path's time, the dequantize kernel's share hatched."""
    plt = pyplot()
    rows = res["rows"]
    labels = [f"{r['model']}\nT={r['tokens']}" for r in rows]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.0 * len(rows)), 4.6))
    paths = [("per_expert", "launches per expert"), ("padded", "padded groups"), ("grouped", "grouped GEMM"),
             ("ap_gemm", "AP GEMM (no dequantized copy)"), ("fused", "fused kernel, 64 tokens a launch")]
    paths = [(p, lab) for p, lab in paths if any(r.get(f"{p}_ms") is not None for r in rows)]
    width = 0.8 / len(paths)
    for i, (p, lab) in enumerate(paths):
        xs = [j + (i - (len(paths) - 1) / 2) * width for j in range(len(rows))]
        ax.bar(xs, [r.get(f"{p}_ms") or 0.0 for r in rows], width, label=lab)
        if p in ("padded", "grouped"):
            ax.bar(xs, [r["dequant_ms"] if r.get(f"{p}_ms") is not None else 0.0 for r in rows], width, fill=False,
                   hatch="//", label="of which dequantize" if p == "padded" else None)
    ax.set_xticks(range(len(rows)), labels, fontsize=7, rotation=30, ha="right")
    ax.set_ylabel("ms per layer (wall, launches included)")
    ax.set_title(f"Prefill MoE layer, experts at {res['bits']} bits, {res.get('dtype', 'float16')} ({res['device']})")
    ax.legend(fontsize=8)
    return write_png(fig, png, dpi=120)
