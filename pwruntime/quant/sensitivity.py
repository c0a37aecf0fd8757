"""k-means weights for AP quantization from calibration text: Hessian diagonal or Fisher (grad^2).

* Hessian diagonal (GPTQ-style): `h_j = E[x_j^2]` over the inputs a block actually sees: for gate_up,
  the hidden rows routed to the expert; for down, the activation act(gate x) * up x of those rows.
  Experts that see few calibration tokens are shrunk towards the layer-wide mean with a prior worth
  `prior_tokens` tokens, and `damp * mean(h)` is added (so no column is weightless). One weight per
  input column, broadcast over the rows by the k-means.
* Fisher (as Any-Precision LLM): the sum over calibration sequences of the squared gradient of the
  LM loss w.r.t. each expert weight: one weight per element. Needs a backward pass; the model's
  forward is inference-only, so this runs its undecorated forward under autograd with
  grad-requiring expert tensors (memory: one fp32 copy of all experts for the gradients).
"""
from __future__ import annotations

import gzip
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from pwruntime.model.attention_plan import prefill_metadata
from pwruntime.model.experts import DenseExpertStore, expert_mlp, grouped_moe
from traces.clikit import UserError

MAX_CHARS_PER_FILE = 64 << 20


def read_calibration_text(files: Sequence[str | Path]) -> list[str]:
    """Texts of the calibration files (plain UTF-8 or .gz)."""
    texts = []
    for f in files:
        p = Path(f)
        try:
            opener = gzip.open if p.suffix == ".gz" else open
            with opener(p, "rt", encoding="utf-8") as fh:
                texts.append(fh.read(MAX_CHARS_PER_FILE))
        except (OSError, EOFError, UnicodeDecodeError) as e:
            raise UserError(f"cannot read calibration file {p}: {e}; pass UTF-8 text (optionally .gz)") from None
    return texts


def calibration_sequences(tokenizer, texts: Sequence[str], n_tokens: int, seq_len: int) -> list[torch.Tensor]:
    """Token sequences of at most `seq_len` covering the first `n_tokens` tokens of the texts."""
    ids: list[int] = []
    for t in texts:
        ids += tokenizer.encode(t)
        if len(ids) >= n_tokens:
            break
    ids = ids[:n_tokens]
    if len(ids) < 2:
        raise UserError(f"calibration text has {len(ids)} tokens; pass more text with --calib-data")
    return [torch.tensor(ids[i:i + seq_len], dtype=torch.long) for i in range(0, len(ids), seq_len)
            if len(ids[i:i + seq_len]) >= 2]


def _prefill(model, seq: torch.Tensor, forward=None):
    block = 16
    meta = prefill_metadata(len(seq), block, model.device)
    kv = model.new_kv_cache(-(-len(seq) // block), block)
    fwd = forward or model.forward
    return fwd(seq, torch.arange(len(seq)), kv, meta)


class _SecondMoments:
    """Wraps the model's DenseExpertStore; accumulates sum x^2 of every block's inputs per expert."""

    def __init__(self, store: DenseExpertStore, experts: int):
        self.store, self.experts = store, experts
        L = store.num_layers
        h, i = store.gate_up[0].shape[2], store.down[0].shape[2]
        self.sq = {"gate_up": np.zeros((L, experts, h)), "down": np.zeros((L, experts, i))}
        self.count = np.zeros((L, experts))

    def weight(self, layer, expert, kind):
        return self.store.weight(layer, expert, kind)

    def moe(self, layer, x, topk_ids, topk_weights, down_in_norm=None):
        gate_up, down = self.store.gate_up[layer], self.store.down[layer]

        def expert(e, rows):
            act, out = expert_mlp(rows, gate_up[e], down[e], act=self.store.activation)
            self.sq["gate_up"][layer, e] += rows.double().pow(2).sum(0).cpu().numpy()
            self.sq["down"][layer, e] += act.double().pow(2).sum(0).cpu().numpy()
            self.count[layer, e] += rows.shape[0]
            return act, out

        return grouped_moe(x, topk_ids, topk_weights, self.experts, expert, down_in_norm)


def _need_dense(model) -> DenseExpertStore:
    if not isinstance(model.experts, DenseExpertStore):
        raise UserError("sensitivity weights need the full-precision model; load the source checkpoint, "
                        "not an AP checkpoint")
    return model.experts


def hessian_diagonals(model, sequences: Sequence[torch.Tensor], *, prior_tokens: float = 16.0,
                      damp: float = 0.01, progress: bool = True) -> dict[str, np.ndarray]:
    """{"gate_up": [L, E, H], "down": [L, E, I]} float64 per-column weights (see module docstring)."""
    dense = _need_dense(model)
    rec = _SecondMoments(dense, model.config.experts)
    model.experts = rec
    try:
        for seq in tqdm(sequences, desc="hessian: calibration forward", unit="seq",
                        disable=None if progress else True):
            _prefill(model, seq)
    finally:
        model.experts = dense
    out = {}
    n = rec.count[..., None]
    for kind, sq in rec.sq.items():
        layer_mean = sq.sum(1, keepdims=True) / np.maximum(n.sum(1, keepdims=True), 1.0)  # [L, 1, in]
        h = (sq + prior_tokens * layer_mean) / (n + prior_tokens)
        h = h + damp * h.mean(axis=-1, keepdims=True)
        out[kind] = np.where(h > 0, h, 1.0)  # a layer with no calibration signal: uniform
    return out


def fisher_weights(model, sequences: Sequence[torch.Tensor], *, progress: bool = True) -> dict[str, list[torch.Tensor]]:
    """{"gate_up": per layer [E, 2I, H], "down": per layer [E, H, I]} float32 sums of per-sequence grad^2.

    Gradients are taken in the model's dtype (load it in fp32 for quantization)."""
    dense = _need_dense(model)
    raw_forward = getattr(type(model).forward, "__wrapped__", None)
    raw_logits = getattr(type(model).logits, "__wrapped__", None)
    if raw_forward is None or raw_logits is None:
        raise RuntimeError("MoEModel.forward or .logits has no undecorated __wrapped__; Fisher weighting needs them")
    gu = [t.detach().clone().requires_grad_(True) for t in dense.gate_up]
    dn = [t.detach().clone().requires_grad_(True) for t in dense.down]
    acc = {"gate_up": [torch.zeros_like(t, dtype=torch.float32) for t in gu],
           "down": [torch.zeros_like(t, dtype=torch.float32) for t in dn]}
    model.experts = DenseExpertStore(gu, dn, dense.activation)
    try:
        with torch.enable_grad():
            for seq in tqdm(sequences, desc="fisher: calibration backward", unit="seq",
                            disable=None if progress else True):
                out = _prefill(model, seq, forward=lambda *a: raw_forward(model, *a))
                logits = raw_logits(model, out.hidden)
                loss = F.cross_entropy(logits[:-1], seq[1:].to(logits.device))
                grads = torch.autograd.grad(loss, gu + dn, allow_unused=True)
                for i, g in enumerate(grads):
                    kind, li = ("gate_up", i) if i < len(gu) else ("down", i - len(gu))
                    if g is not None:
                        acc[kind][li] += g.detach().float().pow(2)
    finally:
        model.experts = dense
    return acc
