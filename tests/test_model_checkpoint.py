"""Checkpoint loading: config parsing, tokenizer, dtypes, and one clear error (exit 2) per kind of bad checkpoint."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from model_fixtures import load_hf_model, make_tiny_checkpoint, tiny_words
from pwruntime.cli import main
from pwruntime.model import CheckpointError, load_model, parse_dtype, prefill_metadata
from traces.clikit import UserError


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("base"), "qwen2_moe", seed=2)


def _copy(base, tmp_path):
    return shutil.copytree(base, tmp_path / "ckpt")


def _edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def _drop_tensor(path, name):
    state = load_file(str(path / "model.safetensors"))
    del state[name]
    save_file(state, str(path / "model.safetensors"))


def _bin_only(path):
    (path / "model.safetensors").rename(path / "pytorch_model.bin")


BREAKERS = {
    "no config": (lambda p: (p / "config.json").unlink(), ["config.json"]),
    "no weights": (_bin_only, ["safetensors", ".bin"]),
    "no tokenizer": (lambda p: (p / "tokenizer.json").unlink(), ["tokenizer.json"]),
    "unknown arch": (lambda p: _edit_config(p, architectures=["LlamaForCausalLM"], model_type="llama"),
                     ["unsupported architecture LlamaForCausalLM", "MixtralForCausalLM"]),
    "wrong shape": (lambda p: _edit_config(p, moe_intermediate_size=40),
                    ["model.layers.0.mlp.experts.0.gate_proj.weight", "[32, 64]", "[40, 64]"]),
    "missing tensor": (lambda p: _drop_tensor(p, "model.layers.1.mlp.shared_expert_gate.weight"),
                       ["model.layers.1.mlp.shared_expert_gate.weight", "missing"]),
    "bad json": (lambda p: (p / "config.json").write_text("{not json"), ["config.json", "cannot read"]),
    "bad act": (lambda p: _edit_config(p, hidden_act="gelu"), ["gelu"]),
    "yarn rope": (lambda p: _edit_config(p, rope_parameters={"rope_type": "yarn", "factor": 4.0}), ["yarn"]),
    "no num_experts": (lambda p: _edit_config(p, num_experts=None), ["num_experts"]),
}


@pytest.mark.parametrize("kind", list(BREAKERS))
def test_bad_checkpoint_clear_error_and_exit_2(base, tmp_path, capsys, kind):
    path = _copy(base, tmp_path)
    breaker, needles = BREAKERS[kind]
    breaker(path)
    with pytest.raises(CheckpointError) as err:
        load_model(path)
    assert isinstance(err.value, UserError)
    for needle in needles:
        assert needle in str(err.value)
    data = tmp_path / "t.txt"
    data.write_text("ba be bi bo bu " * 10)
    assert main(["perplexity", "--model", str(path), "--data", str(data), "--context", "16"]) == 2
    stderr = capsys.readouterr().err
    assert needles[0] in stderr and "Traceback" not in stderr and len(stderr.strip().splitlines()) == 1


def test_missing_dir_and_missing_shard(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_model(tmp_path / "nowhere")
    sharded = make_tiny_checkpoint(tmp_path, "olmoe", max_shard_size="40KB")
    shards = sorted(sharded.glob("model-*.safetensors"))
    assert len(shards) > 1
    shards[1].unlink()
    with pytest.raises(CheckpointError, match=shards[1].name):
        load_model(sharded)


def test_config_fields(tmp_path):
    c = load_model(make_tiny_checkpoint(tmp_path, "qwen2_moe", num_hidden_layers=3, mlp_only_layers=[1])).config
    assert (c.arch, c.layers, c.hidden, c.heads, c.kv_heads, c.head_dim) == ("qwen2_moe", 3, 64, 4, 2, 16)
    assert (c.experts, c.top_k, c.expert_intermediate, c.shared_intermediate) == (4, 2, 32, 48)
    assert c.moe_layers == (0, 2) and c.num_moe_layers == 2 and c.dense_intermediate == 48
    assert c.qkv_bias and not c.norm_topk_prob and c.eos_token_id == 2 and c.max_position == 512
    q3 = load_model(make_tiny_checkpoint(tmp_path, "qwen3_moe")).config
    assert q3.head_dim == 24 and q3.qk_norm == "head" and q3.norm_topk_prob and q3.shared_intermediate == 0
    mx = load_model(make_tiny_checkpoint(tmp_path, "mixtral")).config
    assert mx.rope_theta == 1e6 and mx.norm_topk_prob and mx.qk_norm == "none" and mx.experts == 4


def test_tokenizer_and_chat_template(tmp_path):
    template = ("{% for m in messages %}<s> {{ m['role'] }} {{ m['content'] }} {% endfor %}"
                "{% if add_generation_prompt %}ba{% endif %}")
    model = load_model(make_tiny_checkpoint(tmp_path, "mixtral", chat_template=template))
    tok = model.tokenizer
    words = tiny_words()
    text = " ".join(words[:5])
    ids = tok.encode(text)
    assert ids == [3, 4, 5, 6, 7] and tok.decode(ids) == text
    assert tok.eos_id == 2 and tok.bos_id == 1 and tok.eos_token == "</s>"
    assert tok.decode([1, 3, 2]) == words[0] and tok.decode([1, 3, 2], skip_special_tokens=False) == "<s> ba </s>"
    rendered = tok.apply_chat_template([{"role": "be", "content": "bi bo"}])
    assert rendered == "<s> be bi bo ba"
    plain = load_model(make_tiny_checkpoint(tmp_path, "olmoe")).tokenizer
    assert plain.chat_template is None
    with pytest.raises(UserError, match="chat template"):
        plain.apply_chat_template([{"role": "user", "content": "x"}])


@pytest.mark.parametrize("dtype,tol", [("fp16", 0.05), ("bf16", 0.3)])
def test_half_precision_dtypes(tmp_path, dtype, tol):
    path = make_tiny_checkpoint(tmp_path, "olmoe", seed=4)
    ref = load_model(path)
    model = load_model(path, dtype=dtype)
    assert model.dtype == parse_dtype(dtype) and model.experts.weight(0, 0, "down").dtype == model.dtype
    kv = model.new_kv_cache(4, 4)
    assert kv.k[0].dtype == model.dtype
    ids = torch.tensor([1, 8, 30, 5, 77, 3, 9])
    run = lambda m, cache: m.logits(m.forward(ids, torch.arange(7), cache, prefill_metadata(7, 4)).hidden)
    got, want = run(model, kv), run(ref, ref.new_kv_cache(4, 4))
    assert got.dtype == torch.float32
    assert (got - want).abs().max() < tol
    with pytest.raises(UserError, match="dtype"):
        load_model(path, dtype="fp8")


def test_tied_embeddings(tmp_path):
    path = make_tiny_checkpoint(tmp_path, "qwen3_moe", tie_word_embeddings=True)
    model, hf = load_model(path), load_hf_model(path)
    ids = [1, 4, 9, 16, 25, 36]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    got = model.logits(model.forward(torch.tensor(ids), torch.arange(6), model.new_kv_cache(2, 4),
                                     prefill_metadata(6, 4)).hidden)
    assert torch.allclose(got, ref, atol=1e-4, rtol=0)
