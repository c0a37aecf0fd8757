"""`pwruntime bench decode`: where a warmed-up engine's decode step goes (wall time, engine phases, GPU kernels).

A batch of sequences is brought to steady decoding (a warm-up batch first: CUDA-graph captures and first launches
happen there), then timed over `reps` windows of `steps` engine steps: the step's wall time and the mean of each
engine phase (schedule, forward, sample, observe, plan). On CUDA the torch profiler then records PROFILE_STEPS more
steps, and the kernels are summed from its trace (`kernel_stats`): kernels a step, GPU busy time a step, the span of
the decode graph's kernels, and the kernels that take the most time. A step whose GPU busy time is well under its
wall time is bound by host work.
"""
from __future__ import annotations

import json
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

from pwruntime.bench_prefix_cache import sync_device
from pwruntime.engine import EngineConfig
from pwruntime.sampling import SamplingParams

PROFILE_STEPS = 20
GAP_US = 50.0        # an idle gap longer than this separates two runs of kernels (the host between them)
TOP_KERNELS = 12


def kernel_stats(events: list[dict], steps: int, gap_us: float = GAP_US) -> dict:
    """Sums over the profiler's kernel events (chrome-trace dicts with "cat" "kernel", "name", "ts", "dur" in us) of
    `steps` steps: kernels and GPU busy us a step; `graph_span_us`: the median length of the `steps` longest runs of
    kernels without an idle gap over `gap_us` (a replayed decode graph is one such run a step); the kernels taking
    the most time (count and us a step)."""
    ev = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    if not ev or steps < 1:
        return {"kernels_per_step": 0.0, "gpu_busy_us_per_step": 0.0, "graph_span_us": 0.0, "top": []}
    runs, start, end = [], ev[0]["ts"], ev[0]["ts"] + ev[0]["dur"]
    for e in ev[1:]:
        if e["ts"] - end > gap_us:
            runs.append(end - start)
            start = e["ts"]
        end = max(end, e["ts"] + e["dur"])
    runs.append(end - start)
    by_name: dict[str, list[float]] = defaultdict(list)
    for e in ev:
        by_name[e["name"]].append(e["dur"])
    top = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:TOP_KERNELS]
    return {"kernels_per_step": len(ev) / steps, "gpu_busy_us_per_step": sum(e["dur"] for e in ev) / steps,
            "graph_span_us": float(statistics.median(sorted(runs)[-steps:])),
            "top": [{"name": name[:80], "per_step": len(d) / steps, "us_per_step": sum(d) / steps} for name, d in top]}


def decode_budget(steps: int, reps: int) -> int:
    """Tokens each sequence is asked to decode in `run`: the timed windows, the profiled steps and a margin."""
    return steps * reps + PROFILE_STEPS + 16


def default_kv_blocks(seqs: int, prompt_tokens: int, steps: int, reps: int) -> int:
    """A KV pool with room for the run twice over: every sequence at its longest, plus slack (no pressure)."""
    longest = prompt_tokens + decode_budget(steps, reps) + 24
    return 2 * seqs * -(-longest // EngineConfig.block_size)


def _decode_only(engine) -> bool:
    batch = engine.last_batch
    return batch is not None and bool(batch.entries) and all(e.num_new_tokens == 1 for e in batch.entries)


def run(engine, seqs: int, prompt_tokens: int, steps: int, reps: int, seed: int = 0, temperature: float = 0.0,
        top_p: float = 1.0) -> dict:
    """Decode `seqs` sequences of `prompt_tokens` random prompt tokens, sampling at `temperature` and `top_p` (0:
    greedy); time `reps` windows of `steps` steps, then profile PROFILE_STEPS more on CUDA. Raises RuntimeError when
    the batch never reaches decode-only steps."""
    model = engine.runner.model
    device = model.device
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(10, model.config.vocab, prompt_tokens).tolist() for _ in range(seqs)]
    sampling = dict(temperature=temperature, top_p=top_p, ignore_eos=True)
    engine.generate(prompts, SamplingParams(max_tokens=24, **sampling))       # warm-up
    for i, p in enumerate(prompts):
        engine.add_request(p, SamplingParams(max_tokens=decode_budget(steps, reps), seed=seed + i, **sampling))
    for _ in range(64):                                                             # the prompts' prefill
        engine.step()
        if _decode_only(engine) and len(engine.last_batch.entries) == seqs:
            break
    else:
        raise RuntimeError(f"{seqs} sequences never decoded together: the KV pool or the batch limits are too small")
    windows = []
    for _ in range(reps):
        sync_device(device)
        phases, decode_only, t0 = [], 0, time.perf_counter()
        for _ in range(steps):
            engine.step()
            phases.append(engine.last_phases)
            decode_only += _decode_only(engine)
        sync_device(device)
        wall = time.perf_counter() - t0
        windows.append({"step_ms": wall / steps * 1e3, "decode_only_steps": decode_only,
                        "phases_ms": {k.removesuffix("_s"): float(np.mean([getattr(p, k) for p in phases]) * 1e3)
                                      for k in phases[0].PHASES}})
    res = {"sequences": seqs, "prompt_tokens": prompt_tokens, "steps": steps, "windows": windows,
           "step_ms_median": statistics.median(w["step_ms"] for w in windows),
           "cuda_graph_replays": engine.runner.graphs.replays if engine.runner.graphs else 0, "kernels": None}
    if device.type == "cuda":
        res["kernels"] = _profile(engine, device)
        res["kernels"]["gpu_busy_fraction"] = res["kernels"]["gpu_busy_us_per_step"] / (res["step_ms_median"] * 1e3)
    return res


def _profile(engine, device: torch.device) -> dict:
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(PROFILE_STEPS):
            engine.step()
        sync_device(device)
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text())["traceEvents"]
    return kernel_stats(events, PROFILE_STEPS)


def print_table(res: dict) -> None:
    print(f"{res['sequences']} sequences decoding ({res['prompt_tokens']}-token prompts), {res['device']}, "
          f"{res['dtype']}, CUDA graphs {'on' if res['cuda_graph_replays'] else 'off'}; {res['steps']} steps a window")
    names = list(res["windows"][0]["phases_ms"])
    print(f"{'step ms':>8} {'decode-only':>11} " + " ".join(f"{n + ' ms':>11}" for n in names))
    for w in res["windows"]:
        print(f"{w['step_ms']:8.3f} {w['decode_only_steps']:>6}/{res['steps']:<4} "
              + " ".join(f"{w['phases_ms'][n]:11.3f}" for n in names))
    k = res["kernels"]
    if k is None:
        return
    print(f"\nGPU ({PROFILE_STEPS} profiled steps): {k['kernels_per_step']:.0f} kernels a step, "
          f"{k['gpu_busy_us_per_step']:.0f} us busy ({100 * k['gpu_busy_fraction']:.0f}% of the step), "
          f"the graph's kernels spanning {k['graph_span_us']:.0f} us")
    for t in k["top"]:
        print(f"  {t['us_per_step']:8.1f} us  {t['per_step']:5.1f}x  {t['name']}")
