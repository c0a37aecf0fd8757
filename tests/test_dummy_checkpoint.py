"""`pwruntime quantize --load-format dummy`: AP checkpoints of random weights at a model's shapes, served with a
synthetic calibration that is the simulator's own."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from model_fixtures import CPU_ARCHS, make_tiny_checkpoint
from pwruntime.cli import main
from pwruntime.model.attention_plan import prefill_metadata
from pwruntime.model.checkpoint import find_files, read_config
from pwruntime.model.dummy import DummyTensorReader
from pwruntime.quant.ap_checkpoint import load_ap_checkpoint
from pwruntime.quant.store import load_ap_model


def _quantize(capsys, *argv) -> dict:
    assert main(["quantize", "--load-format", "dummy", "--json", *argv]) == 0
    return json.loads(capsys.readouterr().out)


def _config_only(src, dest):
    """A folder with `src`'s config.json and tokenizer files and no weights."""
    dest.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        if (src / name).is_file():
            shutil.copy(src / name, dest / name)
    return dest


def test_a_bundled_card_becomes_a_checkpoint_of_its_shapes_the_same_for_the_same_seed(tmp_path, capsys):
    a = _quantize(capsys, "--model", "PagedWeight-demo", "--out", str(tmp_path / "a"))
    _quantize(capsys, "--model", "PagedWeight-demo", "--out", str(tmp_path / "b"))
    _quantize(capsys, "--model", "PagedWeight-demo", "--out", str(tmp_path / "c"), "--seed", "1")
    ck = load_ap_checkpoint(tmp_path / "a")
    assert (ck.experts, ck.hidden, ck.intermediate, ck.num_moe_layers) == (16, 256, 128, 4)
    assert a["blocks"] == 4 * 16 * 2 and ck.meta["load_format"] == "dummy"
    assert ck.meta["seed_bits"] == min(ck.meta["bits"]) == 3   # the lowest bitwidth, as `quantize` writes it
    assert ck.meta["source"]["fingerprint"].endswith("+w:dummy")
    for name in ("experts-L000.safetensors", "experts-L003.safetensors", "model.safetensors"):
        a_, b_, c_ = (load_file(str(tmp_path / d / name)) for d in "abc")
        for key in a_:
            assert torch.equal(a_[key].view(torch.uint8), b_[key].view(torch.uint8)), (name, key)
            assert key.endswith(("norm.weight", ".bias")) or not torch.equal(a_[key].view(torch.uint8), c_[key].view(torch.uint8))
    layer = ck.read_layer(0)
    lut = layer["down"].luts[5].float()
    assert torch.all(lut[..., 1:] >= lut[..., :-1])  # sorted codes, as k-means' centroids are
    assert 0.5 < float(lut.std() * 128 ** 0.5) < 1.5  # scaled as a weight of fan-in 128


@pytest.mark.parametrize("arch", CPU_ARCHS)
def test_every_architecture_loads_and_runs_from_config_and_tokenizer_alone(tmp_path, capsys, arch):
    src = _config_only(make_tiny_checkpoint(tmp_path, arch, seed=3), tmp_path / "cfg")
    out = tmp_path / "ap"
    _quantize(capsys, "--model", str(src), "--out", str(out))
    model, store = load_ap_model(out)  # every tensor the loader asks for, at the shape it asks
    assert store.num_blocks == model.config.num_moe_layers * model.config.experts * 2
    ids = torch.tensor([5, 9, 11, 3, 7])
    meta = prefill_metadata(len(ids), 16)
    hidden = model.forward(ids, torch.arange(len(ids)), model.new_kv_cache(1, 16), meta).hidden
    logits = model.logits(hidden)
    assert logits.shape == (len(ids), model.config.vocab) and bool(torch.isfinite(logits).all())
    assert float(logits.std()) > 0


def test_the_reader_makes_norms_ones_biases_zeros_and_each_tensor_from_its_name(tmp_path):
    src = make_tiny_checkpoint(tmp_path, "qwen2_moe", seed=0)
    c = read_config(find_files(src))
    one, two = DummyTensorReader(c, torch.float32, "cpu", seed=4), DummyTensorReader(c, torch.float32, "cpu", seed=4)
    assert torch.equal(one.get("model.norm.weight", (8,)), torch.ones(8))
    assert torch.equal(one.get("model.layers.0.self_attn.q_proj.bias", (8,)), torch.zeros(8))
    q = one.get("model.layers.1.self_attn.q_proj.weight", (64, 32))
    two.get("model.embed_tokens.weight", (100, 32))  # another tensor first: the same draw
    assert torch.equal(two.get("model.layers.1.self_attn.q_proj.weight", (64, 32)), q)
    assert not torch.equal(one.get("model.layers.2.self_attn.q_proj.weight", (64, 32)), q)
    assert 0.015 < float(q.std()) < 0.025
    assert torch.equal(one.made["model.layers.1.self_attn.q_proj.weight"], q)  # kept, to be written


def test_the_reader_draws_at_its_std_and_makes_gemma_4_s_scales_ones(tmp_path):
    c = read_config(find_files(make_tiny_checkpoint(tmp_path, "qwen2_moe", seed=0)))
    wide = DummyTensorReader(c, torch.float32, "cpu", std=0.5).get("model.layers.0.self_attn.q_proj.weight", (64, 32))
    assert 0.4 < float(wide.std()) < 0.6
    reader = DummyTensorReader(c, torch.float32, "cpu")
    for name in ("layer_scalar", "router.scale", "router.per_expert_scale"):
        assert torch.equal(reader.get(f"model.layers.0.{name}", (4,)), torch.ones(4)), name


def test_random_ap_planes_have_a_word_for_every_32_input_columns_or_part():
    from pwruntime.quant.dummy import random_planes

    planes = random_planes(2, 4, 40, torch.Generator().manual_seed(0))   # 40 columns: two words a row
    assert planes.shape == (2, 8, 4, 2) and planes.dtype == torch.int32


def test_synthetic_calibration_is_the_simulators_and_drives_the_planner(tmp_path, capsys):
    from pwruntime.cmd_generate import _calibration
    from pwruntime.trace_recorder import card_for
    from pwsim.runner import _calibration as sim_calibration

    out = tmp_path / "ap"
    _quantize(capsys, "--model", "PagedWeight-demo", "--out", str(out))
    card, card_json = card_for(out)
    assert (card, card_json) == ("PagedWeight-demo", None)  # the simulator names the card a replay of it records
    import policies

    table = policies.PageTable(4, 16, 256, 128)
    for source, seed in (("synthetic", 0), ("synthetic:3", 3)):
        ours, sims = _calibration(source, table, str(out)), sim_calibration(f"synthetic:{seed}", card, 99)
        assert np.array_equal(ours.sensitivity, sims.sensitivity, equal_nan=True)
        assert np.array_equal(ours.initial_bits, sims.initial_bits)
    assert not np.array_equal(_calibration("synthetic:1", table, str(out)).sensitivity,
                              _calibration("synthetic", table, str(out)).sensitivity, equal_nan=True)
    rc = main(["generate", "--ap", str(out), "--calibration", "synthetic", "--policy", "pagedweight", "--prompt",
               "And God said", "--max-tokens", "40", "--ignore-eos", "--num-kv-blocks", "6", "--block-size", "4",
               "--json"])
    assert rc == 0
    stats = json.loads(capsys.readouterr().out)["stats"]
    assert stats["generated_tokens"] == 40 and stats["plans"] > 0 and stats["mean_bits_end"] < 8


@pytest.mark.parametrize("argv, needle", [
    (["--model", "No-Such-Model"], "nor a model card"),
    (["--model", "{llama}"], "unsupported architecture"),
    (["--model", "PagedWeight-demo", "--weighting", "hessian"], "no k-means weighting"),
])
def test_dummy_misuse_is_one_error_and_writes_nothing(tmp_path, capsys, argv, needle):
    out = tmp_path / "out"
    if "{llama}" in argv:   # a folder of a dense model's config.json and a tokenizer
        src = _config_only(make_tiny_checkpoint(tmp_path, "mixtral"), tmp_path / "llama")
        (src / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
        argv = ["--model", str(src)]
    assert main(["quantize", "--load-format", "dummy", "--out", str(out), *argv]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err and not out.exists()


def test_a_bad_synthetic_seed_is_a_user_error(tmp_path, capsys):
    out = tmp_path / "ap"
    _quantize(capsys, "--model", "PagedWeight-demo", "--out", str(out))
    rc = main(["generate", "--ap", str(out), "--calibration", "synthetic:x", "--policy", "pagedweight",
               "--prompt", "a", "--max-tokens", "2"])
    assert rc == 2 and "integer >= 0" in capsys.readouterr().err


@pytest.mark.parametrize("reserve, serving", [("auto", 0), ("256KiB", 0), ("auto", 384 << 10)])
def test_a_dummy_model_s_replay_and_its_simulation_decide_alike_step_by_step(tmp_path, capsys, monkeypatch, reserve,
                                                                              serving):
    """The chain the H200 runs at OLMoE's size, on the demo card's: a dummy checkpoint served with a synthetic
    calibration under pressure (`replay --record-routing`), then `pwsim run --like-replay` (the card the routing names,
    the same synthetic calibration, the replay's settings, its activation reserve: auto measures none on the CPU; and
    what its graphs and buffers took, here a stand-in for CUDA's count, joins it) and `pwsim fidelity`: every step and
    transition alike."""
    from demo_fixtures import first_prompts
    from engine_fixtures import fake_allocator
    from pwsim.cli import main as sim_main

    fake_allocator(monkeypatch, [0, serving])   # at the activation reserve, then at the capture

    ap = tmp_path / "ap"
    _quantize(capsys, "--model", "PagedWeight-demo", "--out", str(ap))
    trace = first_prompts(tmp_path / "load", max_tokens=32)
    assert main(["replay", "--trace", str(trace), "--out", str(tmp_path / "rt"), "--ap", str(ap), "--calibration",
                 "synthetic", "--policy", "pagedweight", "--gpu-memory-budget", "32MiB", "--dtype", "bf16",
                 "--device", "cpu", "--max-num-seqs", "32", "--time-scale", "0", "--record-routing",
                 "--activation-reserve", reserve]) == 0
    capsys.readouterr()
    rt_config = json.loads((tmp_path / "rt" / "config.json").read_text())
    assert rt_config["plane_arena"] is False and rt_config["serving_reserve"] == serving  # what ran, on the CPU
    assert rt_config["prefill_chunk_bytes"] is None   # the pure-torch AP store's prefill has no chunk
    kept = (0 if reserve == "auto" else 256 << 10) + serving
    assert sim_main(["run", "--like-replay", str(tmp_path / "rt"), "--out", str(tmp_path / "sim")]) == 0
    taken = capsys.readouterr().out
    assert "--calibration synthetic:0" in taken and "--model PagedWeight-demo" in taken
    assert f"--activation-reserve {kept}" in taken
    sim_config = json.loads((tmp_path / "sim" / "config.json").read_text())
    assert sim_config["activation_reserve_bytes"] == kept
    assert sim_main(["fidelity", "--sim", str(tmp_path / "sim"), "--runtime", str(tmp_path / "rt"), "--json",
                     "--out", str(tmp_path / "fid")]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["planner"]["plans"]["runtime"] > 2  # under pressure
    assert report["activation_reserve"] == {"sim": kept, "runtime": kept}
    d, t = report["decisions"], report["transitions"]
    assert d["first_difference"] is None and d["agreeing_steps"] == d["steps"] > 50, d
    assert t["first_difference"] is None and t["sim"] == t["runtime"] and t["runtime"]["started"] > 10, t
