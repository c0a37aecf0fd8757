"""The bundled demo model: loads in pwruntime and transformers alike; its routing is imbalanced and domain-dependent."""
from __future__ import annotations

import gzip
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from policies.observe import RoutingMass
from pwruntime.cmd_perplexity import default_model_dir, sliding_window_perplexity
from pwruntime.model import load_model
from pwruntime.model.attention_plan import prefill_metadata

CORPUS = Path(__file__).resolve().parents[1].parent / "shared" / "corpus"
DOMAINS = ("scripture", "pydocs", "fortunes")
SAMPLE_CHARS = 6000


def _valid_text(domain: str) -> str:
    path = CORPUS / domain / "valid.txt.gz"
    if not path.is_file():
        pytest.skip(f"corpus not found at {path}")
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return f.read(SAMPLE_CHARS)


@pytest.fixture(scope="module")
def model():
    bundled = default_model_dir()
    assert bundled is not None, "the demo model must be bundled in pwruntime/demo_model"
    return load_model(bundled, dtype=torch.float32)


def test_bundled_files_are_small():
    files = list(default_model_dir().iterdir())
    assert all(f.stat().st_size < 16 * 2**20 for f in files)
    assert sum(f.stat().st_size for f in files) < 25 * 2**20


def test_perplexity_equals_transformers(model):
    from transformers import AutoModelForCausalLM

    ids = model.tokenizer.encode(_valid_text("scripture")[:3000])
    context = stride = 256
    ours = sliding_window_perplexity(model, ids, context=context, stride=stride, progress=False)
    hf = AutoModelForCausalLM.from_pretrained(default_model_dir(), dtype=torch.float32).eval()
    nll, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(ids) - 1, stride):
            window = torch.tensor(ids[start:start + context])[None]
            if window.shape[1] < 2:
                break
            logits = hf(window).logits.float()
            logp = torch.log_softmax(logits[0, :-1], dim=-1)
            nll -= logp.gather(1, window[0, 1:, None]).sum().item()
            count += window.shape[1] - 1
    assert ours.tokens == count
    assert ours.perplexity == pytest.approx(math.exp(nll / count), rel=1e-4)


def _routing_mass(model, text: str) -> np.ndarray:
    ids = model.tokenizer.encode(text)[:1024]
    kv = model.new_kv_cache(num_blocks=-(-len(ids) // 16), block_size=16)
    out = model.forward(torch.tensor(ids), torch.arange(len(ids)), kv, prefill_metadata(len(ids), 16), record=True)
    mass = RoutingMass(len(out.routing), model.config.experts, half_life_tokens=None)
    mass.update(np.stack([r.topk_ids.numpy() for r in out.routing]), np.stack([r.topk_weights.numpy() for r in out.routing]))
    return mass.mass()


def _jsd(p: np.ndarray, q: np.ndarray) -> float:
    m = 0.5 * (p + q)
    kl = lambda a, b: float(np.sum(np.where(a > 0, a * np.log(np.where(a > 0, a, 1) / b), 0.0)))  # noqa: E731
    return 0.5 * kl(p, m) + 0.5 * kl(q, m)


def test_routing_is_imbalanced_and_domain_dependent(model):
    masses = {d: _routing_mass(model, _valid_text(d)) for d in DOMAINS}
    pooled = sum(masses.values()) / len(DOMAINS)
    for layer, row in enumerate(pooled):
        # the hottest expert of every layer gets at least 10x the traffic of the coldest
        assert row.max() >= 10 * row.min(), f"layer {layer} routing is nearly uniform: {row}"
        entropy = -np.sum(row[row > 0] * np.log(row[row > 0])) / np.log(len(row))
        assert entropy < 0.95, f"layer {layer} normalized entropy {entropy:.3f}"
    # domains route differently: some layer separates scripture from pydocs clearly
    jsd = max(_jsd(masses["scripture"][l], masses["pydocs"][l]) for l in range(len(pooled)))
    assert jsd > 0.2
