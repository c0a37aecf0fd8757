"""`pwruntime bench mixed`: a mixed step's forward (decode rows beside a prompt) run eagerly and from piecewise graphs.

For each prompt size the batch is `rows` decode rows (a 40-token context each) followed by one prompt of that many
tokens, on blocks of the engine's KV cache (the engine is otherwise idle). Eager is `model.forward`; pieces are
`MixedGraphs.forward` (pwruntime.mixed_graphs; CUDA with a capturable expert store only), captured before timing.
Each is called WARMUP times, then timed over `reps` calls, the two alternating for ROUNDS rounds: a call's host time
(until the loop has queued everything) and wall time (the device synchronized after the loop). The pieces' hidden
states and routing are compared with the eager forward's.
"""
from __future__ import annotations

import time

import numpy as np
import torch

from pwruntime.bench_prefix_cache import sync_device
from pwruntime.model.attention_plan import batch_metadata

CONTEXT = 40    # tokens each decode row has in the cache
WARMUP = 5
ROUNDS = 2


def mixed_batch(rows: int, prompt_tokens: int, block_size: int) -> list[tuple[int, int, list[int]]]:
    """(context, new tokens, block ids) of `rows` decode rows then one prompt, on consecutive blocks from 0."""
    seqs, next_block = [], 0
    for ctx, new in [(CONTEXT, 1)] * rows + [(0, prompt_tokens)]:
        n = -(-(ctx + new) // block_size)
        seqs.append((ctx, new, list(range(next_block, next_block + n))))
        next_block += n
    return seqs


def blocks_needed(rows: int, prompt_tokens: int, block_size: int) -> int:
    return sum(len(b) for _, _, b in mixed_batch(rows, prompt_tokens, block_size))


def _timed(call, reps: int, device: torch.device) -> dict:
    for _ in range(WARMUP):
        call()
    sync_device(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        call()
    host = time.perf_counter() - t0
    sync_device(device)
    return {"host_ms": host / reps * 1e3, "wall_ms": (time.perf_counter() - t0) / reps * 1e3}


def run(engine, rows: int, prompt_sizes: tuple[int, ...], reps: int, seed: int = 0) -> dict:
    """One result row per prompt size (see the module docstring)."""
    model, kv, pieces = engine.runner.model, engine.runner.kv, engine.runner.mixed_graphs
    if pieces is not None and not pieces.ready:
        pieces = None
    rng = np.random.default_rng(seed)
    out = []
    for p in prompt_sizes:
        seqs = mixed_batch(rows, p, kv.block_size)
        meta = batch_metadata(seqs, kv.block_size)
        t = meta.num_tokens
        ids = rng.integers(10, model.config.vocab, t).tolist()
        pos = [q for c, n, _ in seqs for q in range(c, c + n)]
        eager = lambda: model.forward(torch.tensor(ids), torch.tensor(pos), kv, meta, record=True)  # noqa: E731
        graphed = None if pieces is None else (lambda: pieces.forward(ids, pos, meta, record=True))
        row = {"decode_rows": rows, "prompt_tokens": p, "tokens": t, "eager": [], "pieces": []}
        for _ in range(ROUNDS):
            row["eager"].append(_timed(eager, reps, model.device))
            if graphed is not None:
                row["pieces"].append(_timed(graphed, reps, model.device))
        if graphed is not None:
            want, got = eager(), graphed()
            if got is None:
                raise RuntimeError(f"the piecewise graphs did not take a batch of {t} tokens: {pieces.disabled}")
            row["bucket"] = next(s for s in pieces.sizes if s >= t)
            row["hidden_rel_diff"] = float((got.hidden.float() - want.hidden.float()).norm()
                                           / want.hidden.float().norm())
            row["routing_ids_equal"] = float(np.mean([(a.topk_ids == b.topk_ids).float().mean().item()
                                                      for a, b in zip(got.routing, want.routing)]))
        out.append(row)
    return {"decode_rows": rows, "reps": reps, "rounds": ROUNDS, "pieces": pieces is not None, "rows": out}


def print_table(res: dict) -> None:
    print(f"mixed steps: {res['decode_rows']} decode rows + one prompt, {res['device']}, {res['dtype']}; host / wall "
          f"ms a forward, mean of {res['reps']} calls, {res['rounds']} rounds alternating"
          + ("" if res["pieces"] else " (no piecewise graphs here: CUDA and a capturable store needed)"))
    print(f"{'prompt':>6} {'tokens':>6} {'bucket':>6} {'eager host':>14} {'eager wall':>14} {'pieces host':>14} "
          f"{'pieces wall':>14} {'rel diff':>9}")
    for r in res["rows"]:
        cols = [" / ".join(f"{x[k]:.2f}" for x in r[mode]) or "-" for mode in ("eager", "pieces")
                for k in ("host_ms", "wall_ms")]
        diff = f"{r['hidden_rel_diff']:.1e}" if "hidden_rel_diff" in r else "-"
        print(f"{r['prompt_tokens']:>6} {r['tokens']:>6} {r.get('bucket', '-'):>6} " + " ".join(f"{c:>14}" for c in cols)
              + f" {diff:>9}")
