"""KV-cache groups (policies.kv_groups): the split of a model's layers into block tables, and what a sequence holds."""
import random

import pytest

from policies.kv_groups import KVGroup, KVLayout
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
    # a gcd of 1: groups of one layer; layers of two shapes and two windows
    layout = KVLayout.build([64, 64, 64, 32], [8, 8, 8, None], 4)
    assert [(g.layers, g.block_size, g.window) for g in layout.groups] == [
        ((0,), 4, 8), ((1,), 4, 8), ((2,), 4, 8), ((3,), 8, None)]
    assert layout.page_bytes == 4 * 64


@pytest.mark.parametrize("args", [([], [], 16), ([64], [None, None], 16), ([64], [None], 0), ([0], [None], 16)])
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
