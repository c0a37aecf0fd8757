"""The KV block pool: which KV-cache block ids exist, which are free, and each sequence's block table.

Shared by pwsim and pwruntime (pure python, no tensors). A block holds `block_size` tokens; a
sequence's block table lists its blocks in token order, so token position `p` lives in slot
`table[p // block_size] * block_size + p % block_size`.

Capacity changes at run time (weight planes give memory to the KV cache and take it back):

* Block ids live in the *id space* `[0, id_limit)`. A runtime backs exactly `id_limit` blocks with
  tensors (`KVCache.resize(pool.id_limit)` after every resize).
* `allocate` hands out the lowest-numbered free ids, so live blocks cluster at the bottom and the
  top of the id space tends to stay free.
* `shrink(n)` retires the `n` highest-numbered *free* blocks (it never touches a block in use).
  Retired ids at the top of the id space are cut off: `id_limit` drops to one past the highest
  id that is not retired. Retired ids below that are *holes*: invalid (never allocated) but still
  inside the runtime's tensor, so they cost memory until `grow` reuses them (`hole_blocks`).
  `compact()` removes holes by moving live blocks from the top of the id space into the lowest
  free/hole ids; it returns the `(src, dst)` copies a runtime must make before the next forward.
* `grow(n)` first revives holes (lowest first), then appends new ids at the top.

Every id in use is valid until its sequence frees it; `shrink` and `grow` never renumber a block in
use (only `compact` does, and it rewrites the block tables and reports each move).
"""
from __future__ import annotations

import bisect
from typing import Hashable


class BlockPoolError(RuntimeError):
    """An impossible pool request (not enough free blocks, unknown sequence); the pool is unchanged."""


class BlockPool:
    """A fixed-block-size pool with a run-time capacity and per-sequence block tables."""

    def __init__(self, num_blocks: int, block_size: int = 16) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be non-negative, got {num_blocks}")
        self.block_size = int(block_size)
        self._id_limit = int(num_blocks)
        self._free: list[int] = list(range(num_blocks))  # sorted ascending
        self._holes: list[int] = []  # retired ids below id_limit, sorted ascending
        self._tables: dict[Hashable, list[int]] = {}
        self._tokens: dict[Hashable, int] = {}  # slots reserved per sequence

    # ----------------------------------------------------------------- views
    @property
    def capacity(self) -> int:
        """Usable blocks (free + in use); excludes holes."""
        return self._id_limit - len(self._holes)

    @property
    def id_limit(self) -> int:
        """Size of the id space; a runtime backs blocks [0, id_limit) with memory."""
        return self._id_limit

    @property
    def hole_blocks(self) -> int:
        return len(self._holes)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.capacity - len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` tokens."""
        return -(-int(num_tokens) // self.block_size)

    def has(self, seq_id: Hashable) -> bool:
        return seq_id in self._tables

    def block_table(self, seq_id: Hashable) -> list[int]:
        """The sequence's block ids in token order (a copy; empty if it holds none)."""
        return list(self._tables.get(seq_id, ()))

    def num_tokens(self, seq_id: Hashable) -> int:
        """Token slots reserved for the sequence."""
        return self._tokens.get(seq_id, 0)

    def num_blocks_of(self, seq_id: Hashable) -> int:
        return len(self._tables.get(seq_id, ()))

    def blocks_needed(self, seq_id: Hashable, num_tokens: int) -> int:
        """Additional blocks the sequence needs to hold `num_tokens` tokens in total."""
        return max(0, self.blocks_for(num_tokens) - self.num_blocks_of(seq_id))

    def can_allocate(self, seq_id: Hashable, num_tokens: int) -> bool:
        """Whether the sequence can grow to `num_tokens` tokens in total with the free blocks."""
        return self.blocks_needed(seq_id, num_tokens) <= len(self._free)

    def slot(self, seq_id: Hashable, position: int) -> int:
        """The flat slot (block_id * block_size + offset) of a reserved token position."""
        if not 0 <= position < self._tokens.get(seq_id, 0):
            raise BlockPoolError(f"position {position} not reserved for sequence {seq_id!r}")
        table = self._tables[seq_id]
        return table[position // self.block_size] * self.block_size + position % self.block_size

    # ------------------------------------------------------------ allocation
    def allocate(self, seq_id: Hashable, num_tokens: int) -> list[int]:
        """Reserve slots so the sequence holds `num_tokens` tokens in total; returns the new block ids.

        Works for a new sequence and for growing one (prefill chunks, decode). Never shrinks a
        sequence. Raises BlockPoolError (pool unchanged) when free blocks do not suffice.
        """
        need = self.blocks_needed(seq_id, num_tokens)
        if need > len(self._free):
            raise BlockPoolError(
                f"sequence {seq_id!r} needs {need} more blocks for {num_tokens} tokens; {len(self._free)} free")
        new = self._free[:need]
        del self._free[:need]
        self._tables.setdefault(seq_id, []).extend(new)
        self._tokens[seq_id] = max(self._tokens.get(seq_id, 0), int(num_tokens))
        return new

    def append_slot(self, seq_id: Hashable) -> int:
        """Reserve one more token slot (a decode step); returns that slot."""
        n = self._tokens.get(seq_id, 0) + 1
        self.allocate(seq_id, n)
        return self.slot(seq_id, n - 1)

    def free(self, seq_id: Hashable) -> int:
        """Return all of the sequence's blocks to the pool; returns how many (0 if it held none)."""
        table = self._tables.pop(seq_id, [])
        self._tokens.pop(seq_id, None)
        for b in table:
            bisect.insort(self._free, b)
        return len(table)

    # -------------------------------------------------------------- capacity
    def grow(self, n: int) -> None:
        """Add `n` blocks: revive holes first (lowest id first), then extend the id space."""
        if n < 0:
            raise ValueError(f"grow needs n >= 0, got {n}")
        revive = self._holes[:n]
        del self._holes[:n]
        for b in revive:
            bisect.insort(self._free, b)
        extra = n - len(revive)
        self._free.extend(range(self._id_limit, self._id_limit + extra))  # all above any existing id
        self._id_limit += extra

    def shrink(self, n: int) -> int:
        """Retire the `n` highest-numbered free blocks; returns the new `id_limit`.

        Raises BlockPoolError (pool unchanged) if fewer than `n` blocks are free.
        """
        if n < 0:
            raise ValueError(f"shrink needs n >= 0, got {n}")
        if n > len(self._free):
            raise BlockPoolError(f"cannot shrink by {n} blocks: only {len(self._free)} free")
        if n == 0:
            return self._id_limit
        retired = self._free[-n:]
        del self._free[-n:]
        for b in retired:
            bisect.insort(self._holes, b)
        self._trim()
        return self._id_limit

    def compact(self) -> list[tuple[int, int]]:
        """Move live blocks from the top of the id space into lower free/hole ids until no hole remains.

        Returns the `(src, dst)` block copies made (a runtime copies K/V of block src into dst
        before the next forward). Block tables are rewritten; `id_limit` drops to `capacity`.
        """
        moves: list[tuple[int, int]] = []
        if not self._holes:
            return moves
        target = self.capacity  # after compaction every id < target is usable, none above
        owner = {b: (sid, j) for sid, t in self._tables.items() for j, b in enumerate(t) if b >= target}
        low_free = [b for b in self._free if b < target] + [b for b in self._holes if b < target]
        low_free.sort()
        for src in sorted(owner):
            dst = low_free.pop(0)
            sid, j = owner[src]
            self._tables[sid][j] = dst
            moves.append((src, dst))
        used = {b for t in self._tables.values() for b in t}
        self._free = [b for b in range(target) if b not in used]
        self._holes = []
        self._id_limit = target
        return moves

    def _trim(self) -> None:
        while self._holes and self._holes[-1] == self._id_limit - 1:
            self._holes.pop()
            self._id_limit -= 1

    # ------------------------------------------------------------ invariants
    def check_invariants(self) -> None:
        """Raise BlockPoolError if ids are double-booked or out of range (tests and debug runs)."""
        used = [b for t in self._tables.values() for b in t]
        everything = used + self._free + self._holes
        if len(set(everything)) != len(everything):
            raise BlockPoolError("a block id is in two places (double allocation)")
        if sorted(everything) != list(range(self._id_limit)):
            raise BlockPoolError(f"block ids do not partition [0, {self._id_limit})")
        if self._free != sorted(self._free) or self._holes != sorted(self._holes):
            raise BlockPoolError("free or hole list not sorted")
        for sid, t in self._tables.items():
            if len(t) != self.blocks_for(self._tokens.get(sid, 0)):
                raise BlockPoolError(f"sequence {sid!r}: {len(t)} blocks for {self._tokens.get(sid, 0)} tokens")
