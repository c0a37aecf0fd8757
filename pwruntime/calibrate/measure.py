"""Measured per-sequence, per-block output errors of the AP weights, with phi and routing mass.

The model runs at full precision (its DenseExpertStore math) through `MeasuringStore`, which, for
every expert call inside `moe()` (dispatched by the shared `grouped_moe`), also multiplies the rows
the expert received by `W_b - W` for every stored bitwidth b. For linear-block i of expert e, over
the (token, top-k slot) pairs of one sequence routed to e, with routing weight r and block input x
(gate_up: the MoE input row; down: the full-precision intermediate activation), it accumulates

    weight[i]  = sum r                          pairs[i] = number of pairs
    err[i, b]  = sum r ||(W_b - W) x||^2         (error against full precision)
    step[i, b] = sum r ||(W_b' - W_b) x||^2      (b' = next lower stored bitwidth; the transition b -> b')
    rel[i, b]  = sum r ||(W_b - W_top) x||^2     (against the top stored bitwidth, 0 at the top)

computed exactly from the recorded inputs (no diagonal approximation). Prompt features phi and the
routing mass (Eq. 1) of each sequence come from `policies.observe` (`BatchedPromptFeatures`,
`RoutingMass` without decay) fed with the forward's routing records, exactly as the engine does.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np
import torch
from tqdm import tqdm

from policies.calibration import NB
from policies.features import BatchedPromptFeatures
from policies.observe import RoutingMass
from pwruntime.model.attention_plan import prefill_metadata
from pwruntime.model.experts import KINDS, DenseExpertStore, expert_mlp, grouped_moe

DEFAULT_MAX_CACHE_BYTES = 8 << 30


@dataclass
class SequenceStats:
    """Per sequence (first axis) and linear-block; see the module docstring. NaN where undefined."""

    tokens: np.ndarray  # [S]
    weight: np.ndarray  # [S, n]
    pairs: np.ndarray  # [S, n]
    err: np.ndarray  # [S, n, NB]
    step: np.ndarray  # [S, n, NB], indexed by the transition's from-bits
    rel: np.ndarray  # [S, n, NB]
    phi: np.ndarray  # [S, n, 3]
    mass: np.ndarray  # [S, layers, experts]

    @property
    def num_sequences(self) -> int:
        return len(self.tokens)

    def subset(self, idx) -> "SequenceStats":
        idx = np.asarray(idx, dtype=np.int64)
        return SequenceStats(*(getattr(self, f.name)[idx] for f in fields(self)))


def _stack(layers, name: str) -> np.ndarray:
    return np.stack([getattr(r, name).detach().cpu().numpy() for r in layers])


class MeasuringStore:
    """An ExpertStore serving the full-precision experts and measuring every AP bitwidth on the side."""

    def __init__(self, dense: DenseExpertStore, ap, bits: tuple[int, ...],
                 max_cache_bytes: int = DEFAULT_MAX_CACHE_BYTES) -> None:
        self.dense, self.ap = dense, ap
        self.bits = tuple(sorted(bits))
        self.layers, self.experts = dense.num_layers, dense.gate_up[0].shape[0]
        n, nb = self.layers * self.experts * 2, len(self.bits)
        dev = dense.gate_up[0].device
        per_expert = sum(int(t[0].numel()) for t in (dense.gate_up[0], dense.down[0])) * 4 * nb
        self._cache: dict | None = {} if per_expert * self.experts * self.layers <= max_cache_bytes else None
        self.w = torch.zeros(n, dtype=torch.float64, device=dev)
        self.pairs = torch.zeros(n, dtype=torch.float64, device=dev)
        self.err = torch.zeros(n, nb, dtype=torch.float64, device=dev)
        self.step = torch.zeros(n, max(nb - 1, 0), dtype=torch.float64, device=dev)
        self.rel = torch.zeros(n, nb, dtype=torch.float64, device=dev)

    def weight(self, layer: int, expert: int, kind: str) -> torch.Tensor:
        return self.dense.weight(layer, expert, kind)

    def deltas(self, layer: int, expert: int, kind: str) -> torch.Tensor:
        """[bits, out, in] float32: W_b - W for every stored bitwidth (ascending)."""
        key = (layer, expert, kind)
        if self._cache is not None and key in self._cache:
            return self._cache[key]
        w = self.dense.weight(layer, expert, kind).float()
        d = torch.stack([self.ap.dequantized(layer, expert, kind, b).to(w.device).float() for b in self.bits]) - w
        if self._cache is not None:
            self._cache[key] = d
        return d

    def reset(self) -> None:
        for t in (self.w, self.pairs, self.err, self.step, self.rel):
            t.zero_()

    def _measure(self, layer: int, expert: int, kind: int, inp: torch.Tensor, r: torch.Tensor) -> None:
        i = (layer * self.experts + expert) * 2 + kind
        d = torch.matmul(inp.float(), self.deltas(layer, expert, KINDS[kind]).transpose(1, 2))  # [bits, rows, out]
        rr = r.double()
        self.w[i] += rr.sum()
        self.pairs[i] += float(inp.shape[0])
        self.err[i] += d.pow(2).sum(-1).double() @ rr
        if d.shape[0] > 1:
            self.step[i] += (d[:-1] - d[1:]).pow(2).sum(-1).double() @ rr
        self.rel[i] += (d - d[-1]).pow(2).sum(-1).double() @ rr

    def moe(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
            down_in_norm: torch.Tensor | None = None) -> torch.Tensor:
        gate_up, down = self.dense.gate_up[layer], self.dense.down[layer]
        flat = topk_ids.reshape(-1)
        order = torch.argsort(flat, stable=True)  # the order grouped_moe hands rows to the experts
        w_sorted = topk_weights.reshape(-1)[order].float()
        counts = torch.bincount(flat, minlength=self.experts)
        starts = (torch.cumsum(counts, 0) - counts).tolist()

        def expert(e: int, rows: torch.Tensor):
            r = w_sorted[starts[e]:starts[e] + rows.shape[0]]
            act, out = expert_mlp(rows, gate_up[e], down[e], act=self.dense.activation)
            self._measure(layer, e, 0, rows, r)
            self._measure(layer, e, 1, act, r)
            return act, out

        return grouped_moe(x, topk_ids, topk_weights, self.experts, expert, down_in_norm)

    def collect(self) -> dict[str, np.ndarray]:
        """This sequence's accumulators as [n] / [n, NB] float64 arrays (NaN where undefined)."""
        n = self.w.shape[0]
        out = {"weight": self.w.cpu().numpy().copy(), "pairs": self.pairs.cpu().numpy().copy()}
        bits = list(self.bits)
        for name, src, cols in (("err", self.err, bits), ("rel", self.rel, bits), ("step", self.step, bits[1:])):
            a = np.full((n, NB), np.nan)
            a[:, cols] = src.cpu().numpy()
            out[name] = a
        return out


def prefill(model, ids, record: bool = True, block_size: int = 16):
    """One sequence as a single prefill through model.forward (a trivial block table)."""
    seq = torch.as_tensor(ids, dtype=torch.long)
    meta = prefill_metadata(len(seq), block_size, model.device)
    kv = model.new_kv_cache(-(-len(seq) // block_size), block_size)
    return model.forward(seq, torch.arange(len(seq)), kv, meta, record=record)


def measure_sequences(model, ap, sequences, bits: tuple[int, ...], *, desc: str = "measure",
                      progress: bool = True, max_cache_bytes: int = DEFAULT_MAX_CACHE_BYTES,
                      store: MeasuringStore | None = None) -> SequenceStats:
    """Run each sequence through the full-precision model and measure it (see the module docstring)."""
    if not len(sequences):
        raise ValueError("measure_sequences needs at least one sequence")
    dense = model.experts
    if store is None:
        if not isinstance(dense, DenseExpertStore):
            raise TypeError("measure_sequences needs the full-precision model (a DenseExpertStore)")
        store = MeasuringStore(dense, ap, bits, max_cache_bytes)
    L, E = store.layers, store.experts
    rows: dict[str, list] = {k: [] for k in ("weight", "pairs", "err", "step", "rel", "phi", "mass")}
    tokens = []
    model.experts = store
    try:
        for ids in tqdm(sequences, desc=desc, unit="seq", disable=None if progress else True):
            store.reset()
            rec = prefill(model, ids).routing
            topk_ids, topk_w = _stack(rec, "topk_ids"), _stack(rec, "topk_weights")
            feats = BatchedPromptFeatures(L, E)
            feats.update(0, topk_ids, topk_w, _stack(rec, "gate_up_in_norm"), _stack(rec, "down_in_norm"))
            mass = RoutingMass(L, E, half_life_tokens=None)
            mass.update(topk_ids, topk_w)
            for k, v in store.collect().items():
                rows[k].append(v)
            rows["phi"].append(feats.sequence_features(0))
            rows["mass"].append(mass.mass())
            tokens.append(len(ids))
    finally:
        model.experts = store.dense
    order = ("weight", "pairs", "err", "step", "rel", "phi", "mass")
    return SequenceStats(np.asarray(tokens, dtype=np.int64), *(np.stack(rows[k]) for k in order))
