"""The decoder layer's fused kernels (cuda/layer_ops.cu) against their pure-torch references, and a model forward
with them against the same forward on the references, for every architecture."""
from __future__ import annotations

import pytest
import torch

from model_fixtures import ARCHS, make_tiny_checkpoint
from pwruntime.kernels import layer_ops
from pwruntime.kernels.reference import (add_rms_norm_ref, gated_add_ref, move_rows_ref, rotary_ref, route_topk_ref,
                                         row_norms_ref, act_mul_ref, slot_combine_ref)
from pwruntime.kv_cache import KVCache
from pwruntime.model import load_model, prefill_metadata
from pwruntime.model.layers import Rotary

pytestmark = pytest.mark.gpu
DTYPES = (torch.float16, torch.bfloat16)


def _rand(*shape, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(*shape, generator=g, device="cuda", dtype=torch.float32).to(dtype)


def _mostly_exact(got: torch.Tensor, ref: torch.Tensor, ulps: float, share: float = 0.99) -> None:
    """Within `ulps` units in the last place of the dtype everywhere, and bit-equal in at least `share` of places
    (the kernels round where torch rounds; only float32 sums may differ in order)."""
    eps = torch.finfo(ref.dtype).eps
    torch.testing.assert_close(got.float(), ref.float(), atol=ulps * eps, rtol=ulps * eps)
    assert (got == ref).float().mean().item() >= share


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cols", [64, 256, 1408, 2048, 4096])
def test_add_rms_norm(dtype, cols):
    wide = _rand(33, cols + 40, dtype=dtype)
    x = wide[:, 40:]                                  # rows with a stride (a split view)
    delta, weight = _rand(33, cols, dtype=dtype, seed=1), _rand(cols, dtype=dtype, seed=2)
    s, out = layer_ops.add_rms_norm(x, delta, weight, 1e-6)
    ref_s, ref_out = add_rms_norm_ref(x, delta, weight, 1e-6)
    assert torch.equal(s, ref_s)                      # the add rounds exactly as torch's
    _mostly_exact(out, ref_out, ulps=4)
    s2, out2 = layer_ops.add_rms_norm(x, None, weight, 1e-6)
    assert s2 is x
    _mostly_exact(out2, add_rms_norm_ref(x, None, weight, 1e-6)[1], ulps=4)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cols, weighted", [(256, True), (512, False), (2816, True), (4096, False)])
def test_gemma_rms_norm(dtype, cols, weighted):
    """The float-weight order (Gemma 4's norms: hidden rows, the per-head q/k norms, the weightless v and router
    norms) against its reference, rows with a stride, with and without the residual add."""
    wide = _rand(37, cols + 24, dtype=dtype)
    x = wide[:, 24:]
    delta = _rand(37, cols, dtype=dtype, seed=1)
    weight = _rand(cols, dtype=dtype, seed=2) + 1 if weighted else None
    for d in (delta, None):
        s, out = layer_ops.add_rms_norm(x, d, weight, 1e-6, float_weight=True)
        ref_s, ref_out = add_rms_norm_ref(x, d, weight, 1e-6, float_weight=True)
        assert torch.equal(s, ref_s)
        _mostly_exact(out, ref_out, ulps=4)
    if weighted:   # the other order rounds before the weight: a kernel that ignored the mode would match it instead
        other = add_rms_norm_ref(x, None, weight, 1e-6)[1]
        assert not torch.equal(layer_ops.add_rms_norm(x, None, weight, 1e-6, float_weight=True)[1], other)


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_adds_eps_inside_the_root(dtype):
    """eps counts: a large one shrinks every output, and a row that sums to zero comes out zero, not NaN."""
    x, weight = _rand(8, 256, dtype=dtype), _rand(256, dtype=dtype, seed=2)
    delta = _rand(8, 256, dtype=dtype, seed=1)
    delta[3] = -x[3]                                  # row 3 sums to exactly zero
    for eps in (1e-6, 1.0):
        s, out = layer_ops.add_rms_norm(x, delta, weight, eps)
        ref_s, ref_out = add_rms_norm_ref(x, delta, weight, eps)
        assert not s[3].any() and torch.isfinite(out).all() and not out[3].any()
        _mostly_exact(out, ref_out, ulps=4)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 2, 64), (16, 16, 128), (32, 4, 128)])
def test_rotary_kv_writes_the_cache_through_the_table(dtype, heads, kv_heads, dim):
    tokens = 21
    qkv = _rand(tokens, (heads + 2 * kv_heads) * dim, dtype=dtype)
    q, k, v = (t.view(tokens, -1, dim) for t in qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1))
    positions = torch.randint(0, 4000, (tokens,), device="cuda")
    cos, sin = Rotary(dim, 10000.0, device="cuda").cos_sin(positions, dtype)
    kv = KVCache(1, 8, 16, kv_heads, dim, dtype, "cuda")
    slots = torch.randperm(8 * 16, device="cuda")[:tokens]
    q_rot, k_rot = layer_ops.rotary_kv(q, k, v, cos, sin, kv.k[0], kv.v[0], slots, kv.layer_ptrs(0))
    assert torch.equal(q_rot, rotary_ref(q, cos, sin)) and torch.equal(k_rot, rotary_ref(k, cos, sin))
    assert q_rot.is_contiguous() and k_rot.is_contiguous()
    assert torch.equal(kv.k[0].view(-1, kv_heads, dim)[slots], k_rot)
    assert torch.equal(kv.v[0].view(-1, kv_heads, dim)[slots], v)
    untouched = torch.ones(8 * 16, dtype=torch.bool, device="cuda")
    untouched[slots] = False
    assert not kv.k[0].view(-1, kv_heads, dim)[untouched].any()
    # without the table: the same rotation, the write by index_copy_
    kv2 = KVCache(1, 8, 16, kv_heads, dim, dtype, "cuda")
    layer_ops.rotary_kv(q, k, v, cos, sin, kv2.k[0], kv2.v[0], slots, None)
    assert torch.equal(kv2.k[0], kv.k[0]) and torch.equal(kv2.v[0], kv.v[0])


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_kv_reads_q_k_v_at_their_head_strides(dtype):
    """q, k and v with heads padded past their rows (head stride 80, rows of 64): the same rotation and cache rows
    as from contiguous copies."""
    tokens, heads, kv_heads, dim = 11, 4, 2, 64
    q, k, v = (_rand(tokens, h, dim + 16, dtype=dtype, seed=s)[:, :, :dim]
               for s, h in enumerate((heads, kv_heads, kv_heads)))
    cos, sin = Rotary(dim, 10000.0, device="cuda").cos_sin(torch.arange(tokens, device="cuda") * 7, dtype)
    slots = torch.randperm(4 * 16, device="cuda")[:tokens]
    got, want = KVCache(1, 4, 16, kv_heads, dim, dtype, "cuda"), KVCache(1, 4, 16, kv_heads, dim, dtype, "cuda")
    q_rot, k_rot = layer_ops.rotary_kv(q, k, v, cos, sin, got.k[0], got.v[0], slots, got.layer_ptrs(0))
    q_ref, k_ref = layer_ops.rotary_kv(q.contiguous(), k.contiguous(), v.contiguous(), cos, sin, want.k[0], want.v[0],
                                       slots, want.layer_ptrs(0))
    assert torch.equal(q_rot, q_ref) and torch.equal(k_rot, k_ref)
    assert torch.equal(got.k[0], want.k[0]) and torch.equal(got.v[0], want.v[0]) and got.v[0].any()


@pytest.mark.parametrize("renorm", [False, True])
def test_route_topk_breaks_ties_by_the_lower_expert_id(renorm):
    """Equal weights are taken in ascending expert id (the kernel's stated order; torch.topk leaves it open)."""
    experts, top_k = 64, 8
    logits = torch.zeros(3, experts, dtype=torch.float16, device="cuda")
    logits[1, [40, 9, 33]] = 1.0                      # three equal leaders, then ties among the rest
    weights, ids = layer_ops.route_topk(logits, top_k, renorm)
    assert ids[0].tolist() == list(range(top_k)) and ids[2].tolist() == list(range(top_k))
    assert ids[1].tolist() == [9, 33, 40, 0, 1, 2, 3, 4]
    assert torch.equal(weights[0], weights[0, :1].expand(top_k))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("experts,top_k", [(8, 2), (16, 4), (60, 4), (64, 8), (128, 8), (256, 8)])
@pytest.mark.parametrize("renorm", [False, True])
def test_route_topk(dtype, experts, top_k, renorm):
    tokens = 37
    g = torch.Generator().manual_seed(experts + top_k)
    # distinct logits in every row (the order of equal weights is not specified by torch.topk): n / 32, exact in both
    base = (torch.arange(experts, dtype=torch.float32) - experts // 2).div(32).to(dtype)
    assert base.unique().numel() == experts
    logits = torch.stack([base[torch.randperm(experts, generator=g)] for _ in range(tokens)]).cuda()
    weights, ids = layer_ops.route_topk(logits, top_k, renorm)
    ref_w, ref_ids = route_topk_ref(logits, top_k, renorm)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_w, atol=0, rtol=2e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_row_norms_and_elementwise(dtype):
    x = _rand(130, 1408, dtype=dtype)
    torch.testing.assert_close(layer_ops.row_norms(x), row_norms_ref(x), atol=0, rtol=2e-6)
    out = torch.full((26, 5), -1.0, device="cuda")
    assert layer_ops.row_norms(x, out=out) is out
    torch.testing.assert_close(out.view(-1), row_norms_ref(x), atol=0, rtol=2e-6)
    h = _rand(19, 2 * 1408 + 16, dtype=dtype)[:, 16:]          # rows with a stride
    for act in ("silu", "gelu_tanh"):
        got = layer_ops.act_mul(h, act)
        _mostly_exact(got, act_mul_ref(h, act), ulps=2)
    assert not torch.equal(got, act_mul_ref(h, "silu"))   # the mode reaches the kernel
    # a count on the device: the rows below it as without one, the others left as they were (NaN here)
    count = torch.tensor([7], device="cuda")
    got = layer_ops.act_mul(h, "silu", count)
    assert torch.equal(got[:7], layer_ops.act_mul(h[:7], "silu"))
    norms = torch.full((130,), float("nan"), device="cuda")
    layer_ops.row_norms(x, out=norms, count=count)
    assert torch.equal(norms[:7], layer_ops.row_norms(x[:7])) and norms[7:].isnan().all()
    placed = torch.full((260,), float("nan"), device="cuda")    # row r's norm at 2 * (129 - r), the first 7 rows
    layer_ops.row_norms(x, out=placed, count=count, out_index=2 * (129 - torch.arange(130, device="cuda")))
    assert torch.equal(placed[2 * (129 - torch.arange(7, device="cuda"))], norms[:7])
    assert int(placed.isnan().sum()) == 260 - 7
    o, s, gate = _rand(19, 2048, dtype=dtype), _rand(19, 2048, dtype=dtype, seed=1), _rand(19, 1, dtype=dtype, seed=2)
    _mostly_exact(layer_ops.gated_add(o, gate, s), gated_add_ref(o, gate, s), ulps=2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,k,cols", [(1, 1, 64), (7, 2, 2048), (300, 8, 2816), (33, 4, 2824), (5, 8, 12)])
def test_slot_combine(dtype, tokens, k, cols):
    """The kernel's weighted sum of each token's slot rows equals the float32 multiply-adds slot by slot (2824: a
    partial column block; 12: not a multiple of 8, the reference's)."""
    rows = _rand(tokens * k, cols, dtype=dtype)
    weights = torch.rand(tokens, k, device="cuda", generator=torch.Generator(device="cuda").manual_seed(1))
    got = layer_ops.slot_combine(rows, weights)
    assert got.shape == (tokens, cols) and got.dtype == dtype
    _mostly_exact(got, slot_combine_ref(rows, weights), ulps=1)
    # `where`: the slots' rows shuffled among spare NaN rows, each read where it went: the same sums
    perm = torch.randperm(2 * tokens * k, device="cuda", generator=torch.Generator(device="cuda").manual_seed(2))
    moved = torch.full((2 * tokens * k, cols), float("nan"), dtype=dtype, device="cuda")
    moved[perm[:tokens * k]] = rows
    assert torch.equal(layer_ops.slot_combine(moved, weights, perm[:tokens * k]), got)
    rows[k:] = float("nan")                           # the first token reads its own k rows and no others
    assert torch.equal(layer_ops.slot_combine(rows, weights)[0], got[0])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("moves,cols", [(1, 64), (300, 2816), (65, 2824), (1000, 4096)])
def test_move_rows(dtype, moves, cols):
    """The kernel's gathers, scatters and bounded moves equal the reference's, bit for bit (2824: a partial column
    block)."""
    src = _rand(moves + 5, cols, dtype=dtype)
    g = torch.Generator(device="cuda").manual_seed(3)
    gather = torch.randperm(moves + 5, device="cuda", generator=g)[:moves]
    scatter = torch.randperm(2 * moves, device="cuda", generator=g)[:moves]
    for si, di, count in ((gather, None, None), (None, scatter, None), (gather, scatter, None),
                          (gather, scatter, torch.tensor([moves // 2], device="cuda")),
                          (gather, None, torch.tensor(0, device="cuda"))):
        first = src if si is not None else src[:moves]    # without a gather, as many rows as moves
        got = layer_ops.move_rows(first, torch.full((2 * moves + 5, cols), float("nan"), dtype=dtype,
                                                    device="cuda"), si, di, count)
        want = move_rows_ref(first, torch.full((2 * moves + 5, cols), float("nan"), dtype=dtype, device="cuda"),
                             si, di, count)
        expected = moves if count is None else min(moves, int(count))
        assert int((~got.isnan().all(1)).sum()) == expected     # as many rows written as moves below the count
        assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())


@pytest.mark.parametrize("arch", ARCHS)
def test_model_forward_with_the_kernels_equals_the_references(tmp_path, monkeypatch, arch):
    """A prefill and a decode step of each architecture in fp16: the fused layer ops against the same model on the
    torch references (qk norms, clip, the shared expert, dense MLPs all pass through)."""
    path = make_tiny_checkpoint(tmp_path, arch, seed=5)
    model = load_model(path, dtype="fp16", device="cuda")
    prompt = torch.randint(3, model.config.vocab, (23,), generator=torch.Generator().manual_seed(1))

    def run():
        kv = model.new_kv_cache(8, 4)
        out = model.forward(prompt, torch.arange(len(prompt)), kv, prefill_metadata(len(prompt), 4, "cuda"),
                            record=True)
        return model.logits(out.hidden), out.routing, kv

    logits, routing, kv = run()
    monkeypatch.setattr(layer_ops, "_applies", lambda *t: False)
    ref_logits, ref_routing, ref_kv = run()
    scale = ref_logits.abs().mean()
    assert (logits - ref_logits).abs().max() < 0.02 * scale
    assert torch.equal(logits.argmax(-1), ref_logits.argmax(-1))
    for got, ref in zip(routing, ref_routing):
        assert (got.topk_ids == ref.topk_ids).float().mean() > 0.98
        torch.testing.assert_close(got.gate_up_in_norm, ref.gate_up_in_norm, rtol=1e-2, atol=0)
    for a, b in zip(kv.k + kv.v, ref_kv.k + ref_kv.v):
        torch.testing.assert_close(a, b, atol=0.02, rtol=0.02)
