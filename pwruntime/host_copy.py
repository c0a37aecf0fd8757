"""Host-to-device copies that do not wait for the GPU.

A copy from pageable host memory to a CUDA device (`tensor.to("cuda")`, `torch.tensor(..., device="cuda")`)
synchronizes the stream: the host waits for every kernel queued before it, so a step that builds its inputs that way
waits for its own (or, with asynchronous scheduling, the previous step's) forward instead of preparing the next work.
`to_device` copies from pinned memory without blocking; torch's caching host allocator keeps the pinned buffer until
the copy has run.
"""
from __future__ import annotations

import torch


def to_device(t: torch.Tensor, device: str | torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`t` (as `dtype`) on `device`; a host tensor reaches a CUDA device from pinned memory in a non-blocking copy."""
    t = t if dtype is None else t.to(dtype)
    device = torch.device(device)
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)
