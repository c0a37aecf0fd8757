"""PlaneArena: the device memory of an expert store's planes and LUTs, kept dense so that what offloads free goes back
to the driver.

Through torch's caching allocator the planes an offload frees stayed in its cache: OLMoE's planes are 256 and 512
KiB, several to a 2 MiB page and freed in no order, so the pages were never wholly free, and the KV cache, which maps
its own memory (pwruntime.vmm), grew into new memory instead (a 12 GiB replay's small pool held 8.4 GiB, the
weights at their starting size, while the cache grew by 2.6 GiB beside it).

Here the tensors of one byte size (a class: a model has a plane size or two and a LUT size a bitwidth) live in the
slots of one GrowableBuffer, slot k at k times the slot size. A tensor's storage owns its slot and frees it when the
last tensor over it dies, as torch's allocator frees a block, and the same stream order makes reuse safe: whoever
writes a freed slot is ordered after the kernels that read it (the store and the page mover keep that order for
torch's memory too). `empty` takes a class's lowest free slot, else the one past its top. `pack` keeps every class
dense: once a class's holes below its top exceed its slack (a 64th of what it holds: the holes a plan's reloads
will take again anyway), and while its top slot's tensor may move (the caller's `movable`: the store's rows name
it, so no copy is writing it), the tensor is copied into the lowest hole (queued in the caller's CopyBatch, on the
current stream) and `relocate` points its owner at the new tensor. `trim`, once the new rows are on their way to
the device, lets a buffer's free tail beyond its slack go; GrowableBuffer unmaps it when the device has passed that
point, so the bytes offloads free become memory the KV cache can map.
"""
from __future__ import annotations

import heapq
import itertools
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from pwruntime.copy_batch import CopyBatch
from pwruntime.vmm import DriverCalls, GrowableBuffer, wrap

SLOT_ALIGN = 256  # bytes: every slot starts on a 256-byte boundary (the kernels' 16-byte loads need 16)
SLACK_SHARE = 64  # a class keeps up to 1/64 of its bytes free (_Class.slack)
MAX_HANDLE_BYTES = 32 << 20  # the largest physical handle a growth maps (_Class.handle_bytes)


class ArenaFull(MemoryError):
    """A class used every slot its address range has (the store sizes them for twice what its blocks can name)."""


@dataclass
class _Class:
    """The slots of one byte size: `tokens[k]` names the allocation in slot k (0: free), `tensors[k]` is a weak
    reference to the tensor handed out there; `holes` is a heap of free slots (stale entries are skipped)."""
    size: int
    capacity: int  # slots
    buffer: GrowableBuffer
    tokens: list[int] = field(default_factory=list)
    tensors: list = field(default_factory=list)
    holes: list[int] = field(default_factory=list)
    live: int = 0  # slots in use

    @property
    def slack(self) -> int:
        """The free bytes the class may keep, in holes or past its top: a 64th of what it holds, at least one step of
        the driver's granularity. Under a plan's mixed offloads and reloads most of what one frees the next takes
        again, without a move or a driver call."""
        return max(self.buffer.step, self.live * self.size // SLACK_SHARE)

    @property
    def handle_bytes(self) -> int:
        """The physical handles a growth maps: half the slack, at least the driver's step, at most 32 MiB. The driver
        charges by the handle (about 100 us to map, grant and unmap one, whatever its size), and a growth maps the
        slack ahead, so a class of a large model grows in two or three handles, not one a 2 MiB step; a trim, which
        gives back only whole handles, then keeps less than half the slack past what it keeps on purpose."""
        return min(MAX_HANDLE_BYTES, max(self.buffer.step, self.slack // 2))

    @property
    def top(self) -> int:
        """Slots up to and including the last one in use."""
        return len(self.tokens)

    def free(self, k: int, token: int) -> None:
        """Slot k is free, if allocation `token` still holds it (a slot `pack` emptied may be free already)."""
        if k < len(self.tokens) and self.tokens[k] == token:
            self.tokens[k], self.tensors[k] = 0, None
            self.live -= 1
            heapq.heappush(self.holes, k)
            while self.tokens and not self.tokens[-1]:
                self.tokens.pop()
                self.tensors.pop()

    def pop_hole(self) -> int | None:
        """The lowest free slot below the top, taken off the heap (None: none). A slot may free at any allocation
        (the garbage collector can drop a tensor then), so a caller claims what this returns before allocating."""
        holes = self.holes
        while holes:
            k = heapq.heappop(holes)
            if k < len(self.tokens) and not self.tokens[k]:
                return k
        return None   # every entry was stale: above the top now, or taken again since

    def claim(self, k: int, token: int) -> None:
        """Slot k (a hole, or the one past the top) belongs to allocation `token` from now on."""
        if k == len(self.tokens):
            self.tokens.append(token)
            self.tensors.append(None)
        else:
            self.tokens[k] = token
        self.live += 1


class _Slot:
    """Owned by the storage of the tensor over one slot: frees the slot when that storage dies."""

    def __init__(self, cls: _Class, k: int, token: int):
        self.cls, self.k, self.token = cls, k, token

    def __del__(self):
        self.cls.free(self.k, self.token)


class PlaneArena:
    """Device tensors of a few fixed byte sizes, each size dense in a buffer of its own (module docstring).

    `sizes` maps a tensor size in bytes to the most tensors of that size alive at once (its address range; nothing is
    mapped until used)."""

    def __init__(self, device: torch.device | str, sizes: dict[int, int]):
        self.device = torch.device(device)
        self._tokens = itertools.count(1)
        self._classes: dict[int, _Class] = {}
        for nbytes, count in sorted(sizes.items()):
            size = -(-int(nbytes) // SLOT_ALIGN) * SLOT_ALIGN
            buffer = GrowableBuffer(size * int(count), self.device)
            self._classes[int(nbytes)] = _Class(size, buffer.capacity // size, buffer)
        self.moves = 0  # tensors `pack` has moved so far

    # ------------------------------------------------------------ allocation
    def empty(self, shape: Iterable[int], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialized tensor in the lowest free slot of its size's class (ValueError for a size the arena has no
        class for, ArenaFull when the class's range is used up, VmmOutOfMemory when the device is)."""
        shape = tuple(int(d) for d in shape)
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        cls = self._classes.get(nbytes)
        if cls is None:
            raise ValueError(f"the plane arena has no class for tensors of {nbytes} bytes (it has {sorted(self._classes)})")
        k = cls.pop_hole()
        if k is None:
            k = cls.top
            if k >= cls.capacity:
                raise ArenaFull(f"the plane arena's {nbytes}-byte class is full ({cls.capacity} tensors)")
            end = (k + 1) * cls.size
            if end > cls.buffer.size:   # its slack ahead, so that growth does not call the driver every few slots
                cls.buffer.resize(min(end + cls.slack, cls.capacity * cls.size), max_handle=cls.handle_bytes)
        return self._take(cls, k, shape, dtype)

    def _take(self, cls: _Class, k: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A tensor over slot k, claimed before anything is allocated (see `_Class.pop_hole`)."""
        token = next(self._tokens)
        cls.claim(k, token)
        t = wrap(cls.buffer.ptr + k * cls.size, shape, dtype, self.device, _Slot(cls, k, token))
        cls.tensors[k] = weakref.ref(t)
        return t

    # ------------------------------------------------------------ keeping it dense
    def pack(self, movable: Callable[[torch.Tensor], bool], relocate: Callable[[torch.Tensor, torch.Tensor], None],
             batch: CopyBatch) -> int:
        """In each class whose holes exceed its slack, move top tensors into the holes below them until none is left
        under a tensor `movable` allows; returns the moves. The copies are queued in `batch` (the caller issues it before the rows that name the new
        tensors reach the device); a moved-from slot counts as free at once, and nothing may be allocated before
        the batch is issued."""
        moves = 0
        for cls in self._classes.values():
            if (cls.top - cls.live) * cls.size <= cls.slack:
                continue   # holes within the slack: the next allocations take them
            while True:
                hole = cls.pop_hole()
                if hole is None:
                    break
                top, token = cls.top - 1, cls.tokens[-1]
                src = cls.tensors[top]()
                if src is None or not movable(src):   # a copy in flight writes it, or a view outlived the tensor
                    heapq.heappush(cls.holes, hole)
                    break
                dst = self._take(cls, hole, tuple(src.shape), src.dtype)
                batch.copy(dst, src)
                cls.free(top, token)   # its tensor lives on in `batch` until the copy is queued
                relocate(src, dst)
                moves += 1
        self.moves += moves
        return moves

    def trim(self) -> int:
        """Let a buffer's free tail go, all but its slack, once it is over twice that (unmapped once the current
        stream has passed this point), and unmap what earlier trims let go that the device is done with; returns the
        bytes unmapped."""
        freed = 0
        for cls in self._classes.values():
            used, slack = cls.top * cls.size, cls.slack
            if cls.buffer.size - used > 2 * slack:
                cls.buffer.resize(used + slack)
            freed += cls.buffer.release_retired()
        return freed

    # ------------------------------------------------------------ views
    @property
    def mapped(self) -> int:
        """Device bytes mapped now (spare and retiring handles included)."""
        return sum(cls.buffer.mapped for cls in self._classes.values())

    @property
    def peak_mapped(self) -> int:
        """The most bytes each class has mapped, summed: no less than the most the arena held at once."""
        return sum(cls.buffer.peak_mapped for cls in self._classes.values())

    @property
    def driver_calls(self) -> DriverCalls:
        """The driver's virtual-memory calls the classes' buffers made so far."""
        return sum((cls.buffer.calls for cls in self._classes.values()), DriverCalls())

    @property
    def used(self) -> int:
        """Bytes of the slots up to each class's top (its tensors and the holes between them)."""
        return sum(cls.top * cls.size for cls in self._classes.values())

    @property
    def live(self) -> int:
        """Bytes of the slots in use."""
        return sum(cls.live * cls.size for cls in self._classes.values())

    def holes(self) -> int:
        """Free slots below the tops, over all classes."""
        return sum(cls.top - cls.live for cls in self._classes.values())

    def close(self) -> None:
        """Give every buffer back (waits for the device); no tensor of the arena may be used after."""
        for cls in self._classes.values():
            cls.buffer.close()
