"""AP checkpoint round trip and APExpertStore (weights at run-time bits, moe(), cache, page table)."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from policies.apformat import ap_block_bytes
from policies.page_table import PageTable
from pwruntime.quant.ap_checkpoint import (APCheckpointError, APCheckpointWriter, is_ap_checkpoint,
                                           load_ap_checkpoint)
from pwruntime.quant.kmeans import quantize_matrix
from pwruntime.quant.quantizer import pack_quantized, stack_blocks
from pwruntime.quant.store import APExpertStore

BITS = (3, 4, 5, 6, 7, 8)
L, E, H, I = 2, 3, 200, 72


@pytest.fixture(scope="module")
def ap_dir(tmp_path_factory):
    """A synthetic AP checkpoint of random experts; also returns the dense weights and quantized matrices."""
    rng = np.random.default_rng(0)
    dense = {(layer, kind): [(rng.standard_normal(shape) * 0.05).astype(np.float32) for _ in range(E)]
             for layer in range(L) for kind, shape in (("gate_up", (2 * I, H)), ("down", (H, I)))}
    quant = {key: [quantize_matrix(w, seed=j) for j, w in enumerate(ws)] for key, ws in dense.items()}
    out = tmp_path_factory.mktemp("ap") / "ckpt"
    with APCheckpointWriter(out) as wr:
        for layer in range(L):
            wr.write_layer(layer, *(stack_blocks([pack_quantized(q, BITS) for q in quant[(layer, k)]], BITS)
                                    for k in ("gate_up", "down")))
        wr.write_nonexpert({"model.norm.weight": torch.arange(H, dtype=torch.bfloat16)})
        wr.finish({"experts": E, "hidden": H, "intermediate": I, "moe_layers": [0, 2], "bits": list(BITS),
                   "weighting": {"method": "none"}, "source": {"fingerprint": "arch:x"}})
    return out, dense, quant


def test_a_layer_written_again_is_the_same_bytes(ap_dir, tmp_path):
    """Same experts, same file, byte for byte (two metadata keys came out of safetensors in a random order)."""
    import hashlib
    _, _, quant = ap_dir
    blocks = [stack_blocks([pack_quantized(q, BITS) for q in quant[(0, k)]], BITS) for k in ("gate_up", "down")]
    digests = set()
    for k in range(12):
        wr = APCheckpointWriter(tmp_path / f"c{k}")
        wr.write_layer(0, *blocks)
        digests.add(hashlib.sha256((wr.tmp / wr.expert_files[0]).read_bytes()).hexdigest())
        wr.abort()
    assert len(digests) == 1


def test_checkpoint_round_trip(ap_dir):
    path, _, quant = ap_dir
    assert is_ap_checkpoint(path) and not list(path.parent.glob(".ckpt.tmp-*"))
    ck = load_ap_checkpoint(path)
    assert (ck.experts, ck.hidden, ck.intermediate, ck.moe_layers, ck.bits) == (E, H, I, [0, 2], BITS)
    assert ck.meta["layout_version"] == 1 and ck.meta["source"]["fingerprint"] == "arch:x"
    for layer in range(L):
        blocks = ck.read_layer(layer)
        for kind, blk in blocks.items():
            assert blk.planes.dtype == torch.uint32
            for e in range(E):
                want = pack_quantized(quant[(layer, kind)][e], BITS)
                assert np.array_equal(blk.planes[e].view(torch.int32).numpy().view(np.uint32), want.planes)
                for b in BITS:
                    assert blk.luts[b].dtype == torch.float16  # fp16 centroids on disk, as a kernel reads them
                    assert np.array_equal(blk.luts[b][e].numpy(), want.luts[b])
                    out_f, in_f = ck.shape(kind)
                    stored = blk.planes[e, :b].numel() * 4 + blk.luts[b][e].numel() * 2
                    assert stored == ap_block_bytes(out_f, in_f, b)
    ne = ck.nonexpert_state()
    assert ne["model.norm.weight"].dtype == torch.bfloat16 and torch.equal(ne["model.norm.weight"],
                                                                         torch.arange(H, dtype=torch.bfloat16))


def test_writer_refuses_existing_output_and_cleans_up_on_error(ap_dir, tmp_path):
    path, _, _ = ap_dir
    with pytest.raises(APCheckpointError, match="already exists"):
        APCheckpointWriter(path)
    target = tmp_path / "never"
    with pytest.raises(RuntimeError):
        with APCheckpointWriter(target):
            raise RuntimeError("boom")
    assert not target.exists() and list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError):  # finish without every layer written: nothing appears
        with APCheckpointWriter(target) as wr:
            wr.finish({"experts": 1, "hidden": 1, "intermediate": 1, "moe_layers": [0], "bits": [3]})
    assert not target.exists()


def test_loader_refuses_other_versions(ap_dir, tmp_path):
    path, _, _ = ap_dir
    with pytest.raises(APCheckpointError, match="not an AP checkpoint"):
        load_ap_checkpoint(tmp_path)
    meta = json.loads((path / "ap_config.json").read_text())
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "ap_config.json").write_text(json.dumps({**meta, "layout_version": 2}))
    with pytest.raises(APCheckpointError, match="layout_version"):
        load_ap_checkpoint(bad)


def test_store_at_8_bits_approximates_dense_and_error_falls_with_bits(ap_dir):
    path, dense, quant = ap_dir
    store = APExpertStore.from_checkpoint(path)
    for (layer, kind), ws in dense.items():
        for e, w in enumerate(ws):
            errs = []
            for b in BITS:
                store.set_bits(b)
                got = store.weight(layer, e, kind).numpy()
                assert np.array_equal(got, quant[(layer, kind)][e].reconstruct(b))
                errs.append(np.linalg.norm(got - w) / np.linalg.norm(w))
            assert errs[-1] < 0.01 and all(a > b for a, b in zip(errs, errs[1:])), errs


def test_moe_equals_direct_computation_at_mixed_bits(ap_dir):
    path, _, quant = ap_dir
    store = APExpertStore.from_checkpoint(path)
    rng = np.random.default_rng(3)
    bits = rng.choice(BITS, store.num_blocks)
    store.set_bits(bits)
    x = torch.from_numpy(rng.standard_normal((9, H)).astype(np.float32))
    ids = torch.from_numpy(rng.integers(0, E, (9, 2)))
    ids[:, 1] = (ids[:, 0] + 1) % E
    wts = torch.rand(9, 2)
    for layer in range(L):
        norms = torch.empty(9, 2)
        got = store.moe(layer, x, ids, wts, down_in_norm=norms)
        want = np.zeros((9, H))
        for t in range(9):
            for k in range(2):
                e = int(ids[t, k])
                bg = bits[store.block_index(layer, e, "gate_up")]
                bd = bits[store.block_index(layer, e, "down")]
                gu = quant[(layer, "gate_up")][e].reconstruct(bg).astype(np.float64) @ x[t].double().numpy()
                act = gu[:I] / (1 + np.exp(-gu[:I])) * gu[I:]
                assert abs(np.linalg.norm(act) - float(norms[t, k])) < 1e-4 * max(1.0, np.linalg.norm(act))
                want[t] += float(wts[t, k]) * (quant[(layer, "down")][e].reconstruct(bd).astype(np.float64) @ act)
        assert got.dtype == torch.float32
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-4, atol=1e-5)


def test_page_table_bits_are_read_at_every_call_and_cache_is_bounded(ap_dir):
    path, _, quant = ap_dir
    one = 2 * I * H * 4  # bytes of one dequantized fp32 gate_up block
    store = APExpertStore.from_checkpoint(path, cache_bytes=3 * one)
    table = PageTable(L, E, H, I, bits=BITS, initial_bits=8)
    store.attach_table(table)
    assert np.array_equal(store.weight(1, 2, "gate_up").numpy(), quant[(1, "gate_up")][2].reconstruct(8))
    q = np.full(table.num_blocks, 8)
    q[table.index(1, 2, 0)] = 4
    table.initialize(q)
    assert np.array_equal(store.weight(1, 2, "gate_up").numpy(), quant[(1, "gate_up")][2].reconstruct(4))
    for _ in range(3):
        for e in range(E):
            store.weight(0, e, "gate_up")
            store.weight(1, e, "down")
            assert store.cache_info()["bytes"] <= 3 * one
    assert store.hits == 0  # six blocks cycling through an LRU of three never hit
    store.weight(0, 0, "down")
    store.weight(0, 0, "down")
    assert store.hits == 1
    q[table.index(0, 1, 1)] = 0
    table.initialize(q)
    with pytest.raises(ValueError, match="0 means not resident"):
        store.weight(0, 1, "down")
    with pytest.raises(ValueError, match="not stored"):
        store.set_bits(2)


def test_cache_evicts_the_least_recently_used_and_as_many_as_a_larger_block_needs(ap_dir):
    """A hit refreshes a block (LRU, not first-in first-out); a gate_up block (twice a down block's bytes) entering a
    cache full of down blocks evicts two of them, and the byte count stays that of the blocks held."""
    path, _, _ = ap_dir
    down = H * I * 4  # bytes of one dequantized fp32 down block; gate_up is twice that
    store = APExpertStore.from_checkpoint(path, cache_bytes=2 * down)
    store.weight(0, 0, "down")
    store.weight(0, 1, "down")
    store.weight(0, 0, "down")  # a hit: (0, 0) is now the most recently used
    store.weight(0, 2, "down")  # evicts (0, 1), the least recently used
    assert (store.hits, store.misses) == (1, 3)
    store.weight(0, 0, "down")
    assert (store.hits, store.misses) == (2, 3)
    store.weight(1, 0, "gate_up")  # needs both down blocks' room
    assert store.cache_info()["entries"] == 1 and store.cache_info()["bytes"] == 2 * down
    store.weight(1, 1, "down")
    store.weight(1, 2, "down")  # evicts the gate_up block
    assert store.cache_info()["entries"] == 2 and store.cache_info()["bytes"] == 2 * down
    store.weight(1, 0, "gate_up")
    assert store.misses == 7 and store.cache_info()["bytes"] == 2 * down


def test_a_page_table_of_another_model_is_refused(ap_dir):
    """attach_table needs exactly this store's blocks: a table of more blocks (another model) is an error."""
    path, _, _ = ap_dir
    store = APExpertStore.from_checkpoint(path)
    for layers, experts in ((L, E + 1), (L + 1, E), (L, E - 1)):
        with pytest.raises(ValueError, match="page table has"):
            store.attach_table(PageTable(layers, experts, H, I, bits=BITS, initial_bits=8))


def test_loader_refuses_expert_tensors_of_other_shapes(ap_dir, tmp_path):
    """A layer file whose planes hold another number of experts than ap_config.json says, or whose LUT_b is not
    [E, out, 2**b], is an APCheckpointError naming the tensor, not a silently misread checkpoint."""
    path, _, quant = ap_dir
    blocks = {k: stack_blocks([pack_quantized(q, BITS) for q in quant[(0, k)]], BITS) for k in ("gate_up", "down")}
    meta = {"experts": E, "hidden": H, "intermediate": I, "moe_layers": [0], "bits": list(BITS)}
    fewer = {k: type(b)(planes=b.planes[:E - 1], luts={n: lut[:E - 1] for n, lut in b.luts.items()})
             for k, b in blocks.items()}
    swapped = {k: type(b)(planes=b.planes, luts={**b.luts, 4: b.luts[3].copy()}) for k, b in blocks.items()}
    for name, layer, match in (("fewer", fewer, "planes have shape"), ("swapped", swapped, "LUT for 4 bits")):
        with APCheckpointWriter(tmp_path / name) as wr:
            wr.write_layer(0, layer["gate_up"], layer["down"])
            wr.finish(meta)
        with pytest.raises(APCheckpointError, match=match):
            load_ap_checkpoint(tmp_path / name).read_layer(0)
    with APCheckpointWriter(tmp_path / "good") as wr:
        wr.write_layer(0, blocks["gate_up"], blocks["down"])
        wr.finish(meta)
    good = load_ap_checkpoint(tmp_path / "good")
    assert set(good.read_layer(0)) == {"gate_up", "down"}
    with pytest.raises(APCheckpointError, match="out of range"):
        good.read_layer(1)
    cfg = json.loads((tmp_path / "good" / "ap_config.json").read_text())
    (tmp_path / "good" / "ap_config.json").write_text(json.dumps({**cfg, "moe_layers": [0, 1]}))  # one file, 2 layers
    with pytest.raises(APCheckpointError, match="1 expert files for 2 MoE layers"):
        load_ap_checkpoint(tmp_path / "good")
