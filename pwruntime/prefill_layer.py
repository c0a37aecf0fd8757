"""The prefill MoE layer over a device weight table (`prefill_moe`): what `DeviceExpertStore.moe` runs for more tokens
than the fused decode kernel takes.

The active experts are dequantized at their committed bits (`dequantize_experts`, `prefill_group_limits` of them at
once) and run by `grouped_mm_moe` (torch's grouped GEMM over the unpadded rows, every expert, a chunk at a time,
nothing read back to the host: capturable) where `grouped_mm_prefill` says so, else by `padded_moe` (which reads the
experts' row counts back: `prefill_syncs`). A grouped layer whose blocks are all at 3-4 bits, with few rows an expert,
runs the fused AP GEMM over the planes instead, with no dequantized copy (`FusedGemmLayer`, `fused_gemm_prefill`).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from policies.memory_budget import DEFAULT_PREFILL_CHUNK_BYTES, prefill_chunk_experts
from policies.prefill_path import (FUSED_GEMM_MAX_BITS, GROUPED_MM_MAX_INTERMEDIATE, fused_gemm_layer,
                                   fused_gemm_tile_rows)
from pwruntime.kernels import DeviceWeightTable, MoEShape, ap_gemm, dequantize_blocks
from pwruntime.kernels.device_table import COL_BITS
from pwruntime.model.experts import block_shape, grouped_mm_moe, grouped_mm_ok, padded_moe

# Prefill groups of experts may compute this many FLOPs on padding rows (padded_moe): about 13 us at the H200's
# measured 772 TFLOP/s fp16, less than the host time of the launches another group of experts would cost.
PAD_FLOPS = 10 ** 10


def capturing(device: torch.device) -> bool:
    """Whether work on `device` is being captured into a CUDA graph now (torch's current stream)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def prefill_group_limits(shape: MoEShape, element_size: int,
                         chunk_bytes: int = DEFAULT_PREFILL_CHUNK_BYTES) -> tuple[int, int]:
    """(experts, padding rows) a prefill group may hold: `chunk_bytes` of dequantized weights, `PAD_FLOPS`."""
    experts = prefill_chunk_experts(shape.hidden, shape.intermediate, element_size, chunk_bytes)
    return experts, PAD_FLOPS // (6 * shape.hidden * shape.intermediate)


def dequantize_experts(table: DeviceWeightTable, shape: MoEShape, layer: int, experts: Sequence[int],
                       dtype: torch.dtype, skip: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate_up [n, 2I, H], down [n, H, I]) of `experts` of one MoE layer at their committed bits. A run of
    consecutive experts (a `range`, as grouped_mm_moe asks) is asked for by block ids made on the device (no copy:
    capturable, see prefill_syncs). `skip` as dequantize_blocks takes it."""
    run = isinstance(experts, range) and experts.step == 1 and table.device.type == "cuda"
    first = torch.arange(2 * experts.start, 2 * experts.stop, 2, device=table.device) if run else None

    def ids(kind: int):
        if run:
            return first + shape.block(layer, 0, kind)
        return [shape.block(layer, e, kind) for e in experts]

    gate_up, down = (dequantize_blocks(table, ids(kind), *block_shape(kind, shape.hidden, shape.intermediate), dtype,
                                       skip) for kind in (0, 1))
    return gate_up, down


def prefill_syncs(shape: MoEShape, x: torch.Tensor) -> bool:
    """Whether `prefill_moe` on activations x reads the experts' row counts back to the host (so cannot run in a
    CUDA graph): everywhere but `grouped_mm_moe`."""
    return not grouped_mm_prefill(x, shape)


def grouped_mm_prefill(x: torch.Tensor, shape: MoEShape) -> bool:
    """Whether prefill takes `grouped_mm_moe`: bf16 on a CUDA device of compute capability 9.0 or newer, experts
    of at most `GROUPED_MM_MAX_INTERMEDIATE` intermediate rows, rows of 16-byte multiples. Measured on the H200
    (torch 2.11, `pwruntime bench prefill`, cuda/NOTES.md session 10): torch's grouped GEMM ran the layers of
    Qwen1.5-MoE, OLMoE and Qwen3-MoE up to 30% faster than `padded_moe` (one case of nine 2% slower),
    Mixtral's (8 experts of 14336) 7-20% slower, and in fp16 the others' 2-3x slower."""
    return grouped_mm_ok(x, shape.hidden, shape.intermediate) and shape.intermediate <= GROUPED_MM_MAX_INTERMEDIATE


@dataclass(frozen=True)
class FusedGemmLayer:
    """One MoE layer's experts as the fused AP GEMM reads them (`kernels.ap_gemm`), for `grouped_mm_moe`. Where the
    device makes the choice, `on` (int64 [1] on the device) is 1 when every block of the layer is at
    FUSED_GEMM_MAX_BITS or fewer, read from the device table when the step runs, so a captured step follows the bits
    of each replay, and `off` = 1 - on; where the host made it (the GEMM runs), both are None."""
    table: DeviceWeightTable
    blocks: tuple[range, range]                # the experts' gate_up and down blocks (page-table rows)
    out_features: tuple[int, int]              # gate_up's and down's
    tile_rows: int
    on: torch.Tensor | None
    off: torch.Tensor | None

    @classmethod
    def of(cls, table: DeviceWeightTable, shape: MoEShape, layer: int, rows: int,
           on_device: bool = True) -> FusedGemmLayer | None:
        """The layer of `rows` routed rows; `on_device` False: the choice made now from the table's host mirror (None
        where a block is above FUSED_GEMM_MAX_BITS), for a step that runs at once (not captured)."""
        first, e = shape.block(layer, 0, 0), shape.num_experts   # the layer's blocks: gate_up, down, gate_up...
        on = off = None
        if on_device:
            on = (table.table[first:first + 2 * e, COL_BITS].amax() <= FUSED_GEMM_MAX_BITS).to(torch.int64).reshape(1)
            off = 1 - on
        elif table.host[first:first + 2 * e, COL_BITS].max() > FUSED_GEMM_MAX_BITS:
            return None
        outs = (block_shape(0, shape.hidden, shape.intermediate)[0], shape.hidden)
        blocks = (range(first, first + 2 * e, 2), range(first + 1, first + 2 * e, 2))
        return cls(table, blocks, outs, fused_gemm_tile_rows(rows, e), on, off)

    def mm(self, kind: int, a: torch.Tensor, ends: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The rows a [N, in] sorted by expert (`ends` int32 [E]) times their experts' blocks of `kind`, where `on`
        says so (into `out` when given)."""
        return ap_gemm.ap_grouped_mm(self.table, self.blocks[kind], a, ends, self.out_features[kind],
                                     FUSED_GEMM_MAX_BITS, self.tile_rows, out, self.on)


def fused_gemm_prefill(x: torch.Tensor, shape: MoEShape) -> bool:
    """Whether `prefill_moe` may run these activations' layer through the fused AP GEMM (`FusedGemmLayer`; it does
    where every block of the layer is at FUSED_GEMM_MAX_BITS or fewer): on `grouped_mm_moe`'s path, where
    `policies.prefill_path.fused_gemm_layer` says so (shapes the kernel takes, few rows an expert)."""
    return grouped_mm_prefill(x, shape) and fused_gemm_layer(x.shape[0] * shape.top_k, shape.num_experts,
                                                             shape.hidden, shape.intermediate)


def prefill_moe(table: DeviceWeightTable, shape: MoEShape, layer: int, x: torch.Tensor, topk_ids: torch.Tensor,
                topk_weights: torch.Tensor, chunk_bytes: int = DEFAULT_PREFILL_CHUNK_BYTES,
                down_in_norm: torch.Tensor | None = None, fused_gemm: bool = True) -> torch.Tensor:
    """The MoE of many tokens over a device weight table: the active experts dequantized at their committed bits
    (`dequantize_experts`) a group at a time (`prefill_group_limits`) and run by `grouped_mm_moe` where
    `grouped_mm_prefill` says so, else by `padded_moe`. Where `fused_gemm_prefill` says so, `grouped_mm_moe` runs the
    fused AP GEMM instead whenever the layer's blocks are all at 4 bits or fewer: in a CUDA-graph capture decided on
    the device at each replay (the dequantization and the chunks' GEMMs then compute nothing), else by the host now
    (the other path is not launched at all). `fused_gemm` False: never."""
    max_experts, max_pad_rows = prefill_group_limits(shape, x.element_size(), chunk_bytes)
    fused = (FusedGemmLayer.of(table, shape, layer, x.shape[0] * shape.top_k, capturing(table.device))
             if fused_gemm and fused_gemm_prefill(x, shape) else None)
    skip = None if fused is None else fused.on
    weights_of = lambda group: dequantize_experts(table, shape, layer, group, x.dtype, skip)  # noqa: E731
    if grouped_mm_prefill(x, shape):
        return grouped_mm_moe(x, topk_ids, topk_weights, shape.num_experts, weights_of, max_experts, down_in_norm,
                              shape.activation, fused)
    return padded_moe(x, topk_ids, topk_weights, shape.num_experts, weights_of, max_experts, max_pad_rows,
                      down_in_norm, shape.activation)
