"""Write a trained demo model as a HuggingFace directory in the classic per-expert layout.

transformers 5 keeps routed experts fused (`mlp.experts.gate_up_proj [E, 2I, H]`, `mlp.experts.down_proj
[E, H, I]`); published Qwen1.5-MoE checkpoints store `mlp.experts.N.{gate,up,down}_proj.weight`. We
convert the state dict ourselves (gate rows are the first I rows of gate_up) and write safetensors
directly, so the layout does not depend on the transformers version; transformers (4.x and 5.x) loads
it, fusing on load where it fuses. Tied LM head: `lm_head.weight` is not written.
Shards stay under `max_shard_bytes` (model-0000i-of-0000n.safetensors + model.safetensors.index.json).
"""
from __future__ import annotations

import copy
import json
import os
import shutil
from pathlib import Path

_DTYPES = ("float16", "bfloat16", "float32")


def per_expert_state_dict(model, dtype_name: str = "float16") -> dict:
    """Model weights with routed experts split per expert, cast to dtype_name, contiguous, CPU."""
    import torch

    if dtype_name not in _DTYPES:
        raise ValueError(f"dtype must be one of {_DTYPES}")
    dtype = getattr(torch, dtype_name)
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    out: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        if tied and name == "lm_head.weight":
            continue
        t = t.detach().to("cpu")
        if name.endswith("mlp.experts.gate_up_proj"):
            prefix = name[: -len("gate_up_proj")]
            inter = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{prefix}{e}.gate_proj.weight"] = t[e, :inter]
                out[f"{prefix}{e}.up_proj.weight"] = t[e, inter:]
        elif name.endswith("mlp.experts.down_proj"):
            prefix = name[: -len("down_proj")]
            for e in range(t.shape[0]):
                out[f"{prefix}{e}.down_proj.weight"] = t[e]
        else:
            out[name] = t
    return {k: v.to(dtype).contiguous().clone() for k, v in out.items()}


def shard(state: dict, max_shard_bytes: int) -> list[dict]:
    """Greedy split in key order; a tensor larger than max_shard_bytes gets a shard of its own."""
    shards: list[dict] = [{}]
    size = 0
    for k, v in state.items():
        n = v.numel() * v.element_size()
        if shards[-1] and size + n > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][k] = v
        size += n
    return shards


def save_hf_model(model, out_dir: str | Path, tokenizer_dir: str | Path, dtype_name: str = "float16",
                  max_shard_bytes: int = 15 * 2**20) -> Path:
    """Write config.json, generation_config.json, safetensors shards (+index), tokenizer files.

    Written into a temporary sibling folder which then replaces out_dir, so no partial model is left.
    """
    import torch
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    out = Path(out_dir)
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    state = per_expert_state_dict(model, dtype_name)
    shards = shard(state, max_shard_bytes)
    if len(shards) == 1:
        save_file(shards[0], str(tmp / "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, sd in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(sd, str(tmp / fname), metadata={"format": "pt"})
            weight_map.update({k: fname for k in sd})
        total = sum(v.numel() * v.element_size() for v in state.values())
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    cfg = copy.deepcopy(model.config)
    cfg.architectures = [type(model).__name__]
    cfg.dtype = getattr(torch, dtype_name)
    cfg.output_router_logits = False
    cfg.save_pretrained(str(tmp))
    GenerationConfig(bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id,
                     pad_token_id=cfg.eos_token_id).save_pretrained(str(tmp))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(Path(tokenizer_dir) / f, tmp / f)
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out
