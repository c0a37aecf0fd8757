"""`pwruntime bench kv-resize`: what resizing a model's KV cache costs, in mapped memory (pwruntime.vmm) and as torch
tensors.

Each round walks the cache through the same seeded sizes (steps of up to `max_step` blocks around `start_blocks`, as
a plan's trades move it) twice, once per backing, in alternation: the host time of a resize, its wall time with the
device's share (the torch tensors' copies), and the device memory held at most beyond what was held before the
cache (the allocator's reserved memory plus what the cache maps itself), sampled after every resize.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path
from statistics import median
from typing import Callable

import numpy as np

from traces.clikit import pyplot, write_png

BACKINGS = ("mapped", "torch")   # KVCache(growable=True), KVCache(growable=False)


@dataclass(frozen=True)
class KvResizeConfig:
    models: tuple[str, ...] = ("olmoe-1b-7b-0924",)
    rounds: int = 2
    resizes: int = 200
    start_blocks: int = 3000
    max_step: int = 30
    block_size: int = 16
    seed: int = 0


def walk(cfg: KvResizeConfig) -> list[int]:
    """The seeded sizes, in blocks: a random walk from `start_blocks` held within half and one and a half of it."""
    rng = np.random.default_rng(cfg.seed)
    lo, hi = max(1, cfg.start_blocks // 2), max(2, cfg.start_blocks * 3 // 2)
    sizes, n = [], cfg.start_blocks
    for step in rng.integers(-cfg.max_step, cfg.max_step + 1, cfg.resizes):
        n = int(min(hi, max(lo, n + step)))
        sizes.append(n)
    return sizes


def _time_walk(card, sizes: list[int], cfg: KvResizeConfig, backing: str) -> dict:
    import torch

    from pwruntime.cuda_memory import held_bytes
    from pwruntime.kv_cache import KVCache
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    reserved = torch.cuda.memory_reserved()
    kv = KVCache(card.layers, cfg.start_blocks, cfg.block_size, card.kv_heads, card.head_dim, torch.bfloat16, "cuda",
                 scratch=True, growable=backing == "mapped")
    torch.cuda.synchronize()
    host, held = 0.0, 0
    start = time.perf_counter()
    for n in sizes:
        t = time.perf_counter()
        kv.resize(n)
        host += time.perf_counter() - t
        held = max(held, held_bytes("cuda", kv.mapped_bytes) - reserved)
    torch.cuda.synchronize()
    wall = time.perf_counter() - start
    per_block = KVCache.bytes_per_block(card.layers, cfg.block_size, card.kv_heads, card.head_dim, torch.bfloat16)
    del kv
    return {"host_ms": 1e3 * host / len(sizes), "wall_ms": 1e3 * wall / len(sizes), "held_gib": held / 2 ** 30,
            "largest_cache_gib": max(sizes + [cfg.start_blocks]) * per_block / 2 ** 30}


def run(cfg: KvResizeConfig, progress: Callable[[str], None] = lambda s: None) -> dict:
    """Per model and backing the medians over the rounds; raises RuntimeError without a CUDA device."""
    import torch

    from traces.model_card import load_card
    if not torch.cuda.is_available():
        raise RuntimeError("needs a CUDA GPU")
    sizes, rows = walk(cfg), []
    for name in cfg.models:
        card = load_card(name)
        runs: dict[str, list[dict]] = {b: [] for b in BACKINGS}
        for r in range(cfg.rounds):
            for backing in BACKINGS if r % 2 == 0 else BACKINGS[::-1]:
                progress(f"{name} round {r + 1} {backing}")
                runs[backing].append(_time_walk(card, sizes, cfg, backing))
        for backing, got in runs.items():
            rows.append({"model": name, "backing": backing, "layers": card.layers, "kv_heads": card.kv_heads,
                         "head_dim": card.head_dim, **{k: round(median(x[k] for x in got), 4) for k in got[0]},
                         "rounds": [{k: round(v, 4) for k, v in x.items()} for x in got]})
    return {"config": asdict(cfg), "rows": rows}


def print_table(res: dict) -> None:
    c = res["config"]
    print(f"{c['resizes']} resizes of a bf16 KV cache ({c['block_size']}-token blocks, from {c['start_blocks']} in "
          f"steps of up to {c['max_step']}), medians of {c['rounds']} rounds on {res['device']}")
    print(f"{'model':<20} {'backing':<8} {'host ms':>8} {'wall ms':>8} {'held GiB':>9} {'largest GiB':>12}")
    for r in res["rows"]:
        print(f"{r['model']:<20} {r['backing']:<8} {r['host_ms']:>8.3f} {r['wall_ms']:>8.3f} {r['held_gib']:>9.2f} "
              f"{r['largest_cache_gib']:>12.2f}")


def plot(res: dict, png: Path) -> Path:
    """Per model, the two backings' host and wall time a resize (bars) and the memory they held (labels)."""
    plt = pyplot()
    rows = res["rows"]
    fig, ax = plt.subplots(figsize=(max(5.0, 1.1 * len(rows)), 4.0))
    x = np.arange(len(rows))
    ax.bar(x - 0.2, [r["host_ms"] for r in rows], 0.4, label="host ms a resize")
    ax.bar(x + 0.2, [r["wall_ms"] for r in rows], 0.4, label="wall ms a resize (device included)")
    for i, r in enumerate(rows):
        ax.annotate(f"{r['held_gib']:.1f} GiB held", (i, max(r["host_ms"], r["wall_ms"])), ha="center",
                    va="bottom", fontsize=7)
    ax.set_xticks(x, [f"{r['model']}\n{r['backing']}" for r in rows], fontsize=7)
    ax.set_ylabel("ms")
    ax.set_title(f"KV cache resizes: mapped memory against torch tensors\n({res['device']})", fontsize=9)
    ax.legend(fontsize=7)
    return write_png(fig, png, dpi=120)
