"""CopyBatch: host-to-device copies gathered at an iteration boundary and queued with one driver call.

A reload stages its planes as a tensor a plane (so that a later offload frees exactly its surplus), so a
boundary that begins tens of reloads queues hundreds of small copies from the pinned master. One at a time,
each costs the host a dispatcher call and a driver call (3.7 us on the H200 for `copy_`, 12.8 us for
`tensor.to`); `cuMemcpyBatchAsync` (CUDA 12.8 and later) queues them all in one call, about 0.9 us a copy
(`pwruntime bench plans` shows what that saves a transition). The batch as a whole runs in stream order on the
stream that issues it; on the legacy default stream, which the driver call rejects, it runs on a side stream that
waits for the issuing stream first and that the issuing stream then waits for, so the order is the same. Where the
driver lacks that entry point, and off CUDA, the batch is issued one `copy_` at a time.

Sources must stay alive until the copies have run (the page mover's are views of the pinned master, which lives
as long as the store) and be contiguous; destinations are allocated on the stream current at `upload`, by torch's
allocator or the batch's `alloc` (the store's plane arena, pwruntime.plane_arena, whose moves between slots are
device-to-device copies in the same batch: `copy`).
"""
from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

log = logging.getLogger(__name__)

_SRC_ACCESS_ORDER_STREAM = 1  # CU_MEMCPY_SRC_ACCESS_ORDER_STREAM: sources are read in stream order


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _MemcpyAttributes(ctypes.Structure):
    _fields_ = [("src_access_order", ctypes.c_int), ("src_loc_hint", _MemLocation),
                ("dst_loc_hint", _MemLocation), ("flags", ctypes.c_uint)]


@functools.cache
def driver_batch_copy() -> Callable | None:
    """`cuMemcpyBatchAsync` of the CUDA driver in its first (12.8) form, with the `failIdx` argument; None where the
    driver library or the entry point is missing."""
    try:
        fn = ctypes.CDLL("libcuda.so.1").cuMemcpyBatchAsync
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p,
                   ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_void_p]
    return fn


@dataclass
class CopyBatch:
    """Copies to the device queued together by `issue()` on the current stream, then the work given to `after`.
    Reusable: `issue()` empties it. If the driver call ever fails, this batch falls back to `copy_` from then on."""
    device: torch.device
    use_driver: bool = True
    alloc: Callable[[tuple[int, ...], torch.dtype], torch.Tensor] | None = None  # (shape, dtype); None: torch.empty
    _dsts: list[torch.Tensor] = field(default_factory=list)
    _srcs: list[torch.Tensor] = field(default_factory=list)
    _after: list[Callable[[], None]] = field(default_factory=list)
    _side: torch.cuda.Stream | None = None  # where a batch issued on the legacy default stream runs

    def upload(self, src: torch.Tensor) -> torch.Tensor:
        """A new device tensor that holds `src` (contiguous) once the batch has been issued and has run."""
        if self.alloc is None:
            dst = torch.empty(src.shape, dtype=src.dtype, device=self.device)
        else:
            dst = self.alloc(tuple(src.shape), src.dtype)
        self.copy(dst, src)
        return dst

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Queue `dst` <- `src` (contiguous, of the same size; `src` on the host or on the device)."""
        if not (src.is_contiguous() and dst.is_contiguous()) or src.nbytes != dst.nbytes:
            raise ValueError("CopyBatch copies need contiguous tensors of one size")
        if src.numel():
            self._dsts.append(dst)
            self._srcs.append(src)

    def savepoint(self) -> tuple[int, int]:
        """Where the batch stands now (its copies and `after` work so far), for `rollback`."""
        return len(self._dsts), len(self._after)

    def rollback(self, point: tuple[int, int]) -> None:
        """Forget the copies and `after` work added since `point` (none of it has been queued): the destinations
        allocated since are dropped unwritten."""
        n, m = point
        del self._dsts[n:], self._srcs[n:], self._after[m:]

    def after(self, fn: Callable[[], None]) -> None:
        """Run `fn` (device work on the same stream) right after the copies are queued."""
        self._after.append(fn)

    def __len__(self) -> int:
        return len(self._dsts)

    def issue(self) -> None:
        """Queue every copy on the current stream (one driver call where it can), then the `after` work; empties the
        batch."""
        dsts, srcs, after = self._dsts, self._srcs, self._after
        self._dsts, self._srcs, self._after = [], [], []
        if dsts:
            stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
            fn = driver_batch_copy() if self.use_driver and stream is not None else None
            if fn is None or not self._driver_copy(fn, dsts, srcs, stream):
                for d, s in zip(dsts, srcs):  # copies are idempotent: after a failed batch, all of them again
                    d.copy_(s, non_blocking=stream is not None)
        for f in after:
            f()

    def _driver_copy(self, fn: Callable, dsts: list[torch.Tensor], srcs: list[torch.Tensor],
                     stream: torch.cuda.Stream) -> bool:
        """One `cuMemcpyBatchAsync` in `stream`'s order; False (and the driver not used again) if it fails."""
        if stream.cuda_stream:
            return self._driver_call(fn, dsts, srcs, stream.cuda_stream)
        if self._side is None:
            self._side = torch.cuda.Stream(self.device)
        self._side.wait_stream(stream)
        ok = self._driver_call(fn, dsts, srcs, self._side.cuda_stream)
        stream.wait_stream(self._side)
        return ok

    def _driver_call(self, fn: Callable, dsts: list[torch.Tensor], srcs: list[torch.Tensor], stream: int) -> bool:
        n = len(dsts)
        dst = np.fromiter((t.data_ptr() for t in dsts), np.uint64, n)
        src = np.fromiter((t.data_ptr() for t in srcs), np.uint64, n)
        size = np.fromiter((t.nbytes for t in srcs), np.uint64, n)
        attrs = _MemcpyAttributes(_SRC_ACCESS_ORDER_STREAM, _MemLocation(0, 0), _MemLocation(0, 0), 0)
        first = (ctypes.c_size_t * 1)(0)  # the one attributes entry applies from copy 0 on
        failed = ctypes.c_size_t(0)
        status = fn(dst.ctypes.data, src.ctypes.data, size.ctypes.data, n, ctypes.byref(attrs), first, 1,
                    ctypes.byref(failed), stream)
        if status:
            log.warning("cuMemcpyBatchAsync failed (CUDA driver error %d at copy %d of %d); copying one at a time "
                        "from now on", status, failed.value, n)
            self.use_driver = False
        return not status
