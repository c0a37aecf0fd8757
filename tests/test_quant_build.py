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


class _Capture:
    """Wraps the dense store and records each MoE call's inputs."""

    def __init__(self, store):
        self.store, self.calls = store, []

    def weight(self, *a):
        return self.store.weight(*a)

    def moe(self, layer, x, ids, w, down_in_norm=None):
        self.calls.append((layer, x.clone(), ids.clone()))
        return self.store.moe(layer, x, ids, w, down_in_norm)


def test_hessian_diagonal_is_the_mean_square_of_routed_inputs(tiny):
    _, src, _ = tiny
    model = load_model(src)
    seqs = [torch.tensor(model.tokenizer.encode(make_text(60, seed=s)))[:50] for s in (3, 4)]
    h = sensitivity.hessian_diagonals(model, seqs, prior_tokens=0.0, damp=0.0, progress=False)
    assert isinstance(model.experts, DenseExpertStore)  # restored
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
    assert (cnt > 0).all()
    np.testing.assert_allclose(h["gate_up"], sq_gu / cnt[..., None], rtol=1e-4)
    np.testing.assert_allclose(h["down"], sq_dn / cnt[..., None], rtol=1e-4, atol=1e-9)


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
