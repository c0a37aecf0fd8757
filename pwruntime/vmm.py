"""GrowableBuffer: device memory at a fixed address whose size follows demand (the CUDA driver's virtual memory calls).

A buffer reserves an address range once and maps physical memory (`cuMemCreate` + `cuMemMap`) into its front as it
grows; shrinking unmaps the tail. Its address never changes and growing copies nothing, so the KV cache
(pwruntime.kv_cache) can follow every plan's trade of expert planes for KV blocks without copying the cache or
leaving the caching allocator holes of the old size. The physical memory a shrink gives up goes back to the driver,
where torch's allocator can take it for the planes the plan reloads.

Unmapping is not stream-ordered: kernels queued before the shrink may still read the tail. So a shrink only marks
the tail's handles retiring, with an event recorded on the current stream, and they are unmapped once the event has
completed (checked at every resize; never waited for). A grow takes retiring handles back first: still mapped,
nothing to call. The bindings go through ctypes to libcuda, loaded on first use, so importing this module needs no
GPU.
"""
from __future__ import annotations

import ctypes
import functools
import time
from dataclasses import dataclass

import numpy as np
import torch

_PINNED, _LOCATION_DEVICE, _READ_WRITE, _GRANULARITY_RECOMMENDED, _OUT_OF_MEMORY = 1, 1, 3, 1, 2


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocationProp(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", _Location),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", ctypes.c_ubyte * 8)]


class _AccessDesc(ctypes.Structure):
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


class VmmError(RuntimeError):
    """A CUDA driver call of the virtual memory API failed (the message names the call and the driver's error)."""


class VmmOutOfMemory(VmmError, MemoryError):
    """The device had no physical memory for a handle, even after torch's allocator gave back what it cached."""


@functools.cache
def _driver() -> ctypes.CDLL:
    lib = ctypes.CDLL("libcuda.so.1")
    u64, size_t = ctypes.c_uint64, ctypes.c_size_t
    lib.cuMemAddressReserve.argtypes = [ctypes.POINTER(u64), size_t, size_t, u64, u64]
    lib.cuMemAddressFree.argtypes = [u64, size_t]
    lib.cuMemCreate.argtypes = [ctypes.POINTER(u64), size_t, ctypes.POINTER(_AllocationProp), u64]
    lib.cuMemRelease.argtypes = [u64]
    lib.cuMemMap.argtypes = [u64, size_t, size_t, u64, u64]
    lib.cuMemUnmap.argtypes = [u64, size_t]
    lib.cuMemSetAccess.argtypes = [u64, size_t, ctypes.POINTER(_AccessDesc), size_t]
    lib.cuMemGetAllocationGranularity.argtypes = [ctypes.POINTER(size_t), ctypes.POINTER(_AllocationProp),
                                                  ctypes.c_int]
    lib.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    return lib


def _check(name: str, result: int) -> None:
    if result != 0:
        text = ctypes.c_char_p()
        _driver().cuGetErrorString(result, ctypes.byref(text))
        error = VmmOutOfMemory if result == _OUT_OF_MEMORY else VmmError
        raise error(f"{name} failed: CUDA driver error {result} ({(text.value or b'?').decode()})")


def _prop(device_index: int) -> _AllocationProp:
    return _AllocationProp(type=_PINNED, location=_Location(_LOCATION_DEVICE, device_index))


def granularity(device_index: int) -> int:
    """The driver's recommended size step for physical memory on this device (2 MiB on the H200)."""
    out = ctypes.c_size_t()
    _check("cuMemGetAllocationGranularity",
           _driver().cuMemGetAllocationGranularity(ctypes.byref(out), ctypes.byref(_prop(device_index)),
                                                   _GRANULARITY_RECOMMENDED))
    return out.value


def round_up(nbytes: int, step: int) -> int:
    return -(-nbytes // step) * step


def handle_sizes(start: int, end: int, step: int, max_handle: int) -> list[int]:
    """Sizes of the physical handles that map [start, end) (start a multiple of `step`): multiples of `step` of at
    most `max_handle` each, so a later shrink can give back all but one handle's worth above what it keeps."""
    total = round_up(max(end - start, 0), step)
    cap = max(step, max_handle // step * step)
    return [min(cap, total - done) for done in range(0, total, cap)]


@dataclass
class DriverCalls:
    """What a buffer asked of the driver's virtual memory so far: handles mapped (`cuMemCreate` + `cuMemMap` each) and
    access grants (`cuMemSetAccess`, one a growth), with the host seconds the growths took, and handles unmapped
    (`cuMemUnmap` + `cuMemRelease` each), with theirs."""
    mapped: int = 0
    grants: int = 0
    map_seconds: float = 0.0
    unmapped: int = 0
    unmap_seconds: float = 0.0

    @property
    def seconds(self) -> float:
        """Host seconds of the growths and the unmaps together."""
        return self.map_seconds + self.unmap_seconds

    def __add__(self, other: "DriverCalls") -> "DriverCalls":
        return DriverCalls(self.mapped + other.mapped, self.grants + other.grants,
                           self.map_seconds + other.map_seconds, self.unmapped + other.unmapped,
                           self.unmap_seconds + other.unmap_seconds)

    def as_dict(self) -> dict:
        return {"handles_mapped": self.mapped, "access_grants": self.grants, "map_ms": round(self.map_seconds * 1e3, 3),
                "handles_unmapped": self.unmapped, "unmap_ms": round(self.unmap_seconds * 1e3, 3)}


@dataclass
class _Handle:
    offset: int
    size: int
    handle: int
    retiring: torch.cuda.Event | None = None   # set while the handle waits to be unmapped

    @property
    def end(self) -> int:
        return self.offset + self.size


class GrowableBuffer:
    """`capacity` bytes of address space on a CUDA device, of which the first `mapped` are backed by memory.

    `_handles` are the physical handles in address order, each mapped at its offset; the first `_active` back the
    buffer, the rest are retiring (a shrink let them go; they are unmapped once the device is done with them)."""

    def __init__(self, capacity: int, device: torch.device | str, max_handle: int = 8 << 20):
        torch.cuda.init()   # the driver calls below run in torch's context
        self.device = torch.device(device)
        self.index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        self._prop = _prop(self.index)
        self._access = _AccessDesc(_Location(_LOCATION_DEVICE, self.index), _READ_WRITE)
        self.step = granularity(self.index)
        self.capacity = round_up(max(capacity, 1), self.step)
        self.max_handle = max_handle
        base = ctypes.c_uint64()
        _check("cuMemAddressReserve", _driver().cuMemAddressReserve(ctypes.byref(base), self.capacity, 0, 0, 0))
        self.ptr: int | None = base.value
        self._handles: list[_Handle] = []
        self._active = 0
        self.peak_mapped = 0
        self.calls = DriverCalls()
        self._grow(self.step, max_handle)   # the first step stays mapped: torch wraps only addresses on the device

    @property
    def mapped(self) -> int:
        """Bytes backed by physical memory now, retiring handles included (the handles lie end to end from 0)."""
        return self._handles[-1].end if self._handles else 0

    @property
    def size(self) -> int:
        """Bytes usable from `ptr` now: the end of the handles that back the buffer (retiring ones not counted)."""
        return self._handles[self._active - 1].end if self._active else 0

    def resize(self, nbytes: int, max_handle: int | None = None) -> None:
        """Make [ptr, ptr + nbytes) usable: map memory behind it (in handles of `max_handle` bytes at most, the
        buffer's own unless told), or retire the handles wholly above it."""
        if nbytes > self.capacity:
            raise ValueError(f"{nbytes} bytes exceed the buffer's reserved {self.capacity}")
        self.release_retired()
        if nbytes > self.size:
            self._grow(nbytes, self.max_handle if max_handle is None else max_handle)
            return
        keep = max(round_up(nbytes, self.step), self.step)
        first_above = self._active   # searched from the top: a shrink gives back few of many handles
        while first_above > 0 and self._handles[first_above - 1].offset >= keep:
            first_above -= 1
        if first_above < self._active:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
            for h in self._handles[first_above:self._active]:
                h.retiring = event
            self._active = first_above

    def _grow(self, nbytes: int, max_handle: int) -> None:
        while self._active < len(self._handles) and self.size < nbytes:
            self._handles[self._active].retiring = None   # still mapped: taken back without a driver call
            self._active += 1
        start = self.size
        if start >= nbytes:
            return
        lib, offset, t0 = _driver(), start, time.perf_counter()
        try:
            for size in handle_sizes(start, nbytes, self.step, max_handle):
                self._map(offset, size)
                offset += size
        finally:   # one access grant for all that got mapped: the driver charges about 25 us a call, whatever its size
            if offset > start:
                self.calls.grants += 1
                _check("cuMemSetAccess",
                       lib.cuMemSetAccess(self.ptr + start, offset - start, ctypes.byref(self._access), 1))
            self.peak_mapped = max(self.peak_mapped, self.mapped)
            self.calls.map_seconds += time.perf_counter() - t0

    def _map(self, offset: int, size: int) -> None:
        lib, handle = _driver(), ctypes.c_uint64()
        result = lib.cuMemCreate(ctypes.byref(handle), size, ctypes.byref(self._prop), 0)
        if result == _OUT_OF_MEMORY:   # torch's allocator may cache what we need: free it and retry, as torch does
            torch.cuda.empty_cache()
            result = lib.cuMemCreate(ctypes.byref(handle), size, ctypes.byref(self._prop), 0)
        _check("cuMemCreate", result)
        result = lib.cuMemMap(self.ptr + offset, size, 0, handle.value, 0)
        if result != 0:
            lib.cuMemRelease(handle.value)
            _check("cuMemMap", result)
        self._handles.insert(self._active, _Handle(offset, size, handle.value))
        self._active += 1
        self.calls.mapped += 1

    def release_retired(self) -> int:
        """Unmap the retiring handles whose event has completed, from the top down; returns the bytes given back to
        the driver."""
        lib, freed = _driver(), 0
        while len(self._handles) > self._active and self._handles[-1].retiring.query():
            h, t0 = self._handles[-1], time.perf_counter()
            _check("cuMemUnmap", lib.cuMemUnmap(self.ptr + h.offset, h.size))
            _check("cuMemRelease", lib.cuMemRelease(h.handle))
            self._handles.pop()
            freed += h.size
            self.calls.unmapped += 1
            self.calls.unmap_seconds += time.perf_counter() - t0
        return freed

    def close(self) -> None:
        """Wait for the device, unmap everything and give the address range back (the buffer is unusable after)."""
        if self.ptr is None:
            return
        torch.cuda.synchronize(self.device)
        for h in self._handles:
            h.retiring = torch.cuda.Event()   # never recorded: complete, as is all the device's work now
        self._active = 0
        self.release_retired()
        _driver().cuMemAddressFree(self.ptr, self.capacity)
        self.ptr = None

    def __del__(self):
        try:
            if not torch.cuda.is_current_stream_capturing():   # (close waits for the device, which a capture forbids:
                self.close()                                    # then the range stays, until the process ends)
        except Exception:   # interpreter shutdown: the driver reclaims everything with the context
            pass

    def rows(self, row_shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A tensor [rows, *row_shape] over the whole reserved range. Only the rows inside the mapped front may be
        touched: slice it to the size asked for. It does not own the memory, so it must not outlive the buffer."""
        shape = (self.capacity // (torch.Size(row_shape).numel() * dtype.itemsize), *row_shape)
        return wrap(self.ptr, shape, dtype, self.device, self)


def wrap(ptr: int, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, owner: object) -> torch.Tensor:
    """A tensor of `shape` and `dtype` over memory at `ptr` that torch does not own, on `device` (CUDA, or the CPU for
    host memory). Its storage holds `owner` until the last tensor over it dies (the buffer behind the memory, or a
    slot of it: pwruntime.plane_arena), and lets it go then."""
    typestr = _TYPESTR.get(dtype) or f"<i{dtype.itemsize}"   # bf16 has no type code: an integer of its width
    face = {"shape": tuple(shape), "typestr": typestr, "data": (ptr, False), "version": 3, "strides": None}
    holder = _ArrayInterface(owner)
    if torch.device(device).type == "cuda":
        holder.__cuda_array_interface__ = face
        t = torch.as_tensor(holder, device=device)
    else:
        holder.__array_interface__ = face
        t = torch.from_numpy(np.asarray(holder))
    return t if t.dtype == dtype else t.view(dtype)


# the array-interface type codes of the dtypes that have one (a view costs the plane arena's every tensor a microsecond)
_TYPESTR = {torch.int32: "<i4", torch.int16: "<i2", torch.int64: "<i8", torch.uint8: "|u1", torch.int8: "|i1",
            torch.float16: "<f2", torch.float32: "<f4", torch.float64: "<f8"}


class _ArrayInterface:
    """What torch.as_tensor (numpy on the CPU) needs to wrap memory it does not own; `owner` lives as long as the
    holder, which the tensor's storage keeps."""

    def __init__(self, owner: object):
        self.owner = owner
