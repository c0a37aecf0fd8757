"""Prefix caching: the pool's chained-hash registry, reference counts and cached free blocks (eviction, shrink,
compaction), the scheduler's admission over cached blocks, and the runtime's outputs, CLI stats and /metrics with
it on (greedy outputs equal to prefix caching off)."""
from __future__ import annotations

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.kv_blocks import BlockPool, BlockPoolError
from policies.scheduler import Scheduler
from policies.sequence import Sequence
from pwruntime.cli import main
from pwruntime.engine import EngineConfig, LLMEngine
from pwruntime.sampling import SamplingParams
from server_fixtures import metric, metrics_text, model, post, serving  # noqa: F401 (fixtures)
from traces.clikit import UserError

# ------------------------------------------------------------------ the pool


def test_register_and_match_a_chain():
    pool = BlockPool(8, block_size=4, prefix_caching=True)
    toks = list(range(10, 20))  # two full blocks and a partial one
    assert pool.allocate("a", 10) == [0, 1, 2]
    assert pool.match_prefix(toks) == []  # nothing registered yet
    assert pool.register("a", toks, 7) == 1  # only the first block is full and computed
    assert pool.match_prefix(toks) == [0]
    assert pool.register("a", toks, 10) == 1 and pool.register("a", toks, 10) == 0  # never the partial block
    assert pool.match_prefix(toks) == [0, 1]
    assert pool.match_prefix(toks[:7]) == [0]  # full blocks only
    assert pool.match_prefix(toks[:5] + [99] + toks[6:]) == [0]  # stops at the first miss
    assert pool.match_prefix([99] + toks[1:]) == []
    assert pool.match_prefix(toks[4:8] + toks[:4]) == []  # chained: block 1's tokens at position 0 are not block 1
    assert pool.num_cached_blocks == 2
    pool.check_invariants()


def test_shared_blocks_are_reference_counted_and_stay_cached_when_free():
    pool = BlockPool(8, block_size=4, prefix_caching=True)
    toks = list(range(10, 20))
    pool.allocate("a", 10)
    pool.register("a", toks, 10)
    prefix = pool.match_prefix(toks[:9])
    assert prefix == [0, 1]
    assert pool.allocate("b", 10, prefix) == [3]  # the new block only
    assert pool.block_table("b") == [0, 1, 3]
    assert [pool.ref_count(b) for b in range(4)] == [2, 2, 1, 1]
    assert pool.num_used == 4 and pool.num_free == 4
    pool.check_invariants()
    assert pool.free("a") == 3
    assert pool.block_table("b") == [0, 1, 3] and [pool.ref_count(b) for b in range(4)] == [1, 1, 0, 1]
    assert pool.num_free == 5  # only a's own block came back
    pool.check_invariants()
    pool.free("b")
    assert pool.num_free == pool.capacity == 8 and pool.num_used == 0
    assert pool.match_prefix(toks) == [0, 1] and pool.num_cached_blocks == 2  # cached free
    pool.check_invariants()
    assert pool.allocate("c", 10, [0, 1]) == [2]  # the cached free prefix leaves the free list, then the lowest
    assert pool.block_table("c") == [0, 1, 2] and pool.num_free == 5
    pool.check_invariants()


def test_admission_counts_only_the_blocks_it_takes_from_the_free_list():
    pool = BlockPool(4, block_size=4, prefix_caching=True)
    toks = list(range(12))
    pool.allocate("a", 12)
    pool.register("a", toks, 12)
    prefix = pool.match_prefix(toks[:11])
    assert prefix == [0, 1] and pool.num_free == 1
    assert pool.can_allocate("b", 12, prefix) and not pool.can_allocate("b", 13, prefix)
    assert not pool.can_allocate("b", 12)
    pool.free("a")
    assert pool.can_allocate("c", 16, prefix) and not pool.can_allocate("c", 17, prefix)  # 2 cached + new ones
    with pytest.raises(BlockPoolError):
        pool.allocate("c", 17, prefix)
    assert not pool.has("c") and pool.num_free == 4 and pool.num_cached_blocks == 3  # unchanged
    with pytest.raises(BlockPoolError, match="matched prefix"):
        pool.allocate("c", 8, [3])  # not registered
    pool.allocate("c", 16, prefix)
    with pytest.raises(BlockPoolError, match="new one"):
        pool.allocate("c", 16, prefix)
    pool.check_invariants()


def _cached_chain(pool: BlockPool, seq_id, tokens: list[int]) -> list[int]:
    """Allocate a sequence for `tokens` (all computed) and register its full blocks; returns its table."""
    pool.allocate(seq_id, len(tokens))
    pool.register(seq_id, tokens, len(tokens))
    return pool.block_table(seq_id)


def test_new_blocks_use_uncached_free_blocks_before_evicting_cached_ones():
    pool = BlockPool(6, block_size=2, prefix_caching=True)
    x, y = [1, 2, 3, 4], [5, 6, 7, 8]
    assert _cached_chain(pool, "x", x) == [0, 1] and _cached_chain(pool, "y", y) == [2, 3]
    pool.free("y")
    pool.free("x")
    assert pool.num_cached_blocks == 4 and pool.num_free == 6
    assert pool.allocate("z", 4) == [4, 5]  # the uncached ones, above the cached ones
    assert pool.num_cached_blocks == 4 and pool.match_prefix(x) == [0, 1] and pool.match_prefix(y) == [2, 3]
    pool.check_invariants()
    assert pool.allocate("z", 6) == [3]  # now an eviction: y, freed first, its tail first
    assert pool.num_cached_blocks == 3 and pool.match_prefix(y) == [2] and pool.match_prefix(x) == [0, 1]
    assert pool.allocate("z", 8) == [2]
    assert pool.match_prefix(y) == [] and pool.match_prefix(x) == [0, 1]
    assert pool.register("z", [9] * 8, 8) == 4  # an evicted block caches z's tokens now
    assert pool.match_prefix([9] * 8) == [4, 5, 3, 2] and pool.is_cached(3) and pool.is_cached(0)
    pool.check_invariants()


def test_a_finished_chain_is_evicted_tail_first_so_its_head_still_matches():
    pool = BlockPool(6, block_size=2, prefix_caching=True)
    toks = list(range(100, 110))  # five full blocks
    assert _cached_chain(pool, "a", toks) == [0, 1, 2, 3, 4]
    pool.allocate("live", 2)  # block 5: no uncached block is left once a is freed
    pool.free("a")
    assert pool.match_prefix(toks) == [0, 1, 2, 3, 4]
    assert pool.allocate("b", 4) == [4, 3]  # lowest ids first would take the head, 0, and strand the chain
    assert pool.match_prefix(toks) == [0, 1, 2]
    assert pool.allocate("c", 2) == [2]
    assert pool.match_prefix(toks) == [0, 1] and not pool.is_cached(2)
    pool.check_invariants()


def test_blocks_a_window_releases_are_evicted_tail_first_as_a_freed_chain_s_are():
    pool = BlockPool(3, block_size=2, prefix_caching=True)
    toks = [1, 2, 3, 4, 5, 6]
    assert _cached_chain(pool, "a", toks) == [0, 1, 2]
    assert pool.release_leading("a", 2) == 2 and pool.block_table("a") == [-1, -1, 2]
    assert pool.allocate("b", 2) == [1]  # the released run's tail goes first; its head stays matchable
    assert pool.is_cached(0) and not pool.is_cached(1)
    pool.check_invariants()


def test_register_hashes_only_the_blocks_whose_tokens_it_is_given():
    """More computed tokens than token ids (a caller's slip) must not register a block under a hash of fewer tokens."""
    pool = BlockPool(4, block_size=2, prefix_caching=True)
    pool.allocate("a", 6)
    assert pool.register("a", [1, 2, 3], 6) == 1
    assert pool.num_cached_blocks == 1 and pool.match_prefix([1, 2, 3, 4]) == [0]
    pool.check_invariants()


def test_register_block_keeps_one_key_per_block():
    pool = BlockPool(4, block_size=1, prefix_caching=True)
    pool.allocate("a", 2)
    assert pool.register_block("a", 0, b"k0") and not pool.register_block("a", 1, b"k0")  # the key is held
    assert not pool.register_block("a", 0, b"other")  # the block is registered already
    assert pool.cached_block(b"k0") == 0 and pool.cached_block(b"other") is None and pool.num_cached_blocks == 1
    pool.check_invariants()


def test_cached_free_blocks_are_evicted_least_recently_freed_first_across_sequences():
    pool = BlockPool(4, block_size=2, prefix_caching=True)
    b, a = [5, 6, 7, 8], [1, 2, 3, 4]
    assert _cached_chain(pool, "b", b) == [0, 1] and _cached_chain(pool, "a", a) == [2, 3]
    pool.free("a")  # a first, though its ids are higher: lowest ids first would evict b
    pool.free("b")
    assert pool.allocate("c", 4) == [3, 2]
    assert pool.match_prefix(a) == [] and pool.match_prefix(b) == [0, 1]
    assert pool.allocate("c", 6) == [1]
    assert pool.match_prefix(b) == [0]
    pool.check_invariants()


def test_a_prefix_hit_leaves_the_eviction_order_and_is_most_recent_once_freed_again():
    pool = BlockPool(6, block_size=2, prefix_caching=True)
    a, b, c = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]
    for sid, toks in (("a", a), ("b", b), ("c", c)):
        _cached_chain(pool, sid, toks)
    for sid in ("a", "b", "c"):
        pool.free(sid)  # eviction order: 1 0 3 2 5 4
    prefix = pool.match_prefix(a + [0])
    assert prefix == [0, 1]
    assert pool.allocate("d", 5, prefix) == [3]  # a's blocks, the oldest, are in use: b's tail goes
    assert pool.block_table("d") == [0, 1, 3] and pool.ref_count(0) == 1 and pool.num_free == 3
    pool.check_invariants()
    pool.free("d")  # block 3 lost its registration (uncached); a's blocks are the most recent now
    assert pool.num_free == 6 and pool.match_prefix(a) == [0, 1]
    assert pool.allocate("e", 8) == [3, 2, 5, 4]  # the uncached block, then b and c, the older ones
    assert pool.match_prefix(a) == [0, 1] and pool.match_prefix(b) == [] and pool.match_prefix(c) == []
    assert pool.allocate("e", 10) == [1]
    assert pool.match_prefix(a) == [0]
    pool.check_invariants()


def test_shrink_retires_the_highest_free_ids_cached_or_not_and_they_leave_the_eviction_order():
    pool = BlockPool(6, block_size=1, prefix_caching=True)
    for i in range(4):  # sequence i holds block i, caching [10 * i]
        _cached_chain(pool, i, [10 * i])
    for i in (3, 0, 1, 2):
        pool.free(i)  # eviction order: 3 0 1 2; uncached free: 4 5
    assert pool.shrink(3) == 3  # retires 5, 4 and the cached 3
    assert [pool.match_prefix([10 * i]) for i in range(4)] == [[0], [1], [2], []]
    assert pool.allocate("x", 2) == [0, 1]  # the oldest cached ones that are left
    assert [pool.match_prefix([10 * i]) for i in range(4)] == [[], [], [2], []]
    pool.check_invariants()


@pytest.mark.parametrize("corrupt", ["cached block among the uncached", "uncached block in the eviction order",
                                     "uncached list unsorted", "free block lost"])
def test_check_invariants_catches_a_corrupt_free_list(corrupt):
    pool = BlockPool(4, block_size=1, prefix_caching=True)
    _cached_chain(pool, "a", [1, 2])
    pool.free("a")  # uncached free 2 3, eviction order 1 0
    pool.check_invariants()
    if corrupt == "cached block among the uncached":
        del pool._evictable[0]
        pool._uncached.insert(0, 0)
    elif corrupt == "uncached block in the eviction order":
        pool._evictable[pool._uncached.pop()] = None
    elif corrupt == "uncached list unsorted":
        pool._uncached.reverse()
    else:
        pool._evictable.popitem(last=False)
    with pytest.raises(BlockPoolError):
        pool.check_invariants()


_MODEL_OPS = ["alloc", "alloc", "free", "grow", "shrink", "compact"]


def _lowest_id_model_run(seed: int) -> None:
    """Random operations on a pool with prefix caching off, checked against a model that hands out the
    lowest free ids (the pool's order before the eviction order changed; the simulator depends on it)."""
    rng = random.Random(seed)
    pool = BlockPool(rng.randint(0, 12), block_size=rng.randint(1, 3))
    free, holes, limit = set(range(pool.id_limit)), set(), pool.id_limit
    tables: dict[int, list[int]] = {}
    for _ in range(200):
        op, seq, n = rng.choice(_MODEL_OPS), rng.randrange(4), rng.randint(0, 6)
        if op == "alloc":
            want = pool.num_tokens(seq) + n
            if not pool.can_allocate(seq, want):
                continue
            new = pool.allocate(seq, want)
            assert new == sorted(free)[:len(new)]
            free -= set(new)
            tables.setdefault(seq, []).extend(new)
        elif op == "free":
            pool.free(seq)
            free |= set(tables.pop(seq, []))
        elif op == "grow":
            pool.grow(n)
            revived = sorted(holes)[:n]
            holes -= set(revived)
            free |= set(revived) | set(range(limit, limit + n - len(revived)))
            limit += n - len(revived)
        elif op == "shrink" and n <= len(free):
            retired = sorted(free)[len(free) - n:]
            free -= set(retired)
            holes |= set(retired)
            while limit - 1 in holes:
                holes.remove(limit - 1)
                limit -= 1
            assert pool.shrink(n) == limit
        elif op == "compact" and holes:
            target = limit - len(holes)
            srcs = sorted(b for t in tables.values() for b in t if b >= target)
            dsts = sorted(b for b in free | holes if b < target)[:len(srcs)]
            assert pool.compact() == list(zip(srcs, dsts))
            moved = dict(zip(srcs, dsts))
            tables = {s: [moved.get(b, b) for b in t] for s, t in tables.items()}
            limit, holes = target, set()
            free = set(range(limit)) - {b for t in tables.values() for b in t}
        pool.check_invariants()
        assert pool.id_limit == limit and pool.num_free == len(free) and pool.hole_blocks == len(holes)
        assert all(pool.block_table(s) == t for s, t in tables.items())


@pytest.mark.parametrize("seed", range(20))
def test_without_prefix_caching_allocation_hands_out_the_lowest_free_ids(seed):
    _lowest_id_model_run(seed)


_PROMPTS = ([1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 9, 9, 9], [1, 2, 7, 7, 7, 7, 7, 7], [5] * 10)  # shared prefixes


@pytest.mark.parametrize("seed", range(30))
def test_random_operations_keep_the_invariants_and_evict_in_lru_tail_first_order(seed):
    """Random allocate/append/free/register/match/shrink/grow/compact operations with prefix caching on:
    the invariants hold after each one, and every allocation hands out uncached free blocks (ascending) before
    any cached one, then evicts the cached free blocks released longest ago (a table's tail released first)."""
    rng = random.Random(seed)
    pool = BlockPool(rng.randint(2, 14), block_size=rng.randint(1, 3), prefix_caching=True)
    released: dict[int, int] = {}  # block id -> when it last became free (a clock over released blocks)
    clock = 0
    ops = ["admit", "admit", "append", "free", "register", "shrink", "grow", "compact"]
    for _ in range(250):
        op, seq, n = rng.choice(ops), rng.randrange(5), rng.randint(0, 4)
        tokens = _PROMPTS[seq % len(_PROMPTS)]
        cached_free = [b for b in range(pool.id_limit) if pool.is_cached(b) and pool.ref_count(b) == 0]
        free_before = pool.num_free
        new: list[int] | None = None
        prefix: list[int] = []
        if op == "admit" and not pool.has(seq):
            prefix = pool.match_prefix(tokens[:-1])
            if pool.can_allocate(seq, len(tokens), prefix):
                new = pool.allocate(seq, len(tokens), prefix)
                assert pool.block_table(seq) == prefix + new
        elif op == "append" and pool.has(seq) and pool.can_allocate(seq, pool.num_tokens(seq) + 1):
            before = pool.num_blocks_of(seq)
            pool.append_slot(seq)
            new = pool.block_table(seq)[before:]
        elif op == "free":
            table = pool.block_table(seq)
            pool.free(seq)
            for b in reversed(table):
                if pool.ref_count(b) == 0:
                    released[b], clock = clock, clock + 1
        elif op == "register" and pool.has(seq):
            pool.register(seq, tokens, min(len(tokens), pool.num_tokens(seq)))
        elif op == "shrink" and n <= pool.num_free:
            pool.shrink(n)
        elif op == "grow":
            pool.grow(n)
        elif op == "compact":
            pool.compact()
        pool.check_invariants()
        if new is None:
            continue
        evictable = [b for b in cached_free if b not in prefix]
        evicted = [b for b in new if b in evictable]
        fresh = new[:len(new) - len(evicted)]
        assert new[len(fresh):] == evicted and fresh == sorted(fresh)
        assert not any(pool.is_cached(b) for b in new)
        if evicted:  # every uncached free block went first
            assert len(fresh) == free_before - len(cached_free)
        assert evicted == sorted(evictable, key=released.__getitem__)[:len(evicted)]


def test_a_duplicate_block_keeps_the_registered_copy_and_its_chain_goes_on():
    pool = BlockPool(4, block_size=2, prefix_caching=True)
    pool.allocate("a", 3)
    pool.allocate("b", 3)  # the same tokens computed twice, side by side
    assert pool.register("a", [1, 2, 3], 3) == 1
    assert pool.register("b", [1, 2, 3], 3) == 0
    assert pool.match_prefix([1, 2, 3]) == [0] and pool.num_cached_blocks == 1
    pool.allocate("b", 4)
    assert pool.register("b", [1, 2, 3, 4], 4) == 1  # b's second block chains on the hash b's copy shares
    assert pool.match_prefix([1, 2, 3, 4]) == [0, 3]
    pool.check_invariants()


def test_shrink_drops_the_registrations_of_retired_blocks():
    pool = BlockPool(4, block_size=1, prefix_caching=True)
    pool.allocate("a", 3)
    pool.register("a", [5, 6, 7], 3)
    pool.allocate("b", 1)  # block 3 stays live
    pool.free("a")
    assert pool.shrink(2) == 4  # retires 2 and 1: holes under block 3
    assert pool.hole_blocks == 2 and pool.num_cached_blocks == 1 and pool.match_prefix([5, 6, 7]) == [0]
    pool.check_invariants()
    pool.grow(2)  # the revived holes hold nothing matchable
    assert pool.match_prefix([5, 6, 7]) == [0]
    pool.check_invariants()
    pool.free("b")
    pool.shrink(4)
    assert pool.num_cached_blocks == 0 and pool.match_prefix([5, 6, 7]) == []
    pool.check_invariants()


def test_compact_moves_a_shared_block_once():
    pool = BlockPool(8, block_size=2, prefix_caching=True)
    pool.allocate("filler", 8)  # 0..3
    t = [1, 2, 3, 4]
    pool.allocate("a", 4)  # 4, 5
    pool.register("a", t, 4)
    assert pool.allocate("b", 5, pool.match_prefix(t)) == [6]
    pool.free("filler")
    assert pool.shrink(3) == 7  # retires 7, 3, 2: holes under the live blocks
    assert pool.hole_blocks == 2 and pool.capacity == 5
    moves = pool.compact()
    assert moves == [(5, 0), (6, 1)]  # block 5, held by a and b, moves once
    assert pool.block_table("a") == [4, 0] and pool.block_table("b") == [4, 0, 1]
    assert pool.ref_count(0) == 2 and pool.ref_count(5) == 0
    assert pool.match_prefix(t) == [4, 0]  # the registration moved with it
    pool.check_invariants()


def test_compact_keeps_cached_free_blocks_below_the_target_and_moves_into_uncached_ids_first():
    pool = BlockPool(5, block_size=1, prefix_caching=True)
    for i in range(5):  # sequence i holds block i, caching [10 * i]
        pool.allocate(i, 1)
        pool.register(i, [10 * i], 1)
    pool.free(0)
    pool.free(1)
    pool.shrink(1)  # retires 1: a hole under live blocks, capacity 4
    pool.free(3)
    assert pool.capacity == 4 and pool.id_limit == 5
    assert pool.compact() == [(4, 1)]  # into the hole, not the lower cached free block 0
    assert pool.block_table(4) == [1]
    assert [pool.match_prefix([10 * i]) for i in range(5)] == [[0], [], [2], [3], [1]]
    pool.check_invariants()


def test_compact_evicts_cached_free_blocks_it_cuts_off():
    pool = BlockPool(4, block_size=1, prefix_caching=True)
    for i in range(4):
        pool.allocate(i, 1)
        pool.register(i, [10 * i], 1)
    pool.free(0)
    pool.free(1)
    pool.shrink(1)  # hole 1, capacity 3
    pool.free(3)
    pool.free(2)
    assert pool.compact() == [] and pool.id_limit == 3
    assert [pool.match_prefix([10 * i]) for i in range(4)] == [[0], [], [2], []]
    pool.check_invariants()


_pool_ops = st.lists(st.tuples(
    st.sampled_from(["alloc", "append", "free", "grow", "shrink", "compact", "register"]),
    st.integers(0, 3), st.integers(0, 12)), max_size=50)


@settings(max_examples=100, deadline=None)
@given(initial=st.integers(0, 10), block_size=st.integers(1, 4), ops=_pool_ops)
def test_without_prefix_caching_nothing_is_shared_or_matched(initial, block_size, ops):
    """A pool with prefix caching off, told to register, behaves as a caching pool that registers nothing."""
    off = BlockPool(initial, block_size)
    inert = BlockPool(initial, block_size, prefix_caching=True)
    for op, seq, n in ops:
        tokens = list(range(n))
        results = []
        for pool in (off, inert):
            if op == "alloc":
                want = pool.num_tokens(seq) + n
                results.append(pool.allocate(seq, want) if pool.can_allocate(seq, want) else None)
            elif op == "append":
                results.append(pool.append_slot(seq) if pool.can_allocate(seq, pool.num_tokens(seq) + 1) else None)
            elif op == "free":
                results.append(pool.free(seq))
            elif op == "grow":
                results.append(pool.grow(n))
            elif op == "shrink":
                results.append(pool.shrink(n) if n <= pool.num_free else None)
            elif op == "compact":
                results.append(pool.compact())
            elif pool is off:
                results.append(pool.register(seq, tokens, n))
            else:
                results.append(0)
        assert results[0] == results[1]
        assert off.match_prefix(tokens) == [] == inert.match_prefix(tokens)
        assert off.num_cached_blocks == 0
        for attr in ("id_limit", "capacity", "num_free", "hole_blocks"):
            assert getattr(off, attr) == getattr(inert, attr)
        assert [off.block_table(s) for s in range(4)] == [inert.block_table(s) for s in range(4)]
        off.check_invariants()


_SEQS = 3


@settings(max_examples=300, deadline=None)
@given(block_size=st.integers(1, 3), initial=st.integers(2, 10),
       prompts=st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=9), min_size=_SEQS, max_size=_SEQS),
       ops=st.lists(st.tuples(st.sampled_from(["run", "free", "shrink", "grow", "compact"]),
                              st.integers(0, _SEQS - 1), st.integers(0, 4)), max_size=40))
def test_random_operations_share_only_blocks_that_hold_the_same_tokens(block_size, initial, prompts, ops):
    """Sequences admitted as the scheduler admits them (over their cached prefix, computing the rest and
    registering it), freed, the pool resized and compacted: every block a match returns holds the matched tokens
    (tracked as a runtime's K/V would be: written by the sequence computing it, copied by compaction, lost above
    `id_limit`), and no sequence writes a block another one holds."""
    pool = BlockPool(initial, block_size, prefix_caching=True)
    content: dict[int, tuple] = {}

    def check(tokens: list[int], matched: list[int]) -> None:
        for j, b in enumerate(matched):
            assert content.get(b) == tuple(tokens[j * block_size:(j + 1) * block_size])

    for op, s, n in ops:
        tokens = prompts[s]
        if op == "run" and not pool.has(s):
            prefix = pool.match_prefix(tokens[:-1])
            check(tokens, prefix)
            if pool.can_allocate(s, len(tokens), prefix):
                pool.allocate(s, len(tokens), prefix)
                table = pool.block_table(s)
                for j in range(len(prefix), len(table)):
                    assert pool.ref_count(table[j]) == 1
                    content[table[j]] = tuple(tokens[j * block_size:(j + 1) * block_size])
                pool.register(s, tokens, len(tokens))
            else:
                with pytest.raises(BlockPoolError):
                    pool.allocate(s, len(tokens), prefix)
        elif op == "free":
            pool.free(s)
        elif op == "shrink" and n <= pool.num_free:
            pool.shrink(n)
        elif op == "grow":
            pool.grow(n)
        elif op == "compact":
            before = dict(content)
            for src, dst in pool.compact():
                content[dst] = before.get(src)
        for b in [b for b in content if b >= pool.id_limit]:  # a runtime's cache is cut there
            del content[b]
        pool.check_invariants()
    for tokens in prompts:
        check(tokens, pool.match_prefix(tokens))


# ------------------------------------------------------------- the scheduler


def _step(scheduler: Scheduler, token: int = 7):
    batch = scheduler.schedule()
    scheduler.postprocess(batch, [token] * batch.num_sampled)
    return batch


@pytest.mark.parametrize("caching", [True, False])
def test_a_second_request_with_the_same_prompt_shares_its_full_blocks(caching):
    pool = BlockPool(4, block_size=16, prefix_caching=caching)
    scheduler = Scheduler(pool)
    a = Sequence("a", list(range(40)), max_tokens=4)
    scheduler.add(a)
    _step(scheduler)
    b = Sequence("b", list(range(40)), max_tokens=4)
    scheduler.add(b)
    batch = scheduler.schedule()
    if not caching:  # b needs 3 blocks, 1 is free
        assert [e.seq for e in batch.entries] == [a] and scheduler.num_cached_tokens == 0
        return
    entry = batch.entries[-1]
    assert entry.seq is b and entry.start == 32 and entry.num_new_tokens == 8 and entry.sample
    assert b.num_computed_tokens == 32 and scheduler.num_cached_tokens == 32
    assert pool.block_table("b")[:2] == pool.block_table("a")[:2]
    assert [pool.ref_count(x) for x in pool.block_table("b")] == [2, 2, 1]
    scheduler.postprocess(batch, [7, 7])
    assert b.num_computed_tokens == 40 and b.output_token_ids == [7]
    pool.check_invariants()


def test_a_prompt_of_whole_blocks_still_computes_its_last_token():
    pool = BlockPool(8, block_size=16, prefix_caching=True)
    scheduler = Scheduler(pool)
    scheduler.add(Sequence("a", list(range(32)), max_tokens=1))
    _step(scheduler)  # a finishes at once: its two blocks stay cached
    assert pool.num_used == 0 and pool.num_cached_blocks == 2
    b = Sequence("b", list(range(32)), max_tokens=1)
    scheduler.add(b)
    (entry,) = _step(scheduler).entries
    assert entry.start == 16 and entry.num_new_tokens == 16 and entry.sample
    assert scheduler.num_cached_tokens == 16 and b.is_finished


def test_sequences_without_token_ids_are_never_matched():
    pool = BlockPool(8, block_size=4, prefix_caching=True)
    scheduler = Scheduler(pool)
    for sid in ("a", "b"):
        scheduler.add(Sequence(sid, prompt_len=12, max_tokens=2))
        _step(scheduler)
    assert scheduler.num_cached_tokens == 0 and pool.num_cached_blocks == 0


def test_match_prefix_hashes_each_block_once_when_given_the_request_s_hashes(monkeypatch):
    pool = BlockPool(8, block_size=4, prefix_caching=True)
    toks = list(range(10, 22))  # three full blocks
    pool.allocate("a", 12)
    pool.register("a", toks, 8)  # blocks 0 and 1 cached, block 2 not
    calls = []
    real = pool._hash
    monkeypatch.setattr(pool, "_hash", lambda *args: calls.append(args[2]) or real(*args))
    hashes: list[bytes] = []
    assert pool.match_prefix(toks, hashes) == [0, 1] and calls == [0, 1, 2] and len(hashes) == 3
    assert pool.match_prefix(toks, hashes) == [0, 1] and calls == [0, 1, 2]  # read, not hashed again
    pool.register("a", toks, 12)  # hashes block 2 for its own chain
    calls.clear()
    assert pool.match_prefix(toks, hashes) == [0, 1, 2] and calls == []
    assert pool.match_prefix(toks + [5, 6, 7, 8], hashes) == [0, 1, 2] and calls == [3]  # more known tokens
    assert hashes[:3] == [pool._hash(h, toks, j) for j, h in enumerate([bytes(32)] + hashes[:2])]
    assert pool.match_prefix(toks) == [0, 1, 2]  # without the list: hashed afresh


def test_a_waiting_request_hashes_its_blocks_once_however_long_it_waits(monkeypatch):
    """The head of the queue, blocked by a running request, is matched against the cache every step; its block hashes
    are kept between steps (and dropped when it finishes)."""
    pool = BlockPool(3, block_size=4, prefix_caching=True)
    scheduler = Scheduler(pool, max_num_batched_tokens=64)
    a = Sequence("a", list(range(8)), max_tokens=6)
    b = Sequence("b", list(range(100, 108)), max_tokens=2)
    scheduler.add(a)
    scheduler.add(b)
    hashed = []
    real = pool._hash
    monkeypatch.setattr(pool, "_hash", lambda parent, tokens, j: hashed.append(tuple(tokens[j * 4:j * 4 + 4]))
                        or real(parent, tokens, j))
    waited = 0
    while not a.is_finished:
        batch = _step(scheduler)
        waited += all(e.seq is not b for e in batch.entries)
    assert waited >= 3  # b waited while a held the pool
    assert hashed.count((100, 101, 102, 103)) == 1  # b's first block: hashed once, not once a step
    while not b.is_finished:
        _step(scheduler)
    assert scheduler._block_hashes == {}


def test_an_admitted_request_hashes_each_of_its_blocks_once(monkeypatch):
    """The block that missed the cache at admission is registered with the hash the match computed, not hashed again
    (one sha256 an admission); a later request still matches every block."""
    pool = BlockPool(16, block_size=4, prefix_caching=True)
    scheduler = Scheduler(pool, max_num_batched_tokens=64)
    hashed = []
    real = pool._hash
    monkeypatch.setattr(pool, "_hash", lambda parent, tokens, j: hashed.append(tuple(tokens[j * 4:j * 4 + 4]))
                        or real(parent, tokens, j))
    a = Sequence("a", list(range(14)), max_tokens=1)   # three full blocks and two tokens
    scheduler.add(a)
    while not a.is_finished:
        _step(scheduler)
    assert sorted(hashed) == [(0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10, 11)]
    b = Sequence("b", list(range(14)) + [99], max_tokens=1)
    scheduler.add(b)
    _step(scheduler)
    assert b.num_computed_tokens == 15 and scheduler.num_cached_tokens == 12   # all three of a's blocks matched


def test_a_preempted_sequence_is_readmitted_over_its_own_cached_blocks():
    pool = BlockPool(3, block_size=4, prefix_caching=True)
    scheduler = Scheduler(pool, max_num_batched_tokens=64)
    a = Sequence("a", [100], max_tokens=5)
    b = Sequence("b", [200], max_tokens=8)
    scheduler.add(a)
    scheduler.add(b)
    held, readmitted = None, None
    for step in range(30):
        tables = {s.seq_id: pool.block_table(s.seq_id) for s in scheduler.running}
        batch = _step(scheduler, 50 + step)
        if b in batch.preempted:
            held = tables["b"]
        elif held is not None and readmitted is None and any(e.seq is b for e in batch.entries):
            readmitted = next(e for e in batch.entries if e.seq is b)
            assert pool.block_table("b")[:1] == held[:1]
        pool.check_invariants()
    assert held == [1] and b.num_preemptions == 1
    assert readmitted.start == 4 and readmitted.num_new_tokens == 1 and scheduler.num_cached_tokens == 4
    assert a.is_finished and b.is_finished and len(b.output_token_ids) == 8


# ---------------------------------------------------------------- the runtime

PREFIX = ("And God said unto Moses, I AM THAT I AM: and he said, Thus shalt thou say unto the children of Israel, "
          "I AM hath sent me unto you.")
PROMPTS = [PREFIX + s for s in (" And Moses", " The king of", " Behold, the", " Then said")]


def _greedy(max_tokens: int = 16) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens)


def _engine(model, **config) -> LLMEngine:
    return LLMEngine(model, EngineConfig(**config))


def test_the_prompts_share_a_long_prefix(model):
    ids = [model.tokenizer.encode(p) for p in PROMPTS]
    common = next(i for i in range(len(ids[0])) if len({tuple(x[:i + 1]) for x in ids}) > 1)
    assert common >= 32  # two blocks of 16


@pytest.mark.parametrize("config", [{"num_kv_blocks": 64}, {"num_kv_blocks": 24, "block_size": 4}],
                         ids=["roomy", "preempting"])
def test_greedy_outputs_equal_with_prefix_caching_off(model, config):
    outs = {}
    for caching in (False, True):
        engine = _engine(model, prefix_caching=caching, **config)
        outs[caching] = [[o.token_ids for o in engine.generate(PROMPTS, _greedy())] for _ in range(2)]
        assert (engine.scheduler.num_cached_tokens > 0) == caching
        assert engine.pool.num_free == engine.pool.capacity
        if config["num_kv_blocks"] == 24:
            assert engine.scheduler.num_preemptions > 0
    assert outs[True] == outs[False]
    assert len({tuple(o) for o in outs[False][0]}) > 1  # not degenerate


def test_outputs_survive_shrink_with_compaction_and_grow_over_shared_blocks(model):
    """A shared live block above the retired ids moves once (both tables follow); cached blocks that survive the
    resize are hit by the next round; the outputs stay those of an engine without prefix caching."""
    filler = model.tokenizer.encode("A fool uttereth all his mind: but a wise man keepeth it in till afterwards. " * 3)
    first, second = (model.tokenizer.encode(p) for p in PROMPTS[:2])
    outs, moved = {}, {}
    for caching in (False, True):
        engine = _engine(model, prefix_caching=caching, num_kv_blocks=64, block_size=4)
        done = []
        # the filler takes the lowest blocks and finishes at once; once the second prompt has taken one of them,
        # the shrink retires the others: holes under the first prompt's blocks, shared ones among them
        engine.add_request(filler[:40], _greedy(1))
        r1 = engine.add_request(first, _greedy())
        done += engine.step()
        r2 = engine.add_request(second, _greedy())
        done += engine.step()
        before = engine.pool.block_table(r1), engine.pool.block_table(r2)
        assert engine.capacity.shrink(engine.pool.num_free)
        after = engine.pool.block_table(r1), engine.pool.block_table(r2)
        assert engine.pool.id_limit == engine.kv.num_blocks == engine.pool.capacity
        moved[caching] = before, after
        engine.capacity.grow(40)
        while engine.has_unfinished():
            done += engine.step()
        hits = engine.scheduler.num_cached_tokens
        again = [o.token_ids for o in engine.generate(PROMPTS, _greedy())]
        assert (hits > 0) == caching and (engine.scheduler.num_cached_tokens > hits) == caching
        outs[caching] = [[o.token_ids for o in sorted(done, key=lambda o: o.request_id)], again]
    (b1, b2), (a1, a2) = moved[True]
    assert b1[:8] == b2[:8] and a1[:8] == a2[:8]  # 8 shared blocks (32 tokens) before and after
    assert any(x != y for x, y in zip(b1[:8], a1[:8]))  # a shared block moved
    assert outs[True] == outs[False]


def test_trace_recording_refuses_prefix_caching(model):
    with pytest.raises(UserError, match="prefix caching"):
        _engine(model, prefix_caching=True, record_traces=True)


@pytest.mark.parametrize("flag", [True, False])
def test_generate_json_reports_prefix_cache_hits(capsys, flag):
    args = ["generate", "--prompt", PROMPTS[0], "--prompt", PROMPTS[0], "--max-tokens", "4", "--max-num-seqs", "1",
            "--num-kv-blocks", "32", "--device", "cpu", "--json"]
    assert main(args + ["--enable-prefix-caching"] * flag) == 0
    out = json.loads(capsys.readouterr().out)
    hits = out["stats"]["prefix_cache_hit_tokens"]
    assert hits >= 32 if flag else hits == 0
    first, second = out["outputs"]
    assert first["token_ids"] == second["token_ids"]


def test_metrics_count_prefix_cache_hit_tokens(model):
    with serving(_engine(model, num_kv_blocks=256, prefix_caching=True)) as url:
        name = "prefix_cache_hit_tokens_total"
        assert f"# TYPE pagedweight_{name} counter" in metrics_text(url) and metric(url, name) == 0
        body = json.dumps({"model": "demo", "prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0}).encode()
        status, first = post(url, "/v1/completions", body)
        assert status == 200 and metric(url, name) == 0
        status, second = post(url, "/v1/completions", body)
        assert status == 200 and second["choices"][0]["text"] == first["choices"][0]["text"]
        assert metric(url, name) >= 32
