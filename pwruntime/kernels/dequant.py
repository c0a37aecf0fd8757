"""Dequantize AP blocks at their committed bits to fp16/bf16 (prefill: dequantize, then torch GEMMs)."""
from __future__ import annotations

from typing import Sequence

import torch

from pwruntime.host_copy import to_device
from pwruntime.kernels import compile as kc
from pwruntime.kernels.device_table import DeviceWeightTable
from pwruntime.kernels.reference import dequantize_resident

THREADS = 128


def variant(dtype: torch.dtype) -> kc.Variant:
    """The cuda/ap_dequant.cu build that dequantizes to `dtype`."""
    return "ap_dequant.cu", (("PW_BF16", int(dtype == torch.bfloat16)),)


def dequantize_blocks(table: DeviceWeightTable, blocks: Sequence[int] | torch.Tensor, out_features: int,
                      in_features: int, dtype: torch.dtype = torch.float16,
                      skip: torch.Tensor | None = None) -> torch.Tensor:
    """W_q [n, out, in] of same-shape blocks, one launch on CUDA; a block at 0 bits gives zeros. Block ids given as
    a tensor on the table's CUDA device are used where they are (nothing copied: capturable in a CUDA graph).
    `skip` (int64 [1] on the device): when it holds a nonzero value the kernel writes nothing (the result's values
    are undefined); off the kernel's path it is ignored."""
    on_device = isinstance(blocks, torch.Tensor) and blocks.is_cuda and table.device.type == "cuda"
    ids = [] if on_device else [int(b) for b in (blocks.tolist() if isinstance(blocks, torch.Tensor) else blocks)]
    n = blocks.numel() if on_device else len(ids)
    if not n:
        return torch.empty(0, out_features, in_features, dtype=dtype, device=table.device)
    if table.device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        ids = ids or blocks.tolist()
        out = []
        for b in ids:
            rb = table.resident(b)
            out.append(torch.zeros(out_features, in_features, dtype=dtype, device=table.device) if rb is None
                       else dequantize_resident(rb, in_features, dtype))
        return torch.stack(out)
    dev = table.device
    dst = torch.empty(n, out_features, in_features, dtype=dtype, device=dev)
    idx = (blocks.to(torch.int64).contiguous() if on_device
           else to_device(torch.tensor(ids, dtype=torch.int64), dev))
    words = -(-in_features // 32)
    name, defines = variant(dtype)
    k = kc.get_kernel(dev, name, "pw_ap_dequant", defines)
    grid = (-(-out_features * words // THREADS), n)
    kc.launch(k, dev, grid, (THREADS,), (kc.ptr(table.table), kc.ptr(idx), kc.i32(out_features),
                                         kc.i32(in_features), kc.ptr(dst), kc.ptr(skip)))
    return dst
