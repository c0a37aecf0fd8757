"""Run-time compilation of cuda/*.cu through CuPy (RawModule) and launching on torch's current stream.

Modules are cached per (device, compute capability, source file, defines); CuPy adds the
device's `-arch=sm_XY` to the options and keeps compiled binaries in its on-disk cache, so a
second process loads them instead of compiling. Local `#include "x.cuh"` lines are inlined before
compiling, so that cache key covers the headers too. Arguments are passed zero-copy: tensors as
raw device pointers (`data_ptr()`), scalars as fixed-width numpy scalars matching the C types.
CuPy is imported only here and only when a CUDA kernel is actually requested.

`compile_variants` compiles (or loads from that cache) many variants at once in threads: NVRTC releases the GIL
while it compiles, so a fresh machine compiles them side by side. An engine compiles the variants its model can use
before it serves (`ModelRunner.compile_kernels`): a first use inside a step took that step 7 s an ap_moe.cu variant
on the H200. `python -m pwruntime.kernels.compile` compiles every variant the runtime and the benchmark use.
"""
from __future__ import annotations

import argparse
import ctypes
import functools
import os
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
import torch

from policies.prefill_path import TILE_ROWS

CUDA_DIR = Path(__file__).resolve().parents[2] / "cuda"
BASE_OPTIONS = ("-std=c++17",)
Variant = tuple[str, tuple[tuple[str, int], ...]]  # (source file, defines), as get_kernel asks for them
_INCLUDE = re.compile(r'^#include "([^"]+)"[ \t]*$', re.M)


class KernelUnavailable(RuntimeError):
    """The CUDA path cannot run here (no CUDA device, or CuPy is not installed)."""


def source(name: str) -> str:
    """Text of cuda/<name> with its local quoted includes inlined (each header once)."""
    seen: set[str] = set()

    def expand(fname: str) -> str:
        if fname in seen:
            return ""
        seen.add(fname)
        text = (CUDA_DIR / fname).read_text()
        return _INCLUDE.sub(lambda m: expand(m.group(1)), text)

    return expand(name)


def options(defines: Sequence[tuple[str, int]]) -> tuple[str, ...]:
    return BASE_OPTIONS + tuple(f"-D{k}={int(v)}" for k, v in defines)


def _cupy():
    try:
        import cupy
    except ImportError as e:  # pragma: no cover - depends on the machine
        raise KernelUnavailable("the CUDA kernels need CuPy (pip install cupy-cuda13x, or the 'cuda' extra)") from e
    return cupy


@functools.lru_cache(maxsize=None)
def _module(device_index: int, capability: tuple[int, int], name: str, defines: tuple[tuple[str, int], ...]):
    cupy = _cupy()
    with cupy.cuda.Device(device_index):
        mod = cupy.RawModule(code=source(name), options=options(defines))
        mod.compile()
    return mod


@functools.lru_cache(maxsize=None)
def _function(device_index: int, capability: tuple[int, int], name: str, defines: tuple[tuple[str, int], ...],
              func: str):
    return _module(device_index, capability, name, defines).get_function(func)


def get_kernel(device: torch.device, name: str, func: str, defines: Sequence[tuple[str, int]], dyn_smem: int = 0):
    """The compiled `func` of cuda/<name> for `device`, allowed at least `dyn_smem` bytes of dynamic shared memory."""
    if device.type != "cuda":
        raise KernelUnavailable(f"CUDA kernels need a CUDA tensor, got device {device}")
    index = device.index if device.index is not None else torch.cuda.current_device()
    fn = _function(index, _capability(index), name, tuple(defines), func)
    return _with_smem(fn, index, int(dyn_smem))


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return tuple(torch.cuda.get_device_capability(index))


@functools.lru_cache(maxsize=4096)
def _with_smem(fn, index: int, dyn_smem: int):
    """`fn`, allowed at least `dyn_smem` bytes of dynamic shared memory (asked of the driver once a size)."""
    if fn.max_dynamic_shared_size_bytes < dyn_smem:
        # the default limit is 48 KiB minus the static shared memory; one CUfunction serves every launch
        # plan, so the limit only ever grows (and a size granted once stays granted)
        with _cupy().cuda.Device(index):
            fn.max_dynamic_shared_size_bytes = dyn_smem
    return fn


class _StreamHandle:
    """A raw cudaStream_t (torch's current stream) offered through the CUDA stream protocol."""

    def __init__(self, handle: int) -> None:
        self.handle = handle

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.handle)


@functools.lru_cache(maxsize=64)
def _external_stream(device_index: int, handle: int):
    """CuPy's view of torch's stream: `Stream.from_external` where CuPy has it (>= 14), else ExternalStream."""
    cuda = _cupy().cuda
    if hasattr(cuda.Stream, "from_external"):
        return cuda.Stream.from_external(_StreamHandle(handle))
    return cuda.ExternalStream(handle, device_index)


def launch(kernel, device: torch.device, grid: tuple[int, ...], block: tuple[int, ...], args: Sequence,
           shared_mem: int = 0, overlap_previous: bool = False, carveout: int | None = None) -> None:
    """Launch on torch's current stream of `device` (so graph capture and stream order just work).

    `overlap_previous` launches with programmatic stream serialization (PDL): the kernel may start
    while the previous kernel on the stream runs, and must execute `griddepcontrol.wait` before it
    reads anything that kernel writes (the previous kernel lets it start with
    `griddepcontrol.launch_dependents`). Graph capture records this as a programmatic edge.
    `carveout`: the launch's preferred shared-memory carveout, percent of an SM's (the driver rounds it up to a
    configuration it supports).
    """
    index = device.index if device.index is not None else torch.cuda.current_device()
    handle = torch.cuda.current_stream(index).cuda_stream
    cupy = _cupy()
    if overlap_previous or carveout is not None:
        with cupy.cuda.Device(index):   # the device's context current for the driver call (the stream is explicit)
            _launch_ex(_function_ptr(kernel, index), grid, block, args, int(shared_mem), handle, overlap_previous,
                       carveout)
        return
    with cupy.cuda.Device(index), _external_stream(index, handle):
        kernel(grid, block, tuple(args), shared_mem=int(shared_mem))


@functools.lru_cache(maxsize=4096)
def _function_ptr(kernel, index: int) -> int:
    """The CUfunction of a compiled kernel on device `index` (RawKernel -> its loaded cupy.cuda.Function)."""
    with _cupy().cuda.Device(index):
        return int(kernel.kernel.ptr)


# cuLaunchKernelEx (CUDA driver API): CuPy launches without attributes, so these launches go through ctypes
_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CUlaunchAttributeID
_PREFERRED_SHARED_MEMORY_CARVEOUT = 14  # CUlaunchAttributeID (CUDA 12.4+)


class LaunchAttribute(ctypes.Structure):
    """CUlaunchAttribute: an id, padding, then a 64-byte value union (72 bytes)."""
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_ubyte * 4), ("value", ctypes.c_ubyte * 64)]


class LaunchConfig(ctypes.Structure):
    """CUlaunchConfig (56 bytes on 64-bit Linux)."""
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared_mem", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(LaunchAttribute)), ("num_attrs", ctypes.c_uint)]


_CTYPE_OF = {np.int32: ctypes.c_int32, np.int64: ctypes.c_int64, np.uint64: ctypes.c_uint64, np.float32: ctypes.c_float}
_PDL_ATTRIBUTE = LaunchAttribute(id=_PROGRAMMATIC_STREAM_SERIALIZATION)
_PDL_ATTRIBUTE.value[0] = 1  # programmaticStreamSerializationAllowed (an int, little-endian)


@functools.lru_cache(maxsize=1)
def _driver():
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuLaunchKernelEx.restype = ctypes.c_int
    lib.cuLaunchKernelEx.argtypes = [ctypes.POINTER(LaunchConfig), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    return lib


def ctas_per_sm(kernel, threads: int, shared_mem: int) -> int:
    """CTAs of `threads` threads and `shared_mem` dynamic bytes that fit on one SM at once (the driver's
    occupancy calculator: registers, shared memory and the CTA limit)."""
    return _ctas_per_sm(kernel.kernel.ptr, int(threads), int(shared_mem))


@functools.lru_cache(maxsize=256)
def _ctas_per_sm(function: int, threads: int, shared_mem: int) -> int:
    n = ctypes.c_int(0)
    err = _driver().cuOccupancyMaxActiveBlocksPerMultiprocessor(ctypes.byref(n), ctypes.c_void_p(function),
                                                                ctypes.c_int(threads), ctypes.c_size_t(shared_mem))
    if err != 0:
        raise RuntimeError(f"cuOccupancyMaxActiveBlocksPerMultiprocessor failed with CUresult {err}")
    return int(n.value)


def _pad3(dims: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(int(d) for d in dims) + (1,) * (3 - len(dims))


def kernel_params(args: Sequence) -> tuple[list, ctypes.Array]:
    """The driver's `void** kernelParams` for numpy-scalar `args`, and the C values it points at (keep them alive)."""
    values = [_CTYPE_OF[type(a)](a) for a in args]
    return values, (ctypes.c_void_p * len(values))(*map(ctypes.addressof, values))


@functools.lru_cache(maxsize=64)
def _launch_attributes(overlap_previous: bool, carveout: int | None) -> ctypes.Array:
    """A launch's attributes (shared between launches: the driver only reads them during the call)."""
    attrs = [_PDL_ATTRIBUTE] if overlap_previous else []
    if carveout is not None:
        a = LaunchAttribute(id=_PREFERRED_SHARED_MEMORY_CARVEOUT)
        a.value[:4] = int(carveout).to_bytes(4, "little")  # sharedMemCarveout (an unsigned int)
        attrs.append(a)
    return (LaunchAttribute * len(attrs))(*attrs)


def _launch_ex(function: int, grid, block, args, shared_mem: int, stream: int, overlap_previous: bool,
               carveout: int | None) -> None:
    values, params = kernel_params(args)  # `values` stays alive until the driver has copied it (the call below)
    attrs = _launch_attributes(overlap_previous, carveout)
    cfg = LaunchConfig(_pad3(grid), _pad3(block), shared_mem, stream,
                       ctypes.cast(attrs, ctypes.POINTER(LaunchAttribute)), len(attrs))
    err = _driver().cuLaunchKernelEx(ctypes.byref(cfg), ctypes.c_void_p(function), params, None)
    if err != 0:
        raise RuntimeError(f"cuLaunchKernelEx failed with CUresult {err}")


# argument helpers: the C type each kernel parameter has
def ptr(t: torch.Tensor | None) -> np.uint64:
    return np.uint64(0 if t is None else t.data_ptr())


def i32(v: int) -> np.int32:
    return np.int32(v)


def i64(v: int) -> np.int64:
    return np.int64(v)


def f32(v: float) -> np.float32:
    return np.float32(v)


# ------------------------------------------------------------------ warm-up
def variants() -> list[Variant]:
    """Every (source, defines) the runtime and `pwruntime bench kernels` compile."""
    out = []
    for bf in (0, 1):
        for nt in (1, 2, 4, 8):
            out.append(("ap_moe.cu", (("PW_BF16", bf), ("PW_NT", nt))))
        # CTAs of 8 warps (MoE launches of 2-16 tokens, long K; the single block at one token) and 16 (the single
        # block at 2-16 tokens)
        for nt in (1, 2):
            for warps in (8, 16):
                out.append(("ap_moe.cu", (("PW_BF16", bf), ("PW_NT", nt), ("PW_WARPS", warps))))
        out.append(("ap_moe.cu", (("PW_BF16", bf), ("PW_NT", 4), ("PW_OVERFLOW", 1))))  # MoE launches above 32 tokens
        out.append(("ap_dequant.cu", (("PW_BF16", bf),)))
        for rows in TILE_ROWS:
            out.append(("ap_gemm.cu", (("PW_BF16", bf), ("PW_BM", rows))))
        out.append(("layer_ops.cu", (("PW_BF16", bf),)))
    for dt in (0, 1, 2):
        out.append(("paged_attention.cu", (("PW_DT", dt), ("PW_DPL", 4))))
    for dt in (0, 1):   # heads a CTA serves: the four architectures' (head_dim 128) and the demo model's (64)
        for dim, per_cta in ((128, 1), (128, 4), (64, 2)):
            out.append(("paged_attention_gqa.cu", (("PW_DT", dt), ("PW_D", dim), ("PW_G", per_cta))))
    out.append(("kv_write.cu", ()))
    return out


def compile_variants(device: torch.device | int, wanted: Iterable[Variant], jobs: int = 8) -> float:
    """Compile every (source, defines) in `wanted` for `device`, or load it from CuPy's disk cache, `jobs` at a time in
    threads (NVRTC releases the GIL); returns the seconds it took. Later `get_kernel` calls find them compiled."""
    index = device if isinstance(device, int) else (device.index if device.index is not None
                                                     else torch.cuda.current_device())
    cap = _capability(index)
    todo = sorted(set(wanted))
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=max(1, min(jobs, len(todo), os.cpu_count() or 1))) as pool:
        list(pool.map(lambda v: _module(index, cap, v[0], tuple(v[1])), todo))
    return time.perf_counter() - start


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Compile PagedWeight's CUDA kernels into CuPy's cache.")
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--jobs", type=int, default=8)
    args = ap.parse_args(argv)
    devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not 0 <= args.device < devices:
        print(f"error: --device {args.device}: this machine has {devices} CUDA device(s); the kernels compile for a "
              "CUDA GPU (run this on one)", file=sys.stderr)
        return 2
    try:
        seconds = compile_variants(args.device, variants(), args.jobs)
    except KernelUnavailable as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"compiled {len(variants())} variants in {seconds:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
