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
from functools import cached_property
from typing import Hashable, Sequence

from policies.kv_blocks import NULL_BLOCK, ROOT_HASH, BlockPool, BlockPoolError, chain_hash


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

    def fresh_table(self, start: int, end: int, first_id: int) -> list[int]:
        """The table of a sequence computing tokens [start, end) whose blocks were numbered from `first_id` in order:
        NULL_BLOCK before those it holds (`blocks_held`). For step inputs made up without a pool (benchmarks, the
        runtime's activation profile)."""
        first, last = self.blocks_held(start, end)
        return [NULL_BLOCK] * first + list(range(first_id, first_id + last - first))


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

    @cached_property
    def group_of(self) -> tuple[int, ...]:
        """Each layer's group, in layer order (made once: every forward's plans read it)."""
        groups = {layer: g for g, group in enumerate(self.groups) for layer in group.layers}
        return tuple(groups[layer] for layer in range(len(groups)))

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


@dataclass(frozen=True)
class GroupPrefix:
    """A cached prefix a new sequence of a GroupedBlockPool starts with: the `tokens` it covers and each group's table
    for them (NULL_BLOCK before a sliding group's window)."""

    tokens: int
    tables: tuple[tuple[int, ...], ...]


class GroupedBlockPool:
    """A block pool of pages for a hybrid layout: per sequence one table a group, sliding groups handing back what left
    their window. The scheduler-facing calls (allocate, try_allocate, blocks_needed, can_allocate, free,
    num_blocks_of) are BlockPool's, counted in pages; capacity, resizes and compaction are the page pool's own.

    The pages live in a BlockPool of 1-token blocks (`pages`) whose tables are keyed (sequence, group) and whose
    "tokens" are a table's entries: this class turns tokens into each group's blocks. A sequence computing tokens
    [start, end) (start: the tokens it had reserved) first releases each sliding group's blocks before the window of
    its query at `start`, then takes the blocks up to `end`, so what it needs is the net of both (`blocks_needed`).

    Prefix caching (as vLLM's for hybrid models): the tokens are hashed in chained *units* (the greatest common
    divisor of the groups' block sizes, `block_size`), and group g's block b is registered under the hash of the unit
    that ends it and g. A prefix of N tokens (a multiple of every group's block size) is a hit when every group has
    cached the blocks a query at position N reads: a full-attention group all of them, a sliding group those of its
    window only (`match_prefix`: the longest such N). The new sequence's sliding tables start NULL before the window.
    A block a window leaves is released as a cached free block, so it stays matchable until evicted.
    """

    def __init__(self, layout: KVLayout, num_pages: int, prefix_caching: bool = False) -> None:
        self.layout = layout
        self.prefix_caching = bool(prefix_caching)
        self.pages = BlockPool(num_pages, block_size=1, prefix_caching=prefix_caching)
        self._tokens: dict[Hashable, int] = {}
        sizes = [g.block_size for g in layout.groups]
        self._unit, self._align = math.gcd(*sizes), math.lcm(*sizes)
        self._chains: dict[Hashable, list[bytes]] = {}   # per sequence: the chained hashes of its full units
        self._registered: dict[tuple[Hashable, int], int] = {}   # (sequence, group) -> its blocks registered
        self._quiet: dict[Hashable, tuple[int, int]] = {}   # per sequence: `_quiet_limits` since its last change

    # page pool: capacity, resizes, compaction (a page is a page, whatever group holds it)
    @property
    def block_size(self) -> int:
        """Tokens of the finest block: every group's block is a whole number of them, and a cached prefix is hashed in
        them (`slot` takes each group's own block size)."""
        return self._unit

    capacity = property(lambda self: self.pages.capacity)
    id_limit = property(lambda self: self.pages.id_limit)
    hole_blocks = property(lambda self: self.pages.hole_blocks)
    num_free = property(lambda self: self.pages.num_free)
    num_used = property(lambda self: self.pages.num_used)
    num_cached_blocks = property(lambda self: self.pages.num_cached_blocks)   # pages registered
    rewrites = property(lambda self: self.pages.rewrites)

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

    def group_table_view(self, seq_id: Hashable, group: int) -> Sequence[int]:
        """`group_table` without the copy (BlockPool.block_table_view: read it before the pool next changes)."""
        return self.pages.block_table_view((seq_id, group))

    def slot(self, seq_id: Hashable, group: int, position: int) -> int:
        """The flat slot (block * the group's block_size + offset) of a reserved token in a group's layers."""
        size = self.layout.groups[group].block_size
        if not 0 <= position < self._tokens.get(seq_id, 0):
            raise BlockPoolError(f"position {position} not reserved for sequence {seq_id!r}")
        block = self.pages.block_table_view((seq_id, group))[position // size]
        if block == NULL_BLOCK:
            raise BlockPoolError(f"position {position} of sequence {seq_id!r} left group {group}'s window")
        return block * size + position % size

    def _plan(self, seq_id: Hashable, num_tokens: int) -> list[tuple[int, int]]:
        """Each group's (blocks to release up to, entries to hold) for computing tokens [reserved, num_tokens)."""
        start = self._tokens.get(seq_id, 0)
        end = max(start, int(num_tokens))
        return [g.blocks_held(start, end) for g in self.layout.groups]

    def _net(self, seq_id: Hashable, plan: list[tuple[int, int]]) -> int:
        """Pages `plan` takes from the free ones: the blocks it adds less those its releases free first (a block
        another sequence shares through a cached prefix stays in use)."""
        net = 0
        for g, (first, last) in enumerate(plan):
            key = (seq_id, g)
            net += max(0, last - self.pages.num_tokens(key))
            if first > self.pages.num_released(key):
                net -= self.pages.freed_by_release(key, first)
        return max(0, net)

    def _quiet_limits(self, seq_id: Hashable) -> tuple[int, int]:
        """(reserved tokens, tokens in all) below and up to which computing more tokens changes no table of the
        sequence: no sliding group releases a block (its first key's block stays the first it holds) and no group
        needs one more (its blocks hold them). Most decode steps stay inside: the scheduler's growth of every running
        sequence, every step, then costs a lookup instead of a plan over the groups."""
        start_limit = end_limit = math.inf
        for g, group in enumerate(self.layout.groups):
            key = (seq_id, g)
            end_limit = min(end_limit, self.pages.num_tokens(key) * group.block_size)
            if group.window is not None:   # blocks_held's first passes the released ones from this start on
                start_limit = min(start_limit, (self.pages.num_released(key) + 1) * group.block_size + group.window - 1)
        return start_limit, end_limit

    def _is_quiet(self, seq_id: Hashable, num_tokens: int) -> bool:
        limits = self._quiet.get(seq_id)
        return limits is not None and self._tokens[seq_id] < limits[0] and num_tokens <= limits[1]

    def blocks_needed(self, seq_id: Hashable, num_tokens: int) -> int:
        """Pages the sequence takes from the free ones to hold `num_tokens` tokens in total, net of the pages its
        sliding groups hand back first."""
        if self._is_quiet(seq_id, num_tokens):
            return 0
        return self._net(seq_id, self._plan(seq_id, num_tokens))

    def can_allocate(self, seq_id: Hashable, num_tokens: int, prefix: GroupPrefix | Sequence[int] = ()) -> bool:
        need = self._prefix_need(prefix, num_tokens) if prefix else self.blocks_needed(seq_id, num_tokens)
        return need <= self.num_free

    def allocate(self, seq_id: Hashable, num_tokens: int, prefix: GroupPrefix | Sequence[int] = ()) -> None:
        """Reserve slots so the sequence holds `num_tokens` tokens, releasing what its windows left first; a new
        sequence starts with a matched `prefix` (`match_prefix`). Raises BlockPoolError (pool unchanged) when the free
        pages do not suffice."""
        if prefix:
            if seq_id in self._tokens:
                raise BlockPoolError(f"sequence {seq_id!r} already holds pages; only a new one takes a prefix")
            if not isinstance(prefix, GroupPrefix) or self._prefix_need(prefix, num_tokens) > self.num_free:
                raise BlockPoolError(f"sequence {seq_id!r}: {prefix!r} is not a matched prefix the free pages can "
                                     f"extend to {num_tokens} tokens")
            for g, table in enumerate(prefix.tables):
                self.pages.allocate((seq_id, g), len(table), list(table))
            self._tokens[seq_id] = prefix.tokens
        if not self.try_allocate(seq_id, num_tokens):
            raise BlockPoolError(f"sequence {seq_id!r} needs {self.blocks_needed(seq_id, num_tokens)} more pages "
                                 f"for {num_tokens} tokens; {self.num_free} free")

    def try_allocate(self, seq_id: Hashable, num_tokens: int) -> bool:
        """`allocate` if the free pages suffice; returns whether it did. The plan is made once for both the check
        and the allocation (the scheduler calls this for every running sequence every step)."""
        if self._is_quiet(seq_id, num_tokens):
            self._tokens[seq_id] = max(self._tokens[seq_id], int(num_tokens))
            return True
        plan = self._plan(seq_id, num_tokens)
        if self._net(seq_id, plan) > self.num_free:
            return False
        for g, (first, _) in enumerate(plan):   # every release before any allocation: they fund it
            self.pages.release_leading((seq_id, g), first)
        for g, (_, last) in enumerate(plan):
            self.pages.allocate((seq_id, g), last)
        self._tokens[seq_id] = max(self._tokens.get(seq_id, 0), int(num_tokens))
        self._quiet[seq_id] = self._quiet_limits(seq_id)
        return True

    def free(self, seq_id: Hashable) -> int:
        """Release every page of the sequence (registered ones stay cached); returns how many it held."""
        self._tokens.pop(seq_id, None)
        self._quiet.pop(seq_id, None)
        self._chains.pop(seq_id, None)
        for g in range(len(self.layout.groups)):
            self._registered.pop((seq_id, g), None)
        return sum(self.pages.free((seq_id, g)) for g in range(len(self.layout.groups)))

    # prefix caching
    def prefix_tokens(self, prefix: GroupPrefix | Sequence[int]) -> int:
        """Tokens a matched prefix covers (0 for none)."""
        return prefix.tokens if prefix else 0

    def _chain(self, chain: list[bytes], token_ids: Sequence[int], units: int) -> list[bytes]:
        """`chain` extended to the chained hashes of the tokens' first `units` units."""
        u = self._unit
        while len(chain) < units:
            j = len(chain)
            chain.append(chain_hash(chain[-1] if chain else ROOT_HASH, token_ids[j * u:(j + 1) * u]))
        return chain

    def _key(self, chain: list[bytes], g: int, b: int) -> bytes:
        """What group g's block b is registered under: the hash of the unit that ends it, and g."""
        return chain[(b + 1) * self.layout.groups[g].block_size // self._unit - 1] + g.to_bytes(2, "little")

    def match_prefix(self, token_ids: Sequence[int], hashes: list[bytes] | None = None) -> GroupPrefix | list:
        """The longest cached prefix of `token_ids` (class docstring), [] for none; `hashes` keeps the tokens' unit
        hashes between calls for one sequence, as BlockPool.match_prefix's does."""
        if not self.prefix_caching:
            return []
        chain = self._chain([] if hashes is None else hashes, token_ids, len(token_ids) // self._unit)
        cached = lambda g, b: self.pages.cached_block(self._key(chain, g, b))  # noqa: E731
        limit = len(token_ids) // self._align * self._align
        for g, group in enumerate(self.layout.groups):   # full attention: the leading blocks, without a gap
            if group.window is None:
                n = 0
                while (n + 1) * group.block_size <= limit and cached(g, n) is not None:
                    n += 1
                limit = min(limit, n * group.block_size // self._align * self._align)
        for end in range(limit, 0, -self._align):   # the longest end every sliding group has its window's blocks for
            tables = []
            for g, group in enumerate(self.layout.groups):
                first, last = group.blocks_held(end, end)
                blocks = [cached(g, b) for b in range(first, last)]
                if None in blocks:
                    break
                tables.append((NULL_BLOCK,) * first + tuple(blocks))
            else:
                return GroupPrefix(end, tuple(tables))
        return []

    def _prefix_need(self, prefix: GroupPrefix, num_tokens: int) -> int:
        """Free pages a new sequence starting with `prefix` takes to hold `num_tokens` tokens: the cached free blocks
        of the prefix, and every group's blocks past it."""
        need = 0
        for group, table in zip(self.layout.groups, prefix.tables):
            need += group.blocks_held(prefix.tokens, max(num_tokens, prefix.tokens))[1] - len(table)
            need += sum(b != NULL_BLOCK and not self.pages.ref_count(b) for b in table)
        return need

    def register(self, seq_id: Hashable, token_ids: Sequence[int], num_computed_tokens: int,
                 known_hashes: Sequence[bytes] = ()) -> int:
        """Register the sequence's blocks, in every group, whose tokens (`token_ids`, from position 0) are all
        computed; returns how many became matchable. `known_hashes`: unit hashes `match_prefix` made for it."""
        if not self.prefix_caching or seq_id not in self._tokens:
            return 0
        chain = self._chains.setdefault(seq_id, [])
        chain += known_hashes[len(chain):]
        computed = min(int(num_computed_tokens), len(token_ids))
        self._chain(chain, token_ids, computed // self._unit)
        added = 0
        for g, group in enumerate(self.layout.groups):
            key, full = (seq_id, g), computed // group.block_size
            for b in range(self._registered.get(key, 0), min(full, self.pages.num_tokens(key))):
                added += self.pages.register_block(key, b, self._key(chain, g, b))
            self._registered[key] = max(self._registered.get(key, 0), full)
        return added

    def check_invariants(self) -> None:
        """The page pool's invariants, and every table as long as its group's blocks for its sequence's tokens."""
        self.pages.check_invariants()
        for seq_id, tokens in self._tokens.items():
            for g, group in enumerate(self.layout.groups):
                if self.pages.num_tokens((seq_id, g)) != -(-tokens // group.block_size):
                    raise BlockPoolError(f"sequence {seq_id!r}: group {g}'s table does not cover {tokens} tokens")


def new_pool(layout: KVLayout, pages: int, prefix_caching: bool = False) -> BlockPool | GroupedBlockPool:
    """The pool a layout's block tables live in: a GroupedBlockPool of `pages` for hybrid groups, else a BlockPool of
    `pages` blocks of the one group's size (what both engines and their benchmarks make)."""
    if layout.hybrid:
        return GroupedBlockPool(layout, pages, prefix_caching)
    return BlockPool(pages, layout.groups[0].block_size, prefix_caching=prefix_caching)
