"""APExpertStore: the ExpertStore that serves routed experts from AP weights at run-time bitwidths.

Pure-torch reference path: each active expert's blocks are dequantized at their committed bits
(`pack.dequantize`: planes[:b] + LUT_b) and multiplied, grouped by expert. The bitwidth of a block
is read at every call, from an attached `policies.PageTable`'s `q` (block index
`(layer * experts + expert) * 2 + kind`, `layer` the MoE-layer ordinal as in pwruntime.model.experts)
or from `set_bits`. A 0-bit (not resident) block is
an error here: the pure-torch store has no offloading of its own.

Dequantization is the expensive part on CPU (an [out, in] gather per block per call), so the
dequantized weights are cached per (block, bits) in an LRU bounded by `cache_bytes`; a bitwidth
change simply misses the cache. The 8-bit master (all planes, all LUTs) stays in the store.

`load_ap_model(dir)` builds the whole model from an AP checkpoint: pwruntime.model.load_model reads the
full-precision tensors (the checkpoint's model.safetensors has no routed experts) and this store
serves the experts.
"""
from __future__ import annotations

from collections import OrderedDict
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from policies.apformat import MAX_BITS
from pwruntime.model.experts import block_shape, checked_block_index, expert_mlp, grouped_moe
from pwruntime.quant.ap_checkpoint import KINDS, APCheckpoint, LayerBlocks, load_ap_checkpoint
from pwruntime.quant.pack import dequantize

DEFAULT_CACHE_BYTES = 1 << 30


class APExpertStore:
    """Routed-expert weights in AP form; `moe()` dequantizes at each block's committed bits."""

    def __init__(
        self,
        layers: Sequence[dict[str, LayerBlocks]],
        *,
        experts: int,
        hidden: int,
        intermediate: int,
        bits: Sequence[int],
        moe_layers: Sequence[int] | None = None,
        initial_bits: int | np.ndarray = MAX_BITS,
        dtype: torch.dtype = torch.float32,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        table=None,
    ) -> None:
        self.experts, self.hidden, self.intermediate = experts, hidden, intermediate
        self.bits = tuple(sorted(int(b) for b in bits))
        self.layers = list(layers)
        self.moe_layers = tuple(moe_layers) if moe_layers is not None else tuple(range(len(self.layers)))
        if len(self.moe_layers) != len(self.layers):
            raise ValueError(f"{len(self.layers)} layers of blocks but {len(self.moe_layers)} MoE layer indices")
        self.dtype = dtype
        self.activation = "silu"   # the experts' gate activation (kernels.reference.ACTIVATIONS): load_ap_model sets it
        self.cache_bytes = int(cache_bytes)
        self._cache: OrderedDict[tuple[int, int], torch.Tensor] = OrderedDict()  # (block, bits)
        self._cached_bytes = 0
        self.hits = self.misses = 0
        self._bits = np.zeros(self.num_blocks, dtype=np.int8)
        self._table = None
        self.set_bits(initial_bits)
        if table is not None:
            self.attach_table(table)

    @classmethod
    def from_checkpoint(cls, ckpt: APCheckpoint | str | Path, *, device: str | torch.device = "cpu",
                        dtype: torch.dtype = torch.float32, **kw) -> "APExpertStore":
        if not isinstance(ckpt, APCheckpoint):
            ckpt = load_ap_checkpoint(ckpt)
        layers = [ckpt.read_layer(i, device=device) for i in range(ckpt.num_moe_layers)]
        return cls(layers, experts=ckpt.experts, hidden=ckpt.hidden, intermediate=ckpt.intermediate,
                   bits=ckpt.bits, moe_layers=ckpt.moe_layers, dtype=dtype, **kw)

    # ------------------------------------------------------------ bits
    @property
    def num_blocks(self) -> int:
        return len(self.layers) * self.experts * 2

    def block_index(self, layer: int, expert: int, kind: str | int) -> int:
        """Page-table row of (MoE layer, expert, kind)."""
        return checked_block_index(layer, expert, kind, len(self.layers), self.experts)

    def set_bits(self, bits: int | np.ndarray) -> None:
        """Bits per block (array [num_blocks]) or one value for all; detaches any page table."""
        arr = np.broadcast_to(np.asarray(bits, dtype=np.int64), (self.num_blocks,))
        bad = sorted(set(arr.tolist()) - set(self.bits))
        if bad:
            raise ValueError(f"bitwidths {bad} are not stored in this AP checkpoint (it has {self.bits})")
        self._bits = arr.astype(np.int8)
        self._table = None

    def attach_table(self, table) -> None:
        """Read bits from `table.q` at every call (a policies.PageTable with this store's block order)."""
        if len(table.q) != self.num_blocks:
            raise ValueError(f"page table has {len(table.q)} blocks, store has {self.num_blocks}")
        self._table = table

    def current_bits(self) -> np.ndarray:
        return np.asarray(self._table.q if self._table is not None else self._bits)

    def bits_of(self, layer: int, expert: int, kind: str | int) -> int:
        b = int(self.current_bits()[self.block_index(layer, expert, kind)])
        if b not in self.bits:
            raise ValueError(f"block L{layer}.E{expert}.{kind} is at {b} bits, which this store cannot serve "
                             f"(stored bitwidths {self.bits}; 0 means not resident)")
        return b

    # ------------------------------------------------------------ weights
    def shape(self, kind: str) -> tuple[int, int]:
        return block_shape(kind, self.hidden, self.intermediate)

    def packed(self, layer: int, expert: int, kind: str, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(planes[:bits] uint32 [bits, out, words], LUT_bits fp16 [out, 2**bits]) of one block."""
        blocks = self.layers[layer][kind]
        return blocks.planes[expert, :bits], blocks.luts[bits][expert]

    def dequantized(self, layer: int, expert: int, kind: str, bits: int) -> torch.Tensor:
        key = (self.block_index(layer, expert, kind), bits)
        w = self._cache.get(key)
        if w is not None:
            self.hits += 1
            self._cache.move_to_end(key)
            return w
        self.misses += 1
        planes, lut = self.packed(layer, expert, kind, bits)
        w = dequantize(planes, lut, *self.shape(kind), dtype=self.dtype)
        size = w.numel() * w.element_size()
        if size <= self.cache_bytes:
            self._cache[key] = w
            self._cached_bytes += size
            while self._cached_bytes > self.cache_bytes:
                _, old = self._cache.popitem(last=False)
                self._cached_bytes -= old.numel() * old.element_size()
        return w

    def weight(self, layer: int, expert: int, kind: str) -> torch.Tensor:
        """The block dequantized at its committed bits: gate_up [2I, H] (gate rows first) or down [H, I]."""
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        return self.dequantized(layer, expert, kind, self.bits_of(layer, expert, kind))

    def clear_cache(self) -> None:
        self._cache.clear()
        self._cached_bytes = 0

    def cache_info(self) -> dict:
        return {"hits": self.hits, "misses": self.misses, "entries": len(self._cache), "bytes": self._cached_bytes,
                "limit_bytes": self.cache_bytes}

    # ------------------------------------------------------------ compute
    def moe(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
            down_in_norm: torch.Tensor | None = None) -> torch.Tensor:
        """sum_k w_k * down_e(act(gate_e x) * up_e x), the DenseExpertStore math on dequantized weights."""
        def expert(e: int, rows: torch.Tensor):
            return expert_mlp(rows, self.weight(layer, e, "gate_up").to(rows.dtype),
                              self.weight(layer, e, "down").to(rows.dtype), act=self.activation)

        return grouped_moe(x, topk_ids, topk_weights, self.experts, expert, down_in_norm)


def load_ap_model(path: str | Path, dtype: torch.dtype | str = torch.float32, device: str | torch.device = "cpu",
                  expert_device: str | torch.device | None = None, **store_kw):
    """(MoEModel, APExpertStore) from an AP checkpoint directory; store_kw go to APExpertStore.

    The store's planes and LUTs go to `expert_device` (default `device`): "cpu" keeps them on the
    host for a pwruntime.device_store.DeviceExpertStore to page from."""
    from pwruntime.model import load_model, parse_dtype

    ckpt = load_ap_checkpoint(path)
    dt = parse_dtype(dtype)
    store = APExpertStore.from_checkpoint(ckpt, device=device if expert_device is None else expert_device, dtype=dt,
                                          **store_kw)
    model = load_model(path, dtype=dt, device=device, experts=store)
    c = model.config
    store.activation = c.hidden_act
    if (c.experts, c.hidden, c.expert_intermediate, c.num_moe_layers) != \
            (ckpt.experts, ckpt.hidden, ckpt.intermediate, ckpt.num_moe_layers):
        from pwruntime.quant.ap_checkpoint import APCheckpointError
        raise APCheckpointError(f"{path}: config.json does not match ap_config.json (experts/hidden/intermediate/"
                                "MoE layers); re-run pwruntime quantize")
    return model, store
