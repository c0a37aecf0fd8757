"""Which prefill layers skip dequantizing (policies.prefill_path), how the simulator prices them (the profile's
`ap_gemm_tflops`, CostModel's fused layers) and how `pwsim prefill-fit` measures that rate from bench rows."""
from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from policies.prefill_path import (FUSED_GEMM_MAX_ROWS, fused_gemm_layer, fused_gemm_shapes_ok,
                                   fused_gemm_tile_rows)
from pwsim.cost_model import CostModel
from pwsim.prefill_fit import BenchRow, card_for, fit, fitted_profile, gemm_flops, layer_ms, parse_rows
from traces.clikit import UserError
from traces.hardware import HardwareProfileError, from_json, load_profile
from traces.model_card import load_card

RATES = {3: {64: 200.0, 128: 300.0}, 4: {64: 160.0, 128: 250.0}}   # TFLOP/s


def test_the_rule_takes_grouped_layers_of_few_rows_an_expert_at_shapes_the_kernel_takes():
    assert fused_gemm_layer(2048 * 8, 128, 2816, 704)                  # Gemma 4 at 2,048 tokens: 128 rows an expert
    assert not fused_gemm_layer(2048 * 8 + 1, 128, 2816, 704)
    assert not fused_gemm_layer(512 * 2, 8, 4096, 14336)              # Mixtral's experts take padded GEMMs
    assert not fused_gemm_layer(64, 16, 2848, 704)                    # K not whole steps of 64
    assert fused_gemm_shapes_ok(704, 2816) and not fused_gemm_shapes_ok(96, 64) and not fused_gemm_shapes_ok(64, 63)
    assert fused_gemm_tile_rows(63 * 128, 128) == 64 and fused_gemm_tile_rows(64 * 128, 128) == 128
    assert FUSED_GEMM_MAX_ROWS == 128


def test_profile_field_round_trips_and_rejects_bad_entries():
    base = load_profile("h200-roofline")
    assert base.ap_gemm_tflops == {} and base.ap_gemm_rate(3, 128) is None
    p = replace(base, ap_gemm_tflops=RATES)
    assert p.ap_gemm_rate(3, 128) == 300e12 and p.ap_gemm_rate(5, 128) is None and p.ap_gemm_rate(3, 32) is None
    assert from_json(json.loads(json.dumps(p.to_json()))) == p
    for bad, what in (({2: {128: 1.0}}, "bitwidth 2"), ({3: {0: 1.0}}, "tile rows 0"), ({3: {128: 0.0}}, "positive")):
        with pytest.raises(HardwareProfileError, match=what):
            replace(base, ap_gemm_tflops=bad)


def _gemma(bits: int, tokens: int = 2048, rates=RATES):
    card = load_card("gemma-4-26b-a4b")
    prof = replace(load_profile("h200-roofline"), ap_gemm_tflops=rates)
    tok = np.zeros((card.moe_layers, card.experts), dtype=np.int64)
    tok[0] = tokens * card.top_k // card.experts
    return card, prof, tok, np.full(card.moe_layers * card.experts * 2, bits)


def test_a_low_bit_layer_of_few_rows_an_expert_is_priced_as_the_fused_gemm():
    card, prof, tok, q = _gemma(3)   # 2,048 tokens x 8 over 128 experts: 128 rows each, one layer
    cm, plain = CostModel(card, prof), CostModel(card, replace(prof, ap_gemm_tflops={}))
    h, i = card.hidden, card.expert_intermediate
    times = cm.fused_gemm_times(q, tok)
    gemm = card.experts * 128 * 2 * 3 * h * i / 300e12   # one whole 128-row tile an expert
    assert times[0] == pytest.approx(gemm, rel=1e-12) and np.isnan(times[1:]).all()
    # the layer's time: the fused GEMM in place of the dequantize path's, the chunks rotating no rows
    dispatch = cm._dispatch_time(tok, 2048, cm.prefill_chunks > 1, ~np.isnan(times))
    assert cm.moe(q, tok, 2048) == pytest.approx(gemm + dispatch + cm.prefill_layer_overhead, rel=1e-9)
    assert dispatch < plain._dispatch_time(tok, 2048, plain.prefill_chunks > 1)   # chunked: a rotation fewer
    assert cm.moe(q, tok, 2048) != plain.moe(q, tok, 2048)
    # a tile of 64 rows where the experts average fewer than 64, at the 4-bit rate where a block is at 4 bits
    tok[0] = 40
    q4 = q.copy()
    q4[1] = 4   # expert 0's down block
    rate = np.full((card.experts, 2), 200e12)
    rate[0, 1] = 160e12
    want = (64 * 2 * np.array([2 * i * h, h * i])[None, :] / rate).sum()   # 40 rows: one tile of 64
    assert cm.fused_gemm_times(q4, tok)[0] == pytest.approx(want, rel=1e-12)
    tok[0, :3] = (65, 128, 129)   # two tiles, two, three (tiles of 64: the experts average fewer than 64 rows)
    assert cm.fused_gemm_times(q, tok)[0] - cm.fused_gemm_times(q, tok * 0 + 40)[0] == pytest.approx(
        (64 + 64 + 128) * 2 * 3 * h * i / 200e12, rel=1e-9)


@pytest.mark.parametrize("case", ["8 bits", "one block at 5", "too many rows", "no rate", "no rate at the tile"])
def test_other_layers_keep_the_dequantize_path(case):
    bits = 8 if case == "8 bits" else 3
    rates = {} if case == "no rate" else {3: {64: 200.0}} if case == "no rate at the tile" else RATES
    card, prof, tok, q = _gemma(bits, rates=rates)
    tok[0] = 129 if case == "too many rows" else 100
    if case == "one block at 5":
        q[5] = 5
    cm, plain = CostModel(card, prof), CostModel(card, replace(prof, ap_gemm_tflops={}))
    assert np.isnan(cm.fused_gemm_times(q, tok)).all()
    assert cm.moe(q, tok, 2048) == plain.moe(q, tok, 2048)


def _kernel_rows(card_name: str, tflops: float, tile: int) -> list[BenchRow]:
    """Rows whose AP GEMM kernels took exactly the FLOPs the model charges at `tflops`."""
    card = card_for(card_name)
    rows = []
    for t in (256, 512, 1024):
        r = BenchRow(card_name, t, 3, card.experts, 1.0, ap_gemm_kernel_ms=1.0, ap_gemm_tile_rows=tile)
        rows.append(replace(r, ap_gemm_kernel_ms=gemm_flops(card, r) / (tflops * 1e12) * 1e3))
    return rows


def test_fit_measures_the_rate_and_models_those_rows_with_it():
    base = replace(load_profile("h100-measured"), prefill_layer_overhead_us=0.0, prefill_chunk_overhead_us=0.0,
                   ap_gemm_tflops={})
    rows = _kernel_rows("qwen3-moe-30b-a3b", 280.0, 64) + _kernel_rows("gemma-4-26b-a4b", 320.0, 128)
    card = card_for("gemma-4-26b-a4b")
    assert gemm_flops(card, rows[3]) == pytest.approx(card.experts * 128 * 2 * 3 * 2816 * 704)   # a tile each
    rep = fit(rows, base)
    assert rep["fit"]["ap_gemm_tflops"] == {"3": {"64": pytest.approx(280.0), "128": pytest.approx(320.0)}}
    assert rep["fit"]["ap_gemm_rows"] == 6
    prof = fitted_profile(base, rep, "test")
    assert prof.ap_gemm_tflops == {3: {64: pytest.approx(280.0), 128: pytest.approx(320.0)}}
    assert fitted_profile(replace(base, ap_gemm_tflops={4: {64: 1.0}}), rep, "t").ap_gemm_tflops[4] == {64: 1.0}


def test_fit_gives_the_fused_layers_a_fixed_cost_of_their_own():
    """Rows the model prices as the fused GEMM (3 bits, few rows an expert) whose gaps are 0.1 ms, and dequantizing
    rows (8 bits) whose gaps are 0.3 ms: each path gets back its own fixed cost, and every row is then exact."""
    base = replace(load_profile("h100-measured"), prefill_layer_overhead_us=0.0, prefill_chunk_overhead_us=0.0,
                   ap_gemm_layer_overhead_us=0.0, ap_gemm_tflops={3: {64: 200.0, 128: 300.0}})
    rows = []
    for m in ("qwen3-moe-30b-a3b", "olmoe-1b-7b"):
        card = card_for(m)
        for t, bits in ((256, 3), (512, 3), (1024, 3), (256, 8), (512, 8), (1024, 8)):
            r = BenchRow(m, t, bits, card.experts, 1.0)
            rows.append(replace(r, measured_ms=layer_ms(card, base, r) + (0.1 if bits == 3 else 0.3)))
    rep = fit(rows, base)
    assert rep["fit"]["ap_gemm_layer_overhead_us"] == pytest.approx(100.0, abs=1e-6)
    assert rep["fit"]["prefill_layer_overhead_us"] == pytest.approx(300.0, abs=1e-6)
    assert [r["chunks"] == 0 for r in rep["rows"]] == [r["bits"] == 3 for r in rep["rows"]]
    assert all(r["fitted_ratio"] == pytest.approx(1.0) for r in rep["rows"])
    assert fitted_profile(base, rep, "t").ap_gemm_layer_overhead_us == pytest.approx(100.0)


def test_bench_rows_give_the_kernel_time_or_nothing_valid():
    row = {"model": "olmoe-1b-7b", "tokens": 512, "bits": 3, "active_experts": 64, "padded_ms": 1.0}
    (r,) = parse_rows({"rows": [{**row, "ap_gemm_kernel_ms": 0.4, "ap_gemm_tile_rows": 128}]}, "bench")
    assert (r.ap_gemm_kernel_ms, r.ap_gemm_tile_rows) == (0.4, 128)
    assert parse_rows({"rows": [row]}, "bench")[0].ap_gemm_kernel_ms is None
    for bad in ({"ap_gemm_kernel_ms": 0.0, "ap_gemm_tile_rows": 128}, {"ap_gemm_kernel_ms": 0.4},
                {"ap_gemm_kernel_ms": "fast", "ap_gemm_tile_rows": 128}):
        with pytest.raises(UserError, match="ap_gemm_kernel_ms"):
            parse_rows({"rows": [{**row, **bad}]}, "bench")
