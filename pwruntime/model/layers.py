"""Small building blocks: RMSNorm, rotary position embedding, the dense gated MLP (shared expert, dense layers)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pwruntime.kernels.layer_ops import act_mul, add_rms_norm


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32 and cast back before the weight (as transformers does); on CUDA one
    kernel, which can also do the residual add before it (`add`)."""
    float_weight = False   # the weight multiplied in float32 before the cast back (FloatRMSNorm)

    def __init__(self, weight: torch.Tensor | None, eps: float):
        super().__init__()
        self.weight = None if weight is None else nn.Parameter(weight, requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.add(x, None)[1]

    def add(self, x: torch.Tensor, delta: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, its norm); delta None: (x, norm of x)."""
        return add_rms_norm(x, delta, self.weight, self.eps, self.float_weight)


class FloatRMSNorm(RMSNorm):
    """Gemma 4's RMSNorm: x / rms(x) * weight all in float32, then cast back (the weight before the cast, unlike
    RMSNorm); without a weight, the normalisation alone. The same kernel on CUDA, in its float-weight mode."""
    float_weight = True


class Rotary(nn.Module):
    """Rotary position embedding (rotate-half convention), inverse frequencies from theta and a linear factor: the
    cos and sin tables of a forward's positions (applied by kernels.layer_ops.rotary_kv). With `fraction` < 1
    (Gemma 4's "proportional" rope) only the first fraction of each head's dimension pairs rotate, at the
    frequencies of the full head; the others get frequency 0 (cos 1, sin 0)."""

    def __init__(self, head_dim: int, theta: float, linear_factor: float = 1.0, device=None, fraction: float = 1.0):
        super().__init__()
        pairs = int(fraction * head_dim // 2)
        inv = 1.0 / (theta ** (torch.arange(0, 2 * pairs, 2, dtype=torch.int64, device=device).float() / head_dim))
        inv = torch.cat([inv, inv.new_zeros(head_dim // 2 - pairs)])
        self.register_buffer("inv_freq", inv / linear_factor, persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape [T, 1, head_dim] for broadcasting over heads."""
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        return emb.cos().to(dtype), emb.sin().to(dtype)


class Linear(nn.Module):
    """y = x W^T (+ b); weights are fixed (inference only)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class DenseMLP(nn.Module):
    """down(act(gate(x)) * up(x)): Qwen2-MoE's shared expert, the dense layers of mlp_only_layers, Gemma 4's MLP
    beside the experts (act GELU there, SiLU elsewhere). gate and up are one GEMM (their weights stacked)."""

    def __init__(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, act: str = "silu"):
        super().__init__()
        self.gate_up, self.down, self.act = Linear(torch.cat([gate, up])), Linear(down), act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.gate_up(x)
        return self.down(act_mul(h, self.act))
