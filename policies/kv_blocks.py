"""The KV block pool: which KV-cache block ids exist, which are free, each sequence's block table, and
(with prefix caching) which full blocks are cached under the hash of their tokens.

Shared by pwsim and pwruntime (pure python, no tensors). A block holds `block_size` tokens; a
sequence's block table lists its blocks in token order, so token position `p` lives in slot
`table[p // block_size] * block_size + p % block_size`.

Capacity changes at run time (weight planes give memory to the KV cache and take it back):

* Block ids live in the *id space* `[0, id_limit)`. A runtime backs exactly `id_limit` blocks with
  tensors (`KVCache.resize(pool.id_limit)` after every resize).
* `allocate` hands out the lowest-numbered free ids (uncached ones before cached ones: see Eviction), so
  live blocks cluster at the bottom and the top of the id space tends to stay free.
* `shrink(n)` retires the `n` highest-numbered *free* blocks (it never touches a block in use).
  Retired ids at the top of the id space are cut off: `id_limit` drops to one past the highest
  id that is not retired. Retired ids below that are *holes*: invalid (never allocated) but still
  inside the runtime's tensor, so they cost memory until `grow` reuses them (`hole_blocks`).
  `compact()` removes holes by moving live blocks from the top of the id space into the lowest
  free/hole ids (uncached ones); it returns the `(src, dst)` copies a runtime must make before the
  next forward.
* `grow(n)` first revives holes (lowest first), then appends new ids at the top.

A sequence whose layers read only a sliding window of past tokens (policies.kv_groups) may hand back the blocks at
the front of its table that no query will read again (`release_leading`): their entries become `NULL_BLOCK` (-1), so
positions keep their blocks, and the blocks return to the free list (a registered one as a cached free block).
Kernels never read those entries.

Every id in use is valid until its sequence frees it; `shrink` and `grow` never renumber a block in
use (only `compact` does, and it rewrites the block tables and reports each move).

Prefix caching (`prefix_caching=True`, as vLLM's automatic prefix caching; off by default):

* A *full* block (block_size tokens, all computed) is *registered* (`register`) under a chained hash:
  sha256 of its parent block's hash (32 zero bytes for a sequence's first block) and its token ids as
  int64 bytes, so a hash names the block's tokens and every token before them, identically in every run.
  A hash already held by another block is not registered twice (the sequence keeps its own copy).
* `match_prefix(token_ids)` returns the longest chain of registered blocks that prefixes the tokens;
  `allocate(seq, n, prefix)` starts a new sequence's table with them. Blocks are reference-counted: a
  block shared by k tables has k references, and returns to the free list when the last one is freed,
  keeping its registration (a *cached free* block, still matchable). Free blocks are all reusable:
  `num_free` counts cached free ones.
* Eviction (vLLM's order): `allocate` hands out uncached free blocks first, lowest id first; only when
  none is left does it evict cached free blocks, least recently freed first. `free` releases a table's
  blocks tail first, so a chain's tail is evicted before its head and what survives is still matchable
  from its head. A cached free block a prefix match takes leaves the eviction order; freed again, it is
  the most recent. An evicted block loses its registration; so do the cached free blocks `shrink` retires
  (the highest free ids, cached or not) and those `compact` cuts off (it never moves a block into a cached
  one). `compact` moves a shared live block once, rewrites every table holding it and moves its
  registration with it.
"""
from __future__ import annotations

import bisect
import hashlib
import heapq
from array import array
from collections import OrderedDict
from typing import Hashable, Sequence

ROOT_HASH = bytes(32)  # the parent hash of a sequence's first block
NULL_BLOCK = -1  # a table entry whose block was released (release_leading): no query reads those positions again


def chain_hash(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """sha256 of a parent block's hash and a block's token ids as int64 bytes: a name for the block's tokens and
    every token before them, the same in every run."""
    return hashlib.sha256(parent + array("q", token_ids).tobytes()).digest()


class BlockPoolError(RuntimeError):
    """An impossible pool request (not enough free blocks, unknown sequence); the pool is unchanged."""


class BlockPool:
    """A fixed-block-size pool with a run-time capacity, per-sequence block tables and optional prefix caching."""

    def __init__(self, num_blocks: int, block_size: int = 16, prefix_caching: bool = False) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be non-negative, got {num_blocks}")
        self.block_size = int(block_size)
        self._id_limit = int(num_blocks)
        self._uncached: list[int] = list(range(num_blocks))  # free, unregistered ids: a min-heap (heapq)
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached free ids, least recently freed first
        self._holes: list[int] = []  # retired ids below id_limit, sorted ascending
        self._tables: dict[Hashable, list[int]] = {}
        self._tokens: dict[Hashable, int] = {}  # slots reserved per sequence
        self._released: dict[Hashable, int] = {}  # leading table entries released (NULL_BLOCK) per sequence
        self._refs: dict[int, int] = {}  # block id in use -> tables holding it
        self.prefix_caching = bool(prefix_caching)
        self._hash_of: dict[int, bytes] = {}  # registered block id -> its chained hash
        self._block_of: dict[bytes, int] = {}  # chained hash -> registered block id
        self._chain: dict[Hashable, list[bytes]] = {}  # per sequence: the hashes of its leading full blocks
        self.rewrites = 0  # compactions that moved blocks: readers keeping copies of tables read them whole again

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
        """Free blocks, cached free ones included (an allocation may evict them)."""
        return len(self._uncached) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        """Registered blocks (in use or cached free)."""
        return len(self._hash_of)

    @property
    def num_used(self) -> int:
        return self.capacity - self.num_free

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` tokens."""
        return -(-int(num_tokens) // self.block_size)

    def has(self, seq_id: Hashable) -> bool:
        return seq_id in self._tables

    def block_table(self, seq_id: Hashable) -> list[int]:
        """The sequence's block ids in token order (a copy; empty if it holds none)."""
        return list(self._tables.get(seq_id, ()))

    def block_table_view(self, seq_id: Hashable) -> Sequence[int]:
        """`block_table` without the copy: the pool's own, to read before the pool next changes (it changes with it;
        never modify it). A step's inputs read every running sequence's table each step, where copies cost."""
        return self._tables.get(seq_id, ())

    def num_tokens(self, seq_id: Hashable) -> int:
        """Token slots reserved for the sequence."""
        return self._tokens.get(seq_id, 0)

    def num_blocks_of(self, seq_id: Hashable) -> int:
        """Blocks the sequence holds (its table's entries, less those released)."""
        return len(self._tables.get(seq_id, ())) - self._released.get(seq_id, 0)

    def ref_count(self, block_id: int) -> int:
        """Block tables holding the block (0: free, a hole or out of range)."""
        return self._refs.get(block_id, 0)

    def is_cached(self, block_id: int) -> bool:
        """Whether the block is registered (matchable), in use or cached free."""
        return block_id in self._hash_of

    def blocks_needed(self, seq_id: Hashable, num_tokens: int) -> int:
        """Additional blocks the sequence needs to hold `num_tokens` tokens in total."""
        # blocks_for less the table's entries, inlined: the scheduler asks this for every running sequence every step
        need = -(-int(num_tokens) // self.block_size) - len(self._tables.get(seq_id, ()))
        return need if need > 0 else 0

    def can_allocate(self, seq_id: Hashable, num_tokens: int, prefix: Sequence[int] = ()) -> bool:
        """Whether the sequence can grow to `num_tokens` tokens in total with the free blocks (a new sequence
        starting with the matched `prefix` blocks: those that are cached free leave the free list too)."""
        need = self.blocks_needed(seq_id, num_tokens)
        if prefix:
            need += sum(b != NULL_BLOCK and b not in self._refs for b in prefix) - len(prefix)
        return need <= self.num_free

    def slot(self, seq_id: Hashable, position: int) -> int:
        """The flat slot (block_id * block_size + offset) of a reserved token position."""
        if not 0 <= position < self._tokens.get(seq_id, 0):
            raise BlockPoolError(f"position {position} not reserved for sequence {seq_id!r}")
        table = self._tables[seq_id]
        return table[position // self.block_size] * self.block_size + position % self.block_size

    # ------------------------------------------------------------ allocation
    def allocate(self, seq_id: Hashable, num_tokens: int, prefix: Sequence[int] = ()) -> list[int]:
        """Reserve slots so the sequence holds `num_tokens` tokens in total; returns the new block ids.

        Works for a new sequence and for growing one (prefill chunks, decode). Never shrinks a
        sequence. `prefix`: registered blocks (`match_prefix`) a new sequence's table starts with, shared
        with whoever holds them; it may start with NULL_BLOCK entries (released at once: the blocks a sliding
        window's table no longer needs, policies.kv_groups). Raises BlockPoolError (pool unchanged) when free
        blocks do not suffice.
        """
        need = self.blocks_needed(seq_id, num_tokens)
        if not need and not prefix and seq_id in self._tables:  # most decode steps: the last block has room
            self._reserve_slots(seq_id, num_tokens)
            return []
        cached_free: list[int] = []  # prefix blocks nobody holds: they leave the free list
        nulls = 0  # the prefix's leading NULL_BLOCK entries
        if prefix:
            if seq_id in self._tables:
                raise BlockPoolError(f"sequence {seq_id!r} already holds blocks; only a new one takes a prefix")
            while nulls < len(prefix) and prefix[nulls] == NULL_BLOCK:
                nulls += 1
            if any(b not in self._hash_of for b in prefix[nulls:]) or len(prefix) > need:
                raise BlockPoolError(f"prefix {list(prefix)} is not a matched prefix of {num_tokens} tokens")
            need -= len(prefix)
            cached_free = [b for b in prefix[nulls:] if b not in self._refs]
        if need + len(cached_free) > self.num_free:
            raise BlockPoolError(f"sequence {seq_id!r} needs {need + len(cached_free)} more blocks for {num_tokens} "
                                 f"tokens; {self.num_free} free")
        for b in cached_free:
            del self._evictable[b]  # reused: it leaves the eviction order
        for b in prefix[nulls:]:
            self._refs[b] = self._refs.get(b, 0) + 1
        if nulls:
            self._released[seq_id] = nulls
        elif prefix:
            self._chain[seq_id] = [self._hash_of[b] for b in prefix]
        new = self._take_free(need)
        for b in new:
            self._refs[b] = 1
        table = self._tables.setdefault(seq_id, [])
        table += prefix
        table += new
        self._reserve_slots(seq_id, num_tokens)
        return new

    def try_allocate(self, seq_id: Hashable, num_tokens: int) -> bool:
        """`allocate(seq_id, num_tokens)` if the free blocks suffice (`can_allocate`), else nothing; returns whether
        it allocated. The scheduler's step grows every running sequence this way, mostly inside its last block."""
        need = self.blocks_needed(seq_id, num_tokens)
        if not need and seq_id in self._tables:  # allocate's common case, without looking the blocks up again
            self._reserve_slots(seq_id, num_tokens)
            return True
        if need > self.num_free:
            return False
        self.allocate(seq_id, num_tokens)
        return True

    def _reserve_slots(self, seq_id: Hashable, num_tokens: int) -> None:
        """Record that the sequence's blocks (already allocated) hold `num_tokens` tokens; never shrinks it."""
        self._tokens[seq_id] = max(self._tokens.get(seq_id, 0), int(num_tokens))

    def _take_free(self, n: int) -> list[int]:
        """Remove `n` free blocks (the caller checked there are enough): the lowest uncached ids, then cached ones
        evicted least recently freed first (each losing its registration)."""
        uncached = self._uncached
        taken = [heapq.heappop(uncached) for _ in range(min(n, len(uncached)))]
        while len(taken) < n:
            b, _ = self._evictable.popitem(last=False)
            self._uncache(b)
            taken.append(b)
        return taken

    def _unref(self, b: int) -> None:
        """Drop one table's reference to block b; the last one returns it to the free blocks."""
        self._refs[b] -= 1
        if not self._refs[b]:
            del self._refs[b]
            self._release(b)

    def _release(self, b: int) -> None:
        """Return block b (no longer referenced) to the free blocks: a cached one becomes the most recently freed."""
        if b in self._hash_of:
            self._evictable[b] = None
        else:
            heapq.heappush(self._uncached, b)

    def append_slot(self, seq_id: Hashable) -> int:
        """Reserve one more token slot (a decode step); returns that slot."""
        n = self._tokens.get(seq_id, 0) + 1
        self.allocate(seq_id, n)
        return self.slot(seq_id, n - 1)

    def free(self, seq_id: Hashable) -> int:
        """Drop the sequence's references to its blocks; returns how many it held (0 if none).

        A block nobody else holds returns to the free blocks (keeping its registration, if any). Blocks are
        released tail first, so a cached chain's tail is evicted before its head (as vLLM's free-block queue)."""
        table = self._tables.pop(seq_id, [])
        self._tokens.pop(seq_id, None)
        held = len(table) - self._released.pop(seq_id, 0)
        self._chain.pop(seq_id, None)
        for b in reversed(table):
            if b != NULL_BLOCK:
                self._unref(b)
        return held

    def num_released(self, seq_id: Hashable) -> int:
        """Leading entries of the sequence's table already released (`release_leading`)."""
        return self._released.get(seq_id, 0)

    def freed_by_release(self, seq_id: Hashable, num_blocks: int) -> int:
        """Blocks `release_leading(seq_id, num_blocks)` would return to the free list: those it releases that no other
        table holds (a shared prefix block stays in use)."""
        table = self._tables.get(seq_id, ())
        return sum(self._refs[b] == 1 for b in table[self._released.get(seq_id, 0):min(int(num_blocks), len(table))])

    def release_leading(self, seq_id: Hashable, num_blocks: int) -> int:
        """Release the table's first `num_blocks` blocks (those before them already are): their entries become
        NULL_BLOCK and the blocks return to the free list, tail first as `free` does (a registered one stays cached
        until evicted). Returns how many it released."""
        table = self._tables.get(seq_id)
        done = self._released.get(seq_id, 0)
        if table is None or num_blocks <= done:
            return 0
        n = min(int(num_blocks), len(table))
        for j in range(n - 1, done - 1, -1):
            b, table[j] = table[j], NULL_BLOCK
            self._unref(b)
        self._released[seq_id] = n
        return n - done

    # --------------------------------------------------------- prefix caching
    def prefix_tokens(self, prefix: Sequence[int]) -> int:
        """Tokens the matched `prefix` blocks hold."""
        return len(prefix) * self.block_size

    def match_prefix(self, token_ids: Sequence[int], hashes: list[bytes] | None = None) -> list[int]:
        """The registered blocks of the longest chain of full blocks that prefixes `token_ids` ([] when off).

        `hashes` keeps the chained hashes of the tokens' leading full blocks between calls for the same sequence
        (its known tokens only grow): it is read first and extended as far as the match reaches, so a request that
        waits several steps hashes each of its blocks once (vLLM keeps them per request for the same reason)."""
        matched: list[int] = []
        if not self.prefix_caching:
            return matched
        hashes = [] if hashes is None else hashes
        for j in range(len(token_ids) // self.block_size):
            if j == len(hashes):
                hashes.append(self._hash(hashes[-1] if hashes else ROOT_HASH, token_ids, j))
            b = self._block_of.get(hashes[j])
            if b is None:
                break
            matched.append(b)
        return matched

    def register(self, seq_id: Hashable, token_ids: Sequence[int], num_computed_tokens: int,
                 known_hashes: Sequence[bytes] = ()) -> int:
        """Register the sequence's full blocks whose tokens (`token_ids`, from position 0) are all computed and
        not yet hashed; returns how many blocks became matchable (0 when prefix caching is off).

        A block whose hash another block already holds is not registered (that one stays the cached copy).
        `known_hashes`: chained hashes of the tokens' leading full blocks already computed (`match_prefix`'s list),
        used instead of hashing those blocks again."""
        table = self._tables.get(seq_id)
        if not self.prefix_caching or not table:
            return 0
        full = min(int(num_computed_tokens), len(token_ids)) // self.block_size
        chain = self._chain.setdefault(seq_id, [])
        added = 0
        for j in range(len(chain), min(full, len(table))):
            parent = chain[-1] if chain else ROOT_HASH
            h = known_hashes[j] if j < len(known_hashes) else self._hash(parent, token_ids, j)
            chain.append(h)
            if h not in self._block_of and table[j] != NULL_BLOCK:
                self._hash_of[table[j]] = h
                self._block_of[h] = table[j]
                added += 1
        return added

    def _hash(self, parent: bytes, token_ids: Sequence[int], j: int) -> bytes:
        """The chained hash of block `j` of `token_ids` under its parent block's hash."""
        return chain_hash(parent, token_ids[j * self.block_size:(j + 1) * self.block_size])

    def cached_block(self, key: bytes) -> int | None:
        """The block registered under `key` (a chained hash, or a key of the caller's: `register_block`), if any."""
        return self._block_of.get(key)

    def register_block(self, seq_id: Hashable, j: int, key: bytes) -> bool:
        """Register entry `j` of the sequence's table under `key`, unless the key is held already or the block is
        (a caller that hashes its blocks itself: policies.kv_groups); returns whether it did."""
        b = self._tables[seq_id][j]
        if not self.prefix_caching or b == NULL_BLOCK or key in self._block_of or b in self._hash_of:
            return False
        self._hash_of[b], self._block_of[key] = key, b
        return True

    def _uncache(self, b: int) -> None:
        """Drop block b's registration (it is evicted, retired or overwritten)."""
        h = self._hash_of.pop(b, None)
        if h is not None:
            del self._block_of[h]

    # -------------------------------------------------------------- capacity
    def id_limit_after_grow(self, n: int) -> int:
        """The id space `grow(n)` leaves (a runtime backs it with memory before the pool hands the blocks out)."""
        return self._id_limit + max(0, n - len(self._holes))

    def grow(self, n: int) -> None:
        """Add `n` blocks: revive holes first (lowest id first), then extend the id space."""
        if n < 0:
            raise ValueError(f"grow needs n >= 0, got {n}")
        limit = self.id_limit_after_grow(n)
        revive = self._holes[:n]
        del self._holes[:n]
        for b in revive:  # holes hold no registration
            heapq.heappush(self._uncached, b)
        self._uncached.extend(range(self._id_limit, limit))  # all above any existing id: still a heap
        self._id_limit = limit

    def shrink(self, n: int) -> int:
        """Retire the `n` highest-numbered free blocks, cached or not; returns the new `id_limit`.

        Raises BlockPoolError (pool unchanged) if fewer than `n` blocks are free.
        """
        if n < 0:
            raise ValueError(f"shrink needs n >= 0, got {n}")
        if n > self.num_free:
            raise BlockPoolError(f"cannot shrink by {n} blocks: only {self.num_free} free")
        if n == 0:
            return self._id_limit
        retired = set()
        for b in self._highest_free(n):
            if b in self._evictable:
                del self._evictable[b]
                self._uncache(b)
            else:
                retired.add(b)
            bisect.insort(self._holes, b)
        if retired:
            self._uncached = [b for b in self._uncached if b not in retired]
            heapq.heapify(self._uncached)
        self._trim()
        return self._id_limit

    def _highest_free(self, n: int) -> list[int]:
        """The `n` highest free ids, cached or not, highest first."""
        return sorted(heapq.nlargest(n, self._uncached) + heapq.nlargest(n, self._evictable), reverse=True)[:n]

    def compact(self) -> list[tuple[int, int]]:
        """Move live blocks from the top of the id space into lower free/hole ids until no hole remains.

        Returns the `(src, dst)` block copies made (a runtime copies K/V of block src into dst
        before the next forward). Block tables are rewritten (a shared block moves once, every table
        holding it follows, and so does its registration); `id_limit` drops to `capacity`. Destinations
        are the lowest holes and uncached free ids below `capacity`, of which there are always enough (as
        many holes lie below it as live and free blocks above it), so cached free blocks below `capacity`
        keep their registration; those at or above it are cut off and evicted.
        """
        moves: list[tuple[int, int]] = []
        if not self._holes:
            return moves
        target = self.capacity  # after compaction every id < target is usable, none above
        holders: dict[int, list[tuple[Hashable, int]]] = {}
        for sid, t in self._tables.items():
            for j, b in enumerate(t):
                if b >= target:
                    holders.setdefault(b, []).append((sid, j))
        low = sorted(b for b in self._uncached + self._holes if b < target)
        for src, dst in zip(sorted(holders), low):
            for sid, j in holders[src]:
                self._tables[sid][j] = dst
            self._refs[dst] = self._refs.pop(src)
            h = self._hash_of.pop(src, None)
            if h is not None:
                self._hash_of[dst], self._block_of[h] = h, dst
            moves.append((src, dst))
        for b in self._evictable:
            if b >= target:
                self._uncache(b)
        # cached free blocks below target were no destination: they stay, in their eviction order
        self._evictable = OrderedDict((b, None) for b in self._evictable if b < target)
        self._uncached = [b for b in range(target) if b not in self._refs and b not in self._evictable]
        self._holes = []
        self._id_limit = target
        self.rewrites += bool(moves)
        return moves

    def _trim(self) -> None:
        while self._holes and self._holes[-1] == self._id_limit - 1:
            self._holes.pop()
            self._id_limit -= 1

    # ------------------------------------------------------------ invariants
    def check_invariants(self) -> None:
        """Raise BlockPoolError if ids are double-booked, out of range or miscounted (tests and debug runs)."""
        holders: dict[int, int] = {}
        for sid, t in self._tables.items():
            released = self._released.get(sid, 0)
            if any(b != NULL_BLOCK for b in t[:released]) or NULL_BLOCK in t[released:]:
                raise BlockPoolError(f"sequence {sid!r}: released entries are not its table's first {released}")
            t = t[released:]
            if len(set(t)) != len(t):
                raise BlockPoolError("a block table holds a block twice")
            for b in t:
                holders[b] = holders.get(b, 0) + 1
        if holders != self._refs:
            raise BlockPoolError("reference counts differ from the tables holding each block")
        if not self.prefix_caching and any(n > 1 for n in holders.values()):
            raise BlockPoolError("a block is shared without prefix caching")
        everything = list(holders) + self._uncached + list(self._evictable) + self._holes
        if len(set(everything)) != len(everything):
            raise BlockPoolError("a block id is in two places (double allocation)")
        if sorted(everything) != list(range(self._id_limit)):
            raise BlockPoolError(f"block ids do not partition [0, {self._id_limit})")
        heap = self._uncached
        if any(heap[(i - 1) // 2] > heap[i] for i in range(1, len(heap))) or self._holes != sorted(self._holes):
            raise BlockPoolError("uncached free ids not a heap, or hole list not sorted")
        if any(b in self._hash_of for b in self._uncached):
            raise BlockPoolError("a registered free block is missing from the eviction order")
        if any(b not in self._hash_of for b in self._evictable):
            raise BlockPoolError("the eviction order holds an unregistered block")
        for sid, t in self._tables.items():
            if len(t) != self.blocks_for(self._tokens.get(sid, 0)):
                raise BlockPoolError(f"sequence {sid!r}: {len(t)} blocks for {self._tokens.get(sid, 0)} tokens")
        if {h: b for b, h in self._hash_of.items()} != self._block_of:
            raise BlockPoolError("the hash -> block map is not the inverse of block -> hash")
        if not set(self._hash_of) <= set(holders) | set(self._evictable):
            raise BlockPoolError("a registered block is a hole or out of range")
        if any(len(self._chain[sid]) > len(t) for sid, t in self._tables.items() if sid in self._chain):
            raise BlockPoolError("a sequence hashed more blocks than it holds")
