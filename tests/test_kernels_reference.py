"""Kernel references (CPU, CI): each against an independent straightforward computation.

dequantize vs a numpy bit-by-bit LUT lookup; the fused-MoE reference (and fused_moe's CPU path
through the device table) vs a per-(token, slot) float64 loop; paged attention vs dense attention
on contiguous K/V; plus the device table's bookkeeping and the launch planner's limits.
"""
from __future__ import annotations

import math
import os
import subprocess
import sys
import threading
import time
from dataclasses import replace

import numpy as np
import pytest
import torch

from pwruntime.kernels import DeviceWeightTable, MoEShape, MoEWorkspace, ap_linear, dequantize_blocks, fused_moe
from pwruntime.kernels import compile as kc
from pwruntime.kernels.attention import decode_variant, paged_attention_decode
from pwruntime.kernels.device_table import device_layout, unpack_top_planes
from pwruntime.kernels.moe import (BLOCK_LUT_SLICE, BLOCK_XS_CAP, LUT_SLICE, MAX_TOKENS, SMEM_LIMIT, XS_CAP, XS_CHUNK,
                                   group_tokens, layer_variants, linear_grid, moe_plans, overflow_slots,
                                   plan_launch, single_block_plan)
from pwruntime.kernels.reference import (B1_CHUNK, ap_linear_one_token_int16_ref, dequantize_resident, fused_moe_ref,
                                         int16_chunks, load_pattern_ref, paged_attention_decode_ref)
from pwruntime.kernels.reference import gated as reference_gated
from pwruntime.quant.pack import pack_planes


def make_block(rng: np.random.Generator, out: int, inp: int):
    """Random 8-bit codes, their packed planes (int32 [8, out, words]) and sorted fp16 LUTs for 1..8 bits."""
    codes = rng.integers(0, 256, size=(out, inp), dtype=np.uint8)
    planes = torch.from_numpy(pack_planes(codes).view(np.int32))
    luts = {b: torch.from_numpy(np.sort(rng.standard_normal((out, 1 << b)), axis=1).astype(np.float16))
            for b in range(1, 9)}
    return codes, planes, luts


def numpy_dequant(planes: np.ndarray, lut: np.ndarray, bits: int, inp: int) -> np.ndarray:
    """Bit by bit: code[r, k] = sum_j bit(k % 32 of word k // 32 of plane j) << (bits - 1 - j)."""
    words = planes.astype(np.uint32)
    out = words.shape[1]
    code = np.zeros((out, inp), dtype=np.int64)
    for j in range(bits):
        for k in range(inp):
            code[:, k] |= ((words[j, :, k // 32] >> np.uint32(k % 32)) & 1).astype(np.int64) << (bits - 1 - j)
    return np.take_along_axis(lut.astype(np.float64), code, axis=1)


@pytest.mark.parametrize("bits", [3, 4, 5, 8])
@pytest.mark.parametrize("shape", [(5, 70), (3, 64)])
def test_dequantize_matches_bitwise_numpy(bits, shape):
    rng = np.random.default_rng(bits * 100 + shape[1])
    codes, planes, luts = make_block(rng, *shape)
    table = DeviceWeightTable(4, "cpu")
    table.set_block(2, device_layout(planes), luts[bits], bits)
    got = dequantize_resident(table.resident(2), shape[1], torch.float32).double().numpy()
    want = numpy_dequant(planes.numpy(), luts[bits].numpy(), bits, shape[1])
    np.testing.assert_array_equal(got, want)
    # the b-bit code is the top b bits of the 8-bit code
    np.testing.assert_array_equal(want, np.take_along_axis(luts[bits].numpy().astype(np.float64),
                                                           (codes >> (8 - bits)).astype(np.int64), axis=1))
    got_many = dequantize_blocks(table, [2, 2], shape[0], shape[1], torch.float16)
    assert got_many.shape == (2, *shape) and torch.equal(got_many[0], got_many[1])
    np.testing.assert_array_equal(got_many[0].double().numpy(), want)


def _moe_setup(seed: int, shape: MoEShape, layers: int, bits):
    rng = np.random.default_rng(seed)
    table = DeviceWeightTable(layers * shape.num_experts * 2, "cpu")
    store = {}
    for layer in range(layers):
        for e in range(shape.num_experts):
            for kind, (o, i) in enumerate([(2 * shape.intermediate, shape.hidden), (shape.hidden, shape.intermediate)]):
                _, planes, luts = make_block(rng, o, i)
                b = int(bits(layer, e, kind)) if callable(bits) else int(bits)
                blk = shape.block(layer, e, kind)
                table.set_block(blk, device_layout(planes), luts[b], b)
                store[blk] = (planes, luts, i)
    return table, store


def _routing(gen: torch.Generator, tokens: int, shape: MoEShape):
    ids = torch.stack([torch.randperm(shape.num_experts, generator=gen)[:shape.top_k] for _ in range(tokens)])
    w = torch.softmax(torch.randn(tokens, shape.top_k, generator=gen), dim=-1)
    return ids, w


def _loop_moe(x, ids, w, wgu, wd):
    """float64, one (token, slot) at a time."""
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = wgu[e] @ x[t].double()
            inter = h.shape[0] // 2
            a = h[:inter] / (1 + torch.exp(-h[:inter])) * h[inter:]
            out[t] += float(w[t, j]) * (wd[e] @ a)
    return out


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).norm() / want.norm())


def _dense(store, blk, bits, dtype=torch.float64):
    planes, luts, i = store[blk]
    return torch.from_numpy(numpy_dequant(planes.numpy(), luts[bits].numpy(), bits, i)).to(dtype)


def test_fused_moe_cpu_path_matches_token_loop_and_follows_bits():
    shape = MoEShape(num_experts=6, hidden=40, intermediate=24, top_k=2)
    table, store = _moe_setup(1, shape, layers=2, bits=lambda l, e, k: 3 + (l + e + k) % 6)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, shape.hidden, generator=gen)
    ids, w = _routing(gen, 5, shape)
    layer = 1

    def dense(bits_of):
        wgu = {e: _dense(store, shape.block(layer, e, 0), bits_of(e, 0)) for e in range(shape.num_experts)}
        wd = {e: _dense(store, shape.block(layer, e, 1), bits_of(e, 1)) for e in range(shape.num_experts)}
        return wgu, wd

    got = fused_moe(table, layer, x, ids, w, shape)
    want = _loop_moe(x, ids, w, *dense(lambda e, k: 3 + (layer + e + k) % 6))
    assert _rel(got, want) < 1e-6

    # commit 3 bits everywhere in this layer: the result follows the table
    for e in range(shape.num_experts):
        for kind in (0, 1):
            blk = shape.block(layer, e, kind)
            table.commit_bits(blk, 3, store[blk][1][3])
    got3 = fused_moe(table, layer, x, ids, w, shape)
    want3 = _loop_moe(x, ids, w, *dense(lambda e, k: 3))
    assert _rel(got3, want3) < 1e-6
    assert _rel(got3, want) > 1e-2


def test_fused_moe_ref_bf16_rounds_like_the_kernel():
    shape = MoEShape(num_experts=4, hidden=32, intermediate=16, top_k=2)
    table, store = _moe_setup(2, shape, layers=1, bits=4)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, shape.hidden, generator=gen).to(torch.bfloat16)
    ids, w = _routing(gen, 3, shape)
    got = fused_moe(table, 0, x, ids, w, shape)
    assert got.dtype == torch.bfloat16
    wgu = {e: _dense(store, shape.block(0, e, 0), 4) for e in range(4)}
    wd = {e: _dense(store, shape.block(0, e, 1), 4) for e in range(4)}
    want = _loop_moe(x.double(), ids, w, wgu, wd)
    assert _rel(got, want) < 2e-2


def test_fused_moe_ref_rounds_the_intermediate_to_the_activation_dtype():
    """In bf16 the reference keeps act(gate) * up in bf16 (it travels between the kernel's two launches in the
    activation dtype) before the down projection; with identity down weights that rounding shows exactly."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(6, 8, generator=gen).to(torch.bfloat16)
    wgu = {e: torch.randn(16, 8, generator=gen) for e in range(2)}
    ids = torch.tensor([[0, 1]] * 6)
    w = torch.full((6, 2), 0.5)
    got = fused_moe_ref(x, ids, w, lambda e: wgu[e], lambda e: torch.eye(8))
    acts = [reference_gated(x.float() @ wgu[e].to(torch.bfloat16).float().T).to(torch.bfloat16).float() for e in (0, 1)]
    assert torch.equal(got, (0.5 * acts[0] + 0.5 * acts[1]).to(torch.bfloat16))
    unrounded = [reference_gated(x.float() @ wgu[e].to(torch.bfloat16).float().T) for e in (0, 1)]
    assert not torch.equal(got, (0.5 * unrounded[0] + 0.5 * unrounded[1]).to(torch.bfloat16))


def test_gated_activations_are_silu_and_the_tanh_gelu():
    """gated(h) = act(gate) * up of h = [gate | up]: SiLU, or Gemma 4's tanh approximation of GELU (not the erf one,
    which differs by up to ~5e-4), from their formulas in float64."""
    h = torch.linspace(-4, 4, 2 * 81, dtype=torch.float64).reshape(1, -1)
    gate, up = h[:, :81], h[:, 81:]
    silu = gate / (1 + torch.exp(-gate)) * up
    gelu = 0.5 * gate * (1 + torch.tanh(math.sqrt(2 / math.pi) * (gate + 0.044715 * gate ** 3))) * up
    torch.testing.assert_close(reference_gated(h), silu, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(reference_gated(h, "gelu_tanh"), gelu, rtol=1e-10, atol=1e-10)


def test_fused_moe_ref_sums_slots_in_order():
    # two slots of one token on the same expert weight set: per-slot weighting, not per-expert
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 8, generator=gen)
    wgu = {0: torch.randn(6, 8, generator=gen), 1: torch.randn(6, 8, generator=gen)}
    wd = {0: torch.randn(8, 3, generator=gen), 1: torch.randn(8, 3, generator=gen)}
    ids = torch.tensor([[0, 1], [1, 0]])
    w = torch.tensor([[0.25, 0.75], [0.5, 0.5]])
    got = fused_moe_ref(x, ids, w, lambda e: wgu[e], lambda e: wd[e])
    want = _loop_moe(x, ids, w, {e: v.double() for e, v in wgu.items()}, {e: v.double() for e, v in wd.items()})
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)


def test_ap_linear_cpu_matches_dense():
    rng = np.random.default_rng(5)
    _, planes, luts = make_block(rng, 9, 100)
    table = DeviceWeightTable(1, "cpu")
    table.set_block(0, device_layout(planes), luts[5], 5)
    x = torch.randn(3, 100, generator=torch.Generator().manual_seed(0))
    got = ap_linear(table, 0, x, 9)
    want = x.double() @ torch.from_numpy(numpy_dequant(planes.numpy(), luts[5].numpy(), 5, 100)).T
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def _dense_attention(q, ks, vs, scale):
    """float64 attention of one query per sequence over its own contiguous K/V [L, Hkv, D]."""
    out = []
    for s, (k, v) in enumerate(zip(ks, vs)):
        group = q.shape[1] // k.shape[1]
        heads = []
        for h in range(q.shape[1]):
            kk, vv = k[:, h // group].double(), v[:, h // group].double()
            sc = (kk @ q[s, h].double()) * scale
            p = torch.exp(sc - sc.max())
            heads.append((p / p.sum()) @ vv)
        out.append(torch.stack(heads))
    return torch.stack(out)


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (3, 3)])
def test_paged_attention_reference_matches_dense(heads, kv_heads):
    gen = torch.Generator().manual_seed(heads)
    block_size, dim, num_blocks = 4, 8, 40
    lens = [1, 7, 13]
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    max_blocks = 5
    tables = torch.full((len(lens), max_blocks), -1, dtype=torch.int32)
    ks, vs = [], []
    for s, n in enumerate(lens):
        nb = -(-n // block_size)
        ids = [perm.pop() for _ in range(nb)]
        tables[s, :nb] = torch.tensor(ids, dtype=torch.int32)
        k = torch.randn(n, kv_heads, dim, generator=gen)
        v = torch.randn(n, kv_heads, dim, generator=gen)
        for i in range(n):  # scatter the sequence into its blocks
            k_cache[ids[i // block_size], i % block_size] = k[i]
            v_cache[ids[i // block_size], i % block_size] = v[i]
        ks.append(k)
        vs.append(v)
    q = torch.randn(len(lens), heads, dim, generator=gen)
    scale = 1 / math.sqrt(dim)
    want = _dense_attention(q, ks, vs, scale)
    got = paged_attention_decode_ref(q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32), scale)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    via_api = paged_attention_decode(q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32))
    torch.testing.assert_close(via_api, got)
    # a sliding window of 5: the query (the last of n tokens) sees exactly the last 5 of them
    want_w = _dense_attention(q, [k[-5:] for k in ks], [v[-5:] for v in vs], scale)
    got_w = paged_attention_decode_ref(q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32), scale,
                                       window=5)
    torch.testing.assert_close(got_w.double(), want_w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bits", [3, 4])
def test_one_token_popcount_identity(bits):
    """The arithmetic of cuda/ap_b1.cuh, bit by bit in numpy, for int16 activations X (two's complement planes:
    w_m = 2^m, w_15 = -2^15) and, per row, counted(mask) = sum_m w_m popcount(mask & xplane_m). At 3 bits the kernel
    counts the Moebius terms: with a_T = sum over U in T of (-1)^|T - U| LUT[U], a_{} sum_k X_k + sum over nonempty T of
    a_T counted(AND of T's planes) equals sum_k LUT[code_k] X_k exactly, for every row. At 4 bits it counts the top-3
    one-hot masks and those masks ANDed with plane 3 (the code's LSB): sum_C LUT[2C] S(top C) +
    (LUT[2C + 1] - LUT[2C]) S(top C, plane 3) is the same sum."""
    rng = np.random.default_rng(15)
    rows, k = 16, 256
    codes = rng.integers(0, 1 << bits, size=(rows, k))
    lut = rng.integers(-1000, 1000, size=(rows, 1 << bits))
    big = rng.integers(-32767, 32768, size=k)
    big[:3] = [-32767, 32767, 0]
    plane_bits = [(codes >> (bits - 1 - j)) & 1 for j in range(bits)]  # plane 0 is the MSB
    x_bits = [((big.astype(np.int64) & 0xFFFF) >> m) & 1 for m in range(16)]
    weights = [1 << m for m in range(15)] + [-(1 << 15)]
    assert np.array_equal(sum(w * b for w, b in zip(weights, x_bits)), big)

    def counted(mask: np.ndarray) -> np.ndarray:  # sum_m w_m popcount(mask & xplane_m), per row
        popc = np.stack([(mask & xb[None, :]).sum(axis=1) for xb in x_bits], axis=1)  # [rows, 16]
        return popc @ np.array(weights, dtype=np.int64)

    got = np.zeros(rows, dtype=np.int64)
    if bits == 3:
        a = lut.copy()  # the Moebius coefficients, by the butterfly b1::finish runs
        for b in (1, 2, 4):
            for c in range(8):
                if c & b:
                    a[:, c] -= a[:, c ^ b]
        got += a[:, 0] * big.sum()  # the empty term: the staged chunk sum, the same for every row
        for t in range(1, 8):  # code bit b of a term is plane 2 - b
            mask = np.ones((rows, k), dtype=np.int64)
            for b in range(3):
                if t >> b & 1:
                    mask &= plane_bits[2 - b]
            got += a[:, t] * counted(mask)
    else:
        for c in range(8):
            onehot = np.ones((rows, k), dtype=np.int64)
            for j in range(3):
                onehot &= plane_bits[j] if (c >> (2 - j)) & 1 else 1 - plane_bits[j]
            odd_minus_even = lut[:, 2 * c + 1] - lut[:, 2 * c]
            got += lut[:, 2 * c] * counted(onehot) + odd_minus_even * counted(onehot & plane_bits[3])
    want = (np.take_along_axis(lut, codes, axis=1) * big[None, :]).sum(axis=1)
    assert np.array_equal(got, want)


def test_int16_chunks_and_the_one_token_int16_reference():
    """int16_chunks: |x - X s| <= s / 2 per element, |X| <= 32767 with the chunk's largest |x| at 32767 exactly, zero
    chunks scale 0; the one-token int16 reference stays within fp16's tolerance of the exact product, also when chunks
    span 10^-3..10^3, and moves by the quantization, which the kernel's GPU test relies on."""
    gen = torch.Generator().manual_seed(3)
    k = 3 * B1_CHUNK + 100  # a partial last chunk
    x = torch.randn(k, generator=gen) * torch.tensor([1e3, 0.0, 1e-3, 5.0]).repeat_interleave(B1_CHUNK)[:k]
    big, scale = int16_chunks(x)
    assert scale.shape == (4,) and float(scale[1]) == 0.0
    assert int16_chunks(x[:2 * B1_CHUNK])[1].shape == (2,)  # no extra chunk where K is a multiple of 512
    per_col = scale.repeat_interleave(B1_CHUNK)[:k].double()
    assert big.abs().max() <= 32767 and torch.all(big == torch.round(big))
    assert torch.all((x.double() - big * per_col).abs() <= per_col / 2 * (1 + 1e-6))
    for c in (0, 2, 3):
        cols = slice(c * B1_CHUNK, min(k, (c + 1) * B1_CHUNK))
        assert float(big[cols].abs().max()) == 32767.0
    w = (torch.randn(64, k, generator=gen) / k ** 0.5).half()
    x16 = x.half()[None]
    exact = x16.double() @ w.double().T
    got = ap_linear_one_token_int16_ref(x16, w)
    assert got.dtype == torch.float16 and got.shape == (1, 64)
    assert float((got.double() - exact).norm() / exact.norm()) < 1.5e-3
    # one large column whose weights are zero sets its chunk's step, and that step shows in the result
    spike = torch.randn(1, B1_CHUNK, generator=gen)
    spike[0, 7] = 2e4
    w2 = torch.randn(32, B1_CHUNK, generator=gen).half()
    w2[:, 7] = 0
    ref2 = (spike.half().double() @ w2.double().T)
    assert float((ap_linear_one_token_int16_ref(spike.half(), w2).double() - ref2).norm() / ref2.norm()) > 2e-2


def test_nibble_layout_roundtrip_and_codes():
    """The device layout of planes 0..2 is a bijection, and it holds what the kernels read: word j & 0x7 in
    nibble s = top code of element j + 4s (j < 3); bit 3 of nibble s of words 0, 1, 2 = element 3 + 4s."""
    rng = np.random.default_rng(11)
    codes, planes, _ = make_block(rng, 6, 96)
    packed = device_layout(planes)
    assert len(packed) == 8 and all(torch.equal(packed[j], planes[j]) for j in range(3, 8))
    assert all(torch.equal(a, b) for a, b in zip(unpack_top_planes(packed), planes[:3]))
    assert not all(torch.equal(packed[j], planes[j]) for j in range(3))
    words = np.stack([p.numpy().view(np.uint32) for p in packed[:3]])  # [3, out, words]
    top = (codes >> 5).astype(np.uint32)                                # the 3-bit codes, [out, in]
    for e in range(32):
        j, s = e % 4, e // 4
        if j < 3:
            got = (words[j] >> np.uint32(4 * s)) & 7
        else:
            got = sum(((words[k] >> np.uint32(4 * s + 3)) & 1) << (2 - k) for k in range(3))
        np.testing.assert_array_equal(got, top[:, e::32])


def test_device_table_rows_and_validation():
    rng = np.random.default_rng(7)
    _, planes, luts = make_block(rng, 4, 64)
    t = DeviceWeightTable(3, "cpu")
    planes = device_layout(planes)
    t.set_block(1, planes, luts[8], 8)
    row = t.host[1]
    assert row[9] == 8 and row[8] == luts[8].data_ptr()
    assert all(row[j] == planes[j].data_ptr() for j in range(8))
    torch.testing.assert_close(t.table.cpu(), torch.from_numpy(t.host))
    assert t.nbytes_read(1) == 8 * 4 * 2 * 4 + 4 * 256 * 2
    t.commit_bits(1, 3, luts[3])
    assert t.bits(1) == 3 and t.host[1, 8] == luts[3].data_ptr() and t.host[1, 0] == planes[0].data_ptr()
    assert t.nbytes_read(1) == 3 * 4 * 2 * 4 + 4 * 8 * 2
    t.clear(1)
    assert t.bits(1) == 0 and t.resident(1) is None and not t.table[1].any()
    with pytest.raises(ValueError, match="LUT_4"):
        t.set_block(0, planes, luts[3], 4)
    with pytest.raises(ValueError, match="need planes"):
        t.set_block(0, planes[:2], luts[3], 3)
    with pytest.raises(ValueError, match="bits must be"):
        t.set_block(0, planes, luts[8], 9)
    with pytest.raises(ValueError, match="bits must be in 3..8"):
        t.set_block(0, planes, luts[2], 2)
    with pytest.raises(ValueError, match="at least planes 0..2"):
        t.upload(0, torch.stack(planes[:2]), luts[2], 2)
    with pytest.raises(IndexError):
        t.bits(3)
    with pytest.raises(ValueError, match="no resident planes"):
        t.commit_bits(2, 3, luts[3])


def test_device_table_defers_rows_to_one_flush():
    rng = np.random.default_rng(8)
    _, planes, luts = make_block(rng, 4, 64)
    planes = device_layout(planes)
    t = DeviceWeightTable(6, "cpu")
    t.set_block(0, planes, luts[8], 8)
    t.set_block(5, planes, luts[8], 8)
    before = t.table.clone()
    t.set_block(4, planes, luts[5], 5, flush=False)
    t.clear(1, flush=False)
    t.commit_bits(0, 4, luts[4])  # an immediate write sends the rows deferred before it too
    assert not t.dirty and torch.equal(t.table, torch.from_numpy(t.host))
    t.set_block(5, planes, luts[3], 3, flush=False)
    t.set_block(2, planes, luts[6], 6, flush=False)
    assert t.dirty and t.bits(5) == 3 and t.bits(2) == 6  # the mirror has them, the kernels' rows do not
    assert torch.equal(t.table[2], before[2]) and torch.equal(t.table[5], before[5])
    t.flush()
    assert not t.dirty and torch.equal(t.table, torch.from_numpy(t.host)) and t.table[5, 9] == 3
    t.set_block(1, planes, luts[7], 7, flush=False)  # rows written in ascending order: the span takes the last too
    t.set_block(3, planes, luts[4], 4, flush=False)
    t.flush()
    assert torch.equal(t.table, torch.from_numpy(t.host)) and (t.table[1, 9], t.table[3, 9]) == (7, 4)
    # a row keeping its planes still checks what is new to it
    with pytest.raises(ValueError, match="LUT_4"):
        t.set_block(5, planes, luts[3], 4, flush=False)
    with pytest.raises(ValueError, match=r"every plane must be \[out=2"):
        t.set_block(5, planes, luts[4][:2], 4, flush=False)
    assert not t.dirty and t.bits(5) == 3


def test_device_table_repoints_a_moved_plane_or_lut_in_its_row_only():
    """A plane arena's move: the row names the new tensor in the old one's column, the reference reads it, and
    nothing else of the row changes."""
    rng = np.random.default_rng(9)
    _, planes, luts = make_block(rng, 4, 64)
    planes = device_layout(planes)
    t = DeviceWeightTable(3, "cpu")
    t.set_block(1, planes[:5], luts[4], 4)
    before = t.host.copy()
    moved = planes[3].clone()
    t.repoint(1, planes[3], moved, flush=False)
    assert t.dirty and torch.equal(t.table[1], torch.from_numpy(before[1]))  # deferred to the next flush
    t.flush()
    want = before.copy()
    want[1, 3] = moved.data_ptr()
    np.testing.assert_array_equal(t.host, want)
    assert torch.equal(t.table, torch.from_numpy(want))
    rb = t.resident(1)
    assert rb.planes[3] is moved and rb.planes[:3] == tuple(planes[:3]) and rb.planes[4] is planes[4]
    assert rb.lut is luts[4] and rb.bits == 4
    lut = luts[4].clone()
    t.repoint(1, luts[4], lut)
    assert t.host[1, 8] == lut.data_ptr() and t.resident(1).lut is lut and t.table[1, 8] == lut.data_ptr()
    t.commit_bits(1, 5, luts[5])   # later writes see the moved planes as the row's own
    assert t.host[1, 3] == moved.data_ptr() and t.bits(1) == 5
    with pytest.raises(ValueError, match="does not name the tensor moved"):
        t.repoint(1, planes[3], planes[3].clone())    # no longer named: the row names `moved`
    with pytest.raises(ValueError, match="does not name the tensor moved"):
        t.repoint(0, planes[0], planes[0].clone())    # a row with nothing resident
    with pytest.raises(ValueError, match="keeps its shape and dtype"):
        t.repoint(1, moved, moved.view(torch.float32))
    assert t.host[1, 3] == moved.data_ptr()


ARCHS = {  # hidden, intermediate, experts, top-k
    "qwen1.5-moe": (2048, 1408, 60, 4), "mixtral": (4096, 14336, 8, 2),
    "olmoe": (2048, 1024, 64, 8), "qwen3-moe": (2048, 768, 128, 8), "gemma4": (2816, 704, 128, 8),
}


@pytest.mark.parametrize("arch", sorted(ARCHS))
@pytest.mark.parametrize("tokens", [1, 4, 16, 64])
def test_launch_plans_fit_and_cover(arch, tokens):
    h, i, e, k = ARCHS[arch]
    p1, p2 = moe_plans(MoEShape(e, h, i, k), tokens)
    for p, rows, rpw in ((p1, i, 8), (p2, h, 16)):
        assert p.warps in (4, 8) and p.ksplit in (1, 2, 4, 8) and p.warps % p.ksplit == 0 and p.smem <= SMEM_LIMIT
        assert p.n_tiles * rpw * (p.warps // p.ksplit) >= rows
        assert p.grid == p.n_tiles * (min(e, tokens * k) + overflow_slots(MoEShape(e, h, i, k), tokens, min(e, tokens * k), p))
        per_cta = min(tokens, 8 * p.nt)                # tokens one CTA of an expert stages
        assert p.xs_budget >= per_cta * XS_CHUNK       # a segment holds one 16-word chunk of each
        assert p.token_groups * 8 * p.nt >= min(tokens, MAX_TOKENS) > (p.token_groups - 1) * 8 * p.nt
        assert p.smem >= p.xs_budget + (p.warps // p.ksplit) * LUT_SLICE  # one byte-path LUT slice per row group
        assert p.smem >= p.nt * 512 * p.warps                           # the k-split reduction's buffer
    assert plan_launch(14336, 4096, MAX_TOKENS, 16, 1, 1).nt == 8


def test_token_groups_split_only_above_32_tokens(monkeypatch):
    # above 32 tokens an MoE launch serves each expert's tokens in two groups of half the n-tiles; tune's
    # --group-tokens forces any group size
    from pwruntime.kernels import moe
    for shape in (MoEShape(64, 2048, 1024, 8), MoEShape(8, 4096, 14336, 2), MoEShape(128, 2048, 768, 8)):
        assert [(p.nt, p.token_groups) for p in moe_plans(shape, 64)] == [(4, 2), (4, 2)]
        assert [(p.nt, p.token_groups) for p in moe_plans(shape, 40)] == [(4, 2), (4, 2)]
        assert [(p.nt, p.token_groups) for p in moe_plans(shape, 32)] == [(4, 1), (4, 1)]
        assert [(p.nt, p.token_groups) for p in moe_plans(shape, 16)] == [(2, 1), (2, 1)]
        assert moe_plans(shape, 33)[0].token_groups == 2 and moe_plans(shape, 33)[0].nt == 4
    assert group_tokens(5) == 5 and group_tokens(33) == 17 and group_tokens(64) == 32
    monkeypatch.setattr(moe, "GROUP_TOKENS", 8)
    assert [(p.nt, p.token_groups) for p in moe_plans(MoEShape(64, 2048, 1024, 8), 16)] == [(1, 2), (1, 2)]
    assert group_tokens(5) == 5 and group_tokens(64) == 8


def test_layer_launches_are_memoized_per_planner_setting(monkeypatch):
    """The dispatch's memo of a layer's plans equals planning afresh, and a changed tuning constant (as `tune` and
    the GPU tests set them) is planned afresh rather than served from the memo."""
    from pwruntime.kernels import moe
    shape = MoEShape(64, 2048, 1024, 8)
    for tokens in (1, 16, 64):
        p1, p2, carveout = moe.layer_launches(shape, tokens, 132, moe.planner_knobs())
        assert (p1, p2) == moe_plans(shape, tokens) and carveout == moe.layer_carveout(p1, p2)
        assert moe.layer_launches(shape, tokens, 132, moe.planner_knobs())[0] is p1   # served from the memo
    monkeypatch.setattr(moe, "GROUP_TOKENS", 8)
    p1, p2, _ = moe.layer_launches(shape, 16, 132, moe.planner_knobs())
    assert [(p.nt, p.token_groups) for p in (p1, p2)] == [(1, 2), (1, 2)]
    monkeypatch.setattr(moe, "LAYER_CARVEOUT", False)
    assert moe.layer_launches(shape, 16, 132, moe.planner_knobs())[2] is None


@pytest.mark.parametrize("arch", sorted(ARCHS))
@pytest.mark.parametrize("group", [8, 16, 32])
def test_overflow_slots_cover_every_routing(arch, group, monkeypatch):
    """A launch's overflow slots (one a further token group of an expert) suffice for any routing: spread, skewed,
    every token on the same experts; and they are far fewer than a second grid row of every expert."""
    from pwruntime.kernels import moe
    monkeypatch.setattr(moe, "GROUP_TOKENS", group)
    h, i, e, k = ARCHS[arch]
    shape = MoEShape(e, h, i, k)
    rng = np.random.default_rng(group)
    for tokens in (33, 40, 64):
        max_active = min(e, tokens * k)
        for p in moe_plans(shape, tokens):
            extra = overflow_slots(shape, tokens, max_active, p)
            assert p.grid == p.n_tiles * (max_active + extra) and p.token_groups == -(-tokens // (8 * p.nt)) > 1
            assert extra < max_active * (p.token_groups - 1) or e * k < 16
            routings = [np.argsort(rng.random((tokens, e)), axis=1)[:, :k],      # spread
                        np.tile(np.arange(k), (tokens, 1)),                    # every token on experts 0..k-1
                        np.argsort(rng.random((tokens, e)) * np.arange(1, e + 1) ** 2, axis=1)[:, :k]]  # skewed
            for ids in routings:
                counts = np.bincount(ids.ravel(), minlength=e)
                needed = sum((int(n) - 1) // (8 * p.nt) for n in counts if n > 0)
                assert needed <= extra, (tokens, p.nt, needed, extra)


def test_moe_shape_blocks_follow_the_page_table_order():
    """The fused kernel reads block (layer * experts + expert) * 2 + kind (gate_up 0, down 1), the page table's row."""
    from policies.page_table import block_index
    shape = MoEShape(6, 64, 32, 2)
    assert [shape.block(layer, e, k) for layer in range(2) for e in range(6) for k in (0, 1)] == \
        [block_index(layer, e, k, 6) for layer in range(2) for e in range(6) for k in (0, 1)] == list(range(24))


def test_overflow_slots_are_as_many_as_the_worst_routing_needs():
    """Mixtral at 64 tokens (two groups of 32 a launch): 128 slots need at most (128 - 1) // 32 = 3 further groups, and
    a routing of three experts with 33 tokens each and one with 29 needs all 3 (no spare slot of empty CTAs)."""
    shape = MoEShape(8, 4096, 14336, 2)
    ids = np.zeros((64, 2), dtype=np.int64)
    ids[:33, 0], ids[33:, 0] = 0, 1
    ids[:2, 1], ids[2:35, 1], ids[35:, 1] = 1, 2, 3
    counts = np.bincount(ids.ravel(), minlength=8)
    assert counts.tolist()[:4] == [33, 33, 33, 29] and all(len(set(row)) == 2 for row in ids.tolist())
    for p in moe_plans(shape, 64):
        assert (p.nt, p.token_groups) == (4, 2)
        needed = sum((int(n) - 1) // (8 * p.nt) for n in counts if n > 0)
        assert overflow_slots(shape, 64, 8, p) == needed == 3 == p.overflow


def test_a_workspace_holds_the_counters_of_every_down_launch():
    """MoEWorkspace's counters (one per row tile of the down launch) cover every token count, also where the hidden
    size is not a multiple of 16."""
    for shape in [MoEShape(e, h, i, k) for h, i, e, k in ARCHS.values()] + [MoEShape(2, 40, 4096, 2)]:
        ws = MoEWorkspace.create(shape, MAX_TOKENS, torch.float32, "cpu")
        assert all(ws.counters.numel() >= moe_plans(shape, t)[1].n_tiles for t in (1, 4, 16, 64)), shape


def test_registers_bound_is_the_kernels_launch_bounds():
    """ctas_by_registers is ap_moe.cu's PW_MINB, (16, 12 or 8 for <= 2, 4 or 8 n-tiles) / warps, at least one."""
    from pathlib import Path

    from pwruntime.kernels.moe import ctas_by_registers
    src = (Path(__file__).resolve().parents[1] / "cuda" / "ap_moe.cu").read_text()
    assert "#define PW_MINB ((PW_NT <= 2 ? 16 : PW_NT == 4 ? 12 : 8) / PW_WARPS)" in src
    got = {(nt, w): ctas_by_registers(nt, w) for nt in (1, 2, 4, 8) for w in (4, 8, 16)}
    assert got == {(nt, w): max(1, (16 if nt <= 2 else 12 if nt == 4 else 8) // w) for nt, w in got}
    assert (got[(4, 4)], got[(8, 4)], got[(2, 8)], got[(4, 16)]) == (3, 2, 2, 1)


def test_every_planned_moe_launch_is_precompiled():
    # `python -m pwruntime.kernels.compile` warms the ap_moe.cu builds the planner picks for the four architectures and
    # the demo model at T = 1..64; launches with overflow slots take the PW_OVERFLOW build, the others do not
    built = {defines for name, defines in kc.variants() if name == "ap_moe.cu"}
    shapes = [MoEShape(e, h, i, k) for h, i, e, k in ARCHS.values()] + [MoEShape(16, 256, 128, 4)]
    seen_overflow = False
    for shape in shapes:
        for tokens in range(1, MAX_TOKENS + 1):
            for p in moe_plans(shape, tokens):
                assert (("PW_OVERFLOW", 1) in p.defines) == (p.overflow > 0) == (p.token_groups > 1)
                seen_overflow |= p.overflow > 0
                for bf in (0, 1):
                    assert (("PW_BF16", bf),) + p.defines in built, (shape, tokens, p)
    assert seen_overflow
    for tokens in range(1, MAX_TOKENS + 1):  # and the single block's (`ap_linear`, the bench's Mixtral block)
        p = single_block_plan(14336, 4096, tokens)
        assert all((("PW_BF16", bf),) + p.defines in built for bf in (0, 1)), (tokens, p)


def test_bench_routing_uniform_or_with_hot_experts():
    # `bench kernels --routing zipf:ALPHA` (and tune's): each token's top-k experts are distinct either way; with
    # popularity 1 / rank the busiest expert gets most tokens, uniformly about T k / E
    from pwruntime.kernels.bench import parse_routing, random_routing
    assert parse_routing("uniform") is None and parse_routing("zipf:1.0") == 1.0 and parse_routing("zipf:0.5") == 0.5
    for bad in ("zipf", "zipf:0", "zipf:nan", "zipf:inf", "pareto:1", ""):
        with pytest.raises(ValueError, match="uniform or zipf:ALPHA"):
            parse_routing(bad)
    shape = MoEShape(128, 2048, 768, 8)
    busiest = {}
    for alpha in (None, 1.0):
        ids, w = random_routing(shape, 64, torch.Generator().manual_seed(0), alpha)
        assert ids.shape == w.shape == (64, 8) and torch.allclose(w.sum(1), torch.ones(64))
        assert all(len(set(row.tolist())) == 8 for row in ids) and 0 <= int(ids.min()) and int(ids.max()) < 128
        busiest[alpha] = int(torch.bincount(ids.flatten(), minlength=128).max())
    assert busiest[None] <= 16 and busiest[1.0] >= 40, busiest
    again, _ = random_routing(shape, 64, torch.Generator().manual_seed(0), 1.0)
    assert torch.equal(again, random_routing(shape, 64, torch.Generator().manual_seed(0), 1.0)[0])


def test_eight_warp_ctas_only_where_k_is_long_and_tokens_few():
    # 2..16 tokens and at least 4 chunks of 512 columns a warp: the same CTAs (grid, tiles) with twice the warps,
    # each row group's K split twice as many ways; never at T = 1, above 16 tokens or for short K
    four = plan_launch(14336, 4096, 1, 16, 1, 1)
    for tokens in (2, 8, 16):
        p = plan_launch(14336, 4096, tokens, 16, 1, 1)
        assert (p.warps, p.ksplit, p.n_tiles) == (8, 2, 224) and dict(p.defines)["PW_WARPS"] == 8
        assert p.nt == (1 if tokens <= 8 else 2)
    assert four.warps == 4 and "PW_WARPS" not in dict(four.defines)
    assert plan_launch(14336, 4096, 17, 16, 1, 1).warps == 4          # 4 n-tiles: too many registers
    assert plan_launch(2048, 1024, 8, 16, 1, 1).warps == 4            # 2 chunks a warp
    for arch, (h, i, e, k) in ARCHS.items():
        for p in moe_plans(MoEShape(e, h, i, k), 4):
            assert p.warps == (8 if arch == "mixtral" else 4)


def test_one_token_k_split_aims_for_two_ctas_an_sm():
    # Qwen1.5-MoE and Qwen3-MoE gate_up at T = 1: k-split 2 (88 and 48 tiles for 4 and 8 experts: 2.7 and 2.9 CTAs
    # an SM), not 4, which left each warp one 512-column chunk; the other launches as before
    qwen15, qwen3 = MoEShape(60, 2048, 1408, 4), MoEShape(128, 2048, 768, 8)
    assert [(p.ksplit, p.n_tiles) for p in moe_plans(qwen15, 1)] == [(2, 88), (2, 64)]
    assert [(p.ksplit, p.n_tiles) for p in moe_plans(qwen3, 1)] == [(2, 48), (1, 32)]
    assert [p.ksplit for p in moe_plans(MoEShape(8, 4096, 14336, 2), 1)] == [1, 4]
    assert [p.ksplit for p in moe_plans(MoEShape(64, 2048, 1024, 8), 1)] == [2, 2]
    assert plan_launch(14336, 4096, 1, 16, 1, 1).ksplit == 2


def test_a_single_block_takes_twice_the_warps_the_moe_planner_takes():
    for tokens in (2, 8, 16):
        moe_plan, p = plan_launch(14336, 4096, tokens, 16, 1, 1), single_block_plan(14336, 4096, tokens)
        assert (moe_plan.warps, p.warps, p.ksplit, p.n_tiles) == (8, 16, moe_plan.ksplit, moe_plan.n_tiles // 2)
        assert dict(p.defines)["PW_WARPS"] == 16 and p.smem <= SMEM_LIMIT
    moe_plan, p = plan_launch(14336, 4096, 1, 16, 1, 1), single_block_plan(14336, 4096, 1)  # one token, K split
    assert (moe_plan.warps, moe_plan.ksplit, p.warps, p.ksplit, p.n_tiles) == (4, 2, 8, 2, moe_plan.n_tiles // 2)
    assert dict(p.defines)["PW_WARPS"] == 8 and p.smem <= SMEM_LIMIT
    for tokens in (17, 64):
        assert single_block_plan(14336, 4096, tokens) == plan_launch(14336, 4096, tokens, 16, 1, 1)
    assert single_block_plan(2048, 1024, 8).warps == 4                   # short K: 4 warps, as the MoE planner
    short = plan_launch(200, 256, 1, 16, 1, 1)
    assert short.ksplit == 1 and single_block_plan(200, 256, 1) == short  # one token, K not split: as the planner


def test_a_single_blocks_wide_ctas_stage_more_activations(monkeypatch):
    from pwruntime.kernels import moe
    # the 16-warp CTAs (one an SM) stage up to BLOCK_XS_CAP: at K = 4096 all of K for up to 7 tokens plus the pads,
    # and for 8 (one segment); 16 tokens take two segments of 4 chunks; the MoE planner's CTAs keep XS_CAP
    chunk = XS_CHUNK - 128                      # one token's 512 columns, unpadded
    for tokens in (2, 4, 8, 16):
        moe_plan, p = plan_launch(14336, 4096, tokens, 16, 1, 1), single_block_plan(14336, 4096, tokens)
        assert moe_plan.xs_budget == min(tokens * (8 * chunk + 128), XS_CAP)
        assert p.xs_budget == min(tokens * (8 * chunk + 128), BLOCK_XS_CAP) and p.xs_budget >= moe_plan.xs_budget
        assert p.smem == p.xs_budget + 8 * BLOCK_LUT_SLICE <= SMEM_LIMIT  # 16 KiB slices in that build (PW_LUTWIDE)
    assert single_block_plan(14336, 4096, 8).xs_budget // 8 >= 8 * chunk + 128   # the whole K in one segment
    assert single_block_plan(14336, 4096, 16).xs_budget // 16 // chunk == 4     # half of it a segment
    assert single_block_plan(14336, 4096, 1).xs_budget == plan_launch(14336, 4096, 1, 16, 1, 1).xs_budget
    for arch, (h, i, e, k) in ARCHS.items():
        for tokens in (4, 8, 16):
            assert all(p.xs_budget <= XS_CAP for p in moe_plans(MoEShape(e, h, i, k), tokens))
    # the 16 KiB slices belong to the 16-warp kernel build, so any launch in it reserves them (tune --warps 16 too)
    forced = plan_launch(2048, 4096, 8, 16, 1, 1).resplit(2048, 16, 16, 4)
    assert forced.smem == max(forced.xs_budget, 16 * 512) + 4 * BLOCK_LUT_SLICE
    eight = plan_launch(2048, 4096, 8, 16, 1, 1).resplit(2048, 16, 8, 4)
    assert eight.smem == max(eight.xs_budget, 8 * 512) + 2 * LUT_SLICE
    monkeypatch.setattr(moe, "BLOCK_XS_CAP", 200 * 1024)  # with the 8 LUT slices, past the SM's shared memory
    with pytest.raises(ValueError, match="bytes of shared memory"):
        single_block_plan(14336, 8192, 16)


def test_activation_stage_leaves_every_cta_its_registers_allow(monkeypatch):
    from pwruntime.kernels import moe

    def ctas(p):  # CTAs an SM: registers (launch bounds) and shared memory, static and reserved included
        per_cta = p.smem + moe.STATIC_SMEM + moe.CTA_SMEM_RESERVED
        return min(moe.ctas_by_registers(p.nt, p.warps), moe.SM_SMEM // per_cta)

    olmoe, mixtral = MoEShape(64, 2048, 1024, 8), MoEShape(8, 4096, 14336, 2)
    for tokens in (8, 12, 16):   # 4-warp CTAs, four an SM by registers: the stage shrinks below XS_CAP so four fit
        for p in moe_plans(olmoe, tokens):
            assert p.warps == 4 and p.xs_budget < XS_CAP and ctas(p) == 4, (tokens, p)
    for tokens in (1, 4, 8, 16, 32, 64):   # nowhere fewer CTAs than registers allow where XS_CAP would allow them
        for arch, (h, i, e, k) in ARCHS.items():
            for p in moe_plans(MoEShape(e, h, i, k), tokens):
                capped = replace(p, smem=moe.launch_smem(min(p.xs_budget, XS_CAP), p.nt, p.warps, p.ksplit))
                assert ctas(p) >= min(ctas(capped), moe.ctas_by_registers(p.nt, p.warps)), (arch, tokens, p)
                assert p.xs_budget <= XS_CAP or p.xs_budget == tokens_staged(p, tokens) * XS_CHUNK
    assert all(p.xs_budget == XS_CAP for p in moe_plans(mixtral, 16))  # two 8-warp CTAs an SM either way
    monkeypatch.setattr(moe, "OCCUPANCY_XS", False)   # tune --xs-no-occupancy: the stage as before, three CTAs an SM
    assert all(p.xs_budget == XS_CAP and ctas(p) == 3 for p in moe_plans(olmoe, 16))


def tokens_staged(p, tokens: int) -> int:
    """Tokens one CTA of plan `p` stages: up to its n-tiles' 8 each."""
    return min(tokens, 8 * p.nt)


def test_single_block_grid_fills_one_wave_of_row_groups():
    # the kernel gives CTA c the 16-row groups c, c + grid, ...: a grid of one full wave spreads the 896 groups of
    # the 14336-row block evenly; never fewer CTAs than the plan's tiles (every row covered), never more than groups
    t1, t8 = plan_launch(14336, 4096, 1, 16, 1, 1), plan_launch(14336, 4096, 8, 16, 1, 1)
    assert (t1.grid, t8.grid) == (448, 224)
    assert linear_grid(t1, 14336, 4 * 132) == 528 and linear_grid(t8, 14336, 2 * 132) == 264
    assert linear_grid(t1, 14336, 300) == 448                           # a smaller GPU: the plan's tiles
    small = plan_launch(200, 1000, 1, 16, 1, 1)
    assert linear_grid(small, 200, 528) == 13                           # 13 row groups, one a CTA


def test_pdl_launch_structs_match_the_driver_abi():
    # cuLaunchKernelEx reads these by offset: CUlaunchConfig is 56 bytes with hStream at 32, attrs at 40,
    # numAttrs at 48; CUlaunchAttribute is 72 bytes with its value union at 8
    import ctypes
    assert ctypes.sizeof(kc.LaunchConfig) == 56 and ctypes.sizeof(kc.LaunchAttribute) == 72
    cfg = kc.LaunchConfig
    assert (cfg.stream.offset, cfg.attrs.offset, cfg.num_attrs.offset) == (32, 40, 48)
    assert kc.LaunchAttribute.value.offset == 8
    # each kernel parameter pointer reads back its argument as the C type the kernel declares
    args = (kc.i32(-7), kc.i64(1 << 40), kc.f32(1.5), kc.ptr(None), np.uint64(0xDEAD0000BEEF))
    values, params = kc.kernel_params(args)
    ctypes_of = (ctypes.c_int32, ctypes.c_int64, ctypes.c_float, ctypes.c_uint64, ctypes.c_uint64)
    back = [ctypes.cast(params[i], ctypes.POINTER(t)).contents.value for i, t in enumerate(ctypes_of)]
    assert back == [-7, 1 << 40, 1.5, 0, 0xDEAD0000BEEF] and len(values) == len(args)


def test_launch_attributes_carry_pdl_and_the_carveout():
    import ctypes
    both = kc._launch_attributes(True, 71)
    assert [a.id for a in both] == [6, 14]   # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, ..._CARVEOUT
    assert int.from_bytes(bytes(both[0].value[:4]), "little") == 1
    assert int.from_bytes(bytes(both[1].value[:4]), "little") == 71 and not any(both[1].value[4:])
    assert [a.id for a in kc._launch_attributes(False, 100)] == [14]
    assert [a.id for a in kc._launch_attributes(True, None)] == [6]
    assert ctypes.sizeof(both) == 2 * ctypes.sizeof(kc.LaunchAttribute)   # contiguous, as attrs[] is read


def test_a_moe_layers_two_launches_share_one_carveout(monkeypatch):
    from pwruntime.kernels import moe
    configs = moe.CARVEOUTS_KIB
    for arch, (h, i, e, k) in ARCHS.items():
        for tokens in (1, 2, 4, 8, 16, 32, 64):
            p1, p2 = moe_plans(MoEShape(e, h, i, k), tokens)
            for p in (p1, p2):  # the configuration holds the CTAs the SM can run, and the next smaller does not
                per_cta = p.smem + moe.STATIC_SMEM + moe.CTA_SMEM_RESERVED
                ctas = min(moe.ctas_by_registers(p.nt, p.warps), moe.SM_SMEM // per_cta)
                kib = moe.carveout_kib(p)
                assert kib * 1024 >= ctas * per_cta
                assert kib == configs[0] or configs[configs.index(kib) - 1] * 1024 < ctas * per_cta
            pct, want = moe.layer_carveout(p1, p2), max(moe.carveout_kib(p1), moe.carveout_kib(p2))
            # the driver rounds a percentage up to a configuration: it lands on `want`, not the one below
            below = configs[configs.index(want) - 1]
            assert below < pct * 228 / 100 <= want, (arch, tokens, pct, want)
    # Qwen3-MoE at one token: gate_up alone fits 132 KiB, down needs 164 (the driver gave them those); both take 164
    p1, p2 = moe_plans(MoEShape(128, 2048, 768, 8), 1)
    assert (moe.carveout_kib(p1), moe.carveout_kib(p2), moe.layer_carveout(p1, p2)) == (132, 164, 71)
    monkeypatch.setattr(moe, "LAYER_CARVEOUT", False)   # tune --driver-carveout
    assert moe.layer_carveout(p1, p2) is None


def test_attention_kernel_choice_and_context_split():
    from pwruntime.kernels.attention import context_parts, gqa_kernel_applies, heads_per_cta
    for dim in (64, 128, 256, 512):
        assert gqa_kernel_applies(torch.float16, dim) and gqa_kernel_applies(torch.bfloat16, dim)
    assert not gqa_kernel_applies(torch.float32, 128)             # fp32 caches: the generic kernel
    assert not gqa_kernel_applies(torch.float16, 96)              # a head_dim it has no lane split for
    # a CTA serves the largest divisor of the group up to 4 heads
    assert [heads_per_cta(g, 128) for g in (1, 2, 3, 4, 5, 6, 8, 16)] == [1, 2, 3, 4, 1, 3, 4, 4]
    assert heads_per_cta(8, 256) == 4 and heads_per_cta(8, 64) == 4
    assert heads_per_cta(8, 512) == 2 and heads_per_cta(5, 512) == 1   # 512-wide heads: a 32 KiB merge buffer holds 2
    # enough CTAs or short contexts: no split; few sequences over long contexts: about two CTAs an SM
    assert context_parts(256, 4096, 132) == 1
    assert context_parts(8, 400, 132) == 1
    assert context_parts(8, 4096, 132) == 16                      # capped by 256-token parts
    assert context_parts(64, 1024, 132) == 4                      # a sliding window's 1024 tokens in 4 parts
    assert context_parts(8, 64 * 1024, 132) == 33
    assert context_parts(64, 64 * 1024, 132) == 5


def test_sources_inline_headers_and_cpu_path_never_imports_cupy():
    src = kc.source("ap_moe.cu")
    assert "mma.sync.aligned.m16n8k16" in src and '#include "pw_common.cuh"' not in src
    assert "m16n8k256.row.col.s32.b1.b1.s32.and.popc" in src and '#include "ap_b1.cuh"' not in src
    probe = kc.source("load_pattern.cu")  # the load-only microbenchmark of `tune --load-patterns`
    assert "pw_load_pattern" in probe and "ldg_nc_v4" in probe and '#include' not in probe
    gqa = kc.source("paged_attention_gqa.cu")
    assert "pw_paged_attention_gqa" in gqa and "pw_paged_attention_merge" in gqa and "#include" not in gqa
    assert kc.options([("PW_NT", 2)]) == ("-std=c++17", "-DPW_NT=2")
    code = ("import sys, torch; from pwruntime.kernels import fused_moe, paged_attention_decode, DeviceWeightTable;"
            "assert 'cupy' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def _fake_bench_results() -> dict:
    moe = []
    for model in ("a", "b"):
        for t in (1, 4):
            for b in (3, 4, 5, 6, 7, 8):
                moe.append({"model": model, "tokens": t, "bits": b, "ap_us": 10.0 * b / t, "ap_bytes": 1e6 * b,
                            "ap_gbps": 1e6 * b / (10.0 * b / t) / 1e3, "fp16_loop_us": 40.0 if t == 1 else 5.0,
                            "fp16_gathered_bmm_us": None})
    return {"device": "Test GPU", "command": "pwruntime bench kernels", "gpu_memory_bytes": 80 << 30,
            "copy": {"h2d_pinned_gbps": 50.0, "d2h_pinned_gbps": 52.0, "d2d_copy_gbps": 4000.0},
            "fp16_gemm_tflops": 700.0, "paged_attention": {"gbps": 2000.0},
            "single_block": [{"tokens": 1, "fp16_gbps": 3600.0}], "moe": moe}


def test_bench_profiles_of_other_dtypes_and_routings_do_not_overwrite_the_default(tmp_path):
    # a session's fp16, bf16 and skewed-routing runs into one folder each keep their own profile
    from pathlib import Path
    from pwruntime.kernels.bench_report import default_profile_path
    res = {"device": "NVIDIA H200", "dtype": "fp16", "routing": "uniform"}
    assert default_profile_path(res, tmp_path / "bench.json") == tmp_path / "hardware-profile-h200.json"
    assert default_profile_path(res, None) == Path("hardware-profile-h200.json")
    names = {default_profile_path({**res, "dtype": d, "routing": r}, tmp_path / "b.json").name
             for d in ("fp16", "bf16") for r in ("uniform", "zipf:1.0")}
    assert names == {"hardware-profile-h200.json", "hardware-profile-h200-bf16.json",
                     "hardware-profile-h200-zipf-1-0.json", "hardware-profile-h200-bf16-zipf-1-0.json"}


def test_bench_profile_is_a_valid_hardware_profile(tmp_path):
    from pwruntime.kernels.bench_report import add_rooflines, measured_profile
    from traces.hardware import load_profile
    res = _fake_bench_results()
    add_rooflines(res)
    assert res["fp16_gemv_gbps"] == 3600.0
    assert res["moe"][0]["roofline_us"] == pytest.approx(3e6 / 3600.0 / 1e3)
    prof = measured_profile(res, "test-measured")
    path = prof.save(tmp_path / "p.json")
    back = load_profile(path)
    assert back.measured and back.hbm_gbps == 4000.0 and back.pcie_h2d_gbps == 50.0
    assert back.achieved_bandwidth_fraction["moe"] == pytest.approx(0.9)
    assert back.achieved_bandwidth_fraction["attention"] == pytest.approx(0.5)
    # ap efficiency at T=1: 1e6*b bytes in 10*b us = 100 GB/s over 3600 GB/s
    assert back.ap_kernel_efficiency[3] == pytest.approx(100 / 3600, rel=1e-3)
    # per batch size too: at T=4 the layer moves the same bytes in a quarter of the time
    assert back.ap_efficiency_by_tokens[3] == pytest.approx({1: 100 / 3600, 4: 400 / 3600}, rel=1e-3)
    assert back.ap_efficiency(3, 2) == pytest.approx(250 / 3600, rel=1e-3)  # halfway in log(T)
    from pwruntime.device_store import FUSED_MAX_TOKENS
    assert back.ap_fused_max_tokens == FUSED_MAX_TOKENS  # the runtime's rule, not a judgement of the kernel


def test_bench_cli_needs_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    r = subprocess.run([sys.executable, "-m", "pwruntime.cli", "bench", "kernels"], capture_output=True, text=True)
    assert r.returncode == 2 and "needs a CUDA GPU" in r.stderr and "Traceback" not in r.stderr
    r = subprocess.run([sys.executable, "-m", "pwruntime.cli", "bench", "layers"], capture_output=True, text=True)
    assert r.returncode == 2


def test_tune_forced_ksplit_keeps_token_groups(monkeypatch):
    from pwruntime.kernels import moe, tune
    monkeypatch.setattr(moe, "plan_launch", moe.plan_launch)   # undone after the test
    shape = MoEShape(64, 2048, 1024, 8)
    before = moe_plans(shape, 64)
    tune.force_ksplit(4)
    for old, new in zip(before, moe_plans(shape, 64)):
        assert new.ksplit == 4 and (new.nt, new.token_groups) == (old.nt, old.token_groups) == (4, 2)
        assert new.smem == old.smem + (1 - 4 // old.ksplit) * LUT_SLICE


def test_tune_harness_needs_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    r = subprocess.run([sys.executable, "-m", "pwruntime.kernels.tune", "--load-patterns"], capture_output=True,
                       text=True)
    assert r.returncode == 2 and "needs a CUDA GPU" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("args,message", [
    (["--ksplit", "8"], "does not divide the 4 warps"), (["--warps", "6"], "invalid choice: 6"),
    (["--ksplit", "3"], "invalid choice: 3"), (["--block-xs-cap", "200000"], "--block-xs-cap 200000: shared memory"),
    (["--xs-cap", "100"], "--xs-cap 100: shared memory for activations must be 1152..")])
def test_tune_rejects_launch_shapes_the_kernel_cannot_run(args, message):
    # checked before the GPU is looked for, so the message is the same with or without one
    r = subprocess.run([sys.executable, "-m", "pwruntime.kernels.tune", *args], capture_output=True, text=True)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr


def test_forced_plans_keep_the_k_split_within_the_ctas_warps(monkeypatch):
    from pwruntime.kernels import moe, tune
    monkeypatch.setattr(moe, "plan_launch", moe.plan_launch)  # force_ksplit replaces it; restored after the test
    assert moe.plan_launch(2048, 4096, 1, 16, 1, 1).ksplit == 4  # the planner's choice for this shape
    tune.force_ksplit(None, 2)
    p = moe.plan_launch(2048, 4096, 1, 16, 1, 1)
    assert (p.warps, p.ksplit, p.n_tiles) == (2, 2, 2048 // 16)
    assert p.smem == moe.launch_smem(p.xs_budget, p.nt, 2, 2)


def test_load_pattern_ref_is_the_xor_of_all_words():
    rng = np.random.default_rng(3)
    planes = [torch.from_numpy(rng.integers(-2**31, 2**31, size=(7, 5), dtype=np.int64).astype(np.int32))
              for _ in range(3)]
    want = np.bitwise_xor.reduce(np.concatenate([p.numpy().ravel().view(np.uint32) for p in planes]))
    assert load_pattern_ref(planes) == int(want)
    assert load_pattern_ref([torch.zeros(4, dtype=torch.int32)] * 3) == 0


def test_an_engine_compiles_the_builds_its_launches_name():
    # an engine compiles `layer_variants` before it serves: the builds its MoE layers' launches run at 1..64 tokens, in
    # both dtypes, each in the warm-up CLI's list for the four architectures and the demo model
    built = set(kc.variants())
    for h, i, e, k in list(ARCHS.values()) + [(256, 128, 16, 4)]:
        shape = MoEShape(e, h, i, k)
        for dtype in (torch.float16, torch.bfloat16):
            got = layer_variants(shape, dtype)
            assert got == {p.variant(dtype) for t in range(1, MAX_TOKENS + 1) for p in moe_plans(shape, t)}
            assert got <= built and {dict(d)["PW_NT"] for _, d in got} >= {1, 2, 4}
            assert all(name == "ap_moe.cu" and dict(d)["PW_BF16"] == (dtype == torch.bfloat16) for name, d in got)


def test_decode_variant_names_the_kernel_paged_attention_runs():
    # the GQA kernel for 16-bit caches of heads 64/128/256 wide (heads a CTA: a divisor of the group), the generic one
    # for fp32 and other multiples of 32 up to 512 (or when asked; Gemma 4's global heads), None where the reference
    # runs
    gqa = ("paged_attention_gqa.cu", (("PW_DT", 1), ("PW_D", 128), ("PW_G", 4)))
    assert decode_variant(torch.bfloat16, 128, 4) == gqa
    assert decode_variant(torch.float16, 64, 6) == ("paged_attention_gqa.cu", (("PW_DT", 0), ("PW_D", 64), ("PW_G", 3)))
    assert decode_variant(torch.float32, 128, 4) == ("paged_attention.cu", (("PW_DT", 2), ("PW_DPL", 4)))
    assert decode_variant(torch.float16, 96, 1) == ("paged_attention.cu", (("PW_DT", 0), ("PW_DPL", 3)))
    assert decode_variant(torch.float16, 128, 4, generic=True)[0] == "paged_attention.cu"
    assert decode_variant(torch.bfloat16, 512, 8) == ("paged_attention_gqa.cu",
                                                      (("PW_DT", 1), ("PW_D", 512), ("PW_G", 2)))
    assert decode_variant(torch.float32, 512, 8) == ("paged_attention.cu", (("PW_DT", 2), ("PW_DPL", 16)))
    assert decode_variant(torch.float16, 48, 1) is None and decode_variant(torch.float16, 544, 1) is None
    assert decode_variant(torch.int8, 128, 1) is None


def test_compile_variants_builds_each_asked_variant_once_in_threads(monkeypatch):
    # every distinct (source, defines) once, on the device's index and capability, as many at a time as asked and
    # the machine has cores
    seen, threads = [], set()

    def fake_module(index, cap, name, defines):
        seen.append((index, cap, name, defines))
        threads.add(threading.get_ident())
        time.sleep(0.05)

    monkeypatch.setattr(kc, "_module", fake_module)
    monkeypatch.setattr(kc, "_capability", lambda index: (9, 0))
    wanted = kc.variants()
    kc.compile_variants(3, wanted + wanted[:5], jobs=4)
    assert sorted(seen) == sorted((3, (9, 0), name, defines) for name, defines in wanted)
    assert len(threads) == min(4, os.cpu_count() or 1)


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU it compiles")
def test_compile_cli_without_a_gpu_is_one_clear_error(capsys):
    assert kc.main([]) == 2 and kc.main(["--device", "3"]) == 2
    err = capsys.readouterr().err
    assert err.count("error: --device") == 2 and "0 CUDA device(s)" in err and "Traceback" not in err
