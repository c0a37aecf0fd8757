"""Demo-model statistics: unigram baseline, routing mass (Eq. 1), imbalance, JSD, model passes, CLI."""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

from pwruntime.demo.stats import (imbalance, js_divergence, normalize, routing_mass, routing_summary,
                                  unigram_perplexity)

sys.path.insert(0, str(Path(__file__).parent))


def test_unigram_perplexity_on_a_planted_example():
    # counts 2,1,1,0 over vocab 4 -> add-one probabilities 3/8, 2/8, 2/8, 1/8
    ppl = unigram_perplexity(np.array([0, 0, 1, 2]), np.array([0, 3]), vocab_size=4)
    assert ppl == pytest.approx(math.exp(-(math.log(3 / 8) + math.log(1 / 8)) / 2))
    assert ppl == pytest.approx(math.sqrt(64 / 3))
    assert unigram_perplexity(np.arange(5), np.arange(5), 5) == pytest.approx(5.0)   # uniform -> vocab


def test_routing_mass_and_imbalance_on_planted_routing():
    # 3 tokens, top-2 of 4 experts; expert 3 never chosen
    ids = np.array([[0, 1], [0, 2], [1, 0]])
    w = np.array([[0.5, 0.25], [0.5, 0.25], [0.3, 0.2]])
    mass = routing_mass(ids, w, 4)
    assert mass.tolist() == pytest.approx([1.2, 0.55, 0.25, 0.0])
    m = normalize(mass)
    im = imbalance(mass)
    assert im["max_min_ratio"] is None and im["min_share"] == 0.0
    assert im["max_share"] == pytest.approx(1.2 / 2.0)
    nz = m[m > 0]
    assert im["normalized_entropy"] == pytest.approx(-(nz * np.log(nz)).sum() / math.log(4))
    planted = imbalance(np.array([4.0, 2.0, 1.0, 1.0]))
    assert planted["max_min_ratio"] == pytest.approx(4.0)
    assert planted["normalized_entropy"] == pytest.approx(
        -(0.5 * math.log(0.5) + 0.25 * math.log(0.25) + 2 * 0.125 * math.log(0.125)) / math.log(4))
    assert imbalance(np.ones(16))["normalized_entropy"] == pytest.approx(1.0)
    assert imbalance(np.ones(16))["max_min_ratio"] == pytest.approx(1.0)


def test_js_divergence_bounds_and_summary():
    assert js_divergence(np.array([1, 2, 3.0]), np.array([2, 4, 6.0])) == pytest.approx(0.0, abs=1e-12)
    assert js_divergence(np.array([1, 0.0]), np.array([0, 1.0])) == pytest.approx(1.0)
    p, q = np.array([0.7, 0.3]), np.array([0.4, 0.6])
    mid = (p + q) / 2
    ref = 0.5 * sum(p * np.log2(p / mid)) + 0.5 * sum(q * np.log2(q / mid))
    assert js_divergence(p, q) == pytest.approx(ref)
    masses = {"a": np.array([[3.0, 1.0], [1.0, 1.0]]), "b": np.array([[1.0, 3.0], [1.0, 1.0]])}
    layers = routing_summary(masses)
    assert layers[0]["mass"]["a"] == pytest.approx([0.75, 0.25])
    assert layers[0]["mass"]["all"] == pytest.approx([0.5, 0.5])
    assert layers[0]["imbalance"]["a"]["max_min_ratio"] == pytest.approx(3.0)
    assert layers[0]["jsd"]["a|b"] > 0.1 and layers[1]["jsd"]["a|b"] == pytest.approx(0.0, abs=1e-12)


@pytest.fixture(scope="module")
def tiny_model():
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from demo_fixtures import tiny_config

    from pwruntime.demo.model import build_model

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield build_model(tiny_config().model, eos_token_id=0, seed=5).eval()
    torch.set_num_threads(n)


def test_routing_masses_match_the_routers_own_choices(tiny_model):
    import torch

    from pwruntime.demo.stats import routing_masses

    windows = [np.random.default_rng(0).integers(0, 300, size=17) for _ in range(3)]
    seen: dict[int, np.ndarray] = {}

    def hook(layer):
        def fn(module, inputs, output):           # the router returns (logits, weights applied, expert ids)
            _, w, ids = output
            seen[layer] = seen.get(layer, 0) + routing_mass(ids.numpy(), w.double().numpy(), 16)
        return fn

    handles = [layer.mlp.gate.register_forward_hook(hook(i)) for i, layer in enumerate(tiny_model.model.layers)]
    try:
        with torch.no_grad():
            for w in windows:
                tiny_model(input_ids=torch.from_numpy(w[None, :-1]))
    finally:
        for h in handles:
            h.remove()
    mass = routing_masses(tiny_model, windows, "cpu", batch_size=2)
    assert mass.shape == (2, 16)
    for layer in range(2):
        np.testing.assert_allclose(mass[layer], seen[layer], rtol=1e-5)
    assert mass.sum() == pytest.approx(0.0 + sum(seen[i].sum() for i in range(2)), rel=1e-5)


def test_window_losses_match_transformers_loss(tiny_model):
    import torch

    from pwruntime.demo.stats import window_losses

    wins = [np.random.default_rng(1).integers(0, 300, size=n) for n in (9, 9, 5)]
    ce = window_losses(tiny_model, wins, "cpu", batch_size=4)
    assert ce.shape == (8 + 8 + 4,)
    with torch.no_grad():
        x = torch.from_numpy(wins[2][None])
        ref = tiny_model(input_ids=x, labels=x).loss.item()
    assert ce[16:].mean() == pytest.approx(ref, rel=1e-5)


def test_stats_cli_writes_json_and_plots(tmp_path, capsys):
    torch = pytest.importorskip("torch")
    from demo_fixtures import run_tiny, write_corpus

    from pwruntime.cli import main

    corpus = write_corpus(tmp_path / "corpus", train_docs=30, valid_docs=6)
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run_tiny(corpus, tmp_path / "run")
        rc = main(["demo", "stats", "--model", str(tmp_path / "run" / "model"), "--corpus", str(corpus),
                   "--out", str(tmp_path / "stats"), "--seq-len", "32", "--routing-tokens", "64",
                   "--no-progress", "--json"])
    finally:
        torch.set_num_threads(n)
    assert rc == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats == json.loads((tmp_path / "stats" / "stats.json").read_text())
    for dom, p in stats["perplexity"].items():
        assert p["model"] > 1 and p["unigram"] > 1 and p["unigram_pooled"] > 1 and p["tokens"] > 0
    assert stats["routing"]["tokens_per_domain"] == {"fortunes": 64, "pydocs": 64, "scripture": 64}
    layers = stats["routing"]["layers"]
    assert len(layers) == 2 and all(sum(rec["mass"]["all"]) == pytest.approx(1.0) for rec in layers)
    assert set(layers[0]["jsd"]) == {"fortunes|pydocs", "fortunes|scripture", "pydocs|scripture"}
    for name in (f"routing_layer{stats['plot_layer']}.png", "routing_all_layers.png"):
        assert (tmp_path / "stats" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "pwruntime demo stats --model" in stats["command"]
