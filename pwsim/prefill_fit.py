"""Prefill fit: the cost model's prefill MoE layer against the runtime's measured one (`pwruntime bench prefill`).

A bench row is one MoE layer of `active_experts` experts, all blocks at `bits`, computing `tokens` prompt
tokens on the runtime's dequantize path (above `ap_fused_max_tokens`), timed on the wall clock (host work
and launches included): `runtime_ms` where the row has it (the path the runtime takes, in benches that time
several), else `padded_ms`. `layer_ms` prices the same layer with `CostModel.moe`:
one layer of the row's model card, the row's `tokens * top_k` routed slots split evenly over its active
experts (the bench routes uniformly at random, so its counts are near-even; and the dequantize path's
time depends on the split only through experts between memory- and compute-bound), every block at the
row's bits, `batch_tokens` = the row's tokens, and the row's chunk size (`prefill_chunk_bytes`, the bench's
`--prefill-chunk`; 1 GiB, the default, in a bench older than the field).

Rows that also time the fused AP GEMM's kernels (`ap_gemm_kernel_ms`, at 3-4 bits, `ap_gemm_tile_rows` a tile) set
the profile's `ap_gemm_tflops` first: per (bits, tile rows) the median over those rows of the FLOPs the cost model
charges the layer's two GEMMs (each expert's rows in whole tiles, `CostModel.fused_gemm_times`, the rows spread
over the experts as a uniform router spreads them, `random_counts`) over the kernels' time. The rows whose layer the
runtime sends through that GEMM (`policies.prefill_path`) are then modeled with it, as the simulator models them:
no chunks of experts (their `chunks` is 0), and a fixed cost of their own, `ap_gemm_layer_overhead_us`, the median
of their gaps (an eager fused layer launches far less than a dequantizing one).

`fit` sets the profile's two fixed costs from the gaps (measured - modeled without them). The medians, not a
least-squares line: the model's slope (bytes and FLOPs at the profile's measured rates) is already physical, what
it lacks is a fixed cost per layer (the group's launches and host work) and one per chunk of experts after the
first, and medians are robust to the few rows where the GEMMs' own inefficiency adds to the gap.
`prefill_chunk_overhead_us` is the median, over pairs of rows alike but for their chunk size (same model, tokens
and bits) and so their chunk count, of the gap's difference per chunk, clipped at 0 (the profile's own value
where the bench has no such pair: one run at one chunk size); `prefill_layer_overhead_us` is then the median over
rows of the gap less the row's chunks after its first at that cost, clipped at 0. Each row has one active layer,
so refitting a fitted profile leaves it unchanged.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from policies.memory_budget import DEFAULT_PREFILL_CHUNK_BYTES
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
    chunk_bytes: int = DEFAULT_PREFILL_CHUNK_BYTES
    ap_gemm_kernel_ms: float | None = None   # the fused AP GEMM's two kernels alone, where the bench timed them
    ap_gemm_tile_rows: int | None = None


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
        chunk = r.get("prefill_chunk_bytes", DEFAULT_PREFILL_CHUNK_BYTES)
        ok = (isinstance(r["model"], str) and _int(r["tokens"]) and r["tokens"] > 0 and r["bits"] in AP_BITS
              and _int(r["active_experts"]) and r["active_experts"] > 0 and isinstance(ms, (int, float))
              and not isinstance(ms, bool) and math.isfinite(ms) and ms > 0 and _int(chunk) and chunk > 0)
        if not ok:
            raise UserError(f"{source}: row {k} has a bad value (model a name, tokens, active_experts and "
                            f"prefill_chunk_bytes positive integers, bits in {list(AP_BITS)}, the time a positive "
                            f"number): {_shown_row(r)}")
        kernel_ms, tile = r.get("ap_gemm_kernel_ms"), r.get("ap_gemm_tile_rows")
        if kernel_ms is not None and not (isinstance(kernel_ms, (int, float)) and not isinstance(kernel_ms, bool)
                                          and math.isfinite(kernel_ms) and kernel_ms > 0 and _int(tile) and tile > 0):
            raise UserError(f"{source}: row {k} has a bad ap_gemm_kernel_ms or ap_gemm_tile_rows (a positive time "
                            f"and a positive integer): {_shown_row(r)}")
        rows.append(BenchRow(r["model"], r["tokens"], r["bits"], r["active_experts"], float(ms), chunk,
                             None if kernel_ms is None else float(kernel_ms), tile if kernel_ms is not None else None))
    return rows


def _shown_row(r: dict) -> dict:
    return {key: r[key] for key in (*ROW_KEYS, "runtime_ms", "prefill_chunk_bytes", "ap_gemm_kernel_ms",
                                    "ap_gemm_tile_rows") if key in r}


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


def read_benches(paths: list[Path]) -> tuple[str | None, list[str], list[BenchRow]]:
    """(the device, each bench's command, every row) of `pwruntime bench prefill` JSON files of one device; a
    UserError where two name different devices (one fit is one device's)."""
    metas, rows = [], []
    for p in paths:
        meta, some = read_bench(p)
        metas.append(meta)
        rows += some
    devices = sorted({m["device"] for m in metas if m.get("device")})
    if len(devices) > 1:
        raise UserError(f"the benches ran on different devices ({', '.join(devices)}); fit one device's benches at a "
                        "time")
    return (devices[0] if devices else None,
            [m.get("command", "pwruntime bench prefill") for m in metas], rows)


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


def random_counts(tokens: int, top_k: int, active: int) -> np.ndarray:
    """`tokens * top_k` routed slots over `active` experts as a uniform router spreads them: one each, the rest
    multinomial (a fixed seed: the same counts for the same row). What the fused AP GEMM's row tiles see: their
    number, not the rows, sets its time, and even counts would never cross a tile."""
    rng = np.random.default_rng(0)
    return rng.multinomial(tokens * top_k - active, np.full(active, 1.0 / active)).astype(np.int64) + 1


def layer_ms(card: ModelSpec, profile: HardwareProfile, row: BenchRow) -> float:
    """The cost model's milliseconds of the row's one prefill MoE layer (see the module docstring)."""
    if row.tokens <= profile.ap_fused_max_tokens:
        raise UserError(f"bench row {row.model} T={row.tokens} takes the fused path (at most "
                        f"{profile.ap_fused_max_tokens} tokens on {profile.name}); prefill-fit fits the dequantize "
                        "path only: bench larger prompts")
    if row.active_experts > min(card.experts, row.tokens * card.top_k):
        raise UserError(f"bench row {row.model} T={row.tokens} has {row.active_experts} active experts, more than "
                        f"{card.name} can route ({card.experts} experts, top-{card.top_k}); is the model right?")
    cm, q, tok = _layer(card, profile, row)
    return cm.moe(q, tok, row.tokens) * 1e3


def _layer(card: ModelSpec, profile: HardwareProfile, row: BenchRow) -> tuple[CostModel, np.ndarray, np.ndarray]:
    """The cost model of the row's chunk size, its bits and its routing (one layer: even counts, or `random_counts`
    where the layer is priced as the fused AP GEMM)."""
    cm = CostModel(card, profile, prefill_chunk_bytes=row.chunk_bytes)
    tok = np.zeros((cm.L, cm.E), dtype=np.int64)
    tok[0, :row.active_experts] = expert_counts(row.tokens, card.top_k, row.active_experts)
    q = np.full(cm.L * cm.E * 2, row.bits)
    if not np.isnan(cm.fused_gemm_times(q, tok)[0]):
        tok[0, :row.active_experts] = random_counts(row.tokens, card.top_k, row.active_experts)
    return cm, q, tok


def row_path(card: ModelSpec, profile: HardwareProfile, row: BenchRow) -> int:
    """The chunks of experts the row's layer pays for, or 0 where the cost model prices it as the fused AP GEMM
    (which takes every row at once, at its own fixed cost)."""
    cm, q, tok = _layer(card, profile, row)
    return 0 if not np.isnan(cm.fused_gemm_times(q, tok)[0]) else cm.prefill_chunks


def gemm_flops(card: ModelSpec, row: BenchRow) -> float:
    """The FLOPs the cost model charges the row's fused AP GEMMs: each active expert's tiles of rows (`random_counts`
    in tiles of `ap_gemm_tile_rows`, padding included), through gate_up and down."""
    tile = row.ap_gemm_tile_rows
    padded = -(-random_counts(row.tokens, card.top_k, row.active_experts) // tile) * tile
    return float(padded.sum()) * 2 * 3 * card.hidden * card.expert_intermediate


def gemm_tflops(rows: list[BenchRow], cards: dict[str, ModelSpec]) -> dict[int, dict[int, float]]:
    """{bits: {tile rows: TFLOP/s}}: per (bits, tile rows) the median over the rows that timed the fused AP GEMM of
    gemm_flops / its kernels' time."""
    rates: dict[tuple[int, int], list[float]] = {}
    for r in rows:
        if r.ap_gemm_kernel_ms is not None:
            rates.setdefault((r.bits, r.ap_gemm_tile_rows), []).append(
                gemm_flops(cards[r.model], r) / (r.ap_gemm_kernel_ms * 1e-3) / 1e12)
    out: dict[int, dict[int, float]] = {}
    for (bits, tile), values in sorted(rates.items()):
        out.setdefault(bits, {})[tile] = float(np.median(values))
    return out


def merge_rates(old: dict[int, dict[int, float]], new: dict[int, dict[int, float]]) -> dict[int, dict[int, float]]:
    """`old` with `new`'s rates over it, (bits, tile rows) by (bits, tile rows)."""
    return {b: {**old.get(b, {}), **new.get(b, {})} for b in sorted({*old, *new})}


def ratio_summary(ratios) -> dict:
    r = np.asarray(ratios, dtype=np.float64)
    return {"min": float(r.min()), "median": float(np.median(r)), "max": float(r.max())}


def chunk_slopes(rows: list[BenchRow], counts: np.ndarray, gaps: np.ndarray) -> list[float]:
    """Per pair of dequantizing rows (a count of chunks, not 0) alike but for their chunk count (same model, tokens
    and bits), their gaps' difference over their chunk counts' (ms a chunk)."""
    slopes = []
    for a in range(len(rows)):
        for b in range(a + 1, len(rows)):
            ra, rb = rows[a], rows[b]
            if ((ra.model, ra.tokens, ra.bits) == (rb.model, rb.tokens, rb.bits) and counts[a] != counts[b]
                    and counts[a] and counts[b]):
                slopes.append(float((gaps[a] - gaps[b]) / (counts[a] - counts[b])))
    return slopes


def fit(rows: list[BenchRow], profile: HardwareProfile) -> dict:
    """Per row the modeled and measured ms before and after the fit, the fitted overheads, the ratio summaries.
    Rows of at most `ap_fused_max_tokens` tokens ran the fused kernel, not the dequantize path: they are left out
    (counted as `skipped_fused_rows`)."""
    fused = profile.ap_fused_max_tokens
    skipped = sum(r.tokens <= fused for r in rows)
    rows = [r for r in rows if r.tokens > fused]
    if not rows:
        raise UserError(f"every bench row takes the fused path (at most {fused} tokens on {profile.name}); prefill-fit "
                        f"fits the dequantize path only: bench prompts of more than {fused} tokens (--tokens)")
    cards = {m: card_for(m) for m in dict.fromkeys(r.model for r in rows)}
    tflops = gemm_tflops(rows, cards)
    rated = replace(profile, ap_gemm_tflops=merge_rates(profile.ap_gemm_tflops, tflops))
    counts = np.array([row_path(cards[r.model], rated, r) for r in rows])   # 0: the fused AP GEMM
    bare = replace(rated, prefill_layer_overhead_us=0.0, prefill_chunk_overhead_us=0.0, ap_gemm_layer_overhead_us=0.0)
    measured = np.array([r.measured_ms for r in rows])
    gaps = measured - np.array([layer_ms(cards[r.model], bare, r) for r in rows])
    slopes = chunk_slopes(rows, counts, gaps)
    chunk_us = max(0.0, float(np.median(slopes)) * 1e3) if slopes else profile.prefill_chunk_overhead_us
    dequantized, fused = counts > 0, counts == 0
    layer_us = (max(0.0, float(np.median(gaps[dequantized] * 1e3 - (counts[dequantized] - 1) * chunk_us)))
                if dequantized.any() else profile.prefill_layer_overhead_us)
    gemm_us = (max(0.0, float(np.median(gaps[fused] * 1e3))) if fused.any()
               else profile.ap_gemm_layer_overhead_us)
    after_profile = replace(rated, prefill_layer_overhead_us=layer_us, prefill_chunk_overhead_us=chunk_us,
                            ap_gemm_layer_overhead_us=gemm_us)
    before = np.array([layer_ms(cards[r.model], profile, r) for r in rows])
    after = np.array([layer_ms(cards[r.model], after_profile, r) for r in rows])
    table = [{"model": r.model, "card": cards[r.model].name, "tokens": r.tokens, "bits": r.bits,
              "active_experts": r.active_experts, "prefill_chunk_bytes": r.chunk_bytes, "chunks": int(c),
              "measured_ms": r.measured_ms, "modeled_ms": float(b), "ratio": float(b / r.measured_ms),
              "fitted_ms": float(a), "fitted_ratio": float(a / r.measured_ms)}
             for r, c, b, a in zip(rows, counts, before, after)]
    return {"hardware": profile.name, "routing": ROUTING, "rows": table, "skipped_fused_rows": skipped,
            "fit": {"prefill_layer_overhead_us": layer_us, "previous_us": profile.prefill_layer_overhead_us,
                    "prefill_chunk_overhead_us": chunk_us,
                    "previous_chunk_us": profile.prefill_chunk_overhead_us, "chunk_pairs": len(slopes),
                    "ap_gemm_layer_overhead_us": gemm_us,
                    "previous_ap_gemm_layer_us": profile.ap_gemm_layer_overhead_us,
                    "method": "chunk: median over rows alike but for their chunk count of the gap's difference a "
                              "chunk (kept where no such pair); layer: median over the dequantizing rows of the gap "
                              "less the chunks after the first; fused AP GEMM layer: median over its rows of the gap; "
                              "all clipped at 0, each kept where no row has that path (gap: measured - modeled "
                              "without any)",
                    "ap_gemm_tflops": {str(b): {str(t): v for t, v in tv.items()} for b, tv in tflops.items()},
                    "previous_ap_gemm_tflops": {str(b): {str(t): v for t, v in tv.items()}
                                                for b, tv in profile.ap_gemm_tflops.items()},
                    "ap_gemm_rows": sum(r.ap_gemm_kernel_ms is not None for r in rows)},
            "ratios": {"before": ratio_summary(before / measured), "after": ratio_summary(after / measured),
                       "of": "modeled / measured"}}


def fitted_profile(profile: HardwareProfile, report: dict, note: str) -> HardwareProfile:
    """`profile` with the fitted prefill overheads and `note` (where it came from) as metadata.prefill_fit."""
    fitted = {int(b): {int(t): v for t, v in tv.items()} for b, tv in report["fit"].get("ap_gemm_tflops", {}).items()}
    return replace(profile, prefill_layer_overhead_us=report["fit"]["prefill_layer_overhead_us"],
                   prefill_chunk_overhead_us=report["fit"]["prefill_chunk_overhead_us"],
                   ap_gemm_layer_overhead_us=report["fit"]["ap_gemm_layer_overhead_us"],
                   ap_gemm_tflops=merge_rates(profile.ap_gemm_tflops, fitted),
                   metadata={**profile.metadata, "prefill_fit": note})
