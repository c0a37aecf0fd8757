"""KVCache: the tensors behind the paged KV block pool (per layer K and V [num_blocks, block_size, kv_heads, head_dim]).

The block pool (policies/kv_blocks.py) decides which block ids a sequence owns; this class only backs
them with memory. resize() grows the cache, or shrinks it keeping blocks [0, num_blocks) (the pool
guarantees those above are free), so capacity can follow the memory weight pages release or reclaim.
"""
from __future__ import annotations

import torch


class KVCache:
    """Per layer K and V tensors [num_blocks, block_size, num_kv_heads, head_dim]."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        if num_blocks < 0 or block_size < 1:
            raise ValueError(f"need num_blocks >= 0 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_layers, self.block_size = num_layers, block_size
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.dtype, self.device = dtype, torch.device(device)
        self.num_blocks = num_blocks
        self.k: list[torch.Tensor] = [self._alloc(num_blocks) for _ in range(num_layers)]
        self.v: list[torch.Tensor] = [self._alloc(num_blocks) for _ in range(num_layers)]

    def _alloc(self, n: int) -> torch.Tensor:
        return torch.zeros(n, self.block_size, self.num_kv_heads, self.head_dim, dtype=self.dtype,
                           device=self.device)

    def resize(self, num_blocks: int) -> None:
        """Grow (new blocks are zero), or shrink keeping blocks [0, num_blocks); frees the old tensors."""
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        if num_blocks == self.num_blocks:
            return
        keep = min(num_blocks, self.num_blocks)
        for tensors in (self.k, self.v):
            for i, old in enumerate(tensors):
                new = self._alloc(num_blocks)
                new[:keep].copy_(old[:keep])
                tensors[i] = new     # the old tensor is released here, layer by layer
        self.num_blocks = num_blocks

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.bytes_per_block(self.num_layers, self.block_size, self.num_kv_heads,
                                                      self.head_dim, self.dtype)

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype) -> int:
        """Bytes one block occupies over all layers, K and V."""
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * block_size * num_kv_heads * head_dim * elem
