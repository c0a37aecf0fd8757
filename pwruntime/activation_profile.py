"""The activation reserve: the device memory a step's forward takes beside the weights and the KV cache, measured once
by a profiling forward of the largest step (vLLM's profiling run) and kept out of a memory-sized KV pool.

The step profiled is the one whose activations are largest: a single chunk of `max_num_batched_tokens` new tokens
(seeded random ids) after as long a cached context as `max_model_len` leaves, so every layer attends over the most
keys a chunk can (the reference path for heads flash attention does not take materializes its scores), its routing
recorded, then the logits of `max_num_seqs` rows (a step samples at most one row a sequence). Its cached keys live in
a scratch cache of the engine's KV layout, allocated before the forward and freed after: they are not activations.
The context is shortened (halved) until that cache takes at most a quarter of the device's free memory, so a long
`max_model_len` on a small device profiles a shorter context rather than fail; a forward that still runs out of
memory is a UserError that names the flags to change.
An expert store that can skip dequantizing a prefill layer (the fused AP GEMM at 3-4 bits) dequantizes every layer
during it (`DeviceExpertStore.dequantizing`): a layer's bits may rise later, and its activations with them.
What counts is torch's allocator peak during the forward beyond what it held before (a workspace a kernel allocates
on its first call included), rounded up to 2 MiB. Only CUDA has an allocator to ask: elsewhere the reserve is 0.
The CUDA graphs' memory pools and the runner's buffers are not in it: they are made after the KV cache exists, and the
serving reserve (`LLMEngine.capture_graphs`) keeps what they hold out of the pool.
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import Callable

import torch

from policies.kv_blocks import NULL_BLOCK
from policies.kv_groups import KVLayout
from pwruntime.model.attention_plan import batch_metadata
from traces.clikit import UserError

GRANULE = 2 << 20   # the reserve is rounded up to the allocator's 2 MiB pages


def profile_step(layout: KVLayout, max_num_batched_tokens: int, max_model_len: int,
                 max_cache_bytes: int | None = None) -> tuple[int, int, list[tuple[int, list[int]]]]:
    """(context, new tokens, each group's (block size, block table)) of the profiled step: the group tables hold
    consecutive page ids, group after group, NULL (-1) before the blocks a group's window needs. The context is
    halved while the pages it and the new tokens hold take more than `max_cache_bytes` (None: no limit)."""
    tokens = max(1, min(max_num_batched_tokens, max_model_len - 1))
    context = max(0, max_model_len - tokens)
    while context and max_cache_bytes is not None and layout.bytes_held(context, context + tokens) > max_cache_bytes:
        context //= 2
    tables, next_id = [], 0
    for g in layout.groups:
        table = g.fresh_table(context, context + tokens, next_id)
        tables.append((g.block_size, table))
        next_id += len(table) - table.count(NULL_BLOCK)
    return context, tokens, tables


def profile_forward(model, block_size: int, hybrid: bool, max_num_batched_tokens: int, max_model_len: int,
                    max_num_seqs: int, seed: int = 0, before: Callable[[], None] = lambda: None,
                    max_cache_bytes: int | None = None) -> torch.Tensor:
    """Run the profiled step (`profile_step`) on `model`'s device, its KV cache of `block_size`-token blocks in hybrid
    groups or not (`model.kv_layout`), over a scratch cache freed after; `before` is called once the cache and the
    inputs exist, just before the forward. Returns the logits it made."""
    layout = model.kv_layout(block_size, hybrid)
    context, tokens, tables = profile_step(layout, max_num_batched_tokens, max_model_len, max_cache_bytes)
    kv = model.new_kv_cache(sum(len(t) - t.count(NULL_BLOCK) for _, t in tables), block_size, growable=False,
                            hybrid=hybrid)
    metas = tuple(batch_metadata([(context, tokens, t)], size, model.device, window=g.window)
                  for (size, t), g in zip(tables, layout.groups))
    ids = torch.randint(0, model.config.vocab, (tokens,), generator=torch.Generator().manual_seed(seed))
    positions = torch.arange(context, context + tokens)
    before()
    dequantizing = getattr(model.experts, "dequantizing", nullcontext)   # the prefill path that holds the most
    with dequantizing():
        out = model.forward(ids, positions, kv, metas[0] if len(metas) == 1 else metas, record=True)
    return model.logits(out.hidden[-min(max_num_seqs, tokens):])


def measure_activation_bytes(model, block_size: int, hybrid: bool, max_num_batched_tokens: int, max_model_len: int,
                             max_num_seqs: int, seed: int = 0) -> int:
    """The reserve (module docstring) of `model` on its device, for `profile_forward`'s step: 0 off CUDA."""
    dev = model.device
    if dev.type != "cuda":
        return 0
    held = []

    def before() -> None:
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        held.append(torch.cuda.memory_allocated(dev))

    try:
        logits = profile_forward(model, block_size, hybrid, max_num_batched_tokens, max_model_len, max_num_seqs, seed,
                                 before, max_cache_bytes=torch.cuda.mem_get_info(dev)[0] // 4)
        torch.cuda.synchronize(dev)
    except torch.cuda.OutOfMemoryError:
        torch.cuda.empty_cache()
        raise UserError(f"the profiling forward of the largest step ({max_num_batched_tokens} tokens) ran out of "
                        f"device memory: lower --max-num-batched-tokens or --max-model-len, or give "
                        f"--activation-reserve SIZE") from None
    peak = torch.cuda.max_memory_allocated(dev) - held[0]
    del logits
    torch.cuda.empty_cache()   # the scratch cache and the activations' blocks go back before the KV cache maps its own
    torch.cuda.reset_peak_memory_stats(dev)   # a replay's peaks are the engine's, not the scratch cache's
    return -(-max(peak, 0) // GRANULE) * GRANULE
