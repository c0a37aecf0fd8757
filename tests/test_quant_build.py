"""`pwruntime quantize` end to end on tiny checkpoints, and the Hessian / Fisher weights it uses."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from model_fixtures import make_text, make_tiny_checkpoint
from pwruntime.cli import main
from pwruntime.model import DenseExpertStore, load_model
from pwruntime.model.attention_plan import prefill_metadata
from pwruntime.quant import sensitivity
from pwruntime.quant.ap_checkpoint import load_ap_checkpoint
from pwruntime.quant.store import load_ap_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("quant_build")
    src = make_tiny_checkpoint(root, "qwen2_moe", seed=1)
    calib = root / "calib.txt"
    calib.write_text(make_text(600, seed=2))
    return root, src, calib


def _logits(model, ids):
    meta = prefill_metadata(len(ids), 16)
    out = model.forward(ids, torch.arange(len(ids)), model.new_kv_cache(-(-len(ids) // 16), 16), meta)
    return model.logits(out.hidden)


def test_quantize_command_writes_a_loadable_checkpoint(tiny, capsys):
    root, src, calib = tiny
    out = root / "ap-hessian"
    rc = main(["quantize", "--model", str(src), "--out", str(out), "--weighting", "hessian",
               "--calib-data", str(calib), "--calib-tokens", "300", "--calib-seq-len", "100", "--json"])
    assert rc == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["blocks"] == 2 * 4 * 2 and summary["weighting"] == "hessian" and summary["quantize_seconds"] > 0
    ck = load_ap_checkpoint(out)
    assert ck.meta["weighting"]["method"] == "hessian" and ck.meta["source"]["fingerprint"].startswith("arch:")
    assert not any("experts." in k for k in ck.nonexpert_state())
    assert "model.layers.0.mlp.shared_expert.gate_proj.weight" in ck.nonexpert_state()

    dense = load_model(src)
    ids = torch.tensor(dense.tokenizer.encode(make_text(40, seed=9)))[:48]
    ref = _logits(dense, ids)
    model, store = load_ap_model(out)
    errs = []
    for b in (3, 5, 8):
        store.set_bits(b)
        errs.append(float((_logits(model, ids) - ref).abs().max()))
    assert errs[2] < 0.02 * float(ref.abs().max()) and errs[0] > errs[1] > errs[2], errs
    # a second run into the same --out is refused without --overwrite
    assert main(["quantize", "--model", str(src), "--out", str(out)]) == 2
    assert "already exists" in capsys.readouterr().err
    assert main(["quantize", "--model", str(src), "--out", str(root / "x"), "--weighting", "fisher"]) == 2
    assert "--calib-data" in capsys.readouterr().err


def test_auto_weighting_is_hessian_with_calibration_text_and_none_without(tiny, capsys, monkeypatch):
    from pwruntime.quant import build

    root, src, calib = tiny
    seen = []
    monkeypatch.setattr(build, "quantize_checkpoint", lambda model, out, opts: seen.append(opts) or {"out": str(out)})
    for extra in ([], ["--calib-data", str(calib)]):
        assert main(["quantize", "--model", str(src), "--out", str(root / "auto"), "--json", *extra]) == 0
    assert [o.weighting for o in seen] == ["none", "hessian"] and seen[1].calib_files == (str(calib),)


def test_an_unweighted_checkpoint_records_no_calibration_tokens(tiny):
    from pwruntime.quant.build import QuantizeOptions, quantize_checkpoint

    root, src, _ = tiny
    quantize_checkpoint(src, root / "ap-none", QuantizeOptions(bits=(3, 8), calib_tokens=300), progress=False)
    meta = load_ap_checkpoint(root / "ap-none").meta
    assert meta["weighting"] == {"method": "none", "calib_files": [], "calib_tokens": 0}


class _Capture:
    """Wraps the dense store and records each MoE call's inputs."""

    def __init__(self, store):
        self.store, self.calls = store, []

    def weight(self, *a):
        return self.store.weight(*a)

    def moe(self, layer, x, ids, w, down_in_norm=None):
        self.calls.append((layer, x.clone(), ids.clone()))
        return self.store.moe(layer, x, ids, w, down_in_norm)


def _routed_second_moments(model, seqs):
    """(sum x^2 of gate_up inputs [L, E, H], of down inputs [L, E, I], routed rows [L, E]), by direct computation."""
    cap = _Capture(model.experts)
    model.experts = cap
    for s in seqs:
        sensitivity._prefill(model, s)
    c = model.config
    sq_gu = np.zeros((c.num_moe_layers, c.experts, c.hidden))
    sq_dn = np.zeros((c.num_moe_layers, c.experts, c.expert_intermediate))
    cnt = np.zeros((c.num_moe_layers, c.experts))
    for layer, x, ids in cap.calls:
        for e in range(c.experts):
            rows = x[(ids == e).any(dim=1)].double()
            gu = rows @ cap.store.gate_up[layer][e].double().t()
            act = F.silu(gu[:, :c.expert_intermediate]) * gu[:, c.expert_intermediate:]
            sq_gu[layer, e] += rows.pow(2).sum(0).numpy()
            sq_dn[layer, e] += act.pow(2).sum(0).numpy()
            cnt[layer, e] += rows.shape[0]
    model.experts = cap.store
    return sq_gu, sq_dn, cnt


def test_hessian_diagonal_is_the_mean_square_of_routed_inputs(tiny):
    _, src, _ = tiny
    model = load_model(src)
    seqs = [torch.tensor(model.tokenizer.encode(make_text(60, seed=s)))[:50] for s in (3, 4)]
    h = sensitivity.hessian_diagonals(model, seqs, prior_tokens=0.0, damp=0.0, progress=False)
    assert isinstance(model.experts, DenseExpertStore)  # restored
    sq_gu, sq_dn, cnt = _routed_second_moments(model, seqs)
    assert (cnt > 0).all()
    np.testing.assert_allclose(h["gate_up"], sq_gu / cnt[..., None], rtol=1e-4)
    np.testing.assert_allclose(h["down"], sq_dn / cnt[..., None], rtol=1e-4, atol=1e-9)


def test_hessian_shrinks_experts_towards_their_layer_mean_and_adds_damping(tiny):
    """With a prior worth P tokens, an expert's h is (its sum x^2 + P * layer mean) / (its rows + P), the layer mean
    pooling the rows of that MoE layer's experts only; `damp` then adds damp * the mean of the block's own h."""
    _, src, _ = tiny
    model = load_model(src)
    seqs = [torch.tensor(model.tokenizer.encode(make_text(60, seed=s)))[:50] for s in (3, 4)]
    sq_gu, sq_dn, cnt = _routed_second_moments(model, seqs)
    assert model.config.num_moe_layers == 2 and (cnt > 0).all()
    undamped = sensitivity.hessian_diagonals(model, seqs, prior_tokens=16.0, damp=0.0, progress=False)
    damped = sensitivity.hessian_diagonals(model, seqs, prior_tokens=16.0, damp=0.25, progress=False)
    pooled = sensitivity.hessian_diagonals(model, seqs, prior_tokens=1e12, damp=0.0, progress=False)
    for kind, sq in (("gate_up", sq_gu), ("down", sq_dn)):
        layer_mean = sq.sum(1, keepdims=True) / cnt.sum(1)[:, None, None]  # [L, 1, in]
        assert not np.allclose(layer_mean[0], layer_mean[1], rtol=1e-2)  # the two layers' inputs differ
        np.testing.assert_allclose(pooled[kind], np.broadcast_to(layer_mean, sq.shape), rtol=1e-6, atol=1e-12)
        want = (sq + 16.0 * layer_mean) / (cnt[..., None] + 16.0)
        np.testing.assert_allclose(undamped[kind], want, rtol=1e-4, atol=1e-9)
        np.testing.assert_allclose(damped[kind], want + 0.25 * want.mean(axis=-1, keepdims=True), rtol=1e-4,
                                   atol=1e-9)


def test_calibration_sequences_are_the_first_tokens_in_windows_of_seq_len():
    """The first n_tokens tokens of the texts, in order across files, cut into windows of seq_len; a last window of one
    token (nothing to predict) is dropped; text of fewer than 2 tokens is a UserError."""
    from traces.clikit import UserError

    class Words:
        def encode(self, text):
            return [int(w) for w in text.split()]

    texts = ["1 2 3 4", "5 6 7 8 9", "10 11"]
    seqs = sensitivity.calibration_sequences(Words(), texts, 7, 3)
    assert [s.tolist() for s in seqs] == [[1, 2, 3], [4, 5, 6]] and seqs[0].dtype == torch.long
    assert [s.tolist() for s in sensitivity.calibration_sequences(Words(), texts, 8, 3)] == [[1, 2, 3], [4, 5, 6],
                                                                                            [7, 8]]
    assert [s.tolist() for s in sensitivity.calibration_sequences(Words(), texts, 100, 6)] == [list(range(1, 7)),
                                                                                              list(range(7, 12))]
    for few, n in ((["5"], 10), (texts, 1)):
        with pytest.raises(UserError, match="1 tokens"):
            sensitivity.calibration_sequences(Words(), few, n, 3)


def test_fisher_is_the_squared_loss_gradient(tiny):
    _, src, _ = tiny
    model = load_model(src).double()  # routing and the MoE sum stay fp32 inside, hence the wide eps below
    st = model.experts
    model.experts = DenseExpertStore([t.double() for t in st.gate_up], [t.double() for t in st.down])
    seq = torch.tensor(model.tokenizer.encode(make_text(40, seed=5)))[:32]
    fisher = sensitivity.fisher_weights(model, [seq], progress=False)

    def loss() -> float:
        return float(F.cross_entropy(_logits(model, seq)[:-1].double(), seq[1:]))

    for kind, layer in (("gate_up", 0), ("down", 1)):
        f = fisher[kind][layer]
        assert f.shape == getattr(model.experts, kind)[layer].shape and (f >= 0).all()
        idx = np.unravel_index(int(torch.argmax(f)), tuple(f.shape))
        w = getattr(model.experts, kind)[layer]
        old, eps = float(w[idx]), 1e-3
        w[idx] = old + eps
        up = loss()
        w[idx] = old - eps
        down = loss()
        w[idx] = old
        grad = (up - down) / (2 * eps)
        assert abs(grad) > 1e-3 and float(f[idx]) ** 0.5 == pytest.approx(abs(grad), rel=1e-2)


def test_each_expert_block_is_quantized_with_its_own_weights(tiny, monkeypatch):
    """With Hessian weighting every block's k-means gets its own expert's column weights (not another expert's), the
    calibration windows are cut at the model's positions when --calib-seq-len is longer, and ap_config.json records
    the seed bitwidth (the lowest stored one)."""
    from pwruntime.quant import build

    root, _, calib = tiny
    src = make_tiny_checkpoint(root / "short", "qwen2_moe", seed=4, max_position_embeddings=64)
    seen, calls = {}, []
    real_hessian, real_block = sensitivity.hessian_diagonals, build.quantize_block

    def hessian(model, seqs, **kw):
        seen["lens"] = [len(s) for s in seqs]
        seen["h"] = real_hessian(model, seqs, **kw)
        return seen["h"]

    def block(w, wt, **kw):
        calls.append(wt)
        return real_block(w, wt, **kw)

    monkeypatch.setattr(sensitivity, "hessian_diagonals", hessian)
    monkeypatch.setattr(build, "quantize_block", block)
    opts = build.QuantizeOptions(bits=(4, 6, 8), weighting="hessian", calib_files=(str(calib),), calib_tokens=300,
                                 calib_seq_len=1000)
    build.quantize_checkpoint(src, root / "ap-own-weights", opts, progress=False)
    assert max(seen["lens"]) == 64 and sum(seen["lens"]) == 300
    h = seen["h"]
    layers, experts = h["gate_up"].shape[:2]
    want = [h[kind][layer, e] for layer in range(layers) for kind in ("gate_up", "down") for e in range(experts)]
    assert len(calls) == len(want) and all(np.array_equal(a, b) for a, b in zip(calls, want))
    assert not np.allclose(h["gate_up"][0, 0], h["gate_up"][0, 1])  # the experts' weights differ
    ck = load_ap_checkpoint(root / "ap-own-weights")
    assert ck.bits == (4, 6, 8) and ck.meta["seed_bits"] == 4 and ck.meta["weighting"]["calib_tokens"] == 300


def test_source_digest_samples_a_large_file_across_its_length(tmp_path, monkeypatch):
    """Past FULL_HASH_LIMIT the digest reads the header and 16 evenly spaced samples: a change inside any sample (not
    only at the start of the file) changes it, and a change between samples does not (nothing else is read)."""
    from pwruntime.quant import build

    monkeypatch.setattr(build, "FULL_HASH_LIMIT", 1024)
    monkeypatch.setattr(build, "SAMPLE_BYTES", 16)
    data = bytearray(np.random.default_rng(0).integers(0, 256, 16 * 256, dtype=np.uint8).tobytes())
    data[:8] = (8).to_bytes(8, "little")  # a safetensors-like header length
    f = tmp_path / "model.safetensors"
    f.write_bytes(bytes(data))
    base = build.source_digest([f])
    for offset, changes in ((5 * 256 + 3, True), (11 * 256, True), (15 * 256 + 15, True), (5 * 256 + 100, False)):
        changed = bytearray(data)
        changed[offset] ^= 0xFF
        f.write_bytes(bytes(changed))
        assert (build.source_digest([f]) != base) == changes, offset


def test_source_digest_hashes_a_file_of_exactly_the_limit_whole_and_a_larger_one_s_header_whole(tmp_path,
                                                                                                 monkeypatch):
    """A file of FULL_HASH_LIMIT bytes is still hashed whole (a change between samples changes the digest); past it,
    the safetensors header is read whole, however far it reaches past the first sample."""
    from pwruntime.quant import build

    monkeypatch.setattr(build, "SAMPLE_BYTES", 16)
    data = bytearray(np.random.default_rng(1).integers(0, 256, 16 * 256, dtype=np.uint8).tobytes())
    data[:8] = (1000).to_bytes(8, "little")  # a header of 1000 bytes, past the first samples
    f = tmp_path / "model.safetensors"

    def digest_changes(offset: int) -> bool:
        f.write_bytes(bytes(data))
        before = build.source_digest([f])
        changed = bytearray(data)
        changed[offset] ^= 0xFF
        f.write_bytes(bytes(changed))
        return build.source_digest([f]) != before

    monkeypatch.setattr(build, "FULL_HASH_LIMIT", len(data))
    assert digest_changes(5 * 256 + 100)  # between samples: the whole file is hashed
    monkeypatch.setattr(build, "FULL_HASH_LIMIT", len(data) - 1)
    assert not digest_changes(5 * 256 + 100)  # sampled now: a change between samples goes unseen
    assert digest_changes(8 + 900)  # inside the header, between the first two samples
