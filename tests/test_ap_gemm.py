"""The fused AP grouped GEMM (kernels.ap_gemm) and the prefill that takes it where a layer is at 3-4 bits.

CPU: the reference against a float64 loop over dequantized blocks, the wrapper's checks, and grouped_mm_moe's
device-side switch between the fused GEMM and the dequantize path (the fused GEMM's reference sabotaged, so which
path ran shows in the result). GPU (`gpu` marker): the kernel against the reference at every bitwidth, both tile
sizes and a LUT capacity below the blocks' bits; its `on` flag; the dequantize kernel's `skip`; a captured prefill
that follows the bits of each replay.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import pwruntime.device_store as ds
import pwruntime.prefill_layer as pl
from pwruntime.kernels import DeviceWeightTable, MoEShape, dequantize_blocks
from pwruntime.kernels import ap_gemm
from pwruntime.kernels.ap_gemm import ap_grouped_mm, ap_grouped_mm_ref
from pwruntime.kernels.device_table import device_layout
from pwruntime.model.experts import grouped_mm_moe
from pwruntime.prefill_layer import FusedGemmLayer, dequantize_experts, fused_gemm_prefill, prefill_moe
from pwruntime.quant.pack import dequantize, pack_planes


def random_layer(shape: MoEShape, bits, device: str, seed: int = 0) -> DeviceWeightTable:
    """One MoE layer of random AP blocks; bits(expert, kind) their committed bits (0: not resident)."""
    rng = np.random.default_rng(seed)
    table = DeviceWeightTable(shape.num_experts * 2, device)
    for e in range(shape.num_experts):
        for kind, (o, i) in enumerate([(2 * shape.intermediate, shape.hidden), (shape.hidden, shape.intermediate)]):
            codes = rng.integers(0, 256, size=(o, i), dtype=np.uint8)
            planes = torch.from_numpy(pack_planes(codes).view(np.int32)).to(device)
            b = bits(e, kind)
            lut = torch.from_numpy(np.sort(rng.standard_normal((o, 1 << max(b, 3))), axis=1) / np.sqrt(i))
            table.set_block(shape.block(0, e, kind), device_layout(planes), lut.half().to(device), max(b, 3))
            if b == 0:
                table.clear(shape.block(0, e, kind))
    return table


def sorted_rows(counts: list[int], k: int, dtype, device: str, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(counts), k, generator=gen).to(dtype).to(device)
    return x, torch.tensor(np.cumsum(counts), dtype=torch.int32, device=device)


# ---------------------------------------------------------------- CPU
def test_reference_is_each_experts_rows_times_its_dequantized_block():
    shape = MoEShape(4, 64, 64, 2)
    table = random_layer(shape, lambda e, kind: (3, 8, 0, 5)[e], "cpu")
    counts = [3, 0, 2, 4]   # expert 1 has no rows, expert 2 is not resident
    x, ends = sorted_rows(counts, 64, torch.float32, "cpu")
    blocks = range(0, 8, 2)   # the gate_up blocks
    got = ap_grouped_mm(table, blocks, x, ends, 128)
    start = 0
    for e, c in enumerate(counts):
        rb = table.resident(blocks[e])
        w = (torch.zeros(128, 64, dtype=torch.float64) if rb is None
             else dequantize(rb.stacked(), rb.lut, 128, 64).double())
        want = x[start:start + c].double() @ w.T
        torch.testing.assert_close(got[start:start + c].double(), want, rtol=1e-5, atol=1e-5)
        start += c
    assert not got[3:5].any()   # the rows of expert 2, whose block is zeros


def test_wrapper_rejects_what_the_kernel_cannot_take():
    shape = MoEShape(2, 64, 64, 2)
    table = random_layer(shape, lambda e, kind: 4, "cpu")
    x, ends = sorted_rows([2, 2], 64, torch.float32, "cpu")
    blocks = range(0, 4, 2)
    with pytest.raises(ValueError, match="K % 64"):
        ap_grouped_mm(table, blocks, x[:, :32], ends, 128)
    with pytest.raises(ValueError, match="one entry per expert"):
        ap_grouped_mm(table, range(0, 2, 2), x, ends, 128)
    with pytest.raises(ValueError, match="tile_rows"):
        ap_grouped_mm(table, blocks, x, ends, 128, tile_rows=32)
    with pytest.raises(ValueError, match="int64"):
        ap_grouped_mm(table, blocks, x, ends, 128, on=torch.ones(1, dtype=torch.int32))


def test_on_zero_writes_nothing():
    shape = MoEShape(2, 64, 64, 2)
    table = random_layer(shape, lambda e, kind: 3, "cpu")
    x, ends = sorted_rows([2, 3], 64, torch.float32, "cpu")
    out = torch.full((5, 128), 7.0)
    ap_grouped_mm(table, range(0, 4, 2), x, ends, 128, out=out, on=torch.zeros(1, dtype=torch.long))
    assert (out == 7).all()
    ap_grouped_mm(table, range(0, 4, 2), x, ends, 128, out=out, on=torch.ones(1, dtype=torch.long))
    torch.testing.assert_close(out, ap_grouped_mm_ref(table, range(0, 4, 2), x, ends, 128))


def test_fused_layer_is_on_only_where_every_block_is_at_four_bits_or_fewer():
    shape = MoEShape(4, 64, 64, 2)
    low = random_layer(shape, lambda e, kind: (3, 4, 0, 4)[e], "cpu")
    layer = FusedGemmLayer.of(low, shape, 0, rows=100)
    assert int(layer.on) == 1 and int(layer.off) == 0 and layer.tile_rows == 64   # 100 rows < 64 a expert
    assert list(layer.blocks[0]) == [0, 2, 4, 6] and list(layer.blocks[1]) == [1, 3, 5, 7]
    assert layer.out_features == (128, 64)
    assert FusedGemmLayer.of(low, shape, 0, rows=256).tile_rows == 128
    one_high = random_layer(shape, lambda e, kind: 5 if (e, kind) == (2, 1) else 3, "cpu")
    assert int(FusedGemmLayer.of(one_high, shape, 0, rows=100).on) == 0
    # the host's choice, from the table's host mirror: no layer at all above 4 bits, one without flags below
    assert FusedGemmLayer.of(one_high, shape, 0, rows=100, on_device=False) is None
    host = FusedGemmLayer.of(low, shape, 0, rows=100, on_device=False)
    assert host.on is None and host.off is None and host.blocks == layer.blocks


def test_fused_gemm_prefill_takes_layers_of_few_rows_an_expert(monkeypatch):
    monkeypatch.setattr(pl, "grouped_mm_prefill", lambda x, shape: True)
    shape = MoEShape(128, 2816, 704, 8)
    x = torch.zeros(2048, 2816, dtype=torch.bfloat16)
    assert fused_gemm_prefill(x, shape)               # 128 rows an expert
    assert not fused_gemm_prefill(torch.zeros(2049, 2816, dtype=torch.bfloat16), shape)
    assert not fused_gemm_prefill(torch.zeros(16, 2848, dtype=torch.bfloat16), MoEShape(128, 2848, 704, 8))  # K
    monkeypatch.setattr(pl, "grouped_mm_prefill", lambda x, shape: False)
    assert not fused_gemm_prefill(x, shape)


@pytest.mark.parametrize("max_experts", [4, 3])   # one chunk of experts, or two
@pytest.mark.parametrize("high", [False, True])   # every block at 3-4 bits, or one at 8
def test_grouped_mm_moe_switches_to_the_fused_gemm_on_the_device(monkeypatch, max_experts, high):
    shape = MoEShape(4, 64, 64, 2)
    table = random_layer(shape, lambda e, kind: 8 if high and (e, kind) == (1, 0) else 3 + (e + kind) % 2, "cpu")
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(24, 64, generator=gen).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(4, generator=gen)[:2] for _ in range(24)])
    w = torch.softmax(torch.randn(24, 2, generator=gen), dim=-1)

    def run(fused):
        norms = torch.zeros(24, 2)
        skip = None if fused is None else fused.on
        weights_of = lambda group: dequantize_experts(table, shape, 0, group, torch.bfloat16, skip)  # noqa: E731
        return grouped_mm_moe(x, ids, w, 4, weights_of, max_experts, norms, fused=fused).float(), norms

    want, want_norms = run(None)
    got, got_norms = run(FusedGemmLayer.of(table, shape, 0, rows=48))
    torch.testing.assert_close(got, want, rtol=0.05, atol=0.02)
    torch.testing.assert_close(got_norms, want_norms, rtol=0.02, atol=0.02)
    # which path ran: the fused GEMM's reference, negated, changes the result only where the layer is fused
    real = ap_gemm.ap_grouped_mm_ref
    monkeypatch.setattr(ap_gemm, "ap_grouped_mm_ref", lambda *a, **k: real(*a, **k).neg_())
    sabotaged, _ = run(FusedGemmLayer.of(table, shape, 0, rows=48))
    if high:
        assert torch.equal(sabotaged, got)
    else:
        assert (sabotaged - want).abs().max() > 0.1


def test_a_layer_the_host_chose_runs_the_fused_gemm_alone(monkeypatch):
    shape = MoEShape(4, 64, 64, 2)
    table = random_layer(shape, lambda e, kind: 3 + (e + kind) % 2, "cpu")
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(20, 64, generator=gen).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(4, generator=gen)[:2] for _ in range(20)])
    w = torch.softmax(torch.randn(20, 2, generator=gen), dim=-1)
    weights_of = lambda group: dequantize_experts(table, shape, 0, group, torch.bfloat16)  # noqa: E731
    want = grouped_mm_moe(x, ids, w, 4, weights_of, 2).float()

    def no_weights(group):
        raise AssertionError("a layer the fused GEMM runs alone dequantizes nothing")

    fused = FusedGemmLayer.of(table, shape, 0, rows=40, on_device=False)
    got = grouped_mm_moe(x, ids, w, 4, no_weights, 2, fused=fused).float()
    torch.testing.assert_close(got, want, rtol=0.05, atol=0.02)


def test_within_dequantizing_the_store_s_prefill_never_takes_the_fused_gemm(ap_path, monkeypatch):
    """`DeviceExpertStore.dequantizing` tells prefill_moe not to take the fused GEMM, and only while it lasts."""
    from policies.page_table import PageTable
    from pwruntime.device_store import DeviceExpertStore
    from pwruntime.quant.store import APExpertStore

    ap = APExpertStore.from_checkpoint(ap_path)
    table = PageTable(len(ap.layers), ap.experts, ap.hidden, ap.intermediate, bits=ap.bits, initial_bits=3)
    store = DeviceExpertStore.from_ap_store(ap, device="cpu", dtype=torch.bfloat16, table=table)
    asked = []
    monkeypatch.setattr(ds, "prefill_moe", lambda *args: asked.append(args[-1]) or args[3])
    x = torch.zeros(200, ap.hidden, dtype=torch.bfloat16)   # more tokens than the fused decode kernel takes
    ids, w = torch.zeros(200, 2, dtype=torch.long), torch.full((200, 2), 0.5)
    store.moe(0, x, ids, w)
    with store.dequantizing():
        store.moe(0, x, ids, w)
    with pytest.raises(KeyError), store.dequantizing():
        raise KeyError("left by an exception")
    store.moe(0, x, ids, w)
    assert asked == [True, False, True]


def test_the_profiling_forward_runs_inside_the_store_s_dequantizing(tmp_path):
    """The activation profile measures the prefill path that holds the most memory: its forward's MoE layers run
    inside the store's `dequantizing` (a store without one, the dense experts', runs as it is)."""
    from contextlib import contextmanager

    from model_fixtures import make_tiny_checkpoint
    from pwruntime.activation_profile import profile_forward
    from pwruntime.model import load_model

    model = load_model(make_tiny_checkpoint(tmp_path, "qwen2_moe", seed=2))
    plain = profile_forward(model, 4, False, 24, 64, 3)
    dense, inside, seen = model.experts, [False], []

    class Recording:
        def __getattr__(self, name):
            return getattr(dense, name)

        @contextmanager
        def dequantizing(self):
            inside[0] = True
            yield
            inside[0] = False

        def moe(self, *args, **kwargs):
            seen.append(inside[0])
            return dense.moe(*args, **kwargs)

    model.experts = Recording()
    torch.testing.assert_close(profile_forward(model, 4, False, 24, 64, 3), plain)
    assert seen and all(seen) and not inside[0]


# ---------------------------------------------------------------- GPU
GEMMA = MoEShape(128, 2816, 704, 8, "gelu_tanh")


def _gpu_rel(got: torch.Tensor, want: torch.Tensor) -> float:
    assert torch.isfinite(got).all()
    return float((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-9))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bits", [3, 4, 5, 6, 7, 8, "mixed"])
def test_kernel_matches_the_reference(dtype, bits):
    shape = MoEShape(8, 256, 192, 2)
    pick = (lambda e, kind: 3 + (3 * e + kind) % 6) if bits == "mixed" else (lambda e, kind, b=bits: b)
    table = random_layer(shape, lambda e, kind: 0 if e == 5 else pick(e, kind), "cuda", seed=int(dtype.itemsize))
    counts = [70, 0, 3, 129, 1, 40, 64, 200]
    for kind, (n, k) in enumerate([(384, 256), (256, 192)]):
        x, ends = sorted_rows(counts, k, dtype, "cuda")
        blocks = range(kind, 16, 2)
        want = ap_grouped_mm_ref(table, blocks, x, ends, n)
        for tile_rows in ap_gemm.TILE_ROWS:
            for max_bits in (8, 4):   # LUT rows in shared memory, or (above 4 bits) looked up in global memory
                got = ap_grouped_mm(table, blocks, x, ends, n, max_bits, tile_rows)
                assert _gpu_rel(got, want) < 5e-3, (kind, tile_rows, max_bits)


@pytest.mark.gpu
def test_on_flag_and_dequantize_skip_on_the_device():
    shape = MoEShape(2, 128, 64, 2)
    table = random_layer(shape, lambda e, kind: 3, "cuda")
    x, ends = sorted_rows([5, 9], 128, torch.bfloat16, "cuda")
    blocks = range(0, 4, 2)
    out = torch.full((14, 128), 7.0, dtype=torch.bfloat16, device="cuda")
    ap_grouped_mm(table, blocks, x, ends, 128, out=out, on=torch.zeros(1, dtype=torch.long, device="cuda"))
    assert (out == 7).all()
    ap_grouped_mm(table, blocks, x, ends, 128, out=out, on=torch.ones(1, dtype=torch.long, device="cuda"))
    assert _gpu_rel(out, ap_grouped_mm_ref(table, blocks, x, ends, 128)) < 5e-3
    skip = torch.ones(1, dtype=torch.long, device="cuda")
    poison = torch.full((2, 128, 128), float("nan"), dtype=torch.bfloat16, device="cuda")
    where = poison.data_ptr()
    del poison   # the caching allocator hands the same block to the next tensor of this size on this stream
    skipped = dequantize_blocks(table, blocks, 128, 128, torch.bfloat16, skip=skip)
    assert skipped.data_ptr() == where and torch.isnan(skipped).all()
    want = dequantize_blocks(table, blocks, 128, 128, torch.bfloat16)
    assert torch.equal(dequantize_blocks(table, blocks, 128, 128, torch.bfloat16,
                                         skip=torch.zeros(1, dtype=torch.long, device="cuda")), want)


@pytest.mark.gpu
def test_captured_prefill_follows_the_bits_of_each_replay():
    """A Gemma-4-shaped layer captured at 3 bits (fused GEMM), replayed after one block went to 8 bits (dequantize
    path) and back: each replay equals the eager prefill at the bits it ran with."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the grouped-GEMM prefill needs compute capability 9.0")
    table = random_layer(GEMMA, lambda e, kind: 3, "cuda")
    gen = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(256, GEMMA.hidden, device="cuda", generator=gen).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(GEMMA.num_experts, device="cuda", generator=gen)[:8] for _ in range(256)])
    w = torch.softmax(torch.randn(256, 8, device="cuda", generator=gen), dim=-1)
    assert fused_gemm_prefill(x, GEMMA)
    eager_low = prefill_moe(table, GEMMA, 0, x, ids, w).clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        prefill_moe(table, GEMMA, 0, x, ids, w)   # warm up (compiles) outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = prefill_moe(table, GEMMA, 0, x, ids, w)
    graph.replay()
    assert torch.equal(out, eager_low)
    lut8 = (torch.sort(torch.randn(GEMMA.hidden, 256, device="cuda", generator=gen), dim=1)[0] / 30).half()
    table.commit_bits(1, 8, lut8)   # expert 0's down block: the layer takes the dequantize path now
    eager_high = prefill_moe(table, GEMMA, 0, x, ids, w).clone()
    graph.replay()
    assert torch.equal(out, eager_high) and not torch.equal(eager_high, eager_low)
