"""CudaPageMover: the runtime's PageMover; moves AP bit-planes between the pinned master and a DeviceExpertStore.

The PlanLoop (policies/loop.py) calls `start(transition, nbytes)` for every transition it begins and
then, at the same iteration boundary, `landed()`, and commits the blocks landed() returns in the
PageTable (`finish_offload` / `finish_reload`). The device side follows the same order:

* offload b -> b' (the loop has already committed b' in the PageTable): `start` uploads LUT_b' and
  rewrites the block's DeviceWeightTable row to planes 0..b'-1 + LUT_b' in the table's host mirror,
  keeping the surplus planes and the old LUT alive. `landed()` first sends the rows of every offload
  begun since the last boundary to the device in one copy on the compute stream (stream-ordered:
  kernels queued before read the old rows, kernels after the new ones) and records one mark (CUDA
  event) after it. A block lands once that mark is done, i.e. no queued kernel can still read its
  surplus planes and old LUT; they are dropped then and the loop's `finish_offload` hands their bytes
  to the KV pool.
* reload b -> b'': `start` queues it; at the same boundary `landed()` stages every reload queued since:
  fresh device tensors for planes b..b''-1 and LUT_b'' (a tensor a plane, so that a later offload frees
  exactly its surplus; allocated on the compute stream, where offloads free theirs), all copied from the
  pinned master as one `CopyBatch` (one driver call on CUDA) on a dedicated copy stream, after the work the
  compute stream has queued, between two marks the boundary's reloads share. The row is not touched, so kernels keep
  reading b bits. When the mark is done,
  **`landed()` commits the device row just before returning the block**: the compute stream waits
  on the copy mark (the only point where it waits on the copy stream; the copies run in order, so one
  wait on the last mark done covers every reload landing), the row gets the new planes, LUT_b'' and
  bits b'' (all landing rows in one copy), and the old LUT_b is freed once the compute stream passes
  that write. The loop's `finish_reload` then raises q in the PageTable at the same boundary, before any
  kernel runs.
* in place (dp-llm) and a policy's `initialize`: the loop commits them without the mover;
  `landed()` first calls `DeviceExpertStore.sync()`, which brings every idle row to `PageTable.q`.

A reload whose device allocation fails is logged and retried at the next boundary (its block stays
at the lower bits, nothing is lost). Bytes follow policies/loop.py exactly: what is resident on the
device, `store.resident_bytes() + inflight_bytes()`, equals `PageTable.resident_bytes()`. Off CUDA
the same code runs with CPU tensors, no copy stream and marks that are done at once, so a transfer
lands at the boundary it started.
"""
from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field

import torch

from policies.contract import Transition
from pwruntime.device_store import DeviceExpertStore
from pwruntime.stream_marks import Mark, mark, on_stream, seconds_between, side_stream, tensor_bytes, wait_for

log = logging.getLogger(__name__)


@dataclass
class MoverStats:
    """Counters for metrics: transfers, bytes and times."""
    offloads: int = 0
    reloads: int = 0
    failed_reloads: int = 0  # allocation failures (each retried at the next boundary)
    bytes_freed: int = 0  # device bytes landed offloads dropped: surplus planes + old LUT (what the loop releases)
    bytes_reloaded: int = 0  # host-to-device bytes of landed reloads (planes + LUT)
    bytes_lut_uploaded: int = 0  # host-to-device bytes of the lower LUTs offloads upload
    reload_seconds: float = 0.0  # copy time of landed reloads (device time on CUDA; a batch's split by bytes)
    reload_seconds_max: float = 0.0  # the longest batch of reloads (those a boundary began)
    offload_seconds: float = 0.0  # start -> landed of offloads (host time)
    host_seconds: float = 0.0  # host time in `start` and `landed`: what the page moves cost the plan phase

    @property
    def bytes_moved(self) -> int:
        return self.bytes_reloaded + self.bytes_lut_uploaded

    def metrics(self) -> dict[str, float]:
        """Prometheus-style names: counters end in _total."""
        d = {f"page_{k}_total": v for k, v in asdict(self).items() if k != "reload_seconds_max"}
        d["page_bytes_moved_total"] = self.bytes_moved
        d["page_reload_seconds_max"] = self.reload_seconds_max
        return d


@dataclass
class _Transfer:
    block: int
    to_bits: int
    nbytes: int  # what the loop passed to start()
    done: Mark | None  # the block lands when this is done (an offload's is recorded at the next landed())
    begun: Mark  # start of the copy (reload) or of the offload (host time only)
    tensors: tuple[torch.Tensor, ...] = ()  # offload: surplus planes + old LUT; reload: new planes
    lut: torch.Tensor | None = None  # reload: LUT_to
    share: float = 1.0  # reload: its part of its batch's bytes (the batch's copy time is split by bytes)

    @property
    def is_offload(self) -> bool:
        return self.lut is None

    @property
    def device_bytes(self) -> int:
        return tensor_bytes(self.tensors) + (tensor_bytes((self.lut,)) if self.lut is not None else 0)


@dataclass
class CudaPageMover:
    """PageMover over one DeviceExpertStore (see the module docstring for the commit protocol)."""
    store: DeviceExpertStore
    stats: MoverStats = field(default_factory=MoverStats)
    _pending: list[_Transfer] = field(default_factory=list)
    _staging: list[tuple[Transition, int]] = field(default_factory=list)  # reloads begun since the last boundary
    _retry: list[tuple[Transition, int, int]] = field(default_factory=list)  # (transition, nbytes, failed at boundary)
    _boundary: int = 0  # landed() calls so far

    def __post_init__(self) -> None:
        self.device = self.store.device
        self.copy_stream = side_stream(self.device)
        self._batch = self.store.new_batch()

    # ------------------------------------------------------------ PageMover
    def start(self, transition: Transition, nbytes: int) -> None:
        began = time.perf_counter()
        i = int(transition.block)
        if int(self.store.row_bits[i]) != transition.from_bits:  # a commit no boundary has synced yet
            self.store.follow(i, transition.from_bits, transition.from_bits)
        if transition.is_offload:
            self._start_offload(i, transition.to_bits, nbytes)
        else:
            self._staging.append((transition, int(nbytes)))
        self.stats.host_seconds += time.perf_counter() - began

    def landed(self) -> list[int]:
        began = time.perf_counter()
        out = self._land()
        self.stats.host_seconds += time.perf_counter() - began
        return out

    def _land(self) -> list[int]:
        begun = [tr for tr in self._pending if tr.done is None]  # offloads begun since the last boundary
        if begun:
            self.store.flush()
            done = mark(self.device)
            for tr in begun:
                tr.done = done
        self.store.sync()
        due = [r for r in self._retry if r[2] < self._boundary]  # reloads that failed at an earlier boundary
        self._retry = [r for r in self._retry if r[2] >= self._boundary]
        self._stage_reloads(self._staging + [(t, nbytes) for t, nbytes, _ in due])
        self._staging = []
        self._boundary += 1
        passed: dict[int, bool] = {}  # a boundary's transfers share marks: each is queried once
        out, keep = [], []
        for tr in self._pending:
            m = tr.done
            if m is not None and id(m) not in passed:
                passed[id(m)] = m.done()
            (out if m is not None and passed[id(m)] else keep).append(tr)
        self._pending = keep
        reloads = [tr for tr in out if not tr.is_offload]
        if reloads:
            wait_for(reloads[-1].done, self.device)  # the copy stream ran them in order: the last covers all
        batch_seconds: dict[int, float] = {}
        for tr in out:
            if not tr.is_offload and id(tr.done) not in batch_seconds:
                batch_seconds[id(tr.done)] = seconds_between(tr.begun, tr.done)
            self._finish(tr, batch_seconds.get(id(tr.done), 0.0))
        self.store.flush()
        self.store.deferred.collect()
        self.store.keep_dense()   # after the frees that collect let go
        return [tr.block for tr in out]

    # ------------------------------------------------------------ views
    def inflight_bytes(self) -> int:
        """Device bytes of transfers not landed: offloads' surplus planes + old LUT, reloads' planes + LUT."""
        return sum(tr.device_bytes for tr in self._pending)

    def device_bytes(self) -> int:
        """Every device byte of expert weights that the page table accounts for."""
        return self.store.resident_bytes() + self.inflight_bytes()

    @property
    def num_pending(self) -> int:
        return len(self._pending) + len(self._staging) + len(self._retry)

    def metrics(self) -> dict[str, float]:
        """The stats' counters, and with a plane arena the tensors it moved to stay dense (`page_arena_moves_total`)."""
        d = self.stats.metrics()
        if self.store.arena is not None:
            d["page_arena_moves_total"] = self.store.arena.moves
        return d

    def drain(self) -> None:
        """Block until every transfer begun so far has completed on the device (tests, shutdown)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # ------------------------------------------------------------ transfers
    def _start_offload(self, i: int, to_bits: int, nbytes: int) -> None:
        begun = Mark(None, time.perf_counter())
        surplus = self.store.lower(i, to_bits)
        if to_bits:
            self.stats.bytes_lut_uploaded += tensor_bytes(self.store.resident(i)[1:])
        self._pending.append(_Transfer(i, to_bits, int(nbytes), None, begun, tuple(surplus)))

    def _stage_reloads(self, reloads: list[tuple[Transition, int]]) -> None:
        """Allocate `reloads` on the compute stream and copy them as one batch on the copy stream; a reload whose
        allocation fails is retried at the next boundary (its block stays at the lower bits).

        The caching allocator hands a freed block only to the stream it was allocated on. Planes allocated on the
        copy stream would leave what offloads free on the compute stream (the model's planes were loaded there)
        cached for nothing, and the other way round: about 3 GiB of the 11.5 the small pool reserved in a 12 GiB
        OLMoE replay. So the destinations come from the compute stream, and the copy stream waits for the compute
        stream's work queued so far (whatever used that memory before) before it writes them."""
        if not reloads:
            return
        allocated = []
        for t, nbytes in reloads:
            point = self._batch.savepoint()
            try:
                planes, lut = self.store.stage_planes(int(t.block), t.to_bits, self._batch)
            except (torch.cuda.OutOfMemoryError, MemoryError) as e:
                self._batch.rollback(point)  # what it allocated before failing is freed, never written
                self.stats.failed_reloads += 1
                log.warning("reload of block %d to %d bits failed (%s); it stays at the lower bits and is "
                            "retried", t.block, t.to_bits, e)
                self._retry.append((t, nbytes, self._boundary))
                continue
            allocated.append((t, nbytes, planes, lut))
        compute = torch.cuda.current_stream(self.device) if self.copy_stream is not None else None
        with on_stream(self.copy_stream):
            if compute is not None:
                self.copy_stream.wait_stream(compute)
            begun = mark(self.device, self.copy_stream, timing=True)
            staged = [_Transfer(int(t.block), t.to_bits, nbytes, None, begun, planes, lut)
                      for t, nbytes, planes, lut in allocated]
            self._batch.issue()
            done = mark(self.device, self.copy_stream, timing=True)
        total = sum(tr.device_bytes for tr in staged)
        for tr in staged:
            tr.done, tr.share = done, tr.device_bytes / total if total else 1.0
        self._pending.extend(staged)

    def _finish(self, tr: _Transfer, batch_seconds: float) -> None:
        if tr.is_offload:
            self.stats.offloads += 1
            self.stats.bytes_freed += tr.device_bytes
            self.stats.offload_seconds += time.perf_counter() - tr.begun.host_time
            tr.tensors = ()  # the surplus planes and the old LUT are freed: no queued kernel reads them
            return
        self.store.retire(self.store.raise_bits(tr.block, tr.tensors, tr.lut, tr.to_bits))
        self.stats.reloads += 1
        self.stats.bytes_reloaded += tr.device_bytes
        self.stats.reload_seconds += batch_seconds * tr.share
        self.stats.reload_seconds_max = max(self.stats.reload_seconds_max, batch_seconds)
