"""Mixed (prefill + decode) steps through piecewise CUDA graphs (pwruntime.mixed_graphs).

CPU: the token buckets, when the pieces are usable, the staging of a batch padded to its bucket, and the pieces
themselves run eagerly in order with the attention cores between them (what a replay does), which must give the
real rows of the unpadded forward and write nothing but the scratch block for the padding rows; the store's MoE
inside a capture and the dequantize of device ids.
GPU (`gpu` marker): on the bundled demo model in fp16 over the capturable AP test store of test_cuda_graphs,
mixed batches through the pieces equal the eager forward (sampled logits and routing) across batches of other
shapes in one bucket, after a change of bits and after a KV resize, without recapture; the engine decodes the same
tokens with and without them, and gives the same prompt log-probabilities; the DeviceExpertStore's MoE of more than 128 tokens is captured (fused launch sets
in fp16, the grouped GEMM over device block ids in bf16) and replays what it computes eagerly.
"""
from __future__ import annotations

from dataclasses import fields
from types import SimpleNamespace

import pytest
import torch

from pwruntime.cuda_graphs import padded_size
from pwruntime.kv_cache import KVCache
from pwruntime.mixed_graphs import MIXED_BUCKET, MixedGraphs, mixed_sizes
from pwruntime.model.attention_plan import batch_metadata
from pwruntime.model.moe_model import LayerRouting
from test_cuda_graphs import TableStore, _fake_model as _fake_decode_model, assert_same_step, rel
from test_device_store import stores


# ------------------------------------------------------------------ CPU
def _fake_model(**kw):
    model = _fake_decode_model(**kw)
    model.config.heads, model.config.kv_shapes = 4, ((2, 8), (2, 8))
    return model


def test_mixed_sizes_are_multiples_of_the_bucket_up_to_the_budget():
    assert mixed_sizes(1) == (64,) and mixed_sizes(64) == (64,)
    assert mixed_sizes(65) == (64, 128)
    assert mixed_sizes(512) == tuple(range(64, 513, 64)) and MIXED_BUCKET == 64
    with pytest.raises(ValueError):
        mixed_sizes(0)
    assert [padded_size(n, mixed_sizes(200)) for n in (1, 64, 65, 200, 256, 257)] == [64, 64, 128, 256, 256, None]


def test_pieces_usable_only_for_capturable_models_and_batches_in_budget():
    kv = KVCache(2, 16, 4, 1, 8, torch.float16, scratch=True)
    g = MixedGraphs(_fake_model(), kv, 100)
    assert g.sizes == (64, 128) and g.inputs.shape == (4, 128)
    b = g.boundaries[0]
    assert b.q.shape == (128, 4, 8) and b.k.shape == (128, 2, 8)   # the largest bucket's rows
    assert g.boundaries[1] is b                                      # layers of one geometry share one set
    assert g.supports(1) and g.supports(128) and not g.supports(129) and not g.supports(0)
    assert not MixedGraphs(_fake_model(store=SimpleNamespace()), kv, 100).supports(5)   # store not capturable
    assert not MixedGraphs(_fake_model(dtype=torch.float32), kv, 100).supports(5)
    assert not MixedGraphs(_fake_model(), KVCache(2, 16, 4, 1, 8), 100).supports(5)     # no scratch block
    g.disabled = "capture failed"
    assert not g.supports(5)


def test_pieces_take_no_more_tokens_than_the_store_captures_well():
    """A store's `captured_tokens_limit` (DeviceExpertStore: where its captured MoE would be slower than eager) caps
    the batches the pieces take; larger ones run eagerly. It is asked again of a new store."""
    kv = KVCache(2, 16, 4, 1, 8, torch.float16, scratch=True)
    asked = []
    store = SimpleNamespace(capturable=True, graph_epoch=0,
                            captured_tokens_limit=lambda dtype, top_k: asked.append((dtype, top_k)) or 128)
    model = _fake_model(store=store)
    model.config.top_k = 2
    g = MixedGraphs(model, kv, 512)
    assert g.sizes[-1] == 512 and g.supports(128) and not g.supports(129) and not g.supports(512)
    assert asked == [(torch.float16, 2)]                     # once for this store
    model.experts = SimpleNamespace(capturable=True, graph_epoch=0, captured_tokens_limit=lambda dtype, top_k: None)
    assert g.supports(512) and not g.supports(513)           # None: any the buckets hold


def test_stage_pads_to_the_bucket_with_scratch_slots_and_clears_the_last_batch():
    kv = KVCache(2, 16, 4, 1, 8, torch.float16, scratch=True)
    g = MixedGraphs(_fake_model(), kv, 128)
    g._stage([5, 6, 7], [0, 1, 9], [torch.tensor([40, 41, 73])], 64, token_src=[-1, -1, 3])
    assert g.inputs[0, :4].tolist() == [5, 6, 7, 0] and g.inputs[1, :4].tolist() == [0, 1, 9, 0]
    scratch = kv.scratch_block * kv.block_size
    assert g.inputs[2, :3].tolist() == [40, 41, 73] and set(g.inputs[2, 3:64].tolist()) == {scratch}
    assert g.inputs[3, :4].tolist() == [-1, -1, 3, -1]
    g._stage([8], [2], [torch.tensor([42])], 64)   # a smaller batch after: the rows it does not use are padding again
    assert g.inputs[:, :2].tolist() == [[8, 0], [2, 0], [42, scratch], [-1, -1]]


def test_stage_gives_each_kv_group_its_slots():
    """A hybrid cache (two groups: 8-token sliding blocks, 4-token global ones): a row of slots a group, each group's
    padding on the scratch page at its own block size."""
    from policies.kv_groups import KVLayout

    layout = KVLayout.build([64, 128], [8, None], 4)
    kv = KVCache(2, 16, 4, 2, 8, torch.float16, scratch=True, layer_shapes=((2, 8), (2, 16)), layout=layout)
    g = MixedGraphs(_fake_model(), kv, 64)
    assert g.inputs.shape == (5, 64) and g._group_of == (0, 1)
    g._stage([5, 6], [3, 4], [torch.tensor([19, 20]), torch.tensor([7, 8])], 64, token_src=[-1, 0])
    assert g.inputs[:, :3].tolist() == [[5, 6, 0], [3, 4, 0], [19, 20, 16 * 8], [7, 8, 16 * 4], [-1, 0, -1]]
    with pytest.raises(ValueError):
        g._stage([5], [3], [torch.tensor([19])], 64)   # one row of slots for two groups


# decode rows, a prompt from scratch and a chunk after 20 cached tokens: (context, query, blocks); 65 tokens
MIXED = [(30, 1, [0, 1]), (12, 1, [2]), (0, 37, [3, 4, 5]), (20, 25, [6, 7, 8]), (44, 1, [9, 10, 11])]


def _group_metadata(seqs, layout):
    """MIXED's sequences in each KV group of a hybrid layout: pages of their own (group g's from 12 * g on, twice as
    many where its blocks are half as long), NULL where a sliding group has released blocks before the window."""
    metas = []
    for g, group in enumerate(layout.groups):
        tables = []
        for ctx, q, _ in seqs:
            first, last = group.blocks_held(ctx, ctx + q)
            tables.append((ctx, q, [-1] * first + [40 * g + 5 * len(tables) + b for b in range(first, last)]))
        metas.append(batch_metadata(tables, group.block_size))
    return tuple(metas)


@pytest.mark.parametrize("n_seqs, size", [(5, 128), (4, 64), (3, 64)])
@pytest.mark.parametrize("arch", ["demo", "gemma4", "gemma4-hybrid"])
def test_pieces_run_in_order_give_the_forward_of_the_real_rows(tmp_path, arch, n_seqs, size):
    """What a replay runs, eagerly on CPU (fp32): the batch padded to its bucket (65 tokens in 128, 64 in 64, 39
    in 64) through piece 0, core 0, piece 1, ..., piece L equals model.forward on the real rows (hidden, routing,
    packed words), and the padding rows' K/V land in the scratch block only. On the demo model and on a tiny Gemma 4,
    whose sliding and global layers meet their cores in boundaries of two geometries, and with hybrid KV groups there
    (each group its slots and plan; the sliding group's released blocks are NULL)."""
    from model_fixtures import make_tiny_checkpoint
    from pwruntime.cmd_perplexity import default_model_dir
    from pwruntime.model import load_model
    from pwruntime.model.attention_plan import group_metadata, layer_plans
    from pwruntime.model.moe_model import pack_routing

    path = default_model_dir() if arch == "demo" else make_tiny_checkpoint(tmp_path, "gemma4")
    model = load_model(path, dtype="fp32", device="cpu")
    bs, hybrid = 16, arch.endswith("hybrid")
    seqs = MIXED[:n_seqs]
    layout = model.kv_layout(bs, hybrid)
    assert layout.hybrid == hybrid
    meta = _group_metadata(seqs, layout) if hybrid else batch_metadata(seqs, bs)
    t = sum(q for _, q, _ in seqs)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, model.config.vocab, (t,), generator=gen)
    pos = torch.cat([torch.arange(c, c + q) for c, q, _ in seqs])
    caches = [model.new_kv_cache(80 if hybrid else 16, bs, scratch=True, hybrid=hybrid) for _ in range(2)]
    for layer in range(model.config.layers):   # the cached context of the decode rows and the second chunk
        g = torch.Generator().manual_seed(layer)
        k, v = torch.randn(caches[0].k[layer].shape, generator=g), torch.randn(caches[0].v[layer].shape, generator=g)
        for kv in caches:
            kv.k[layer].copy_(k)
            kv.v[layer].copy_(v)
    want = model.forward(ids, pos, caches[0], meta, record=True)

    pieces = MixedGraphs(model, caches[1], 128)
    assert padded_size(t, pieces.sizes) == size
    pieces._stage(ids.tolist(), pos.tolist(), [m.slot_mapping for m in group_metadata(meta)], size)
    plans = layer_plans(meta, layout, model.device, model.dtype)
    kv, layers = caches[1], len(model.layers)
    assert len({id(b) for b in pieces.boundaries}) == len(set(model.config.kv_shapes))
    carry, records = None, []
    for i in range(layers + 1):
        res = pieces._piece(i, size, carry, records)
        if i < layers:
            carry, rec = res
            b = pieces.boundaries[i]
            model.layers[i].attn.core(b.q[:t], b.k[:t], b.v[:t], kv.k[i], kv.v[i], plans[i], out=b.out)
        else:
            hidden, rec, words = res
        records += rec
    assert torch.allclose(hidden[:t], want.hidden, atol=1e-5, rtol=1e-4)
    for got, ref in zip(records, want.routing, strict=True):
        assert torch.equal(got.topk_ids[:t], ref.topk_ids)
        assert torch.allclose(got.down_in_norm[:t], ref.down_in_norm, atol=1e-5, rtol=1e-4)
    real = [LayerRouting(**{f.name: getattr(r, f.name)[:t] for f in fields(r)}) for r in records]
    assert torch.equal(words[:t], pack_routing(real))
    scratch = kv.scratch_block
    for layer in range(model.config.layers):   # identical caches but for the scratch block (when padded)
        for a, b in ((caches[0].k[layer], kv.k[layer]), (caches[0].v[layer], kv.v[layer])):
            assert torch.allclose(a[:scratch], b[:scratch], atol=1e-5, rtol=1e-5)
            assert torch.equal(a[scratch], b[scratch]) == (size == t)


def test_dequantize_takes_block_ids_as_a_list_or_a_tensor():
    from pwruntime.kernels import DeviceWeightTable
    from pwruntime.kernels.dequant import dequantize_blocks
    from test_cuda_graphs import quantize_uniform
    from pwruntime.kernels.device_table import device_layout

    table = DeviceWeightTable(4, "cpu")
    g = torch.Generator().manual_seed(1)
    for blk in (0, 2):
        planes, luts = quantize_uniform(torch.randn(8, 64, generator=g))
        table.set_block(blk, device_layout(planes), luts[5], 5)
    a = dequantize_blocks(table, [2, 0, 1], 8, 64)
    b = dequantize_blocks(table, torch.tensor([2, 0, 1]), 8, 64)
    assert torch.equal(a, b) and a[2].abs().sum() == 0 and a[0].abs().sum() > 0


# ------------------------------------------------------------------ GPU
@pytest.fixture(scope="module")
def demo():
    from pwruntime.cmd_perplexity import default_model_dir
    from pwruntime.model import load_model

    model = load_model(default_model_dir(), dtype="fp16", device="cuda")
    model.experts = TableStore(model.experts, model.config)
    yield SimpleNamespace(model=model, store=model.experts)
    del model
    torch.cuda.empty_cache()


class MixedPair:
    """One cache replayed piecewise (with scratch) and one run eagerly, filled alike; each step runs the same
    mixed batch through MixedGraphs and through model.forward over the sampled rows."""

    BS = 16

    def __init__(self, model, max_tokens: int = 256):
        self.model = model
        self.kv_graph = model.new_kv_cache(96, self.BS, scratch=True)
        self.kv_eager = model.new_kv_cache(96, self.BS)
        self.pieces = MixedGraphs(model, self.kv_graph, max_tokens)
        for layer in range(model.config.layers):   # the same context in both (the scratch block aside)
            g = torch.Generator().manual_seed(layer)
            for caches in ((self.kv_graph.k, self.kv_eager.k), (self.kv_graph.v, self.kv_eager.v)):
                values = torch.randn(caches[1][layer].shape, generator=g).half()
                for c in caches:
                    c[layer][:values.shape[0]].copy_(values)

    def step(self, seqs, seed: int = 0):
        meta = batch_metadata(seqs, self.BS)
        t = meta.num_tokens
        ids = torch.randint(3, self.model.config.vocab, (t,), generator=torch.Generator().manual_seed(seed)).tolist()
        pos = torch.cat([torch.arange(c, c + q) for c, q, _ in seqs]).tolist()
        rows = (torch.tensor([q for _, q, _ in seqs]).cumsum(0) - 1).tolist()   # each sequence's last token
        out = self.pieces.forward(ids, pos, meta, record=True)
        assert out is not None, self.pieces.disabled
        assert out.hidden.shape[0] == t and out.routing_words.shape[0] == t
        graph = self.model.logits(out.hidden[rows]), out.routing
        ref = self.model.forward(torch.tensor(ids), torch.tensor(pos), self.kv_eager, meta, record=True)
        return graph, (self.model.logits(ref.hidden[rows]), ref.routing)


def _batches():
    """Mixed batches of 37-200 tokens: decode rows, prompts, chunks after cached context."""
    yield [(30, 1, [0, 1]), (12, 1, [2]), (0, 37, [3, 4, 5]), (20, 25, [6, 7, 8]), (44, 1, [9, 10, 11])]   # 65
    yield [(0, 50, [12, 13, 14, 15]), (5, 1, [16])]                                                        # 51
    yield [(31, 1, [0, 1]), (13, 1, [2]), (37, 90, [3, 4, 5, 17, 18, 19, 20, 21, 22]), (0, 100, list(range(23, 30)))]
    # 192


@pytest.mark.gpu
def test_mixed_steps_through_pieces_equal_eager(demo):
    pair = MixedPair(demo.model)
    for seed, seqs in enumerate(_batches()):
        assert_same_step(*pair.step(seqs, seed))
    g = pair.pieces
    assert g.disabled is None and g.replays == 3 and g.captures == 3   # buckets 128, 64, 192
    assert_same_step(*pair.step([(0, 40, [40, 41, 42]), (9, 1, [43])]))   # bucket 64 again: no capture
    assert g.captures == 3 and g.replays == 4 and g.invalidations == 0


@pytest.mark.gpu
def test_pieces_follow_committed_bits_and_kv_resizes(demo):
    pair = MixedPair(demo.model)
    seqs = [(30, 1, [0, 1]), (0, 60, [3, 4, 5, 6])]
    try:
        assert_same_step(*pair.step(seqs))
        demo.store.set_bits(3)                         # device table writes only
        graph, eager = pair.step(seqs)
        assert_same_step(graph, eager)
        demo.store.set_bits(8)
        at8, _ = pair.step(seqs)                       # the same tokens at 8 bits again
        assert rel(graph[0], at8[0]) > 10 * max(rel(graph[0], eager[0]), 1e-4)   # the bits did change the result
        for kv in (pair.kv_graph, pair.kv_eager):
            kv.resize(kv.num_blocks + 16)
        assert_same_step(*pair.step(seqs, seed=1))
        assert pair.pieces.captures == 1 and pair.pieces.invalidations == 0 and pair.pieces.replays == 4
    finally:
        demo.store.set_bits(8)


@pytest.mark.gpu
def test_engine_decodes_the_same_tokens_with_mixed_graphs(demo):
    from pwruntime.engine import EngineConfig, LLMEngine
    from pwruntime.sampling import SamplingParams

    prompts = ["And God said unto Moses, " * 6, "def main(", "You will meet a tall stranger. " * 3, "The"]
    tokens, engines = {}, {}
    for mixed in (False, True):
        engine = LLMEngine(demo.model, EngineConfig(num_kv_blocks=64, max_num_seqs=4, max_num_batched_tokens=64,
                                                    mixed_cuda_graphs=mixed))
        params = SamplingParams(max_tokens=12, ignore_eos=True)
        tokens[mixed] = [o.token_ids for o in engine.generate(prompts, params)]
        engines[mixed] = engine
    assert engines[False].runner.mixed_graphs is None
    g = engines[True].runner.mixed_graphs
    assert g.disabled is None and g.replays >= 2 and g.captures == 1   # chunked prompts: several mixed steps
    assert tokens[True] == tokens[False]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_device_store_moe_of_many_tokens_is_captured(ap_path, dtype):
    """More than 128 tokens in a capture: fp16 runs fused launch sets (its prefill path reads counts back), bf16
    the grouped GEMM over block ids made on the device; the replay equals the store's eager MoE."""
    from pwruntime.prefill_layer import prefill_syncs

    _, _, dev = stores(ap_path, 5, device="cuda", dtype=dtype)
    tokens = 200
    g = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(tokens, dev.hidden, device="cuda", generator=g).to(dtype)
    ids = torch.stack([torch.randperm(8, device="cuda", generator=g)[:2] for _ in range(tokens)])
    wts = torch.softmax(torch.randn(tokens, 2, device="cuda", generator=g), dim=-1)
    norms = torch.zeros(tokens, 2, device="cuda")
    assert prefill_syncs(dev.moe_shape(2), x) == (dtype == torch.float16 or torch.cuda.get_device_capability() < (9, 0))
    dev.moe(1, x, ids, wts, norms)                       # warm-up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = dev.moe(1, x, ids, wts, norms)
    x.copy_(torch.randn(tokens, dev.hidden, device="cuda", generator=g).to(dtype))
    ids.copy_(torch.stack([torch.randperm(8, device="cuda", generator=g)[:2] for _ in range(tokens)]))
    graph.replay()
    want_norms = torch.zeros_like(norms)
    want = dev.moe(1, x, ids, wts, want_norms)
    assert rel(out.float(), want.float()) < 2e-2 and rel(norms, want_norms) < 2e-2


@pytest.mark.gpu
def test_prompt_logprobs_through_the_graphs_equal_eager(demo):
    """Prompt records come from the hidden rows a mixed replay (or a decode replay) hands back: the same as an eager
    engine's, chunked prompts included."""
    from pwruntime.engine import EngineConfig, LLMEngine
    from pwruntime.sampling import SamplingParams

    prompts = ["And God said unto Moses, " * 9, "def main(", "You will meet a tall stranger. " * 4]
    params = SamplingParams(max_tokens=6, ignore_eos=True, prompt_logprobs=3, logprobs=1)
    outs = {}
    for graphs in (False, True):
        engine = LLMEngine(demo.model, EngineConfig(num_kv_blocks=64, max_num_seqs=4, max_num_batched_tokens=64,
                                                    cuda_graphs=graphs))
        outs[graphs] = engine.generate(prompts, params)
        if graphs:
            assert engine.runner.mixed_graphs.replays >= 2 and engine.runner.mixed_graphs.disabled is None
    for eager, graph in zip(outs[False], outs[True]):
        assert len(graph.prompt_logprobs) == len(graph.prompt_token_ids) - 1 > 0
        assert [r.token_id for r in graph.prompt_logprobs] == graph.prompt_token_ids[1:]
        diff = max(abs(a.logprob - b.logprob) for a, b in zip(eager.prompt_logprobs, graph.prompt_logprobs))
        assert diff < 2e-2, diff
        same_top = sum(a.top[0][0] == b.top[0][0] for a, b in zip(eager.prompt_logprobs, graph.prompt_logprobs))
        assert same_top >= 0.95 * len(graph.prompt_logprobs)
        assert graph.token_ids == eager.token_ids
