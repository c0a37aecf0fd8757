"""`pwruntime bench decode`: the decode step's time and phases wherever it runs (the CPU in CI), the kernel sums
from a profiler trace, the errors; on the GPU its kernels and graph replays."""
from __future__ import annotations

import json

import pytest
import torch

from pwruntime.bench_decode import kernel_stats
from pwruntime.cli import main


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_decode_bench_times_steady_decode_steps(tmp_path, capsys, asynchronous):
    res = run_bench("decode", ["--prompts", "3", "--prompt-tokens", "6", "--steps", "4", "--reps", "2", "--dtype",
                               "fp32", "--json", *(["--async-scheduling"] if asynchronous else [])], tmp_path)
    captured = capsys.readouterr()
    assert json.loads(captured.out) == res      # stdout is JSON alone: what follows it goes to stderr
    printed = captured.out + captured.err
    assert res["sequences"] == 3 and res["steps"] == 4 and len(res["windows"]) == 2
    for w in res["windows"]:
        assert w["decode_only_steps"] == 4 and w["step_ms"] > 0
        assert set(w["phases_ms"]) == {"schedule", "forward", "sample", "observe", "plan"}
        assert sum(w["phases_ms"].values()) <= w["step_ms"] * 1.05      # the phases are parts of the step
    assert res["step_ms_median"] == pytest.approx(sum(w["step_ms"] for w in res["windows"]) / 2)
    assert res["kernels"] is None and res["device"] == "cpu" and res["kv_blocks"] > 0
    assert "reproduce: pwruntime bench decode" in printed
    assert res["async_scheduling"] is asynchronous and ("--async-scheduling" in res["command"]) is asynchronous
    assert res["temperature"] == 0.0 and res["top_p"] == 1.0 and "--temperature" not in res["command"]


def test_decode_bench_samples_at_a_temperature(tmp_path, capsys):
    """--temperature / --top-p: the timed sequences sample (seeded), and the result and its command say so."""
    res = run_bench("decode", ["--prompts", "3", "--prompt-tokens", "6", "--steps", "3", "--reps", "1", "--dtype",
                               "fp32", "--temperature", "0.8", "--top-p", "0.9"], tmp_path)
    assert res["temperature"] == 0.8 and res["top_p"] == 0.9 and "--temperature 0.8 --top-p 0.9" in res["command"]
    assert res["windows"][0]["decode_only_steps"] == 3


@pytest.mark.parametrize("argv, message", [
    (["--steps", "0"], "--steps must be positive, got 0"),
    (["--tokens", "4"], "--tokens does not apply"),
    (["--max-tokens", "3"], "--max-tokens belongs to `pwruntime bench prefix-cache`"),
    (["--num-kv-blocks", "0"], "--num-kv-blocks must be positive"),
    (["--temperature", "-1"], "--temperature / --top-p: temperature must be a finite number >= 0"),
    (["--temperature", "1", "--top-p", "0"], "--temperature / --top-p: top_p must be in (0, 1]"),
    (["--prompts", "8", "--num-kv-blocks", "8", "--steps", "2", "--reps", "1"], "never decoded together"),
])
def test_decode_bench_misuse_is_one_clear_error_and_writes_nothing(tmp_path, capsys, argv, message):
    assert_bench_misuse("decode", argv, message, tmp_path, capsys)


def run_bench(target: str, argv: list[str], tmp_path) -> dict:
    """`pwruntime bench target ...argv --out FILE` exits 0; the JSON it wrote."""
    out = tmp_path / f"{target}.json"
    assert main(["bench", target, *argv, "--out", str(out)]) == 0
    return json.loads(out.read_text())


def assert_bench_misuse(target: str, argv: list[str], message: str, tmp_path, capsys) -> None:
    """`pwruntime bench target ...argv` exits 2 with one error line holding `message` and writes no --out file."""
    out = tmp_path / f"{target}.json"
    assert main(["bench", target, "--dtype", "fp32", *argv, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0] and not out.exists()


def test_decode_options_are_refused_by_the_other_benches(capsys):
    assert main(["bench", "prefix-cache", "--steps", "3"]) == 2
    assert "belong to `pwruntime bench decode`" in capsys.readouterr().err
    assert main(["bench", "kernels", "--policy", "noop"]) == 2
    assert "belong to `pwruntime bench decode`" in capsys.readouterr().err
    assert main(["bench", "kernels", "--async-scheduling"]) == 2
    assert "--async-scheduling, --temperature and --top-p belong to `pwruntime bench decode`" in capsys.readouterr().err
    assert main(["bench", "mixed", "--temperature", "0.8"]) == 2
    assert "--temperature does not apply to `pwruntime bench mixed`" in capsys.readouterr().err


def test_kernel_stats_sums_a_trace():
    def k(name, ts, dur):
        return {"cat": "kernel", "name": name, "ts": ts, "dur": dur}
    events = [{"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 500}]
    for step in range(2):   # a graph of three back-to-back kernels, the host, then a small eager kernel
        t0 = 1000.0 * step
        events += [k("norm", t0, 10), k("moe", t0 + 11, 20), k("norm", t0 + 32, 10), k("argmax", t0 + 300, 5)]
    s = kernel_stats(events, steps=2)
    assert s["kernels_per_step"] == 4 and s["gpu_busy_us_per_step"] == 45
    assert s["graph_span_us"] == 42                       # the two longest runs: each step's graph, 0..42
    assert [t["name"] for t in s["top"]] == ["norm", "moe", "argmax"] and s["top"][0]["per_step"] == 2
    assert kernel_stats([], steps=2)["kernels_per_step"] == 0


@pytest.mark.gpu
def test_decode_bench_on_the_gpu_counts_the_graph_kernels(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    res = run_bench("decode", ["--prompts", "8", "--steps", "10", "--reps", "1"], tmp_path)
    k = res["kernels"]
    assert res["cuda_graph_replays"] > 0 and res["windows"][0]["decode_only_steps"] == 10
    assert k["kernels_per_step"] > 10 and 0 < k["gpu_busy_us_per_step"] and 0 < k["graph_span_us"]
    assert 0 < k["gpu_busy_fraction"] < 1.5 and k["top"]
