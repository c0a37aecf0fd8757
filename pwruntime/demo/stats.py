"""Evaluation of the demo model: per-domain perplexity, unigram baseline, routing statistics, plots.

Routing mass (DESIGN.md Eq. 1): m[l,e] = sum_t sum_k r[l,t,k] 1{z[l,t,k]=e} / sum_t sum_k r[l,t,k], with
z the experts the router selects (top-k of the softmax) and r the weights it applies to them.
Imbalance per layer: max/min mass ratio and normalized entropy H(m)/log(E) (1 = uniform). Domain
dependence: Jensen-Shannon divergence (base 2, in [0, 1]) between two domains' mass vectors.
"""
from __future__ import annotations

import math
from itertools import combinations
from pathlib import Path
from typing import Sequence

import numpy as np

from traces.clikit import pyplot, write_png


# ----------------------------------------------------------------------------------------- math (numpy)
def routing_mass(topk_ids: np.ndarray, topk_weights: np.ndarray, num_experts: int) -> np.ndarray:
    """Unnormalised routing mass per expert: sum of the weights with which each expert was selected."""
    mass = np.zeros(num_experts, dtype=np.float64)
    np.add.at(mass, np.asarray(topk_ids).ravel(), np.asarray(topk_weights, dtype=np.float64).ravel())
    return mass


def normalize(mass: np.ndarray) -> np.ndarray:
    s = float(np.sum(mass))
    return np.asarray(mass, dtype=np.float64) / s if s > 0 else np.full(len(mass), 1.0 / len(mass))


def imbalance(mass: np.ndarray) -> dict:
    """max/min ratio (None when an expert got nothing), normalized entropy in [0, 1], max and min share."""
    m = normalize(mass)
    nz = m[m > 0]
    ent = float(-(nz * np.log(nz)).sum() / math.log(len(m))) if len(m) > 1 else 1.0
    lo, hi = float(m.min()), float(m.max())
    return {"max_min_ratio": hi / lo if lo > 0 else None, "normalized_entropy": ent, "max_share": hi,
            "min_share": lo}


def js_divergence(p: np.ndarray, q: np.ndarray) -> float:
    """Jensen-Shannon divergence in bits (0 identical, 1 disjoint support)."""
    p, q = normalize(p), normalize(q)
    m = 0.5 * (p + q)

    def kl(a, b):
        nz = a > 0
        return float((a[nz] * np.log2(a[nz] / b[nz])).sum())

    return 0.5 * kl(p, m) + 0.5 * kl(q, m)


def unigram_perplexity(train_tokens: np.ndarray, eval_tokens: np.ndarray, vocab_size: int) -> float:
    """Perplexity of eval_tokens under add-one smoothed unigram frequencies of train_tokens."""
    counts = np.bincount(np.asarray(train_tokens, dtype=np.int64), minlength=vocab_size).astype(np.float64)
    logp = np.log(counts + 1.0) - math.log(counts.sum() + vocab_size)
    return float(math.exp(-logp[np.asarray(eval_tokens, dtype=np.int64)].mean()))


# ---------------------------------------------------------------------------------------- model passes
def _batches(windows: Sequence[np.ndarray], batch_size: int):
    """Consecutive runs of equal-length windows, at most batch_size at a time (order preserved)."""
    i = 0
    while i < len(windows):
        j = i + 1
        while j < len(windows) and j - i < batch_size and len(windows[j]) == len(windows[i]):
            j += 1
        yield np.stack(windows[i:j])
        i = j


def window_losses(model, windows: Sequence[np.ndarray], device, batch_size: int = 16) -> np.ndarray:
    """Cross-entropy (nats) of every target token of every window, in order (float64)."""
    import torch
    import torch.nn.functional as F

    out = []
    with torch.no_grad():
        for b in _batches(windows, batch_size):
            x = torch.from_numpy(b).to(device)
            logits = model(input_ids=x[:, :-1], use_cache=False).logits.float()
            ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="none")
            out.append(ce.double().cpu().numpy())
    return np.concatenate(out) if out else np.zeros(0)


def routing_masses(model, windows: Sequence[np.ndarray], device, batch_size: int = 16) -> np.ndarray:
    """Unnormalised routing mass [layers, experts] over every input token of the windows."""
    import torch

    cfg = model.config
    mass = None
    with torch.no_grad():
        for b in _batches(windows, batch_size):
            x = torch.from_numpy(b).to(device)
            o = model(input_ids=x[:, :-1], output_router_logits=True, use_cache=False)
            if mass is None:
                mass = np.zeros((len(o.router_logits), cfg.num_experts))
            for layer, logits in enumerate(o.router_logits):
                probs = torch.softmax(logits.float().reshape(-1, cfg.num_experts), dim=-1)
                w, ids = torch.topk(probs, cfg.num_experts_per_tok, dim=-1)
                if getattr(cfg, "norm_topk_prob", False):
                    w = w / w.sum(-1, keepdim=True)
                mass[layer] += routing_mass(ids.cpu().numpy(), w.double().cpu().numpy(), cfg.num_experts)
    return mass if mass is not None else np.zeros((cfg.num_hidden_layers, cfg.num_experts))


def routing_summary(masses: dict[str, np.ndarray]) -> list[dict]:
    """Per layer: normalised mass per domain and pooled ('all'), imbalance, pairwise JSD between domains."""
    doms = list(masses)
    pooled = sum(masses.values())
    layers = []
    for layer in range(pooled.shape[0]):
        per = {d: masses[d][layer] for d in doms}
        per["all"] = pooled[layer]
        jsd = {f"{a}|{b}": js_divergence(masses[a][layer], masses[b][layer]) for a, b in combinations(doms, 2)}
        layers.append({
            "layer": layer,
            "mass": {k: normalize(v).tolist() for k, v in per.items()},
            "imbalance": {k: imbalance(v) for k, v in per.items()},
            "jsd": jsd,
            "mean_jsd": float(np.mean(list(jsd.values()))) if jsd else 0.0,
        })
    return layers


# ------------------------------------------------------------------------------------------- evaluate
def evaluate_model(model, tokenizer, corpus: str | Path, domains: Sequence[str] | None = None, *,
                   seq_len: int = 512, max_eval_tokens: int | None = None, routing_tokens: int = 8192,
                   device="cpu", batch_size: int = 16, progress: bool = True) -> dict:
    """Per-domain validation perplexity vs unigram baselines, and routing statistics on validation text."""
    from tqdm.auto import tqdm

    from .data import corpus_domains, eval_windows, read_documents, tokenize_documents
    from .tokenizer_train import EOS

    domains = corpus_domains(corpus, domains)
    eos = tokenizer.token_to_id(EOS)
    vocab = tokenizer.get_vocab_size()          # add-one smoothing over the tokenizer's vocabulary
    model.eval()
    ppl, masses, routed, train_all = {}, {}, {}, []
    for dom in tqdm(domains, desc="demo stats", disable=not progress):
        train = tokenize_documents(tokenizer, read_documents(Path(corpus) / dom / "train.txt.gz"), eos)
        valid = tokenize_documents(tokenizer, read_documents(Path(corpus) / dom / "valid.txt.gz"), eos)
        if max_eval_tokens is not None:
            valid = valid[: max_eval_tokens + 1]
        train_all.append(train)
        ce = window_losses(model, eval_windows(valid, seq_len), device, batch_size)
        targets = valid[1:].astype(np.int64)
        assert len(ce) == len(targets)
        ppl[dom] = {"model": float(math.exp(ce.mean())), "unigram": unigram_perplexity(train, targets, vocab),
                    "tokens": int(len(targets)), "_targets": targets}
        sample = eval_windows(valid[: routing_tokens + 1], seq_len)
        routed[dom] = int(sum(len(w) - 1 for w in sample))
        masses[dom] = routing_masses(model, sample, device, batch_size)
    pooled_train = np.concatenate(train_all)
    for dom in domains:
        ppl[dom]["unigram_pooled"] = unigram_perplexity(pooled_train, ppl[dom].pop("_targets"), vocab)
    layers = routing_summary(masses)
    return {
        "domains": list(domains), "seq_len": seq_len, "vocab_size": vocab,
        "perplexity": ppl,
        "routing": {"tokens_per_domain": routed,
                    "num_experts": int(model.config.num_experts), "top_k": int(model.config.num_experts_per_tok),
                    "layers": layers},
        "most_domain_dependent_layer": int(max(layers, key=lambda r: r["mean_jsd"])["layer"]) if layers else 0,
    }


def load_hf(model_dir: str | Path, device="cpu"):
    """(model, tokenizer) from a HuggingFace directory, fp32, in eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    from .tokenizer_train import load_tokenizer

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).to(device).eval()
    return model, load_tokenizer(model_dir)


# ---------------------------------------------------------------------------------------------- plots
def plot_layer(stats: dict, layer: int, path: str | Path) -> None:
    """Grouped bars: normalised routing mass of every expert of one layer, one bar per domain (PNG)."""
    plt = pyplot()
    rec = stats["routing"]["layers"][layer]
    doms = stats["domains"]
    E = stats["routing"]["num_experts"]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.45 * E), 3.6))
    width = 0.8 / len(doms)
    x = np.arange(E)
    for i, d in enumerate(doms):
        ax.bar(x + (i - (len(doms) - 1) / 2) * width, rec["mass"][d], width, label=d)
    ax.axhline(1.0 / E, color="k", lw=0.8, ls="--", label="uniform")
    ax.set_xticks(x)
    ax.set_xlabel("expert")
    ax.set_ylabel("routing mass (normalised)")
    ax.set_title(f"Layer {layer}: expert routing mass per domain (mean JSD {rec['mean_jsd']:.3f})")
    ax.legend(fontsize=8, ncol=len(doms) + 1)
    write_png(fig, path, dpi=120)


def plot_grid(stats: dict, path: str | Path) -> None:
    """One small panel per layer, same bars as plot_layer (PNG)."""
    plt = pyplot()
    layers = stats["routing"]["layers"]
    doms = stats["domains"]
    E = stats["routing"]["num_experts"]
    cols = min(len(layers), 2)
    rows = math.ceil(len(layers) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6.5 * cols, 2.6 * rows), squeeze=False, sharey=True)
    width = 0.8 / len(doms)
    x = np.arange(E)
    for ax, rec in zip(axes.ravel(), layers):
        for i, d in enumerate(doms):
            ax.bar(x + (i - (len(doms) - 1) / 2) * width, rec["mass"][d], width, label=d)
        ax.axhline(1.0 / E, color="k", lw=0.8, ls="--")
        ax.set_title(f"layer {rec['layer']} (max/min all {_fmt_ratio(rec['imbalance']['all']['max_min_ratio'])}, "
                     f"H {rec['imbalance']['all']['normalized_entropy']:.3f})", fontsize=9)
        ax.set_xticks(x)
        ax.tick_params(labelsize=7)
    for ax in axes.ravel()[len(layers):]:
        ax.axis("off")
    axes[0, 0].legend(fontsize=7)
    fig.supylabel("routing mass (normalised)")
    write_png(fig, path)


def _fmt_ratio(r) -> str:
    return "inf" if r is None else f"{r:.1f}"
