"""CUDA kernels vs the pure-torch references (needs a GPU and CuPy; skipped cleanly without CUDA).

Blocks are random bit-planes (any bit pattern is a valid AP block) with sorted random fp16 LUTs;
the references dequantize them with pwruntime.quant.pack.dequantize. Outputs and scratch buffers
are poisoned with NaN first, so an unwritten element or a read of unwritten scratch fails.
"""
from __future__ import annotations

import math

import pytest
import torch

from pwruntime.kernels import DeviceWeightTable, MoEShape, MoEWorkspace, ap_linear, dequantize_blocks, fused_moe
from pwruntime.kernels.attention import paged_attention_decode
from pwruntime.kernels.bench import random_routing
from pwruntime.kernels.device_table import device_layout
from pwruntime.kernels.moe import moe_plans
from pwruntime.kernels.reference import (ap_linear_one_token_int16_ref, fused_moe_ref, load_pattern_ref,
                                         paged_attention_decode_ref)
from pwruntime.quant.pack import dequantize

pytestmark = pytest.mark.gpu

ARCHS = {  # hidden, intermediate, experts, top-k
    "qwen1.5-moe": (2048, 1408, 60, 4), "mixtral": (4096, 14336, 8, 2),
    "olmoe": (2048, 1024, 64, 8), "qwen3-moe": (2048, 768, 128, 8), "gemma4": (2816, 704, 128, 8),
}
ACTIVATION = {"gemma4": "gelu_tanh"}   # the others' experts: SiLU
TOL = {torch.float16: 3e-3, torch.bfloat16: 1.5e-2}


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    assert torch.isfinite(got).all(), "non-finite output (unwritten or NaN scratch read)"
    return float((got.double() - want.double()).norm() / want.double().norm())


def random_block(out: int, inp: int, gen: torch.Generator):
    words = -(-inp // 32)
    planes = torch.randint(-2**31, 2**31 - 1, (8, out, words), dtype=torch.int32, device="cuda", generator=gen)
    if inp % 32:  # layout v1: padding bits are zero
        planes[:, :, -1] &= (1 << (inp % 32)) - 1
    scale = 1 / math.sqrt(inp)  # weight-like magnitudes keep fp16 activations in range
    luts = {b: (torch.sort(torch.randn(out, 1 << b, device="cuda", generator=gen), dim=1)[0] * scale).half()
            for b in range(1, 9)}
    return planes, luts


class Model:
    """Random AP expert blocks for `layers` MoE layers of an architecture, all 8 planes resident."""

    def __init__(self, arch: str, layers: int = 2, seed: int = 0):
        h, i, e, k = ARCHS[arch]
        self.shape = MoEShape(e, h, i, k, ACTIVATION.get(arch, "silu"))
        self.gen = torch.Generator(device="cuda").manual_seed(seed)
        self.table = DeviceWeightTable(layers * e * 2, "cuda")
        self.blocks = {}
        for layer in range(layers):
            for ex in range(e):
                for kind, (o, inp) in enumerate([(2 * i, h), (h, i)]):
                    planes, luts = random_block(o, inp, self.gen)
                    blk = self.shape.block(layer, ex, kind)
                    self.blocks[blk] = (planes, luts, o, inp)
                    self.table.set_block(blk, device_layout(planes), luts[8], 8)
        self._cache = {}

    def set_bits(self, bits_of) -> None:
        self._cache.clear()
        for blk, (_, luts, _, _) in self.blocks.items():
            self.table.commit_bits(blk, int(bits_of(blk)), luts[int(bits_of(blk))])

    def set_random_bits(self, seed: int) -> None:
        """Every block at its own bits, drawn uniformly from 3..8."""
        gen = torch.Generator().manual_seed(seed)
        bits = {blk: int(torch.randint(3, 9, (1,), generator=gen)) for blk in self.blocks}
        self.set_bits(lambda blk: bits[blk])

    def weight(self, blk: int) -> torch.Tensor:
        b = self.table.bits(blk)
        key = (blk, b)
        if key not in self._cache:
            planes, luts, o, inp = self.blocks[blk]
            self._cache[key] = dequantize(planes[:b], luts[b], o, inp)
        return self._cache[key]

    def ref(self, layer, x, ids, w):
        s = self.shape
        return fused_moe_ref(x, ids, w, lambda e: self.weight(s.block(layer, e, 0)),
                             lambda e: self.weight(s.block(layer, e, 1)), s.activation)

    def routing(self, tokens: int):
        return random_routing(self.shape, tokens, self.gen)


@pytest.fixture(scope="module", params=sorted(ARCHS))
def model(request):
    m = Model(request.param, layers=2 if request.param != "mixtral" else 1)
    yield m
    del m
    torch.cuda.empty_cache()


def _workspace(m: Model, tokens: int, dtype) -> MoEWorkspace:
    ws = MoEWorkspace.create(m.shape, tokens, dtype, "cuda")
    ws.act.fill_(float("nan"))
    ws.partial.fill_(float("nan"))
    return ws


def _check_fused_moe(m: Model, layer: int, ids, w, dtype=torch.float16) -> None:
    """fused_moe on random activations follows the reference, and a second call gives the same bits."""
    tokens = ids.shape[0]
    x = torch.randn(tokens, m.shape.hidden, device="cuda", generator=m.gen).to(dtype)
    ws = _workspace(m, tokens, dtype)
    got = fused_moe(m.table, layer, x, ids, w, m.shape, ws)
    err = rel(got, m.ref(layer, x, ids, w))
    assert err < TOL[dtype], (dtype, tokens, err)
    assert torch.equal(got, fused_moe(m.table, layer, x, ids, w, m.shape, ws)), "non-deterministic result (race?)"


def test_planner_occupancy_model_matches_the_driver():
    """moe.occupancy_xs_cap models an SM's CTAs from the launch bounds and STATIC_SMEM: the driver's occupancy
    calculator agrees for every planned launch of the four architectures, so the capped stage does hold 4 CTAs."""
    from pwruntime.kernels import compile as kc
    from pwruntime.kernels import moe
    dev = torch.device("cuda")
    for h, i, e, k in ARCHS.values():
        for tokens in (1, 4, 8, 16, 32, 64):
            for p in moe_plans(MoEShape(e, h, i, k), tokens):
                kern = p.kernel(dev, torch.float16)
                assert kern.shared_size_bytes <= moe.STATIC_SMEM, (p, kern.shared_size_bytes)
                assert kc.ctas_per_sm(kern, 32 * p.warps, p.smem) == moe.ctas_per_sm(p), ((h, i, e, k), tokens, p)


def test_fused_moe_mixed_bits_all_token_counts(model):
    m = model
    m.set_random_bits(1)
    layer = max(0, m.table.num_blocks // (2 * m.shape.num_experts) - 1)
    for dtype in (torch.float16, torch.bfloat16):
        for tokens in ((1, 2, 7, 16, 20, 33, 64) if dtype == torch.float16 else (1, 16, 64)):
            ids, w = m.routing(tokens)
            _check_fused_moe(m, layer, ids, w, dtype)


def test_fused_moe_experts_beyond_one_token_group(model):
    """Every token routed to the same top-k experts: each gets more tokens than one CTA's n-tiles hold."""
    m = model
    m.set_random_bits(2)
    s = m.shape
    for tokens in (33, 64):
        hot = torch.randperm(s.num_experts, device="cuda", generator=m.gen)[:s.top_k]   # every token's experts
        ids = torch.stack([hot[torch.randperm(s.top_k, device="cuda", generator=m.gen)] for _ in range(tokens)])
        w = torch.softmax(torch.randn(tokens, s.top_k, device="cuda", generator=m.gen), dim=-1)
        p1, _ = moe_plans(s, tokens)
        per_expert = torch.bincount(ids.flatten(), minlength=s.num_experts).max().item()
        assert per_expert > 8 * p1.nt, "the case must need more than one token group"
        _check_fused_moe(m, 0, ids, w)


def test_fused_moe_overflow_slots_serve_small_token_groups(model, monkeypatch):
    """Token groups of 8 (tune --group-tokens 8) under skewed routing: in one launch experts of one to eight groups,
    every further group served by an overflow slot (cuda/ap_route.cuh)."""
    from pwruntime.kernels import moe
    monkeypatch.setattr(moe, "GROUP_TOKENS", 8)
    m = model
    m.set_random_bits(4)
    s = m.shape
    for tokens in (16, 64):
        ids, w = random_routing(s, tokens, m.gen, zipf=2.0)  # popularity 1 / rank^2: a few experts get most tokens
        p1, p2 = moe_plans(s, tokens)
        assert p1.nt == p2.nt == 1 and p1.token_groups > 1
        counts = torch.bincount(ids.flatten(), minlength=s.num_experts)
        assert int(((counts - 1).clamp(min=0) // 8).sum()) >= 2, "the case must use several overflow slots"
        _check_fused_moe(m, 0, ids, w)


def test_fused_moe_uniform_bits(model):
    m = model
    tokens = 7
    ids, w = m.routing(tokens)
    x = torch.randn(tokens, m.shape.hidden, device="cuda", generator=m.gen).half()
    ws = _workspace(m, tokens, torch.float16)
    for b in range(3, 9):
        m.set_bits(lambda blk: b)
        err = rel(fused_moe(m.table, 0, x, ids, w, m.shape, ws), m.ref(0, x, ids, w))
        assert err < TOL[torch.float16], (b, err)


def test_graph_replay_follows_bits_and_routing():
    m = Model("qwen1.5-moe", layers=2, seed=3)
    tokens, dtype = 4, torch.float16
    m.set_bits(lambda blk: 8)
    ids, w = m.routing(tokens)
    x = torch.randn(tokens, m.shape.hidden, device="cuda", generator=m.gen).to(dtype)
    ws = _workspace(m, tokens, dtype)

    def step():
        h = fused_moe(m.table, 0, x, ids, w, m.shape, ws)
        return fused_moe(m.table, 1, h, ids, w, m.shape, ws)

    def ref():
        return m.ref(1, m.ref(0, x, ids, w), ids, w)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # warm-up: compile, load, set shared-memory limits outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    graph.replay()
    torch.cuda.synchronize()
    first = out.clone()
    assert rel(first, ref()) < 5e-3

    gen = torch.Generator().manual_seed(5)
    new_bits = {blk: int(torch.randint(3, 8, (1,), generator=gen)) for blk in m.blocks}
    m.set_bits(lambda blk: new_bits[blk])  # table writes only: same graph
    graph.replay()
    torch.cuda.synchronize()
    assert rel(out, ref()) < 5e-3
    assert rel(out, first) > 1e-2

    ids2, w2 = m.routing(tokens)
    ids.copy_(ids2)
    w.copy_(w2)
    graph.replay()
    torch.cuda.synchronize()
    assert rel(out, ref()) < 5e-3


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("out_f,in_f", [(200, 1000), (48, 80), (14336, 4096), (4096, 1408)])
def test_ap_linear_every_bitwidth(dtype, out_f, in_f):
    gen = torch.Generator(device="cuda").manual_seed(out_f + in_f)
    planes, luts = random_block(out_f, in_f, gen)
    table = DeviceWeightTable(2, "cuda")
    table.set_block(1, device_layout(planes), luts[8], 8)
    for b in range(3, 9):
        table.commit_bits(1, b, luts[b])
        w = dequantize(planes[:b], luts[b], out_f, in_f)
        for tokens in (1, 2, 7, 16, 20, 64):  # the long-K block: 8-, 16-, 16-, 16- (two n-tiles), 4-, 4-warp CTAs
            x = torch.randn(tokens, in_f, device="cuda", generator=gen).to(dtype)
            got = ap_linear(table, 1, x, out_f)
            want = x.float() @ w.to(dtype).float().T
            err = rel(got, want)
            assert err < TOL[dtype] / 2, (b, tokens, err)


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_ap_linear_waits_for_the_kernel_that_writes_its_input(graph):
    """ap_linear is a programmatic dependent launch that loads its weights before waiting for the kernel before it:
    a chain of blocks, each reading what the block just before it (or a torch kernel just before it) wrote, must
    match the same chain computed from dequantized weights, eagerly and replayed from a graph on a new input."""
    dim, steps = 4096, 6
    gen = torch.Generator(device="cuda").manual_seed(21)
    table = DeviceWeightTable(steps, "cuda")
    weights = []
    for i in range(steps):
        planes, luts = random_block(dim, dim, gen)
        b = 3 + i % 6
        table.set_block(i, device_layout(planes), luts[8], 8)
        table.commit_bits(i, b, luts[b])
        weights.append(dequantize(planes[:b], luts[b], dim, dim).half().float())
    x = torch.randn(2, dim, device="cuda", generator=gen).half()

    def chain() -> torch.Tensor:
        h = x
        for i in range(steps):
            h = ap_linear(table, i, h * 2.0 if i % 2 else h, dim)  # odd steps read a torch kernel's output
        return h

    def want() -> torch.Tensor:
        h = x.float()
        for i in range(steps):
            h = (h * 2.0 if i % 2 else h).half().float() @ weights[i].T
        return h

    if graph:
        from pwruntime.kernels.bench import capture
        out = {}
        g = capture(lambda: out.__setitem__("h", chain()))
        x.normal_(generator=gen)  # a new input after the capture: the replay must read it
        g.replay()
        torch.cuda.synchronize()
        got = out["h"]
    else:
        got = chain()
    assert rel(got, want()) < 1e-2


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_ap_linear_wide_dynamic_range(dtype):
    """Rows whose LUTs span 10^-3..10^1 and tokens whose 512-column chunks span 10^-3..10^3 (one chunk all zero):
    every row must match the reference as closely as on ordinary inputs (the error is measured with each row
    divided by its scale, so small rows count), at 3, 4 and 8 bits and T of one n-tile. A decoder that rescales
    per row or chunk (such as the int8-halves experiment of cuda/NOTES.md, session 12) must pass this too."""
    out_f, in_f = 256, 4096
    gen = torch.Generator(device="cuda").manual_seed(12)
    planes, luts = random_block(out_f, in_f, gen)
    row_scale = 10.0 ** (torch.rand(out_f, 1, device="cuda", generator=gen) * 4 - 3)  # fp16 outputs stay finite
    table = DeviceWeightTable(1, "cuda")
    table.set_block(0, device_layout(planes), (luts[8].float() * row_scale).half(), 8)
    chunk_scale = torch.tensor([1e3, 1e-3, 0.0, 1.0, 3e2, 1e-2, 5.0, 1e3], device="cuda").repeat_interleave(512)
    for b in (3, 4, 8):
        lut = (luts[b].float() * row_scale).half()
        table.commit_bits(0, b, lut)
        w = dequantize(planes[:b], lut, out_f, in_f)
        for tokens in (1, 3, 8):
            x = (torch.randn(tokens, in_f, device="cuda", generator=gen) * chunk_scale).to(dtype)
            got = ap_linear(table, 0, x, out_f)
            want = x.float() @ w.to(dtype).float().T
            err = rel(got.float() / row_scale.T, want / row_scale.T)  # every row counts, whatever its scale
            assert err < TOL[dtype] / 2, (b, tokens, err)


@pytest.mark.parametrize("bits", [3, 4])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_one_token_3_and_4_bit_blocks_decode_on_the_binary_tensor_cores(dtype, bits):
    """One token at 3 or 4 bits takes the int16-activation decode (cuda/ap_b1.cuh). Each 512-column chunk gets one large
    activation (2000 times the others) in a column whose code maps to a zero LUT entry: it sets the chunk's int16 step
    without adding to the product, so `ap_linear_one_token_int16_ref` sits about 2% from the exact product, and the
    kernel must follow it. With three tokens the same block takes the 16-bit decode and follows the exact product."""
    out_f, in_f = 512, 4096 + 96  # a partial last chunk
    gen = torch.Generator(device="cuda").manual_seed(15 + bits)
    planes, luts = random_block(out_f, in_f, gen)
    spikes = list(range(7, in_f, 512))
    for k in spikes:  # code 0 in every row
        bit = 1 << (k % 32)
        planes[:bits, :, k // 32] &= ~(bit if bit < 2**31 else bit - 2**32)
    lut = luts[bits].clone()
    lut[:, 0] = 0.0
    table = DeviceWeightTable(1, "cuda")
    table.set_block(0, device_layout(planes), luts[8], 8)
    table.commit_bits(0, bits, lut)
    w = dequantize(planes[:bits], lut, out_f, in_f)
    x = torch.randn(3, in_f, device="cuda", generator=gen)
    x[:, spikes] = 2e3
    x = x.to(dtype)
    want = ap_linear_one_token_int16_ref(x[:1], w)
    exact = x.float() @ w.to(dtype).float().T
    assert rel(want.float(), exact[:1]) > 1e-2  # the case tells the two decodes apart
    assert rel(ap_linear(table, 0, x[:1], out_f), want) < TOL[dtype] / 2
    assert rel(ap_linear(table, 0, x, out_f), exact) < TOL[dtype] / 2


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("out_f, in_f", [(96, 333), (100, 352)], ids=["per-thread-stores", "staged-stores"])
def test_dequantize_kernel_is_exact(dtype, out_f, in_f):
    """Every element of blocks at 3..8 bits and of a block cleared from the table (zeros). K = 333 takes the
    per-thread stores; K = 352 (a multiple of 32) the warp's shared-memory stage, and 100 x 11 words leave the
    last warp of the last CTA partly past the end."""
    gen = torch.Generator(device="cuda").manual_seed(9)
    table = DeviceWeightTable(7, "cuda")
    want = []
    for blk, b in zip(range(7), (3, 4, 5, 6, 7, 8, 4)):
        planes, luts = random_block(out_f, in_f, gen)
        table.set_block(blk, device_layout(planes), luts[b], b)
        want.append(dequantize(planes[:b], luts[b], out_f, in_f).to(dtype))
    table.clear(6)
    want[6] = torch.zeros(out_f, in_f, dtype=dtype, device="cuda")
    order = [4, 6, 0, 5, 2, 1, 3]
    got = dequantize_blocks(table, order, out_f, in_f, dtype)
    assert torch.equal(got, torch.stack([want[i] for i in order]))


def _attention_case(gen, lens, heads, kv_heads, dim, dtype, block_size=16, spare_blocks=7):
    """Random caches whose blocks are scattered (a permutation) with -1 padding in the block table."""
    max_blocks = -(-max(lens) // block_size)
    num_blocks = sum(-(-n // block_size) for n in lens) + spare_blocks
    kc = torch.randn(num_blocks, block_size, kv_heads, dim, device="cuda", generator=gen).to(dtype)
    vc = torch.randn(num_blocks, block_size, kv_heads, dim, device="cuda", generator=gen).to(dtype)
    perm = torch.randperm(num_blocks, device="cuda", generator=gen)
    tables = torch.full((len(lens), max_blocks), -1, dtype=torch.int32, device="cuda")
    used = 0
    for s, n in enumerate(lens):
        nb = -(-n // block_size)
        tables[s, :nb] = perm[used:used + nb].int()
        used += nb
    cl = torch.tensor(lens, dtype=torch.int32, device="cuda")
    q = torch.randn(len(lens), heads, dim, device="cuda", generator=gen).to(dtype)
    return q, kc, vc, tables, cl


ATTN_TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1e-2}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_paged_attention_matches_reference(dtype):
    gen = torch.Generator(device="cuda").manual_seed(11)
    q, kc, vc, tables, cl = _attention_case(gen, [1, 17, 300, 64, 129], 32, 8, 128, dtype)
    got = paged_attention_decode(q, kc, vc, tables, cl)
    want = paged_attention_decode_ref(q, kc, vc, tables, cl, 1 / math.sqrt(128))
    assert rel(got, want) < ATTN_TOL[dtype]


# (lens, heads, kv_heads, dim): groups 1, 2, 4, 5, 6, 8, 16 (sliced into CTAs of up to 4 heads) and every
# head_dim of the GQA kernel (Gemma 4's global 512, group 8: CTAs of 2 heads, two loads a lane); a head_dim it does not
# take (96), served by the generic one
@pytest.mark.parametrize("case", [
    ([1, 17, 300, 64, 129], 16, 16, 128), ([5, 64, 65, 1000], 16, 2, 64), ([33, 129, 2], 16, 2, 256),
    ([7, 2048], 32, 8, 128), ([3, 900], 32, 4, 128), ([40, 41], 8, 4, 96), ([50, 3], 32, 2, 64),
    ([77, 20], 10, 2, 128), ([600, 9], 12, 2, 128), ([70, 1025, 1], 16, 2, 512), ([5000], 16, 2, 512),
    ([30, 7], 10, 2, 512)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_paged_attention_every_group_and_head_dim(case, dtype):
    lens, heads, kv_heads, dim = case
    gen = torch.Generator(device="cuda").manual_seed(len(lens) * heads + dim)
    q, kc, vc, tables, cl = _attention_case(gen, lens, heads, kv_heads, dim, dtype)
    got = paged_attention_decode(q, kc, vc, tables, cl, scale=0.7 / math.sqrt(dim))
    want = paged_attention_decode_ref(q, kc, vc, tables, cl, 0.7 / math.sqrt(dim))
    assert rel(got, want) < ATTN_TOL[dtype]
    generic = paged_attention_decode(q, kc, vc, tables, cl, scale=0.7 / math.sqrt(dim), generic=True)
    assert rel(generic, want) < ATTN_TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_paged_attention_context_split_merges_parts(dtype):
    """One or two sequences over long contexts take the split path; parts past a short context are empty."""
    from pwruntime.kernels.attention import context_parts, heads_per_cta
    gen = torch.Generator(device="cuda").manual_seed(5)
    for lens in ([5000], [4100, 3], [1, 4096]):
        q, kc, vc, tables, cl = _attention_case(gen, lens, 32, 8, 128, dtype)
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        assert context_parts(len(lens) * 8 * 4 // heads_per_cta(4, 128), tables.shape[1] * 16, sms) > 1
        got = paged_attention_decode(q, kc, vc, tables, cl)
        want = paged_attention_decode_ref(q, kc, vc, tables, cl, 1 / math.sqrt(128))
        assert rel(got, want) < ATTN_TOL[dtype], lens
        # the same shapes in a CUDA graph, replayed after the lengths change
        cl2 = cl.clone()
        graph = torch.cuda.CUDAGraph()
        paged_attention_decode(q, kc, vc, tables, cl2)
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            out = paged_attention_decode(q, kc, vc, tables, cl2)
        cl2.copy_(torch.clamp(cl - 1000, min=1))
        graph.replay()
        want2 = paged_attention_decode_ref(q, kc, vc, tables, cl2, 1 / math.sqrt(128))
        assert rel(out, want2) < ATTN_TOL[dtype], lens


# (lens, heads, kv_heads, dim): the GQA kernel at Gemma 4's sliding layers (256-wide heads, group 2), its split path
# (one long context), its 512-wide heads (Gemma 4's global layers); the generic kernel on fp32 caches below
@pytest.mark.parametrize("case", [([1, 63, 64, 65, 300, 1030], 16, 8, 256), ([4100], 32, 8, 128),
                                  ([70, 1025, 1, 700], 16, 2, 512)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_paged_attention_sliding_window_keeps_the_last_tokens(case, dtype):
    """A sliding-window layer's decode: each query sees its context's last `window` tokens (all of a shorter one),
    as the reference; the split path cuts only those tokens into parts. Differs from the full context's attention."""
    lens, heads, kv_heads, dim = case
    gen = torch.Generator(device="cuda").manual_seed(dim + len(lens))
    q, kc, vc, tables, cl = _attention_case(gen, lens, heads, kv_heads, dim, dtype)
    scale = 1 / math.sqrt(dim)
    for window in (64, 1024):
        got = paged_attention_decode(q, kc, vc, tables, cl, scale, window=window)
        want = paged_attention_decode_ref(q, kc, vc, tables, cl, scale, window)
        assert rel(got, want) < ATTN_TOL[dtype], window
        full = paged_attention_decode_ref(q, kc, vc, tables, cl, scale)
        cut = [s for s, n in enumerate(lens) if n > window + 16]   # the window drops at least 16 tokens
        assert all(rel(got[s], full[s]) > 2 * ATTN_TOL[dtype] for s in cut)
    fp32 = [t.float() for t in (q, kc, vc)]
    got = paged_attention_decode(fp32[0], fp32[1], fp32[2], tables, cl, scale, window=64)   # the generic kernel
    assert rel(got, paged_attention_decode_ref(*fp32, tables, cl, scale, 64)) < ATTN_TOL[torch.float32]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_kv_pointer_table_reads_and_writes_the_caches(dtype):
    """Through a [K, V] pointer table (KVCache.ptrs), the decode kernels equal their direct-pointer selves bit for
    bit, and the K/V write kernel equals index_copy_ for strided rows (views of a fused q/k/v buffer, as the
    model passes them); after the caches are replaced and the table rewritten, one captured graph reads and writes
    the new tensors."""
    from pwruntime.kernels.attention import write_kv
    gen = torch.Generator(device="cuda").manual_seed(21)
    q, kc, vc, tables, cl = _attention_case(gen, [1, 17, 300, 64], 16, 2, 64, dtype)
    ptrs = torch.tensor([kc.data_ptr(), vc.data_ptr()], dtype=torch.int64, device="cuda")
    assert torch.equal(paged_attention_decode(q, kc, vc, tables, cl, kv_ptrs=ptrs),
                       paged_attention_decode(q, kc, vc, tables, cl))
    n, hq, hk, d = 7, 16, 2, 64
    qkv = torch.randn(n, (hq + 2 * hk) * d, device="cuda", generator=gen).to(dtype)
    k = qkv[:, hq * d:(hq + hk) * d].view(n, hk, d)
    v = qkv[:, (hq + hk) * d:].view(n, hk, d)
    slots = torch.randperm(kc.shape[0] * kc.shape[1], device="cuda", generator=gen)[:n]
    want_k, want_v = kc.clone(), vc.clone()
    write_kv(k, v, want_k, want_v, slots)                       # no table: the index_copy_ reference
    write_kv(k, v, kc, vc, slots, ptrs)
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)
    if dtype == torch.float32:
        return
    static_slots, static_q = slots.clone(), q.clone()
    write_kv(k, v, kc, vc, static_slots, ptrs)
    paged_attention_decode(static_q, kc, vc, tables, cl, kv_ptrs=ptrs)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        write_kv(k, v, kc, vc, static_slots, ptrs)
        out = paged_attention_decode(static_q, kc, vc, tables, cl, kv_ptrs=ptrs)
    kc2, vc2 = torch.randn_like(kc.float()).to(dtype), torch.randn_like(vc.float()).to(dtype)   # the "resized" caches
    ptrs.copy_(torch.tensor([kc2.data_ptr(), vc2.data_ptr()], dtype=torch.int64))
    want_k, want_v = kc2.clone(), vc2.clone()
    write_kv(k, v, want_k, want_v, static_slots)
    graph.replay()
    assert torch.equal(kc2, want_k) and torch.equal(vc2, want_v)
    assert torch.equal(out, paged_attention_decode(static_q, kc2, vc2, tables, cl))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_kv_write_reads_k_and_v_at_their_head_stride(dtype):
    """The K/V write kernel takes any head stride (here heads padded to 80 of which 64 are the row), as its
    index_copy_ reference does."""
    from pwruntime.kernels.attention import write_kv
    gen = torch.Generator(device="cuda").manual_seed(5)
    n, hk, d = 9, 4, 64
    kc, vc = (torch.zeros(6, 16, hk, d, dtype=dtype, device="cuda") for _ in range(2))
    k, v = (torch.randn(n, hk, d + 16, device="cuda", generator=gen).to(dtype)[:, :, :d] for _ in range(2))
    assert k.stride(1) == d + 16
    slots = torch.randperm(6 * 16, device="cuda", generator=gen)[:n]
    ptrs = torch.tensor([kc.data_ptr(), vc.data_ptr()], dtype=torch.int64, device="cuda")
    want_k, want_v = kc.clone(), vc.clone()
    write_kv(k, v, want_k, want_v, slots)
    write_kv(k, v, kc, vc, slots, ptrs)
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)


@pytest.mark.parametrize("mode", [0, 1, 2])
def test_load_pattern_probe_reads_every_word_once(mode):
    """The load microbenchmark (cuda/load_pattern.cu) XORs every word it reads: in each access pattern and
    k-split that equals the XOR of all words of the three planes, so each word is read exactly once."""
    from pwruntime.kernels.tune import launch_load_pattern
    gen = torch.Generator(device="cuda").manual_seed(mode)
    rows, words = 128, 32
    planes = [torch.randint(-2**31, 2**31 - 1, (rows * words,), dtype=torch.int32, device="cuda", generator=gen)
              for _ in range(3)]
    want = load_pattern_ref(planes)
    for ksplit in (1, 2, 4):
        sink = torch.zeros(1, dtype=torch.int32, device="cuda")
        launch_load_pattern(planes, rows, words, ksplit, mode, sink)
        assert int(sink.item()) & 0xFFFFFFFF == want, (mode, ksplit)
    planes[1][77] ^= 1  # one flipped bit anywhere changes the result
    assert load_pattern_ref(planes) == want ^ 1
