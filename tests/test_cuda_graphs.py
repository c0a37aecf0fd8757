"""Decode steps through captured CUDA graphs (pwruntime.cuda_graphs) and the CUDA decode-attention path.

CPU: bucketing and padding of decode batches, the scratch KV block, when graphs are stale or not
usable, and the attention decode path selection (the CPU reference is unchanged, and the kernel's
arguments are wired right: on CPU the kernel function falls back to its reference).
GPU (`gpu` marker): on the bundled demo model in fp16, with a capturable expert store built here
(experts quantized to AP bit-planes in a DeviceWeightTable, served by kernels.fused_moe): graph
replay equals the eager forward (logits and routing), follows `commit_bits` without recapture, and
KV resizes keep graphs on CUDA (the pointer table) and drop them elsewhere; the engine decodes the same tokens with and without graphs, and runs
eagerly with the (not capturable) dense store.
"""
from __future__ import annotations

from dataclasses import fields, replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from pwruntime.cuda_graphs import GRAPH_SIZES, DecodeGraphs, DecodeInputs, DecodeRows, graph_sizes, padded_size
from pwruntime.kv_cache import KVCache
from pwruntime.model.attention import paged_attention
from pwruntime.model.attention_plan import AttentionPlan, DecodeBatch, batch_metadata
from pwruntime.model.moe_model import pack_routing
from pwruntime.kernels.reference import paged_attention_decode_ref


# ------------------------------------------------------------------ CPU: bucketing and padding
def test_graph_sizes_and_padding_buckets():
    assert graph_sizes(1) == (1,)
    assert graph_sizes(3) == (1, 2, 4)
    assert graph_sizes(32) == (1, 2, 4, 8, 16, 32)
    assert graph_sizes(33) == GRAPH_SIZES == graph_sizes(1000)
    with pytest.raises(ValueError):
        graph_sizes(0)
    sizes = graph_sizes(16)
    assert [padded_size(n, sizes) for n in (1, 2, 3, 5, 8, 9, 16)] == [1, 2, 4, 8, 8, 16, 16]
    assert padded_size(17, sizes) is None


def test_pad_puts_padding_rows_on_the_scratch_block():
    bs, scratch = 4, 9
    rows = DecodeRows([11, 12, 13], [0, 5, 8], [[3], [7, 2], [1, 4, 6]])
    assert len(rows) == 3 and rows.max_blocks == 3
    p = DecodeInputs.pad(rows, 4, 5, bs, scratch)
    assert p.input_ids.tolist() == [11, 12, 13, 0] and p.positions.tolist() == [0, 5, 8, 0]
    assert p.seq_lens.tolist() == [1, 6, 9, 1] and p.seq_lens.dtype == np.int32
    assert p.slot_mapping.tolist() == [3 * bs, 2 * bs + 1, 6 * bs, scratch * bs]
    assert p.block_tables.tolist() == [[3, 9, 9, 9, 9], [7, 2, 9, 9, 9], [1, 4, 6, 9, 9], [9] * 5]
    empty = DecodeInputs.pad(DecodeRows([], [], []), 2, 3, bs, scratch)
    assert empty.slot_mapping.tolist() == [scratch * bs] * 2 and empty.seq_lens.tolist() == [1, 1]
    with pytest.raises(ValueError):
        DecodeInputs.pad(rows, 2, 5, bs, scratch)           # more rows than the graph size
    for window in (None, 4):   # a table wider than the buffer: refused as such, sliding window or not
        with pytest.raises(ValueError, match="do not fit"):
            DecodeInputs.pad(rows, 4, 2, bs, scratch, window=window)
    with pytest.raises(ValueError):
        DecodeInputs.pad(DecodeRows([1], [4], [[3]]), 1, 2, bs, scratch)   # position 4 needs a second block


def test_static_buffers_feed_the_plan_without_copies():
    buf = DecodeInputs.alloc(8, 6, torch.device("cpu"))
    buf.fill_from(DecodeInputs.pad(DecodeRows([5, 6], [3, 17], [[2], [0, 1, 4]]), 4, 6, 8, 7))
    meta = buf.metadata(4)
    assert meta.query_lens == [1] * 4 and meta.num_tokens == 4
    plan = AttentionPlan.build(meta, 8, torch.device("cpu"), torch.float16)
    assert plan.decode is not None
    for got, static in ((plan.decode.seq_lens, buf.seq_lens), (plan.decode.block_tables, buf.block_tables),
                        (plan.slot_mapping, buf.slot_mapping)):
        assert got.data_ptr() == static.data_ptr()      # views of the static buffers, as a graph needs
    assert plan.decode.seq_lens.tolist() == [4, 18, 1, 1]
    assert buf.slot_mapping[:4].tolist() == [2 * 8 + 3, 4 * 8 + 1, 7 * 8, 7 * 8]


def test_pad_into_host_buffers_matches_new_arrays_and_clears_the_last_batch():
    bs, scratch = 4, 9
    host = DecodeInputs.alloc(8, 5, torch.device("cpu"))
    first = DecodeRows([21, 22, 23, 24], [3, 7, 2, 13], [[1], [5, 6], [8], [2, 3, 4, 0]])
    DecodeInputs.pad(first, 8, 5, bs, scratch, out=host)
    rows = DecodeRows([11, 12], [0, 5], [[3], [7, 2]])
    got = DecodeInputs.pad(rows, 4, 5, bs, scratch, out=host)   # the earlier batch's rows 2-3 become padding
    want = DecodeInputs.pad(rows, 4, 5, bs, scratch)
    assert got is host
    for name in DecodeInputs.ARRAYS:
        assert np.array_equal(getattr(host, name)[:4].numpy(), getattr(want, name)), name
    assert host.input_ids[4:].tolist() == [0] * 4 and host.block_tables[3].tolist() == [scratch] * 5
    with pytest.raises(ValueError):
        DecodeInputs.pad(rows, 4, 6, bs, scratch, out=host)          # buffers of another table width


def test_pad_of_a_sliding_window_s_tables_reads_only_what_the_window_reads():
    """With the tables' `window` (a hybrid KV group's) a row's entries before the block that holds its window's first
    key stay on the scratch block, into host buffers as into new arrays; the entries from there on, and the slots,
    are those of the whole table."""
    import random

    rng = random.Random(5)
    bs, window, scratch, width = 4, 10, 99, 16
    positions = [0, 9, 10, 37, 59, 63]
    tables = [[rng.randrange(50) for _ in range(p // bs + 1)] for p in positions]
    rows = DecodeRows(list(range(6)), positions, tables)
    whole = DecodeInputs.pad(rows, 8, width, bs, scratch)
    host = DecodeInputs.alloc(8, width, torch.device("cpu"))
    for windowed in (DecodeInputs.pad(rows, 8, width, bs, scratch, window=window),
                     DecodeInputs.pad(rows, 8, width, bs, scratch, out=host, window=window)):
        got = np.asarray(windowed.block_tables)
        for i, p in enumerate(positions):
            first = max(p - window + 1, 0) // bs
            assert got[i].tolist() == [scratch] * first + tables[i][first:] + [scratch] * (width - len(tables[i]))
        assert [max(p - window + 1, 0) // bs for p in positions] == [0, 0, 0, 7, 12, 13]   # entries left on scratch
        assert np.array_equal(np.asarray(windowed.slot_mapping), whole.slot_mapping)
        assert got[6:].tolist() == whole.block_tables[6:].tolist() == [[scratch] * width] * 2


def test_one_transfer_moves_every_array_up_to_the_batch_rows():
    host, dev = DecodeInputs.alloc(8, 5, torch.device("cpu")), DecodeInputs.alloc(8, 5, torch.device("cpu"))
    assert host.raw.numel() == 8 * (4 * 8 + 4 + 5 * 4)
    for name in DecodeInputs.ARRAYS:      # views of the one buffer
        t = getattr(host, name)
        assert t.untyped_storage().data_ptr() == host.raw.untyped_storage().data_ptr() and t.is_contiguous()
    dev.block_tables.fill_(-1)
    rows = DecodeRows([5, 6, 7], [3, 17, 0], [[2], [0, 1, 4], [6]], token_src=[-1, 2, 0])
    DecodeInputs.pad(rows, 4, 5, 8, 7, out=host)
    dev.fill_from(host, 4)
    assert dev.token_src[:4].tolist() == [-1, 2, 0, -1]       # padding takes no sampled token
    for name in DecodeInputs.ARRAYS:
        assert torch.equal(getattr(dev, name)[:4], getattr(host, name)[:4]), name
    assert dev.block_tables[4:].eq(-1).all()     # the rows past the batch are not sent
    assert dev.slot_mapping[:4].tolist() == [2 * 8 + 3, 4 * 8 + 1, 6 * 8, 7 * 8]


def test_sampled_rows_are_a_view_when_every_row_samples():
    from pwruntime.model_runner import _rows
    h = torch.arange(12.0).reshape(6, 2)
    assert _rows(h, [0, 1, 2]).data_ptr() == h.data_ptr() and _rows(h, [0, 1, 2]).tolist() == h[:3].tolist()
    assert _rows(h, [1, 4]).tolist() == [[2.0, 3.0], [8.0, 9.0]]
    assert _rows(h, []).shape == (0, 2)


def test_routing_reaches_the_host_in_one_copy_bit_for_bit():
    from pwruntime.model.moe_model import LayerRouting
    from pwruntime.model_runner import routing_to_host
    g = torch.Generator().manual_seed(0)
    layers, t, k = 3, 5, 4
    static = [LayerRouting(torch.randint(0, 2 ** 40, (8, k), generator=g), torch.randn(8, k, generator=g),
                           torch.rand(8, generator=g), torch.randn(8, k, generator=g)) for _ in range(layers)]
    rows = [LayerRouting(*(getattr(x, f.name)[:t] for f in fields(x))) for x in static]  # as a graph's real rows
    r = routing_to_host(rows, (2, 3)).arrays()
    assert r.query_lens == (2, 3) and r.topk_ids.dtype == np.int64 and r.topk_ids.shape == (layers, t, k)
    for f in fields(rows[0]):
        want = torch.stack([getattr(x, f.name) for x in rows]).numpy()
        assert getattr(r, f.name).dtype == want.dtype and np.array_equal(getattr(r, f.name), want), f.name


def test_kv_cache_scratch_block_and_generation():
    kv = KVCache(2, 4, 2, 1, 8, torch.float16, scratch=True)
    assert kv.scratch_block == 4 and kv.k[0].shape[0] == 5 and kv.generation == 0
    assert kv.nbytes == 5 * KVCache.bytes_per_block(2, 2, 1, 8, torch.float16)
    kv.k[1][:4].normal_()
    before = kv.k[1][:4].clone()
    kv.k[1][4].fill_(7.0)                                   # what padded rows wrote
    kv.resize(7)
    assert kv.scratch_block == 7 and kv.k[1].shape[0] == 8 and kv.generation == 1
    assert torch.equal(kv.k[1][:4], before) and not kv.k[1][4:].any()   # new blocks and the scratch block zero
    kv.resize(7)
    assert kv.generation == 1                               # nothing replaced
    kv.resize(3)
    assert kv.scratch_block == 3 and kv.v[0].shape[0] == 4 and kv.generation == 2
    assert kv.ptrs is None and kv.layer_ptrs(0) is None and kv.graph_epoch == 2   # no pointer table off CUDA
    plain = KVCache(2, 4, 2, 1, 8)
    assert plain.scratch_block is None and plain.k[0].shape[0] == 4


def _fake_model(dtype=torch.float16, store=None, graph_attention=True):
    cfg = SimpleNamespace(max_position=64)
    return SimpleNamespace(config=cfg, device=torch.device("cpu"), dtype=dtype, graph_attention=graph_attention,
                           experts=store if store is not None else SimpleNamespace(capturable=True, graph_epoch=0))


def test_graphs_usable_only_for_capturable_decode_batches():
    kv = KVCache(2, 16, 4, 1, 8, torch.float16, scratch=True)
    g = DecodeGraphs(_fake_model(), kv, max_num_seqs=6)
    assert g.sizes == (1, 2, 4, 8) and g.widths == [16] and g.buffers.block_tables.shape == (8, 16)
    row = lambda n, pos=3: DecodeRows([1] * n, [pos] * n, [[0] * (pos // 4 + 1)] * n)  # noqa: E731
    assert g.supports(row(1)) and g.supports(row(8))
    assert not g.supports(row(9)) and not g.supports(row(0))
    assert not g.supports(DecodeRows([1], [3], [[0] * 17]))         # wider than max_position / block_size
    assert not DecodeGraphs(_fake_model(store=SimpleNamespace()), kv, 4).supports(row(1))     # store not capturable
    assert not DecodeGraphs(_fake_model(dtype=torch.float32), kv, 4).supports(row(1))       # fp32: no decode kernel
    assert not DecodeGraphs(_fake_model(graph_attention=False), kv, 4).supports(row(1))   # heads it cannot take
    assert not DecodeGraphs(_fake_model(), KVCache(2, 16, 4, 1, 8), 4).supports(row(1))    # no scratch block
    g.disabled = "capture failed"
    assert not g.supports(row(1))


def test_each_kv_group_of_a_hybrid_cache_gets_its_tables_and_slots():
    """A hybrid cache (sliding 8-token blocks, global 4-token ones; max_position 64): a table width for each group, and
    a batch staged into each group's static inputs with that group's tables, slots and scratch padding."""
    from policies.kv_groups import KVLayout

    layout = KVLayout.build([64, 128], [8, None], 4)
    kv = KVCache(2, 16, 4, 2, 8, torch.float16, scratch=True, layer_shapes=((2, 8), (2, 16)), layout=layout)
    g = DecodeGraphs(_fake_model(), kv, max_num_seqs=2)
    assert g.block_sizes == [8, 4] and g.widths == [8, 16] and g.buffers is g.inputs[0]
    # position 9: the sliding table released block 0 (NULL); the global table holds blocks for positions 0..11
    rows = DecodeRows([7, 8], [9, 2], [[-1, 3], [5]], token_src=[-1, 0], more_tables=([[0, 1, 2], [6]],))
    assert g.supports(rows) and not g.supports(replace(rows, more_tables=([[0] * 17, [6]],)))
    with pytest.raises(ValueError, match="1 KV groups for a cache of 2"):
        g.supports(DecodeRows([7], [9], [[-1, 3]]))
    g._stage(rows, 2)
    sliding, full = g.inputs
    assert sliding.slot_mapping[:2].tolist() == [3 * 8 + 1, 5 * 8 + 2]
    assert full.slot_mapping[:2].tolist() == [2 * 4 + 1, 6 * 4 + 2]
    assert sliding.block_tables[0, :3].tolist() == [-1, 3, 16] and full.block_tables[1, :2].tolist() == [6, 16]
    assert sliding.seq_lens[:2].tolist() == full.seq_lens[:2].tolist() == [10, 3]
    assert sliding.token_src[:2].tolist() == [-1, 0] and sliding.input_ids[:2].tolist() == [7, 8]
    g._stage(DecodeRows([], [], [], more_tables=((),)), 2)   # padding rows: each group's scratch slot
    assert sliding.slot_mapping[:2].tolist() == [16 * 8] * 2 and full.slot_mapping[:2].tolist() == [16 * 4] * 2


def test_graphs_dropped_when_cache_or_store_changes():
    store = SimpleNamespace(capturable=True, graph_epoch=0)
    model = _fake_model(store=store)
    kv = KVCache(2, 16, 4, 1, 8, torch.float16, scratch=True)
    g = DecodeGraphs(model, kv, 4)

    def captured_then_stale(change) -> bool:
        g._drop_stale()
        g._graphs[(1, False)] = object()
        g._drop_stale()
        assert g._graphs, "dropped without a change"
        change()
        g._drop_stale()
        return not g._graphs

    assert captured_then_stale(lambda: kv.resize(20))
    assert captured_then_stale(lambda: kv.resize(8))
    assert captured_then_stale(lambda: setattr(store, "graph_epoch", 1))
    assert captured_then_stale(lambda: setattr(model, "experts", SimpleNamespace(capturable=True)))
    assert g.invalidations == 4


def test_captures_wait_for_the_cache_to_settle_after_a_change():
    store = SimpleNamespace(capturable=True, graph_epoch=0)
    kv = KVCache(2, 16, 4, 1, 8, torch.float16, scratch=True)
    g = DecodeGraphs(_fake_model(store=store), kv, 4, settle_steps=3)
    g._drop_stale()
    assert g._settled()                                # the first capture happens at once
    kv.resize(20)
    g._drop_stale()
    assert [g._settled() for _ in range(4)] == [False, False, False, True]
    kv.resize(24)                                      # a change while settling starts the count again
    g._drop_stale()
    assert [g._settled() for _ in range(4)] == [False, False, False, True]
    g._drop_stale()                                    # no change: stays settled
    assert g._settled()


# ------------------------------------------------------------------ CPU: attention decode path
def _decode_batch(seed: int = 0, device: str = "cpu"):
    """Four decode sequences (contexts 0, 5, 12, 3) over random caches [24 blocks of 4, 2 KV heads, 32]."""
    g = torch.Generator().manual_seed(seed)
    bs, kvh, heads, d, nblocks = 4, 2, 4, 32, 24
    k_cache = torch.randn(nblocks, bs, kvh, d, generator=g).to(device)
    v_cache = torch.randn(nblocks, bs, kvh, d, generator=g).to(device)
    perm = torch.randperm(nblocks, generator=g).tolist()
    seqs, used = [], 0
    for ctx in (0, 5, 12, 3):
        n = -(-(ctx + 1) // bs)
        seqs.append((ctx, 1, perm[used:used + n]))
        used += n
    meta = batch_metadata(seqs, bs, device)
    q = torch.randn(len(seqs), heads, d, generator=g).to(device)
    new_k, new_v = (torch.randn(len(seqs), kvh, d, generator=g).to(device) for _ in range(2))
    return q, (new_k, new_v), (k_cache, v_cache), meta


def _write_new(plan: AttentionPlan, new, caches) -> None:
    for t, c in zip(new, caches):
        c.view(-1, c.shape[2], c.shape[3]).index_copy_(0, plan.slot_mapping, t.to(c.dtype))


def test_decode_plan_selection():
    meta = _decode_batch()[3]
    plan = AttentionPlan.build(meta, 4, torch.device("cpu"), torch.float32)
    assert plan.decode is not None
    assert plan.decode.seq_lens.tolist() == [1, 6, 13, 4] and plan.decode.seq_lens.dtype == torch.int32
    assert plan.decode.block_tables.dtype == torch.int32
    assert "decode_group" in plan.__dict__            # CPU: the reference's groups are built (and checked) at once
    mixed = batch_metadata([(5, 1, [0, 1]), (0, 3, [2]), (2, 1, [3])], 4)
    md = AttentionPlan.build(mixed, 4, torch.device("cpu")).decode  # the decode sequences of a mixed batch
    assert md.rows.tolist() == [0, 4] and md.seq_lens.tolist() == [6, 3]
    assert md.block_tables.tolist() == [[0, 1], [3, -1]] and md.seq_lens.dtype == torch.int32
    assert AttentionPlan.build(batch_metadata([(0, 3, [2])], 4), 4, torch.device("cpu")).decode is None
    d = plan.decode
    assert d.kernel_applies("cuda", torch.float16) and d.kernel_applies("cuda", torch.bfloat16)
    assert not d.kernel_applies("cuda", torch.float32) and not d.kernel_applies("cpu", torch.float16)


def test_cpu_decode_reference_unchanged_and_kernel_wiring(monkeypatch):
    q, new, caches, meta = _decode_batch(seed=1)
    plan = AttentionPlan.build(meta, 4, torch.device("cpu"))
    _write_new(plan, new, caches)
    scale = 32 ** -0.5
    ref = paged_attention(q, *new, *caches, plan, scale)
    want = paged_attention_decode_ref(q, *caches, meta.block_tables, plan.decode.seq_lens, scale)
    assert torch.allclose(ref, want, atol=1e-5)       # the gather reference == the kernel's own reference
    calls = []
    monkeypatch.setattr(DecodeBatch, "kernel_applies", staticmethod(lambda dev, dtype: calls.append(dev) or True))
    via_kernel_fn = paged_attention(q, *new, *caches, plan, scale)   # on CPU the kernel function falls back
    assert calls == ["cpu"] and torch.allclose(via_kernel_fn, ref, atol=1e-5)


@pytest.mark.parametrize("window", [None, 3])
def test_mixed_batch_decode_rows_through_the_kernel_equal_the_reference(monkeypatch, window):
    """A batch of decodes, a chunk with context and a plain prefill: the decode rows through the kernel function
    (its CPU fallback, which keeps the last `window` tokens itself) beside the chunks' groups give what the gather
    reference gives for every row, under a sliding window too."""
    g = torch.Generator().manual_seed(3)
    bs, kvh, heads, d = 4, 2, 4, 16
    caches = [torch.randn(24, bs, kvh, d, generator=g) for _ in range(2)]
    meta = batch_metadata([(5, 1, [0, 1]), (6, 3, [2, 3, 4]), (0, 4, [5]), (9, 1, [6, 7, 8])], bs)
    plan = AttentionPlan.build(meta, bs, torch.device("cpu"))
    q = torch.randn(meta.num_tokens, heads, d, generator=g)
    new = [torch.randn(meta.num_tokens, kvh, d, generator=g) for _ in range(2)]
    _write_new(plan, new, caches)
    scale = d ** -0.5
    ref = paged_attention(q, *new, *caches, plan, scale, window)
    calls = []
    monkeypatch.setattr(DecodeBatch, "kernel_applies", staticmethod(lambda dev, dtype: calls.append(dev) or True))
    got = paged_attention(q, *new, *caches, plan, scale, window)
    assert calls == ["cpu"] and plan.decode.rows.tolist() == [0, 8]
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert not torch.equal(got[0], got[8])
    if window:   # the window changed the decode rows (5 and 9 tokens of context): it was applied, not ignored
        assert not torch.allclose(got[[0, 8]], paged_attention(q, *new, *caches, plan, scale)[[0, 8]], atol=1e-3)


def test_engine_on_cpu_has_no_graphs_or_scratch():
    from pwruntime.cmd_perplexity import default_model_dir
    from pwruntime.engine import EngineConfig, LLMEngine
    from pwruntime.model import load_model

    engine = LLMEngine(load_model(default_model_dir()), EngineConfig(num_kv_blocks=8, cuda_graphs=True))
    assert engine.runner.graphs is None and engine.kv.scratch_block is None


# ------------------------------------------------------------------ GPU
def quantize_uniform(w: torch.Tensor) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """AP layout of `w` [out, in] with a per-row uniform 8-bit codebook: planes [8, out, words] int32 and
    LUT_b = the centre of the values whose top b code bits are each b-bit code (fast, deterministic)."""
    from pwruntime.quant.pack import pack_planes_torch

    w = w.float()
    lo, hi = w.min(1, keepdim=True).values, w.max(1, keepdim=True).values
    step = (hi - lo).clamp_min(1e-8) / 255
    codes = ((w - lo) / step).round().clamp(0, 255).to(torch.uint8)
    planes = pack_planes_torch(codes).view(torch.int32).contiguous()
    luts = {}
    for b in range(1, 9):
        width = 1 << (8 - b)
        centre = torch.arange(1 << b, device=w.device) * width + (width - 1) / 2
        luts[b] = (lo + centre[None, :] * step).half().contiguous()
    return planes, luts


class TableStore:
    """A capturable ExpertStore for these tests: every routed expert as AP planes in a DeviceWeightTable,
    served by kernels.fused_moe with one persistent workspace; down_in_norm from the workspace's activations."""

    capturable = True
    graph_epoch = 0

    def __init__(self, dense, cfg, device: str = "cuda"):
        from pwruntime.kernels import DeviceWeightTable, MoEShape
        from pwruntime.kernels.device_table import device_layout

        self.shape = MoEShape(cfg.experts, cfg.hidden, cfg.expert_intermediate, cfg.top_k)
        self.table = DeviceWeightTable(len(dense.gate_up) * cfg.experts * 2, device)
        self.luts: dict[int, dict[int, torch.Tensor]] = {}
        for layer in range(len(dense.gate_up)):
            for e in range(cfg.experts):
                for kind, w in enumerate((dense.gate_up[layer][e], dense.down[layer][e])):
                    planes, luts = quantize_uniform(w)
                    blk = self.shape.block(layer, e, kind)
                    self.table.set_block(blk, device_layout(planes), luts[8], 8)
                    self.luts[blk] = luts
        self._ws: dict[torch.dtype, object] = {}

    def set_bits(self, bits: int) -> None:
        for blk, luts in self.luts.items():
            self.table.commit_bits(blk, bits, luts[bits])

    def moe(self, layer, x, topk_ids, topk_weights, down_in_norm=None):
        from pwruntime.kernels import MoEWorkspace, fused_moe
        from pwruntime.kernels.moe import MAX_TOKENS

        if x.dtype not in self._ws:
            self._ws[x.dtype] = MoEWorkspace.create(self.shape, MAX_TOKENS, x.dtype, x.device)
        ws, k = self._ws[x.dtype], self.shape.top_k
        outs = []
        for s in range(0, x.shape[0], MAX_TOKENS):
            sl = slice(s, s + MAX_TOKENS)
            outs.append(fused_moe(self.table, layer, x[sl], topk_ids[sl], topk_weights[sl], self.shape, ws))
            if down_in_norm is not None:
                n = outs[-1].shape[0]
                down_in_norm[sl].copy_(ws.act[:n * k].float().norm(dim=-1).view(n, k))
        return outs[0] if len(outs) == 1 else torch.cat(outs)


@pytest.fixture(scope="module")
def demo():
    from pwruntime.cmd_perplexity import default_model_dir
    from pwruntime.model import load_model

    model = load_model(default_model_dir(), dtype="fp16", device="cuda")
    dense = model.experts
    model.experts = TableStore(dense, model.config)
    yield SimpleNamespace(model=model, store=model.experts, dense=dense)
    del model
    torch.cuda.empty_cache()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    assert torch.isfinite(a).all() and torch.isfinite(b).all()
    return float((a.double() - b.double()).norm() / b.double().norm())


class Pair:
    """n sequences prefilled identically into a graph cache (with scratch) and an eager cache; each step
    decodes the same given tokens through DecodeGraphs and through the eager forward."""

    BS = 16

    def __init__(self, model, n: int, max_num_seqs: int = 8, seed: int = 0, growable: bool | None = None):
        self.model, self.n = model, n
        gen = torch.Generator().manual_seed(seed)
        self.lens = [int(x) for x in torch.randint(20, 60, (n,), generator=gen)]
        per = 8                                   # blocks per sequence: room for 128 tokens
        self.tables = [list(range(i * per, (i + 1) * per)) for i in range(n)]
        self.kv_graph = model.new_kv_cache(n * per, self.BS, scratch=True, growable=growable)
        self.kv_eager = model.new_kv_cache(n * per, self.BS, growable=growable)
        self.graphs = DecodeGraphs(model, self.kv_graph, max_num_seqs)
        self.gen = gen
        for i in range(n):
            ids = torch.randint(3, model.config.vocab, (self.lens[i],), generator=gen)
            meta = batch_metadata([(0, self.lens[i], self.tables[i])], self.BS, model.device)
            for kv in (self.kv_graph, self.kv_eager):
                model.forward(ids, torch.arange(self.lens[i]), kv, meta)

    def tokens(self) -> list[int]:
        return [int(t) for t in torch.randint(3, self.model.config.vocab, (self.n,), generator=self.gen)]

    def rows(self, tokens: list[int]) -> DecodeRows:
        return DecodeRows(tokens, list(self.lens), self.tables)

    def graph_step(self, tokens: list[int]):
        out = self.graphs.forward(self.rows(tokens), record=True)
        assert out is not None, self.graphs.disabled
        assert torch.equal(out.routing_words, pack_routing(out.routing))   # packed inside the graph, the real rows
        assert out.logits.shape[0] == len(tokens) and rel(out.logits, self.model.logits(out.hidden)) < 5e-3
        return out.logits, out.routing

    def eager_step(self, tokens: list[int], kv=None):
        meta = batch_metadata([(p, 1, t) for p, t in zip(self.lens, self.tables)], self.BS, self.model.device)
        out = self.model.forward(torch.tensor(tokens), torch.tensor(self.lens), kv or self.kv_eager, meta, record=True)
        return self.model.logits(out.hidden), out.routing

    def step(self, tokens: list[int] | None = None):
        tokens = tokens or self.tokens()
        g, e = self.graph_step(tokens), self.eager_step(tokens)
        self.lens = [x + 1 for x in self.lens]
        return g, e


def assert_same_step(graph, eager, tol: float = 5e-3) -> None:
    (gl, gr), (el, er) = graph, eager
    assert gl.shape == el.shape and rel(gl, el) < tol
    assert len(gr) == len(er)
    for a, b in zip(gr, er):
        assert a.topk_ids.shape == b.topk_ids.shape
        assert (a.topk_ids == b.topk_ids).float().mean() > 0.95
        assert torch.allclose(a.gate_up_in_norm, b.gate_up_in_norm, rtol=1e-2, atol=1e-2)
        same = (a.topk_ids == b.topk_ids).all(dim=-1)
        assert torch.allclose(a.topk_weights[same], b.topk_weights[same], rtol=1e-2, atol=1e-3)
        assert torch.allclose(a.down_in_norm[same], b.down_in_norm[same], rtol=2e-2, atol=1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [4, 5, 1])
def test_graph_decode_equals_eager(demo, n):
    pair = Pair(demo.model, n)
    for _ in range(4):
        assert_same_step(*pair.step())
    g = pair.graphs
    assert g.disabled is None and g.replays == 4 and g.captures == 1 and g.invalidations == 0


@pytest.mark.gpu
def test_replay_follows_committed_bits(demo):
    pair = Pair(demo.model, 3, seed=1)
    try:
        assert_same_step(*pair.step())
        tokens = pair.tokens()
        at8 = pair.eager_step(tokens, kv=pair.kv_graph)      # the graph cache's slots are rewritten below
        demo.store.set_bits(3)                               # device table writes only
        graph, eager = pair.step(tokens)
        assert_same_step(graph, eager)
        assert rel(graph[0], at8[0]) > 10 * max(rel(graph[0], eager[0]), 1e-4)   # the bits did change the result
        assert_same_step(*pair.step())
        assert pair.graphs.captures == 1 and pair.graphs.invalidations == 0
    finally:
        demo.store.set_bits(8)


@pytest.mark.gpu
@pytest.mark.parametrize("growable", [True, False], ids=["growable", "torch-tensors"])
def test_kv_resize_keeps_graphs(demo, growable):
    """A resize maps memory behind the same addresses (growable buffers), or replaces the cache tensors and
    rewrites the pointer table (torch's): either way the captured graph replays on, reading and writing the resized
    cache (equal to an eager forward over its own), and nothing is recaptured."""
    pair = Pair(demo.model, 3, seed=2, growable=growable)
    assert_same_step(*pair.step())
    captures = pair.graphs.captures
    for grow in (8, -8, 16):
        old = [t.data_ptr() for t in pair.kv_graph.k]
        for kv in (pair.kv_graph, pair.kv_eager):
            kv.resize(kv.num_blocks + grow)
        assert all((t.data_ptr() == o) == growable for t, o in zip(pair.kv_graph.k, old))
        assert pair.kv_graph.ptrs[:, 0].tolist() == [t.data_ptr() for t in pair.kv_graph.k]
        pos = list(pair.lens)
        assert_same_step(*pair.step())
        for i, p in enumerate(pos):   # the replay wrote this step's K/V into the new tensors
            blk, off = pair.tables[i][p // Pair.BS], p % Pair.BS
            for layer in range(demo.model.config.layers):
                for got, want in ((pair.kv_graph.k[layer][blk, off], pair.kv_eager.k[layer][blk, off]),
                                  (pair.kv_graph.v[layer][blk, off], pair.kv_eager.v[layer][blk, off])):
                    assert want.abs().sum() > 0 and rel(got, want) < 1e-2
    assert pair.graphs.captures == captures and pair.graphs.invalidations == 0 and pair.graphs.replays == 4


@pytest.mark.gpu
def test_cuda_decode_attention_kernel_matches_reference():
    q, new, caches, meta = _decode_batch(seed=3, device="cuda")
    plan = AttentionPlan.build(meta, 4, torch.device("cuda"), torch.float16)
    assert plan.decode is not None and "decode_group" not in plan.__dict__   # the kernel path builds no gather group
    _write_new(plan, new, caches)
    scale = 32 ** -0.5
    want = paged_attention(q, *new, *caches, plan, scale)              # fp32: the gather reference
    half = [c.half() for c in caches]
    got = paged_attention(q.half(), *(t.half() for t in new), *half, plan, scale)
    assert got.dtype == torch.float16 and rel(got.float(), want) < 3e-3


@pytest.mark.gpu
def test_cuda_mixed_batch_decode_rows_through_the_kernel_match_reference():
    g = torch.Generator().manual_seed(4)
    bs, kvh, heads, d = 4, 2, 4, 32
    caches = [torch.randn(24, bs, kvh, d, generator=g).cuda() for _ in range(2)]
    meta = batch_metadata([(5, 1, [0, 1]), (6, 3, [2, 3, 4]), (0, 4, [5]), (9, 1, [6, 7, 8])], bs, "cuda")
    plan = AttentionPlan.build(meta, bs, torch.device("cuda"), torch.float16)
    assert plan.decode.rows.tolist() == [0, 8] and "decode_group" not in plan.__dict__
    q = torch.randn(meta.num_tokens, heads, d, generator=g).cuda()
    new = [torch.randn(meta.num_tokens, kvh, d, generator=g).cuda() for _ in range(2)]
    _write_new(plan, new, caches)
    scale = d ** -0.5
    want = paged_attention(q, *new, *caches, plan, scale)              # fp32: the gather reference for every row
    got = paged_attention(q.half(), *(t.half() for t in new), *[c.half() for c in caches], plan, scale)
    assert "decode_group" in plan.__dict__ and rel(got.float(), want) < 3e-3


def _engine_outputs(model, graphs: bool, grow_at: int | None = None, params=None, sampler: bool = True):
    """Each prompt's RequestOutput (with `params`, one a prompt; greedy by default) and the engine; `sampler` False
    turns the captured sampler off (the eager one then samples the graphs' logits)."""
    from pwruntime.engine import EngineConfig, LLMEngine
    from pwruntime.sampling import SamplingParams

    engine = LLMEngine(model, EngineConfig(num_kv_blocks=48, max_num_seqs=4, cuda_graphs=graphs, graph_settle_steps=2))
    if not sampler:
        engine.runner.graphs.sampler_disabled = "turned off by the test"
    params = params or [SamplingParams(max_tokens=12, ignore_eos=True)] * 4
    ids = [engine.add_request(p, sp) for p, sp in zip(("And God said", "def main(", "You will", "The"), params)]
    done, step = {}, 0
    while engine.has_unfinished():
        if step == grow_at:
            engine.capacity.grow(8)
        for out in engine.step():
            done[out.request_id] = out
        step += 1
    return [done[i] for i in ids], engine


def _engine_tokens(model, graphs: bool, grow_at: int | None = None):
    outputs, engine = _engine_outputs(model, graphs, grow_at)
    return [o.token_ids for o in outputs], engine


@pytest.mark.gpu
def test_engine_decodes_through_graphs(demo):
    eager, e_engine = _engine_tokens(demo.model, graphs=False, grow_at=5)
    graphed, g_engine = _engine_tokens(demo.model, graphs=True, grow_at=5)
    assert e_engine.runner.graphs is None and g_engine.kv.scratch_block is not None
    g = g_engine.runner.graphs
    # every decode step (1-11) replays the one graph: the growth before step 5 replaced the cache tensors and
    # rewrote the pointer table, which the graph reads (before the table: steps 5-6 eager, a second capture)
    assert g.disabled is None and g.invalidations == 0 and g.captures == 1 and g.replays == 11
    assert graphed == eager
    demo.model.experts = demo.dense                      # not capturable: decode runs eagerly
    try:
        _, d_engine = _engine_tokens(demo.model, graphs=True)
        assert d_engine.runner.graphs.replays == 0 and d_engine.runner.graphs.captures == 0
    finally:
        demo.model.experts = demo.store


@pytest.mark.gpu
def test_prefix_caching_on_cuda_decodes_the_tokens_an_engine_without_it_decodes(demo):
    """Prefix caching on CUDA (AP experts, graphs): a second round of prompts that share a prefix of several blocks
    starts over the cached KV blocks (its prompt chunk attends to K/V already in the cache) and decodes the tokens,
    with the log-probabilities, of an engine without prefix caching."""
    from pwruntime.engine import EngineConfig, LLMEngine
    from pwruntime.sampling import SamplingParams

    prefix = ("And God said unto Moses, I AM THAT I AM: and he said, Thus shalt thou say unto the children of "
              "Israel, I AM hath sent me unto you.")
    prompts = [prefix + s for s in (" And Moses", " The king of", " Behold, the", " Then said")]
    params = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=0)
    outs, hits = {}, {}
    for caching in (False, True):
        engine = LLMEngine(demo.model, EngineConfig(num_kv_blocks=64, block_size=8, max_num_seqs=4,
                                                    prefix_caching=caching))
        outs[caching] = [engine.generate(prompts, params) for _ in range(2)]
        hits[caching] = engine.scheduler.num_cached_tokens
        assert engine.pool.num_free == engine.pool.capacity
    assert hits[False] == 0 and hits[True] >= 4 * 24      # the second round: at least three 8-token blocks each
    for r in range(2):
        for off, on in zip(outs[False][r], outs[True][r]):
            assert on.token_ids == off.token_ids, (r, off.token_ids, on.token_ids)
            assert max(abs(a.logprob - b.logprob) for a, b in zip(off.logprobs, on.logprobs)) < 2e-2
    assert len({tuple(o.token_ids) for o in outs[False][0]}) > 1  # not degenerate


@pytest.mark.gpu
def test_dense_store_decodes_through_graphs():
    """The plain (bf16) model's experts run as grouped GEMMs with no host sync: its decode steps replay graphs, the
    layer equals the per-expert loop, and graph and eager steps agree."""
    from pwruntime.cmd_perplexity import default_model_dir
    from pwruntime.model import load_model
    from pwruntime.model.experts import expert_mlp, grouped_moe

    model = load_model(default_model_dir(), dtype="bf16", device="cuda")
    store = model.experts
    assert store.capturable
    g = torch.Generator(device="cuda").manual_seed(5)
    cfg = model.config
    x = torch.randn(13, cfg.hidden, device="cuda", generator=g).bfloat16()
    ids = torch.randint(0, cfg.experts, (13, cfg.top_k), device="cuda", generator=g)
    wts = torch.rand(13, cfg.top_k, device="cuda", generator=g)
    norms, want_norms = (torch.zeros(13, cfg.top_k, device="cuda") for _ in range(2))
    got = store.moe(1, x, ids, wts, norms)
    gu, dn = store.gate_up[1], store.down[1]
    want = grouped_moe(x, ids, wts, cfg.experts, lambda e, rows: expert_mlp(rows, gu[e], dn[e]), want_norms)
    assert rel(got.float(), want.float()) < 1e-2 and rel(norms, want_norms) < 1e-2
    pair = Pair(model, 5)
    for _ in range(3):
        assert_same_step(*pair.step(), tol=1e-2)
    assert pair.graphs.disabled is None and pair.graphs.replays == 3 and pair.graphs.captures == 1


@pytest.mark.gpu
def test_captured_sampler_picks_the_eager_samplers_tokens(demo):
    """After a decode replay, DecodeGraphs.sample (one transfer, one replay) gives the tokens sample_tensor gives on
    the same logits, for greedy, temperature, top-k, top-p, min-p and several-cut rows (padding rows greedy), step after step
    with new numbers; logits that are not the replay's as it left them are refused (the caller samples eagerly)."""
    from pwruntime.sampling import SamplingParams, row_values, sample_tensor

    pair = Pair(demo.model, 5, seed=2)
    both = [SamplingParams(), SamplingParams(temperature=0.7, top_k=5), SamplingParams(temperature=1.0, top_p=0.9),
            SamplingParams(temperature=1.3), SamplingParams(temperature=0.9, top_k=50, top_p=0.8)]
    plain = [SamplingParams(temperature=0.6)] * 2 + [SamplingParams()] * 2 + [SamplingParams(temperature=1.4)]
    top_p = [SamplingParams(temperature=1.0, top_p=0.95)] * 4 + [SamplingParams()]
    top_k = [SamplingParams(temperature=1.0, top_k=40)] + [SamplingParams(temperature=0.5)] * 4
    min_p = [SamplingParams(temperature=1.0, min_p=0.1)] * 3 + [SamplingParams(temperature=0.7, top_p=0.9, min_p=0.05),
                                                                SamplingParams()]
    gen = torch.Generator().manual_seed(7)
    for step in range(10):
        params = (both, plain, top_p, top_k, min_p)[step % 5]   # a sampler graph for each set of cuts
        logits, _ = pair.graph_step(pair.tokens())
        pair.lens = [x + 1 for x in pair.lens]
        numbers = [None if p.greedy else float(u) for p, u in zip(params, torch.rand(5, generator=gen))]
        if step == 0:
            numbers[3], numbers[4] = 0.0, 1 - 2 ** -23   # the smallest and the largest number
        want = sample_tensor(logits, params, numbers)
        values = [row_values(p, u, logits.shape[-1]) for p, u in zip(params, numbers)]
        got = pair.graphs.sample(logits, values)
        assert got is not None and got.tolist() == want.tolist()
        assert pair.graphs.sample(logits.clone(), values) is None
        assert pair.graphs.sample(logits[:4], values[:4]) is None
    g = pair.graphs
    assert g.sampler_disabled is None and g.sampler_replays == 10 and g.replays == 10 and g.captures == 1
    assert sorted(g._graphs[(8, True)].samplers) == [(False, False, False), (False, True, False), (False, True, True),
                                                     (True, False, False), (True, True, False)]


@pytest.mark.gpu
def test_engine_samples_through_the_captured_sampler(demo):
    """An engine whose decode batches sample (seeded temperature, top-k, top-p; one greedy request; log-probabilities)
    replays the captured sampler and returns the tokens and log-probabilities of the same engine sampling those
    graphs' logits eagerly."""
    from pwruntime.sampling import SamplingParams

    params = [SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.8, top_p=0.9, seed=3, logprobs=2),
              SamplingParams(max_tokens=12, ignore_eos=True, temperature=1.0, top_k=20, seed=4, logprobs=0),
              SamplingParams(max_tokens=12, ignore_eos=True, logprobs=1),
              SamplingParams(max_tokens=12, ignore_eos=True, temperature=1.2, seed=5)]
    captured, c_engine = _engine_outputs(demo.model, graphs=True, params=params)
    eager, e_engine = _engine_outputs(demo.model, graphs=True, params=params, sampler=False)
    assert c_engine.runner.graphs.sampler_replays >= 10 and e_engine.runner.graphs.sampler_replays == 0
    assert c_engine.runner.graphs.replays == e_engine.runner.graphs.replays >= 10
    assert [o.token_ids for o in captured] == [o.token_ids for o in eager]
    assert [o.logprobs for o in captured] == [o.logprobs for o in eager]
    assert len({tuple(o.token_ids) for o in captured}) == 4 and all(len(o.logprobs) == 12 for o in captured[:3])


@pytest.mark.gpu
def test_processed_logits_sample_eagerly_after_a_graph_replay(demo):
    """A batch with a request whose logits are processed (logit_bias) replays the decode graphs and samples the
    processed logits eagerly: the bias of 100 makes its every token the biased one, sampled or greedy."""
    from pwruntime.sampling import SamplingParams

    forced = 1234
    params = [SamplingParams(max_tokens=8, ignore_eos=True, temperature=1.0, seed=1, logit_bias={forced: 100}),
              SamplingParams(max_tokens=8, ignore_eos=True, logit_bias={forced: 100}),
              SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.7, seed=2),
              SamplingParams(max_tokens=8, ignore_eos=True)]
    outputs, engine = _engine_outputs(demo.model, graphs=True, params=params)
    assert outputs[0].token_ids == outputs[1].token_ids == [forced] * 8 and forced not in outputs[3].token_ids
    g = engine.runner.graphs
    assert g.replays >= 6 and g.sampler_replays == 0 and g.sampler_disabled is None
