"""BlockPool: allocation, free, grow/shrink over free blocks only, compaction, no double allocation."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.kv_blocks import BlockPool, BlockPoolError


def test_allocate_lowest_ids_and_slots():
    pool = BlockPool(8, block_size=4)
    assert pool.allocate("a", 6) == [0, 1]
    assert pool.allocate("b", 1) == [2]
    assert pool.num_free == 5 and pool.num_used == 3
    assert pool.block_table("a") == [0, 1]
    assert pool.slot("a", 5) == 1 * 4 + 1
    # growing within the last block needs no new block; crossing it does
    assert pool.allocate("a", 8) == []
    assert pool.append_slot("a") == 3 * 4 + 0
    assert pool.block_table("a") == [0, 1, 3]
    with pytest.raises(BlockPoolError):
        pool.slot("a", 9)
    pool.check_invariants()


def test_can_allocate_and_refusal_leaves_pool_unchanged():
    pool = BlockPool(3, block_size=16)
    assert pool.can_allocate("a", 48) and not pool.can_allocate("a", 49)
    with pytest.raises(BlockPoolError):
        pool.allocate("a", 49)
    assert pool.num_free == 3 and not pool.has("a")
    pool.allocate("a", 20)
    assert pool.blocks_needed("a", 48) == 1 and pool.can_allocate("a", 48)


def test_a_sequence_holding_more_than_asked_needs_no_block():
    pool = BlockPool(8, block_size=4)
    pool.allocate("a", 12)
    assert pool.blocks_needed("a", 1) == 0 and pool.blocks_needed("a", 12) == 0 and pool.blocks_needed("a", 13) == 1


def test_release_leading_past_the_table_releases_the_whole_table():
    pool = BlockPool(8, block_size=4)
    pool.allocate("a", 12)
    assert pool.release_leading("a", 10) == 3
    assert pool.block_table("a") == [-1, -1, -1] and pool.num_free == 8 and pool.num_blocks_of("a") == 0
    pool.check_invariants()


def test_free_returns_blocks_and_reuses_lowest():
    pool = BlockPool(6, block_size=2)
    pool.allocate("a", 4)
    pool.allocate("b", 4)
    assert pool.free("a") == 2 and pool.free("a") == 0
    assert pool.allocate("c", 2) == [0]
    pool.check_invariants()


def test_shrink_takes_highest_free_and_trims_id_space():
    pool = BlockPool(8, block_size=1)
    pool.allocate("a", 3)  # 0,1,2
    assert pool.shrink(3) == 5  # retires 7,6,5: a clean tail
    assert pool.capacity == 5 and pool.hole_blocks == 0 and pool.num_free == 2
    with pytest.raises(BlockPoolError):
        pool.shrink(3)  # only 2 free; never touches blocks in use
    assert pool.capacity == 5
    pool.check_invariants()


def test_shrink_with_live_block_on_top_leaves_holes_then_compact():
    pool = BlockPool(6, block_size=1)
    pool.allocate("a", 5)  # 0..4
    pool.allocate("b", 1)  # 5
    pool.free("a")  # free 0..4, "b" keeps the top id
    assert pool.shrink(3) == 6  # retires 2,3,4: holes below the live block 5
    assert pool.hole_blocks == 3 and pool.capacity == 3 and pool.id_limit == 6
    assert pool.allocate("c", 2) == [0, 1]  # holes are never handed out
    moves = pool.compact()
    assert moves == [(5, 2)]
    assert pool.block_table("b") == [2] and pool.id_limit == 3 and pool.hole_blocks == 0
    pool.check_invariants()


def test_compaction_that_moves_no_block_keeps_tables_and_is_no_rewrite():
    """`rewrites` tells readers holding copies of block tables to read them again: only a compaction that moved."""
    pool = BlockPool(3, block_size=1)
    for s in "abc":
        pool.allocate(s, 1)
    pool.free("a")
    pool.free("b")
    assert pool.shrink(1) == 3 and pool.hole_blocks == 1  # id 1 retired below the live block 2
    pool.free("c")
    assert pool.compact() == [] and pool.rewrites == 0
    assert pool.id_limit == 2 and pool.hole_blocks == 0 and pool.num_free == 2
    pool.check_invariants()


def test_allocating_fewer_tokens_than_reserved_never_shrinks_a_sequence():
    pool = BlockPool(8, block_size=4)
    pool.allocate("a", 10)
    assert pool.allocate("a", 3) == [] and pool.num_tokens("a") == 10
    assert pool.slot("a", 9) == 2 * 4 + 1
    pool.check_invariants()


def test_grow_revives_holes_then_extends():
    pool = BlockPool(4, block_size=1)
    pool.allocate("low", 3)  # 0,1,2
    pool.allocate("hi", 1)  # 3
    pool.free("low")
    pool.shrink(2)  # retires 2 and 1 (highest free): holes under the live block 3
    assert pool.hole_blocks == 2 and pool.id_limit == 4 and pool.block_table("hi") == [3]
    assert pool.id_limit_after_grow(2) == 4 and pool.id_limit_after_grow(3) == 5
    pool.grow(3)  # revive 1, 2, then a new id 4
    assert pool.hole_blocks == 0 and pool.id_limit == 5 and pool.capacity == 5 and pool.num_free == 4
    assert pool.allocate("new", 4) == [0, 1, 2, 4]
    pool.check_invariants()


def test_bad_arguments():
    with pytest.raises(ValueError):
        BlockPool(4, block_size=0)
    pool = BlockPool(2)
    with pytest.raises(ValueError):
        pool.grow(-1)
    with pytest.raises(ValueError):
        pool.shrink(-1)


_ops = st.lists(
    st.one_of(
        st.tuples(st.just("alloc"), st.integers(0, 5), st.integers(1, 40)),
        st.tuples(st.just("append"), st.integers(0, 5), st.just(0)),
        st.tuples(st.just("free"), st.integers(0, 5), st.just(0)),
        st.tuples(st.just("grow"), st.just(0), st.integers(0, 6)),
        st.tuples(st.just("shrink"), st.just(0), st.integers(0, 6)),
        st.tuples(st.just("compact"), st.just(0), st.just(0)),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(initial=st.integers(0, 12), block_size=st.integers(1, 8), ops=_ops)
def test_random_operations_never_double_allocate(initial, block_size, ops):
    pool = BlockPool(initial, block_size=block_size)
    for op, seq, n in ops:
        if op == "alloc":
            want = pool.num_tokens(seq) + n
            if pool.can_allocate(seq, want):
                pool.allocate(seq, want)
            else:
                with pytest.raises(BlockPoolError):
                    pool.allocate(seq, want)
        elif op == "append":
            if pool.can_allocate(seq, pool.num_tokens(seq) + 1):
                pool.append_slot(seq)
        elif op == "free":
            pool.free(seq)
        elif op == "grow":
            limit = pool.id_limit_after_grow(n)
            pool.grow(n)
            assert pool.id_limit == limit
        elif op == "shrink":
            before_used = {s: pool.block_table(s) for s in range(6)}
            if n <= pool.num_free:
                pool.shrink(n)
            else:
                with pytest.raises(BlockPoolError):
                    pool.shrink(n)
            assert {s: pool.block_table(s) for s in range(6)} == before_used  # live blocks never move
        else:
            before = {s: pool.block_table(s) for s in range(6)}
            moves = dict(pool.compact())
            after = {s: pool.block_table(s) for s in range(6)}
            for s in range(6):  # each moved block is reported, others unchanged
                assert after[s] == [moves.get(b, b) for b in before[s]]
            assert pool.hole_blocks == 0 and pool.id_limit == pool.capacity
        pool.check_invariants()
        live = [b for s in range(6) for b in pool.block_table(s)]
        assert len(live) == len(set(live)) == pool.num_used
        assert all(0 <= b < pool.id_limit for b in live)
        assert all(pool.num_blocks_of(s) == pool.blocks_for(pool.num_tokens(s)) for s in range(6))
