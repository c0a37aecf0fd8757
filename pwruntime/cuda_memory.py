"""The CUDA caching allocator's setting the runtime relies on (expandable segments) and the memory it reports.

A PagedWeight engine resizes its KV cache whenever a plan trades expert planes for KV blocks (pwruntime.kv_cache),
each time to a new size. With torch's default allocator every new size is a new fixed segment: the cached ones no
longer fit, so the process reserves more and more device memory it does not use (60 resizes of a 3.5 GiB cache
reserved 27.6 GiB on the H200) and calls cudaMalloc/cudaFree on the way. Expandable segments (torch's
`expandable_segments:True`) map physical pages into one growing address range instead: the same 60 resizes reserved
4.9 GiB, and a 12 GiB-budget OLMoE replay's allocator held at most 22 GiB instead of all 139 GiB of the GPU
(18.3-18.7 GiB since reloads allocate on the compute stream, pwruntime.page_mover).
The KV cache and the expert planes no longer go through the allocator on CUDA: they map their own memory
(pwruntime.vmm, pwruntime.plane_arena), so the allocator's numbers leave them out. `use_expandable_segments` turns
them on unless the user configured the allocator; `memory_report` (a replay's summary) and `memory_gauges` (/metrics)
say what the device held, the mapped memory included (`MappedMemory`), to set beside `--gpu-memory-budget`.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from pwruntime.vmm import DriverCalls

GIB = 2 ** 30


@dataclass(frozen=True)
class MappedMemory:
    """Device memory the process maps itself beside torch's allocator, in bytes: the KV cache's and the expert planes'
    now and at their peaks, the most that and the allocator's reserved memory came to at once (`held_peak`: sampled by
    the engine whenever the KV cache is resized, where the trade between the two happens), the driver calls each
    one's mapping took, and the most the mapped memory and the allocator's live tensors came to at those samples
    (`in_use_peak`: what the budget's accounting holds, without what the allocator caches)."""
    kv: int = 0
    kv_peak: int = 0
    weights: int = 0
    weights_peak: int = 0
    held_peak: int = 0
    kv_calls: DriverCalls = field(default_factory=DriverCalls)
    weights_calls: DriverCalls = field(default_factory=DriverCalls)
    in_use_peak: int = 0


def held_bytes(device: torch.device | str, mapped_bytes: int) -> int:
    """The allocator's reserved memory plus `mapped_bytes`: what the process holds on a CUDA device now (0 off it)."""
    device = torch.device(device)
    return torch.cuda.memory_reserved(device) + mapped_bytes if device.type == "cuda" else 0


def allocator_reserved(device: torch.device | str) -> int | None:
    """What torch's caching allocator holds on a CUDA device once it has given back its wholly free segments (None off
    CUDA): the memory its live tensors and CUDA graphs' pools keep."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    return torch.cuda.memory_reserved(device)


def in_use_bytes(device: torch.device | str, mapped_bytes: int) -> int:
    """The allocator's live tensors plus `mapped_bytes`: what the process uses on a CUDA device now (0 off it)."""
    device = torch.device(device)
    return torch.cuda.memory_allocated(device) + mapped_bytes if device.type == "cuda" else 0

ALLOC_CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
SETTING = "expandable_segments:True"


def user_alloc_conf() -> str | None:
    """The allocator configuration the user gave in the environment (None: none)."""
    for name in ALLOC_CONF_VARS:
        if os.environ.get(name):
            return f"{name}={os.environ[name]}"
    return None


def use_expandable_segments() -> bool:
    """Make the segments the CUDA allocator creates from now on expandable; False (nothing changed) off CUDA, when
    the user configured the allocator (PYTORCH_CUDA_ALLOC_CONF / PYTORCH_ALLOC_CONF: theirs stands) or when this torch
    has no way to set it at run time."""
    if not torch.cuda.is_available() or user_alloc_conf() is not None:
        return False
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)  # torch >= 2.9
    if setter is None:
        setter = getattr(torch.cuda.memory, "_set_allocator_settings", None)
    if setter is None:
        return False
    setter(SETTING)
    return True


def memory_gauges(device: torch.device | str, mapped: MappedMemory = MappedMemory()) -> dict:
    """The bytes the process's tensors take and the allocator holds now, and the bytes the KV cache and the expert
    planes map themselves, /metrics' gauges, with the driver calls that mapping took so far (counters); empty off
    CUDA."""
    device = torch.device(device)
    if device.type != "cuda":
        return {}
    calls = mapped.kv_calls + mapped.weights_calls
    return {"gpu_memory_allocated_bytes": torch.cuda.memory_allocated(device),
            "gpu_memory_reserved_bytes": torch.cuda.memory_reserved(device),
            "gpu_memory_kv_mapped_bytes": int(mapped.kv), "gpu_memory_weights_mapped_bytes": int(mapped.weights),
            "gpu_vmm_handles_mapped_total": calls.mapped, "gpu_vmm_handles_unmapped_total": calls.unmapped,
            "gpu_vmm_driver_seconds_total": calls.seconds}


def memory_report(device: torch.device | str, mapped: MappedMemory = MappedMemory()) -> dict | None:
    """GiB the allocator's tensors took at most (`peak_allocated_gib`) and the allocator held at most from the device
    (`peak_reserved_gib`; both since the engine's activation profile where one ran, pwruntime.activation_profile), what
    it holds now (`reserved_gib`), in how many segments and how many of them expandable, the KV cache's and the expert
    planes' own mapped memory now and at most, the most all of it held at once (`peak_held_gib`: `mapped.held_peak`, or
    what is held now if more) and used at once (`peak_in_use_gib`: the live tensors instead of the reserved memory,
    `mapped.in_use_peak` or now), the driver calls that mapping took (`driver_calls`: vmm.DriverCalls of each), and
    the user's allocator configuration if any; None off CUDA."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    index = torch.cuda.current_device() if device.index is None else device.index
    segments = [seg for seg in torch.cuda.memory_snapshot() if seg.get("device", index) == index]
    dev, own = torch.device("cuda", index), mapped.kv + mapped.weights
    held, in_use = max(mapped.held_peak, held_bytes(dev, own)), max(mapped.in_use_peak, in_use_bytes(dev, own))
    return {"peak_allocated_gib": round(torch.cuda.max_memory_allocated(index) / GIB, 3),
            "peak_reserved_gib": round(torch.cuda.max_memory_reserved(index) / GIB, 3),
            "reserved_gib": round(torch.cuda.memory_reserved(index) / GIB, 3),
            "kv_mapped_gib": round(mapped.kv / GIB, 3), "kv_peak_mapped_gib": round(mapped.kv_peak / GIB, 3),
            "weights_mapped_gib": round(mapped.weights / GIB, 3),
            "weights_peak_mapped_gib": round(mapped.weights_peak / GIB, 3),
            "peak_held_gib": round(held / GIB, 3), "peak_in_use_gib": round(in_use / GIB, 3),
            "driver_calls": {"kv": mapped.kv_calls.as_dict(), "weights": mapped.weights_calls.as_dict()},
            "segments": len(segments), "expandable_segments": sum(bool(seg.get("is_expandable")) for seg in segments),
            "user_alloc_conf": user_alloc_conf()}
