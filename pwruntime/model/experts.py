"""The narrow expert interface: the model reads routed-expert weights only through an ExpertStore.

`layer` is the MoE-layer index: the position of the decoder layer in ModelConfig.moe_layers (equal to the
decoder layer index when every layer is MoE, as in all published checkpoints of the four architectures).
It matches the page table's block index i = (layer * experts + expert) * 2 + kind and the order of
ForwardOutput.routing. Expert e computes  down @ (silu(gate @ x) * (up @ x))  with
gate_up = [gate; up] of shape [2I, H] and down of shape [H, I].
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F

from policies.page_table import block_index

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


def expert_mlp(rows: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One expert on its rows [n, H]: (act = silu(gate rows) * (up rows) [n, I], down act [n, H]).

    gate_up [2I, H] (gate rows first), down [H, I]: the expert_fn body every store hands grouped_moe."""
    h = F.linear(rows, gate_up)
    inter = down.shape[-1]
    act = F.silu(h[:, :inter]) * h[:, inter:]
    return act, F.linear(act, down)


def grouped_moe(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_experts: int,
                expert_fn, down_in_norm: torch.Tensor | None = None) -> torch.Tensor:
    """Shared plain-torch MoE dispatch: sort (token, slot) pairs by expert, run one call per active expert.

    expert_fn(e, rows [n, H]) -> (intermediate act [n, I], output [n, H]). Accumulates in float32.
    """
    n_tok, k = topk_ids.shape
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()       # the one host sync per layer
    token_of = order // k
    rows = x[token_of]
    outputs = torch.empty_like(rows)
    norms = torch.empty(rows.shape[0], dtype=torch.float32, device=x.device) if down_in_norm is not None else None
    start = 0
    for e, c in enumerate(counts):
        if c == 0:
            continue
        act, y = expert_fn(e, rows[start:start + c])
        outputs[start:start + c] = y
        if norms is not None:
            norms[start:start + c] = act.float().norm(dim=-1)
        start += c
    weighted = outputs.float() * topk_weights.reshape(-1)[order].float()[:, None]
    out = torch.zeros(n_tok, x.shape[1], dtype=torch.float32, device=x.device).index_add_(0, token_of, weighted)
    if norms is not None:
        down_in_norm.view(-1)[order] = norms
    return out.to(x.dtype)


class DenseExpertStore:
    """Full-precision expert weights: per MoE layer a gate_up [E, 2I, H] and a down [E, H, I] tensor."""

    def __init__(self, gate_up: list[torch.Tensor], down: list[torch.Tensor]):
        if len(gate_up) != len(down):
            raise ValueError("gate_up and down need one tensor per MoE layer each")
        self.gate_up, self.down = gate_up, down

    @property
    def num_layers(self) -> int:
        return len(self.gate_up)

    def weight(self, layer: int, expert: int, kind: str) -> torch.Tensor:
        if kind == "gate_up":
            return self.gate_up[layer][expert]
        if kind == "down":
            return self.down[layer][expert]
        raise ValueError(f"kind must be one of {KINDS}, not {kind!r}")

    def moe(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
            down_in_norm: torch.Tensor | None = None) -> torch.Tensor:
        gate_up, down = self.gate_up[layer], self.down[layer]
        return grouped_moe(x, topk_ids, topk_weights, gate_up.shape[0],
                           lambda e, rows: expert_mlp(rows, gate_up[e], down[e]), down_in_norm)
