"""ModelConfig: the architecture facts pwruntime needs, parsed from a HuggingFace config.json.

Supported architectures (their transformers 5 semantics are mirrored exactly):
  mixtral    MixtralForCausalLM   softmax router, top-k renormalised, experts w1/w3/w2, optional sliding window
  qwen2_moe  Qwen2MoeForCausalLM  Qwen1.5-MoE: q/k/v bias, shared expert with a sigmoid gate, norm_topk_prob,
                                  decoder_sparse_step / mlp_only_layers (those layers use a dense MLP)
  olmoe      OlmoeForCausalLM     RMSNorm on the full q and k projections, optional clip_qkv, norm_topk_prob
  qwen3_moe  Qwen3MoeForCausalLM  explicit head_dim, per-head q/k RMSNorm, norm_topk_prob,
                                  decoder_sparse_step / mlp_only_layers
  gemma4     Gemma4ForCausalLM, Gemma4ForConditionalGeneration (its text model; the weights under
             model.language_model.)  a GELU MLP beside the GELU experts in every layer, four more norms a layer,
             a scaled router, sliding-window layers and "full_attention" (global) layers of their own head size,
             KV heads and rope (proportional: part of each head rotates), V = the K projection there
             (attention_k_eq_v), a scale-less V norm, attention scale 1, a per-layer output scalar, embeddings
             scaled by sqrt(hidden), final logit soft-capping (pwruntime.model.gemma4)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from policies.kv_groups import KVLayout
from traces.clikit import UserError
from traces.gemma4_config import gemma4_layout, text_config
from traces.model_card import expert_count


class CheckpointError(UserError):
    """A checkpoint directory pwruntime cannot load (missing file or tensor, unknown architecture, bad shape)."""


ARCHITECTURES = {
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "OlmoeForCausalLM": "olmoe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Gemma4ForCausalLM": "gemma4",
    "Gemma4ForConditionalGeneration": "gemma4",
}
_MODEL_TYPES = {"gemma4_text": "gemma4"}   # model_type spellings other than the arch's name
_DEFAULT_THETA = {"mixtral": 1e6, "qwen2_moe": 1e4, "olmoe": 1e4, "qwen3_moe": 1e4}


@dataclass(frozen=True)
class ModelConfig:
    arch: str                       # one of ARCHITECTURES' values
    layers: int                     # decoder layers
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    experts: int                    # routed experts per MoE layer
    top_k: int
    expert_intermediate: int        # I of one routed expert: gate_up is [2I, H], down is [H, I]
    shared_intermediate: int        # 0 when there is no shared expert
    eos_token_id: int | None        # the first of eos_token_ids
    max_position: int
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    moe_layers: tuple[int, ...] = ()        # decoder layer indices with a routed MoE block (the others are dense)
    dense_intermediate: int = 0             # of the dense MLP layers (mlp_only_layers; Gemma 4: every layer's MLP)
    rms_eps: float = 1e-6
    rope_theta: float = 1e4
    rope_linear_factor: float = 1.0         # rope_scaling {"type": "linear", "factor": f}; 1.0 = none
    norm_topk_prob: bool = True
    qk_norm: str = "none"                   # "none" | "full" (OLMoE, whole projection) | "head" (Qwen3, per head)
    qkv_bias: bool = False
    o_bias: bool = False
    clip_qkv: float | None = None
    sliding_windows: tuple[int | None, ...] = ()   # per decoder layer; None = full causal attention
    tie_word_embeddings: bool = False
    torch_dtype: str | None = None          # dtype the checkpoint says it was saved in, if any
    hidden_act: str = "silu"                # MLP and expert gate activation: "silu" | "gelu_tanh" (Gemma 4)
    weight_prefix: str = "model."           # of the text model's tensors (Gemma 4 multimodal: model.language_model.)
    attention_scale: float | None = None    # None: head_dim ** -0.5 (Gemma 4: 1, its q/k norms set the scale)
    final_logit_softcap: float | None = None
    # Gemma 4's global ("full_attention") layers: their own head size, KV heads and rope
    global_layers: tuple[int, ...] = ()
    global_head_dim: int = 0
    global_kv_heads: int = 0
    global_k_eq_v: bool = False             # no v_proj: V is the K projection (before the K norm and rope)
    global_rope_theta: float = 1e6
    global_rope_fraction: float = 1.0       # the part of each head that rotates (proportional rope)
    global_rope_factor: float = 1.0

    @property
    def num_moe_layers(self) -> int:
        return len(self.moe_layers)

    def kv_shape(self, layer: int) -> tuple[int, int]:
        """(KV heads, head size) of decoder layer `layer`."""
        if layer in self.global_layers:
            return self.global_kv_heads, self.global_head_dim
        return self.kv_heads, self.head_dim

    @property
    def kv_shapes(self) -> tuple[tuple[int, int], ...]:
        """kv_shape of every decoder layer, in order (the KV cache's per-layer geometry)."""
        return tuple(self.kv_shape(i) for i in range(self.layers))

    @property
    def attention_reads(self) -> tuple[tuple[int | None, int], ...]:
        """Each decoder layer's (sliding window or None, head size): what its attention reads (AttentionPlan.build)."""
        windows = self.sliding_windows or (None,) * self.layers
        return tuple((w, d) for w, (_, d) in zip(windows, self.kv_shapes))

    def kv_layout(self, block_size: int, dtype_bytes: int, hybrid: bool = True) -> KVLayout:
        """The KV cache's groups of layers (policies.kv_groups): sliding-window and global layers in groups with block
        tables of their own where `hybrid` and the model gains from it, else one group of every layer."""
        token_bytes = [2 * heads * dim * dtype_bytes for heads, dim in self.kv_shapes]
        return KVLayout.build(token_bytes, self.sliding_windows or [None] * self.layers, block_size, hybrid)


def _experts(cfg: dict, key: str) -> int:
    """The expert count under either spelling (traces.model_card.expert_count); where the config gives neither, the
    missing-key error names `key`, the architecture's own spelling."""
    experts = expert_count(cfg, CheckpointError)
    return int(_get(cfg, key)) if experts is None else experts


def _get(cfg: dict, key: str, default: Any = ..., where: str = "config.json") -> Any:
    value = cfg.get(key, None)
    if value is None:
        if default is ...:
            raise CheckpointError(f"{where} has no {key!r}; it is required for {cfg.get('architectures')}: "
                                  f"re-export the checkpoint with transformers' save_pretrained")
        return default
    return value


def detect_arch(cfg: dict) -> str:
    archs = cfg.get("architectures") or []
    for name in archs:
        if name in ARCHITECTURES:
            return ARCHITECTURES[name]
    model_type = _MODEL_TYPES.get(cfg.get("model_type"), cfg.get("model_type"))
    if not archs and model_type in ARCHITECTURES.values():
        return model_type
    shown = archs[0] if archs else f"model_type {model_type!r}"
    raise CheckpointError(f"unsupported architecture {shown}: pwruntime loads "
                          f"{', '.join(ARCHITECTURES)}; use a checkpoint of one of these")


def _rope(cfg: dict, arch: str) -> tuple[float, float]:
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise CheckpointError(f"config.json rope_parameters must be a mapping, got {params!r}")
    theta = float(params.get("rope_theta") or cfg.get("rope_theta") or _DEFAULT_THETA[arch])
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    if float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor") or 1.0)) != 1.0:
        raise CheckpointError("partial_rotary_factor != 1 is not supported: use a checkpoint with full rotary dims")
    if kind == "default":
        return theta, 1.0
    if kind == "linear":
        return theta, float(_get(params, "factor", where="rope_scaling"))
    raise CheckpointError(f"rope type {kind!r} is not supported (only default and linear): "
                          f"use a checkpoint without that rope_scaling")


def _moe_layers(cfg: dict, layers: int, experts: int) -> tuple[int, ...]:
    step = int(cfg.get("decoder_sparse_step") or 1)
    dense = set(cfg.get("mlp_only_layers") or [])
    return tuple(i for i in range(layers) if i not in dense and experts > 0 and (i + 1) % step == 0)


def _sliding(cfg: dict, arch: str, layers: int) -> tuple[int | None, ...]:
    if arch in ("qwen2_moe", "qwen3_moe") and not cfg.get("use_sliding_window", False):
        return (None,) * layers
    window = cfg.get("sliding_window")
    if not window or arch == "olmoe":
        return (None,) * layers
    if arch == "qwen2_moe":     # transformers: layer_types, or odd-numbered layers below max_window_layers
        types = cfg.get("layer_types") or [
            "sliding_attention" if (i + 1) % 2 and i < int(cfg.get("max_window_layers", 28)) else "full_attention"
            for i in range(layers)]
        return tuple(int(window) if t == "sliding_attention" else None for t in types)
    return (int(window),) * layers


def _ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(int(v) for v in (value if isinstance(value, (list, tuple)) else [value]))


def eos_ids(cfg: dict, generation_config: dict | None) -> tuple[int, ...]:
    """config.json's EOS ids, then generation_config.json's others."""
    eos = _ids(cfg.get("eos_token_id"))
    for e in _ids((generation_config or {}).get("eos_token_id")):
        eos = eos if e in eos else eos + (e,)
    return eos


def parse_config(cfg: dict, generation_config: dict | None = None) -> ModelConfig:
    """ModelConfig from the dicts of config.json (and generation_config.json, for extra EOS ids)."""
    arch = detect_arch(cfg)
    if arch == "gemma4":
        return parse_gemma4_config(cfg, generation_config)
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise CheckpointError(f"hidden_act {act!r} is not supported (only silu): use a supported checkpoint")
    hidden, heads, layers = int(_get(cfg, "hidden_size")), int(_get(cfg, "num_attention_heads")), \
        int(_get(cfg, "num_hidden_layers"))
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = hidden // heads
    if arch in ("mixtral", "qwen3_moe") and cfg.get("head_dim"):
        head_dim = int(cfg["head_dim"])
    if heads % kv_heads:
        raise CheckpointError(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
    experts = _experts(cfg, "num_local_experts" if arch == "mixtral" else "num_experts")
    inter = int(_get(cfg, "moe_intermediate_size" if arch in ("qwen2_moe", "qwen3_moe") else "intermediate_size"))
    moe_layers = _moe_layers(cfg, layers, experts) if arch in ("qwen2_moe", "qwen3_moe") else tuple(range(layers))
    theta, linear = _rope(cfg, arch)
    eos = eos_ids(cfg, generation_config)
    return ModelConfig(
        arch=arch, layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
        vocab=int(_get(cfg, "vocab_size")), experts=experts, top_k=int(_get(cfg, "num_experts_per_tok")),
        expert_intermediate=inter,
        shared_intermediate=int(cfg.get("shared_expert_intermediate_size") or 0) if arch == "qwen2_moe" else 0,
        eos_token_id=eos[0] if eos else None, eos_token_ids=eos, bos_token_id=cfg.get("bos_token_id"),
        max_position=int(cfg.get("max_position_embeddings") or 4096),
        moe_layers=moe_layers,
        dense_intermediate=int(cfg.get("intermediate_size") or 0) if len(moe_layers) < layers else 0,
        rms_eps=float(cfg.get("rms_norm_eps") or 1e-6), rope_theta=theta, rope_linear_factor=linear,
        norm_topk_prob=True if arch == "mixtral" else bool(cfg.get("norm_topk_prob", False)),
        qk_norm={"olmoe": "full", "qwen3_moe": "head"}.get(arch, "none"),
        qkv_bias=bool(cfg.get("qkv_bias", True)) if arch == "qwen2_moe" else bool(cfg.get("attention_bias", False)),
        o_bias=bool(cfg.get("attention_bias", False)) if arch in ("olmoe", "qwen3_moe") else False,
        clip_qkv=float(cfg["clip_qkv"]) if arch == "olmoe" and cfg.get("clip_qkv") is not None else None,
        sliding_windows=_sliding(cfg, arch, layers),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        torch_dtype=cfg.get("dtype") or cfg.get("torch_dtype"),
    )


def _gemma4_rope(cfg: dict) -> tuple[float, float, float, float]:
    """(sliding layers' theta, global layers' theta, rotating fraction, linear factor) of Gemma 4's rope_parameters
    (transformers' defaults where absent)."""
    params = cfg.get("rope_parameters") or {}
    sliding = params.get("sliding_attention") or {"rope_type": "default", "rope_theta": 1e4}
    full = params.get("full_attention") or {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                            "rope_theta": 1e6}
    if sliding.get("rope_type", "default") != "default" or full.get("rope_type", "default") not in (
            "default", "proportional"):
        raise CheckpointError(f"Gemma 4 rope types {sliding.get('rope_type')!r} / {full.get('rope_type')!r} are not "
                              "supported (sliding layers: default; global layers: default or proportional)")
    proportional = full.get("rope_type") == "proportional"
    return (float(sliding.get("rope_theta", 1e4)), float(full.get("rope_theta", 1e6)),
            float(full.get("partial_rotary_factor", 1.0)) if proportional else 1.0,
            float(full.get("factor", 1.0)) if proportional else 1.0)


def parse_gemma4_config(config: dict, generation_config: dict | None = None) -> ModelConfig:
    """ModelConfig of a Gemma 4 MoE checkpoint (Gemma4ForCausalLM, or Gemma4ForConditionalGeneration's text model)."""
    cfg = text_config(config)
    layout = gemma4_layout(cfg, CheckpointError)
    act = cfg.get("hidden_activation", "gelu_pytorch_tanh")
    if act != "gelu_pytorch_tanh":
        raise CheckpointError(f"Gemma 4 hidden_activation {act!r} is not supported (only gelu_pytorch_tanh)")
    layers, hidden, heads = (int(_get(cfg, k)) for k in ("num_hidden_layers", "hidden_size", "num_attention_heads"))
    kv_heads, head_dim = layout.kv_heads, layout.head_dim
    if heads % kv_heads or heads % layout.global_kv_heads:
        raise CheckpointError(f"num_attention_heads {heads} is not a multiple of the KV heads {kv_heads} / "
                              f"{layout.global_kv_heads}")
    theta, g_theta, g_fraction, g_factor = _gemma4_rope(cfg)
    eos = eos_ids(cfg if cfg.get("eos_token_id") is not None else config, generation_config)
    bias = bool(cfg.get("attention_bias", False))
    softcap = cfg.get("final_logit_softcapping")
    return ModelConfig(
        arch="gemma4", layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
        vocab=int(_get(cfg, "vocab_size")), experts=_experts(cfg, "num_experts"),
        top_k=int(_get(cfg, "top_k_experts")), expert_intermediate=int(_get(cfg, "moe_intermediate_size")),
        shared_intermediate=0, eos_token_id=eos[0] if eos else None, eos_token_ids=eos,
        bos_token_id=cfg.get("bos_token_id", config.get("bos_token_id")),
        max_position=int(cfg.get("max_position_embeddings") or 131072), moe_layers=tuple(range(layers)),
        dense_intermediate=int(_get(cfg, "intermediate_size")), rms_eps=float(cfg.get("rms_norm_eps") or 1e-6),
        rope_theta=theta, norm_topk_prob=True, qk_norm="head", qkv_bias=bias, o_bias=bias,
        sliding_windows=tuple(None if i in layout.global_layers else layout.sliding_window for i in range(layers)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", config.get("tie_word_embeddings", True))),
        torch_dtype=cfg.get("dtype") or config.get("dtype") or config.get("torch_dtype"),
        hidden_act="gelu_tanh", weight_prefix="model.language_model." if "text_config" in config else "model.",
        attention_scale=1.0, final_logit_softcap=float(softcap) if softcap else None,
        global_layers=layout.global_layers, global_head_dim=layout.global_head_dim,
        global_kv_heads=layout.global_kv_heads, global_k_eq_v=layout.k_eq_v, global_rope_theta=g_theta,
        global_rope_fraction=g_fraction, global_rope_factor=g_factor)
