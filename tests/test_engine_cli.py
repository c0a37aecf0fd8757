"""`pwruntime generate`: JSON output, greedy equality with the engine, user errors exit 2."""
from __future__ import annotations

import json

import pytest

from model_fixtures import make_tiny_checkpoint
from pwruntime.cli import main


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("cli"), "mixtral", seed=3)


def test_generate_json(ckpt, capsys):
    rc = main(["generate", "--model", str(ckpt), "--prompt", "ba be bi bo", "--prompt", "ka ke",
               "--max-tokens", "6", "--ignore-eos", "--block-size", "4", "--num-kv-blocks", "32", "--json",
               "--logprobs", "2"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert [o["prompt"] for o in out["outputs"]] == ["ba be bi bo", "ka ke"]
    for o in out["outputs"]:
        assert len(o["token_ids"]) == 6 and o["finish_reason"] == "length" and o["text"]
        assert [r["token_id"] for r in o["logprobs"]] == o["token_ids"]
        assert all(len(r["top"]) == 2 and r["top"][0][0] == r["token_id"] for r in o["logprobs"])  # greedy
    assert out["stats"]["generated_tokens"] == 12 and out["stats"]["kv_blocks"] == 32

    from pwruntime.engine import EngineConfig, LLMEngine
    from pwruntime.model import load_model
    from pwruntime.sampling import SamplingParams
    alone = LLMEngine(load_model(ckpt), EngineConfig(num_kv_blocks=32, block_size=4)).generate(
        ["ka ke"], SamplingParams(max_tokens=6, ignore_eos=True))[0]
    assert out["outputs"][1]["token_ids"] == alone.token_ids


def test_generate_text_output_and_seed(ckpt, capsys):
    args = ["generate", "--model", str(ckpt), "--prompt", "ba be", "--max-tokens", "5", "--temperature", "1.0",
            "--seed", "4", "--device", "cpu", "--dtype", "fp32"]
    assert main(args) == 0
    first = capsys.readouterr().out
    assert main(args) == 0
    assert capsys.readouterr().out == first and first.strip()


@pytest.mark.parametrize("extra, message", [
    (["--model", "/nonexistent/model"], "does not exist"),
    (["--model", "CKPT", "--top-p", "0"], "top_p"),
    (["--model", "CKPT", "--logprobs", "-1", "--json"], "logprobs must be >= 0"),
    (["--model", "CKPT", "--logprobs", "2"], "add --json"),
    (["--model", "CKPT", "--max-num-seqs", "0"], "--max-num-seqs"),
    (["--model", "CKPT", "--num-kv-blocks", "1", "--block-size", "1"], "KV blocks"),
])
def test_generate_user_errors_exit_2(ckpt, capsys, extra, message):
    extra = [str(ckpt) if a == "CKPT" else a for a in extra]
    rc = main(["generate", "--prompt", "ba be bi", *extra])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_generate_requires_model_without_demo(capsys, monkeypatch):
    import pwruntime.cmd_perplexity as cp

    monkeypatch.setattr(cp, "default_model_dir", lambda: None)
    assert main(["generate", "--prompt", "x"]) == 2
    assert "--model" in capsys.readouterr().err
