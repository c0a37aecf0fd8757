"""The demo model's architecture: transformers' own Qwen2-MoE at a few million parameters.

Same structure as Qwen1.5-MoE-A2.7B (fine-grained routed experts, top-k softmax routing without
renormalisation, one shared expert with a sigmoid gate, GQA attention with qkv bias), scaled down.
Embeddings are tied to the LM head (saves vocab*hidden parameters; `tie_word_embeddings` in config.json).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class ModelSpec:
    vocab_size: int = 4096
    hidden_size: int = 256
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    num_experts: int = 16
    num_experts_per_tok: int = 4
    moe_intermediate_size: int = 128
    shared_expert_intermediate_size: int = 512
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = True
    router_aux_loss_coef: float = 0.001
    initializer_range: float = 0.02

    def to_dict(self) -> dict:
        return asdict(self)


def build_config(spec: ModelSpec, eos_token_id: int):
    """A transformers Qwen2MoeConfig for `spec` (only arguments present in transformers 4.45 .. 5.x)."""
    from transformers import Qwen2MoeConfig

    cfg = Qwen2MoeConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.shared_expert_intermediate_size,   # unused: every layer is sparse
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        num_experts=spec.num_experts,
        num_experts_per_tok=spec.num_experts_per_tok,
        moe_intermediate_size=spec.moe_intermediate_size,
        shared_expert_intermediate_size=spec.shared_expert_intermediate_size,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings,
        router_aux_loss_coef=spec.router_aux_loss_coef,
        initializer_range=spec.initializer_range,
        norm_topk_prob=False,
        decoder_sparse_step=1,
        output_router_logits=False,
        use_sliding_window=False,
        bos_token_id=eos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=None,   # a pad id would make nn.Embedding freeze that row at zero (EOS is our pad)
    )
    # rope: transformers 5 keeps it in rope_parameters, 4.x in rope_theta; set whichever exists
    rp = getattr(cfg, "rope_parameters", None)
    if isinstance(rp, dict):
        rp["rope_theta"] = spec.rope_theta
    else:
        cfg.rope_theta = spec.rope_theta
    return cfg


def build_model(spec: ModelSpec, eos_token_id: int, seed: int, experts_impl: str | None = None):
    """A freshly initialised Qwen2MoeForCausalLM (fp32, CPU), deterministic given the seed."""
    import torch
    from transformers import Qwen2MoeForCausalLM

    cfg = build_config(spec, eos_token_id)
    if experts_impl is not None:
        cfg._experts_implementation = experts_impl
    torch.manual_seed(seed)
    model = Qwen2MoeForCausalLM(cfg)
    return model


def count_parameters(model) -> dict[str, int]:
    """Unique parameters by group (tied weights counted once); `active` = used by one token."""
    cfg = model.config
    seen: set[int] = set()
    groups = {"embedding": 0, "attention": 0, "routed_experts": 0, "shared_expert": 0, "router": 0, "norm": 0}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            continue
        seen.add(id(p))
        n = p.numel()
        if "embed_tokens" in name or name.startswith("lm_head"):
            groups["embedding"] += n
        elif "self_attn" in name:
            groups["attention"] += n
        elif ".experts." in name or name.endswith(".experts.gate_up_proj") or name.endswith(".experts.down_proj"):
            groups["routed_experts"] += n
        elif "shared_expert" in name:
            groups["shared_expert"] += n
        elif ".mlp.gate." in name:
            groups["router"] += n
        else:
            groups["norm"] += n
    total = sum(groups.values())
    routed_active = groups["routed_experts"] * cfg.num_experts_per_tok // max(cfg.num_experts, 1)
    return {**groups, "total": total, "active_per_token": total - groups["routed_experts"] + routed_active}
