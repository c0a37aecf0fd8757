"""The weight page table: one row per expert linear-block, its bits, planes and bytes.

A linear-block `i = (layer, expert, kind)` with `kind` 0 = gate_up, 1 = down. Row order is
`i = (layer * experts + expert) * 2 + kind` (see `block_index`).

Per row the table keeps the committed bitwidth `q` (what inference reads now), the desired
bitwidth `d` (what the planner asked for), and the state of each of the 8 bit-planes. The
protocol, enforced here so that no engine can break it:

* offload `b -> b'` (`begin_offload`): `q` drops to `b'` *first*; planes `b'..b-1` become
  TO_CPU (still occupying GPU memory until in-flight kernels are done with them, along with the
  old LUT_b). `finish_offload` releases them (CPU). Nothing is copied back: the CPU keeps the
  8-bit master.
* reload `b -> b''` (`begin_reload`): planes `b..b''-1` become TO_GPU and LUT_b'' is copied in;
  `q` stays `b`. `finish_reload` (called by the engine at a safe boundary after the copy landed)
  marks them GPU, raises `q` to `b''` and frees the old LUT_b.

* in place (`commit_in_place`, only for the dp-llm baseline that keeps every plane resident): `q`
  moves among planes already on the GPU and nothing is copied; a block holding planes above `q`
  is `held` and refuses offload/reload. Its bytes are still counted as `M[i, q]`: such a policy
  reports its real footprint itself (`policies.planners.weight_bytes`).

At most one transfer per block is in flight. Illegal calls raise `PageTableError` and change
nothing. Bytes are exact: resident = sum_i M[i, q_i] + sum_i in_flight_bytes(i), where a block's
in-flight bytes are its TO_* planes plus the extra LUT it holds during the transfer.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import numpy as np

from policies.apformat import MAX_BITS, byte_table, lut_bytes, lut_bytes_of, plane_bytes

KINDS = ("gate_up", "down")
GATE_UP, DOWN = 0, 1
DEFAULT_BITS = (3, 4, 5, 6, 7, 8)


class PlaneState(IntEnum):
    CPU = 0
    GPU = 1
    TO_GPU = 2
    TO_CPU = 3


# The states as plain ints for the numpy work of the protocol methods, which run for every transition: numpy takes
# 3.7 us to compare or assign an IntEnum member on Python 3.11 (it probes the member's attributes), 0.5 us an int.
_CPU, _GPU, _TO_GPU, _TO_CPU = (int(state) for state in PlaneState)


class PageTableError(RuntimeError):
    """An illegal page-table transition; the table is unchanged."""


@dataclass(frozen=True)
class BlockId:
    layer: int
    expert: int
    kind: int

    def __str__(self) -> str:
        return f"L{self.layer}.E{self.expert}.{KINDS[self.kind]}"


def block_index(layer: int, expert: int, kind: int, experts: int) -> int:
    return (layer * experts + expert) * 2 + kind


class PageTable:
    """Numpy-backed page table; engines mutate it only through the protocol methods."""

    def __init__(
        self,
        layers: int,
        experts: int,
        hidden: int,
        intermediate: int,
        bits: tuple[int, ...] = DEFAULT_BITS,
        initial_bits: int | np.ndarray = MAX_BITS,
    ) -> None:
        if layers <= 0 or experts <= 0:
            raise ValueError(f"need at least one layer and one expert, got {layers}x{experts}")
        if not bits or any(not 1 <= b <= MAX_BITS for b in bits):
            raise ValueError(f"supported bitwidths must lie in 1..{MAX_BITS}, got {bits}")
        self.layers, self.experts = layers, experts
        self.bits = tuple(sorted(set(bits)))
        n = layers * experts * 2
        idx = np.arange(n)
        self.kind = (idx % 2).astype(np.int8)
        self.expert = ((idx // 2) % experts).astype(np.int32)
        self.layer = (idx // (2 * experts)).astype(np.int32)
        # gate_up is [2 * intermediate, hidden]; down is [hidden, intermediate]
        self.shapes = np.where(
            self.kind[:, None] == GATE_UP,
            np.array([2 * intermediate, hidden]),
            np.array([hidden, intermediate]),
        ).astype(np.int64)
        self.M = byte_table(self.shapes)
        self._plane = np.array([plane_bytes(int(o), int(i)) for o, i in self.shapes], dtype=np.int64)
        self.supported = np.zeros(MAX_BITS + 1, dtype=bool)
        self.supported[list(self.bits)] = True
        self.q = np.zeros(n, dtype=np.int8)
        self.d = np.zeros(n, dtype=np.int8)  # desired: the bits the planner last moved the block to (q once landed)
        self.planes = np.zeros((n, MAX_BITS), dtype=np.int8)
        self.target = np.full(n, -1, dtype=np.int8)  # bits of the transfer in flight, -1 none
        self.held = np.zeros(n, dtype=bool)  # GPU planes kept above q by commit_in_place
        self.initialize(initial_bits)

    # ----------------------------------------------------------------- views
    @property
    def num_blocks(self) -> int:
        return len(self.q)

    def block_id(self, i: int) -> BlockId:
        return BlockId(int(self.layer[i]), int(self.expert[i]), int(self.kind[i]))

    def index(self, layer: int, expert: int, kind: int) -> int:
        return block_index(layer, expert, kind, self.experts)

    @property
    def busy(self) -> np.ndarray:
        """Blocks with a transfer in flight (no new transition may start on them)."""
        return self.target >= 0

    def in_flight(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(blocks with a transfer in flight, the GPU bytes each holds beyond M[i, q_i], whether it is a reload): a
        reload holds its TO_GPU planes and the new LUT, an offload its TO_CPU planes and the old LUT."""
        idx = np.flatnonzero(self.target >= 0)
        if not idx.size:   # most steps (the engines ask every step)
            return idx, np.zeros(0, np.int64), np.zeros(0, bool)
        q, target = self.q[idx].astype(np.int64), self.target[idx].astype(np.int64)
        moving = (self.planes[idx] >= _TO_GPU).sum(axis=1)
        reload = target > q
        extra = moving * self._plane[idx] + lut_bytes_of(self.shapes[idx, 0], np.where(reload, target, q + moving))
        return idx, extra, reload

    def in_flight_bytes(self) -> np.ndarray:
        """Per block: bytes held on the GPU beyond M[i, q_i] because of a transfer."""
        out = np.zeros(self.num_blocks, dtype=np.int64)
        idx, extra, _ = self.in_flight()
        out[idx] = extra
        return out

    def committed_bytes(self) -> int:
        return int(self.M[np.arange(self.num_blocks), self.q].sum())

    def resident_bytes(self) -> int:
        """All GPU bytes the table accounts for: committed planes/LUTs plus transfers in flight."""
        return self.committed_bytes() + int(self.in_flight_bytes().sum())

    def mean_bits(self) -> float:
        return float(self.q.mean())

    def leading_gpu_planes(self) -> np.ndarray:
        on_gpu = self.planes == _GPU
        return np.where(on_gpu.all(axis=1), MAX_BITS, np.argmin(on_gpu, axis=1))

    # ------------------------------------------------------------ protocol
    def initialize(self, bits: int | np.ndarray) -> None:
        """Set every block's bits before serving (no transfer may be in flight)."""
        if self.busy.any():
            raise PageTableError("cannot re-initialize while transfers are in flight")
        arr = np.broadcast_to(np.asarray(bits, dtype=np.int64), self.q.shape)
        bad = ~(self.supported[np.clip(arr, 0, MAX_BITS)] | (arr == 0)) | (arr < 0) | (arr > MAX_BITS)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise PageTableError(f"initial bits {int(arr[i])} for {self.block_id(i)} not in {self.bits}")
        self.q[:] = arr
        self.d[:] = arr
        self.held[:] = False
        self.planes[:] = np.where(np.arange(MAX_BITS)[None, :] < arr[:, None], _GPU, _CPU)

    def begin_offload(self, i: int, to_bits: int) -> int:
        """Commit the lower bits, mark surplus planes TO_CPU; returns the bytes it will free."""
        self._check_idle(i)
        self._check_bits(i, to_bits)
        self._check_not_held(i)
        q = int(self.q[i])
        if to_bits >= q:
            raise PageTableError(f"offload of {self.block_id(i)} must lower bits: {q} -> {to_bits}")
        self.q[i] = to_bits  # commit the lower bitwidth first
        self.d[i] = to_bits
        self.planes[i, to_bits:q] = _TO_CPU
        self.target[i] = to_bits
        return int(self.M[i, q] - self.M[i, to_bits])

    def finish_offload(self, i: int) -> None:
        """Release the surplus planes and old LUT (after kernels stopped reading them)."""
        self._check_index(i)
        if self.target[i] < 0 or self.target[i] > self.q[i] or not (self.planes[i] == _TO_CPU).any():
            raise PageTableError(f"{self.block_id(i)} has no offload in flight")
        self.planes[i][self.planes[i] == _TO_CPU] = _CPU
        self.target[i] = -1

    def begin_reload(self, i: int, to_bits: int) -> int:
        """Mark planes q..to_bits-1 TO_GPU; returns the bytes to copy (planes plus LUT_to)."""
        self._check_idle(i)
        self._check_bits(i, to_bits)
        self._check_not_held(i)
        q = int(self.q[i])
        if to_bits <= q:
            raise PageTableError(f"reload of {self.block_id(i)} must raise bits: {q} -> {to_bits}")
        self.planes[i, q:to_bits] = _TO_GPU
        self.target[i] = to_bits
        self.d[i] = to_bits
        return int((to_bits - q) * self._plane[i] + lut_bytes(int(self.shapes[i, 0]), to_bits))

    def finish_reload(self, i: int) -> None:
        """Planes landed: mark them GPU and only now raise the committed bits."""
        self._check_index(i)
        if self.target[i] < 0 or self.target[i] <= self.q[i]:
            raise PageTableError(f"{self.block_id(i)} has no reload in flight")
        to_bits = int(self.target[i])
        if not (self.planes[i, self.q[i]:to_bits] == _TO_GPU).all():
            raise PageTableError(f"{self.block_id(i)}: reload planes are not all in flight")
        self.planes[i, self.q[i]:to_bits] = _GPU
        self.q[i] = to_bits
        self.target[i] = -1

    def commit_in_place(self, i: int, bits: int) -> None:
        """Set q to `bits` among planes already on the GPU; no plane moves (dp-llm baseline only)."""
        self._check_idle(i)
        self._check_bits(i, bits)
        on_gpu = self.planes[i] == _GPU
        lead = MAX_BITS if on_gpu.all() else int(np.argmin(on_gpu))
        if not 1 <= bits <= lead:
            raise PageTableError(f"{self.block_id(i)}: cannot commit {bits} bits in place, "
                                 f"only {lead} leading planes are on the GPU")
        self.q[i] = bits
        self.d[i] = bits
        self.held[i] = bits < lead

    def _check_not_held(self, i: int) -> None:
        if self.held[i]:
            raise PageTableError(f"{self.block_id(i)} keeps planes above q={self.q[i]} in place "
                                 "(commit_in_place); it cannot offload or reload")

    def _check_index(self, i: int) -> None:
        if not 0 <= i < self.num_blocks:
            raise PageTableError(f"block index {i} out of range 0..{self.num_blocks - 1}")

    def _check_idle(self, i: int) -> None:
        self._check_index(i)
        if self.target[i] >= 0:
            raise PageTableError(f"{self.block_id(i)} already has a transfer in flight")

    def _check_bits(self, i: int, bits: int) -> None:
        self._check_index(i)
        if bits != 0 and not (0 < bits <= MAX_BITS and self.supported[bits]):
            raise PageTableError(f"{bits} bits not supported for {self.block_id(i)}; supported: {self.bits}")

    # ----------------------------------------------------------- invariants
    def check_invariants(self) -> None:
        """Raise PageTableError if the table is inconsistent (used by tests and debug runs)."""
        lead = self.leading_gpu_planes()
        if (self.q > lead).any():
            i = int(np.flatnonzero(self.q > lead)[0])
            raise PageTableError(f"{self.block_id(i)}: q={self.q[i]} exceeds leading GPU planes {lead[i]}")
        for i in np.flatnonzero(~self.busy):
            if (self.planes[i] >= _TO_GPU).any():
                raise PageTableError(f"{self.block_id(i)}: planes in flight but no transfer recorded")
            if not self.held[i] and (self.planes[i, self.q[i]:] == _GPU).any():
                raise PageTableError(f"{self.block_id(i)}: GPU planes above q={self.q[i]} while idle")
