"""load_model: build an MoEModel from a HuggingFace checkpoint directory (per-architecture tensor names).

Routed experts may be stored per expert (as published checkpoints are: Mixtral `block_sparse_moe.experts.N.
w1/w3/w2`, the others `mlp.experts.N.gate_proj/up_proj/down_proj`) or fused as transformers 5 holds them
(`mlp.experts.gate_up_proj` [E, 2I, H], gate rows first, and `mlp.experts.down_proj` [E, H, I]).
"""
from __future__ import annotations

from pathlib import Path

import torch
from tqdm import tqdm

from pwruntime.model.attention import read_attention
from pwruntime.model.checkpoint import TensorReader, find_files, read_config
from pwruntime.model.config import CheckpointError, ModelConfig
from pwruntime.model.dummy import DummyTensorReader
from pwruntime.model.experts import DenseExpertStore, ExpertStore
from pwruntime.model.gemma4 import read_gemma4_layer
from pwruntime.model.layers import DenseMLP, FloatRMSNorm, RMSNorm
from pwruntime.model.moe_model import DecoderLayer, MoEBlock, MoEModel
from pwruntime.model.tokenizer import Tokenizer
from traces.clikit import UserError

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "fp16": torch.float16, "float16": torch.float16,
          "half": torch.float16, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise UserError(f"dtype {dtype} is not supported: use fp32, fp16 or bf16")
        return dtype
    if dtype not in DTYPES:
        raise UserError(f"unknown dtype {dtype!r}: use one of fp32, fp16, bf16")
    return DTYPES[dtype]


def check_device(device: str | torch.device) -> torch.device:
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise UserError(f"unknown device {device!r}: use cpu or cuda") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"device {device} requested but no CUDA GPU is available: use --device cpu")
    if dev.type not in ("cpu", "cuda"):
        raise UserError(f"device {device!r} is not supported: use cpu or cuda")
    return dev


def _dense(r: TensorReader, prefix: str, hidden: int, inter: int) -> DenseMLP:
    return DenseMLP(r.get(prefix + "gate_proj.weight", (inter, hidden)),
                    r.get(prefix + "up_proj.weight", (inter, hidden)),
                    r.get(prefix + "down_proj.weight", (hidden, inter)))


def _moe_prefix(r: TensorReader, c: ModelConfig, i: int) -> str:
    options = [f"model.layers.{i}.mlp."]
    if c.arch == "mixtral":
        options.insert(0, f"model.layers.{i}.block_sparse_moe.")
    return r.first([p + "gate.weight" for p in options])[:-len("gate.weight")]


def _experts(r: TensorReader, c: ModelConfig, p: str) -> tuple[torch.Tensor, torch.Tensor]:
    """gate_up [E, 2I, H] and down [E, H, I] of one MoE layer, from the fused or the per-expert layout."""
    e_n, inter, h = c.experts, c.expert_intermediate, c.hidden
    if r.has(p + "experts.gate_up_proj"):
        return r.get(p + "experts.gate_up_proj", (e_n, 2 * inter, h)), r.get(p + "experts.down_proj", (e_n, h, inter))
    gate, up, down = ("w1", "w3", "w2") if c.arch == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    gate_up = torch.empty(e_n, 2 * inter, h, dtype=r.dtype, device=r.device)
    down_t = torch.empty(e_n, h, inter, dtype=r.dtype, device=r.device)
    for e in range(e_n):
        q = f"{p}experts.{e}."
        gate_up[e, :inter] = r.get(q + gate + ".weight", (inter, h))
        gate_up[e, inter:] = r.get(q + up + ".weight", (inter, h))
        down_t[e] = r.get(q + down + ".weight", (h, inter))
    return gate_up, down_t


def _read_layer(r: TensorReader, c: ModelConfig, i: int, with_experts: bool
                ) -> tuple[DecoderLayer, torch.Tensor | None, torch.Tensor | None]:
    """(decoder layer i, its experts' gate_up [E, 2I, H] and down [E, H, I], or None twice for a dense layer or
    without `with_experts`)."""
    p, gate_up, down = f"model.layers.{i}.", None, None
    if i in c.moe_layers:
        mp = _moe_prefix(r, c, i)
        shared = shared_gate = None
        if c.shared_intermediate:
            shared = _dense(r, mp + "shared_expert.", c.hidden, c.shared_intermediate)
            shared_gate = r.get(mp + "shared_expert_gate.weight", (1, c.hidden))
        mlp = MoEBlock(c, c.moe_layers.index(i), r.get(mp + "gate.weight", (c.experts, c.hidden)), shared, shared_gate)
        if with_experts:
            gate_up, down = _experts(r, c, mp)
    else:
        mlp = _dense(r, p + "mlp.", c.hidden, c.dense_intermediate)
    layer = DecoderLayer(read_attention(r, c, i), mlp,
                         RMSNorm(r.get(p + "input_layernorm.weight", (c.hidden,)), c.rms_eps),
                         RMSNorm(r.get(p + "post_attention_layernorm.weight", (c.hidden,)), c.rms_eps))
    return layer, gate_up, down


def load_model(path: str | Path, dtype: str | torch.dtype = torch.float32, device: str | torch.device = "cpu",
               experts: ExpertStore | None = None, reader: DummyTensorReader | None = None) -> MoEModel:
    """Load a Mixtral / Qwen2-MoE / OLMoE / Qwen3-MoE / Gemma 4 checkpoint. With `experts` given, routed-expert
    tensors are not read and that store serves them; with a `reader` (pwruntime.model.dummy), the tensors come
    from it and `path` needs config.json and the tokenizer only. Raises CheckpointError (a UserError)."""
    dtype, dev = parse_dtype(dtype), check_device(device)
    files = find_files(path, weights=reader is None)
    if experts is None and (files.root / "ap_config.json").is_file():
        raise CheckpointError(f"{files.root} is an AP checkpoint (`pwruntime quantize` output), not a full-precision "
                              "model: pass it with --ap, or give the HuggingFace model it was quantized from")
    c = read_config(files)
    tokenizer = Tokenizer(files.tokenizer, files.tokenizer_config, c.eos_token_id)
    r = reader if reader is not None else TensorReader(files, dtype, dev)
    embed = r.get(c.weight_prefix + "embed_tokens.weight", (c.vocab, c.hidden))
    layers, gate_ups, downs = [], [], []
    read_layer = read_gemma4_layer if c.arch == "gemma4" else _read_layer
    for i in tqdm(range(c.layers), desc="loading layers", unit="layer", disable=None, leave=False):
        layer, gate_up, down = read_layer(r, c, i, with_experts=experts is None)
        layers.append(layer)
        if gate_up is not None:
            gate_ups.append(gate_up)
            downs.append(down)
    norm_weight = r.get(c.weight_prefix + "norm.weight", (c.hidden,))
    norm = FloatRMSNorm(norm_weight, c.rms_eps) if c.arch == "gemma4" else RMSNorm(norm_weight, c.rms_eps)
    if r.has("lm_head.weight") or not c.tie_word_embeddings:
        lm_head = r.get("lm_head.weight", (c.vocab, c.hidden))
    else:
        lm_head = embed
    if tokenizer.vocab_size > c.vocab:
        raise CheckpointError(f"tokenizer.json has {tokenizer.vocab_size} tokens but the model's vocab_size is "
                              f"{c.vocab}; use the tokenizer that came with these weights")
    store = experts if experts is not None else DenseExpertStore(gate_ups, downs, c.hidden_act)
    return MoEModel(c, tokenizer, embed, layers, norm, lm_head, store)
