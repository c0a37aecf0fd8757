"""KVCache: the tensors behind the paged KV block pool (per layer K and V [num_blocks, block_size, kv_heads, head_dim]).

The block pool (policies/kv_blocks.py) decides which block ids a sequence owns; this class only backs
them with memory. resize() grows the cache, or shrinks it keeping blocks [0, num_blocks) (the pool
guarantees those above are free), so capacity can follow the memory weight pages release or reclaim.

With `scratch=True` the tensors hold one more block, `scratch_block` (== num_blocks, never a pool id):
the padded rows of a CUDA-graph decode batch write and read there. `generation` counts the resizes
that replaced the tensors. On CUDA, `ptrs` [layers, 2] int64 holds every layer's K and V addresses on the device and
each resize rewrites it: the decode kernels and the K/V writes read the caches through it
(pwruntime.kernels.attention), so a captured graph stays valid across resizes (`graph_epoch` stays 0). Elsewhere a
graph would have baked the addresses, and `graph_epoch` is the generation.
"""
from __future__ import annotations

import torch


class KVCache:
    """Per layer K and V tensors [num_blocks (+1 scratch), block_size, num_kv_heads, head_dim]."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", scratch: bool = False):
        if num_blocks < 0 or block_size < 1:
            raise ValueError(f"need num_blocks >= 0 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_layers, self.block_size = num_layers, block_size
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.dtype, self.device = dtype, torch.device(device)
        self.num_blocks, self.scratch, self.generation = num_blocks, bool(scratch), 0
        self.k: list[torch.Tensor] = [self._alloc(num_blocks) for _ in range(num_layers)]
        self.v: list[torch.Tensor] = [self._alloc(num_blocks) for _ in range(num_layers)]
        self.ptrs: torch.Tensor | None = (torch.zeros(num_layers, 2, dtype=torch.int64, device=self.device)
                                          if self.device.type == "cuda" else None)
        self._publish()

    def _alloc(self, n: int) -> torch.Tensor:
        return torch.zeros(n + self.scratch, self.block_size, self.num_kv_heads, self.head_dim, dtype=self.dtype,
                           device=self.device)

    def _publish(self) -> None:
        """Write the tensors' addresses into `ptrs` (stream-ordered: later kernels read the new ones). The copy does
        not wait for the stream: a blocking one would hold the host until the resize's copies had run (a KV cache of
        gigabytes: about a millisecond), so it comes from pinned memory, as `pwruntime.host_copy` explains."""
        if self.ptrs is not None:
            addresses = torch.tensor([[k.data_ptr(), v.data_ptr()] for k, v in zip(self.k, self.v)], dtype=torch.int64)
            self.ptrs.copy_(addresses.reshape(self.num_layers, 2).pin_memory(), non_blocking=True)

    def layer_ptrs(self, layer: int) -> torch.Tensor | None:
        """Layer `layer`'s [K, V] addresses on the device (None off CUDA)."""
        return None if self.ptrs is None else self.ptrs[layer]

    @property
    def graph_epoch(self) -> int:
        """Changes whenever a captured forward would read or write stale cache tensors (see the module docstring)."""
        return 0 if self.ptrs is not None else self.generation

    @property
    def scratch_block(self) -> int | None:
        """The block id past the pool's ids that padded graph rows use, or None without scratch."""
        return self.num_blocks if self.scratch else None

    def resize(self, num_blocks: int) -> None:
        """Grow (new blocks are zero), or shrink keeping blocks [0, num_blocks); frees the old tensors.

        The scratch block's contents are not kept (nothing reads what a padded row wrote)."""
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        if num_blocks == self.num_blocks:
            return
        keep = min(num_blocks, self.num_blocks)
        for tensors in (self.k, self.v):
            for i, old in enumerate(tensors):
                new = torch.empty((num_blocks + self.scratch, *old.shape[1:]), dtype=self.dtype, device=self.device)
                new[:keep].copy_(old[:keep])
                new[keep:].zero_()   # the blocks added and the scratch block
                tensors[i] = new     # the old tensor is released here, layer by layer
        self.num_blocks = num_blocks
        self.generation += 1
        self._publish()

    @property
    def nbytes(self) -> int:
        per_block = self.bytes_per_block(self.num_layers, self.block_size, self.num_kv_heads, self.head_dim, self.dtype)
        return (self.num_blocks + self.scratch) * per_block

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype) -> int:
        """Bytes one block occupies over all layers, K and V."""
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * block_size * num_kv_heads * head_dim * elem
