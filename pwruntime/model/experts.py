"""The narrow expert interface: the model reads routed-expert weights only through an ExpertStore.

`layer` is the MoE-layer index: the position of the decoder layer in ModelConfig.moe_layers (equal to the
decoder layer index when every layer is MoE, as in all published checkpoints of the five architectures).
It matches the page table's block index i = (layer * experts + expert) * 2 + kind and the order of
ForwardOutput.routing. Expert e computes  down @ (act(gate @ x) * (up @ x))  with
gate_up = [gate; up] of shape [2I, H] and down of shape [H, I]; act is SiLU (Gemma 4: tanh-approximated GELU).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np
import torch

from policies.page_table import block_index
from pwruntime.kernels.layer_ops import act_mul, move_rows, row_norms, slot_combine

KINDS = ("gate_up", "down")


def block_shape(kind: str | int, hidden: int, intermediate: int) -> tuple[int, int]:
    """(out, in) of a linear-block: gate_up [2I, H], down [H, I]."""
    k = KINDS.index(kind) if isinstance(kind, str) else int(kind)
    return (2 * intermediate, hidden) if k == 0 else (hidden, intermediate)


def checked_block_index(layer: int, expert: int, kind: str | int, layers: int, experts: int) -> int:
    """Page-table row (policies.page_table.block_index) of (MoE layer, expert, kind), after checking it exists."""
    k = KINDS.index(kind) if isinstance(kind, str) else int(kind)
    if not 0 <= layer < layers or not 0 <= expert < experts:
        raise ValueError(f"no block L{layer}.E{expert}: the store has {layers} MoE layers x {experts} experts")
    return block_index(layer, expert, k, experts)


@runtime_checkable
class ExpertStore(Protocol):
    def weight(self, layer: int, expert: int, kind: str) -> torch.Tensor:
        """kind "gate_up": [2I, H] (gate rows first, then up); kind "down": [H, I]."""
        ...

    def moe(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
            down_in_norm: torch.Tensor | None = None) -> torch.Tensor:
        """sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t]) for every token t: [T, H] -> [T, H].

        When `down_in_norm` (a float32 [T, k] tensor) is given, it is filled with the L2 norm of the
        intermediate activation fed to each selected expert's down projection (for routing records).
        """
        ...


def expert_mlp(rows: torch.Tensor, gate_up: torch.Tensor | None, down: torch.Tensor | None,
               offs: torch.Tensor | None = None, act: str = "silu", count: torch.Tensor | None = None,
               fused=None) -> tuple[torch.Tensor, torch.Tensor]:
    """One expert on its rows [n, H], or a batch of experts on theirs [b, n, H]: (act = act(gate rows) *
    (up rows) [..., n, I], down act [..., n, H]). With `offs` (int32 [b], each expert's end row), rows [N, H]
    sorted by expert go through torch's grouped GEMM against the b experts' matrices instead, which computes only
    the rows below the last offset; `count` (that row on the device, int64 [1]) bounds the activation's rows too.
    `fused` (with offs; a `prefill_layer.FusedGemmLayer`) may run the fused AP GEMM in their place, as its `on` says
    on the device: the grouped GEMMs then get offsets of zeros (they compute nothing) and the fused GEMM writes their
    results; with gate_up and down None it runs alone.

    gate_up [..., 2I, H] (gate rows first), down [..., H, I]: the expert body the dispatchers below run."""
    gated = None if fused is None or gate_up is None else (offs * fused.off).to(torch.int32)

    def mm(a: torch.Tensor, w: torch.Tensor | None, kind: int) -> torch.Tensor:
        wt = None if w is None else w.transpose(-1, -2)
        if offs is None:
            return torch.matmul(a, wt)
        if fused is None:
            return torch._grouped_mm(a, wt, offs=offs)
        return fused.mm(kind, a, offs, None if wt is None else torch._grouped_mm(a, wt, offs=gated))

    a = act_mul(mm(rows, gate_up, 0), act, count)
    return a, mm(a, down, 1)


@dataclass
class _Dispatch:
    """One MoE dispatch: the (token, slot) pairs sorted by expert (stable), each expert's row count on the device
    (reading them back is a dispatch's host sync), the sorted rows (each its token's input), and what a
    dispatcher fills in, kept in slot order (row t * k + j: token t's slot j): each row's expert output and, when
    down norms are asked, its activation's norm. Without `outputs` nothing is put: the dispatcher runs every sorted
    row at once and combines from its result (`combine_sorted`)."""
    order: torch.Tensor
    counts: torch.Tensor
    rows: torch.Tensor
    outputs: torch.Tensor | None
    norms: torch.Tensor | None

    @classmethod
    def of(cls, x: torch.Tensor, topk_ids: torch.Tensor, num_experts: int, norms: bool,
           outputs: bool = True) -> _Dispatch:
        flat = topk_ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        rows = x[order // topk_ids.shape[1]]   # each sorted (token, slot) pair's token
        # counted by index_add_ into a fixed size, not bincount, which reads the largest id back to the host
        counts = torch.zeros(num_experts, dtype=torch.long, device=x.device).index_add_(0, flat, torch.ones_like(flat))
        if not outputs:
            return cls(order, counts, rows, None, None)
        return cls(order, counts, rows, x.new_empty(rows.shape),
                   torch.empty(rows.shape[0], dtype=torch.float32, device=x.device) if norms else None)

    def put(self, dest, act: torch.Tensor, y: torch.Tensor, count: torch.Tensor | None = None) -> None:
        """Sorted rows `dest` (a slice or an index) got expert outputs y [n, H] from activations act [n, I]; with
        `count` (int64 [1] on the device) only the first `count` of them: the others are left alone (on a GPU not
        even read)."""
        slots = self.order[dest]
        move_rows(y, self.outputs, dst_index=slots, count=count)
        if self.norms is not None:
            row_norms(act, out=self.norms, count=count, out_index=slots)

    def combine(self, topk_weights: torch.Tensor, down_in_norm: torch.Tensor | None) -> torch.Tensor:
        """sum over each token's slots of routing weight * expert output, accumulated in float32 slot by slot
        (`layer_ops.slot_combine`: deterministic, no atomics, each output row read once on a GPU); fills
        down_in_norm."""
        if self.norms is not None:
            down_in_norm.view(-1).copy_(self.norms)
        return slot_combine(self.outputs, topk_weights)

    def combine_sorted(self, act: torch.Tensor, y: torch.Tensor, topk_weights: torch.Tensor,
                       down_in_norm: torch.Tensor | None) -> torch.Tensor:
        """combine's result from every sorted row's activation act [n, I] and output y [n, H], read where each
        slot's row went (no scatter of the outputs into slot order: a write and a read of y fewer)."""
        where = torch.empty_like(self.order).index_copy_(0, self.order, torch.arange(self.order.shape[0],
                                                                                      device=self.order.device))
        if down_in_norm is not None:
            row_norms(act, out=down_in_norm, out_index=self.order)
        return slot_combine(y, topk_weights, where)


def grouped_moe(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_experts: int,
                expert_fn, down_in_norm: torch.Tensor | None = None) -> torch.Tensor:
    """Shared plain-torch MoE dispatch: sort (token, slot) pairs by expert, run one call per active expert.

    expert_fn(e, rows [n, H]) -> (intermediate act [n, I], output [n, H]). Accumulates in float32.
    """
    d = _Dispatch.of(x, topk_ids, num_experts, down_in_norm is not None)
    start = 0
    for e, c in enumerate(d.counts.tolist()):
        if c == 0:
            continue
        d.put(slice(start, start + c), *expert_fn(e, d.rows[start:start + c]))
        start += c
    return d.combine(topk_weights, down_in_norm)


def expert_groups(counts: Sequence[int], max_experts: int, max_pad_rows: int) -> list[list[int]]:
    """The active experts (count > 0) in padded_moe's groups: by descending count (ties by id), a group closing
    when it holds `max_experts` or when padding it and the next expert to its first (largest) count would add
    more than `max_pad_rows` rows that are computed and dropped. An expert alone is never padded."""
    if max_experts < 1:
        raise ValueError(f"max_experts must be >= 1, got {max_experts}")
    groups: list[list[int]] = []
    group: list[int] = []
    rows = 0
    for e in sorted((e for e, c in enumerate(counts) if c > 0), key=lambda e: (-counts[e], e)):
        if group and (len(group) == max_experts or (len(group) + 1) * counts[group[0]] - rows - counts[e] > max_pad_rows):
            groups.append(group)
            group, rows = [], 0
        group.append(e)
        rows += counts[e]
    return groups + [group] if group else groups


def padded_moe(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_experts: int,
               weights_of, max_experts: int, max_pad_rows: int,
               down_in_norm: torch.Tensor | None = None, act: str = "silu") -> torch.Tensor:
    """grouped_moe's result with a few launches per group of experts instead of a set per expert (prefill).

    weights_of(experts) -> (gate_up [n, 2I, H], down [n, H, I]) of a list of experts; at most `max_experts` are
    asked at once (expert_groups, which also bounds a group's padding by `max_pad_rows`). Each group's rows are
    padded to its largest count (pads repeat a real row and are dropped) and run through expert_mlp as one batch.
    """
    d = _Dispatch.of(x, topk_ids, num_experts, down_in_norm is not None)
    counts = d.counts.tolist()
    starts = np.concatenate([[0], np.cumsum(counts)])
    for group in expert_groups(counts, max_experts, max_pad_rows):
        width = counts[group[0]]
        count = np.array([counts[e] for e in group])
        slot = np.arange(width)[None, :]
        src = (starts[group][:, None] + np.minimum(slot, count[:, None] - 1)).reshape(-1)  # sorted row of each slot
        keep = np.flatnonzero((slot < count[:, None]).reshape(-1))  # the real slots
        idx = torch.from_numpy(np.concatenate([src, keep, src[keep]])).to(x.device, non_blocking=True)
        take, kept, dest = idx.split([len(src), len(keep), len(keep)])
        gate_up, down = weights_of(group)
        a, y = expert_mlp(d.rows[take].view(len(group), width, -1), gate_up, down, act=act)
        del gate_up, down  # the next group's weights are made after these go
        d.put(dest, a.reshape(-1, a.shape[-1])[kept], y.reshape(-1, y.shape[-1])[kept])
    return d.combine(topk_weights, down_in_norm)


def grouped_mm_moe(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_experts: int,
                   weights_of, max_experts: int, down_in_norm: torch.Tensor | None = None,
                   act: str = "silu", fused=None) -> torch.Tensor:
    """grouped_moe's result with torch's grouped GEMM (`torch._grouped_mm`, prefill in bf16 on Hopper), reading
    nothing back to the host: no host sync, capturable in a CUDA graph.

    The rows stay sorted by expert and unpadded, and every expert is asked for (`weights_of` as in padded_moe,
    with a `range` of expert ids), those without rows included, `max_experts` at a time in id order. A chunk is two
    grouped GEMMs over its experts' rows with their row offsets on the device. The grouped GEMM takes its rows from
    the first, so each chunk after the first runs on the sorted rows rotated to start at its own (the rotation is
    a device index, as are the offsets). A chunk's row count, known on the device only, bounds its rotation, its
    activation and the scatter of its outputs into slot order, so each moves its own rows, not all of them. With one
    chunk the combine reads the GEMMs' rows where they are, sorted (`_Dispatch.combine_sorted`).

    `fused` (a `prefill_layer.FusedGemmLayer`): where its `on` says so on the device, the fused AP GEMM computes the
    layer over every sorted row at once, and the chunks see row ends of zeros, so their GEMMs, moves and activations
    compute nothing (`weights_of` must skip its dequantization then, as `fused.on` says). A `fused` without `on`
    (the host's choice) runs alone: no chunk, no dequantization.
    """
    if not x.shape[0]:
        return x.new_empty(x.shape)
    fused_only = fused is not None and fused.on is None
    chunked = num_experts > max_experts and not fused_only
    d = _Dispatch.of(x, topk_ids, num_experts, down_in_norm is not None, outputs=chunked)
    n = d.rows.shape[0]
    ends = torch.cumsum(d.counts, 0)
    if not chunked:
        gate_up, down = (None, None) if fused_only else weights_of(range(num_experts))
        return d.combine_sorted(*expert_mlp(d.rows, gate_up, down, ends.to(torch.int32), act, fused=fused),
                                topk_weights, down_in_norm)
    chunk_ends = ends if fused is None else ends * fused.off  # zeros where the fused GEMM runs
    pos, rotated = torch.arange(n, device=x.device), torch.empty_like(d.rows)
    for first in range(0, num_experts, max_experts):
        last = min(first + max_experts, num_experts)
        gate_up, down = weights_of(range(first, last))
        if not first:
            count = chunk_ends[last - 1:last]
            d.put(slice(None), *expert_mlp(d.rows, gate_up, down, chunk_ends[:last].to(torch.int32), act, count),
                  count)
        else:
            start = chunk_ends[first - 1]
            count = chunk_ends[last - 1:last] - start
            src = (pos + start) % n   # sorted row of each rotated row: this chunk's rows first
            move_rows(d.rows, rotated, src_index=src, count=count)
            offs = (chunk_ends[first:last] - start).to(torch.int32)
            d.put(src, *expert_mlp(rotated, gate_up, down, offs, act, count), count)
        del gate_up, down  # the next chunk's weights are made after these go
    if fused is not None:
        count = ends[-1:] * fused.on
        d.put(slice(None), *expert_mlp(d.rows, None, None, ends.to(torch.int32), act, count, fused), count)
    return d.combine(topk_weights, down_in_norm)


def grouped_mm_ok(x: torch.Tensor, hidden: int, intermediate: int) -> bool:
    """Whether torch's grouped GEMM (`torch._grouped_mm`) serves activations x: bf16 on a CUDA device of compute
    capability 9.0 or newer, rows of 16-byte multiples."""
    return (x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")
            and torch.cuda.get_device_capability(x.device) >= (9, 0) and hidden % 8 == 0 and intermediate % 8 == 0)


class DenseExpertStore:
    """Full-precision expert weights: per MoE layer a gate_up [E, 2I, H] and a down [E, H, I] tensor.

    In bf16 on Hopper a layer is two grouped GEMMs over all its experts (`grouped_mm_moe`, rows sorted by expert,
    the experts' offsets on the device): no host sync and no data-dependent allocation, so decode steps run from
    CUDA graphs (`capturable`). Elsewhere one set of launches per active expert (`grouped_moe`). `activation` is
    the experts' gate activation (a key of kernels.reference.ACTIVATIONS)."""

    def __init__(self, gate_up: list[torch.Tensor], down: list[torch.Tensor], activation: str = "silu"):
        if len(gate_up) != len(down):
            raise ValueError("gate_up and down need one tensor per MoE layer each")
        self.gate_up, self.down, self.activation = gate_up, down, activation

    @property
    def num_layers(self) -> int:
        return len(self.gate_up)

    def weight(self, layer: int, expert: int, kind: str) -> torch.Tensor:
        if kind == "gate_up":
            return self.gate_up[layer][expert]
        if kind == "down":
            return self.down[layer][expert]
        raise ValueError(f"kind must be one of {KINDS}, not {kind!r}")

    @property
    def capturable(self) -> bool:
        w = self.gate_up[0]
        return grouped_mm_ok(w, w.shape[2], w.shape[1] // 2)

    def moe(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
            down_in_norm: torch.Tensor | None = None) -> torch.Tensor:
        gate_up, down = self.gate_up[layer], self.down[layer]
        experts = gate_up.shape[0]
        if grouped_mm_ok(x, gate_up.shape[2], down.shape[2]):
            return grouped_mm_moe(x, topk_ids, topk_weights, experts, lambda _: (gate_up, down), experts, down_in_norm,
                                  self.activation)
        return grouped_moe(x, topk_ids, topk_weights, experts,
                           lambda e, rows: expert_mlp(rows, gate_up[e], down[e], act=self.activation), down_in_norm)
