"""Device-side weight page table: per linear-block plane pointers, LUT pointer and committed bits.

One int64 tensor `table[num_blocks, 10]` on the device: columns 0..7 hold the addresses of bit-planes
0..7 (0 where a plane is not resident), column 8 the address of `LUT_q`, column 9 the committed
bitwidth q. Block order is the page table's: `i = (layer * experts + expert) * 2 + kind`. Kernels
read the row of every block they touch at run time, so committing a new bitwidth or moving a plane
is a small stream-ordered write into this tensor: no recompilation, no new launch configuration,
and a captured CUDA graph replays with the new bits.

Device layout of the planes: planes 3..7 are the AP format's plane slabs as they are; the three
always-resident top planes 0..2 are stored *nibble-packed* (`pack_top_planes`): same three slabs,
same bytes, but the 96 bits of each word position are rearranged so that word j (j = 0, 1, 2) holds
in nibble s the 3-bit top code (plane 0 as its MSB) of element j + 4s, and in bit 3 of nibble s the
plane-j bit of element 3 + 4s. The fused kernel then gets the nibble codes of three of every four
elements with one AND, instead of shifting and merging three planes. Blocks are therefore never
below 3 bits (the AP format's floor). Callers holding planes in the AP layout pack them
(`pack_top_planes`, `pack_top_planes_` in place, or `upload`, which does it); `ResidentBlock.stacked()` unpacks for the
reference.

The table also keeps a reference to every tensor it points at (so nothing it names is freed while
it is named) and a host mirror of the rows; the pure-torch reference path computes from those
tensors, which makes the same object usable on CPU. A write goes to the mirror at once and to the
device rows with `flush()`: at once by default, or, with `flush=False`, together with the other rows
written since, in one copy (the page mover writes a plan's rows so, one copy a boundary instead of one
a row). Until then kernels read the rows as they were, so a caller that defers must keep what those
name alive and flush before what it wrote is needed.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from policies.apformat import MAX_BITS, WORD_BITS

TABLE_COLS = 10
COL_LUT = 8
COL_BITS = 9
ALIGN = 16
TOP_PLANES = 3  # planes 0..2: always resident, nibble-packed on the device
MIN_BITS = TOP_PLANES


def _i32(mask: int) -> int:
    """A 32-bit mask as the signed value an int32 tensor holds."""
    return mask - (1 << 32) if mask >= 1 << 31 else mask


def _shift(x: torch.Tensor, by: int) -> torch.Tensor:
    """x << by for by >= 0, x >> -by otherwise (arithmetic; callers mask the bits shifted in)."""
    return x << by if by >= 0 else x >> -by


def pack_top_planes(planes: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """AP planes 0..2 (int32 [out, words], bit e = element e) -> the device's nibble-packed words 0..2.

    Word j, nibble s: bits 0..2 = plane 2, 1, 0 bits of element j + 4s (the top code, plane 0 its MSB),
    bit 3 = plane j's bit of element 3 + 4s. A bijection on the 96 bits of each word position.
    """
    p = [as_int32(t) for t in planes[:TOP_PLANES]]
    if len(p) != TOP_PLANES:
        raise ValueError(f"the nibble layout needs planes 0..2, got {len(p)} planes")
    out = []
    for j in range(TOP_PLANES):
        n = (_shift(p[0], 2 - j) & _i32(0x44444444)) | (_shift(p[1], 1 - j) & _i32(0x22222222)) \
            | (_shift(p[2], -j) & _i32(0x11111111)) | (p[j] & _i32(0x88888888))
        out.append(n)
    return out


def pack_top_planes_(planes: Sequence[torch.Tensor]) -> None:
    """`pack_top_planes` in place: the three tensors then hold the device's nibble-packed words 0..2."""
    for t, packed in zip(planes, pack_top_planes(planes)):
        t.copy_(packed)


def unpack_top_planes(words: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The inverse of `pack_top_planes`: nibble-packed words 0..2 -> AP planes 0..2."""
    n = [as_int32(t) for t in words[:TOP_PLANES]]
    out = []
    for k in range(TOP_PLANES):
        p = n[k] & _i32(0x88888888)
        for j in range(TOP_PLANES):
            p = p | (_shift(n[j], j + k - 2) & _i32(0x11111111 << j))
        out.append(p)
    return out


def device_layout(planes) -> list[torch.Tensor]:
    """AP planes (a [planes, out, words] tensor or a list, at least 3) in the device layout: top three packed."""
    plist = [as_int32(p) for p in _as_plane_list(planes)]
    return pack_top_planes(plist) + plist[TOP_PLANES:]


def as_int32(t: torch.Tensor) -> torch.Tensor:
    """32-bit words as int32 (a uint32 tensor is viewed, not copied)."""
    return t.view(torch.int32) if t.dtype == torch.uint32 else t


@dataclass(frozen=True)
class ResidentBlock:
    """What one row points at: planes 0..len-1 (each [out, words] 32-bit words) and LUT_bits."""
    planes: tuple[torch.Tensor, ...]
    lut: torch.Tensor
    bits: int

    @property
    def out_features(self) -> int:
        return int(self.lut.shape[0])

    @property
    def words(self) -> int:
        return int(self.planes[0].shape[1])

    def stacked(self) -> torch.Tensor:
        """Planes 0..bits-1 in the AP layout (top three unpacked), one [bits, out, words] int32 tensor:
        the reference dequantizer's input."""
        planes = unpack_top_planes(self.planes) + [as_int32(p) for p in self.planes[TOP_PLANES:self.bits]]
        return torch.stack(planes)


def _as_plane_list(planes) -> list[torch.Tensor]:
    if isinstance(planes, torch.Tensor):
        if planes.dim() != 3:
            raise ValueError(f"planes must be [planes, out, words] or a list of [out, words], got {tuple(planes.shape)}")
        return [planes[j] for j in range(planes.shape[0])]
    return list(planes)


class DeviceWeightTable:
    """The kernels' view of the weight page table (see the module docstring for the row format)."""

    def __init__(self, num_blocks: int, device: str | torch.device = "cuda") -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = int(num_blocks)
        self.device = torch.device(device)
        self._cuda = self.device.type == "cuda"
        self.table = torch.zeros(self.num_blocks, TABLE_COLS, dtype=torch.int64, device=self.device)
        self.host = np.zeros((self.num_blocks, TABLE_COLS), dtype=np.int64)
        self._blocks: dict[int, ResidentBlock] = {}
        self._dirty: tuple[int, int] | None = None  # rows lo..hi-1 hold writes the device has not had yet

    # ------------------------------------------------------------ reads
    def bits(self, block: int) -> int:
        return int(self.host[self._check(block), COL_BITS])

    def resident(self, block: int) -> ResidentBlock | None:
        return self._blocks.get(self._check(block))

    def nbytes_read(self, block: int) -> int:
        """Bytes a kernel reads for this block at its committed bits (planes 0..q-1 + LUT_q)."""
        rb = self._blocks.get(self._check(block))
        if rb is None:
            return 0
        return rb.bits * rb.out_features * rb.words * 4 + rb.lut.numel() * 2

    # ------------------------------------------------------------ writes
    def set_block(self, block: int, planes, lut: torch.Tensor, bits: int | None = None, flush: bool = True) -> None:
        """Point `block` at `planes` (at least `bits` of them, MSB first, in the device layout: see the
        module docstring) and `LUT_bits`, committing `bits`; the device row changes now, or with the next
        `flush()` if `flush` is False.

        `bits` defaults to the number of planes given. Planes beyond `bits` are recorded too (they
        are resident, the kernels just do not read them), so `commit_bits` can raise q later.
        """
        block = self._check(block)
        plist = _as_plane_list(planes)
        bits = len(plist) if bits is None else int(bits)
        rb = self._validate(plist, lut, bits, self._blocks.get(block))
        row = [p.data_ptr() for p in plist] + [0] * (COL_LUT - len(plist)) + [lut.data_ptr(), bits]
        self._write(block, row, flush)
        self._blocks[block] = rb

    def commit_bits(self, block: int, bits: int, lut: torch.Tensor) -> None:
        """Change the committed bitwidth of a resident block (its planes 0..bits-1 must be recorded)."""
        block = self._check(block)
        rb = self._blocks.get(block)
        if rb is None:
            raise ValueError(f"block {block} has no resident planes; call set_block first")
        self.set_block(block, rb.planes, lut, bits)

    def repoint(self, block: int, old: torch.Tensor, new: torch.Tensor, flush: bool = True) -> None:
        """`block`'s row names `new` where it named `old`, a plane or its LUT that moved (a plane arena's move: same
        shape and dtype, new memory); the device row changes now, or with the next `flush()`. Only `new`'s placement
        is checked: the row passed the rest when it was set."""
        block = self._check(block)
        rb = self._blocks.get(block)
        if new.shape != old.shape or new.dtype != old.dtype:
            raise ValueError(f"a moved tensor keeps its shape and dtype: {tuple(old.shape)} {old.dtype} -> "
                             f"{tuple(new.shape)} {new.dtype}")
        if rb is not None and rb.lut is old:
            col, rb = COL_LUT, ResidentBlock(rb.planes, new, rb.bits)
        else:
            col = next((j for j, p in enumerate(rb.planes) if p is old), None) if rb is not None else None
            if col is None:
                raise ValueError(f"block {block}'s row does not name the tensor moved")
            rb = ResidentBlock(rb.planes[:col] + (new,) + rb.planes[col + 1:], rb.lut, rb.bits)
        self._check_placed(new)
        row = self.host[block].copy()
        row[col] = new.data_ptr()
        self._write(block, row, flush)
        self._blocks[block] = rb

    def clear(self, block: int, flush: bool = True) -> None:
        """Mark a block not resident (q = 0); kernels then treat its weights as zero."""
        block = self._check(block)
        self._write(block, np.zeros(TABLE_COLS, dtype=np.int64), flush)
        self._blocks.pop(block, None)

    @property
    def dirty(self) -> bool:
        """Whether rows were written with `flush=False` since the last `flush()`."""
        return self._dirty is not None

    def flush(self) -> None:
        """Copy the rows written since the last flush to the device, stream-ordered on the current stream: the
        span from the first to the last of them, in one copy from pinned memory (rows between are rewritten
        with what they hold)."""
        if self._dirty is None:
            return
        lo, hi = self._dirty
        self._dirty = None
        on_gpu = self.device.type == "cuda"
        # a fresh buffer (torch's caching host allocator keeps it until the copy has run), not the mirror, which
        # later writes change while the copy may still be queued
        src = torch.empty((hi - lo, TABLE_COLS), dtype=torch.int64, pin_memory=on_gpu)
        src.numpy()[:] = self.host[lo:hi]
        # kernels queued before see the old rows, after it the new; from pinned memory the host does not wait
        self.table[lo:hi].copy_(src, non_blocking=on_gpu)

    def upload(self, block: int, planes: torch.Tensor, lut: torch.Tensor, bits: int,
               planes_resident: int | None = None) -> ResidentBlock:
        """Copy planes[:planes_resident or bits] (AP layout) and LUT_bits to this table's device, in the
        device layout, and point `block` at them."""
        n = bits if planes_resident is None else int(planes_resident)
        if n < TOP_PLANES:
            raise ValueError(f"blocks keep at least planes 0..{TOP_PLANES - 1} resident, got {n} planes")
        dev_planes = device_layout(planes[:n].to(self.device, non_blocking=True))
        dev_lut = lut.to(self.device, dtype=torch.float16, non_blocking=True).contiguous()
        self.set_block(block, dev_planes, dev_lut, bits)
        return self._blocks[block]

    # ------------------------------------------------------------ internals
    def _check(self, block: int) -> int:
        block = int(block)
        if not 0 <= block < self.num_blocks:
            raise IndexError(f"block {block} out of range for a table of {self.num_blocks} blocks")
        return block

    def _validate(self, plist: Sequence[torch.Tensor], lut: torch.Tensor, bits: int,
                  current: ResidentBlock | None) -> ResidentBlock:
        """The row's checks; a tensor the block's `current` row already names passed them when it was set (the page
        mover rewrites rows on every transition, so the checks touch only what is new to the row)."""
        if not MIN_BITS <= bits <= MAX_BITS:
            raise ValueError(f"bits must be in {MIN_BITS}..{MAX_BITS} (planes 0..2 are stored together), got {bits}")
        if not bits <= len(plist) <= MAX_BITS:
            raise ValueError(f"{bits} bits need planes 0..{bits - 1}; got {len(plist)} planes")
        if lut.dim() != 2 or lut.shape[1] != 1 << bits:
            raise ValueError(f"LUT_{bits} must be [out, {1 << bits}], got {tuple(lut.shape)}")
        if lut.dtype != torch.float16:
            raise ValueError(f"LUTs are fp16 centroids, got {lut.dtype}")
        out = lut.shape[0]
        known = set(map(id, current.planes)) if current is not None else set()
        new = [p for p in plist if id(p) not in known]
        # the planes the row names passed the shape checks against its LUT's rows; a LUT of other rows checks them all
        shape = (out, plist[0].shape[1] if plist[0].dim() == 2 else -1)
        for p in new if current is not None and current.lut.shape[0] == out else plist:
            if p.dtype not in (torch.int32, torch.uint32):
                raise ValueError(f"planes are 32-bit words (int32/uint32), got {p.dtype}")
            if p.shape != shape:
                raise ValueError(f"every plane must be [out={out}, words], got {tuple(p.shape)}")
        if current is None or lut is not current.lut:
            new.append(lut)
        for t in new:
            self._check_placed(t)
        if shape[1] * WORD_BITS <= 0:
            raise ValueError("empty planes")
        return ResidentBlock(tuple(plist), lut, bits)

    def _check_placed(self, t: torch.Tensor) -> None:
        """`t` is on this table's device (any CUDA device when it names none), contiguous and aligned there."""
        elsewhere = (not t.is_cuda or self.device.index not in (None, t.get_device())) if self._cuda \
            else t.device != self.device
        if elsewhere:
            raise ValueError(f"tensor on {t.device}, table on {self.device}")
        if not t.is_contiguous():
            raise ValueError("planes and LUTs must be contiguous")
        if self._cuda and t.data_ptr() % ALIGN:
            raise ValueError(f"planes and LUTs must be {ALIGN}-byte aligned on the device")

    def _write(self, block: int, row, flush: bool) -> None:
        self.host[block] = row
        lo, hi = self._dirty or (block, block + 1)
        self._dirty = (min(lo, block), max(hi, block + 1))
        if flush:
            self.flush()
