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
from pwruntime.model.config import parse_config
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


def _narrow_tensor(path, name):
    state = load_file(str(path / "model.safetensors"))
    state[name] = state[name][:, :-4].contiguous()   # the first dimension right, the second not
    save_file(state, str(path / "model.safetensors"))


def _add_special_token(path, token):
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    tok.add_special_tokens([token])   # an added token: its id is past the model's vocabulary
    tok.save(str(path / "tokenizer.json"))


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
    "narrow tensor": (lambda p: _narrow_tensor(p, "model.layers.0.mlp.gate.weight"),
                      ["model.layers.0.mlp.gate.weight", "[4, 60]", "[4, 64]"]),
    "missing tensor": (lambda p: _drop_tensor(p, "model.layers.1.mlp.shared_expert_gate.weight"),
                       ["model.layers.1.mlp.shared_expert_gate.weight", "missing"]),
    "tokenizer past the vocab": (lambda p: _add_special_token(p, "<extra>"),
                                 ["tokenizer.json has 129 tokens", "vocab_size is 128"]),
    "bad json": (lambda p: (p / "config.json").write_text("{not json"), ["config.json", "cannot read"]),
    "json not an object": (lambda p: (p / "config.json").write_text("[1, 2]"), ["config.json", "not a JSON object"]),
    "empty index": (lambda p: (p / "model.safetensors.index.json").write_text('{"weight_map": {}}'),
                    ["model.safetensors.index.json", "weight_map"]),
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


def test_optional_files_are_optional_and_generation_config_adds_its_eos_ids(base, tmp_path):
    path = _copy(base, tmp_path)
    (path / "tokenizer_config.json").unlink(missing_ok=True)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 5]}))
    (path / "model.safetensors").rename(path / "weights.safetensors")   # no index: every *.safetensors is read
    model = load_model(path)
    assert model.config.eos_token_ids == (2, 5) and model.tokenizer.eos_id == 2
    assert model.tokenizer.chat_template is None


def test_a_cuda_device_without_a_gpu_is_a_user_error(base, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UserError, match="no CUDA GPU is available"):
        load_model(base, device="cuda")


def test_a_tied_checkpoint_that_stores_its_own_lm_head_reads_it_as_transformers_does(base, tmp_path):
    """tie_word_embeddings with an lm_head.weight of other values in the file: transformers keeps the stored head
    (it ties only what the file leaves out), and so does the loader; without one the head is the embedding."""
    path = _copy(base, tmp_path)
    _edit_config(path, tie_word_embeddings=True)
    state = load_file(str(path / "model.safetensors"))
    state["lm_head.weight"] = torch.randn_like(state["model.embed_tokens.weight"])
    save_file(state, str(path / "model.safetensors"))
    ours, theirs = load_model(path), load_hf_model(path)
    assert torch.equal(ours.lm_head, state["lm_head.weight"])
    assert torch.equal(theirs.lm_head.weight, state["lm_head.weight"])
    _drop_tensor(path, "lm_head.weight")
    assert torch.equal(load_model(path).lm_head, state["model.embed_tokens.weight"])


def test_missing_dir_and_missing_shard(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_model(tmp_path / "nowhere")
    sharded = make_tiny_checkpoint(tmp_path, "olmoe", max_shard_size="40KB")
    shards = sorted(sharded.glob("model-*.safetensors"))
    assert len(shards) > 1
    shards[1].unlink()
    with pytest.raises(CheckpointError, match=f"lacks shard.*{shards[1].name}"):   # before any file is opened
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


def _config(arch: str, **changes) -> dict:
    """A small config.json of `arch` with only the fields it needs (older or hand-written checkpoints leave the rest
    out: transformers' defaults apply), plus `changes`."""
    cfg = {"architectures": [arch], "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 5,
           "vocab_size": 100, "num_experts_per_tok": 2, "intermediate_size": 48}
    cfg.update({"Qwen2MoeForCausalLM": {"num_experts": 4, "moe_intermediate_size": 32},
                "Qwen3MoeForCausalLM": {"num_experts": 4, "moe_intermediate_size": 32},
                "OlmoeForCausalLM": {"num_experts": 4}, "MixtralForCausalLM": {"num_local_experts": 4}}[arch])
    return {**cfg, **changes}


@pytest.mark.parametrize("arch", ["MixtralForCausalLM", "OlmoeForCausalLM", "Qwen2MoeForCausalLM",
                                  "Qwen3MoeForCausalLM"])
def test_the_expert_count_takes_either_spelling_and_refuses_two_that_disagree(arch):
    """transformers spells it num_local_experts or num_experts. Which one it takes from a config that gives both at
    different values depends on its version and the architecture (5.25: Mixtral's num_experts, OLMoE's
    num_local_experts), so such a config is refused, naming both."""
    base = {k: v for k, v in _config(arch).items() if k not in ("num_experts", "num_local_experts")}
    for key in ("num_experts", "num_local_experts"):
        assert parse_config({**base, key: 6}).experts == 6
    assert parse_config({**base, "num_experts": 6, "num_local_experts": 6}).experts == 6
    with pytest.raises(CheckpointError, match="num_local_experts 4 and num_experts 6: keep the one"):
        parse_config({**base, "num_experts": 6, "num_local_experts": 4})


def test_config_defaults_and_layer_kinds_follow_transformers():
    """Fields a config.json leaves out take transformers' defaults, and the layers' kinds (MoE or dense, sliding or
    not) follow its Qwen2-MoE rules: MoE every decoder_sparse_step-th layer, sliding windows only with
    use_sliding_window, on odd-numbered layers below max_window_layers."""
    q2 = parse_config(_config("Qwen2MoeForCausalLM"))
    assert q2.moe_layers == (0, 1, 2, 3, 4) and q2.kv_heads == 4 and q2.head_dim == 16 and not q2.tie_word_embeddings
    assert q2.qkv_bias and not q2.norm_topk_prob and q2.sliding_windows == (None,) * 5
    assert parse_config(_config("Qwen2MoeForCausalLM", sliding_window=8)).sliding_windows == (None,) * 5
    slide = parse_config(_config("Qwen2MoeForCausalLM", use_sliding_window=True, sliding_window=8, max_window_layers=2))
    assert slide.sliding_windows == (8, None, None, None, None)
    q3 = parse_config(_config("Qwen3MoeForCausalLM", attention_bias=True))
    assert not q3.norm_topk_prob and q3.qkv_bias and q3.o_bias
    assert parse_config(_config("OlmoeForCausalLM", sliding_window=8)).sliding_windows == (None,) * 5
    mx = parse_config(_config("MixtralForCausalLM", head_dim=32, sliding_window=8))
    assert (mx.head_dim, mx.experts, mx.sliding_windows) == (32, 4, (8,) * 5)
    eos = parse_config(_config("OlmoeForCausalLM", eos_token_id=2), {"eos_token_id": [2, 7]})
    assert (eos.eos_token_id, eos.eos_token_ids) == (2, (2, 7))
    with pytest.raises(CheckpointError, match="partial_rotary_factor"):
        parse_config(_config("Qwen3MoeForCausalLM", partial_rotary_factor=0.5))
    assert parse_config({**_config("MixtralForCausalLM", model_type="mixtral"), "architectures": []}).arch == "mixtral"
    with pytest.raises(CheckpointError, match="unsupported architecture MixtralForSequenceClassification"):
        parse_config(_config("MixtralForCausalLM", architectures=["MixtralForSequenceClassification"],
                             model_type="mixtral"))


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


def test_special_tokens_as_added_token_dicts_and_config_json_s_eos_first(base, tmp_path):
    """Older tokenizer_config.json files spell special tokens as AddedToken dicts; config.json's EOS id wins over the
    tokenizer's EOS token."""
    from pwruntime.model.tokenizer import Tokenizer

    cfg = tmp_path / "tokenizer_config.json"
    cfg.write_text(json.dumps({"bos_token": {"content": "<s>", "lstrip": False}, "eos_token": {"content": "</s>"}}))
    tok = Tokenizer(base / "tokenizer.json", cfg)
    assert (tok.bos_token, tok.bos_id, tok.eos_token, tok.eos_id) == ("<s>", 1, "</s>", 2)
    assert Tokenizer(base / "tokenizer.json", cfg, eos_token_id=5).eos_id == 5
    bare = Tokenizer(base / "tokenizer.json", None, eos_token_id=2)   # no tokenizer_config.json: the EOS id names it
    assert (bare.eos_token, bare.bos_token, bare.bos_id) == ("</s>", None, None)


def test_the_chat_template_is_the_default_of_a_named_list_else_chat_template_jinja(base, tmp_path):
    from pwruntime.model.tokenizer import Tokenizer

    shutil.copy(base / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "chat_template.jinja").write_text("from the jinja file")
    cfg = tmp_path / "tokenizer_config.json"
    named = [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": "plain"}]
    for template, want in ((named, "plain"), ("from the config", "from the config"), (None, "from the jinja file")):
        cfg.write_text(json.dumps({"chat_template": template}))
        assert Tokenizer(tmp_path / "tokenizer.json", cfg).chat_template == want
    cfg.write_text(json.dumps({"chat_template": "{{ bos_token }}{{ messages[0]['content'] }}{{ eos_token }}",
                               "bos_token": "<s>", "eos_token": "</s>"}))
    assert Tokenizer(tmp_path / "tokenizer.json", cfg).apply_chat_template([{"role": "user", "content": "ba"}]) == \
        "<s>ba</s>"


def test_the_chat_template_renders_as_transformers_renders_it(base, tmp_path):
    """Jinja as transformers sets it up (block tags trim their newline and the indentation before them), the generation
    prompt only when asked, extra variables passed through, and the template's raise_exception message as the error."""
    import transformers
    from pwruntime.model.tokenizer import Tokenizer

    template = ("{% for m in messages %}\n"
                "  {% if m['role'] == 'bad' %}{{ raise_exception('no role ' + m['role']) }}{% endif %}\n"
                "{{ bos_token }}{{ m['role'] }}: {{ m['content'] }}{{ eos_token }}\n"
                "  {% endfor %}\n"
                "{% if add_generation_prompt %}{{ greeting }}:{% endif %}")
    shutil.copy(base / "tokenizer.json", tmp_path / "tokenizer.json")
    cfg = tmp_path / "tokenizer_config.json"
    cfg.write_text(json.dumps({"chat_template": template, "bos_token": "<s>", "eos_token": "</s>"}))
    ours = Tokenizer(tmp_path / "tokenizer.json", cfg)
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    messages = [{"role": "user", "content": "ba be"}, {"role": "assistant", "content": "bi"}]
    for generation_prompt in (True, False):
        want = theirs.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False,
                                          greeting="bo")
        assert ours.apply_chat_template(messages, add_generation_prompt=generation_prompt, greeting="bo") == want
    assert want == "<s>user: ba be</s>\n<s>assistant: bi</s>\n"
    with pytest.raises(UserError, match="chat template failed: no role bad"):
        ours.apply_chat_template([{"role": "bad", "content": "ba"}])


def test_special_tokens_details_the_chat_template_and_the_prompt_budget_rely_on(base, tmp_path):
    """config.json's EOS id leaves tokenizer_config.json's EOS token the templates' `eos_token`; a named template list
    without a "default" gives its first; the longest token counts added tokens; a tokenizer_config.json that is not
    UTF-8 is a checkpoint error."""
    from pwruntime.model.tokenizer import Tokenizer

    cfg = tmp_path / "tokenizer_config.json"
    cfg.write_text(json.dumps({"eos_token": "</s>", "chat_template": [{"name": "rag", "template": "first"},
                                                                      {"name": "tool_use", "template": "second"}]}))
    tok = Tokenizer(base / "tokenizer.json", cfg, eos_token_id=5)
    assert (tok.eos_token, tok.eos_id, tok.chat_template) == ("</s>", 5, "first")
    path = _copy(base, tmp_path)
    _add_special_token(path, "<|an added token longer than any word|>")
    assert Tokenizer(path / "tokenizer.json").longest_token_chars() == len("<|an added token longer than any word|>")
    cfg.write_bytes(b'{"eos_token": "\xff"}')
    with pytest.raises(CheckpointError, match="cannot read"):
        Tokenizer(base / "tokenizer.json", cfg)


def test_special_tokens_and_templates_of_other_types_are_ignored_not_a_crash(base, tmp_path):
    """A special token that is neither a string nor an AddedToken dict, a template list's entries that are not dicts
    and a chat_template of another type count as absent."""
    from pwruntime.model.tokenizer import Tokenizer

    cfg = tmp_path / "tokenizer_config.json"
    cfg.write_text(json.dumps({"bos_token": 1, "eos_token": ["</s>"],
                               "chat_template": ["junk", {"name": "default", "template": "plain"}]}))
    tok = Tokenizer(base / "tokenizer.json", cfg)
    assert (tok.bos_token, tok.bos_id, tok.eos_token, tok.eos_id) == (None, None, None, None)
    assert tok.chat_template == "plain"
    cfg.write_text(json.dumps({"chat_template": {"default": "plain"}}))
    assert Tokenizer(base / "tokenizer.json", cfg).chat_template is None


def test_encode_adds_the_post_processor_s_bos_only_when_asked():
    from pwruntime.cmd_perplexity import default_model_dir
    from pwruntime.model.tokenizer import Tokenizer

    root = default_model_dir()
    tok = Tokenizer(root / "tokenizer.json", root / "tokenizer_config.json")
    ids = tok.encode("And God said")
    assert tok.bos_id is not None and ids[0] == tok.bos_id and tok.encode("And God said", False) == ids[1:]


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


def test_tied_embeddings_count_once_in_the_weight_bytes_and_positions_must_match_the_ids(tmp_path):
    model = load_model(make_tiny_checkpoint(tmp_path, "qwen3_moe", tie_word_embeddings=True))
    assert model.lm_head.data_ptr() == model.embed.data_ptr()
    assert model.weight_bytes() == sum(p.nbytes for p in model.parameters()) - model.lm_head.nbytes
    with pytest.raises(ValueError, match="6 input ids and 5 positions"):
        model.forward(torch.arange(1, 7), torch.arange(5), model.new_kv_cache(2, 4), prefill_metadata(6, 4))
