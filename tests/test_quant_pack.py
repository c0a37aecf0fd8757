"""Layout-v1 bit-plane packing, the torch dequantize reference, and exact stored bytes."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from policies.apformat import ap_block_bytes, plane_bytes
from pwruntime.quant.pack import (dequantize, pack_planes, pack_planes_torch, unpack_codes, unpack_codes_torch,
                                  words_per_row)
from pwruntime.quant.quantizer import quantize_block

SHAPES = [(3, 1), (5, 31), (4, 32), (2, 33), (7, 50), (3, 768), (2, 1408)]


@pytest.mark.parametrize("out_f,in_f", SHAPES)
def test_pack_unpack_round_trip_numpy_and_torch(out_f, in_f):
    codes = np.random.default_rng(in_f).integers(0, 256, (out_f, in_f), dtype=np.uint8)
    planes = pack_planes(codes)
    assert planes.dtype == np.uint32 and planes.shape == (8, out_f, words_per_row(in_f))
    planes_t = pack_planes_torch(torch.from_numpy(codes))
    assert planes_t.dtype == torch.uint32
    assert np.array_equal(planes_t.view(torch.int32).numpy().view(np.uint32), planes)
    for b in range(1, 9):
        want = codes >> (8 - b)
        assert np.array_equal(unpack_codes(planes, b, in_f), want)
        assert np.array_equal(unpack_codes_torch(planes_t, b, in_f).numpy(), want)
        assert np.array_equal(unpack_codes_torch(planes_t.view(torch.int32)[:b], b, in_f).numpy(), want)


def test_bit_positions_follow_layout_v1():
    codes = np.zeros((3, 70), dtype=np.uint8)
    codes[1, 37] = 0b1000_0001  # MSB -> plane 0, LSB -> plane 7; column 37 -> word 1, bit 5
    codes[2, 69] = 0b0100_0000  # bit 6 -> plane 1; column 69 -> word 2, bit 5
    planes = pack_planes(codes)
    expect = np.zeros_like(planes)
    expect[0, 1, 1] = 1 << 5
    expect[7, 1, 1] = 1 << 5
    expect[1, 2, 2] = 1 << 5
    assert np.array_equal(planes, expect)
    full = pack_planes(np.full((1, 70), 255, dtype=np.uint8))
    assert (full[:, 0, :2] == 0xFFFFFFFF).all()
    assert (full[:, 0, 2] == (1 << 6) - 1).all()  # padding bits of the last word are zero


@pytest.mark.parametrize("out_f,in_f", [(6, 50), (4, 768), (3, 1408)])
def test_dequantize_reference_equals_numpy_lut_lookup(out_f, in_f):
    rng = np.random.default_rng(out_f)
    codes = rng.integers(0, 256, (out_f, in_f), dtype=np.uint8)
    planes = torch.from_numpy(pack_planes(codes))
    for b in range(3, 9):
        lut = rng.standard_normal((out_f, 1 << b)).astype(np.float16)
        want = np.take_along_axis(lut, (codes >> (8 - b)).astype(np.int64), axis=1)
        got = dequantize(planes[:b], torch.from_numpy(lut), out_f, in_f)
        assert got.dtype == torch.float16 and np.array_equal(got.numpy(), want)
        got32 = dequantize(planes[:b], torch.from_numpy(lut), out_f, in_f, dtype=torch.float32)
        assert np.array_equal(got32.numpy(), want.astype(np.float32))
    with pytest.raises(ValueError):
        dequantize(planes[:4], torch.zeros(out_f, 8, dtype=torch.float16), out_f, in_f)  # LUT_3 with 4 planes


@pytest.mark.parametrize("out_f,in_f", [(64, 50), (96, 768), (40, 1408), (32, 64)])
def test_stored_bytes_equal_apformat(out_f, in_f):
    w = np.random.default_rng(0).standard_normal((out_f, in_f)).astype(np.float32)
    blk = quantize_block(w)
    assert blk.planes.nbytes == 8 * plane_bytes(out_f, in_f)
    for b in range(3, 9):
        assert blk.stored_bytes(b) == ap_block_bytes(out_f, in_f, b)
        # what a kernel reads at b bits: the top b planes + LUT_b, nothing else
        assert blk.planes[:b].nbytes + blk.luts[b].nbytes == ap_block_bytes(out_f, in_f, b)
        assert blk.planes[:b].flags["C_CONTIGUOUS"]


def test_packed_block_dequantizes_to_the_quantized_matrix():
    from pwruntime.quant.kmeans import quantize_matrix

    w = np.random.default_rng(9).standard_normal((12, 100)).astype(np.float32)
    q = quantize_matrix(w, seed=2)
    planes = torch.from_numpy(pack_planes(q.codes))
    for b in range(3, 9):
        got = dequantize(planes[:b], torch.from_numpy(q.luts[b]), 12, 100, dtype=torch.float32)
        assert np.array_equal(got.numpy(), q.reconstruct(b))


def test_unpack_and_dequantize_refuse_planes_of_another_shape():
    """Planes whose word count, plane count or rows do not match the matrix are an error, not a silent misread."""
    codes = np.random.default_rng(3).integers(0, 256, (4, 70), dtype=np.uint8)
    planes = pack_planes(codes)  # 3 words per row
    planes_t = torch.from_numpy(planes.view(np.int32))
    for unpack, p in ((unpack_codes, planes), (unpack_codes_torch, planes_t)):
        with pytest.raises(ValueError, match="words per row"):
            unpack(p, 4, 40)  # 40 columns take 2 words, not 3
        with pytest.raises(ValueError, match="words per row"):
            unpack(p, 4, 100)  # 100 columns take 4 words
        with pytest.raises(ValueError, match="bits must be"):
            unpack(p, 0, 70)
        with pytest.raises(ValueError, match="bits must be"):
            unpack(p[:3], 4, 70)  # 4 bits from 3 planes
    lut = torch.zeros(3, 16, dtype=torch.float16)
    with pytest.raises(ValueError, match="rows"):
        dequantize(planes_t[:4], lut, 3, 70)  # LUT and out_features say 3 rows, the planes have 4


def test_quantize_block_seeds_at_its_lowest_bits_and_keeps_only_its_luts():
    """quantize_block(bits) is the k-means seeded at min(bits) (not a fixed 3), packed, with LUT_b for those bits only;
    asking pack_quantized for a bitwidth below the seed is a ValueError."""
    from pwruntime.quant.kmeans import quantize_matrix
    from pwruntime.quant.quantizer import pack_quantized

    w = np.random.default_rng(12).standard_normal((8, 96)).astype(np.float32)
    blk = quantize_block(w, bits=(6, 4, 8), seed=4)
    q = quantize_matrix(w, seed_bits=4, seed=4)
    assert sorted(blk.luts) == [4, 6, 8]
    assert np.array_equal(blk.planes, pack_planes(q.codes))
    assert all(np.array_equal(blk.luts[b], q.luts[b]) for b in (4, 6, 8))
    assert not np.array_equal(pack_planes(quantize_matrix(w, seed_bits=3, seed=4).codes), blk.planes)
    with pytest.raises(ValueError, match="no LUT for bits"):
        pack_quantized(q, (3, 4))
