"""KVCache: the tensors behind the paged KV block pool (per layer K and V [num_blocks, block_size, kv_heads, head_dim]).

A block id names the same rows in every layer; layers may differ in KV heads and head size (`layer_shapes`: Gemma
4's global layers), so a block's bytes are the sum over its layers.

The block pool (policies/kv_blocks.py) decides which block ids a sequence owns; this class only backs
them with memory. resize() grows the cache, or shrinks it keeping blocks [0, num_blocks) (the pool
guarantees those above are free), so capacity can follow the memory weight pages release or reclaim.

With `scratch=True` the tensors hold one more block, `scratch_block` (== num_blocks, never a pool id):
the padded rows of a CUDA-graph decode batch write and read there. `generation` counts the resizes. On CUDA,
`ptrs` [layers, 2] int64 holds every layer's K and V addresses on the device, rewritten by a resize that moves the
tensors: the decode kernels and the K/V writes read the caches through it (pwruntime.kernels.attention), so a captured
graph stays valid across resizes (`graph_epoch` stays 0). Elsewhere a graph would have baked the addresses, and
`graph_epoch` is the generation.

On CUDA each layer's K and V live in a GrowableBuffer (pwruntime.vmm): an address range reserved once, with physical
memory mapped behind the blocks in use. A resize maps or unmaps memory at the end and copies nothing; the tensors'
addresses never change. (With torch tensors a resize copied the whole cache into new ones, several GiB at a real
model's size, and every new size left the caching allocator a hole of the old one: a 12 GiB OLMoE replay's
allocator held 10.5 GiB of large blocks for about 7 GiB of tensors.) `growable=False` keeps torch tensors on CUDA too.

With a hybrid `layout` (policies.kv_groups: Gemma 4's sliding and global layers in groups with tables of their own) a
block id names a *page*, which one group holds at a time. The memory is then one K and one V buffer for each place in
a group, shared by the layers at that place in every group: each layer's K and V are views of its place's buffers,
[num_pages, its group's block_size, kv_heads, head_dim], all the same bytes a page (the layout's rule). A layer reads
only the pages its group's tables give it, so the views never meet.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from policies.kv_groups import KVLayout
from pwruntime.vmm import DriverCalls, GrowableBuffer


class KVCache:
    """Per layer K and V tensors [num_blocks (+1 scratch), block_size, num_kv_heads, head_dim]; `layer_shapes`, when
    given, is each layer's (num_kv_heads, head_dim) instead, and a hybrid `layout` gives each layer its group's
    block_size over shared buffers (module docstring)."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", scratch: bool = False,
                 growable: bool | None = None, layer_shapes: Sequence[tuple[int, int]] | None = None,
                 layout: KVLayout | None = None):
        if num_blocks < 0 or block_size < 1:
            raise ValueError(f"need num_blocks >= 0 and block_size >= 1, got {num_blocks}, {block_size}")
        uniform = ((num_kv_heads, head_dim),) * num_layers
        self.layer_shapes = tuple(layer_shapes) if layer_shapes is not None else uniform
        if len(self.layer_shapes) != num_layers:
            raise ValueError(f"{len(self.layer_shapes)} layer shapes for {num_layers} layers")
        self.num_layers, self.block_size = num_layers, block_size
        self.dtype, self.device = dtype, torch.device(device)
        self.num_blocks, self.scratch, self.generation = num_blocks, bool(scratch), 0
        elem = dtype.itemsize
        self.layout = layout if layout is not None else KVLayout.build(
            [2 * h * d * elem for h, d in self.layer_shapes], [None] * num_layers, block_size)
        if not self.layout.hybrid and self.layout.groups[0].block_size != block_size:
            raise ValueError(f"a single-group layout of {self.layout.groups[0].block_size}-token blocks for a cache of "
                             f"{block_size}")
        # each layer's place (its K in buffer 2 * place, its V in 2 * place + 1) and the shape of its rows in a block
        self._place, self._row_shape = self._places()
        places = max(self._place) + 1
        # the bytes of a block's rows in each buffer: K of place 0, V of place 0, K of place 1, ...
        self._row_bytes = [0] * (2 * places)
        for place, (tokens, heads, dim) in zip(self._place, self._row_shape):
            self._row_bytes[2 * place] = self._row_bytes[2 * place + 1] = tokens * heads * dim * elem
        self.buffers: list[GrowableBuffer] = []   # one per entry of _row_bytes when growable
        self._rows: list[torch.Tensor] = []       # a [capacity, row elements] view of each buffer
        self._flat: list[torch.Tensor] = []       # each buffer's [num_blocks (+1), row elements] now
        if self.device.type == "cuda" if growable is None else growable:
            self._reserve()
            self._resize_buffers(num_blocks, keep=0)
        else:
            self._flat = [torch.zeros(num_blocks + self.scratch, b // elem, dtype=dtype, device=self.device)
                          for b in self._row_bytes]
            self._make_views()
        self.ptrs: torch.Tensor | None = (torch.zeros(num_layers, 2, dtype=torch.int64, device=self.device)
                                          if self.device.type == "cuda" else None)
        self._publish()

    def _places(self) -> tuple[tuple[int, ...], tuple[tuple[int, int, int], ...]]:
        """Each layer's place and (tokens a block, kv_heads, head_dim): its own place in a single group; the place
        it holds in its group, shared with the same place of every other group, in a hybrid layout."""
        if not self.layout.hybrid:
            return (tuple(range(self.num_layers)),
                    tuple((self.block_size, h, d) for h, d in self.layer_shapes))
        place, shape = [0] * self.num_layers, [(0, 0, 0)] * self.num_layers
        elem = self.dtype.itemsize
        share = self.layout.page_bytes // (2 * self.layout.layers_per_group)   # K (or V) of one layer in a page
        for group in self.layout.groups:
            for p, layer in enumerate(group.layers):
                heads, dim = self.layer_shapes[layer]
                if group.block_size * heads * dim * elem != share:
                    raise ValueError(f"layer {layer}: {group.block_size} tokens of {heads} x {dim} are not "
                                     f"{share} bytes, the layout's share of a page")
                place[layer], shape[layer] = p, (group.block_size, heads, dim)
        return tuple(place), tuple(shape)

    def _make_views(self) -> None:
        """Each layer's K and V over its place's buffers as they are now (`_flat`)."""
        view = lambda t, shape: t.view(t.shape[0], *shape)  # noqa: E731 - (rows given: a buffer may have none)
        self.k = [view(self._flat[2 * p], shape) for p, shape in zip(self._place, self._row_shape)]
        self.v = [view(self._flat[2 * p + 1], shape) for p, shape in zip(self._place, self._row_shape)]

    def _reserve(self) -> None:
        """A buffer per place's K and V, each large enough for the whole device (the ranges are addresses only)."""
        total = torch.cuda.get_device_properties(self.device).total_memory
        most_blocks = total // sum(self._row_bytes) + 1
        elem = self.dtype.itemsize
        for row_bytes in self._row_bytes:
            buffer = GrowableBuffer(most_blocks * row_bytes, self.device)
            self.buffers.append(buffer)
            self._rows.append(buffer.rows((row_bytes // elem,), self.dtype))

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
        """Grow (new blocks are zero), or shrink keeping blocks [0, num_blocks).

        The scratch block's contents are not kept (nothing reads what a padded row wrote). A growth the device has no
        memory for raises MemoryError (VmmOutOfMemory; torch's OutOfMemoryError for torch tensors) with the cache at
        its old size, its blocks as they were (torch tensors: some buffers may be larger, each as its pointer says)."""
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        if num_blocks == self.num_blocks:
            return
        keep = min(num_blocks, self.num_blocks)
        if self.buffers:
            self._resize_buffers(num_blocks, keep)   # the addresses stay: nothing to publish
        else:
            try:
                for i, old in enumerate(self._flat):
                    new = torch.empty((num_blocks + self.scratch, old.shape[1]), dtype=self.dtype, device=self.device)
                    new[:keep].copy_(old[:keep])
                    new[keep:].zero_()   # the blocks added and the scratch block
                    self._flat[i] = new
                    self._make_views()   # the old buffer is released once nothing views it: buffer by buffer
            finally:
                self._publish()
        self.num_blocks = num_blocks
        self.generation += 1

    def _resize_buffers(self, num_blocks: int, keep: int) -> None:
        rows, old_rows = num_blocks + self.scratch, self.num_blocks + self.scratch
        for i, buffer in enumerate(self.buffers):
            try:
                buffer.resize(rows * self._row_bytes[i])
            except MemoryError:
                for grown, row_bytes in zip(self.buffers[:i], self._row_bytes):   # back to the old size: no mapping
                    grown.resize(old_rows * row_bytes)
                raise
        self._flat = [full[:rows] for full in self._rows]
        for t in self._flat:
            t[keep:].zero_()     # the blocks added and the scratch block
        self._make_views()

    def release_retired(self) -> int:
        """Wait for the device, then give the driver back what shrinks retired (GrowableBuffer.release_retired), now
        instead of at the next resize; returns the bytes (0 without growable buffers)."""
        if not self.buffers:
            return 0
        torch.cuda.synchronize(self.device)
        return sum(b.release_retired() for b in self.buffers)

    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy every buffer's block src[i] into dst[i] (int64 indices on the cache's device): a compaction's moves,
        whatever layers and groups use the blocks."""
        for t in self._flat:
            t[dst] = t[src]

    @property
    def mapped_bytes(self) -> int:
        """Device memory the growable buffers hold now (0 without them); at most one handle a buffer above nbytes,
        plus what a shrink retired and the device still uses."""
        return sum(b.mapped for b in self.buffers)

    @property
    def driver_calls(self) -> DriverCalls:
        """The driver's virtual-memory calls the growable buffers made so far (none without them)."""
        return sum((b.calls for b in self.buffers), DriverCalls())

    @property
    def peak_mapped_bytes(self) -> int:
        """The most the growable buffers held (the sum of their peaks: they grow and shrink together)."""
        return sum(b.peak_mapped for b in self.buffers)

    @property
    def nbytes(self) -> int:
        return (self.num_blocks + self.scratch) * sum(self._row_bytes)

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype, layer_shapes: Sequence[tuple[int, int]] | None = None) -> int:
        """Bytes one block occupies over all layers, K and V (`layer_shapes` as in KVCache)."""
        elem = dtype.itemsize
        shapes = layer_shapes if layer_shapes is not None else ((num_kv_heads, head_dim),) * num_layers
        return 2 * block_size * elem * sum(h * d for h, d in shapes)
