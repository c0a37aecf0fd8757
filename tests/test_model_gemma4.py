"""Gemma 4 in the runtime beyond the parity tests (tests/test_model_parity.py): the published config's geometry against
its model card, the multimodal checkpoint's layout, what is refused, the CLI, and AP experts with GELU."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from model_fixtures import make_tiny_checkpoint
from pwruntime.cli import main
from pwruntime.kv_cache import KVCache
from pwruntime.model import load_model, prefill_metadata
from pwruntime.model.config import CheckpointError, parse_config
from traces.model_card import ModelSpec, load_card, read_card_json

PROMPT = [1, 17, 4, 99, 23, 56, 8, 8, 120, 64, 3, 77, 31, 45, 12, 90, 5, 66]
pytestmark = pytest.mark.usefixtures("one_thread")


def _logits(model, ids=PROMPT) -> torch.Tensor:
    hidden = model.forward(torch.tensor(ids), torch.arange(len(ids)), model.new_kv_cache(8, 4),
                           prefill_metadata(len(ids), 4)).hidden
    return model.logits(hidden)


def test_the_published_config_reads_as_the_card_says():
    """google/gemma-4-26B-A4B's config.json (as the card keeps it): 25 sliding layers of 8 KV heads of 256 and 5
    global ones of 2 KV heads of 512 without V, so a token's K and V are the card's 225,280 bytes in fp16."""
    card = load_card("Gemma-4-26B-A4B")
    c = parse_config(read_card_json("Gemma-4-26B-A4B")["hf_config"])
    assert (c.arch, c.layers, c.hidden, c.experts, c.top_k, c.expert_intermediate) == ("gemma4", 30, 2816, 128, 8, 704)
    assert c.global_layers == (5, 11, 17, 23, 29) == card.global_layers and c.global_k_eq_v
    assert c.kv_shape(0) == (8, 256) and c.kv_shape(5) == (2, 512)
    assert c.sliding_windows[0] == 1024 and c.sliding_windows[29] is None
    assert c.attention_reads[:6] == ((1024, 256),) * 5 + ((None, 512),)  # what each layer's attention reads
    assert (c.global_rope_fraction, c.global_rope_theta, c.rope_theta) == (0.25, 1e6, 1e4)
    assert c.weight_prefix == "model.language_model." and c.tie_word_embeddings and c.final_logit_softcap == 30.0
    assert c.dense_intermediate == 2112 and c.hidden_act == "gelu_tanh" and c.attention_scale == 1.0
    per_token = KVCache.bytes_per_block(c.layers, 16, c.kv_heads, c.head_dim, torch.float16, c.kv_shapes) // 16
    assert per_token == card.kv_bytes_per_token() == 225_280


def test_the_text_config_s_fields_come_first_and_absent_ones_take_transformers_defaults():
    """A multimodal config's EOS ids are its text model's where it names them; embeddings are tied unless a config
    says otherwise."""
    hf = json.loads(json.dumps(read_card_json("Gemma-4-26B-A4B")["hf_config"]))
    for cfg in (hf, hf["text_config"]):
        cfg.pop("tie_word_embeddings", None)
    hf["eos_token_id"], hf["text_config"]["eos_token_id"] = 1, [1, 106]
    c = parse_config(hf)
    assert c.tie_word_embeddings and c.eos_token_ids == (1, 106)


def test_a_saved_checkpoint_reads_as_its_card_reads_it(tmp_path):
    """transformers 5 saves the global layers' geometry as per_layer_config: the card and the runtime both read it."""
    path = make_tiny_checkpoint(tmp_path, "gemma4")
    cfg = json.loads((path / "config.json").read_text())
    assert "per_layer_config" in cfg and "global_head_dim" not in cfg
    card, c = ModelSpec.from_hf_config(cfg), load_model(path).config
    assert (card.global_head_dim, card.global_kv_heads) == (c.global_head_dim, c.global_kv_heads) == (32, 1)
    assert card.kv_bytes_per_token(4) == KVCache.bytes_per_block(c.layers, 1, 0, 0, torch.float32, c.kv_shapes)


def test_the_multimodal_checkpoint_layout_loads_its_text_model(tmp_path):
    """Gemma4ForConditionalGeneration, as published: config.json's text_config and the text model's tensors under
    model.language_model.; the same logits as the text-only checkpoint of the same weights."""
    src = make_tiny_checkpoint(tmp_path, "gemma4", seed=2)
    dest = tmp_path / "multimodal"
    dest.mkdir()
    text = json.loads((src / "config.json").read_text())
    (dest / "config.json").write_text(json.dumps({"architectures": ["Gemma4ForConditionalGeneration"],
                                                  "model_type": "gemma4", "text_config": text,
                                                  "vision_config": {"hidden_size": 8}}))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (dest / name).write_bytes((src / name).read_bytes())
    state = load_file(str(src / "model.safetensors"))
    save_file({k.replace("model.", "model.language_model.", 1): v for k, v in state.items()},
              str(dest / "model.safetensors"), metadata={"format": "pt"})
    one, two = load_model(src), load_model(dest)
    assert two.config.weight_prefix == "model.language_model."
    assert torch.equal(_logits(one), _logits(two))


@pytest.mark.parametrize("change, needle", [
    ({"enable_moe_block": False}, "no MoE blocks"),
    ({"hidden_size_per_layer_input": 64}, "per-layer inputs"),
    ({"num_kv_shared_layers": 1}, "KV-shared layers"),
    ({"hidden_activation": "relu"}, "hidden_activation 'relu'"),
    ({"layer_types": ["sliding_attention"]}, "must name num_hidden_layers (2) layers"),
    ({"rope_parameters": {"sliding_attention": {"rope_type": "yarn", "rope_theta": 1e4}}}, "rope types 'yarn'"),
])
def test_what_the_runtime_cannot_serve_is_one_clear_error(tmp_path, change, needle):
    path = make_tiny_checkpoint(tmp_path, "gemma4")
    cfg = json.loads((path / "config.json").read_text())
    with pytest.raises(CheckpointError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        parse_config({**cfg, **change})


def test_the_expert_count_takes_either_spelling_as_the_model_card_does(tmp_path):
    """Gemma 4's text config names it num_experts; num_local_experts alone is read as the card reads it, and the two
    at different values are refused, naming both."""
    path = make_tiny_checkpoint(tmp_path, "gemma4")
    cfg = json.loads((path / "config.json").read_text())
    base = {k: v for k, v in cfg.items() if k != "num_experts"}
    assert parse_config({**base, "num_local_experts": 6}).experts == 6
    assert parse_config({**base, "num_local_experts": 6}).experts == ModelSpec.from_hf_config(
        {**base, "num_local_experts": 6}).experts
    with pytest.raises(CheckpointError, match="num_local_experts 4 and num_experts 6: keep the one"):
        parse_config({**base, "num_experts": 6, "num_local_experts": 4})


def test_which_decode_steps_cuda_graphs_can_capture(tmp_path):
    """Decode steps wherever the attention kernel takes every layer's heads (not the tiny fixture's 16-wide ones; at
    Gemma 4's 256 and 512 it does)."""
    from pwruntime.cmd_perplexity import default_model_dir

    tiny = load_model(make_tiny_checkpoint(tmp_path, "gemma4"), dtype="bf16")
    assert not tiny.graph_attention
    sized = load_model(make_tiny_checkpoint(tmp_path, "gemma4", seed=1, hidden_size=128, num_attention_heads=4,
                                            num_key_value_heads=2, head_dim=256, global_head_dim=512), dtype="bf16")
    assert sized.graph_attention
    assert load_model(default_model_dir(), dtype="bf16").graph_attention


def test_generate_and_perplexity_from_the_cli(tmp_path, capsys):
    from model_fixtures import make_text

    path = make_tiny_checkpoint(tmp_path, "gemma4", seed=4)
    argv = ["generate", "--model", str(path), "--prompt", "ba be bi", "--max-tokens", "6", "--ignore-eos", "--json"]
    assert main(argv) == 0
    (out,) = json.loads(capsys.readouterr().out)["outputs"]
    assert len(out["token_ids"]) == 6 and out["finish_reason"] == "length"
    (tmp_path / "text.txt").write_text(make_text(300, seed=1))
    assert main(["perplexity", "--model", str(path), "--data", str(tmp_path / "text.txt"), "--context", "32",
                 "--json"]) == 0
    ppl = json.loads(capsys.readouterr().out)
    assert ppl["tokens"] > 100 and 1 < ppl["perplexity"] < 10 * 128


def test_ap_experts_serve_gemma4_with_gelu(tmp_path, capsys):
    """`pwruntime quantize` of a Gemma 4 checkpoint, then the AP store at 8 bits: its experts are the dense store's
    (GELU, not SiLU: those differ by far more than 8-bit codes do), the model's logits stay near the full-precision
    model's, and the pagedweight planner runs over the experts under pressure."""
    from pwruntime.quant.build import QuantizeOptions, quantize_checkpoint
    from pwruntime.quant.store import load_ap_model

    src = make_tiny_checkpoint(tmp_path, "gemma4", seed=5)
    quantize_checkpoint(src, tmp_path / "ap", QuantizeOptions(weighting="none"), progress=False)
    model, store = load_ap_model(tmp_path / "ap")
    full = load_model(src)
    assert store.activation == full.experts.activation == "gelu_tanh"
    x = torch.randn(20, 64, generator=torch.Generator().manual_seed(0))
    ids = torch.randint(0, 4, (20, 2), generator=torch.Generator().manual_seed(1))
    ids[:, 1] = (ids[:, 0] + 1) % 4
    w = torch.rand(20, 2, generator=torch.Generator().manual_seed(2))
    ref = full.experts.moe(1, x, ids, w)
    err = float((store.moe(1, x, ids, w) - ref).norm() / ref.norm())
    full.experts.activation = "silu"
    assert err < 0.02 and float((full.experts.moe(1, x, ids, w) - ref).norm() / ref.norm()) > 10 * err
    full.experts.activation = "gelu_tanh"
    dense, ap = _logits(full), _logits(model)
    assert float((ap - dense).abs().max()) < 0.05 * float(dense.abs().max())
    prompts = [a for p in ("ba be bi bo", "ka ke ki ko ku", "ma me") for a in ("--prompt", p)]
    assert main(["generate", "--ap", str(tmp_path / "ap"), "--calibration", "synthetic", "--policy", "pagedweight",
                 *prompts, "--max-tokens", "40", "--ignore-eos", "--num-kv-blocks", "8", "--block-size", "4",
                 "--no-hybrid-kv-cache", "--json"]) == 0  # one table: pressure enough to keep the bits lowered
    stats = json.loads(capsys.readouterr().out)["stats"]
    assert stats["plans"] > 0 and stats["mean_bits_end"] < stats["mean_bits_start"] and stats["kv_blocks"] > 8


@pytest.mark.parametrize("dtype, torch_dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_half_precision_errs_no_more_than_transformers_own(tmp_path, dtype, torch_dtype):
    """In bf16 and fp16 the runtime's logits are as far from the fp32 model's as transformers' own in that dtype."""
    from model_fixtures import load_hf_model
    import transformers

    path = make_tiny_checkpoint(tmp_path, "gemma4", seed=3)
    exact = load_hf_model(path)
    low = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch_dtype,
                                                            attn_implementation="eager").eval()
    with torch.no_grad():
        want, theirs = (m(torch.tensor([PROMPT])).logits[0].float() for m in (exact, low))
    ours = _logits(load_model(path, dtype=dtype))
    their_err, our_err = float((theirs - want).abs().max()), float((ours - want).abs().max())
    assert 0 < our_err <= 1.5 * their_err


@pytest.mark.parametrize("dtype, torch_dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_the_final_norm_weighs_in_float32_as_transformers_gemma4_norm_does(tmp_path, dtype, torch_dtype):
    """The final norm of a half-precision model: the weight applied in float32 before the cast back, bit for bit
    transformers' (a norm that casts first, as the other architectures' do, rounds differently)."""
    import transformers

    path = make_tiny_checkpoint(tmp_path, "gemma4", seed=3)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch_dtype,
                                                               attn_implementation="eager").eval().model.norm
    ours = load_model(path, dtype=dtype).norm
    x = 3 * torch.randn(64, ours.weight.shape[0], generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(ours(x.to(torch_dtype)), theirs(x.to(torch_dtype)))


@pytest.mark.parametrize("hybrid", [False, True], ids=["one-table", "hybrid-kv"])
def test_a_replay_and_its_simulation_decide_alike_step_by_step(tmp_path, capsys, hybrid):
    """The runtime's Gemma 4 under a planner's pressure (AP experts, synthetic calibration, `replay --record-routing`)
    and `pwsim run --like-replay`: no bundled card describes the tiny model, so the replay writes its card (the two
    KV geometries included) beside the routing, and the simulator takes every step's and transition's decision the
    runtime took. With hybrid KV groups (the default) both keep the sliding layer's KV in a group of its own (window 8
    of prompts up to 40 tokens: its pages go back as the sequences grow), the simulator because the replay did."""
    import numpy as np

    from pwsim.cli import main as sim_main
    from pwruntime.quant.build import QuantizeOptions, quantize_checkpoint
    from traces.io import CARD_FILE, write_requests
    from traces.schema import RequestTrace

    src = make_tiny_checkpoint(tmp_path, "gemma4", seed=6)
    quantize_checkpoint(src, tmp_path / "ap", QuantizeOptions(weighting="none"), progress=False)
    rng, k = np.random.default_rng(0), 24
    lengths = rng.integers(8, 40, k)
    (tmp_path / "load").mkdir()
    write_requests(tmp_path / "load" / "requests.parquet", RequestTrace.from_columns(
        np.arange(k), np.zeros(k), lengths, np.full(k, 24), np.array(["a"] * k),
        prompt_token_ids=[rng.integers(3, 128, n).tolist() for n in lengths]))
    rt, sim = tmp_path / "rt", tmp_path / "sim"
    assert main(["replay", "--trace", str(tmp_path / "load"), "--out", str(rt), "--ap", str(tmp_path / "ap"),
                 "--calibration", "synthetic", "--policy", "pagedweight", "--gpu-memory-budget", "760KiB",
                 "--dtype", "bf16", "--device", "cpu", "--time-scale", "0", "--record-routing"]
                + ["--no-hybrid-kv-cache"] * (not hybrid)) == 0
    card = ModelSpec.from_dict(json.loads((rt / "trace" / CARD_FILE).read_text()))
    assert card.global_head_dim == 32 and card.kv_bytes_per_token() == 2 * 2 * (2 * 16 + 32)
    capsys.readouterr()
    assert sim_main(["run", "--like-replay", str(rt), "--out", str(sim)]) == 0
    taken = capsys.readouterr().out
    assert f"--model {rt / 'trace' / CARD_FILE}" in taken
    assert (" --hybrid-kv-cache" in taken) == hybrid and ("--no-hybrid-kv-cache" in taken) != hybrid
    assert sim_main(["fidelity", "--sim", str(sim), "--runtime", str(rt), "--json",
                     "--out", str(tmp_path / "fid")]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["planner"]["plans"]["runtime"] > 5  # under pressure
    assert report["scheduler"]["hybrid_kv_cache"] == {"sim": hybrid, "runtime": hybrid}
    d, t = report["decisions"], report["transitions"]
    assert d["first_difference"] is None and d["agreeing_steps"] == d["steps"] > 20, d
    assert t["first_difference"] is None and t["sim"] == t["runtime"] and t["runtime"]["started"] > 10, t
    if hybrid:  # a replay from before hybrid KV groups (no such key in its config) ran one table: simulated so
        config = json.loads((rt / "config.json").read_text())
        (rt / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "hybrid_kv_cache"}))
        assert sim_main(["run", "--like-replay", str(rt), "--out", str(tmp_path / "old"), "--no-plots"]) == 0
        assert "--no-hybrid-kv-cache" in capsys.readouterr().out
        assert json.loads((tmp_path / "old" / "config.json").read_text())["hybrid_kv"] is False
