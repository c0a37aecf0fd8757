"""`pwruntime bench mixed`: a mixed step's forward eagerly wherever it runs (the CPU in CI), the batch it builds, the
errors; on the GPU eager against the piecewise graphs, equal results."""
from __future__ import annotations

import json

import pytest
import torch

from pwruntime.bench_mixed import blocks_needed, mixed_batch
from test_bench_decode import assert_bench_misuse, run_bench


def test_mixed_batch_is_decode_rows_then_one_prompt_on_distinct_blocks():
    seqs = mixed_batch(3, 20, 16)
    assert [(c, n) for c, n, _ in seqs] == [(40, 1)] * 3 + [(0, 20)]
    assert [b for _, _, b in seqs] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10]]
    assert blocks_needed(3, 20, 16) == 11 and blocks_needed(0, 33, 16) == 3


def test_mixed_bench_times_eager_forwards_on_the_cpu(tmp_path, capsys):
    res = run_bench("mixed", ["--prompts", "3", "--tokens", "5,17", "--reps", "2", "--dtype", "fp32", "--json"], tmp_path)
    captured = capsys.readouterr()
    assert json.loads(captured.out) == res      # stdout is JSON alone: what follows it goes to stderr
    printed = captured.out + captured.err
    assert res["device"] == "cpu" and res["pieces"] is False and res["decode_rows"] == 3
    assert [r["tokens"] for r in res["rows"]] == [8, 20] and res["kv_blocks"] == blocks_needed(3, 17, 16)
    for r in res["rows"]:
        assert len(r["eager"]) == res["rounds"] and r["pieces"] == []
        assert all(0 < x["host_ms"] <= x["wall_ms"] for x in r["eager"])
    assert "reproduce: pwruntime bench mixed" in printed


@pytest.mark.parametrize("argv, message", [
    (["--tokens", "0"], "--tokens must be positive, got 0"),
    (["--tokens", "a,b"], "comma-separated integers"),
    (["--steps", "3"], "--steps does not apply"),
    (["--max-tokens", "3"], "--max-tokens belongs to `pwruntime bench prefix-cache`"),
    (["--prompts", "8", "--tokens", "100", "--num-kv-blocks", "10"], "cannot hold 8 decode rows"),
    (["--async-scheduling"], "--async-scheduling belongs to `pwruntime bench decode`"),
])
def test_mixed_bench_misuse_is_one_clear_error_and_writes_nothing(tmp_path, capsys, argv, message):
    assert_bench_misuse("mixed", argv, message, tmp_path, capsys)


@pytest.mark.gpu
def test_mixed_bench_on_the_gpu_runs_the_pieces_and_matches_eager(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    res = run_bench("mixed", ["--prompts", "8", "--tokens", "30,200", "--reps", "3"], tmp_path)
    assert res["pieces"] is True and [r["bucket"] for r in res["rows"]] == [64, 256]
    for r in res["rows"]:
        assert len(r["pieces"]) == res["rounds"] and r["routing_ids_equal"] > 0.95 and r["hidden_rel_diff"] < 2e-2
