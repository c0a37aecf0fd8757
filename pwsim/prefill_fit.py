"""Prefill fit: the cost model's prefill MoE layer against the runtime's measured one (`pwruntime bench prefill`).

A bench row is one MoE layer of `active_experts` experts, all blocks at `bits`, computing `tokens` prompt
tokens on the runtime's dequantize path (above `ap_fused_max_tokens`), timed on the wall clock (host work
and launches included): `runtime_ms` where the row has it (the path the runtime takes, in benches that time
several), else `padded_ms`. `layer_ms` prices the same layer with `CostModel.moe`:
one layer of the row's model card, the row's `tokens * top_k` routed slots split evenly over its active
experts (the bench routes uniformly at random, so its counts are near-even; and the dequantize path's
time depends on the split only through experts between memory- and compute-bound), every block at the
row's bits, `batch_tokens` = the row's tokens.

`fit` sets the profile's `prefill_layer_overhead_us` to its current value plus the median over rows of
(measured - modeled), clipped at 0. The median, not a least-squares line: the model's slope (bytes and
FLOPs at the profile's measured rates) is already physical, what it lacks is a fixed cost per layer (the
experts' row counts read back to the host, the group's launches), and the median of the gaps is robust
to the few rows where the GEMMs' own inefficiency adds to it. Each row has one active layer, so the fit
is exact for the median row and refitting a fitted profile leaves it unchanged.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from pwsim.cost_model import CostModel
from traces.clikit import UserError
from traces.hardware import AP_BITS, HardwareProfile
from traces.model_card import CardError, ModelSpec, load_card

# the bundled bench, by path (pwsim does not import pwruntime; an installed package may lack it)
DEFAULT_BENCH = Path(__file__).resolve().parents[1] / "pwruntime" / "assets" / "prefill_bench.json"
# `pwruntime bench prefill` names its shapes as pwruntime.kernels.bench.MODEL_SHAPES does; the bundled card of each
BENCH_CARDS = {"demo": "pagedweight-demo", "qwen1.5-moe-a2.7b": "qwen1.5-moe-a2.7b",
               "mixtral-8x7b": "mixtral-8x7b-v0.1", "olmoe-1b-7b": "olmoe-1b-7b-0924",
               "qwen3-moe-30b-a3b": "qwen3-30b-a3b", "gemma-4-26b-a4b": "gemma-4-26b-a4b"}
ROW_KEYS = ("model", "tokens", "bits", "active_experts", "padded_ms")
ROUTING = "even: the row's tokens * top_k routed slots split evenly over its active experts, one MoE layer"


@dataclass(frozen=True)
class BenchRow:
    """What the fit reads of one `pwruntime bench prefill` row."""
    model: str
    tokens: int
    bits: int
    active_experts: int
    measured_ms: float


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def parse_rows(data, source: str) -> list[BenchRow]:
    """The rows of a bench JSON object; a UserError naming the first bad one."""
    fix = "give the JSON that `pwruntime bench prefill --out FILE` writes"
    if not isinstance(data, dict) or not isinstance(data.get("rows"), list):
        raise UserError(f"{source}: not a prefill bench (a JSON object with a list 'rows'); {fix}")
    if not data["rows"]:
        raise UserError(f"{source}: the bench has no rows; {fix}")
    rows = []
    for k, r in enumerate(data["rows"]):
        missing = [key for key in ROW_KEYS if not isinstance(r, dict) or key not in r]
        if missing:
            raise UserError(f"{source}: row {k} lacks {missing}; each row needs {list(ROW_KEYS)}; {fix}")
        ms = r["runtime_ms"] if r.get("runtime_ms") is not None else r["padded_ms"]
        ok = (isinstance(r["model"], str) and _int(r["tokens"]) and r["tokens"] > 0 and r["bits"] in AP_BITS
              and _int(r["active_experts"]) and r["active_experts"] > 0 and isinstance(ms, (int, float))
              and not isinstance(ms, bool) and math.isfinite(ms) and ms > 0)
        if not ok:
            raise UserError(f"{source}: row {k} has a bad value (model a name, tokens and active_experts positive "
                            f"integers, bits in {list(AP_BITS)}, the time a positive number): "
                            f"{ {key: r[key] for key in (*ROW_KEYS, 'runtime_ms') if key in r} }")
        rows.append(BenchRow(r["model"], r["tokens"], r["bits"], r["active_experts"], float(ms)))
    return rows


def read_bench(path: str | Path) -> tuple[dict, list[BenchRow]]:
    """(the bench's metadata: everything but its rows, the rows) of a `pwruntime bench prefill` JSON file."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"bench file {str(path)!r} {'is a directory' if p.is_dir() else 'not found'}; pass --bench "
                        "FILE written by `pwruntime bench prefill --out FILE`")
    try:
        data = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{p}: not a JSON file ({e}); give the JSON that `pwruntime bench prefill --out FILE` "
                        "writes") from None
    rows = parse_rows(data, str(p))
    return {k: v for k, v in data.items() if k != "rows"}, rows


def card_for(model: str) -> ModelSpec:
    """The model card of a bench model name (BENCH_CARDS, else a card of that name)."""
    try:
        return load_card(BENCH_CARDS.get(model, model))
    except CardError:
        raise UserError(f"bench model {model!r} has no model card; known bench models: {', '.join(BENCH_CARDS)} "
                        "(or name a bundled card, see `pwsim models`)") from None


def expert_counts(tokens: int, top_k: int, active: int) -> np.ndarray:
    """`tokens * top_k` routed slots split evenly over `active` experts (the first `slots % active` get one more)."""
    base, extra = divmod(tokens * top_k, active)
    return np.full(active, base, dtype=np.int64) + (np.arange(active) < extra)


def layer_ms(card: ModelSpec, profile: HardwareProfile, row: BenchRow) -> float:
    """The cost model's milliseconds of the row's one prefill MoE layer (see the module docstring)."""
    if row.tokens <= profile.ap_fused_max_tokens:
        raise UserError(f"bench row {row.model} T={row.tokens} takes the fused path (at most "
                        f"{profile.ap_fused_max_tokens} tokens on {profile.name}); prefill-fit fits the dequantize "
                        "path only: bench larger prompts")
    if row.active_experts > min(card.experts, row.tokens * card.top_k):
        raise UserError(f"bench row {row.model} T={row.tokens} has {row.active_experts} active experts, more than "
                        f"{card.name} can route ({card.experts} experts, top-{card.top_k}); is the model right?")
    cm = CostModel(card, profile)
    tok = np.zeros((cm.L, cm.E), dtype=np.int64)
    tok[0, :row.active_experts] = expert_counts(row.tokens, card.top_k, row.active_experts)
    q = np.full(cm.L * cm.E * 2, row.bits)
    return cm.moe(q, tok, row.tokens) * 1e3


def ratio_summary(ratios) -> dict:
    r = np.asarray(ratios, dtype=np.float64)
    return {"min": float(r.min()), "median": float(np.median(r)), "max": float(r.max())}


def fit(rows: list[BenchRow], profile: HardwareProfile) -> dict:
    """Per row the modeled and measured ms before and after the fit, the fitted overhead, the ratio summaries.
    Rows of at most `ap_fused_max_tokens` tokens ran the fused kernel, not the dequantize path: they are left out
    (counted as `skipped_fused_rows`)."""
    fused = profile.ap_fused_max_tokens
    skipped = sum(r.tokens <= fused for r in rows)
    rows = [r for r in rows if r.tokens > fused]
    if not rows:
        raise UserError(f"every bench row takes the fused path (at most {fused} tokens on {profile.name}); prefill-fit "
                        f"fits the dequantize path only: bench prompts of more than {fused} tokens (--tokens)")
    cards = {m: card_for(m) for m in dict.fromkeys(r.model for r in rows)}
    before = np.array([layer_ms(cards[r.model], profile, r) for r in rows])
    measured = np.array([r.measured_ms for r in rows])
    fitted_us = max(0.0, profile.prefill_layer_overhead_us + float(np.median(measured - before)) * 1e3)
    after_profile = replace(profile, prefill_layer_overhead_us=fitted_us)
    after = np.array([layer_ms(cards[r.model], after_profile, r) for r in rows])
    table = [{"model": r.model, "card": cards[r.model].name, "tokens": r.tokens, "bits": r.bits,
              "active_experts": r.active_experts, "measured_ms": r.measured_ms, "modeled_ms": float(b),
              "ratio": float(b / r.measured_ms), "fitted_ms": float(a), "fitted_ratio": float(a / r.measured_ms)}
             for r, b, a in zip(rows, before, after)]
    return {"hardware": profile.name, "routing": ROUTING, "rows": table, "skipped_fused_rows": skipped,
            "fit": {"prefill_layer_overhead_us": fitted_us, "previous_us": profile.prefill_layer_overhead_us,
                    "method": "previous + median over rows of (measured - modeled), clipped at 0"},
            "ratios": {"before": ratio_summary(before / measured), "after": ratio_summary(after / measured),
                       "of": "modeled / measured"}}


def fitted_profile(profile: HardwareProfile, report: dict, note: str) -> HardwareProfile:
    """`profile` with the fitted `prefill_layer_overhead_us` and `note` (where it came from) as metadata.prefill_fit."""
    return replace(profile, prefill_layer_overhead_us=report["fit"]["prefill_layer_overhead_us"],
                   metadata={**profile.metadata, "prefill_fit": note})
