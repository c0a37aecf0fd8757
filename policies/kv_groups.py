"""KV-cache groups: which layers share a block table, so that sliding-window layers can free what left their window.

A model whose layers all attend alike keeps one block table a sequence: a block holds `block_size` tokens of every
layer, as `policies.kv_blocks` describes. A model that mixes sliding-window and full-attention layers (Gemma 4: 25
layers with a 1024-token window, 5 global ones) wastes most of that: a sliding layer never reads a token more than
`window` positions back, yet its rows stay as long as the global layers' do. vLLM's hybrid allocator splits the
layers into *groups*, each with its own block table, so a sliding group's table can release the blocks that fell
out of the window while the global group keeps all of its own. This module decides that split (`KVLayout.build`) and
what a sequence holds under it (`KVLayout.pages`); it is pure arithmetic, shared by both engines.

The rule, vLLM's: every group has the same number of layers `n` and every layer the same bytes in one of its group's
blocks, so one pool of equal *pages* (a page = one block of one group, `page_bytes`) serves all
groups and the pool's resize and compaction never look at which group a page belongs to. Layers are sorted into
*kinds* by (window, K/V bytes a token); `n` is the greatest common divisor of the kinds' layer counts, each kind's
layers form consecutive groups of `n` in layer order, and each kind gets the block size that fills
that share: the kind with the most bytes a token keeps `block_size`, the others proportionally more tokens a
block. Gemma-4-26B-A4B (sliding 8 KiB a token a layer, global 4 KiB): five sliding groups of 5 layers at 16 tokens a
block and one global group of 5 at 32, pages of 5 x 128 KiB. Where no kind has a window, or a kind's block size
would not be a whole number of tokens, the layout is the single group of today (one table, every layer).

Since every layer's share of a page has the same bytes, the runtime can keep one K and one V buffer for each of the
`n` places in a group, shared by the layers at that place in every group: a layer's cache is then a contiguous
`[pages, its group's block_size, kv_heads, head_dim]` view, and the attention kernels need no block stride.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence


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
