"""KV-cache groups (policies.kv_groups): the split of a model's layers into block tables, and what a sequence holds."""
import random

import pytest

from policies.kv_blocks import NULL_BLOCK, BlockPool, BlockPoolError
from policies.kv_groups import GroupedBlockPool, KVGroup, KVLayout
from traces.model_card import load_card


def test_gemma_4_splits_into_five_sliding_groups_and_one_global_group():
    card = load_card("gemma-4-26b-a4b")
    layout = card.kv_layout(16)
    assert layout.hybrid and layout.layers_per_group == 5 and len(layout.groups) == 6
    sliding, full = layout.groups[:5], layout.groups[5]
    assert [g.layers for g in sliding] == [tuple(range(a, a + 5)) for a in (0, 6, 12, 18, 24)]
    assert all(g.block_size == 16 and g.window == 1024 for g in sliding)
    assert full.layers == (5, 11, 17, 23, 29) and full.block_size == 32 and full.window is None
    # every layer once, and every layer's share of a page the same bytes (16 x 8 KiB = 32 x 4 KiB)
    assert sorted(l for g in layout.groups for l in g.layers) == list(range(card.layers))
    shares = {g.block_size * 2 * kvh * hd * 2 for g in layout.groups
              for hd, kvh, _ in map(card.attention_geometry, g.layers)}
    assert shares == {128 << 10} and layout.page_bytes == 5 * (128 << 10)


@pytest.mark.parametrize("name", ["olmoe-1b-7b-0924", "qwen3-30b-a3b", "mixtral-8x7b-v0.1", "pagedweight-demo"])
def test_models_without_windows_keep_one_table(name):
    card = load_card(name)
    layout = card.kv_layout(16)
    assert layout == card.kv_layout(16, hybrid=False) and not layout.hybrid
    assert layout.page_bytes == 16 * card.kv_bytes_per_token()
    assert [layout.pages(s, e) for s, e in ((0, 0), (0, 1), (5, 16), (16, 17), (100, 1000))] == [0, 1, 1, 2, 63]


def test_gemma_4_holds_what_its_windows_read_within_a_block_a_group():
    """A decode step's pages against the card's exact bytes (sliding layers keep `window` tokens): never less, at most
    two blocks a group more (a partial block at each end); one table would hold every token of every layer."""
    card = load_card("gemma-4-26b-a4b")
    layout, single = card.kv_layout(16), card.kv_layout(16, hybrid=False)
    for context in (1, 100, 1023, 1024, 1025, 2048, 8191, 32768):
        held, exact = layout.bytes_held(context, context + 1), card.kv_bytes(context + 1)
        assert exact <= held <= exact + 2 * len(layout.groups) * layout.page_bytes, context
        assert held <= single.bytes_held(context, context + 1) + layout.page_bytes   # the global group's 32-token block
    saved = 1 - layout.bytes_held(32768, 32769) / single.bytes_held(32768, 32769)
    assert 0.87 < saved < 0.89


def test_blocks_held_are_exactly_those_a_chunk_reads():
    rng = random.Random(0)
    for _ in range(400):
        bs, window = rng.choice((1, 2, 4, 16)), rng.choice((None, 1, 3, 8, 40))
        start = rng.randrange(0, 120)
        end = start + rng.randrange(0, 50)
        group = KVGroup((0,), bs, window)
        read = {k // bs for p in range(start, end)
                for k in range(0 if window is None else max(0, p - window + 1), p + 1)}
        first, last = group.blocks_held(start, end)
        if read:
            assert (first, last) == (min(read), max(read) + 1), (bs, window, start, end)
            assert read == set(range(first, last))   # contiguous: nothing inside the range is free to go


def test_layouts_that_cannot_split_evenly_fall_back_to_one_table():
    # a kind whose block would not be a whole number of tokens
    assert not KVLayout.build([3000, 7000], [512, None], 16).hybrid   # 16 x 7000 / 3000 tokens
    assert KVLayout.build([3000, 2000], [512, None], 16).groups[1].block_size == 24
    # windows everywhere alike, or none: nothing to split
    assert not KVLayout.build([64, 64, 64], [None, None, None], 16).hybrid
    assert not KVLayout.build([64, 64], [8, 8], 16).hybrid
    assert not KVLayout.build([64, 32], [None, None], 16).hybrid   # two shapes, but no window
    assert KVLayout.build([64], [None], 1).page_bytes == 64 and KVLayout.build([1], [None], 16).page_bytes == 16
    # a gcd of 1: groups of one layer; layers of two shapes and two windows
    layout = KVLayout.build([64, 64, 64, 32], [8, 8, 8, None], 4)
    assert [(g.layers, g.block_size, g.window) for g in layout.groups] == [
        ((0,), 4, 8), ((1,), 4, 8), ((2,), 4, 8), ((3,), 8, None)]
    assert layout.page_bytes == 4 * 64


def test_groups_take_the_greatest_common_divisor_of_the_kinds_layer_counts():
    """6 sliding layers and 4 global ones: groups of 2 (not 4, which would leave a sliding group of 2 beside 4s)."""
    layout = KVLayout.build([64] * 6 + [32] * 4, [8] * 6 + [None] * 4, 4)
    assert [g.layers for g in layout.groups] == [(0, 1), (2, 3), (4, 5), (6, 7), (8, 9)]
    assert layout.layers_per_group == 2 and layout.page_bytes == 2 * 4 * 64


@pytest.mark.parametrize("args", [([], [], 16), ([64], [None, None], 16), ([64], [None], 0), ([0], [None], 16),
                                  ([0, 64], [None, None], 16)])
def test_bad_layouts_are_refused(args):
    with pytest.raises(ValueError):
        KVLayout.build(*args)


def test_pages_refuses_a_backward_range():
    layout = KVLayout.build([64, 32], [8, None], 4)
    with pytest.raises(ValueError):
        layout.pages(5, 4)
    # the sliding layer (4-token blocks) holds from the block of p - 7, the full one (8-token blocks) everything
    assert [layout.pages(s, e) for s, e in ((0, 9), (0, 20), (20, 21), (40, 48))] == [
        3 + 2, 5 + 3, 3 + 3, 4 + 6]


# ---------------------------------------------------------------- BlockPool.release_leading
def test_release_leading_frees_the_front_of_a_table_and_keeps_positions():
    pool = BlockPool(8, block_size=2)
    pool.allocate("a", 9)                                  # 5 blocks
    table = pool.block_table("a")
    assert pool.release_leading("a", 2) == 2 and pool.num_free == 5
    assert pool.block_table("a") == [NULL_BLOCK, NULL_BLOCK] + table[2:]
    assert pool.num_blocks_of("a") == 3 and pool.slot("a", 8) == table[4] * 2
    assert pool.release_leading("a", 1) == 0 and pool.release_leading("a", 3) == 1   # only what is not released yet
    pool.check_invariants()
    # the freed blocks are taken again; compaction moves live entries only; free counts what was held
    pool.allocate("b", 6)
    assert set(pool.block_table("b")) & set(table[:3])
    pool.shrink(1)
    pool.compact()
    pool.check_invariants()
    assert pool.block_table("a")[:3] == [NULL_BLOCK] * 3
    assert pool.free("a") == 2 and pool.free("b") == 3
    pool.check_invariants()
    assert pool.num_free == pool.capacity


def test_a_released_block_stays_cached_and_a_shared_one_stays_held():
    """With prefix caching a released registered block becomes a cached free block (still matchable until evicted),
    and one another table shares stays in use."""
    pool = BlockPool(6, block_size=2, prefix_caching=True)
    tokens = [5, 6, 7, 8, 9]
    pool.allocate("a", 5)
    assert pool.register("a", tokens, 4) == 2
    first, second = pool.block_table("a")[:2]
    pool.allocate("b", 5, pool.match_prefix(tokens[:4]))   # b shares both full blocks
    assert pool.release_leading("a", 2) == 2 and pool.ref_count(first) == 1 and pool.num_free == 2
    pool.check_invariants()
    assert pool.release_leading("b", 1) == 1 and pool.ref_count(first) == 0 and pool.num_free == 3
    assert pool.is_cached(first) and pool.match_prefix(tokens[:4]) == [first, second]
    pool.check_invariants()
    assert pool.free("a") == 1 and pool.free("b") == 2 and pool.num_free == 6 and pool.is_cached(second)


# ---------------------------------------------------------------- GroupedBlockPool
def _gemma_like() -> KVLayout:
    """Three sliding layers (window 8, 4-token blocks) and one full layer of half the bytes (8-token blocks)."""
    return KVLayout.build([64, 64, 64, 32], [8, 8, 8, None], 4)


def test_grouped_pool_holds_each_group_s_window_and_hands_back_the_rest():
    layout = _gemma_like()
    pool = GroupedBlockPool(layout, 64)
    assert pool.blocks_needed("a", 10) == 3 * 3 + 2 == layout.pages(0, 10)
    pool.allocate("a", 10)                                   # a 10-token prompt
    assert pool.num_blocks_of("a") == 11 and pool.num_free == 53
    for step in range(10, 40):                               # then decode: query at `step` reads [step - 7, step]
        assert pool.blocks_needed("a", step + 1) == max(0, layout.pages(step, step + 1) - pool.num_blocks_of("a"))
        assert pool.try_allocate("a", step + 1)
        assert pool.num_blocks_of("a") == layout.pages(step, step + 1)
        pool.check_invariants()
    for g in range(3):                                       # a sliding table: released entries, then the window
        table = pool.group_table("a", g)
        assert table[:8] == [NULL_BLOCK] * 8 and NULL_BLOCK not in table[8:] and len(table) == 10   # keys 32..39
        with pytest.raises(BlockPoolError):
            pool.slot("a", g, 27)                            # left the window
        assert pool.slot("a", g, 39) == table[9] * 4 + 3
    assert NULL_BLOCK not in pool.group_table("a", 3) and len(pool.group_table("a", 3)) == 5
    assert pool.slot("a", 3, 0) == pool.group_table("a", 3)[0] * 8   # the full group holds position 0 still
    for position in (-1, 40):
        with pytest.raises(BlockPoolError, match="not reserved"):
            pool.slot("a", 3, position)
    assert pool.free("a") == 3 * 2 + 5 and pool.num_free == 64
    pool.check_invariants()


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_steps_inside_every_group_s_blocks_and_window_decide_as_the_full_plan_does(monkeypatch, prefix_caching):
    """The shortcut for a step that changes no table (`_quiet_limits`) answers `blocks_needed` and `try_allocate` as
    the plan over every group does: two pools through the same random decode steps, chunks, frees and shortage, one
    of them always planning, hold the same tables and free pages at every step (prefix caching on and off)."""
    layout = _gemma_like()
    fast, full = GroupedBlockPool(layout, 90, prefix_caching), GroupedBlockPool(layout, 90, prefix_caching)
    monkeypatch.setattr(full, "_is_quiet", lambda seq_id, num_tokens: False)
    rng, tokens, quiet, checks = random.Random(11), {}, 0, 0
    for step in range(1500):
        if len(tokens) < 4 and rng.random() < 0.1:
            s, n = step, rng.randint(1, 30)
            assert fast.try_allocate(s, n) == full.try_allocate(s, n)
            if fast.num_tokens(s):
                tokens[s] = n
        for s in list(tokens):
            if rng.random() < 0.01:   # it finishes, or is preempted and computed again from its start
                assert fast.free(s) == full.free(s)
                del tokens[s]
                if rng.random() < 0.5:
                    ok = fast.try_allocate(s, 1)
                    assert ok == full.try_allocate(s, 1)
                    if ok:
                        tokens[s] = 1
                continue
            n = tokens[s] + rng.choice([1, 1, 1, 1, 5])
            quiet, checks = quiet + fast._is_quiet(s, n), checks + 1
            assert fast.blocks_needed(s, n) == full.blocks_needed(s, n)
            ok = fast.try_allocate(s, n)
            assert ok == full.try_allocate(s, n)
            tokens[s] = n if ok else tokens[s]
            assert [fast.group_table(s, g) for g in range(4)] == [full.group_table(s, g) for g in range(4)]
        assert fast.num_free == full.num_free
    fast.check_invariants()
    assert quiet > checks / 10   # the shortcut was taken (its share grows with the blocks: 4 tokens here)


def test_a_table_view_is_the_pool_s_own_and_a_table_a_copy():
    """What a step's inputs read (`group_table_view`, `block_table_view`: no copy) is the table the pool holds: equal
    to the copy, and changed by the pool's next allocation and release, which the copy is not."""
    pool = GroupedBlockPool(_gemma_like(), 64)
    pool.allocate("a", 7)
    view, copy = pool.group_table_view("a", 0), pool.group_table("a", 0)
    assert list(view) == copy == pool.pages.block_table_view(("a", 0))
    assert pool.try_allocate("a", 20) and pool.try_allocate("a", 30)   # grows, then releases what left the window
    assert list(view) == pool.group_table("a", 0) != copy and view[0] == NULL_BLOCK != copy[0]
    assert BlockPool(4, 4).block_table_view("none") == ()


def test_grouped_pool_releases_before_it_takes_so_a_full_pool_still_decodes():
    layout = _gemma_like()
    pool = GroupedBlockPool(layout, layout.pages(0, 16))    # exactly a 16-token prompt's pages
    assert not pool.prefix_caching and pool.can_allocate("a", 16) and not pool.can_allocate("a", 24)
    pool.allocate("a", 16)
    assert pool.num_free == 0
    # token 16 takes a block in each group (4) while the windows let go of blocks 0 and 1 of each sliding group (6):
    # the releases fund the allocation
    assert pool.blocks_needed("a", 17) == 0 and pool.try_allocate("a", 17) and pool.num_free == 2
    pool.check_invariants()
    n = 17
    while pool.try_allocate("a", n + 1):                    # decode until the full group outgrows the pool
        n += 1
        assert pool.num_free == pool.capacity - layout.pages(n - 1, n)
    assert layout.pages(n, n + 1) > pool.capacity and pool.blocks_needed("a", n + 1) > pool.num_free
    with pytest.raises(BlockPoolError):
        pool.allocate("a", n + 1)
    pool.check_invariants()                                 # unchanged by the refusal
    assert pool.num_tokens("a") == n and pool.num_blocks_of("a") == layout.pages(n - 1, n)


def test_grouped_pool_resizes_and_compacts_pages_of_every_group():
    layout = _gemma_like()
    pool = GroupedBlockPool(layout, 40)
    rng = random.Random(3)
    lens = {}   # sequence -> (start, end) of its last allocation
    for step in range(300):
        seq = rng.randrange(6)
        if seq in lens and rng.random() < 0.1:
            pool.free(seq)
            del lens[seq]
        else:
            start = lens.get(seq, (0, 0))[1]
            n = start + rng.choice((1, 1, 1, 5, 13))
            if pool.try_allocate(seq, n):
                lens[seq] = (start, n)
        if step % 25 == 0:
            pool.grow(rng.randrange(0, 6))
            pool.shrink(min(pool.num_free, rng.randrange(0, 6)))
            moves = pool.compact()
            assert all(dst < pool.id_limit <= src or dst < src for src, dst in moves)
        pool.check_invariants()
        assert pool.num_used == sum(pool.num_blocks_of(s) for s in lens)
        assert all(pool.num_blocks_of(s) == layout.pages(*span) for s, span in lens.items())


def test_a_cached_prefix_needs_only_a_sliding_group_s_window():
    """Prefix caching over groups (three sliding groups of 4-token blocks, window 8; a full group of 8-token ones): a
    sequence's blocks are registered once computed; another with the same leading tokens gets the longest prefix every
    group can serve, 16 tokens here (a multiple of 8, below its 23 known tokens): the full group's two blocks, and of
    each sliding group only blocks 2 and 3, what a query at 16 reads; block 0, released before it was registered, is
    not needed. Its sliding tables start NULL; the shared blocks are held twice; what it takes is counted."""
    layout = _gemma_like()
    pool = GroupedBlockPool(layout, 64, prefix_caching=True)
    tokens = list(range(100, 124))
    pool.allocate("a", 12)                                  # computed, not registered yet
    pool.allocate("a", 24)                                  # hands sliding block 0 back (window of position 12)
    assert [pool.group_table("a", g)[0] for g in range(3)] == [NULL_BLOCK] * 3
    assert pool.register("a", tokens, 24) == 3 * 5 + 3 and pool.register("a", tokens, 24) == 0
    assert pool.match_prefix(tokens[:7]) == [] and pool.match_prefix([1] + tokens[1:23]) == []
    hashes: list[bytes] = []
    prefix = pool.match_prefix(tokens[:23], hashes)
    assert prefix.tokens == 16 == pool.prefix_tokens(prefix) and len(hashes) == 5   # 4-token units, as far as known
    a_tables = [pool.group_table("a", g) for g in range(4)]
    assert prefix.tables == tuple((NULL_BLOCK, NULL_BLOCK, *a_tables[g][2:4]) for g in range(3)) + (
        tuple(a_tables[3][:2]),)
    pool.pages.allocate("spare", pool.num_free - 4)          # exactly the pages b needs are free
    assert pool.can_allocate("b", 20, prefix) and pool._prefix_need(prefix, 20) == 3 * 1 + 1   # block 4, block 2
    pool.allocate("b", 20, prefix)
    assert pool.num_free == 0 and pool.pages.ref_count(a_tables[3][0]) == 2
    pool.pages.free("spare")
    assert pool.group_table("b", 0)[:4] == [NULL_BLOCK, NULL_BLOCK, *a_tables[0][2:4]]
    assert pool.slot("b", 0, 17) == pool.group_table("b", 0)[4] * 4 + 1
    pool.check_invariants()
    with pytest.raises(BlockPoolError, match="only a new one"):
        pool.allocate("b", 24, prefix)
    # growing b to 28 tokens releases each sliding group's block 2, which a still holds: it frees nothing, so b needs
    # all 7 new pages, not 7 less the 3 it releases
    pool.pages.allocate("filler", pool.num_free - 5)
    assert pool.blocks_needed("b", 28) == 7 and not pool.can_allocate("b", 28) and not pool.try_allocate("b", 28)
    assert pool.num_tokens("b") == 20 and pool.group_table("b", 0)[2] == a_tables[0][2]   # unchanged
    pool.pages.free("filler")
    assert pool.try_allocate("b", 28) and pool.group_table("b", 0)[:3] == [NULL_BLOCK] * 3
    assert pool.pages.ref_count(a_tables[0][2]) == 1
    pool.check_invariants()
    assert pool.free("a") == 3 * 5 + 3 and pool.free("b") == 3 * 4 + 4 and pool.num_free == pool.capacity
    assert pool.match_prefix(tokens[:23]).tokens == 16     # freed blocks stay cached until evicted
    assert pool.num_cached_blocks == 3 * 5 + 3 == pool.pages.num_cached_blocks   # free, yet a prefix hit's (counted)
    assert GroupedBlockPool(layout, 8).match_prefix(tokens) == []   # caching off




def test_only_computed_blocks_are_registered_and_a_revived_prefix_counts_its_cached_pages():
    """`register` takes the blocks whose tokens are all computed, though more token ids are known; a prefix whose
    blocks are cached but free (their sequence finished) takes those pages back, and the need says so."""
    layout = _gemma_like()
    pool = GroupedBlockPool(layout, 64, prefix_caching=True)
    tokens = list(range(200, 224))
    pool.allocate("a", 12)
    assert pool.register("a", tokens, 12) == 3 * 3 + 1     # sliding blocks 0-2; the full group's block 0 (not 8..15)
    assert pool.match_prefix(tokens).tokens == 8
    pool.allocate("a", 16)
    assert pool.register("a", tokens, 16) == 3 * 1 + 1     # now block 3 of each sliding group, block 1 of the full
    pool.free("a")
    prefix = pool.match_prefix(tokens)
    assert prefix.tokens == 16 and pool.num_free == 64
    need = pool._prefix_need(prefix, 20)
    assert need == 3 * 2 + 2 + 3 * 1 + 1                    # the cached pages revived, then one block a group more
    pool.allocate("b", 20, prefix)
    assert pool.num_free == 64 - need
    pool.check_invariants()


def test_a_sequence_id_freed_and_used_again_registers_its_new_blocks():
    """A preempted sequence comes back under its id; whatever it registered before, its new blocks are registered."""
    pool = GroupedBlockPool(_gemma_like(), 64, prefix_caching=True)
    first, again = list(range(200, 212)), list(range(300, 312))
    pool.allocate("c", 12)
    assert pool.register("c", first, 12) > 0
    pool.free("c")
    pool.allocate("c", 12)
    assert pool.register("c", again, 12) > 0 and pool.match_prefix(again[:9]).tokens == 8
    pool.check_invariants()


def test_a_matched_prefix_is_a_whole_number_of_every_group_s_blocks():
    """A matched prefix ends on a multiple of every group's block size (8 here), whatever bounds it."""
    pool = GroupedBlockPool(KVLayout.build([64, 32], [8, 16], 4), 64, prefix_caching=True)
    tokens = list(range(200, 216))
    pool.allocate("c", 12)
    pool.register("c", tokens, 12)
    assert pool.match_prefix(tokens[:13]).tokens == 8
    # a full-attention group of finer blocks (4 tokens) than the alignment: its cached run of 12 tokens bounds at 8
    pool = GroupedBlockPool(KVLayout.build([32, 64], [8, None], 4), 64, prefix_caching=True)
    pool.allocate("c", 12)
    pool.register("c", tokens, 12)
    assert pool.match_prefix(tokens).tokens == 8


def test_a_prefix_of_one_alignment_unit_is_matched():
    """The shortest prefix every group can serve (one unit of 8 tokens: the blocks' least common multiple) is found,
    as longer ones are."""
    pool = GroupedBlockPool(_gemma_like(), 64, prefix_caching=True)
    tokens = list(range(200, 212))
    pool.allocate("c", 12)
    pool.register("c", tokens, 12)
    assert pool.match_prefix(tokens[:9]).tokens == 8
    assert pool.match_prefix(tokens[:7]) == []
