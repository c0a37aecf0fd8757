"""pwruntime.model: HuggingFace MoE checkpoints (Mixtral, Qwen2-MoE, OLMoE, Qwen3-MoE, Gemma 4) in plain PyTorch."""
from pwruntime.model.attention import paged_attention
from pwruntime.model.attention_plan import AttentionMetadata, batch_metadata, prefill_metadata
from pwruntime.model.config import ARCHITECTURES, CheckpointError, ModelConfig
from pwruntime.model.experts import DenseExpertStore, ExpertStore
from pwruntime.model.loader import load_model, parse_dtype
from pwruntime.model.moe_model import ForwardOutput, LayerRouting, MoEModel
from pwruntime.model.tokenizer import Tokenizer

__all__ = ["ARCHITECTURES", "AttentionMetadata", "CheckpointError", "DenseExpertStore", "ExpertStore",
           "ForwardOutput", "LayerRouting", "ModelConfig", "MoEModel", "Tokenizer", "batch_metadata",
           "load_model", "paged_attention", "parse_dtype", "prefill_metadata"]
