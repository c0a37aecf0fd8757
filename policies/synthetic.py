"""Synthetic calibrations, routing masses and prompt features with realistic structure (seeded).

For tests, benchmarks and the simulator until a measured calibration exists. The structure:

* sensitivity `s[i, b]` grows by about `per_bit_growth` (4x) per bit removed, with a little
  per-step jitter (always > 1x, so it stays monotone); its scale is the block's parameter count,
  times a per-element kind factor (down projections `down_factor` x more sensitive than gate_up),
  times a lognormal per-block factor (sigma `block_sigma`), times a layer factor that makes the
  first and last layers up to 1.75x more sensitive;
* residual heads per (kind, b -> b') for every supported pair, centred on the typical features
  (`rho = w . (phi - phi0)`), with confidences in [0.3, 0.9] and clip bounds +-1;
* per-domain damages `E_d[i, b]`: the sensitivity times a lognormal per-block, per-domain factor
  (the simulator's quality model must not be the planner's own predictor);
* the initial assignment: the top bitwidth, or the sensitivity-optimal one at `initial_mean_bits`.

`model` may be a PageTable, a model card (`traces.model_card.ModelSpec` or anything with
`moe_layers`/`layers`, `experts`, `hidden`, `expert_intermediate`), a mapping with those keys, or a
tuple `(layers, experts, hidden, intermediate)`.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from policies.calibration import NB, Calibration, model_fingerprint
from policies.page_table import DEFAULT_BITS, PageTable
from policies.planners.allocation import sensitivity_optimal_bits

SYNTHETIC = "synthetic"  # a calibration source meaning "synthetic_calibration, seeded": `synthetic` or `synthetic:S`


def synthetic_seed(source: str, default: int) -> int | None:
    """The seed a calibration source `synthetic[:S]` names (`default` without `:S`); None for any other source.
    Raises ValueError for a seed that is not an integer >= 0."""
    if source != SYNTHETIC and not source.startswith(SYNTHETIC + ":"):
        return None
    _, _, s = source.partition(":")
    if s and not (s.isascii() and s.isdigit()):
        raise ValueError(f"calibration {source!r}: the seed after 'synthetic:' must be an integer >= 0, e.g. "
                         "synthetic:3")
    return int(s) if s else default


PHI0 = {0: np.array([1.0, 1.15, 3.0]), 1: np.array([0.5, 0.6, 2.0])}  # typical phi per kind


def model_dims(model: Any) -> tuple[int, int, int, int]:
    """(layers, experts, hidden, intermediate) of a table, card, mapping or tuple."""
    if isinstance(model, PageTable):
        return model.layers, model.experts, int(model.shapes[0, 1]), int(model.shapes[0, 0] // 2)
    if isinstance(model, (tuple, list)) and len(model) == 4:
        return tuple(int(x) for x in model)  # type: ignore[return-value]
    get = model.get if isinstance(model, dict) else (lambda k, d=None: getattr(model, k, d))
    layers = get("moe_layers", None)
    layers = layers() if callable(layers) else layers
    layers = get("layers") if layers is None else layers
    inter = get("expert_intermediate", None) or get("intermediate")
    if None in (layers, get("experts"), get("hidden"), inter):
        raise ValueError("model must give layers, experts, hidden and expert_intermediate")
    return int(layers), int(get("experts")), int(get("hidden")), int(inter)


def _fingerprint(model: Any, dims: tuple[int, int, int, int]) -> str:
    fp = getattr(model, "fingerprint", None)
    if callable(fp):
        return fp()
    layers, experts, hidden, inter = dims
    return model_fingerprint({"layers": layers, "experts": experts, "hidden": hidden, "intermediate": inter})


def synthetic_calibration(model: Any, seed: int = 0, *, bits: tuple[int, ...] = DEFAULT_BITS,
                          initial_mean_bits: float | None = None, per_bit_growth: float = 4.0,
                          block_sigma: float = 0.8, down_factor: float = 3.0, residual_scale: float = 0.3,
                          domains: tuple[str, ...] = ("c4", "wikitext2", "code"),
                          fingerprint: str | None = None, **overrides) -> Calibration:
    """A Calibration with the structure described in the module docstring; `overrides` go to Calibration."""
    dims = model_dims(model)
    layers, experts, hidden, inter = dims
    table = model if isinstance(model, PageTable) and model.bits == tuple(sorted(bits)) else \
        PageTable(layers, experts, hidden, inter, bits=bits)
    rng = np.random.default_rng(seed)
    n = table.num_blocks
    sup = sorted(table.bits)
    params = (table.shapes[:, 0] * table.shapes[:, 1]).astype(np.float64)
    kind_f = np.where(table.kind == 0, 1.0, down_factor)
    span = max((layers - 1) / 2, 1.0)
    layer_f = 1.0 + 0.75 * ((table.layer - (layers - 1) / 2) / span) ** 2
    scale = 1e-6 * params * kind_f * layer_f * rng.lognormal(0.0, block_sigma, n)
    sens = np.full((n, NB), np.nan)
    sens[:, sup[-1]] = scale
    for hi, lo in zip(sup[::-1][:-1], sup[::-1][1:]):
        step = per_bit_growth ** (hi - lo) * np.exp(rng.normal(0.0, 0.1, n))
        sens[:, lo] = sens[:, hi] * np.maximum(step, 1.01)

    w = np.zeros((2, NB, NB, 3))
    bias = np.zeros((2, NB, NB))
    conf = np.zeros((2, NB, NB))
    clip = np.zeros((2, NB, NB, 2))
    for k in (0, 1):
        for b in sup:
            for b2 in sup:
                if b2 >= b:
                    continue
                w[k, b, b2] = rng.normal(0.0, residual_scale, 3) / PHI0[k]
                bias[k, b, b2] = -float(w[k, b, b2] @ PHI0[k])
                conf[k, b, b2] = rng.uniform(0.3, 0.9)
                clip[k, b, b2] = (-1.0, 1.0)

    if initial_mean_bits is None:
        init = np.full(n, sup[-1], dtype=np.int64)
    else:
        init = sensitivity_optimal_bits(table, sens, target_mean_bits=float(initial_mean_bits))
    damage = {d: sens * rng.lognormal(0.0, 0.3, n)[:, None] for d in domains}
    provenance = {"synthetic": True, "generator": "policies.synthetic.synthetic_calibration", "seed": seed,
                  "per_bit_growth": per_bit_growth, "block_sigma": block_sigma, "down_factor": down_factor,
                  "residual_scale": residual_scale, "initial_mean_bits": initial_mean_bits}
    return Calibration(
        fingerprint=fingerprint or _fingerprint(model, dims), layers=layers, experts=experts, bits=tuple(sup),
        sensitivity=sens, initial_bits=init, residual_weights=w, residual_bias=bias, residual_confidence=conf,
        residual_clip=clip, domain_damage=damage, provenance=provenance, **overrides)


def synthetic_routing_mass(layers: int, experts: int, seed: int = 0, skew: float = 1.1) -> np.ndarray:
    """[layers, experts] Zipf-skewed routing mass, a different expert order per layer; rows sum to 1."""
    rng = np.random.default_rng(seed)
    base = 1.0 / np.arange(1, experts + 1) ** skew
    m = np.stack([rng.permutation(base) for _ in range(layers)])
    return m / m.sum(axis=1, keepdims=True)


def synthetic_features(num_blocks: int, seed: int = 0, sigma: float = 0.3, active: float = 1.0) -> np.ndarray:
    """[num_blocks, 3] prompt features phi (mean <= rms <= max norms) around PHI0; a fraction `active` nonzero."""
    rng = np.random.default_rng(seed)
    kind = np.arange(num_blocks) % 2
    base = np.where(kind[:, None] == 0, PHI0[0], PHI0[1])
    mean = base[:, 0] * rng.lognormal(0.0, sigma, num_blocks)
    rms = mean * (base[:, 1] / base[:, 0]) * rng.uniform(0.95, 1.1, num_blocks)
    mx = np.maximum(rms, mean * (base[:, 2] / base[:, 0]) * rng.lognormal(0.0, sigma, num_blocks))
    out = np.stack([mean, np.maximum(rms, mean), mx], axis=1)
    out[rng.random(num_blocks) >= active] = 0.0
    return out

