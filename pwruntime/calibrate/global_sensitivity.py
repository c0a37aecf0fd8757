"""The global sensitivity table s[i, b] (paper Eq. 2) of every expert linear-block and stored bitwidth.

    s[i, b] = sum_j h[i, j] * sum_rows (W[i] - W_b[i])[:, j]^2

with `h[i, j] = E[x_j^2]` over the calibration tokens routed to the block's expert (gate_up: the MoE
input; down: the intermediate activation), as `pwruntime.quant.sensitivity.hessian_diagonals`
computes it (cold experts shrunk towards the layer mean), and `W_b` the AP checkpoint's weights at
b bits (`pack.dequantize` through the APExpertStore) against the full-precision `W` (the differences
come from the measuring store, which dequantizes each block once). Summed in float64. NaN where b
is not stored. `s[i, top] > 0` is the residual error of the 8-bit codes.

Scale (`--sensitivity`). As defined above, s is a damage *per routed (token, slot) pair*: it says
nothing about how often the expert is used, so a rarely routed expert looks as sensitive as a hot
one. `frequency` (the default) multiplies each block's row by its expert's calibration routing
frequency `f[l, e] = sum r / tokens` (routing weight per calibration token, Eq. 1's numerator per
token; floored at 1% of the layer mean so no block gets exactly zero), which makes s the expected
damage per calibration token, the quantity the held-out score measures; `routed` keeps the per-pair
values. On the demo model at the uniform-5-bit byte target, frequency scaling lowered the measured
held-out damage of the static sensitivity-optimal assignment from 2.25 to 1.70 (uniform: 2.15) and of
the searched planner from 1.55 to 1.35. The prompt-residual heads are fit against the per-pair
values either way (the planner's routing buckets, not the residual, track routing).

Nested codes make the error fall as bits grow, but weighting by `h` (which need not be the k-means
weighting) and fp16 LUT rounding can break that by a hair; `monotone_envelope` lifts each value to
the largest one at any higher bitwidth, and the number of entries it changed is reported.
"""
from __future__ import annotations

import numpy as np
import torch
from tqdm import tqdm

from policies.calibration import NB
from pwruntime.model.experts import KINDS


def sensitivity_table(deltas, h: dict[str, np.ndarray], bits: tuple[int, ...], progress: bool = True) -> np.ndarray:
    """[n_blocks, 9] raw s[i, b].

    `deltas(layer, expert, kind)` gives `W_b - W` for every b of `bits` (ascending), [bits, out, in]
    (`MeasuringStore.deltas`, which caches them for the measurement that follows); `h[kind]` is
    [layers, experts, in] (hessian_diagonals' output).
    """
    layers, experts = h["gate_up"].shape[:2]
    cols = sorted(bits)
    s = np.full((layers * experts * 2, NB), np.nan)
    bar = tqdm(total=layers * experts * 2, desc="sensitivity", unit="block", disable=None if progress else True)
    for layer in range(layers):
        for e in range(experts):
            for k, kind in enumerate(KINDS):
                d = deltas(layer, e, kind)
                hj = torch.as_tensor(h[kind][layer, e], dtype=torch.float64, device=d.device)
                s[(layer * experts + e) * 2 + k, cols] = (d.double().pow(2).sum(1) @ hj).cpu().numpy()
                bar.update(1)
    bar.close()
    return s


def monotone_envelope(s: np.ndarray, bits: tuple[int, ...]) -> tuple[np.ndarray, int]:
    """(s lifted so that s[i, b'] >= s[i, b] for b' < b, number of entries changed)."""
    out = s.copy()
    down = sorted(bits, reverse=True)
    for hi, lo in zip(down[:-1], down[1:]):
        out[:, lo] = np.maximum(out[:, lo], out[:, hi])
    changed = int((out[:, list(bits)] != s[:, list(bits)]).sum())
    return out, changed


def routing_frequency(weight: np.ndarray, tokens: int, layers: int, experts: int, floor: float = 0.01) -> np.ndarray:
    """[layers, experts] routing weight per token from summed gate_up `weight` [n_blocks] over `tokens`."""
    f = np.asarray(weight, dtype=np.float64)[0::2].reshape(layers, experts) / max(int(tokens), 1)
    return np.maximum(f, floor * f.mean(axis=1, keepdims=True))


def frequency_scaled(s: np.ndarray, freq: np.ndarray) -> np.ndarray:
    """s[i, b] times the routing frequency of block i's expert (both blocks of an expert share it)."""
    return s * np.repeat(np.asarray(freq, dtype=np.float64).reshape(-1), 2)[:, None]
