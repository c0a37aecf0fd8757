"""Model cards: the architecture numbers of an MoE model (`ModelSpec`) and what follows from them.

A card is a JSON file in `traces/cards/` holding the `ModelSpec` fields, where the numbers come
from (`source`), the published total it was checked against, and the `hf_config` values it was
derived from. Everything derived (parameter totals, fp16 bytes, the AP byte table, KV bytes per
token, the page table, the fingerprint) is computed here from the numbers, never stored.

Counting follows the HuggingFace implementations exactly: every Linear weight (and bias), every
norm scale, router weights (and Gemma 4's router scales), embeddings and the LM head (once if
tied). Page-table `layer` indices are MoE-layer ordinals (`moe_layer_ids()[layer]` is the model
layer); only routed experts are in the page table, shared experts and attention stay fp16.
"""
from __future__ import annotations

import json
import os
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path

import numpy as np

from policies.apformat import MAX_BITS, byte_table
from policies.calibration import model_fingerprint
from policies.kv_groups import KVLayout
from policies.page_table import DEFAULT_BITS, PageTable
from traces.clikit import UserError
from traces.gemma4_config import gemma4_layout, text_config

CARDS_DIR = Path(__file__).with_name("cards")
QK_NORMS = ("none", "head", "full")  # none; per head_dim (Qwen3, Gemma 4); over all heads (OLMoE)
METADATA_FIELDS = ("name", "hf_id", "published_params", "published_active_params", "published_source", "source")
CARD_ONLY_KEYS = ("hf_config", "notes")
HF_ARCHS = ("mixtral", "qwen2_moe", "olmoe", "qwen3_moe", "gemma4")


class CardError(UserError):
    """A model card is missing, malformed, or describes an unsupported architecture."""


@dataclass(frozen=True)
class ModelSpec:
    name: str
    arch: str  # mixtral | qwen2_moe | olmoe | qwen3_moe | gemma4
    layers: int
    hidden: int
    expert_intermediate: int
    experts: int  # routed experts per MoE layer
    shared_experts: int  # always-on MLPs per MoE layer (Qwen2-MoE shared expert, Gemma 4 dense MLP)
    shared_intermediate: int
    top_k: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied_embeddings: bool
    dense_layers: tuple[int, ...] = ()  # model layers with a dense MLP instead of experts
    dense_intermediate: int = 0
    qk_norm: str = "none"
    qkv_bias: bool = False
    o_bias: bool = False
    shared_expert_gate: bool = False  # Linear(hidden, 1) per shared expert (Qwen2-MoE)
    router_scales: bool = False  # Gemma 4: router input scale [hidden] + per-expert scale [experts]
    norms_per_layer: int = 2  # hidden-sized norm scales per layer
    global_layers: tuple[int, ...] = ()  # layers with the "global" attention geometry (Gemma 4)
    global_head_dim: int = 0
    global_kv_heads: int = 0
    global_k_eq_v: bool = False  # global layers reuse the key projection as values (no v_proj)
    sliding_window: int = 0  # window of the non-global layers; 0 = every layer attends to everything
    hf_id: str = ""
    published_params: int = 0
    published_active_params: int = 0
    published_source: str = ""
    source: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "dense_layers", tuple(sorted(int(x) for x in self.dense_layers)))
        object.__setattr__(self, "global_layers", tuple(sorted(int(x) for x in self.global_layers)))
        positive = ("layers", "hidden", "expert_intermediate", "experts", "top_k", "heads", "kv_heads",
                    "head_dim", "vocab")
        for f in positive:
            if not isinstance(getattr(self, f), int) or getattr(self, f) <= 0:
                raise CardError(f"model {self.name!r}: {f} must be a positive integer, got {getattr(self, f)!r}")
        if self.top_k > self.experts:
            raise CardError(f"model {self.name!r}: top_k {self.top_k} exceeds experts {self.experts}")
        if self.qk_norm not in QK_NORMS:
            raise CardError(f"model {self.name!r}: qk_norm must be one of {QK_NORMS}, got {self.qk_norm!r}")
        for f in ("dense_layers", "global_layers"):
            if any(not 0 <= x < self.layers for x in getattr(self, f)):
                raise CardError(f"model {self.name!r}: {f} must lie in 0..{self.layers - 1}")
        if len(self.dense_layers) >= self.layers:
            raise CardError(f"model {self.name!r}: every layer is dense; an MoE model needs expert layers")
        if self.shared_experts and self.shared_intermediate <= 0:
            raise CardError(f"model {self.name!r}: shared_experts needs a positive shared_intermediate")
        if self.dense_layers and self.dense_intermediate <= 0:
            raise CardError(f"model {self.name!r}: dense_layers needs a positive dense_intermediate")

    # ------------------------------------------------------------ structure
    def moe_layer_ids(self) -> tuple[int, ...]:
        dense = set(self.dense_layers)
        return tuple(l for l in range(self.layers) if l not in dense)

    @property
    def moe_layers(self) -> int:
        return self.layers - len(self.dense_layers)

    def attention_geometry(self, layer: int) -> tuple[int, int, bool]:
        """(head_dim, kv_heads, has v_proj) of a layer."""
        if layer in self.global_layers:
            return (self.global_head_dim or self.head_dim, self.global_kv_heads or self.kv_heads,
                    not self.global_k_eq_v)
        return self.head_dim, self.kv_heads, True

    # ------------------------------------------------------------ parameters
    def expert_params(self) -> int:
        """One routed expert: gate, up [I, H] and down [H, I]."""
        return 3 * self.hidden * self.expert_intermediate

    def attention_params(self, layer: int) -> int:
        hd, kvh, has_v = self.attention_geometry(layer)
        q_out, kv_out = self.heads * hd, kvh * hd
        n = self.hidden * (q_out + kv_out * (2 if has_v else 1)) + q_out * self.hidden
        if self.qkv_bias:
            n += q_out + kv_out * (2 if has_v else 1)
        if self.o_bias:
            n += self.hidden
        n += {"none": 0, "head": 2 * hd, "full": q_out + kv_out}[self.qk_norm]
        return n

    def mlp_params(self, layer: int) -> int:
        if layer in self.dense_layers:
            return 3 * self.hidden * self.dense_intermediate
        n = self.experts * self.expert_params() + self.hidden * self.experts  # experts + router
        n += self.shared_experts * 3 * self.hidden * self.shared_intermediate
        if self.shared_expert_gate:
            n += self.shared_experts * self.hidden
        if self.router_scales:
            n += self.hidden + self.experts
        return n

    def layer_params(self, layer: int) -> int:
        return self.attention_params(layer) + self.mlp_params(layer) + self.norms_per_layer * self.hidden

    def embedding_params(self) -> int:
        """Input embeddings, LM head (unless tied) and the final norm."""
        return self.vocab * self.hidden * (1 if self.tied_embeddings else 2) + self.hidden

    def total_params(self) -> int:
        return self.embedding_params() + sum(self.layer_params(l) for l in range(self.layers))

    def routed_expert_params(self) -> int:
        return self.moe_layers * self.experts * self.expert_params()

    def active_params(self) -> int:
        """Parameters one token touches: everything but the experts it does not route to."""
        return self.total_params() - self.moe_layers * (self.experts - self.top_k) * self.expert_params()

    def expert_share(self) -> float:
        """Fraction of all weights that are routed experts (what AP quantization can shrink)."""
        return self.routed_expert_params() / self.total_params()

    def fp16_bytes(self) -> int:
        return 2 * self.total_params()

    # ------------------------------------------------------------ KV cache
    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """K and V of one token across all layers (fp16 by default), ignoring sliding windows."""
        total = 0
        for layer in range(self.layers):
            hd, kvh, _ = self.attention_geometry(layer)
            total += 2 * kvh * hd * dtype_bytes
        return total

    def kv_layout(self, block_size: int, dtype_bytes: int = 2, hybrid: bool = True) -> KVLayout:
        """The KV-cache groups of this model's layers (policies.kv_groups; `hybrid=False`: one table for all)."""
        token_bytes = [2 * kvh * hd * dtype_bytes for hd, kvh, _ in map(self.attention_geometry, range(self.layers))]
        windows = [None if not self.sliding_window or layer in self.global_layers else self.sliding_window
                   for layer in range(self.layers)]
        return KVLayout.build(token_bytes, windows, block_size, hybrid)

    def kv_bytes(self, tokens: int, dtype_bytes: int = 2) -> int:
        """KV bytes of a sequence of `tokens`; sliding-window layers keep at most `sliding_window`."""
        total = 0
        for layer in range(self.layers):
            hd, kvh, _ = self.attention_geometry(layer)
            kept = tokens if (not self.sliding_window or layer in self.global_layers) else min(tokens, self.sliding_window)
            total += 2 * kvh * hd * dtype_bytes * kept
        return total

    # ------------------------------------------------------------ AP bytes and the page table
    def block_shapes(self) -> np.ndarray:
        """`[2, 2]` (out, in) of an expert's blocks: row 0 gate_up [2I, H], row 1 down [H, I]."""
        return np.array([[2 * self.expert_intermediate, self.hidden], [self.hidden, self.expert_intermediate]],
                        dtype=np.int64)

    def block_byte_table(self) -> np.ndarray:
        """`[2, 9]` GPU bytes of one expert's gate_up / down block at 0..8 bits (policies.apformat)."""
        return byte_table(self.block_shapes())

    def expert_bytes(self, bits: int) -> int:
        """All routed-expert blocks at a uniform bitwidth (planes plus LUTs)."""
        if not 0 <= bits <= MAX_BITS:
            raise ValueError(f"bits must be in 0..{MAX_BITS}, got {bits}")
        return int(self.block_byte_table()[:, bits].sum()) * self.moe_layers * self.experts

    def page_table(self, bits: tuple[int, ...] = DEFAULT_BITS, initial_bits: int | np.ndarray = MAX_BITS) -> PageTable:
        return PageTable(self.moe_layers, self.experts, self.hidden, self.expert_intermediate,
                         bits=bits, initial_bits=initial_bits)

    # ------------------------------------------------------------ identity
    def architecture(self) -> dict:
        """The numbers that define the weights' shapes (no names or citations)."""
        return {k: (list(v) if isinstance(v, tuple) else v)
                for k, v in asdict(self).items() if k not in METADATA_FIELDS}

    def fingerprint(self, weights_digest: str | None = None) -> str:
        return model_fingerprint(self.architecture(), weights_digest)

    def to_dict(self) -> dict:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(self).items()}

    @classmethod
    def from_dict(cls, data: dict, where: str = "model card") -> "ModelSpec":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known - set(CARD_ONLY_KEYS))
        if unknown:
            raise CardError(f"{where}: unknown field(s) {', '.join(unknown)}; known fields: {', '.join(sorted(known))}")
        missing = [f.name for f in fields(cls) if f.name not in data and f.default is MISSING]
        if missing:
            raise CardError(f"{where}: missing field(s) {', '.join(missing)}")
        try:
            return cls(**{k: v for k, v in data.items() if k in known})
        except (TypeError, ValueError) as e:
            raise CardError(f"{where}: {e}") from None

    @classmethod
    def from_hf_config(cls, config: dict, name: str | None = None) -> "ModelSpec":
        """Build the spec from a HuggingFace `config.json` (mixtral, qwen2_moe, olmoe, qwen3_moe, gemma4)."""
        kw = _fields_from_hf_config(config)
        return cls(name=name or str(config.get("_name_or_path") or kw["arch"]), **kw)


# ---------------------------------------------------------------- HuggingFace config.json
def _get(cfg: dict, key: str, arch: str):
    if cfg.get(key) is None:
        raise CardError(f"{arch} config.json lacks {key!r}")
    return cfg[key]


def _qwen_dense_layers(cfg: dict, layers: int) -> tuple[int, ...]:
    """Qwen2/3-MoE: a layer is sparse unless listed in mlp_only_layers or skipped by decoder_sparse_step."""
    only, step = set(cfg.get("mlp_only_layers") or []), int(cfg.get("decoder_sparse_step") or 1)
    return tuple(l for l in range(layers) if l in only or (l + 1) % step != 0)


def expert_count(cfg: dict, error: type[UserError] = CardError) -> int | None:
    """The expert count of a config.json (its text config for Gemma 4), None where it gives none. transformers spells
    it num_local_experts or num_experts (an attribute_map alias; transformers 5 may save either). A config that gives
    both at different values is refused: which one transformers takes depends on its version and the architecture."""
    values = {k: int(cfg[k]) for k in ("num_local_experts", "num_experts") if cfg.get(k) is not None}
    if len(set(values.values())) > 1:
        raise error(f"config.json gives num_local_experts {values['num_local_experts']} and num_experts "
                     f"{values['num_experts']}: keep the one the checkpoint's experts match")
    return next(iter(values.values()), None)


def _fields_from_hf_config(config: dict) -> dict:
    arch = str(config.get("model_type", ""))
    arch = "gemma4" if arch == "gemma4_text" else arch
    if arch not in HF_ARCHS:
        raise CardError(f"model_type {arch!r} is not supported; supported: {', '.join(HF_ARCHS)}")
    cfg = dict(text_config(config)) if arch == "gemma4" else dict(config)
    experts = expert_count(cfg)
    if experts is not None:
        cfg["num_experts"] = cfg["num_local_experts"] = experts
    g = lambda key: int(_get(cfg, key, arch))  # noqa: E731
    layers, hidden, heads = g("num_hidden_layers"), g("hidden_size"), g("num_attention_heads")
    bias = bool(cfg.get("attention_bias", False))
    kw = dict(arch=arch, layers=layers, hidden=hidden, heads=heads, vocab=g("vocab_size"),
              kv_heads=int(cfg.get("num_key_value_heads") or heads), head_dim=int(cfg.get("head_dim") or hidden // heads),
              tied_embeddings=bool(cfg.get("tie_word_embeddings", arch == "gemma4")),
              top_k=g("top_k_experts" if arch == "gemma4" else "num_experts_per_tok"),
              shared_experts=0, shared_intermediate=0)
    if arch == "mixtral":
        kw.update(experts=g("num_local_experts"), expert_intermediate=g("intermediate_size"),
                  sliding_window=int(cfg.get("sliding_window") or 0))
    elif arch == "olmoe":
        kw.update(experts=g("num_experts"), expert_intermediate=g("intermediate_size"), qk_norm="full",
                  qkv_bias=bias, o_bias=bias)
    elif arch in ("qwen2_moe", "qwen3_moe"):
        dense = _qwen_dense_layers(cfg, layers)
        kw.update(experts=g("num_experts"), expert_intermediate=g("moe_intermediate_size"), dense_layers=dense,
                  dense_intermediate=g("intermediate_size") if dense else 0)
        if arch == "qwen2_moe":
            shared = int(cfg.get("shared_expert_intermediate_size") or 0)
            kw.update(qkv_bias=bool(cfg.get("qkv_bias", True)), shared_experts=int(shared > 0),
                      shared_intermediate=shared, shared_expert_gate=shared > 0)
        else:
            kw.update(qk_norm="head", qkv_bias=bias, o_bias=bias)
    else:
        kw.update(_gemma4_fields(cfg, g), qkv_bias=bias, o_bias=bias)
    return kw


def _gemma4_fields(cfg: dict, g) -> dict:
    """Gemma 4 with MoE blocks: a dense MLP runs beside the experts (counted as an ungated shared expert)."""
    layout = gemma4_layout(cfg, CardError)
    return dict(experts=g("num_experts"), expert_intermediate=g("moe_intermediate_size"),
                shared_experts=1, shared_intermediate=g("intermediate_size"), qk_norm="head",
                kv_heads=layout.kv_heads, head_dim=layout.head_dim,
                router_scales=True, norms_per_layer=7, global_layers=layout.global_layers,
                global_head_dim=layout.global_head_dim, global_kv_heads=layout.global_kv_heads,
                global_k_eq_v=layout.k_eq_v, sliding_window=layout.sliding_window)


# ---------------------------------------------------------------- bundled cards
def available_cards() -> list[str]:
    """Names of the bundled cards (as written in each card's `name`)."""
    return [json.loads(p.read_text())["name"] for p in sorted(CARDS_DIR.glob("*.json"))]


def _card_file(name: str) -> Path | None:
    wanted = name.lower()
    for p in sorted(CARDS_DIR.glob("*.json")):
        if p.stem.lower() == wanted or json.loads(p.read_text()).get("name", "").lower() == wanted:
            return p
    return None


def read_card_json(name_or_path: str | os.PathLike) -> dict:
    """The raw JSON of a card: a bundled card name (case-insensitive), a JSON file, or a checkpoint directory."""
    path = Path(name_or_path)
    if path.is_dir() and (path / "config.json").is_file():  # a HuggingFace checkpoint directory
        path = path / "config.json"
    if not path.is_file():
        found = _card_file(str(name_or_path))
        if found is None:
            raise CardError(f"no model card {str(name_or_path)!r}; available cards: {', '.join(available_cards())} "
                            "(or pass the path of a card JSON or a HuggingFace config.json)")
        path = found
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CardError(f"{path}: cannot read model card ({e})") from None
    if not isinstance(data, dict):
        raise CardError(f"{path}: a model card is a JSON object")
    return data


def load_card(name_or_path: str | os.PathLike) -> ModelSpec:
    """A bundled card by name, a card JSON by path, or a HuggingFace config.json by path."""
    data = read_card_json(name_or_path)
    if "arch" not in data and "model_type" in data:  # a HuggingFace config.json
        p = Path(name_or_path)
        return ModelSpec.from_hf_config(data, name=data.get("_name_or_path") or (p if p.is_dir() else p.parent).name)
    return ModelSpec.from_dict(data, where=str(name_or_path))
