"""`pwruntime demo` command line: dispatch, user errors (exit 2, one line), a tiny train run with --json."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from demo_fixtures import write_corpus  # noqa: E402

from pwruntime.cli import main  # noqa: E402


def test_demo_without_action_prints_usage_and_exits_2(capsys):
    assert main(["demo"]) == 2
    assert "train" in capsys.readouterr().err


def test_user_errors_are_one_line_with_exit_2(tmp_path, capsys):
    assert main(["demo", "train", "--corpus", str(tmp_path / "nowhere"), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "does not exist" in err[0] and "Traceback" not in err[0]
    assert main(["demo", "stats", "--model", str(tmp_path), "--corpus", str(tmp_path), "--out", str(tmp_path)]) == 2
    assert "not a model folder" in capsys.readouterr().err
    root = write_corpus(tmp_path / "c", train_docs=3, valid_docs=2)
    assert main(["demo", "train", "--corpus", str(root), "--out", str(tmp_path / "o"), "--domains", "nope"]) == 2
    assert "nope" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["demo", "train", "--corpus", str(root), "--out", str(tmp_path / "o"), "--steps", "0"])
    assert e.value.code == 2


def test_tiny_train_run_through_the_cli(tmp_path, capsys):
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    root = write_corpus(tmp_path / "c", train_docs=30, valid_docs=4)
    args = ["demo", "train", "--corpus", str(root), "--out", str(tmp_path / "run"), "--steps", "6",
            "--batch-size", "3", "--seq-len", "16", "--vocab-size", "280", "--hidden-size", "32", "--layers", "1",
            "--heads", "4", "--kv-heads", "2", "--experts", "16", "--moe-intermediate", "16",
            "--shared-intermediate", "32", "--log-every", "3", "--eval-every", "6", "--warmup-steps", "2",
            "--domain-mix", "equal", "--no-progress", "--json", "--device", "cpu"]
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert main(args) == 0
    finally:
        torch.set_num_threads(n)
    res = json.loads(capsys.readouterr().out)
    assert res["finished"] and res["step"] == 6 and res["params"]["total"] > 0
    cfg = json.loads((tmp_path / "run" / "train_config.json").read_text())
    assert cfg["config"]["model"]["num_hidden_layers"] == 1 and cfg["counts_per_batch"] == [1, 1, 1]
    hf = json.loads((tmp_path / "run" / "model" / "config.json").read_text())
    assert hf["num_experts"] == 16 and hf["num_experts_per_tok"] == 4 and hf["vocab_size"] == 280
