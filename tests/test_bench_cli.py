"""`pwruntime bench kernels|prefill|prefix-cache` off the GPU: figures and tables of saved results, and the errors; on
the GPU the prefill bench's two paths agree; the prefix-cache bench wherever it runs (CPU in CI)."""
from __future__ import annotations

import json
import sys

import numpy as np
import pytest
import torch

from pwruntime.cli import main
from traces.clikit import UserError


def _result() -> dict:
    """A small result in the shape `pwruntime bench kernels --out` writes."""
    single = [{"out": 64, "in": 128, "tokens": t, "bits": b, "ap_us": 10.0 + b + t, "fp16_us": 20.0,
               "fp16_same_bytes_us": 5.0 + b} for t in (1, 8) for b in (3, 4, 8)]
    moe = [{"model": m, "tokens": t, "bits": b, "vs_roofline": 2.0 + t / 8, "roofline_us": 4.0,
            "fp16_same_bytes_us": 6.0} for m in ("olmoe-1b-7b", "mixtral-8x7b") for t in (1, 16) for b in (3, "mixed")]
    return {"device": "test GPU", "single_block": single, "moe": moe}


def test_plot_from_a_saved_result_writes_a_png(tmp_path, capsys):
    src = tmp_path / "bench.json"
    src.write_text(json.dumps(_result()))
    assert main(["bench", "kernels", "--plot-from", str(src)]) == 0
    png = tmp_path / "bench.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert str(png) in capsys.readouterr().out


def test_the_moe_panel_draws_every_model_of_the_run_in_its_order(tmp_path, monkeypatch):
    """Gemma 4's rows (and a shape without a label, named as it is) get their bars beside the four models'."""
    from pwruntime.kernels import plots
    figures = []
    monkeypatch.setattr(plots, "write_png", lambda fig, path: figures.append(fig) or path)
    res = _result()
    res["moe"] = [{**r, "model": m} for m in ("olmoe-1b-7b", "gemma-4-26b-a4b", "tiny-shape") for r in res["moe"][:4]]
    plots.plot_bench(res, tmp_path / "bench.png")
    right = figures[0].axes[1]
    assert [t.get_text() for t in right.get_xticklabels()] == ["OLMoE", "Gemma 4", "tiny-shape"]
    assert len(right.patches) == 3 * 2   # a bar a model and token count at 3 bits


def test_plot_from_a_wrong_file_is_one_clear_error(tmp_path, capsys):
    src = tmp_path / "bench.json"
    src.write_text(json.dumps({"single_block": [{"tokens": 1}]}))   # rows without their fields
    assert main(["bench", "kernels", "--plot-from", str(src)]) == 2
    err = capsys.readouterr().err
    assert "not a `pwruntime bench kernels --out` result" in err and "Traceback" not in err
    assert not (tmp_path / "bench.png").exists()
    assert main(["bench", "kernels", "--plot-from", str(tmp_path / "missing.json")]) == 2


def test_kernel_tables_print_the_same_bytes_dense_gemvs_where_a_run_has_them(capsys):
    from pwruntime.kernels.bench_report import print_tables
    row = {"tokens": 1, "bits": 3, "ap_us": 10.5, "ap_gbps": 2100.0, "fp16_us": 31.4, "speedup_vs_fp16": 2.99}
    res = {"device": "test GPU", "fp16_gemm_tflops": 700.0,
           "copy": {"h2d_pinned_gbps": 55.0, "d2h_pinned_gbps": 55.0, "d2d_copy_gbps": 4000.0},
           "fp16_gemv_gbps": 3700.0, "single_block": [{**row, "fp16_same_bytes_us": 7.25}, {**row, "bits": 4}]}
    layer = {"model": "olmoe-1b-7b", "tokens": 1, "bits": 3, "active_experts": 8, "ap_us": 17.0, "roofline_us": 5.0,
             "vs_roofline": 3.4, "ap_gbps": 1100.0, "fp16_loop_us": 190.0, "fp16_gathered_bmm_us": None}
    res["moe"] = [{**layer, "fp16_same_bytes_us": 12.5}, {**layer, "bits": 4}]
    print_tables(res)
    out = capsys.readouterr().out.splitlines()
    lines = [ln for ln in out if ln.strip().startswith("1 ")]
    assert lines[0].split()[-1] == "7.25" and lines[1].split()[-1] == "-"   # the second: a run before session 21
    layers = [ln for ln in out if ln.startswith("olmoe-1b-7b")]
    assert layers[0].split()[-1] == "12.5" and layers[1].split()[-1] == "-"


@pytest.mark.parametrize("argv, message", [
    (["--tokens", "64"], "--tokens must lie in 65..8192 for bench prefill"),
    (["--tokens", "a,b"], "comma-separated integers"),
    (["--bits", "2"], "--bits must lie in 3..8"),
    (["--models", "gpt-5"], "unknown model shape"),
    (["--profile-out", "p.json"], "belong to `pwruntime bench kernels`"),
    (["--prefill-chunk", "0"], "--prefill-chunk: size '0' must be positive"),
    (["--prefill-chunk", "lots"], "--prefill-chunk: cannot read size 'lots'"),
    (["--models", "demo,gemma-4-26b-a4b,gemma-3"], "unknown model shape(s) ['gemma-3']"),
])
def test_prefill_bench_misuse_is_one_clear_error(tmp_path, capsys, argv, message):
    out = tmp_path / "prefill.json"
    assert main(["bench", "prefill", "--out", str(out), *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and not out.exists()


def test_prefill_bench_table_and_figure(tmp_path, capsys):
    from pwruntime import bench_prefill as bp

    rows = [{"model": m, "tokens": t, "bits": 4, "dtype": "bfloat16", "active_experts": 8, "padded_groups": 2,
             "runtime_path": "fused" if t <= 128 else "grouped", "max_rel_diff": 1e-3, "per_expert_ms": 3.0 + t / 128,
             "padded_ms": 1.0 + t / 256, "grouped_ms": 0.5 + t / 512, "fused_ms": t / 256,
             "runtime_ms": t / 256 if t <= 128 else 0.5 + t / 512, "speedup": 2.0, "dequant_ms": 0.3,
             "dequant_gbps": 2500.0}
            for m in ("olmoe-1b-7b", "mixtral-8x7b") for t in (128, 512)]
    res = {"device": "test GPU", "bits": 4, "dtype": "bfloat16", "reps": 5, "rows": rows}
    bp.print_table(res)
    text = capsys.readouterr().out
    assert "olmoe-1b-7b" in text and "mixtral-8x7b" in text and text.count("\n") == 2 + len(rows)
    assert text.count("*") == 1 + len(rows)  # the legend's and each row's runtime path
    png = bp.plot(res, tmp_path / "prefill.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_bench_kernels_takes_a_dtype(capsys):
    """--dtype reaches bench kernels' config (bf16 is what the runtime serves); an unknown dtype is refused."""
    from pwruntime.kernels.bench import BenchConfig
    assert BenchConfig().act_dtype == torch.float16 and BenchConfig(dtype="bf16").act_dtype == torch.bfloat16
    with pytest.raises(SystemExit) as exc:
        main(["bench", "kernels", "--dtype", "fp8"])
    assert exc.value.code == 2
    assert "invalid choice: 'fp8'" in capsys.readouterr().err
    if not torch.cuda.is_available():  # parsed and checked up to the GPU
        assert main(["bench", "kernels", "--dtype", "bf16", "--models", "olmoe-1b-7b"]) == 2
        err = capsys.readouterr().err
        assert "needs a CUDA GPU" in err and "Traceback" not in err


def test_dequant_bytes_count_planes_luts_and_the_written_weights():
    from pwruntime import bench_prefill as bp
    from pwruntime.kernels.moe import MoEShape

    olmoe = MoEShape(64, 2048, 1024, 8)  # gate_up [2048, 2048], down [2048, 1024]
    per_expert = (4 * 2048 * 64 * 4 + 2048 * 16 * 2 + 2048 * 2048 * 2) + (4 * 2048 * 32 * 4 + 2048 * 16 * 2 + 2048 * 1024 * 2)
    assert bp.dequant_bytes(olmoe, 3, 4, 2) == 3 * per_expert
    assert bp.dequant_bytes(olmoe, 1, 8, 2) - bp.dequant_bytes(olmoe, 1, 4, 2) == 4 * 2048 * 96 * 4 + 2 * 2048 * 240 * 2


@pytest.mark.gpu
def test_gpu_prefill_bench_paths_agree():
    from pwruntime import bench_prefill as bp
    from pwruntime.kernels.bench import BenchConfig

    rows = bp.prefill_layers(BenchConfig(models=("olmoe-1b-7b",), tokens=(80, 200), reps=2, warmup=1), "olmoe-1b-7b", 5)
    assert [r["tokens"] for r in rows] == [80, 200]
    for r in rows:  # OLMoE's experts in bf16 on Hopper: two fused launch sets at 80 tokens, torch's grouped GEMM at 200
        assert r["max_rel_diff"] < 2e-2 and r["padded_groups"] >= 1 and r["active_experts"] > 8
        assert r["padded_ms"] > 0 and r["per_expert_ms"] > 0 and r["grouped_ms"] > 0 and r["fused_ms"] > 0
        assert r["runtime_path"] == ("fused" if r["tokens"] <= 128 else "grouped")
        assert r["runtime_ms"] == r[f"{r['runtime_path']}_ms"]
        assert 0 < r["dequant_ms"] < r["padded_ms"] and r["dequant_gbps"] > 0


@pytest.mark.gpu
def test_gpu_kernel_bench_times_gemma4_layers():
    """bench kernels' MoE layers at Gemma 4's shape (tanh GELU experts): a row per width asked and mixed, each with
    the bytes its active experts' planes and LUTs hold at those bits."""
    from pwruntime.kernels.bench import BenchConfig, moe_layers

    cfg = BenchConfig(models=("gemma-4-26b-a4b",), tokens=(1, 4), reps=2, warmup=1, dtype="bf16")
    rows = moe_layers(cfg, "gemma-4-26b-a4b", bits=(3, 8), baselines=False)
    assert [(r["bits"], r["tokens"]) for r in rows] == [(b, t) for b in (3, 8, "mixed") for t in (1, 4)]
    by = {(r["bits"], r["tokens"]): r for r in rows}
    for t, active in ((1, 8), (4, None)):
        assert active is None or by[(3, t)]["active_experts"] == active
        assert by[(3, t)]["ap_bytes"] < by[("mixed", t)]["ap_bytes"] < by[(8, t)]["ap_bytes"]
        assert all(by[(b, t)]["ap_us"] > 0 for b in (3, 8, "mixed"))


@pytest.mark.gpu
def test_gpu_prefill_bench_takes_gemma4_in_one_chunk_or_two():
    """Gemma 4's 128 experts (1.52 GB in bf16) take two chunks at the default 1 GiB, one at 2 GiB; every path runs
    the tanh GELU (a path left on SiLU would differ from the per-expert one by far more than bf16 rounding). At 3
    bits and 16 rows an expert the runtime takes the fused AP GEMM, which skips the chunks."""
    from pwruntime import bench_prefill as bp
    from pwruntime.kernels.bench import BenchConfig

    cfg = BenchConfig(models=("gemma-4-26b-a4b",), tokens=(256,), reps=1, warmup=0)
    for chunk, chunks in ((1 << 30, 2), (2 << 30, 1)):
        (r,) = bp.prefill_layers(cfg, "gemma-4-26b-a4b", 3, chunk_bytes=chunk)
        assert (r["chunks"], r["prefill_chunk_bytes"], r["activation"]) == (chunks, chunk, "gelu_tanh")
        assert r["max_rel_diff"] < 2e-2 and r["runtime_path"] == "ap_gemm" and r["active_experts"] > 100
        assert 0 < r["ap_gemm_ms"] == r["runtime_ms"] and r["grouped_ms"] > 0


def test_prefix_cache_bench_reports_hits_and_equal_outputs(tmp_path, capsys):
    """A batch sharing a prefix, caching off then on: only the cached round takes prompt tokens from the cache, both
    produce the plain engine's greedy tokens (fp32), and the JSON, the table and the reproduce line are written."""
    out = tmp_path / "prefix.json"
    assert main(["bench", "prefix-cache", "--prompts", "4", "--max-tokens", "3", "--reps", "1", "--dtype", "fp32",
                 "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    off, on = res["rounds"]
    assert (off["caching"], on["caching"]) == (False, True)
    assert off["hit_tokens"] == 0 and on["hit_tokens"] >= 16 and on["hit_tokens"] % 16 == 0
    assert on["hit_tokens"] <= 3 * res["prefix_tokens"]           # the first prompt computes the prefix itself
    assert off["same_outputs"] == on["same_outputs"] == 4
    assert res["prompt_tokens"] > 4 * res["prefix_tokens"] > 0
    text = capsys.readouterr().out
    assert "hit tokens" in text and "reproduce: pwruntime bench prefix-cache" in text


@pytest.mark.parametrize("target,argv,message", [
    ("prefix-cache", ["--models", "olmoe-1b-7b"], "--models does not apply"),
    ("prefix-cache", ["--prompts", "0"], "--prompts must be positive, got 0"),
    ("kernels", ["--prompts", "4"], "belong to `pwruntime bench prefix-cache`"),
    ("prefill", ["--dtype", "fp32"], "--dtype fp32 is for"),
])
def test_prefix_cache_bench_misuse_is_one_clear_error(capsys, target, argv, message):
    assert main(["bench", target, *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_plans_bench_times_every_boundary_and_leaves_the_blocks_at_8_bits(tmp_path, capsys):
    """Every block of the demo shape's layer goes 8 -> 5 -> 8 bits through the plan loop and the page mover (on the
    CPU here): a row per shape with each boundary's host time a transition, the reloads' bytes and copy rate."""
    out = tmp_path / "plans.json"
    assert main(["bench", "plans", "--models", "demo", "--bits", "5", "--reps", "2", "--seed", "3",
                 "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    (row,) = res["rows"]
    assert (row["model"], row["blocks"], row["low_bits"], res["reps"]) == ("demo", 32, 5, 2)
    phases = [row[f"{p}_us"] for p in ("begin_offload", "land_offload", "begin_reload", "land_reload")]
    assert all(us > 0 for us in phases) and row["transition_us"] == pytest.approx(sum(phases) / 2)
    # gate_up [256, 256] and down [256, 128]: planes 5..7 (three of 8 or 4 words a row) and LUT_8, on average
    assert row["reload_bytes_per_block"] == (3 * 256 * 8 * 4 + 3 * 256 * 4 * 4) // 2 + 256 * 256 * 2
    assert row["reload_copy_gbps"] > 0
    assert out.with_suffix(".png").stat().st_size > 0
    text = capsys.readouterr().out
    assert "begin off" in text and "reproduce: pwruntime bench plans --models demo --layers 1 --bits 5" in text
    # the arena where the runtime serves from one (CUDA), else torch's allocator, and what reproduces it says which
    gpu = torch.cuda.is_available()
    assert res["plane_arena"] == gpu and ("arena_moves_per_transition" in row) == gpu
    assert ("--plane-arena" if gpu else "--no-plane-arena") in res["command"].split()


def test_a_plans_bench_s_reproduce_line_names_the_arena_choice_the_device_made(monkeypatch, tmp_path, capsys):
    """Run as given on the command line, without either flag: what reproduces it says which allocator ran."""
    out = tmp_path / "plans.json"
    argv = ["bench", "plans", "--models", "demo", "--reps", "1", "--out", str(out)]
    monkeypatch.setattr(sys, "argv", ["pwruntime", *argv])
    assert main(argv) == 0
    flag = "--plane-arena" if torch.cuda.is_available() else "--no-plane-arena"
    assert json.loads(out.read_text())["command"] == "pwruntime " + " ".join(argv) + " " + flag
    assert f"reproduce: pwruntime {' '.join(argv)} {flag}" in capsys.readouterr().out


def test_a_plans_bench_told_no_plane_arena_runs_on_torch_s_allocator_and_names_the_flag_once(monkeypatch, tmp_path):
    """--no-plane-arena is every device's choice (the CPU's only one): torch's allocator runs, and the command that
    reproduces it, which names the flag already, is the command as given."""
    out = tmp_path / "plans.json"
    argv = ["bench", "plans", "--models", "demo", "--reps", "1", "--no-plane-arena", "--out", str(out)]
    monkeypatch.setattr(sys, "argv", ["pwruntime", *argv])
    assert main(argv) == 0
    res = json.loads(out.read_text())
    assert res["plane_arena"] is False and "arena_moves_per_transition" not in res["rows"][0]
    assert res["command"] == "pwruntime " + " ".join(argv)


def test_on_cuda_the_plans_bench_s_arena_is_on_unless_told_otherwise(monkeypatch):
    """What a device that has CUDA makes of the flags (a stand-in here: the bench's config, stopped before it runs):
    the arena by default and with --plane-arena, torch's allocator with --no-plane-arena; with or without a plan log."""
    from pwruntime import bench_plan_log as bpg
    from pwruntime import bench_plans as bpl

    class Ran(Exception):
        """The config a bench was about to run with."""

    def run(cfg, device, *rest, **kw):
        raise Ran(cfg.plane_arena, device.type)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bpl, "run", run)
    monkeypatch.setattr(bpg, "measure", run)
    monkeypatch.setattr(bpg, "log_plans", lambda cfg: [])   # a log it could play
    for log in ([], ["--plan-log", "nowhere"]):
        for flags, arena in (([], True), (["--plane-arena"], True), (["--no-plane-arena"], False)):
            with pytest.raises(Ran) as ran:
                main(["bench", "plans", "--models", "demo", *log, *flags])
            assert ran.value.args == (arena, "cuda"), (log, flags)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's refusal")
def test_plans_bench_with_a_plane_arena_needs_a_gpu(capsys, tmp_path):
    out = tmp_path / "plans.json"
    assert main(["bench", "plans", "--models", "demo", "--plane-arena", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "--plane-arena needs a CUDA GPU" in err and "Traceback" not in err and not out.exists()


@pytest.mark.gpu
def test_gpu_plans_bench_with_a_plane_arena_moves_tensors_and_leaves_the_blocks_at_8_bits(tmp_path, capsys):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    out = tmp_path / "plans.json"
    # OLMoE's shape: the demo's planes would all fit in one class's slack, with nothing to move; the arena is the
    # default on CUDA, as the runtime serves AP experts there
    assert main(["bench", "plans", "--models", "olmoe-1b-7b", "--bits", "5", "--reps", "1", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    (row,) = res["rows"]
    assert res["plane_arena"] and row["arena_moves_per_transition"] > 0 and row["transition_us"] > 0
    assert "--plane-arena" in res["command"] and "in a plane arena" in capsys.readouterr().out


@pytest.fixture(scope="module")
def demo_plan_log(tmp_path_factory):
    """A `pwsim run` of the bundled default (the demo model under a 24 MiB budget): its plans.parquet."""
    from pwsim.cli import main as sim_main
    out = tmp_path_factory.mktemp("plans") / "sim"
    assert sim_main(["run", "--budget", "24MiB", "--out", str(out)]) == 0
    return out


def test_a_runs_plans_are_grouped_by_step_and_checked_against_the_shape(demo_plan_log):
    from pwruntime.bench_plan_log import started_plans
    from traces.results import read_plan_log
    log = read_plan_log(demo_plan_log)
    plans = started_plans(log, "demo", 2)
    in_two = (log["status"] == "started") & (log["layer"] < 2)
    assert sum(len(b) for _, b, _, _ in plans) == int(in_two.sum()) > 0
    assert [s for s, *_ in plans] == sorted(set(log["step"][in_two].tolist()))
    for step, blocks, frm, to in plans:
        rows = in_two & (log["step"] == step)
        assert blocks.tolist() == log["block"][rows].tolist() and np.all(blocks < 2 * 16 * 2)
        assert frm.tolist() == log["from_bits"][rows].tolist() and to.tolist() == log["to_bits"][rows].tolist()
    with pytest.raises(UserError, match="not olmoe-1b-7b's"):   # 16 experts a layer numbered as 64
        started_plans(log, "olmoe-1b-7b", 2)


def test_plans_bench_plays_a_runs_plan_log(demo_plan_log, tmp_path, capsys):
    """The demo run's own plans through the runtime's plan machinery (on the CPU here): every started transition of
    its four layers begun and landed, a plan at a time, from the bits its blocks start at in the log."""
    from traces.results import read_plan_log
    out = tmp_path / "log.json"
    assert main(["bench", "plans", "--plan-log", str(demo_plan_log), "--models", "demo", "--layers", "4",
                 "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    log = read_plan_log(demo_plan_log)
    started = log["status"] == "started"
    row = res["row"]
    assert (row["model"], row["layers"], row["transitions"]) == ("demo", 4, int(started.sum()))
    assert row["plans"] == len(res["per_plan"]) == len(set(log["step"][started].tolist()))
    assert row["offloads"] == int(np.sum(log["to_bits"][started] < log["from_bits"][started]))
    assert row["begin_us"] > 0 and row["land_us"] > 0 and row["transition_us"] == row["begin_us"] + row["land_us"]
    # the arena where the runtime serves from one (CUDA), else torch's allocator, and what reproduces it says which
    gpu = torch.cuda.is_available()
    assert res["plane_arena"] is gpu and ("arena_moves_per_transition" in row) == gpu
    assert out.with_suffix(".png").stat().st_size > 0
    text = capsys.readouterr().out
    flag = "--plane-arena" if gpu else "--no-plane-arena"
    assert f"reproduce: pwruntime bench plans --plan-log {demo_plan_log} --models demo --layers 4 {flag}" in text
    assert f"{row['transitions']} transitions" in text


def test_a_played_plan_log_reports_the_arenas_moves_calls_and_overhead(demo_plan_log, monkeypatch):
    """The arena's part of the row, over host memory (tests/vmm_fakes.py): its moves, the handles its buffers mapped
    and unmapped a transition, and its mapped memory over what its tensors take after each plan."""
    from pwruntime import bench_plan_log as bpg
    from pwruntime import plane_arena
    from vmm_fakes import HostBuffer
    monkeypatch.setattr(plane_arena, "GrowableBuffer", HostBuffer)
    monkeypatch.setattr(HostBuffer, "growths_left", None)
    cfg = bpg.PlanLogConfig(str(demo_plan_log), "demo", 4, plane_arena=True)
    res = bpg.measure(cfg, torch.device("cpu"), bpg.log_plans(cfg))
    row = res["row"]
    ratios = [p["mapped_over_live"] for p in res["per_plan"]]
    assert row["mapped_over_live_max"] == max(ratios) >= row["mapped_over_live_mean"] >= 1
    assert row["arena_moves_per_transition"] >= 0 and row["driver_us_per_transition"] >= 0
    assert row["handles_mapped_per_transition"] > 0 and row["handles_unmapped_per_transition"] > 0


@pytest.mark.gpu
def test_gpu_plans_bench_plays_a_runs_plan_log_with_a_plane_arena(demo_plan_log, tmp_path, capsys):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    out = tmp_path / "log.json"
    assert main(["bench", "plans", "--plan-log", str(demo_plan_log), "--models", "demo", "--layers", "4",
                 "--plane-arena", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    row = res["row"]
    assert res["plane_arena"] and row["transitions"] > 0 and row["arena_moves_per_transition"] >= 0
    assert row["mapped_over_live_max"] >= row["mapped_over_live_mean"] >= 1   # whole 2 MiB steps over its tensors
    assert row["handles_mapped_per_transition"] >= 0 and row["handles_unmapped_per_transition"] >= 0
    assert "the arena a transition:" in capsys.readouterr().out


@pytest.mark.parametrize("argv,message", [
    (["--models", "demo,olmoe-1b-7b"], "on one model shape"),
    (["--models", "demo", "--bits", "5"], "--bits does not apply to `pwruntime bench plans --plan-log`"),
    (["--models", "demo", "--reps", "2"], "--reps does not apply to `pwruntime bench plans --plan-log`"),
    (["--models", "olmoe-1b-7b", "--layers", "2"], "give --models the shape of the model the run served"),
])
def test_plans_bench_plan_log_misuse_is_one_clear_error(demo_plan_log, capsys, tmp_path, argv, message):
    out = tmp_path / "x.json"
    assert main(["bench", "plans", "--plan-log", str(demo_plan_log), *argv, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and not out.exists()


@pytest.mark.parametrize("argv,message", [
    (["plans", "--bits", "8"], "--bits must lie in 3..7"),
    (["plans", "--models", "gpt2"], "unknown model shape(s) ['gpt2']"),
    (["plans", "--layers", "0"], "--layers must be positive, got 0"),
    (["decode", "--plane-arena"], "--plane-arena and --no-plane-arena belong to `pwruntime bench plans`"),
    (["kernels", "--no-plane-arena"], "--plane-arena and --no-plane-arena belong to `pwruntime bench plans`"),
    (["plans", "--dtype", "bf16"], "--dtype does not apply"),
    (["kernels", "--layers", "2"], "--layers belongs to `pwruntime bench plans`"),
    (["decode", "--layers", "2"], "--layers belongs to `pwruntime bench plans`"),
    (["kv-resize", "--models", "gpt2"], "--models: no model card 'gpt2'"),
    (["kv-resize", "--reps", "0"], "--reps must be positive"),
    (["kv-resize", "--tokens", "4"], "--tokens does not apply to `pwruntime bench kv-resize`"),
    (["decode", "--plan-log", "runs/x"], "--plan-log belongs to `pwruntime bench plans`"),
    (["kernels", "--bits", "5"], "--bits belongs to `pwruntime bench prefill` and `bench plans`"),
    (["serve", "--bits", "5"], "--bits belongs to `pwruntime bench prefill` and `bench plans`"),
    (["kernels", "--prefill-chunk", "2GiB"], "--prefill-chunk belongs to `pwruntime bench prefill`"),
    (["serve", "--prefill-chunk", "2GiB"], "--prefill-chunk belongs to `pwruntime bench prefill`"),
    (["plans", "--models", "demo", "--plan-log", "/nonexistent"], "holds no plan log"),
])
def test_plans_and_kv_resize_bench_misuse_is_one_clear_error(capsys, argv, message):
    assert main(["bench", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1   # no progress line


def test_kv_resize_walk_is_seeded_and_stays_within_half_and_one_and_a_half_of_its_start():
    from pwruntime.bench_kv_resize import KvResizeConfig, walk
    cfg = KvResizeConfig(resizes=500, start_blocks=100, max_step=30, seed=4)
    sizes = walk(cfg)
    assert sizes == walk(cfg) and sizes != walk(KvResizeConfig(resizes=500, start_blocks=100, max_step=30, seed=5))
    assert len(sizes) == 500 and min(sizes) >= 50 and max(sizes) <= 150
    assert min(sizes) == 50 or max(sizes) == 150   # a walk this long reaches a bound
    steps = [b - a for a, b in zip([100] + sizes, sizes)]
    assert max(map(abs, steps)) <= 30 and len(set(sizes)) > 20


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_kv_resize_bench_needs_a_gpu(tmp_path, capsys):
    assert main(["bench", "kv-resize", "--out", str(tmp_path / "kv.json")]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err and not (tmp_path / "kv.json").exists()


def test_kv_resize_table_and_figure_from_a_result(tmp_path, capsys):
    from pwruntime import bench_kv_resize as bkv
    rows = [{"model": "olmoe-1b-7b-0924", "backing": b, "host_ms": h, "wall_ms": w, "held_gib": g,
             "largest_cache_gib": 8.8} for b, h, w, g in (("mapped", 1.2, 1.4, 8.9), ("torch", 1.6, 3.3, 9.9))]
    res = {"device": "test GPU", "config": {"resizes": 200, "block_size": 16, "start_blocks": 3000, "max_step": 30,
                                            "rounds": 2}, "rows": rows}
    bkv.print_table(res)
    text = capsys.readouterr().out
    assert "olmoe-1b-7b-0924     mapped      1.200    1.400      8.90" in text and "torch" in text
    png = bkv.plot(res, tmp_path / "kv.png")
    assert png.stat().st_size > 5000


@pytest.mark.gpu
def test_gpu_kv_resize_bench_runs_both_backings(tmp_path, capsys):
    out = tmp_path / "kv.json"
    assert main(["bench", "kv-resize", "--models", "pagedweight-demo,olmoe-1b-7b-0924", "--reps", "2",
                 "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert [(r["model"], r["backing"]) for r in res["rows"]] == [
        (m, b) for m in ("pagedweight-demo", "olmoe-1b-7b-0924") for b in ("mapped", "torch")]
    for r in res["rows"]:
        assert len(r["rounds"]) == 2 and 0 < r["host_ms"] <= r["wall_ms"]   # the wall time holds the host's
        assert r["held_gib"] >= r["largest_cache_gib"] * 0.99   # nothing holds less than the cache at its largest
    assert out.with_suffix(".png").exists() and "reproduce: pwruntime bench kv-resize" in capsys.readouterr().out


def test_step_inputs_batch_is_a_pool_holding_each_row_as_a_running_sequence_and_is_seeded():
    """The bench's batch lives in a real pool, each sequence grown as a running one is: its sliding group's table NULL
    before its query's window, its full group's whole; the shape is seeded."""
    from dataclasses import replace

    from policies.kv_groups import KVGroup, KVLayout
    from pwruntime.bench_step_inputs import StepInputsConfig, batch_pool, batch_shape
    cfg = StepInputsConfig(rows=5, context_min=30, context_max=90, chunks=2, chunk_tokens=10, chunk_context=40)
    assert batch_shape(cfg) == batch_shape(cfg) != batch_shape(replace(cfg, seed=1))
    assert batch_shape(cfg)[5:] == [(40, 10), (0, 10)]
    layout = KVLayout((KVGroup((0,), 16), KVGroup((1,), 16, 32)), 64)
    pool = batch_pool(cfg, layout)
    for i, (c, q) in enumerate(batch_shape(cfg)):
        first = max(c - 31, 0) // 16
        whole, sliding = pool.group_table(i, 0), pool.group_table(i, 1)
        assert len(whole) == len(sliding) == -(-(c + q) // 16) and -1 not in whole
        assert sliding[:first] == [-1] * first and -1 not in sliding[first:]
    one = batch_pool(cfg, KVLayout((KVGroup((0,), 16),), 64))
    assert [len(one.block_table(i)) for i in range(7)] == [-(-(c + q) // 16) for c, q in batch_shape(cfg)]


def test_step_inputs_bench_times_both_layouts_of_a_sliding_model_and_one_of_another(tmp_path, capsys):
    """On the CPU (CI): the Gemma 4 card gets a row for one table and one for its six hybrid groups, Mixtral's (no
    sliding layers to group) one table; the result, its figure and the reproducing command are written."""
    out = tmp_path / "si.json"
    assert main(["bench", "step-inputs", "--models", "Gemma-4-26B-A4B,Mixtral-8x7B-v0.1", "--reps", "2",
                 "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    res = json.loads(out.read_text())
    assert [(r["model"], r["layout"], r["groups"]) for r in res["rows"]] == [
        ("Gemma-4-26B-A4B", "one table", 1), ("Gemma-4-26B-A4B", "hybrid", 6), ("Mixtral-8x7B-v0.1", "one table", 1)]
    assert all(r[k] > 0 for r in res["rows"] for k in ("decode_staging_ms", "mixed_metadata_ms", "mixed_plans_ms"))
    assert out.with_suffix(".png").stat().st_size > 0
    assert "reproduce: pwruntime bench step-inputs" in printed and "hybrid" in printed


@pytest.mark.parametrize("argv,message", [
    (["--models", "no-such-model"], "--models"),
    (["--reps", "0"], "--reps must be positive"),
    (["--tokens", "4"], "--tokens does not apply to `pwruntime bench step-inputs`"),
])
def test_step_inputs_bench_misuse_is_one_clear_error(tmp_path, capsys, argv, message):
    assert main(["bench", "step-inputs", *argv, "--out", str(tmp_path / "si.json")]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "si.json").exists()


@pytest.mark.parametrize("argv, want", [
    (["--models", "demo", "--tokens", "256", "--bits", "3", "--prefill-chunk", "2GiB"],
     "pwruntime bench prefill --models demo --tokens 256 --bits 3 --prefill-chunk 2GiB --json --out OUT --dtype bf16"),
    (["--models", "demo", "--tokens", "256"],
     "pwruntime bench prefill --models demo --tokens 256 --json --out OUT --bits 4 --dtype bf16"),
])
def test_bench_prefill_records_the_command_with_each_flag_once(tmp_path, monkeypatch, capsys, argv, want):
    """The reproduce command is the flags as given plus what the run chose of --bits and --dtype, each once (it once
    appended `--bits 3 --dtype bf16` to a command that named them); the host side, the layers' timing stubbed."""
    from pwruntime import bench_prefill
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "test GPU")
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(bench_prefill, "prefill_layers", lambda *a: [])
    monkeypatch.setattr(bench_prefill, "plot", lambda res, path: path)
    out = tmp_path / "prefill.json"
    given = ["bench", "prefill", *argv, "--json", "--out", str(out)]
    monkeypatch.setattr(sys, "argv", ["pwruntime", *given])   # the command as a shell gave it
    assert main(given) == 0
    capsys.readouterr()
    assert json.loads(out.read_text())["command"] == want.replace("OUT", str(out))
