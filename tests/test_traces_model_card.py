"""Model cards: published totals, exact counts vs transformers, AP byte tables, KV bytes, HF configs, errors."""
from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from policies.apformat import ap_block_bytes
from traces.model_card import CardError, ModelSpec, available_cards, load_card, read_card_json

CARDS = ("Qwen1.5-MoE-A2.7B", "Mixtral-8x7B-v0.1", "OLMoE-1B-7B-0924", "Qwen3-30B-A3B", "Gemma-4-26B-A4B")


def test_the_five_cards_and_the_demo_card_are_bundled():
    assert sorted(available_cards()) == sorted([*CARDS, "PagedWeight-demo"])


def test_demo_card_matches_the_bundled_model():
    import json

    from pwruntime.cmd_perplexity import default_model_dir

    config = json.loads((default_model_dir() / "config.json").read_text())
    card = load_card("PagedWeight-demo")
    assert card.total_params() == 9_721_088
    assert card.fingerprint() == ModelSpec.from_hf_config(config).fingerprint()


@pytest.mark.parametrize("name, published", [("Qwen1.5-MoE-A2.7B", 14.3e9), ("Mixtral-8x7B-v0.1", 46.7e9)])
def test_totals_match_the_issue_figures(name, published):
    assert abs(load_card(name).total_params() / published - 1) < 0.02


@pytest.mark.parametrize("name", CARDS)
def test_every_card_cites_and_matches_its_published_sizes(name):
    spec = load_card(name)
    assert spec.source and spec.published_source and spec.hf_id
    assert abs(spec.total_params() / spec.published_params - 1) < 0.02
    assert abs(spec.active_params() / spec.published_active_params - 1) < 0.05
    assert spec.fp16_bytes() == 2 * spec.total_params()
    assert 0.8 < spec.expert_share() < 1.0


@pytest.mark.parametrize("name", CARDS)
def test_card_equals_its_hf_config(name):
    spec, raw = load_card(name), read_card_json(name)
    from_hf = ModelSpec.from_hf_config(raw["hf_config"], name=name)
    assert from_hf.architecture() == spec.architecture()
    assert from_hf.fingerprint() == spec.fingerprint()


@pytest.mark.parametrize("name", CARDS)
def test_parameter_count_equals_transformers(name):
    """Instantiate the real transformers model (meta device, 2 layers) and count its parameters."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    cfg = json.loads(json.dumps(read_card_json(name)["hf_config"]))
    text = cfg.get("text_config", cfg)
    text["num_hidden_layers"] = 2
    if "layer_types" in text:
        text["layer_types"] = ["sliding_attention", "full_attention"]
    if name == "Qwen3-30B-A3B":
        text["mlp_only_layers"] = [0]  # exercise a dense layer too
    kw = {k: v for k, v in text.items() if k != "model_type"}
    hf = transformers.AutoConfig.for_model(text["model_type"], **kw)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf)
    expected = sum(p.numel() for p in model.parameters())
    assert ModelSpec.from_hf_config(cfg).total_params() == expected


@pytest.mark.parametrize("name", CARDS)
def test_byte_tables_come_from_apformat(name):
    spec = load_card(name)
    table = spec.block_byte_table()
    H, I = spec.hidden, spec.expert_intermediate
    for b in range(9):
        assert table[0, b] == ap_block_bytes(2 * I, H, b) and table[1, b] == ap_block_bytes(H, I, b)
        assert spec.expert_bytes(b) == (table[0, b] + table[1, b]) * spec.moe_layers * spec.experts
    pt = spec.page_table(initial_bits=4)
    assert pt.num_blocks == spec.moe_layers * spec.experts * 2
    np.testing.assert_array_equal(pt.M[0], table[0])
    np.testing.assert_array_equal(pt.M[-1], table[1])
    assert pt.committed_bytes() == spec.expert_bytes(4)


def test_kv_bytes_per_token():
    assert load_card("Mixtral-8x7B-v0.1").kv_bytes_per_token() == 32 * 2 * 8 * 128 * 2
    assert load_card("Qwen1.5-MoE-A2.7B").kv_bytes_per_token() == 24 * 2 * 16 * 128 * 2
    gemma = load_card("Gemma-4-26B-A4B")
    sliding, full = 2 * 8 * 256 * 2, 2 * 2 * 512 * 2
    assert gemma.kv_bytes_per_token() == 25 * sliding + 5 * full
    assert gemma.kv_bytes(4096) == 25 * sliding * 1024 + 5 * full * 4096
    assert gemma.kv_bytes(100) == 100 * gemma.kv_bytes_per_token()


def test_fingerprint_follows_architecture_not_names():
    spec = load_card("OLMoE-1B-7B-0924")
    assert replace(spec, name="other", source="x", published_params=1).fingerprint() == spec.fingerprint()
    assert replace(spec, top_k=4).fingerprint() != spec.fingerprint()
    assert spec.fingerprint(weights_digest="abc").endswith("+w:abc")


def test_qwen_sparse_step_and_mlp_only_layers():
    cfg = dict(read_card_json("Qwen3-30B-A3B")["hf_config"], num_hidden_layers=6, decoder_sparse_step=2,
               mlp_only_layers=[5])
    spec = ModelSpec.from_hf_config(cfg)
    assert spec.dense_layers == (0, 2, 4, 5) and spec.moe_layer_ids() == (1, 3) and spec.moe_layers == 2
    assert spec.page_table().layers == 2


def test_load_card_by_name_path_and_checkpoint_dir(tmp_path):
    assert load_card("mixtral-8x7b-v0.1").name == "Mixtral-8x7B-v0.1"
    card = tmp_path / "mine.json"
    card.write_text(json.dumps(load_card("Qwen3-30B-A3B").to_dict()))
    assert load_card(card).fingerprint() == load_card("Qwen3-30B-A3B").fingerprint()
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(read_card_json("Mixtral-8x7B-v0.1")["hf_config"]))
    spec = load_card(tmp_path / "ckpt")
    assert spec.name == "ckpt" and spec.fingerprint() == load_card("Mixtral-8x7B-v0.1").fingerprint()


def test_card_errors_are_clear(tmp_path):
    with pytest.raises(CardError, match="available cards: .*Mixtral-8x7B-v0.1"):
        load_card("Mixtral-8x22B")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(dict(load_card("Qwen3-30B-A3B").to_dict(), top_k=999)))
    with pytest.raises(CardError, match="top_k 999 exceeds experts 128"):
        load_card(bad)
    bad.write_text(json.dumps(dict(load_card("Qwen3-30B-A3B").to_dict(), layerz=3)))
    with pytest.raises(CardError, match="unknown field"):
        load_card(bad)
    bad.write_text("{not json")
    with pytest.raises(CardError, match="cannot read"):
        load_card(bad)
    with pytest.raises(CardError, match="not supported"):
        ModelSpec.from_hf_config({"model_type": "llama", "hidden_size": 8})
    with pytest.raises(CardError, match="lacks 'num_local_experts'"):
        ModelSpec.from_hf_config({k: v for k, v in read_card_json("Mixtral-8x7B-v0.1")["hf_config"].items()
                                  if k != "num_local_experts"})
    mixtral = read_card_json("Mixtral-8x7B-v0.1")["hf_config"]
    assert ModelSpec.from_hf_config({**mixtral, "num_experts": 8}).experts == 8
    with pytest.raises(CardError, match="num_local_experts 8 and num_experts 16"):
        ModelSpec.from_hf_config({**mixtral, "num_experts": 16})


@pytest.mark.parametrize("change, needle", [
    (dict(layers=0), "layers must be a positive integer"),
    (dict(hidden=2.5), "hidden must be a positive integer"),
    (dict(dense_layers=(48,)), "dense_layers must lie in 0..47"),
    (dict(dense_layers=tuple(range(48)), dense_intermediate=64), "every layer is dense"),
    (dict(dense_layers=(0,), dense_intermediate=0), "dense_layers needs a positive dense_intermediate"),
    (dict(shared_experts=1, shared_intermediate=0), "shared_experts needs a positive shared_intermediate"),
])
def test_each_bad_card_field_alone_is_refused(change, needle):
    with pytest.raises(CardError, match=needle):
        replace(load_card("Qwen3-30B-A3B"), **change)


def test_card_fields_at_their_bounds_are_taken():
    card = load_card("Qwen3-30B-A3B")
    assert replace(card, top_k=card.experts).top_k == 128  # every expert active: still a card
    assert replace(card, dense_layers=tuple(range(47)), dense_intermediate=64).moe_layers == 1


def test_an_output_bias_counts_one_hidden_vector_a_layer():
    card = load_card("Mixtral-8x7B-v0.1")
    assert replace(card, o_bias=True).attention_params(0) - card.attention_params(0) == card.hidden


def test_kv_layout_is_hybrid_by_default_with_full_attention_on_global_layers():
    gemma = load_card("Gemma-4-26B-A4B")
    layout = gemma.kv_layout(16)
    assert layout.hybrid and not gemma.kv_layout(16, hybrid=False).hybrid
    window = {layer: group.window for group in layout.groups for layer in group.layers}
    assert all(window[layer] is None for layer in gemma.global_layers)
    assert {window[layer] for layer in range(gemma.layers) if layer not in gemma.global_layers} == {1024}
    assert [g.window for g in load_card("Qwen3-30B-A3B").kv_layout(16).groups] == [None]


def test_hf_config_defaults_and_names():
    """A config without `_name_or_path` is named by its architecture; one giving only `num_experts` for Mixtral is
    read; absent flags take transformers' defaults (no attention bias; tied embeddings only for Gemma 4); a Qwen1.5
    config without a shared expert has none."""
    mixtral = read_card_json("Mixtral-8x7B-v0.1")["hf_config"]
    assert ModelSpec.from_hf_config(mixtral).name == "mixtral"
    assert ModelSpec.from_hf_config({**mixtral, "_name_or_path": "org/m"}).name == "org/m"
    only_new = {k: v for k, v in mixtral.items() if k != "num_local_experts"}
    assert ModelSpec.from_hf_config({**only_new, "num_experts": 8}).experts == 8
    bare = {k: v for k, v in mixtral.items() if k != "tie_word_embeddings"}
    assert ModelSpec.from_hf_config(bare).tied_embeddings is False
    gemma = load_card("Gemma-4-26B-A4B")
    assert gemma.tied_embeddings is True and gemma.qkv_bias is False
    olmoe = {k: v for k, v in read_card_json("OLMoE-1B-7B-0924")["hf_config"].items() if k != "attention_bias"}
    assert ModelSpec.from_hf_config(olmoe).qkv_bias is False
    qwen = {**read_card_json("Qwen1.5-MoE-A2.7B")["hf_config"], "shared_expert_intermediate_size": 0}
    spec = ModelSpec.from_hf_config(qwen)
    assert (spec.shared_experts, spec.shared_expert_gate) == (0, False)


def test_a_card_json_without_arch_says_so(tmp_path):
    data = load_card("Qwen3-30B-A3B").to_dict()
    del data["arch"]
    (tmp_path / "c.json").write_text(json.dumps(data))
    with pytest.raises(CardError, match="missing field.*arch"):
        load_card(tmp_path / "c.json")
