"""GrowableBuffer's interface over host memory, so the code built on mapped memory (the KV cache, the plane arena)
runs in CI."""
from __future__ import annotations

import torch

from pwruntime import vmm


class HostBuffer:
    """A GrowableBuffer over a host tensor: `size` follows `resize` exactly and a shrink's memory is unmapped at once;
    with `growths_left` set, the growth after that many raises as the driver's out-of-memory does. `calls` counts a
    growth's grant and the handles it maps (of `max_handle` bytes at most, a `step` unless told), and the `step`s a
    shrink unmaps; `largest_handle` is the largest it mapped."""
    growths_left: int | None = None
    step = 4096

    def __init__(self, capacity: int, device, max_handle: int | None = None):
        self.capacity, self.size, self.mapped, self.peak_mapped = capacity, 0, 0, 0
        self._memory = torch.full((capacity,), 7, dtype=torch.uint8)   # what unmapped memory would hold: not zeros
        self.ptr = self._memory.data_ptr()
        self.closed = False
        self.calls = vmm.DriverCalls()
        self.max_handle = max_handle or self.step
        self.largest_handle = 0

    def resize(self, nbytes: int, max_handle: int | None = None) -> None:
        if nbytes > self.capacity:
            raise ValueError(f"{nbytes} bytes exceed the buffer's reserved {self.capacity}")
        if nbytes > self.size and HostBuffer.growths_left is not None:
            if HostBuffer.growths_left == 0:
                raise vmm.VmmOutOfMemory("cuMemCreate failed: CUDA driver error 2 (out of memory)")
            HostBuffer.growths_left -= 1
        if nbytes > self.size:
            self.calls.grants += 1
            sizes = vmm.handle_sizes(self.size, nbytes, self.step, max_handle or self.max_handle)
            self.calls.mapped += len(sizes)
            self.largest_handle = max(self.largest_handle, *sizes)
        else:
            self.calls.unmapped += (self.size - nbytes) // self.step
        self.size = self.mapped = nbytes
        self.peak_mapped = max(self.peak_mapped, nbytes)

    def release_retired(self) -> int:
        return 0

    def close(self) -> None:
        self.closed = True

    def rows(self, row_shape, dtype):
        elem = torch.empty((), dtype=dtype).element_size()
        n = self.capacity // (torch.Size(row_shape).numel() * elem)
        return self._memory[:n * torch.Size(row_shape).numel() * elem].view(dtype).view(n, *row_shape)
