"""`pwruntime perplexity` against a direct transformers computation over the same sliding windows."""
from __future__ import annotations

import gzip
import json
import math
from pathlib import Path

import pytest
import torch

from model_fixtures import load_hf_model, make_text, make_tiny_checkpoint
from pwruntime.cli import main
from pwruntime.cmd_perplexity import window_targets
from pwruntime.model import load_model


pytestmark = pytest.mark.usefixtures("one_thread")


def hf_sliding_ppl(hf, ids: list[int], context: int, stride: int) -> tuple[float, int, int]:
    """The HuggingFace recipe written with labels: mask the tokens an earlier window scored with -100;
    transformers' loss averages the (shifted) unmasked labels."""
    nll, count, windows, prev_end = 0.0, 0, 0, 0
    for begin in range(0, len(ids), stride):
        end = min(begin + context, len(ids))
        trg_len = end - prev_end
        inp = torch.tensor([ids[begin:end]])
        labels = inp.clone()
        labels[:, :-trg_len] = -100
        valid = int((labels[:, 1:] != -100).sum())
        if valid:
            with torch.no_grad():
                nll += float(hf(inp, labels=labels).loss) * valid
            count += valid
            windows += 1
        prev_end = end
        if end == len(ids):
            break
    return math.exp(nll / count), count, windows


def run_cli(capsys, *argv) -> tuple[int, dict | None, str]:
    rc = main(["perplexity", *argv])
    out = capsys.readouterr()
    return rc, (json.loads(out.out) if rc == 0 and "--json" in argv else None), out.err


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ppl")
    path = make_tiny_checkpoint(tmp, "qwen2_moe", seed=5)
    text = tmp / "text.txt"
    text.write_text(make_text(300, seed=2))
    return path, text


@pytest.mark.parametrize("context,stride", [(32, 8), (40, 40), (64, 25)])
def test_perplexity_cli_matches_transformers(setup, capsys, context, stride):
    path, text = setup
    rc, res, _ = run_cli(capsys, "--model", str(path), "--data", str(text), "--context", str(context),
                         "--stride", str(stride), "--json", "--block-size", "4")
    assert rc == 0
    ids = load_model(path).tokenizer.encode(text.read_text())
    ppl, count, windows = hf_sliding_ppl(load_hf_model(path), ids, context, stride)
    assert res["tokens"] == count and res["windows"] == windows and res["text_tokens"] == len(ids)
    assert res["context"] == context and res["stride"] == stride
    assert abs(res["perplexity"] - ppl) / ppl < 1e-4
    assert abs(math.log(res["perplexity"]) - res["nll"]) < 1e-9


def test_gzip_and_max_tokens(setup, capsys, tmp_path):
    path, text = setup
    gz = tmp_path / "text.txt.gz"
    with gzip.open(gz, "wt", encoding="utf-8") as f:
        f.write(text.read_text())
    rc, res, _ = run_cli(capsys, "--model", str(path), "--data", str(gz), "--context", "16", "--max-tokens", "50",
                         "--json")
    assert rc == 0 and res["text_tokens"] == 50 and res["stride"] == 8
    ids = load_model(path).tokenizer.encode(text.read_text())[:50]
    ppl, count, _ = hf_sliding_ppl(load_hf_model(path), ids, 16, 8)
    assert res["tokens"] == count == 49
    assert abs(res["perplexity"] - ppl) / ppl < 1e-4
    rc = main(["perplexity", "--model", str(path), "--data", str(gz), "--context", "16", "--max-tokens", "50"])
    assert rc == 0 and "perplexity" in capsys.readouterr().out


def test_window_targets_score_every_token_once():
    for n, context, stride in [(100, 16, 8), (100, 16, 16), (17, 16, 5), (2, 16, 8), (50, 7, 3)]:
        scored = [t for _, end, first in window_targets(n, context, stride) for t in range(first, end)]
        windows = window_targets(n, context, stride)
        assert all(end - begin <= context and first > begin for begin, end, first in windows)
        if stride < context:
            assert scored == list(range(1, n))          # overlapping windows: all but the first token
        else:
            assert sorted(set(scored)) == scored and scored[0] == 1 and scored[-1] == n - 1


@pytest.mark.parametrize("argv,needle", [
    (["--context", "1"], "--context"),
    (["--context", "16", "--stride", "17"], "--stride"),
    (["--context", "1024"], "max_position_embeddings"),
    (["--max-tokens", "1"], "--max-tokens"),
    (["--dtype", "fp8"], "invalid choice"),
    (["--device", "cuda:0"] if not torch.cuda.is_available() else ["--device", "tpu"], "device"),
])
def test_bad_flags_exit_2(setup, capsys, argv, needle):
    path, text = setup
    with pytest.raises(SystemExit) if needle == "invalid choice" else _nothing():
        rc = main(["perplexity", "--model", str(path), "--data", str(text), *argv])
        assert rc == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


def test_bad_data_exit_2(setup, capsys, tmp_path):
    path, _ = setup
    rc, _, err = run_cli(capsys, "--model", str(path), "--data", str(tmp_path / "missing.txt"))
    assert rc == 2 and "missing.txt" in err
    (tmp_path / "bad.gz").write_bytes(b"not gzip at all")
    rc, _, err = run_cli(capsys, "--model", str(path), "--data", str(tmp_path / "bad.gz"))
    assert rc == 2 and "bad.gz" in err
    (tmp_path / "one.txt").write_text("ba")
    rc, _, err = run_cli(capsys, "--model", str(path), "--data", str(tmp_path / "one.txt"))
    assert rc == 2 and "at least 2" in err


def test_missing_model_without_bundled_default_exit_2(capsys, tmp_path, monkeypatch):
    import pwruntime.cmd_perplexity as cp

    monkeypatch.setattr(cp, "default_model_dir", lambda: None)
    (tmp_path / "one.txt").write_text("some text")
    rc, _, err = run_cli(capsys, "--data", str(tmp_path / "one.txt"))
    assert rc == 2 and "--model" in err


def test_bundled_demo_model_is_the_default(capsys, tmp_path):
    import pwruntime.cmd_perplexity as cp

    bundled = cp.default_model_dir()
    assert bundled is not None and (bundled / "config.json").is_file()
    (tmp_path / "t.txt").write_text("In the beginning was the word, and the word was with the code.")
    rc, result, _ = run_cli(capsys, "--data", str(tmp_path / "t.txt"), "--context", "16", "--json")
    assert rc == 0
    assert Path(result["model"]).resolve() == bundled.resolve() and result["perplexity"] > 1


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
