"""Demo-model training: determinism, exact resumption, settings checks, HF export and loading."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

sys.path.insert(0, str(Path(__file__).parent))
from demo_fixtures import run_tiny, tiny_config, write_corpus  # noqa: E402

from traces.clikit import UserError  # noqa: E402

_TIMING = ("tokens_per_s", "elapsed_s")


pytestmark = pytest.mark.usefixtures("one_thread")   # tiny tensors; results stay reproducible


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def run_a(corpus, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("run_a")
    res = run_tiny(corpus, out)
    assert res.finished and res.step == 20
    return out


def _log(out: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if k not in _TIMING}
            for line in (out / "train_log.jsonl").read_text().splitlines()]


def _weights(out: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(out / "model" / "model.safetensors"))


def _assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = _weights(a), _weights(b)
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k


def test_same_seed_gives_identical_log_and_weights(corpus, run_a, tmp_path):
    run_tiny(corpus, tmp_path / "b")
    log = _log(run_a)
    assert [r["step"] for r in log if r["type"] == "train"] == [5, 10, 15, 20]
    assert [r["step"] for r in log if r["type"] == "eval"] == [10, 20]
    assert log[-1]["valid_loss"]["pydocs"] < log[2]["valid_loss"]["pydocs"]  # it learns
    assert _log(tmp_path / "b") == log
    _assert_same_weights(run_a, tmp_path / "b")


def test_other_seed_gives_other_run(corpus, run_a, tmp_path):
    run_tiny(corpus, tmp_path / "s1", tiny_config(seed=1), stop_at=5)
    assert _log(tmp_path / "s1")[0]["loss"] != _log(run_a)[0]["loss"]


def test_resume_after_stops_matches_uninterrupted_run(corpus, run_a, tmp_path):
    out = tmp_path / "c"
    first = run_tiny(corpus, out, max_minutes=1e-6)       # budget already spent: stops after one step
    assert not first.finished and first.step == 1 and (out / "checkpoint.pt").exists()
    assert not (out / "model").exists()
    second = run_tiny(corpus, out, stop_at=8)              # 8 is not a log step: accumulators are resumed
    assert not second.finished and second.step == 8
    last = run_tiny(corpus, out)
    assert last.finished and last.step == 20
    assert _log(out) == _log(run_a)
    _assert_same_weights(run_a, out)
    again = run_tiny(corpus, out)                          # nothing left to do: a no-op that reports done
    assert again.finished and again.model_dir


def test_resume_refuses_changed_settings_and_no_resume_starts_over(corpus, tmp_path):
    out = tmp_path / "d"
    run_tiny(corpus, out, stop_at=3)
    with pytest.raises(UserError, match="steps"):
        run_tiny(corpus, out, tiny_config(steps=30))
    res = run_tiny(corpus, out, tiny_config(steps=6, log_every=3, eval_every=6), resume=False)
    assert res.finished and [r["step"] for r in _log(out) if r["type"] == "train"] == [3, 6]


def _checkpoint_model(out: Path):
    from pwruntime.demo.model import build_model

    ck = torch.load(out / "checkpoint.pt", weights_only=True)
    model = build_model(tiny_config().model, eos_token_id=0, seed=0)
    model.load_state_dict(ck["model"])
    return model.eval()


def test_saved_model_loads_in_transformers_with_same_logits(run_a):
    from transformers import AutoModelForCausalLM

    mdir = run_a / "model"
    names = sorted(p.name for p in mdir.iterdir())
    assert names == ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                     "tokenizer_config.json"]
    assert all(p.stat().st_size < 16 * 2**20 for p in mdir.iterdir())
    keys = set(_weights(run_a))
    assert "model.layers.1.mlp.experts.15.gate_proj.weight" in keys
    assert not any(k.endswith("gate_up_proj") or k == "lm_head.weight" for k in keys)
    cfg = json.loads((mdir / "config.json").read_text())
    assert cfg["tie_word_embeddings"] and cfg["eos_token_id"] == 0 and cfg["num_experts"] == 16

    ours = _checkpoint_model(run_a)
    loaded = AutoModelForCausalLM.from_pretrained(str(mdir), dtype=torch.float32).eval()
    x = torch.randint(1, 300, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        a, b = ours(input_ids=x).logits, loaded(input_ids=x).logits
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


def test_fp16_sharded_export_roundtrip(run_a, tmp_path):
    from transformers import AutoModelForCausalLM

    from pwruntime.demo.export import save_hf_model

    ours = _checkpoint_model(run_a)
    mdir = save_hf_model(ours, tmp_path / "m16", run_a / "tokenizer", "float16", max_shard_bytes=48 * 1024)
    index = json.loads((mdir / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 3 and all((mdir / s).stat().st_size <= 64 * 1024 for s in shards)
    gate_up = ours.model.layers[0].mlp.experts.gate_up_proj.detach()
    from safetensors import safe_open
    with safe_open(str(mdir / index["weight_map"]["model.layers.0.mlp.experts.3.up_proj.weight"]), "pt") as f:
        up3 = f.get_tensor("model.layers.0.mlp.experts.3.up_proj.weight")
    assert up3.dtype == torch.float16 and torch.equal(up3, gate_up[3, 16:].half())

    loaded = AutoModelForCausalLM.from_pretrained(str(mdir), dtype=torch.float32).eval()
    rounded = _checkpoint_model(run_a)
    with torch.no_grad():
        for p in rounded.parameters():
            p.copy_(p.half().float())
    x = torch.randint(1, 300, (1, 16), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=x).logits, rounded(input_ids=x).logits, rtol=1e-5, atol=1e-5)


def test_tokenizer_is_lossless_adds_bos_and_loads_in_transformers(run_a):
    from transformers import AutoTokenizer

    from pwruntime.demo.tokenizer_train import load_tokenizer

    tok = load_tokenizer(run_a / "model")
    text = "    >>> def f(x):\n\treturn x  # café ✓"
    enc = tok.encode(text)
    assert enc.ids[0] == tok.token_to_id("<|endoftext|>") == 0
    assert tok.decode(enc.ids, skip_special_tokens=True) == text
    hf = AutoTokenizer.from_pretrained(str(run_a / "model"))
    assert hf(text).input_ids == enc.ids and hf.eos_token_id == 0
    chat = hf.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert chat == "<|endoftext|>hi\n"
