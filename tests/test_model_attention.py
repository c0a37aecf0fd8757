"""Paged KV cache tensors and the pure-torch reference paged attention (GQA, block tables, windows)."""
from __future__ import annotations

import math
import random

import pytest
import torch

from policies.kv_groups import KVLayout
from pwruntime.kv_cache import KVCache
from pwruntime.model.attention import paged_attention
from pwruntime.model.attention_plan import AttentionPlan, VarlenChunks, batch_metadata, prefill_metadata


def test_kv_cache_resize_keeps_low_blocks_and_counts_bytes():
    kv = KVCache(num_layers=3, num_blocks=4, block_size=2, num_kv_heads=2, head_dim=8, dtype=torch.float16)
    assert kv.k[0].shape == (4, 2, 2, 8) and len(kv.v) == 3
    for i in range(3):
        kv.k[i].normal_()
        kv.v[i].normal_()
    before_k, before_v = [t.clone() for t in kv.k], [t.clone() for t in kv.v]
    kv.resize(7)
    assert kv.num_blocks == 7 and kv.k[2].shape[0] == 7
    assert torch.equal(kv.k[1][:4], before_k[1]) and torch.equal(kv.v[2][:4], before_v[2])
    assert not kv.k[0][4:].any()
    kv.resize(3)
    assert kv.k[0].shape[0] == 3 and torch.equal(kv.v[0], before_v[0][:3])
    assert KVCache.bytes_per_block(3, 2, 2, 8, torch.float16) == 2 * 3 * 2 * 2 * 8 * 2
    assert kv.nbytes == 3 * KVCache.bytes_per_block(3, 2, 2, 8, torch.float16)
    kv.resize(0)
    assert kv.k[0].shape == (0, 2, 2, 8)
    with pytest.raises(ValueError):
        kv.resize(-1)



def test_kv_cache_refuses_a_single_group_layout_of_other_blocks():
    """A single-group layout sizes pages for its own block size: a cache of another block size over it is refused
    (its blocks would not be the layout's pages), one of the same block size is built."""
    layout = KVLayout.build([2 * 2 * 8 * 4], [None], 8)
    with pytest.raises(ValueError, match="single-group layout"):
        KVCache(1, 4, 4, 2, 8, layout=layout)
    assert KVCache(1, 4, 8, 2, 8, layout=layout).k[0].shape == (4, 8, 2, 8)

def test_kv_cache_layers_of_their_own_shapes():
    """Layers of two geometries (Gemma 4's sliding and global layers): each layer's tensors have its shape, a block's
    bytes are the sum over layers, and resizes keep every layer's low blocks."""
    shapes = ((2, 8), (1, 16))
    kv = KVCache(2, 4, 2, 2, 8, torch.float32, layer_shapes=shapes)
    assert kv.k[0].shape == (4, 2, 2, 8) and kv.v[1].shape == (4, 2, 1, 16)
    assert KVCache.bytes_per_block(2, 2, 2, 8, torch.float32, shapes) == 2 * 2 * 4 * (16 + 16)
    assert kv.nbytes == 4 * KVCache.bytes_per_block(2, 2, 2, 8, torch.float32, shapes)
    for t in kv.k + kv.v:
        t.normal_()
    before = [t.clone() for t in kv.k + kv.v]
    kv.resize(6)
    assert kv.v[1].shape == (6, 2, 1, 16) and all(torch.equal(t[:4], b) for t, b in zip(kv.k + kv.v, before))
    with pytest.raises(ValueError, match="3 layer shapes for 2 layers"):
        KVCache(2, 4, 2, 2, 8, layer_shapes=shapes + ((1, 1),))


def _naive(q_tok, keys, values, q_pos, scale, window):
    """One query token against its sequence's keys [L, kvh, d] (positions 0..L-1)."""
    heads, kvh = q_tok.shape[0], keys.shape[1]
    out = torch.empty_like(q_tok)
    for h in range(heads):
        kh = keys[:, h // (heads // kvh)]
        vh = values[:, h // (heads // kvh)]
        s = (kh @ q_tok[h]) * scale
        pos = torch.arange(keys.shape[0])
        ok = pos <= q_pos
        if window is not None:
            ok &= pos > q_pos - window
        s[~ok] = -math.inf
        out[h] = torch.softmax(s, 0) @ vh
    return out


@pytest.mark.parametrize("window", [None, 5])
def test_paged_attention_matches_naive_over_mixed_batch(window):
    g = torch.Generator().manual_seed(1)
    rng = random.Random(1)
    bs, heads, kvh, d, n_blocks = 4, 6, 2, 8, 40
    k_cache = torch.zeros(n_blocks, bs, kvh, d)
    v_cache = torch.zeros(n_blocks, bs, kvh, d)
    free = list(range(n_blocks))
    rng.shuffle(free)
    # (context_len, query_len): decodes, a chunk with context, a plain prefill, another decode
    shapes = [(9, 1), (5, 6), (0, 7), (13, 1), (0, 1)]
    seqs, full_k, full_v = [], [], []
    for ctx, ql in shapes:
        blocks = [free.pop() for _ in range(-(-(ctx + ql) // bs))]
        ks, vs = torch.randn(ctx + ql, kvh, d, generator=g), torch.randn(ctx + ql, kvh, d, generator=g)
        for p in range(ctx):        # the cached context
            k_cache[blocks[p // bs], p % bs] = ks[p]
            v_cache[blocks[p // bs], p % bs] = vs[p]
        seqs.append((ctx, ql, blocks))
        full_k.append(ks)
        full_v.append(vs)
    meta = batch_metadata(seqs, bs)
    new_k = torch.cat([k[c:] for k, (c, _, _) in zip(full_k, seqs)])
    new_v = torch.cat([v[c:] for v, (c, _, _) in zip(full_v, seqs)])
    plan = AttentionPlan.build(meta, bs, torch.device("cpu"))
    k_cache.view(-1, kvh, d).index_copy_(0, plan.slot_mapping, new_k)
    v_cache.view(-1, kvh, d).index_copy_(0, plan.slot_mapping, new_v)
    q = torch.randn(meta.num_tokens, heads, d, generator=g)
    scale = d ** -0.5
    got = paged_attention(q, new_k, new_v, k_cache, v_cache, plan, scale, window)
    t = 0
    for (ctx, ql, _), ks, vs in zip(seqs, full_k, full_v):
        for i in range(ql):
            ref = _naive(q[t], ks[:ctx + i + 1], vs[:ctx + i + 1], ctx + i, scale, window)
            assert torch.allclose(got[t], ref, atol=1e-5), (ctx, ql, i)
            t += 1


def test_varlen_chunks_list_each_chunks_rows_and_key_slots():
    """The chunks (query length > 1) of a batch as one flash-attention call: their rows, each one's keys (context
    then new tokens) as cache slots, the cumulative lengths; decode rows are left out."""
    meta = batch_metadata([(5, 1, [0, 1]), (6, 3, [2, 3, 4]), (0, 4, [5]), (9, 1, [6, 7, 8])], 4)
    v = VarlenChunks.build(meta, 4, torch.device("cpu"))
    assert v.rows.tolist() == [1, 2, 3, 4, 5, 6, 7]
    assert v.key_slots.tolist() == [8, 9, 10, 11, 12, 13, 14, 15, 16] + [20, 21, 22, 23]
    assert v.cu_q.tolist() == [0, 3, 7] and v.cu_k.tolist() == [0, 9, 13] and v.cu_q.dtype == torch.int32
    assert (v.max_q, v.max_k) == (4, 9)
    # a sliding window of 3: the chunk after 6 tokens of context gathers keys from position 4 (what its first query,
    # at position 6, sees); the plain prefill all of its own
    w = VarlenChunks.build(meta, 4, torch.device("cpu"), window=3)
    assert w.rows.tolist() == v.rows.tolist() and w.cu_q.tolist() == v.cu_q.tolist()
    assert w.key_slots.tolist() == [12, 13, 14, 15, 16] + [20, 21, 22, 23]
    assert w.cu_k.tolist() == [0, 5, 9] and (w.max_q, w.max_k) == (4, 5)
    assert VarlenChunks.build(meta, 4, torch.device("cpu"), window=100).key_slots.tolist() == v.key_slots.tolist()
    assert VarlenChunks.build(batch_metadata([(5, 1, [0, 1])], 4), 4, torch.device("cpu")) is None
    assert not VarlenChunks.applies(torch.zeros(3, 2, 8))     # CPU: the groups' path
    bad = batch_metadata([(6, 2, [7, 3])], 4)
    bad.host_tables[0, 1] = -1
    with pytest.raises(ValueError, match="block table"):
        VarlenChunks.build(bad, 4, torch.device("cpu"))


def test_a_sliding_group_s_released_blocks_are_never_gathered():
    """A hybrid KV group's table (policies.kv_groups) with the block before the window released (NULL): the chunk
    after 6 tokens, window 3, gathers keys from position 4 on, so block 0 is not needed; with the window forgotten it
    would be, and the table is refused rather than read. Its plan (built with the group's window) gathers as the chunk
    does, on the reference's path too."""
    meta = batch_metadata([(6, 3, [-1, 3, 4])], 4)
    w = VarlenChunks.build(meta, 4, torch.device("cpu"), window=3)
    assert w.key_slots.tolist() == [12, 13, 14, 15, 16]
    with pytest.raises(ValueError, match="block table"):
        VarlenChunks.build(meta, 4, torch.device("cpu"))
    plan = AttentionPlan.build(meta, 4, torch.device("cpu"), torch.float32, window=3)
    (group,) = plan.chunk_groups
    assert group.key_blocks.tolist() == [[0, 3, 4]]
    assert group.key_valid[0].tolist() == [False] * 4 + [True] * 5 + [False] * 3
    with pytest.raises(ValueError, match="block table"):
        AttentionPlan.build(meta, 4, torch.device("cpu"), torch.float32)


def _same_tensors(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_groups_of_a_kind_build_together_what_each_builds_alone():
    """Hybrid groups of one block size and window over one batch (their tables differ only in block ids) build their
    plans together (`build_all`: the rows and lengths once, each input in one copy) exactly as each alone: slot
    mappings, decode batches, flash chunks and the reference's groups. Metadata of two batches is refused."""
    shape = [(5, 1), (6, 3), (0, 4), (9, 1)]
    metas = [batch_metadata([(c, q, [10 * g + 3 * i + b for b in range(-(-(c + q) // 4))])
                             for i, (c, q) in enumerate(shape)], 4) for g in range(3)]
    cpu = torch.device("cpu")
    together = VarlenChunks.build_all(metas, 4, cpu, window=3)
    for meta, chunks in zip(metas, together):
        alone = VarlenChunks.build(meta, 4, cpu, window=3)
        assert _same_tensors((chunks.rows, chunks.key_slots, chunks.cu_q, chunks.cu_k),
                             (alone.rows, alone.key_slots, alone.cu_q, alone.cu_k))
        assert (chunks.max_q, chunks.max_k) == (alone.max_q, alone.max_k)
    assert not torch.equal(together[0].key_slots, together[1].key_slots)   # each group's own blocks
    plans = AttentionPlan.build_all(metas, 4, cpu, torch.float32, window=3)
    for meta, plan in zip(metas, plans):
        alone = AttentionPlan.build(meta, 4, cpu, torch.float32, window=3)
        assert torch.equal(plan.slot_mapping, alone.slot_mapping) and plan.window == 3
        d, e = plan.decode, alone.decode
        assert _same_tensors((d.block_tables, d.seq_lens, d.rows), (e.block_tables, e.seq_lens, e.rows))
        for g, h in zip(plan.groups, alone.groups, strict=True):
            assert type(g) is type(h)
            if hasattr(g, "key_blocks"):
                assert _same_tensors((g.token_idx, g.key_blocks, g.key_valid, g.q_pos), (h.token_idx, h.key_blocks,
                                                                                       h.key_valid, h.q_pos))
    decode_only = [batch_metadata([(c, 1, [g, g + 3, g + 6])], 4) for c, g in ((7, 0), (7, 1))]
    plans = AttentionPlan.build_all(decode_only, 4, cpu, torch.float32)
    assert [p.decode.block_tables.tolist() for p in plans] == [[[0, 3, 6]], [[1, 4, 7]]]
    assert all(p.decode.seq_lens.tolist() == [8] and p.decode.rows is None for p in plans)
    with pytest.raises(ValueError, match="one batch"):
        AttentionPlan.build_all([metas[0], batch_metadata([(5, 1, [0, 1])], 4)], 4, cpu)



def test_plans_built_together_refuse_metadata_of_other_context_lengths():
    """`build_all` shares one batch's rows and lengths among its groups: metadata with the same query lengths but
    other context lengths (another batch) are refused, not planned with the first one's lengths."""
    cpu = torch.device("cpu")
    a = batch_metadata([(5, 3, [0, 1]), (2, 1, [2])], 4)
    b = batch_metadata([(4, 3, [3, 4]), (2, 1, [5])], 4)
    with pytest.raises(ValueError, match="one batch"):
        AttentionPlan.build_all([a, b], 4, cpu, torch.float32)

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads,kvh,d", [(8, 2, 64), (16, 4, 128), (4, 4, 32)])
@pytest.mark.parametrize("window", [None, 20])
def test_cuda_chunks_through_flash_attention_match_the_reference(dtype, heads, kvh, d, window):
    """On CUDA a batch's chunks (plain prefills, chunks after their cached context) run in one varlen flash-attention
    call; beside decode rows through the decode kernel, every row equals the fp32 group reference, under a sliding
    window too (flash attention's left window, the decode kernel's own)."""
    g = torch.Generator().manual_seed(heads + d)
    bs, n_blocks = 16, 64
    shapes = [(30, 1), (40, 57), (0, 100), (3, 1), (0, 2), (17, 33)]
    caches = [torch.randn(n_blocks, bs, kvh, d, generator=g) for _ in range(2)]
    blocks, seqs = list(range(n_blocks)), []
    random.Random(3).shuffle(blocks)
    for ctx, ql in shapes:
        seqs.append((ctx, ql, [blocks.pop() for _ in range(-(-(ctx + ql) // bs))]))
    meta = batch_metadata(seqs, bs)
    new = [torch.randn(meta.num_tokens, kvh, d, generator=g) for _ in range(2)]
    q = torch.randn(meta.num_tokens, heads, d, generator=g)
    ref_plan = AttentionPlan.build(meta, bs, torch.device("cpu"))
    for c, t in zip(caches, new):
        c.view(-1, kvh, d).index_copy_(0, ref_plan.slot_mapping, t)
    want = paged_attention(q, *new, *caches, ref_plan, d ** -0.5, window)
    plan = AttentionPlan.build(batch_metadata(seqs, bs, "cuda"), bs, torch.device("cuda"), dtype)
    got = paged_attention(q.to("cuda", dtype), *(t.to("cuda", dtype) for t in new),
                          *(c.to("cuda", dtype) for c in caches), plan, d ** -0.5, window)
    assert set(plan.varlens) == {None, window} and "chunk_groups" not in plan.__dict__
    err = (got.float().cpu() - want).norm() / want.norm()
    assert err < (3e-3 if dtype == torch.float16 else 2e-2)


@pytest.mark.gpu
def test_a_cuda_plan_builds_what_its_layers_read_and_nothing_else():
    """A plan's layers (`reads`: window, head size) decide what it builds at once: flash attention's chunks for each
    window read with heads it takes, the reference's groups only where some layer's heads it does not take (Gemma 4's
    512-wide global heads), so a hybrid cache's global group builds no chunks it never reads."""
    seqs = [(20, 1, list(range(6))), (8, 12, list(range(6, 11)))]   # a decode row, a chunk after its context
    meta = batch_metadata(seqs, 4, "cuda")

    def built(reads):
        plan = AttentionPlan.build(meta, 4, torch.device("cuda"), torch.bfloat16, reads=reads)
        return set(plan.varlens), "chunk_groups" in plan.__dict__

    assert built(()) == ({None}, False)                      # one layer of the plan's window (None), heads it takes
    assert built([(16, 256), (16, 256)]) == ({16}, False)
    assert built([(16, 256), (None, 512)]) == ({16}, True)   # one table for Gemma 4's sliding and global layers
    assert built([(None, 512)]) == (set(), True)             # a hybrid cache's global group


def test_metadata_helpers_and_table_checks():
    meta = prefill_metadata(10, 4)
    assert meta.query_lens == [10] and meta.context_lens == [0]
    assert meta.block_tables.tolist() == [[0, 1, 2]] and meta.block_tables.dtype == torch.int32
    assert meta.slot_mapping.tolist() == list(range(10))
    meta = batch_metadata([(5, 2, [7, 3]), (0, 1, [1])], 4)
    assert meta.block_tables.tolist() == [[7, 3], [1, -1]]
    assert meta.slot_mapping.tolist() == [3 * 4 + 1, 3 * 4 + 2, 4]
    with pytest.raises(ValueError):
        batch_metadata([(5, 4, [7, 3])], 4)         # 9 tokens do not fit 2 blocks of 4
    bad = batch_metadata([(6, 1, [7, 3])], 4)
    bad.block_tables[0, 1] = -1                     # a needed block missing from the table
    with pytest.raises(ValueError):
        AttentionPlan.build(bad, 4, torch.device("cpu"))


def test_batch_metadata_equals_a_per_token_reference_over_random_batches():
    """With a sliding `window` a sequence's entries before the block of its first query's earliest key (position
    context - window + 1) are NULL (-1), whatever the table holds there; the rest and the slots as without one."""
    rng = random.Random(0)
    for trial in range(200):
        bs, seqs, window = rng.choice([1, 4, 16]), [], rng.choice([None, 1, 5, 24])
        for _ in range(rng.randint(1, 9)):
            ctx, qlen = rng.randint(0, 40), rng.randint(0, 20)        # sequences without new tokens too
            seqs.append((ctx, qlen, rng.sample(range(500), -(-(ctx + qlen) // bs) + rng.randint(0, 2))))
        meta = batch_metadata(seqs, bs, window=window)
        width = max(len(b) for _, _, b in seqs)
        first = [max(c - window + 1, 0) // bs if window else 0 for c, _, _ in seqs]
        assert meta.block_tables.dtype == torch.int32 and meta.slot_mapping.dtype == torch.int64
        assert meta.block_tables.tolist() == [[-1] * f + b[f:] + [-1] * (width - len(b))
                                              for f, (_, _, b) in zip(first, seqs)], trial
        assert meta.slot_mapping.tolist() == [b[p // bs] * bs + p % bs for c, q, b in seqs for p in range(c, c + q)]
        assert meta.query_lens == [q for _, q, _ in seqs] and meta.context_lens == [c for c, _, _ in seqs]
    with pytest.raises(ValueError, match="sequence 1: 1 blocks of 4 cannot hold 13 tokens"):
        batch_metadata([(5, 1, [0, 1]), (10, 3, [2])], 4)
