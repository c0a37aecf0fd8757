"""The prefill MoE layer's fixed cost: the profile field, the cost model's use of it, and `pwsim prefill-fit`."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from pwsim.cli import main
from pwsim.cost_model import BatchShape, CostModel, prefill_chunks
from pwsim.prefill_fit import (BenchRow, card_for, expert_counts, fit, fitted_profile, layer_ms, parse_rows,
                               random_counts)
from traces.hardware import HardwareProfileError, from_json, load_profile
from traces.model_card import load_card

OVERHEAD_US = 250.0


@pytest.fixture(scope="module")
def qwen():
    return load_card("Qwen1.5-MoE-A2.7B"), replace(load_profile("h200-roofline"), prefill_layer_overhead_us=OVERHEAD_US)


def _routing(card, layers: int, per_expert: int) -> np.ndarray:
    """`per_expert` tokens on 4 experts of the first `layers` MoE layers, none elsewhere."""
    et = np.zeros((card.moe_layers, card.experts))
    et[:layers, :4] = per_expert
    return et


def test_dequantize_path_pays_the_overhead_once_per_active_layer(qwen):
    card, prof = qwen
    plain, paid = CostModel(card, replace(prof, prefill_layer_overhead_us=0.0)), CostModel(card, prof)
    q = np.full(card.moe_layers * card.experts * 2, 4)
    for layers in (1, 3, card.moe_layers):
        et = _routing(card, layers, 256)  # 256 tokens > ap_fused_max_tokens: the dequantize path
        assert paid.moe(q, et, 256) - plain.moe(q, et, 256) == pytest.approx(layers * OVERHEAD_US * 1e-6, rel=1e-9)
    # in an iteration the cost is the moe operator's, not the per-iteration overhead's
    batch = BatchShape.of([256], [0], 1)
    a, b = plain.iteration(batch, q, _routing(card, 3, 256)), paid.iteration(batch, q, _routing(card, 3, 256))
    assert b.moe - a.moe == pytest.approx(3 * OVERHEAD_US * 1e-6) and b.overhead == a.overhead
    assert paid.moe(q, np.zeros((card.moe_layers, card.experts)), 256) == 0.0


def test_fused_path_and_fp16_experts_pay_nothing(qwen):
    card, prof = qwen
    q = np.full(card.moe_layers * card.experts * 2, 4)
    zero = replace(prof, prefill_layer_overhead_us=0.0)
    et = _routing(card, 5, 16)
    fused = prof.ap_fused_max_tokens
    assert CostModel(card, prof).moe(q, et, fused) == CostModel(card, zero).moe(q, et, fused)
    et = _routing(card, 5, 256)
    assert CostModel(card, prof, True).moe(q, et, 256) == CostModel(card, zero, True).moe(q, et, 256)


def test_profile_without_the_field_loads_with_zero_and_a_negative_one_is_rejected(tmp_path):
    data = load_profile("h200-roofline").to_json()
    assert "prefill_layer_overhead_us" in data
    data.pop("prefill_layer_overhead_us")
    assert from_json(data).prefill_layer_overhead_us == 0.0
    # the GPU profile carries the eager prefill layer's host cost; the demo-runtime profile, fitted to a runtime that
    # captures its mixed steps (piecewise graphs), does not pay it
    assert load_profile("h200-measured").prefill_layer_overhead_us > 0
    assert load_profile("h200-demo-runtime").prefill_layer_overhead_us == 0.0
    p = replace(from_json(data), prefill_layer_overhead_us=12.5)
    assert load_profile(p.save(tmp_path / "p.json")).prefill_layer_overhead_us == 12.5
    with pytest.raises(HardwareProfileError, match="prefill_layer_overhead_us"):
        from_json({**data, "prefill_layer_overhead_us": -1.0})
    data.pop("prefill_chunk_overhead_us")
    assert from_json(data).prefill_chunk_overhead_us == 0.0
    with pytest.raises(HardwareProfileError, match="prefill_chunk_overhead_us"):
        from_json({**data, "prefill_chunk_overhead_us": -1.0})


@pytest.mark.parametrize("card_name,chunk,want", [("Qwen3-30B-A3B", 1 << 30, 2), ("Qwen3-30B-A3B", 2 << 30, 1),
                                                  ("Mixtral-8x7B-v0.1", 1 << 30, 3), ("Qwen1.5-MoE-A2.7B", 1 << 30, 1),
                                                  ("Qwen1.5-MoE-A2.7B", 256 << 20, 4)])
def test_each_chunk_of_experts_after_the_first_pays_the_chunk_overhead(card_name, chunk, want):
    """A prefill layer takes ceil(experts / those `chunk` bytes of 16-bit weights hold) chunks (Qwen3-MoE: 128
    experts of 9.4 MB, 114 to a GiB; Mixtral: 8 of 352 MB, 3 to a GiB), each after the first at the profile's
    prefill_chunk_overhead_us; the fused path pays none."""
    card = load_card(card_name)
    prof = replace(load_profile("h200-roofline"), prefill_layer_overhead_us=100.0, prefill_chunk_overhead_us=40.0)
    assert prefill_chunks(card, chunk) == want
    q = np.full(card.moe_layers * card.experts * 2, 4)
    et = _routing(card, 3, 256)
    plain = CostModel(card, replace(prof, prefill_chunk_overhead_us=0.0), prefill_chunk_bytes=chunk)
    paid = CostModel(card, prof, prefill_chunk_bytes=chunk)
    assert paid.moe(q, et, 256) - plain.moe(q, et, 256) == pytest.approx(3 * (want - 1) * 40e-6, abs=1e-12)
    fused = _routing(card, 3, 16)
    assert paid.moe(q, fused, prof.ap_fused_max_tokens) == plain.moe(q, fused, prof.ap_fused_max_tokens)


def test_pwsim_run_prefill_chunk_reaches_the_cost_model(tmp_path, capsys):
    """`pwsim run --prefill-chunk`: Qwen1.5-MoE's experts (60 of 17.3 MB) in one chunk at 1 GiB, four at 256 MiB. A
    profile whose chunks cost 1 ms each makes the same prompt 3 ms a prefill layer longer there (24 layers) than one
    whose chunks cost nothing, and nothing longer in one chunk; the chunks' extra passes over the rows cost anyway."""
    makespan = {}
    for chunk_us in (0.0, 1000.0):
        prof = replace(load_profile("h200-measured"), prefill_chunk_overhead_us=chunk_us)
        hw = prof.save(tmp_path / f"hw{chunk_us:.0f}.json")
        for chunk in ("1GiB", "256MiB"):
            out = tmp_path / f"{chunk}-{chunk_us:.0f}"
            assert main(["run", "--model", "Qwen1.5-MoE-A2.7B", "--calibration", "synthetic", "--trace", "synthetic",
                         "--quality-fit", "none", "--requests", "1", "--prompt-dist", "fixed:480", "--output-dist",
                         "fixed:1", "--budget", "20GiB", "--hardware", str(hw), "--prefill-chunk", chunk,
                         "--no-plots", "--no-progress", "--out", str(out)]) == 0
            assert f"--prefill-chunk {chunk}" in capsys.readouterr().out   # the command that reproduces it
            makespan[chunk, chunk_us] = json.loads((out / "summary.json").read_text())["makespan_s"]
    assert makespan["256MiB", 1000.0] - makespan["256MiB", 0.0] == pytest.approx(24 * 3e-3, rel=1e-6)
    assert makespan["1GiB", 1000.0] == makespan["1GiB", 0.0] < makespan["256MiB", 0.0]


def test_the_dispatch_moves_each_routed_row_s_activations():
    """Beside the experts' weights a prefill layer moves its routed rows' activations (gathered inputs, the GEMMs'
    inputs and outputs, the activation, the combine): 5H + 6I 16-bit elements a row in one chunk, plus in more each
    row's scatter and the rotation of the rows of the chunks after the first; and each token's output. The fp16
    experts pay it too; nothing else about the layer depends on the chunking (h200-measured prices a chunk at 0 us)."""
    card, prof = load_card("gemma-4-26b-a4b"), load_profile("h200-measured")
    assert prof.prefill_chunk_overhead_us == 0.0
    h, i, tokens = card.hidden, card.expert_intermediate, 2048
    tok = np.zeros((card.moe_layers, card.experts), dtype=np.int64)
    tok[0] = tokens * card.top_k // card.experts   # 16,384 rows over 128 experts, one layer
    rows, bw = tokens * card.top_k, prof.bandwidth("moe")
    one = 2 * (rows * (5 * h + 6 * i) + tokens * h) / bw
    first = (1 << 30) // (3 * h * i * 2)            # the experts of the first 1 GiB chunk (90 of 128)
    later = (card.experts - first) * tokens * card.top_k // card.experts
    two = 2 * (rows * (5 * h + 6 * i) + 2 * h * (rows + later) + tokens * h) / bw
    whole, halves = CostModel(card, prof, prefill_chunk_bytes=4 << 30), CostModel(card, prof)
    assert (whole.prefill_chunks, halves.prefill_chunks, first) == (1, 2, 90)
    assert whole._dispatch_time(tok, tokens, False) == pytest.approx(one, rel=1e-12)
    assert halves._dispatch_time(tok, tokens, True) == pytest.approx(two, rel=1e-12)
    q = np.full(card.moe_layers * card.experts * 2, 3)
    assert halves.moe(q, tok, tokens) - whole.moe(q, tok, tokens) == pytest.approx(two - one, rel=1e-9)
    fp16 = CostModel(card, prof, fp16_experts=True)
    bare = sum(max(2 * n / bw, 2 * (tokens * card.top_k // card.experts) * n / prof.flops_per_s)
               for n in (2 * i * h, h * i)) * card.experts
    assert fp16.moe(q, tok, tokens) == pytest.approx(bare + one, rel=1e-9)


def test_the_cost_model_chunks_a_layer_as_the_runtime_does():
    """pwsim's chunk count is the runtime's (`prefill_group_limits`, what `bench prefill` records as `chunks`) for
    every bench shape and a few chunk sizes."""
    from pwruntime.prefill_layer import prefill_group_limits
    from pwruntime.kernels.bench import model_shape
    from pwsim.prefill_fit import BENCH_CARDS
    for name in BENCH_CARDS:
        shape = model_shape(name)
        for chunk in (64 << 20, 1 << 30, 2 << 30, 8 << 30):
            runtime = -(-shape.num_experts // prefill_group_limits(shape, 2, chunk)[0])
            assert prefill_chunks(card_for(name), chunk) == runtime, (name, chunk)


def test_expert_counts_split_the_routed_slots_evenly():
    c = expert_counts(130, 4, 60)
    assert c.sum() == 520 and c.max() - c.min() == 1 and list(c[:40]) == [9] * 40 and list(c[40:]) == [8] * 20
    r = random_counts(2048, 8, 128)   # as a uniform router spreads them: about 128 an expert, some above a tile
    assert r.sum() == 2048 * 8 and r.min() >= 1 and (r > 128).sum() > 20 and r.max() < 200
    assert np.array_equal(r, random_counts(2048, 8, 128))


def test_the_measurement_is_the_runtime_path_where_the_bench_times_several():
    row = {"model": "mixtral-8x7b", "tokens": 256, "bits": 4, "active_experts": 8, "padded_ms": 2.5}
    rows = parse_rows({"rows": [row, {**row, "runtime_ms": 2.0}, {**row, "runtime_ms": None}]}, "bench")
    assert [r.measured_ms for r in rows] == [2.5, 2.0, 2.5]
    # a row's chunk size: as recorded, else the runtime's default (a bench older than the field); never a bad one
    rows = parse_rows({"rows": [row, {**row, "prefill_chunk_bytes": 2 << 30}]}, "bench")
    assert [r.chunk_bytes for r in rows] == [1 << 30, 2 << 30]
    from traces.clikit import UserError
    for bad in (0, "1GiB", 1.5, True):
        with pytest.raises(UserError, match="row 0 has a bad value.*prefill_chunk_bytes"):
            parse_rows({"rows": [{**row, "prefill_chunk_bytes": bad}]}, "bench")
    for key in ("tokens", "active_experts"):
        with pytest.raises(UserError, match="row 0 has a bad value"):
            parse_rows({"rows": [{**row, key: 0}]}, "bench")
    for not_a_bench in ([row], {"rows": {"0": row}}):
        with pytest.raises(UserError, match="not a prefill bench"):
            parse_rows(not_a_bench, "bench")
    with pytest.raises(UserError, match="row 0 has a bad value"):
        parse_rows({"rows": [{**row, "padded_ms": 0.0}]}, "bench")
    timed = {**row, "ap_gemm_kernel_ms": 0.5, "ap_gemm_tile_rows": 64}
    assert parse_rows({"rows": [timed]}, "bench")[0].ap_gemm_kernel_ms == 0.5
    for bad in ({"ap_gemm_kernel_ms": True}, {"ap_gemm_kernel_ms": 0.0}, {"ap_gemm_kernel_ms": float("nan")},
                {"ap_gemm_tile_rows": 0}, {"ap_gemm_tile_rows": 1.5}):
        with pytest.raises(UserError, match="bad ap_gemm_kernel_ms or ap_gemm_tile_rows"):
            parse_rows({"rows": [{**timed, **bad}]}, "bench")


def test_a_row_at_the_fused_path_s_largest_prompt_is_refused_and_ratios_are_summarised():
    from pwsim.prefill_fit import ratio_summary
    from traces.clikit import UserError
    profile = load_profile("h200-measured")
    row = BenchRow("olmoe-1b-7b", profile.ap_fused_max_tokens, 4, 60, 0.5)
    with pytest.raises(UserError, match="takes the fused path"):
        layer_ms(card_for(row.model), profile, row)
    assert ratio_summary([3.0, 1.0, 2.0]) == {"min": 1.0, "median": 2.0, "max": 3.0}
    assert fit(_rows(profile), profile)["fit"]["ap_gemm_rows"] == 0


def _rows(profile, models=("qwen1.5-moe-a2.7b", "mixtral-8x7b", "olmoe-1b-7b", "qwen3-moe-30b-a3b"),
          extra_ms=(0.0,) * 8) -> list[BenchRow]:
    """Rows whose "measured" time is the model's own on `profile` plus `extra_ms` (cycled)."""
    rows, k = [], 0
    for m in models:
        card = card_for(m)
        for t in (256, 512):
            active = min(card.experts, 40)
            r = BenchRow(m, t, 3 + k % 6, active, 1.0)
            rows.append(replace(r, measured_ms=layer_ms(card, profile, r) + extra_ms[k % len(extra_ms)]))
            k += 1
    return rows


def test_fit_recovers_a_known_constant_robustly_and_refits_to_itself():
    base = load_profile("h200-measured")
    zero = replace(base, prefill_layer_overhead_us=0.0)
    gaps = (0.3, 0.3, 0.3, 0.3, 0.3, 0.3, 5.0, 0.0)  # 0.3 ms a layer, one slow outlier, one row without it
    rep = fit(_rows(zero, extra_ms=gaps), zero)
    assert rep["fit"]["prefill_layer_overhead_us"] == pytest.approx(300.0, abs=1e-6)
    assert rep["ratios"]["before"]["median"] < 1 and rep["ratios"]["after"]["median"] == pytest.approx(1.0)
    assert [r["fitted_ms"] - r["modeled_ms"] for r in rep["rows"]] == pytest.approx([0.3] * 8)
    # fitting a profile that already carries some overhead lands on the same value
    again = fit(_rows(zero, extra_ms=gaps), replace(base, prefill_layer_overhead_us=120.0))
    assert again["fit"]["previous_us"] == 120.0
    assert again["fit"]["prefill_layer_overhead_us"] == pytest.approx(300.0, abs=1e-6)
    # a model slower than the runtime: clipped at 0
    faster = [replace(r, measured_ms=r.measured_ms * 0.5) for r in _rows(zero)]
    assert fit(faster, zero)["fit"]["prefill_layer_overhead_us"] == 0.0
    # rows the runtime ran on the fused kernel (at most ap_fused_max_tokens) are left out and counted
    fused_row = BenchRow("olmoe-1b-7b", zero.ap_fused_max_tokens, 4, 60, 0.5)
    with_fused = fit([fused_row, *_rows(zero, extra_ms=gaps)], zero)
    assert with_fused["skipped_fused_rows"] == 1 and len(with_fused["rows"]) == 8
    assert with_fused["fit"] == rep["fit"]


def test_fit_takes_the_chunk_cost_from_rows_alike_but_for_their_chunk_size():
    """Rows of two chunk sizes whose gaps are 0.3 ms a layer and 0.2 ms a chunk after the first (one outlier) give
    back both costs; rows of one chunk size keep the profile's chunk cost and fit the layer's alone."""
    base = replace(load_profile("h200-measured"), prefill_layer_overhead_us=0.0, prefill_chunk_overhead_us=0.0)
    rows = []
    for m in ("qwen3-moe-30b-a3b", "mixtral-8x7b", "gemma-4-26b-a4b"):
        card = card_for(m)
        for t in (256, 1024):
            for chunk in (256 << 20, 1 << 30, 4 << 30):
                r = BenchRow(m, t, 3, card.experts, 1.0, chunk)
                extra = 0.3 + 0.2 * (prefill_chunks(card, chunk) - 1) + (4.0 if (m, t, chunk) == (m, 256, 1 << 30) and
                                                                          m == "mixtral-8x7b" else 0.0)
                rows.append(replace(r, measured_ms=layer_ms(card, base, r) + extra))
    rep = fit(rows, base)
    assert rep["fit"]["prefill_chunk_overhead_us"] == pytest.approx(200.0, abs=1e-6)
    assert rep["fit"]["prefill_layer_overhead_us"] == pytest.approx(300.0, abs=1e-6)
    assert rep["fit"]["chunk_pairs"] == 18 and {r["chunks"] for r in rep["rows"]} >= {1, 2, 3}
    assert sorted(r["fitted_ratio"] for r in rep["rows"])[-2] == pytest.approx(1.0)   # all but the outlier exact
    again = fit(rows, fitted_profile(base, rep, "test"))
    assert again["fit"]["prefill_chunk_overhead_us"] == pytest.approx(200.0, abs=1e-6)
    assert again["fit"]["prefill_layer_overhead_us"] == pytest.approx(300.0, abs=1e-6)
    one_size = [r for r in rows if r.chunk_bytes == 1 << 30]
    kept = fit(one_size, replace(base, prefill_chunk_overhead_us=50.0))["fit"]
    assert kept["chunk_pairs"] == 0 and kept["prefill_chunk_overhead_us"] == 50.0


def _bench(path, rows: list[BenchRow], device: str = "test"):
    data = {"device": device, "command": f"synthetic {path.name}", "rows": [
        {"model": r.model, "tokens": r.tokens, "bits": r.bits, "active_experts": r.active_experts,
         "padded_groups": 1, "padded_ms": r.measured_ms, "prefill_chunk_bytes": r.chunk_bytes} for r in rows]}
    path.write_text(json.dumps(data))
    return path


def test_cli_writes_the_report_the_plot_and_the_fitted_profile(tmp_path, capsys):
    prof = replace(load_profile("h200-roofline"), prefill_layer_overhead_us=0.0)
    bench = _bench(tmp_path / "bench.json", _rows(prof, extra_ms=(0.45,)))
    out, fitted = tmp_path / "out", tmp_path / "fitted.json"
    assert main(["prefill-fit", "--bench", str(bench), "--hardware", "h200-roofline", "--out", str(out),
                 "--fit-profile", str(fitted)]) == 0
    text = capsys.readouterr().out
    assert "reproduce: pwsim prefill-fit --bench" in text and "0.0 -> 450.0" in text
    report = json.loads((out / "prefill_fit.json").read_text())
    assert len(report["rows"]) == 8 and report["fit"]["prefill_layer_overhead_us"] == pytest.approx(450.0)
    assert (out / "prefill_fit.png").stat().st_size > 10_000
    p = load_profile(fitted)
    assert p.prefill_layer_overhead_us == pytest.approx(450.0) and "pwsim prefill-fit" in p.metadata["prefill_fit"]
    assert replace(p, prefill_layer_overhead_us=0.0, metadata=prof.metadata) == prof  # nothing else moved
    assert main(["prefill-fit", "--bench", str(bench), "--hardware", "h200-roofline", "--out", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["fit"] == report["fit"]


def test_cli_fits_the_chunk_cost_from_two_benches_of_one_device(tmp_path, capsys):
    """Two bench runs (one --prefill-chunk each) fit together; benches of two devices are refused."""
    prof = replace(load_profile("h200-roofline"), prefill_layer_overhead_us=0.0, prefill_chunk_overhead_us=0.0)
    paths = []
    for chunk in (256 << 20, 4 << 30):
        rows = []
        for m in ("qwen3-moe-30b-a3b", "gemma-4-26b-a4b"):
            r = BenchRow(m, 512, 3, 128, 1.0, chunk)
            rows.append(replace(r, measured_ms=layer_ms(card_for(m), prof, r) + 0.4
                                + 0.1 * (prefill_chunks(card_for(m), chunk) - 1)))
        paths.append(_bench(tmp_path / f"bench{chunk}.json", rows))
    out = tmp_path / "out"
    argv = ["prefill-fit", "--bench", str(paths[0]), "--bench", str(paths[1]), "--hardware", "h200-roofline"]
    assert main([*argv, "--out", str(out), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["fit"]["prefill_chunk_overhead_us"] == pytest.approx(100.0) and report["fit"]["chunk_pairs"] == 2
    assert report["fit"]["prefill_layer_overhead_us"] == pytest.approx(400.0)
    assert report["inputs"]["bench_command"] == [f"synthetic {p.name}" for p in paths]
    assert report["command"].count("--bench") == 2
    other = _bench(tmp_path / "other.json", [BenchRow("qwen3-moe-30b-a3b", 512, 3, 128, 1.0)], device="NVIDIA B200")
    assert main([*argv[:3], "--bench", str(other), "--out", str(tmp_path / "mixed")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "different devices (NVIDIA B200, test)" in err[0] and not (tmp_path / "mixed").exists()


def test_bundled_h200_measured_carries_the_fit_of_the_bundled_bench(tmp_path, capsys):
    assert main(["prefill-fit", "--out", str(tmp_path), "--json"]) == 0  # defaults: the bundled bench, h200-measured
    report = json.loads(capsys.readouterr().out)
    assert report["fit"]["previous_us"] == load_profile("h200-measured").prefill_layer_overhead_us > 0
    assert report["fit"]["prefill_layer_overhead_us"] == pytest.approx(report["fit"]["previous_us"], abs=0.1)
    assert report["ratios"]["after"]["min"] > 0.75 and report["ratios"]["after"]["max"] < 1.25


def test_bundled_h100_measured_carries_the_fit_of_its_benches(tmp_path, capsys):
    """The H100 profile (`bench kernels` on an H100) carries both prefill costs and the fused AP GEMM's rates fitted
    from the bundled H100 benches (3 bits at 1 and 4 GiB chunks: pairs of rows alike but for their chunk count; 4
    bits at 1 GiB), and fits every row within 0.85-1.2."""
    assets = Path(__file__).resolve().parents[1] / "pwruntime" / "assets"
    benches = [a for name in ("1GiB", "4GiB", "4bit")
               for a in ("--bench", str(assets / f"prefill_bench_h100_{name}.json"))]
    assert main(["prefill-fit", *benches, "--hardware", "h100-measured", "--out", str(tmp_path), "--json"]) == 0
    report, prof = json.loads(capsys.readouterr().out), load_profile("h100-measured")
    assert prof.device.startswith("NVIDIA H100") and report["fit"]["chunk_pairs"] > 0
    assert report["fit"]["prefill_layer_overhead_us"] == pytest.approx(prof.prefill_layer_overhead_us, abs=0.1)
    assert report["fit"]["prefill_chunk_overhead_us"] == pytest.approx(prof.prefill_chunk_overhead_us, abs=0.1)
    assert report["fit"]["ap_gemm_layer_overhead_us"] == pytest.approx(prof.ap_gemm_layer_overhead_us, abs=0.1)
    assert prof.prefill_chunk_overhead_us > 0 and report["fit"]["ap_gemm_rows"] > 0
    assert 0 < prof.ap_gemm_layer_overhead_us < prof.prefill_layer_overhead_us   # it launches less
    assert report["fit"]["ap_gemm_tflops"] == {b: {t: pytest.approx(v, rel=1e-9) for t, v in tiles.items()}
                                               for b, tiles in prof.to_json()["ap_gemm_tflops"].items()}
    assert set(prof.ap_gemm_tflops) == {3, 4} and all(set(t) == {64, 128} for t in prof.ap_gemm_tflops.values())
    assert report["ratios"]["after"]["min"] > 0.85 and report["ratios"]["after"]["max"] < 1.2


def _misuse(tmp_path):
    prof = load_profile("h200-measured")
    good = {"model": "mixtral-8x7b", "tokens": 256, "bits": 4, "active_experts": 8, "padded_ms": 2.3}
    (tmp_path / "nojson.json").write_text("{ not json")
    for name, rows in (("missing", [{k: v for k, v in good.items() if k != "padded_ms"}]),
                       ("unknown", [{**good, "model": "gpt-5-moe"}]), ("empty", []),
                       ("fused", [{**good, "tokens": prof.ap_fused_max_tokens}]),
                       ("badbits", [{**good, "bits": 2}])):
        (tmp_path / f"{name}.json").write_text(json.dumps({"rows": rows}))
    return [
        (["--bench", str(tmp_path / "absent.json")], "not found"),
        (["--bench", str(tmp_path / "nojson.json")], "not a JSON file"),
        (["--bench", str(tmp_path / "missing.json")], "row 0 lacks"),
        (["--bench", str(tmp_path / "unknown.json")], "'gpt-5-moe' has no model card"),
        (["--bench", str(tmp_path / "empty.json")], "no rows"),
        (["--bench", str(tmp_path / "fused.json")], "fused path"),
        (["--bench", str(tmp_path / "badbits.json")], "bad value"),
        (["--hardware", "no-such-gpu"], "not found"),
    ]


def test_out_that_is_a_file_is_one_line_exit_2_and_writes_nothing(tmp_path, capsys):
    out, fitted = tmp_path / "out", tmp_path / "fitted.json"
    out.write_text("keep me")
    assert main(["prefill-fit", "--out", str(out), "--fit-profile", str(fitted)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is a file; give a directory" in err[0], err
    assert out.read_text() == "keep me" and not fitted.exists()


@pytest.mark.parametrize("case", range(8))
def test_misuse_is_one_line_exit_2_and_writes_nothing(tmp_path, capsys, case):
    argv, needle = _misuse(tmp_path)[case]
    out, fitted = tmp_path / "out", tmp_path / "fitted.json"
    assert main(["prefill-fit", *argv, "--out", str(out), "--fit-profile", str(fitted)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("pwsim prefill-fit: error:") and needle in err[0], err
    assert not out.exists() and not fitted.exists()


def test_a_row_with_more_active_experts_than_routed_slots_is_refused():
    """5 tokens of OLMoE (top-8) route 40 slots: 60 active experts cannot be, though OLMoE has 64."""
    from traces.clikit import UserError
    prof = replace(load_profile("h200-roofline"), ap_fused_max_tokens=4, ap_fused_launch_tokens=4)
    card = card_for("olmoe-1b-7b")
    assert layer_ms(card, prof, BenchRow("olmoe-1b-7b", 5, 4, 40, 1.0)) > 0
    with pytest.raises(UserError, match="more than"):
        layer_ms(card, prof, BenchRow("olmoe-1b-7b", 5, 4, 60, 1.0))


def test_every_shape_the_prefill_bench_takes_prices_as_its_own_card():
    """`pwruntime bench prefill --models` names shapes (MODEL_SHAPES); `pwsim prefill-fit` prices each row on the card
    it maps the name to, which must have that shape, or the fit would compare one model against another."""
    from pwruntime.kernels.bench import MODEL_SHAPES
    for name, (hidden, intermediate, experts, top_k) in MODEL_SHAPES.items():
        card = card_for(name)
        assert (card.hidden, card.expert_intermediate, card.experts, card.top_k) == (hidden, intermediate, experts,
                                                                                      top_k), name
