"""Dummy weights (vLLM's `--load-format dummy`): seeded random tensors where a checkpoint's would be read.

For benchmarks and simulator checks at a real model's size without its weights: `DummyTensorReader` stands in for
`checkpoint.TensorReader`, so `load_model(dir, reader=DummyTensorReader(...))` builds a model from `dir`'s
config.json and tokenizer alone. Each tensor the loader asks for is made: norm weights, Gemma 4's router scales and
layer scalars ones, biases zeros, the rest normal with standard deviation 0.02 (transformers' default
`initializer_range`); each drawn from a generator seeded by (seed, name), so a tensor does not depend on which were
asked for before it. The reader keeps what it made
(`made`): `pwruntime quantize --load-format dummy` writes those as the AP checkpoint's full-precision rest.
"""
from __future__ import annotations

import zlib

import torch

from pwruntime.model.config import ModelConfig

DEFAULT_STD = 0.02
ONES = ("norm.weight", "router.scale", "router.per_expert_scale", "layer_scalar")   # tensors made of ones


class DummyTensorReader:
    """The TensorReader interface (get, has, first) over made tensors (module docstring)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: str | torch.device, seed: int = 0,
                 std: float = DEFAULT_STD) -> None:
        self.config, self.dtype, self.device, self.seed, self.std = config, dtype, torch.device(device), seed, std
        self.made: dict[str, torch.Tensor] = {}

    def has(self, name: str) -> bool:
        """A separate LM head unless the embeddings are tied; routed experts in the fused layout (one tensor a
        kind and layer); every other optional name absent."""
        if name == "lm_head.weight":
            return not self.config.tie_word_embeddings
        return name.endswith(("experts.gate_up_proj", "experts.down_proj"))

    def first(self, names: list[str]) -> str:
        return names[0]

    def get(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if name.endswith(ONES):
            t = torch.ones(shape)
        elif name.endswith(".bias"):
            t = torch.zeros(shape)
        else:
            gen = torch.Generator().manual_seed(zlib.crc32(f"{self.seed}:{name}".encode()))  # the CPU's is 32 bits
            t = torch.randn(shape, generator=gen) * self.std
        t = t.to(self.dtype)
        self.made[name] = t
        return t.to(self.device)
