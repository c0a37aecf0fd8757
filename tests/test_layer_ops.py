"""The decoder layer's small ops on CPU (the pure-torch references the CUDA kernels are tested against): what each
computes, checked from first principles, and the arguments they refuse."""
from __future__ import annotations

import math

import pytest
import torch

from pwruntime.kernels import layer_ops
from pwruntime.kv_cache import KVCache
from pwruntime.model.layers import FloatRMSNorm, Linear, Rotary


def test_add_rms_norm_adds_then_normalizes():
    g = torch.Generator().manual_seed(0)
    x, delta = torch.randn(5, 96, generator=g), torch.randn(5, 96, generator=g)
    weight = torch.rand(96, generator=g) + 0.5
    s, out = layer_ops.add_rms_norm(x, delta, weight, 1e-6)
    assert torch.equal(s, x + delta)
    rms = (s.double() ** 2).mean(-1, keepdim=True).add(1e-6).sqrt()
    torch.testing.assert_close(out.double(), s.double() / rms * weight.double(), atol=1e-5, rtol=1e-5)
    s2, out2 = layer_ops.add_rms_norm(s, None, weight, 1e-6)
    assert s2 is s and torch.equal(out2, out)
    # bf16: the norm in float32, rounded to bf16 before the weight multiplies it (as transformers does)
    xb, wb = x.to(torch.bfloat16), weight.to(torch.bfloat16)
    _, outb = layer_ops.add_rms_norm(xb, None, wb, 1e-6)
    normed = (xb.double() / (xb.double() ** 2).mean(-1, keepdim=True).add(1e-6).sqrt()).to(torch.bfloat16)
    assert outb.dtype == torch.bfloat16 and torch.equal(outb, wb * normed)


def test_gemma_rms_norm_weights_in_float32_before_the_one_rounding():
    """float_weight (Gemma 4's order): round(s / rms(s) * weight) in float32, not weight * round(s / rms(s)); without
    a weight the normalisation alone. A weightless norm in the other order is refused."""
    g = torch.Generator().manual_seed(4)
    x, delta = (torch.randn(6, 80, generator=g).to(torch.bfloat16) for _ in range(2))
    w = (torch.rand(80, generator=g) * 3 + 0.5).to(torch.bfloat16)
    s, out = layer_ops.add_rms_norm(x, delta, w, 1e-6, float_weight=True)
    assert torch.equal(s, x + delta)
    normed = s.double() / (s.double() ** 2).mean(-1, keepdim=True).add(1e-6).sqrt()
    want = (normed * w.double()).to(torch.bfloat16)
    assert (out != want).float().mean() < 0.02 and torch.allclose(out.double(), want.double(), rtol=8e-3, atol=0)
    assert not torch.equal(out, layer_ops.add_rms_norm(x, delta, w, 1e-6)[1])   # the orders round differently
    _, bare = layer_ops.add_rms_norm(x, None, None, 1e-6, float_weight=True)
    torch.testing.assert_close(bare, (x.double() / (x.double() ** 2).mean(-1, keepdim=True).add(1e-6).sqrt())
                               .to(torch.bfloat16), atol=0, rtol=8e-3)
    with pytest.raises(ValueError, match="without a weight"):
        layer_ops.add_rms_norm(x, None, None, 1e-6)


def test_rotary_rotates_each_pair_by_its_angle_and_writes_the_cache():
    heads, kv_heads, dim, tokens = 3, 1, 8, 6
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(tokens, h, dim, generator=g) for h in (heads, kv_heads, kv_heads))
    positions = torch.tensor([0, 1, 2, 7, 100, 4095])
    rotary = Rotary(dim, 10000.0)
    cos, sin = rotary.cos_sin(positions, torch.float32)
    kv = KVCache(1, 4, 4, kv_heads, dim)
    slots = torch.tensor([3, 0, 9, 15, 4, 8])
    q_rot, k_rot = layer_ops.rotary_kv(q, k, v, cos, sin, kv.k[0], kv.v[0], slots, kv.layer_ptrs(0))
    half = dim // 2
    angle = positions[:, None].double() * rotary.inv_freq[None, :].double()          # [T, half]
    turn = torch.polar(torch.ones_like(angle), angle)[:, None]
    z = torch.complex(q[..., :half].double(), q[..., half:].double()) * turn
    torch.testing.assert_close(q_rot.double(), torch.cat([z.real, z.imag], -1), atol=1e-5, rtol=1e-5)
    assert torch.equal(q_rot[0], q[0])                                                 # position 0: no rotation
    assert torch.equal(kv.k[0].view(-1, kv_heads, dim)[slots], k_rot)
    assert torch.equal(kv.v[0].view(-1, kv_heads, dim)[slots], v)


def test_route_topk_picks_the_largest_and_renormalizes():
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0], [3.0, 0.0, 0.0, 2.5]])
    weights, ids = layer_ops.route_topk(logits, 2, renormalize=False)
    probs = torch.softmax(logits, -1)
    assert ids.tolist() == [[1, 2], [0, 3]]
    torch.testing.assert_close(weights, probs.gather(1, ids))
    renormed, _ = layer_ops.route_topk(logits, 2, renormalize=True)
    torch.testing.assert_close(renormed.sum(-1), torch.ones(2))
    assert math.isclose(renormed[0, 0].item(), 1 / (1 + math.exp(-1.0)), rel_tol=1e-6)
    for bad in (0, 5):
        with pytest.raises(ValueError, match="top_k must be in 1..4"):
            layer_ops.route_topk(logits, bad, renormalize=False)


def test_row_norms_into_out_and_the_elementwise_ops():
    x = torch.tensor([[3.0, 4.0], [0.0, 0.0], [1.0, 1.0]])
    torch.testing.assert_close(layer_ops.row_norms(x), torch.tensor([5.0, 0.0, math.sqrt(2)]))
    out = torch.empty(3)
    assert layer_ops.row_norms(x, out=out) is out and out[0].item() == 5.0
    with pytest.raises(ValueError, match="contiguous float32 tensor of 3 values"):
        layer_ops.row_norms(x, out=torch.empty(4))
    h = torch.tensor([[1.0, -2.0, 3.0, 5.0]])
    sig = lambda t: 1 / (1 + math.exp(-t))
    torch.testing.assert_close(layer_ops.act_mul(h), torch.tensor([[1.0 * sig(1.0) * 3.0, -2.0 * sig(-2.0) * 5.0]]))
    gelu = lambda t: 0.5 * t * (1 + math.tanh(math.sqrt(2 / math.pi) * (t + 0.044715 * t ** 3)))
    torch.testing.assert_close(layer_ops.act_mul(h, "gelu_tanh"), torch.tensor([[gelu(1.0) * 3.0, gelu(-2.0) * 5.0]]))
    o, s, gate = torch.ones(2, 3), torch.full((2, 3), 2.0), torch.tensor([[0.0], [100.0]])
    torch.testing.assert_close(layer_ops.gated_add(o, gate, s), torch.tensor([[2.0] * 3, [3.0] * 3]))


def test_slot_combine_weights_each_token_s_slots_and_rounds_once():
    g = torch.Generator().manual_seed(3)
    tokens, k, cols = 5, 3, 16
    rows = torch.randn(tokens * k, cols, generator=g).to(torch.bfloat16)
    weights = torch.rand(tokens, k, generator=g)
    got = layer_ops.slot_combine(rows, weights)
    want = (rows.double().view(tokens, k, cols) * weights.double()[:, :, None]).sum(1)
    assert got.dtype == torch.bfloat16 and got.shape == (tokens, cols)
    # one rounding to bf16 of a float32 sum: within half a bf16 ulp of the exact sum (plus float32's error)
    torch.testing.assert_close(got.double(), want, atol=1e-6, rtol=2 ** -8 + 1e-6)
    assert torch.equal(layer_ops.slot_combine(rows[:k], weights[:1]), got[:1])   # a token sees only its own rows
    with pytest.raises(ValueError, match="14 rows for 5 tokens of 3 slots"):
        layer_ops.slot_combine(rows[:14], weights)
    # `where`: each slot's row read where it went, here rows shuffled and two spare rows added
    perm = torch.randperm(tokens * k + 2, generator=g)
    moved = torch.full((tokens * k + 2, cols), float("nan"), dtype=rows.dtype)
    moved[perm[:tokens * k]] = rows
    assert torch.equal(layer_ops.slot_combine(moved, weights, perm[:tokens * k]), got)
    with pytest.raises(ValueError, match="where must be int64 \\[15\\]"):
        layer_ops.slot_combine(moved, weights, perm[:tokens * k].int())


def test_rotary_linear_factor_divides_positions():
    """Linear rope scaling (rope_scaling {"type": "linear", "factor": f}): the inverse frequencies are divided by f, so
    position f * p gets the angles position p gets without scaling."""
    plain, scaled = Rotary(8, 10000.0), Rotary(8, 10000.0, linear_factor=4.0)
    torch.testing.assert_close(scaled.inv_freq, plain.inv_freq / 4)
    cos_s, sin_s = scaled.cos_sin(torch.tensor([0, 4, 12]), torch.float32)
    cos_p, sin_p = plain.cos_sin(torch.tensor([0, 1, 3]), torch.float32)
    torch.testing.assert_close(cos_s, cos_p)
    torch.testing.assert_close(sin_s, sin_p)


def test_float_rms_norm_add_returns_the_sum_and_its_norm():
    """FloatRMSNorm.add (Gemma 4's residual add before a norm): (x + delta, norm of x + delta); without delta, (x,
    norm of x)."""
    g = torch.Generator().manual_seed(3)
    x, delta = torch.randn(4, 16, generator=g), torch.randn(4, 16, generator=g)
    norm = FloatRMSNorm(torch.rand(16, generator=g) + 0.5, 1e-6)
    s, out = norm.add(x, delta)
    assert torch.equal(s, x + delta)
    rms = (s.double() ** 2).mean(-1, keepdim=True).add(1e-6).sqrt()
    torch.testing.assert_close(out.double(), s.double() / rms * norm.weight.double(), atol=1e-5, rtol=1e-5)
    s2, out2 = norm.add(x, None)
    assert s2 is x and torch.equal(out2, norm(x))


def test_linear_adds_its_bias():
    """Linear: x W^T + b (the attention projections of models with qkv or output biases), x W^T without a bias."""
    g = torch.Generator().manual_seed(4)
    x, w, b = torch.randn(3, 5, generator=g), torch.randn(6, 5, generator=g), torch.randn(6, generator=g)
    torch.testing.assert_close(Linear(w, b)(x), x @ w.T + b)
    torch.testing.assert_close(Linear(w)(x), x @ w.T)


def test_the_norm_and_activation_modes_reach_their_launches(monkeypatch):
    """The host side of the CUDA path, run on the CPU with the launch captured: Gemma's norm order and a missing weight,
    and the activation, arrive as the kernels' mode arguments, the output as the kernel's destination."""
    launches = []
    monkeypatch.setattr(layer_ops, "_applies", lambda *tensors: True)
    monkeypatch.setattr(layer_ops, "_kernel", lambda t, func: func)
    monkeypatch.setattr(layer_ops.kc, "launch",
                        lambda kernel, device, grid, block, args: launches.append((kernel, args)))
    h = torch.zeros(3, 8, dtype=torch.bfloat16)
    for act, flag in (("silu", 0), ("gelu_tanh", 1)):
        out = layer_ops.act_mul(h, act)
        kernel, args = launches.pop()
        assert kernel == "pw_act_mul" and int(args[4]) == flag and int(args[5]) == 0 and int(args[6]) == out.data_ptr()
        assert out.shape == (3, 4) and int(args[3]) == 12 and int(args[2]) == 4
    count = torch.tensor([2])
    layer_ops.act_mul(h, "silu", count)
    layer_ops.row_norms(h, count=count)
    (_, norms_args), (_, act_args) = launches.pop(), launches.pop()
    assert int(act_args[5]) == count.data_ptr() and int(norms_args[4]) == count.data_ptr() and int(norms_args[5]) == 0
    for bad in (torch.tensor([2], dtype=torch.int32), torch.tensor([1, 2])):
        with pytest.raises(ValueError, match="count must be one int64 value"):
            layer_ops.act_mul(h, "silu", bad)
    x, w = torch.zeros(3, 8, dtype=torch.bfloat16), torch.ones(8, dtype=torch.bfloat16)
    for weight, float_weight in ((w, False), (w, True), (None, True)):
        _, out = layer_ops.add_rms_norm(x, None, weight, 1e-6, float_weight=float_weight)
        kernel, args = launches.pop()
        assert kernel == "pw_add_rms_norm" and int(args[-1]) == int(float_weight)
        assert int(args[5]) == (0 if weight is None else weight.data_ptr()) and int(args[6]) == out.data_ptr()


def test_row_norms_placed_by_an_index_up_to_a_count():
    """With `out_index` row r's norm lands at out[out_index[r]], only for the rows below `count`; the other places
    keep what they held. Misuse: an index without an out, or of another length."""
    x = torch.tensor([[3.0, 4.0], [0.0, 1.0], [6.0, 8.0]])
    out = torch.full((2, 3), -1.0)
    assert layer_ops.row_norms(x, out=out, out_index=torch.tensor([4, 0, 2])) is out
    assert out.view(-1).tolist() == [1.0, -1.0, 10.0, -1.0, 5.0, -1.0]
    out = torch.full((6,), -1.0)
    layer_ops.row_norms(x, out=out, count=torch.tensor([2]), out_index=torch.tensor([5, 3, 1]))
    assert out.tolist() == [-1.0, -1.0, -1.0, 1.0, -1.0, 5.0]
    with pytest.raises(ValueError, match="out_index needs an out"):
        layer_ops.row_norms(x, out_index=torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match=r"must be int64 \[3\]"):
        layer_ops.row_norms(x, out=out, out_index=torch.tensor([0, 1]))


def test_move_rows_gathers_scatters_and_stops_at_the_count():
    """dst[dst_index[p]] = src[src_index[p]] move by move (the reference on the CPU), up to a count that lives in a
    tensor; rows no move writes keep what they held."""
    src = torch.arange(6 * 8, dtype=torch.float32).view(6, 8)
    gather, scatter = torch.tensor([5, 0, 3]), torch.tensor([9, 2, 4, 7, 0, 1])
    dst = layer_ops.move_rows(src, torch.full((10, 8), -1.0), src_index=gather)
    assert torch.equal(dst[:3], src[[5, 0, 3]]) and (dst[3:] == -1).all()
    dst = layer_ops.move_rows(src, torch.full((10, 8), -1.0), dst_index=scatter)
    assert torch.equal(dst[scatter], src) and (dst[[3, 5, 6, 8]] == -1).all()
    for count, moved in ((torch.tensor([2]), 2), (torch.tensor(0), 0), (torch.tensor([99]), 3)):
        dst = layer_ops.move_rows(src, torch.full((10, 8), -1.0), gather, scatter, count)
        want = torch.full((10, 8), -1.0)
        for p in range(moved):
            want[scatter[p]] = src[gather[p]]
        assert torch.equal(dst, want), count
    with pytest.raises(ValueError, match="src_index must be int64"):
        layer_ops.move_rows(src, torch.zeros(10, 8), src_index=gather.int())
    with pytest.raises(ValueError, match=r"dst_index must be int64 \[3\] or longer"):
        layer_ops.move_rows(src, torch.zeros(10, 8), gather, scatter[:2])


def test_move_rows_launch_takes_its_moves_indices_and_count(monkeypatch):
    """The host side of the CUDA path, run on the CPU with the launch captured: a CTA row a move, 8 columns a
    thread, null pointers for the identity, the count's address."""
    launches = []
    monkeypatch.setattr(layer_ops, "_applies", lambda *tensors: True)
    monkeypatch.setattr(layer_ops, "_kernel", lambda t, func: func)
    monkeypatch.setattr(layer_ops.kc, "launch",
                        lambda kernel, device, grid, block, args: launches.append((kernel, grid, block, args)))
    src, dst = torch.zeros(7, 2816, dtype=torch.bfloat16), torch.zeros(9, 2816, dtype=torch.bfloat16)
    index, count = torch.arange(5), torch.tensor([3])
    assert layer_ops.move_rows(src, dst, src_index=index, count=count) is dst
    kernel, grid, block, args = launches.pop()
    assert kernel == "pw_move_rows" and grid == (5, 3) and block == (128,)
    assert [int(a) for a in args] == [src.data_ptr(), index.data_ptr(), dst.data_ptr(), 0, count.data_ptr(), 2816]
    scatter = torch.arange(7)
    layer_ops.move_rows(src, dst, dst_index=scatter)
    _, grid, _, args = launches.pop()
    assert grid == (7, 3) and int(args[1]) == 0 and int(args[3]) == scatter.data_ptr() and int(args[4]) == 0
    layer_ops.move_rows(src[:, :12], dst[:, :12])       # not a multiple of 8 columns: the reference
    assert not launches
