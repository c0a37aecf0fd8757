"""Test fixtures: tiny random HuggingFace MoE checkpoints (Mixtral, Qwen2-MoE, OLMoE, Qwen3-MoE, Gemma 4) + a tiny
tokenizer.

Shared by the model tests and the engine tests. Stable API:

    make_tiny_checkpoint(tmp_path, arch, seed=0, **overrides) -> Path
    load_hf_model(path) -> transformers model (fp32, eval)
    tiny_words(n) -> list[str]; make_text(n_words, seed) -> str

`overrides` are config fields (e.g. norm_topk_prob=True, mlp_only_layers=[1], num_hidden_layers=3) plus
these special keys, which are not config fields:
    layout="classic" | "fused"   classic: per-expert tensors exactly as `save_pretrained` writes them
                                 (Mixtral `block_sparse_moe.experts.N.w1/w2/w3`, others
                                 `mlp.experts.N.gate_proj/up_proj/down_proj`; Gemma 4, whose published
                                 checkpoints hold them fused, `experts.gate_up_proj`); fused: transformers-5
                                 in-memory names, `mlp.experts.gate_up_proj` [E, 2I, H] and
                                 `mlp.experts.down_proj` [E, H, I], in one model.safetensors.
    max_shard_size="40KB"        save sharded (model-0000x-of-0000n.safetensors + index json).
    tokenizer=True               write tokenizer.json (WordLevel over tiny_words) + tokenizer_config.json.
    chat_template=None | str     put this Jinja chat template in tokenizer_config.json.

Token ids: 0 <unk>, 1 <s> (bos), 2 </s> (eos); words from 3 on. The configs use eos_token_id=2, so pass
`eos_token_id=None`-style settings (or min_new_tokens) to transformers' generate when comparing a fixed
number of greedy tokens. Weights are drawn with initializer_range=0.3 (larger than the default) so routing
and greedy decoding are not degenerate.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

ARCHS = ("mixtral", "qwen2_moe", "olmoe", "qwen3_moe")   # those the CUDA path runs too
CPU_ARCHS = ARCHS + ("gemma4",)                           # Gemma 4 runs on the CPU only
VOCAB = 128

_BASE = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             num_experts_per_tok=2, max_position_embeddings=512, initializer_range=0.3,
             bos_token_id=1, eos_token_id=2, pad_token_id=None, tie_word_embeddings=False)

_ARCH = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(num_local_experts=4, intermediate_size=32)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                       intermediate_size=48, norm_topk_prob=False)),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM",
              dict(num_experts=4, intermediate_size=32, norm_topk_prob=False)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(num_experts=4, moe_intermediate_size=32, intermediate_size=40, head_dim=24,
                       norm_topk_prob=True)),
    # two layers: a sliding one (window 8, shorter than the tests' prompts) and a global one (its own head size,
    # one KV head, V from the K projection, proportional rope); soft-capped logits. (Tied embeddings, Gemma's
    # default, make a random tiny model repeat its last token: greedy tests would compare nothing.)
    "gemma4": ("Gemma4TextConfig", "Gemma4ForCausalLM",
               dict(num_experts=4, top_k_experts=2, moe_intermediate_size=32, intermediate_size=48, head_dim=16,
                    global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True, enable_moe_block=True,
                    hidden_size_per_layer_input=0, sliding_window=8, final_logit_softcapping=30.0)),
}


def tiny_words(n: int = VOCAB - 3) -> list[str]:
    """n distinct pronounceable words (cv, then cvc syllables), deterministic."""
    cons, vows = "bdfgklmnprstvz", "aeiou"
    words = [c + v for c in cons for v in vows] + [c + v + d for c in cons for v in vows for d in cons]
    return words[:n]


def make_text(n_words: int, seed: int = 0) -> str:
    """Deterministic pseudo text over tiny_words, with line breaks."""
    rng = random.Random(seed)
    words = tiny_words()
    lines, line = [], []
    for _ in range(n_words):
        line.append(words[min(int(rng.expovariate(0.08)), len(words) - 1)])
        if len(line) >= rng.randint(6, 14):
            lines.append(" ".join(line))
            line = []
    if line:
        lines.append(" ".join(line))
    return "\n".join(lines) + "\n"


def write_tokenizer(path: Path, chat_template: str | None = None) -> None:
    """tokenizer.json (WordLevel, whitespace split) + tokenizer_config.json into directory `path`."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for w in tiny_words():
        vocab[w] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])     # already in the vocab: marks them special
    tok.save(str(path / "tokenizer.json"))
    cfg: dict = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
                 "tokenizer_class": "PreTrainedTokenizerFast"}
    if chat_template is not None:
        cfg["chat_template"] = chat_template
    (path / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))


def _hf_config(arch: str, overrides: dict):
    import transformers

    if arch not in _ARCH:
        raise ValueError(f"unknown arch {arch!r}; one of {CPU_ARCHS}")
    cfg_cls, _, extra = _ARCH[arch]
    kw = {**_BASE, **extra, **overrides}
    if arch == "gemma4":
        kw.pop("num_experts_per_tok")   # top_k_experts there
    return getattr(transformers, cfg_cls)(**kw)


def make_tiny_checkpoint(tmp_path, arch: str, seed: int = 0, **overrides) -> Path:
    """Build a random tiny `arch` model with transformers, save it under tmp_path/<arch>-<seed>, return the dir."""
    import torch
    import transformers

    layout = overrides.pop("layout", "classic")
    max_shard_size = overrides.pop("max_shard_size", None)
    with_tokenizer = overrides.pop("tokenizer", True)
    chat_template = overrides.pop("chat_template", None)
    if layout not in ("classic", "fused"):
        raise ValueError(f"layout must be 'classic' or 'fused', not {layout!r}")
    config = _hf_config(arch, overrides)
    torch.manual_seed(seed)
    model = getattr(transformers, _ARCH[arch][1])(config).eval()
    if arch == "gemma4":   # its norms, router scales and layer scalars start at ones: make each matter
        with torch.no_grad():
            for name, t in model.named_parameters(recurse=True):
                if name.endswith(("norm.weight", "router.scale", "per_expert_scale")):
                    t.uniform_(0.5, 1.5)
            for name, t in model.named_buffers():
                if name.endswith("layer_scalar"):
                    t.uniform_(0.5, 1.5)
    out = Path(tmp_path) / f"{arch}-{seed}-{layout}{'-sharded' if max_shard_size else ''}"
    out.mkdir(parents=True, exist_ok=True)
    if layout == "classic":
        kw = {"max_shard_size": max_shard_size} if max_shard_size else {}
        model.save_pretrained(out, **kw)
        _ensure_classic(out, arch)
    else:
        from safetensors.torch import save_file

        if max_shard_size:
            raise ValueError("layout='fused' is written unsharded")
        config.save_pretrained(out)
        state = {k: v.detach().contiguous().clone() for k, v in model.state_dict().items()}
        save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    if with_tokenizer:
        write_tokenizer(out, chat_template)
    return out


def _ensure_classic(out: Path, arch: str) -> None:
    """Rewrite fused expert tensors (should a transformers version save them) to the per-expert names."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    files = sorted(out.glob("*.safetensors"))
    names = [n for f in files for n in safe_open(str(f), "pt").keys()]
    if arch == "gemma4" or not any(n.endswith("experts.gate_up_proj") for n in names):
        return
    if len(files) != 1:
        raise RuntimeError("this transformers saves fused experts; rewriting shards is not supported")
    state = load_file(str(files[0]))
    gate, up, down = ("w1", "w3", "w2") if arch == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    for name in [n for n in state if n.endswith("experts.gate_up_proj")]:
        prefix = name[:-len("experts.gate_up_proj")]
        new_prefix = prefix.replace(".mlp.", ".block_sparse_moe.") if arch == "mixtral" else prefix
        if arch == "mixtral":
            state[new_prefix + "gate.weight"] = state.pop(prefix + "gate.weight")
        gate_up, down_w = state.pop(name), state.pop(prefix + "experts.down_proj")
        inter = gate_up.shape[1] // 2
        for e in range(gate_up.shape[0]):
            state[f"{new_prefix}experts.{e}.{gate}.weight"] = gate_up[e, :inter].contiguous()
            state[f"{new_prefix}experts.{e}.{up}.weight"] = gate_up[e, inter:].contiguous()
            state[f"{new_prefix}experts.{e}.{down}.weight"] = down_w[e].contiguous()
    save_file(state, str(files[0]), metadata={"format": "pt"})


def load_hf_model(path):
    """The transformers reference model for a checkpoint directory (fp32, eval mode, eager attention)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype="float32",
                                                              attn_implementation="eager")
    return model.eval()
