"""KvCapacity: how many blocks the KV pool has, and the cache memory behind them, as a page plan's offloads give
bytes and its reloads take them back.

The pool starts with what the memory budget leaves beside the model's weights (`initial_kv_blocks`). Bytes an offload
frees wait as spare until they make whole blocks, which grow the pool and the cache behind it (`release`); a growth
the device has no memory for leaves them spare, and is tried again once more are released. A reload takes spare bytes
first, then shrinks the pool over free blocks, compacting live ones downwards so the cache can be truncated
(`reserve`): by as many blocks as the transitions of the plan still to begin will ask (`PlanLoop.kv_blocks_to_free`),
so a plan resizes the cache once, not once a transition. At every resize it samples the device memory the process
holds and uses (`MappedMemory.held_peak`, `in_use_peak`).
"""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress

import torch

from policies.kv_blocks import BlockPool
from policies.loop import PlanLoop
from policies.memory_budget import allocator_slack_bytes, kv_room_bytes
from policies.page_table import PageTable
from policies.planners.base import weight_bytes
from pwruntime.cuda_memory import MappedMemory, held_bytes, in_use_bytes
from pwruntime.kv_cache import KVCache
from pwruntime.vmm import DriverCalls
from traces.clikit import UserError
from traces.sizes import format_size

log = logging.getLogger(__name__)


def initial_kv_blocks(config, model, policy, table: PageTable, block_bytes: int, blocks_per_seq: int,
                      activation_bytes: int = 0) -> tuple[int, int]:
    """The KV pool's first blocks (an EngineConfig's `num_kv_blocks`, else what its memory budget leaves, else a share
    of free GPU memory or `cpu_kv_cache_bytes`, never more than `max_num_seqs` full-length sequences need, each
    `blocks_per_seq`), and the spare bytes beside them that only a memory budget has (its room's remainder short of
    one more block: released weight bytes join them, as the simulator's headroom counts them). A pool sized from
    device memory leaves out `activation_bytes` (the activation reserve, pwruntime.activation_profile)."""
    if config.num_kv_blocks is not None:
        if config.num_kv_blocks < 1:
            raise UserError(f"num_kv_blocks must be >= 1, got {config.num_kv_blocks}")
        return int(config.num_kv_blocks), 0
    if config.gpu_memory_budget is not None:
        return _budget_blocks(int(config.gpu_memory_budget), model, policy, table, block_bytes, activation_bytes)
    useful = config.max_num_seqs * blocks_per_seq
    if model.device.type == "cuda":
        free, total = torch.cuda.mem_get_info(model.device)
        budget = int(total * config.gpu_memory_fraction) - (total - free) - activation_bytes
    else:
        budget = int(config.cpu_kv_cache_bytes)
    n = min(budget // block_bytes, useful)
    if n < 1:
        raise UserError(f"no memory left for the KV cache ({budget} bytes, {block_bytes} per block, after an "
                        f"activation reserve of {format_size(activation_bytes)}): raise gpu_memory_fraction or set "
                        "num_kv_blocks")
    return int(n), 0


def _budget_blocks(budget: int, model, policy, table: PageTable, block_bytes: int,
                   activation_bytes: int) -> tuple[int, int]:
    """The KV blocks a memory budget leaves beside the model's weights (the routed experts at the policy's starting
    bits), the allocator's slack and the activation reserve (policies.memory_budget: the simulator's --budget and
    --activation-reserve give the same pool), and the room's remainder short of one more block."""
    own, experts = model.weight_bytes(), weight_bytes(policy, table)
    room = kv_room_bytes(budget, own + experts, activation_bytes=activation_bytes)
    n = room // block_bytes
    if n < 1:
        raise UserError(f"a memory budget of {format_size(budget)} cannot hold the model's weights "
                        f"({format_size(own)}, and {format_size(experts)} of routed experts at the policy's "
                        f"starting bits), the allocator's slack ({format_size(allocator_slack_bytes(budget))}), "
                        f"a step's activations ({format_size(activation_bytes)}: --activation-reserve) and one KV "
                        f"block ({block_bytes} bytes): raise --gpu-memory-budget")
    free = torch.cuda.mem_get_info(model.device)[0] if model.device.type == "cuda" else _host_free_bytes()
    if n * block_bytes > free:
        raise UserError(f"a memory budget of {format_size(budget)} leaves the KV cache "
                        f"{format_size(n * block_bytes)}, more than the {format_size(free)} free on "
                        f"{model.device}: lower --gpu-memory-budget")
    return int(n), int(room - n * block_bytes)


def _host_free_bytes() -> int:
    """Host memory available now (the CPU engine's KV cache lives there)."""
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


class KvCapacity:
    """The pool's growth and shrinking over the cache (module docstring). `loop` is the plan loop whose `reserve`
    and `release` these are (set once it exists: it is built with them)."""

    def __init__(self, model, pool: BlockPool, kv: KVCache, copy_blocks, block_bytes: int, spare_bytes: int):
        self.model, self.pool, self.kv, self.block_bytes = model, pool, kv, block_bytes
        self._copy_blocks = copy_blocks  # ModelRunner.copy_blocks: a compaction's moves, on the device
        self.loop: PlanLoop | None = None
        self.spare_bytes = spare_bytes  # released or left over, not yet in the pool
        self.seconds = 0.0  # host time resizing the cache so far
        self.grow_failures = 0  # growths the device had no memory for (the bytes stay spare)
        self._refused_at = -1  # spare bytes at the last such failure: tried again once more are released
        self._held_peak = 0  # the most device memory held at a resize (allocator + mapped; 0 off CUDA)
        self._in_use_peak = 0  # and used (live tensors + mapped)
        self._note_held()

    def grow(self, num_blocks: int) -> bool:
        """Add blocks to the pool and back them with cache memory; False, the pool and cache as they were, when the
        device has no memory for them (logged, counted in `grow_failures`)."""
        start = time.perf_counter()
        try:   # the cache first, to the id space the pool's growth makes
            self.kv.resize(self.pool.id_limit_after_grow(num_blocks))
        except (torch.cuda.OutOfMemoryError, MemoryError) as e:
            self.grow_failures += 1
            log.warning("growing the KV cache by %d blocks failed (%s); the bytes stay spare and it is retried "
                        "once more are released", num_blocks, e)
            return False
        finally:
            self.seconds += time.perf_counter() - start
        self.pool.grow(num_blocks)
        self._note_held()
        return True

    def shrink(self, num_blocks: int) -> bool:
        """Remove free blocks (compacting live ones downwards if needed); False if too few are free."""
        if num_blocks > self.pool.num_free:
            return False
        start = time.perf_counter()
        self.pool.shrink(num_blocks)
        if self.pool.hole_blocks:
            self._copy_blocks(self.pool.compact())
        self.kv.resize(self.pool.id_limit)
        self.seconds += time.perf_counter() - start
        self._note_held()  # what a shrink unmaps is still held until the device passes it; reloads map beside it
        return True

    def release(self, nbytes: int) -> None:
        """Freed bytes join the spare ones; the whole blocks they make grow the pool."""
        self.spare_bytes += int(nbytes)
        n = self.spare_bytes // self.block_bytes
        if n and self.spare_bytes > self._refused_at:
            if self.grow(n):
                self.spare_bytes -= n * self.block_bytes
                self._refused_at = -1
            else:
                self._refused_at = self.spare_bytes

    @contextmanager
    def unmapped(self) -> Iterator[None]:
        """The cache's memory given back to the device while the body runs, mapped again for the pool as the body
        leaves it: what the body allocates (the CUDA graphs' captures before the first request) then takes the place
        the cache will have, not memory beside it. Only a cache in growable buffers with every block free and none
        cached; a no-op otherwise (torch tensors would move, and the graphs captured over them with them; a cached
        free block's K and V are what a later prefix hit reads)."""
        if not self.kv.buffers or self.pool.num_free < self.pool.capacity or self.pool.num_cached_blocks:
            yield
            return
        self.kv.resize(0)   # the scratch block stays: padded graph rows write there
        try:
            self.kv.release_retired()
            yield
        except BaseException:
            with suppress(MemoryError):   # the body's error says more than a remap's failure would
                self.kv.resize(self.pool.id_limit)
            raise
        try:
            self.kv.resize(self.pool.id_limit)
        except MemoryError:
            size = format_size(self.pool.id_limit * self.block_bytes)
            raise UserError(f"cannot map the KV cache's {self.pool.id_limit:,} blocks ({size}) again on "
                            f"{self.kv.device} once the CUDA graphs are captured: lower --gpu-memory-budget") from None
        self._note_held()

    def keep_out(self, nbytes: int, what: str) -> None:
        """Hold `nbytes` of the budget outside the pool from now on (`what` takes them): spare bytes first, then free
        blocks. A UserError, the pool as it was, when that would leave it no block or take blocks in use."""
        need = max(0, -(-(nbytes - self.spare_bytes) // self.block_bytes))
        if need >= self.pool.capacity or need > self.pool.num_free:
            raise UserError(f"{what} take {format_size(nbytes)}, which leaves the KV cache "
                            f"{max(0, self.pool.capacity - need)} of its {self.pool.capacity} blocks "
                            f"({self.pool.num_free} free): raise --gpu-memory-budget, or lower --max-num-seqs or "
                            "--max-num-batched-tokens")
        if need:
            self.shrink(need)
        self.spare_bytes += need * self.block_bytes - nbytes

    def give(self, nbytes: int) -> int:
        """Expert bytes freed outside the plan loop (the policy's initial bits) grow the pool; returns blocks added."""
        before = self.pool.capacity
        self.release(nbytes)
        return self.pool.capacity - before

    def reserve(self, nbytes: int) -> bool:
        """Room for a reload, or an offload's new LUT: spare bytes first, then shrink the pool over free blocks, once
        for every transition of the plan still to begin (the planner step of a plan reloading about a hundred blocks
        took 46-49 ms on the H200 when it shrank once a transition); the blocks the plan does not take come back
        after it (the engine's `release(0)` at the end of its plan phase)."""
        need = self.loop.kv_blocks_to_free(nbytes, self.spare_bytes, self.block_bytes, self.pool.num_free)
        if need is None:
            return False
        if need:
            self.shrink(need)
        self.spare_bytes += need * self.block_bytes - nbytes
        return True

    def _note_held(self) -> None:
        m = self.mapped_memory()
        self._held_peak = max(self._held_peak, held_bytes(self.kv.device, m.kv + m.weights))
        self._in_use_peak = max(self._in_use_peak, in_use_bytes(self.kv.device, m.kv + m.weights))

    def mapped_memory(self) -> MappedMemory:
        """The device memory the KV cache and the expert planes (a PlaneArena's, pwruntime.plane_arena) map themselves
        (cuda_memory.MappedMemory)."""
        arena = getattr(getattr(self.model, "experts", None), "arena", None)
        on = arena is not None
        return MappedMemory(self.kv.mapped_bytes, self.kv.peak_mapped_bytes, arena.mapped if on else 0,
                            arena.peak_mapped if on else 0, self._held_peak, self.kv.driver_calls,
                            arena.driver_calls if on else DriverCalls(), self._in_use_peak)
