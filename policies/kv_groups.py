"""KV-cache groups: which layers share a block table, so that sliding-window layers can free what left their window.

A model whose layers all attend alike keeps one block table a sequence: a block holds `block_size` tokens of every
layer, as `policies.kv_blocks` describes. A model that mixes sliding-window and full-attention layers (Gemma 4: 25
layers with a 1024-token window, 5 global ones) wastes most of that: a sliding layer never reads a token more than
`window` positions back, yet its rows stay as long as the global layers' do. vLLM's hybrid allocator splits the
layers into *groups*, each with its own block table, so a sliding group's table can release the blocks that fell
out of the window while the global group keeps all of its own. This module decides that split (`KVLayout.build`),
what a sequence holds under it (`KVLayout.pages`), and keeps the pages (`GroupedBlockPool`, which the scheduler
drives as it drives a BlockPool). The simulator uses it with `hybrid_kv`, the runtime with `hybrid_kv_cache`.

The rule, vLLM's: every group has the same number of layers `n` and every layer the same bytes in one of its group's
blocks, so one pool of equal *pages* (a page = one block of one group, `page_bytes`) serves all
groups and the pool's resize and compaction never look at which group a page belongs to. Layers are sorted into
*kinds* by (window, K/V bytes a token); `n` is the greatest common divisor of the kinds' layer counts, each kind's
layers form consecutive groups of `n` in layer order, and each kind gets the block size that fills
that share: the kind with the most bytes a token keeps `block_size`, the others proportionally more tokens a
block. Gemma-4-26B-A4B (sliding 8 KiB a token a layer, global 4 KiB): five sliding groups of 5 layers at 16 tokens a
block and one global group of 5 at 32, pages of 5 x 128 KiB. Where no kind has a window, or a kind's block size
would not be a whole number of tokens, the layout is the single group (one table, every layer).

Since every layer's share of a page has the same bytes, the runtime can keep one K and one V buffer for each of the
`n` places in a group, shared by the layers at that place in every group: a layer's cache is then a contiguous
`[pages, its group's block_size, kv_heads, head_dim]` view, and the attention kernels need no block stride.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Hashable, Sequence

from policies.kv_blocks import NULL_BLOCK, BlockPool, BlockPoolError


@dataclass(frozen=True)
class KVGroup:
    """Layers that share one block table: `layers` in place order, tokens a block, and the window (None: all)."""

    layers: tuple[int, ...]
    block_size: int
    window: int | None = None

    def blocks_held(self, start: int, end: int) -> tuple[int, int]:
        """[first, last) block indices a sequence must hold while it computes tokens [start, end): each query at
        position p reads keys [p - window + 1, p] (all of [0, p] without a window)."""
        first_key = 0 if self.window is None else max(0, start - self.window + 1)
        return first_key // self.block_size, -(-end // self.block_size)


@dataclass(frozen=True)
class KVLayout:
    """The groups of a model's layers (module docstring) and the bytes of one page."""

    groups: tuple[KVGroup, ...]
    page_bytes: int   # one block of one group: K and V of its layers (hybrid: layers_per_group x a layer's share)

    @property
    def hybrid(self) -> bool:
        """Whether the layers are split into several groups (else one table holds every layer)."""
        return len(self.groups) > 1

    @property
    def layers_per_group(self) -> int:
        return len(self.groups[0].layers)

    @classmethod
    def build(cls, token_bytes: Sequence[int], windows: Sequence[int | None], block_size: int,
              hybrid: bool = True) -> "KVLayout":
        """The layout of layers whose K and V take `token_bytes[l]` bytes a token, with `windows[l]` (None or 0: full
        attention); `hybrid=False` (or a model that does not gain from groups) gives the single group."""
        if len(token_bytes) != len(windows) or not token_bytes:
            raise ValueError(f"need one window per layer, got {len(token_bytes)} layers and {len(windows)} windows")
        if block_size < 1 or min(token_bytes) < 1:
            raise ValueError("block_size and every layer's bytes a token must be positive")
        wins = [w or None for w in windows]
        single = cls((KVGroup(tuple(range(len(token_bytes))), block_size),), block_size * sum(token_bytes))
        kinds: dict[tuple[int | None, int], list[int]] = {}
        for layer, key in enumerate(zip(wins, token_bytes)):
            kinds.setdefault(key, []).append(layer)
        if not hybrid or len(kinds) == 1 or all(w is None for w, _ in kinds):
            return single
        layer_block_bytes = block_size * max(token_bytes)
        if any(layer_block_bytes % b for _, b in kinds):
            return single
        n = math.gcd(*(len(layers) for layers in kinds.values()))
        groups = [KVGroup(tuple(layers[i:i + n]), layer_block_bytes // b, w)
                  for (w, b), layers in kinds.items() for i in range(0, len(layers), n)]
        return cls(tuple(groups), n * layer_block_bytes)

    def pages(self, start: int, end: int) -> int:
        """Pages a sequence holds while it computes tokens [start, end) (0 <= start <= end): each group's blocks
        from the first its queries read to the one holding token end - 1."""
        if not 0 <= start <= end:
            raise ValueError(f"need 0 <= start <= end, got {start}, {end}")
        return sum(last - first for first, last in (g.blocks_held(start, end) for g in self.groups))

    def bytes_held(self, start: int, end: int) -> int:
        return self.pages(start, end) * self.page_bytes


class GroupedBlockPool:
    """A block pool of pages for a hybrid layout: per sequence one table a group, sliding groups handing back what left
    their window. The scheduler-facing calls (allocate, try_allocate, blocks_needed, can_allocate, free,
    num_blocks_of) are BlockPool's, counted in pages; capacity, resizes and compaction are the page pool's own.

    The pages live in a BlockPool of 1-token blocks (`pages`) whose tables are keyed (sequence, group) and whose
    "tokens" are a table's entries: this class turns tokens into each group's blocks. A sequence computing tokens
    [start, end) (start: the tokens it had reserved) first releases each sliding group's blocks before the window of
    its query at `start`, then takes the blocks up to `end`, so what it needs is the net of both (`blocks_needed`).
    No prefix caching: a released block could be a cached chain's head (vLLM keeps sliding blocks cached apart).
    """

    prefix_caching = False   # so the scheduler never asks for a cached prefix or registers blocks

    def __init__(self, layout: KVLayout, num_pages: int) -> None:
        self.layout = layout
        self.pages = BlockPool(num_pages, block_size=1)
        self._tokens: dict[Hashable, int] = {}

    # page pool: capacity, resizes, compaction (a page is a page, whatever group holds it)
    @property
    def block_size(self) -> int:
        """The first group's tokens a block (`slot` takes each group's own)."""
        return self.layout.groups[0].block_size

    capacity = property(lambda self: self.pages.capacity)
    id_limit = property(lambda self: self.pages.id_limit)
    hole_blocks = property(lambda self: self.pages.hole_blocks)
    num_free = property(lambda self: self.pages.num_free)
    num_used = property(lambda self: self.pages.num_used)

    def grow(self, n: int) -> None:
        self.pages.grow(n)

    def shrink(self, n: int) -> int:
        return self.pages.shrink(n)

    def compact(self) -> list[tuple[int, int]]:
        return self.pages.compact()

    def id_limit_after_grow(self, n: int) -> int:
        return self.pages.id_limit_after_grow(n)

    # sequences
    def num_tokens(self, seq_id: Hashable) -> int:
        return self._tokens.get(seq_id, 0)

    def num_blocks_of(self, seq_id: Hashable) -> int:
        """Pages the sequence holds, over its groups."""
        return sum(self.pages.num_blocks_of((seq_id, g)) for g in range(len(self.layout.groups)))

    def group_table(self, seq_id: Hashable, group: int) -> list[int]:
        """The sequence's blocks in group `group`, in token order (NULL_BLOCK where released; a copy)."""
        return self.pages.block_table((seq_id, group))

    def slot(self, seq_id: Hashable, group: int, position: int) -> int:
        """The flat slot (block * the group's block_size + offset) of a reserved token in a group's layers."""
        size = self.layout.groups[group].block_size
        if not 0 <= position < self._tokens.get(seq_id, 0):
            raise BlockPoolError(f"position {position} not reserved for sequence {seq_id!r}")
        block = self.pages.block_table((seq_id, group))[position // size]
        if block == NULL_BLOCK:
            raise BlockPoolError(f"position {position} of sequence {seq_id!r} left group {group}'s window")
        return block * size + position % size

    def _plan(self, seq_id: Hashable, num_tokens: int) -> list[tuple[int, int]]:
        """Each group's (blocks to release up to, entries to hold) for computing tokens [reserved, num_tokens)."""
        start = self._tokens.get(seq_id, 0)
        end = max(start, int(num_tokens))
        return [g.blocks_held(start, end) for g in self.layout.groups]

    def _net(self, seq_id: Hashable, plan: list[tuple[int, int]]) -> int:
        """Pages `plan` takes from the free ones: the blocks it adds less those it releases first."""
        net = 0
        for g, (first, last) in enumerate(plan):
            key = (seq_id, g)
            net += max(0, last - self.pages.num_tokens(key)) - max(0, first - self.pages.num_released(key))
        return max(0, net)

    def blocks_needed(self, seq_id: Hashable, num_tokens: int) -> int:
        """Pages the sequence takes from the free ones to hold `num_tokens` tokens in total, net of the pages its
        sliding groups hand back first."""
        return self._net(seq_id, self._plan(seq_id, num_tokens))

    def can_allocate(self, seq_id: Hashable, num_tokens: int, prefix: Sequence[int] = ()) -> bool:
        if prefix:
            raise BlockPoolError("a grouped pool has no prefix caching")
        return self.blocks_needed(seq_id, num_tokens) <= self.num_free

    def allocate(self, seq_id: Hashable, num_tokens: int, prefix: Sequence[int] = ()) -> None:
        """Reserve slots so the sequence holds `num_tokens` tokens, releasing what its windows left first. Raises
        BlockPoolError (pool unchanged) when the free pages do not suffice."""
        if prefix:
            raise BlockPoolError("a grouped pool has no prefix caching")
        if not self.try_allocate(seq_id, num_tokens):
            raise BlockPoolError(f"sequence {seq_id!r} needs {self.blocks_needed(seq_id, num_tokens)} more pages "
                                 f"for {num_tokens} tokens; {self.num_free} free")

    def try_allocate(self, seq_id: Hashable, num_tokens: int) -> bool:
        """`allocate` if the free pages suffice; returns whether it did. The plan is made once for both the check
        and the allocation (the scheduler calls this for every running sequence every step)."""
        plan = self._plan(seq_id, num_tokens)
        if self._net(seq_id, plan) > self.num_free:
            return False
        for g, (first, _) in enumerate(plan):   # every release before any allocation: they fund it
            self.pages.release_leading((seq_id, g), first)
        for g, (_, last) in enumerate(plan):
            self.pages.allocate((seq_id, g), last)
        self._tokens[seq_id] = max(self._tokens.get(seq_id, 0), int(num_tokens))
        return True

    def free(self, seq_id: Hashable) -> int:
        """Release every page of the sequence; returns how many it held."""
        self._tokens.pop(seq_id, None)
        return sum(self.pages.free((seq_id, g)) for g in range(len(self.layout.groups)))

    def check_invariants(self) -> None:
        """The page pool's invariants, and every table as long as its group's blocks for its sequence's tokens."""
        self.pages.check_invariants()
        for seq_id, tokens in self._tokens.items():
            for g, group in enumerate(self.layout.groups):
                if self.pages.num_tokens((seq_id, g)) != -(-tokens // group.block_size):
                    raise BlockPoolError(f"sequence {seq_id!r}: group {g}'s table does not cover {tokens} tokens")
