"""Gemma 4's config.json beyond the fields every architecture has: its layer layout, read once for the simulator's
model cards (traces.model_card) and the runtime's model (pwruntime.model.config), as transformers 5 reads it.

The MoE Gemma 4 (google/gemma-4-26B-A4B) interleaves sliding-window layers with "full_attention" (global) layers of
their own head size and, with `attention_k_eq_v`, their own KV heads and no V projection. transformers 5 saves the
global layers' geometry as `per_layer_config`; the published config.json gives it as `global_head_dim` and
`num_global_key_value_heads`. Both are read.
"""
from __future__ import annotations

from dataclasses import dataclass

from traces.clikit import UserError

SLIDING, FULL = "sliding_attention", "full_attention"


@dataclass(frozen=True)
class Gemma4Layout:
    kv_heads: int                    # of the sliding layers
    head_dim: int
    global_layers: tuple[int, ...]   # the full_attention layers (the last layer always is one)
    global_kv_heads: int
    global_head_dim: int
    k_eq_v: bool                     # the global layers have no v_proj: V is the K projection
    sliding_window: int              # of the other layers


def text_config(config: dict) -> dict:
    """The text model's config: `text_config` of a multimodal Gemma4ForConditionalGeneration, else config itself."""
    return config.get("text_config") or config


def gemma4_layout(cfg: dict, error: type[UserError] = UserError) -> Gemma4Layout:
    """The layout of a Gemma 4 text config; a model pwruntime cannot serve raises `error` naming why."""
    if not cfg.get("enable_moe_block"):
        raise error("this Gemma 4 has no MoE blocks (enable_moe_block false), so no experts to page: use an MoE "
                    "Gemma 4 such as google/gemma-4-26B-A4B")
    for key, what in (("hidden_size_per_layer_input", "per-layer inputs"), ("num_kv_shared_layers", "KV-shared layers"),
                      ("use_double_wide_mlp", "double-wide MLPs")):
        if cfg.get(key):
            raise error(f"Gemma 4 {what} ({key}) are not supported: only the MoE Gemma 4 (google/gemma-4-26B-A4B), "
                        "which has none")
    if cfg.get("use_bidirectional_attention") == "all":
        raise error("Gemma 4 with use_bidirectional_attention 'all' is not a causal LM: use a causal one")
    layers = int(cfg.get("num_hidden_layers") or 0)
    types = list(cfg.get("layer_types") or [FULL if (i + 1) % 6 == 0 else SLIDING for i in range(layers)])
    if layers < 1 or len(types) != layers or set(types) - {FULL, SLIDING}:
        raise error(f"Gemma 4 layer_types must name num_hidden_layers ({layers}) layers, each {FULL} or {SLIDING}; "
                    f"got {types}")
    types[-1] = FULL   # as transformers forces
    kv_heads = int(cfg.get("num_key_value_heads") or cfg.get("num_attention_heads") or 0)
    head_dim = int(cfg.get("head_dim") or 256)   # transformers' default for Gemma 4
    k_eq_v = bool(cfg.get("attention_k_eq_v", False))
    per_layer = cfg.get("per_layer_config")
    if per_layer:
        shapes = {(int(o.get("num_key_value_heads", kv_heads)), int(o.get("head_dim", head_dim)))
                  for layer, o in per_layer.items() if types[int(layer)] == FULL}
        if len(shapes) != 1 or any(types[int(layer)] != FULL for layer in per_layer):
            raise error("Gemma 4 per_layer_config must give every full_attention layer the same head_dim and "
                        "num_key_value_heads and no other layer any: two layer geometries are supported")
        g_kv, g_dim = shapes.pop()
    else:
        g_kv = int((cfg.get("num_global_key_value_heads") if k_eq_v else None) or kv_heads)
        g_dim = int(cfg.get("global_head_dim") or 512)
    return Gemma4Layout(kv_heads, head_dim, tuple(i for i, t in enumerate(types) if t == FULL), g_kv, g_dim, k_eq_v,
                        int(cfg.get("sliding_window") or 512))
