"""BlockTables (pwruntime.block_tables): a runner's persistent copy of a pool's block tables reads, after any sequence
of pool changes, what the pool's own tables hold, and the step inputs built from it equal those built from the lists."""
import random

import numpy as np
import pytest

from policies.kv_blocks import NULL_BLOCK, BlockPool
from policies.kv_groups import GroupedBlockPool, KVGroup, KVLayout
from pwruntime.block_tables import BlockTables, TableRows
from pwruntime.model.attention_plan import batch_metadata, table_metadata

LAYOUT = KVLayout((KVGroup((0,), 4), KVGroup((1,), 4, 10), KVGroup((2,), 8)), 64)


def _pool(hybrid: bool, pages: int) -> BlockPool | GroupedBlockPool:
    return GroupedBlockPool(LAYOUT, pages, prefix_caching=True) if hybrid else BlockPool(pages, 4, prefix_caching=True)


def _tables(pool, seq_id) -> list[list[int]]:
    if isinstance(pool, GroupedBlockPool):
        return [pool.group_table(seq_id, g) for g in range(len(LAYOUT.groups))]
    return [pool.block_table(seq_id)]


def _check(tables: BlockTables, pool, seqs: list) -> None:
    """Every group's rows of `seqs` equal the pool's tables, but where the pool released an entry (NULL there): nothing
    reads those (the readers start at a row's window), and the copy may keep the old id; past a table, NULL."""
    for g, rows in enumerate(tables.batch(pool, seqs)):
        assert len(rows) == len(seqs)
        for i, s in enumerate(seqs):
            want = _tables(pool, s)[g]
            assert rows.lengths[i] == len(want)
            got = rows.ids[rows.index[i]]
            assert all(w == NULL_BLOCK or w == b for w, b in zip(want, got.tolist()))
            assert (got[len(want):] == NULL_BLOCK).all()


@pytest.mark.parametrize("hybrid", [False, True])
def test_the_copy_follows_growth_frees_reallocations_releases_and_compaction(hybrid):
    rng = random.Random(7 if hybrid else 3)
    pool = _pool(hybrid, 600)
    tables = BlockTables(len(LAYOUT.groups) if hybrid else 1, rows=2, width=2)   # both grow on the way
    live: dict[int, int] = {}
    next_id, compactions = 0, 0
    for step in range(400):
        op = rng.random()
        if op < 0.15 or not live:                     # a new sequence
            n = rng.randint(1, 40)
            if pool.can_allocate(next_id, n):
                pool.allocate(next_id, n)
                live[next_id] = n
            next_id += 1
        elif op < 0.25 or pool.num_free < 20:         # one finishes, or is preempted and comes back from scratch
            s = rng.choice(list(live))
            pool.free(s)
            if rng.random() < 0.5 and pool.can_allocate(s, live[s]):
                pool.allocate(s, live[s])
            else:
                del live[s]
        elif op < 0.3 and pool.hole_blocks == 0 and pool.num_free:   # a shrink leaves holes, compaction moves blocks
            pool.shrink(min(pool.num_free, rng.randint(1, 30)))
            if pool.compact():
                compactions += 1
            pool.grow(rng.randint(0, 30))
        else:                                         # running sequences grow (a decode step or a chunk)
            for s in list(live):
                n = live[s] + rng.choice([1, 1, 1, 9])
                if pool.try_allocate(s, n):
                    live[s] = n
        batch = rng.sample(list(live), min(len(live), rng.randint(1, 6))) if live else []
        _check(tables, pool, batch)
    assert compactions and pool.rewrites == compactions and tables.rows > 2


def test_rows_of_sequences_outside_the_batch_are_let_go_before_the_rows_grow():
    pool = BlockPool(100, 4)
    for s in range(6):
        pool.allocate(s, 4 * (s + 1))
    tables = BlockTables(1, rows=4, width=8)
    tables.batch(pool, [0, 1, 2, 3])
    tables.batch(pool, [4, 5])          # rows of 0-3 go to 4 and 5
    assert tables.rows == 4
    tables.batch(pool, [0, 1, 2, 3, 4])   # five at once: the rows double
    assert tables.rows == 8
    _check(tables, pool, [5, 4, 3, 2, 1, 0])


def test_metadata_from_the_copy_equals_metadata_from_the_lists():
    """A mixed batch over a hybrid pool: each group's `table_metadata` from a BlockTables equals `batch_metadata` of the
    pool's lists, its sliding group's entries before each window NULL in both."""
    pool = GroupedBlockPool(LAYOUT, 500)
    shape = [(30, 1), (57, 1), (12, 9), (0, 20)]
    for s, (ctx, new) in enumerate(shape):
        pool.allocate(s, ctx)
        pool.allocate(s, ctx + new)
    tables = BlockTables(len(LAYOUT.groups))
    ctx, new = [c for c, _ in shape], [q for _, q in shape]
    for g, rows in enumerate(tables.batch(pool, list(range(4)))):
        group = LAYOUT.groups[g]
        got = table_metadata(ctx, new, rows, group.block_size, window=group.window)
        want = batch_metadata([(c, q, pool.group_table(s, g)) for s, (c, q) in enumerate(shape)], group.block_size,
                              window=group.window)
        assert np.array_equal(got.host_tables.numpy(), want.host_tables.numpy())
        assert got.slot_mapping.tolist() == want.slot_mapping.tolist()
    with pytest.raises(ValueError, match="cannot hold"):
        table_metadata([40], [1], TableRows.of([[1, 2]]), 4)


def test_rows_without_a_block_yet_are_one_null_entry_wide_and_every_reader_takes_them():
    """Tables given as lists that are all empty still make rows of width 1 (NULL): placing them leaves the callers'
    fill as it is, and their metadata is a NULL table, where a zero-width array could not be gathered from."""
    from pwruntime.model.attention_plan import place_block_tables
    rows = TableRows.of([[], []])
    assert rows.ids.shape == (2, 1) and (rows.ids == NULL_BLOCK).all() and rows.max_blocks == 0
    out = np.full((2, 3), 5, np.int32)
    place_block_tables(rows, out, 4, None, np.zeros(2, np.int64))
    assert (out == 5).all()
    assert table_metadata([0, 0], [0, 0], rows, 4).host_tables.tolist() == [[NULL_BLOCK], [NULL_BLOCK]]


def test_a_pool_of_other_groups_is_refused():
    with pytest.raises(ValueError, match="KV groups"):
        BlockTables(2).batch(BlockPool(10, 4), [0])


@pytest.mark.parametrize("rows, width", [(0, 64), (8, 0)])
def test_tables_that_could_never_grow_are_refused(rows, width):
    with pytest.raises(ValueError, match="at least one row and one entry wide"):
        BlockTables(1, rows=rows, width=width)
