"""Stream-ordered completion marks for page moves: CUDA events on CUDA, already-complete marks on CPU.

`mark(device, stream)` records a point on a stream (the current stream by default); `Mark.done()`
says, without blocking, whether the device has passed it; `wait_for(mark, device)` makes the current
stream wait for it. `DeferredFree` keeps tensors alive until a mark recorded after their last use is
done and then drops them, so the caching allocator never hands out memory that a queued kernel still
reads. Off CUDA every mark is done when it is made and streams are a no-op, so the code that uses
these runs unchanged (and is tested) without a GPU.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Mark:
    """A point on a stream: a CUDA event, or None where work completes in program order."""
    event: "torch.cuda.Event | None"
    host_time: float

    def done(self) -> bool:
        return self.event is None or bool(self.event.query())


def mark(device: torch.device, stream: "torch.cuda.Stream | None" = None, timing: bool = False) -> Mark:
    """Record a mark on `stream` (default: the current stream of `device`)."""
    if device.type != "cuda":
        return Mark(None, time.perf_counter())
    event = torch.cuda.Event(enable_timing=timing)
    event.record(stream if stream is not None else torch.cuda.current_stream(device))
    return Mark(event, time.perf_counter())


def wait_for(m: Mark, device: torch.device) -> None:
    """The current stream of `device` waits for `m` (no host sync)."""
    if m.event is not None and device.type == "cuda":
        torch.cuda.current_stream(device).wait_event(m.event)


def seconds_between(start: Mark, end: Mark) -> float:
    """Device time between two done timing marks (CUDA), else the host time between their recording."""
    if start.event is not None and end.event is not None:
        return start.event.elapsed_time(end.event) / 1e3
    return end.host_time - start.host_time


def side_stream(device: torch.device) -> "torch.cuda.Stream | None":
    """A new stream on a CUDA device (for copies); None elsewhere."""
    return torch.cuda.Stream(device) if device.type == "cuda" else None


@contextlib.contextmanager
def on_stream(stream: "torch.cuda.Stream | None"):
    """Context that makes `stream` current on its device (a no-op for None). It switches with `torch.cuda.set_stream`:
    `torch.cuda.stream` looks the current device up through `torch.cuda.is_available()` on entry and exit, about 20 us
    of host time on the H200, paid by every reload the page mover stages."""
    if stream is None:
        yield
        return
    before = torch.cuda.current_stream(stream.device)
    torch.cuda.set_stream(stream)
    try:
        yield
    finally:
        torch.cuda.set_stream(before)


def tensor_bytes(tensors) -> int:
    return sum(t.nbytes for t in tensors)


@dataclass
class DeferredFree:
    """Tensors kept alive until the device passed a mark recorded after their last use."""
    device: torch.device
    _held: list[tuple[Mark, tuple[torch.Tensor, ...]]] = field(default_factory=list)

    def add(self, tensors, m: Mark | None = None) -> None:
        tensors = tuple(tensors)
        if tensors:
            self._held.append((m if m is not None else mark(self.device), tensors))

    def collect(self) -> int:
        """Drop the tensors whose mark is done; returns the bytes released."""
        keep, freed = [], 0
        for m, ts in self._held:
            if m.done():
                freed += tensor_bytes(ts)
            else:
                keep.append((m, ts))
        self._held = keep
        return freed

    @property
    def nbytes(self) -> int:
        return sum(tensor_bytes(ts) for _, ts in self._held)
