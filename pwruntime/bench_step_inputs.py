"""`pwruntime bench step-inputs`: the host time of a step's inputs for a model card's KV layouts, one table and hybrid
KV groups: a decode step's staging into CUDA-graph inputs (`DecodeInputs.pad`, a KV group at a time) and a mixed
step's metadata and attention plans (`table_metadata` a group at a time on the host, as `ModelRunner.prepare` makes
it, then `layer_plans` with what each layer reads, which copies what the plans need to the device). Both read the
tables as a runner does, from a BlockTables over the pool (pwruntime.block_tables) that earlier steps brought up to
date, so the timed reads find nothing new in it (as 15 of a 16-token block's decode steps do).

The batch is seeded: `rows` decode rows with contexts drawn from [context_min, context_max], and `chunks` prompt chunks
of `chunk_tokens` each, the first after a context of `chunk_context`, in a pool that holds them (`batch_pool`), a
sliding group's tables NULL before each row's window. A timing is the least, over `rounds`, of the mean of
`reps` calls. On CUDA the plans are built as a step builds them (flash chunks, decode batches on the device, the
device synchronized after each call); on the CPU they take the reference path, so compare plan times on one device.
"""
from __future__ import annotations

import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from policies.kv_blocks import BlockPool
from policies.kv_groups import GroupedBlockPool, KVLayout, new_pool
from pwruntime.block_tables import BlockTables
from traces.clikit import pyplot, write_png


@dataclass(frozen=True)
class StepInputsConfig:
    models: tuple[str, ...] = ("Gemma-4-26B-A4B",)
    rows: int = 48
    context_min: int = 1500
    context_max: int = 6000
    chunks: int = 2
    chunk_tokens: int = 1000
    chunk_context: int = 4096
    block_size: int = 16
    graph_rows: int = 64     # the decode graph's padded batch
    max_model_len: int = 16384   # the graph inputs' table width, in tokens
    reps: int = 20
    rounds: int = 5
    seed: int = 0


def batch_shape(cfg: StepInputsConfig) -> list[tuple[int, int]]:
    """(context, new tokens) of the decode rows, then the chunks."""
    rng = random.Random(cfg.seed)
    shape = [(rng.randint(cfg.context_min, cfg.context_max), 1) for _ in range(cfg.rows)]
    return shape + [(cfg.chunk_context if i == 0 else 0, cfg.chunk_tokens) for i in range(cfg.chunks)]


def batch_pool(cfg: StepInputsConfig, layout: KVLayout) -> BlockPool | GroupedBlockPool:
    """A pool holding the batch (`batch_shape`: sequence i is the i-th), each sequence grown to its context and then to
    its new tokens, as a running one is: a hybrid group's table NULL before its window (released on the way)."""
    shape = batch_shape(cfg)
    pages = sum(layout.pages(0, c + q) for c, q in shape)
    pool = new_pool(layout, pages)
    for i, (ctx, new) in enumerate(shape):
        pool.allocate(i, ctx)
        pool.allocate(i, ctx + new)
    return pool


def _least_mean_ms(fn: Callable[[], object], cfg: StepInputsConfig, sync: Callable[[], None]) -> float:
    fn()
    best = float("inf")
    for _ in range(cfg.rounds):
        start = time.perf_counter()
        for _ in range(cfg.reps):
            fn()
            sync()
        best = min(best, (time.perf_counter() - start) / cfg.reps)
    return 1e3 * best


def measure(cfg: StepInputsConfig, device: str, progress: Callable[[str], None] = lambda s: None) -> dict:
    """A row per model and layout (hybrid only where the model has sliding layers to group)."""
    import torch

    from pwruntime.cuda_graphs import DecodeInputs, DecodeRows
    from pwruntime.model.attention_plan import layer_plans, table_metadata
    from pwruntime.model.config import parse_config
    from traces.model_card import read_card_json

    dev = torch.device(device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    rows = []
    for name in cfg.models:
        config = parse_config(read_card_json(name)["hf_config"])
        for hybrid in (False, True):
            layout = config.kv_layout(cfg.block_size, 2, hybrid)
            if hybrid and not layout.hybrid:
                continue
            progress(f"{name} {'hybrid' if hybrid else 'one table'}")
            pool, shape, tables = batch_pool(cfg, layout), batch_shape(cfg), BlockTables(len(layout.groups))
            seqs, decoding = list(range(len(shape))), list(range(cfg.rows))
            tables.batch(pool, seqs)   # as a runner's after the steps before: the timed reads find nothing new
            hosts = [DecodeInputs.alloc_host(cfg.graph_rows, -(-cfg.max_model_len // g.block_size))
                     for g in layout.groups]
            positions = [c for c, _ in shape[:cfg.rows]]

            def stage():
                groups = tables.batch(pool, decoding)
                rows = DecodeRows([1] * cfg.rows, positions, groups[0], None, tuple(groups[1:]))
                for g, (group, host) in enumerate(zip(layout.groups, hosts)):
                    DecodeInputs.pad(rows.group(g), cfg.graph_rows, host.block_tables.shape[1], group.block_size, 0,
                                     out=host, window=group.window)

            def metadata():   # on the host, as a step prepares it: the plans copy it
                ctx, new = [c for c, _ in shape], [q for _, q in shape]
                return [table_metadata(ctx, new, t, g.block_size, window=g.window)
                        for g, t in zip(layout.groups, tables.batch(pool, seqs))]

            metas = metadata()

            def plans():   # given what each layer reads, a plan builds all of it at once (AttentionPlan.build)
                return layer_plans(metas, layout, dev, torch.bfloat16, config.attention_reads)

            rows.append({"model": name, "layout": "hybrid" if hybrid else "one table", "groups": len(layout.groups),
                         "decode_staging_ms": _least_mean_ms(stage, cfg, lambda: None),
                         "mixed_metadata_ms": _least_mean_ms(metadata, cfg, lambda: None),
                         "mixed_plans_ms": _least_mean_ms(plans, cfg, sync)})
    return {"config": asdict(cfg), "rows": rows}


def print_table(res: dict) -> None:
    c = res["config"]
    print(f"host ms a step: {c['rows']} decode rows of {c['context_min']}-{c['context_max']} tokens (staged into "
          f"{c['graph_rows']} graph rows) and {c['chunks']} chunks of {c['chunk_tokens']}; least mean of "
          f"{c['rounds']} x {c['reps']} calls on {res['device']}")
    print(f"{'model':<22} {'layout':<10} {'groups':>6} {'decode staging':>15} {'mixed metadata':>15} "
          f"{'mixed plans':>12}")
    for r in res["rows"]:
        print(f"{r['model']:<22} {r['layout']:<10} {r['groups']:>6} {r['decode_staging_ms']:>15.3f} "
              f"{r['mixed_metadata_ms']:>15.3f} {r['mixed_plans_ms']:>12.3f}")


def plot(res: dict, png: Path) -> Path:
    """Per model and layout, the three host times (grouped bars)."""
    plt = pyplot()
    rows = res["rows"]
    fig, ax = plt.subplots(figsize=(max(5.0, 1.4 * len(rows)), 4.0))
    x = np.arange(len(rows))
    for i, (key, label) in enumerate((("decode_staging_ms", "decode staging"), ("mixed_metadata_ms", "mixed metadata"),
                                      ("mixed_plans_ms", "mixed plans"))):
        ax.bar(x + (i - 1) * 0.27, [r[key] for r in rows], 0.27, label=label)
    ax.set_xticks(x, [f"{r['model']}\n{r['layout']} ({r['groups']})" for r in rows], fontsize=7)
    ax.set_ylabel("host ms a step")
    ax.set_title(f"a step's inputs on {res['device']}", fontsize=9)
    ax.legend(fontsize=7)
    return write_png(fig, png)
