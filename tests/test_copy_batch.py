"""CopyBatch: a boundary's host-to-device copies queued together (one driver call on CUDA), then the work after them."""
from __future__ import annotations

import pytest
import torch

from pwruntime.copy_batch import CopyBatch, driver_batch_copy


def sources(n: int, pin: bool = False) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(n)
    out = [torch.randint(-2 ** 31, 2 ** 31 - 1, (64 + 8 * k, 16), dtype=torch.int32, generator=gen) for k in range(n)]
    out.append(torch.randn(32, 8, generator=gen).half())
    return [t.pin_memory() for t in out] if pin else out


def test_uploads_hold_their_sources_once_issued_and_after_work_runs_after_the_copies():
    batch = CopyBatch(torch.device("cpu"))
    srcs = sources(5)
    dsts = [batch.upload(s) for s in srcs]
    assert len(batch) == 6
    batch.after(lambda: dsts[0].add_(1))  # sees the copied values, not the empty tensor's
    batch.issue()
    assert torch.equal(dsts[0], srcs[0] + 1) and all(torch.equal(d, s) for d, s in zip(dsts[1:], srcs[1:]))
    assert len(batch) == 0  # emptied: the same batch serves the next boundary
    again = batch.upload(srcs[1])
    batch.issue()
    assert torch.equal(again, srcs[1]) and again.data_ptr() != dsts[1].data_ptr()


def test_a_source_must_be_contiguous_and_empty_sources_queue_nothing():
    batch = CopyBatch(torch.device("cpu"))
    with pytest.raises(ValueError, match="contiguous"):
        batch.upload(torch.zeros(8, 8)[:, ::2])
    empty = batch.upload(torch.zeros(0, 4))
    assert empty.shape == (0, 4) and len(batch) == 0
    batch.issue()


def test_a_rollback_forgets_the_copies_and_after_work_added_since_its_savepoint():
    """What a failed reload staged is dropped unwritten: neither its copies nor its `after` work run."""
    batch = CopyBatch(torch.device("cpu"))
    srcs = sources(3)
    kept = [batch.upload(s) for s in srcs[:2]]
    ran = []
    point = batch.savepoint()
    batch.upload(srcs[2])
    batch.after(lambda: ran.append("dropped"))
    batch.rollback(point)
    batch.after(lambda: ran.append("kept"))
    assert len(batch) == 2
    batch.issue()
    assert ran == ["kept"] and all(torch.equal(d, s) for d, s in zip(kept, srcs))


def test_a_copy_between_tensors_of_other_byte_sizes_is_refused():
    batch = CopyBatch(torch.device("cpu"))
    with pytest.raises(ValueError, match="one size"):
        batch.copy(torch.empty(8, dtype=torch.int32), torch.zeros(8, dtype=torch.float16))   # 8 of each, other bytes


@pytest.mark.gpu
def test_gpu_batch_copies_with_one_driver_call_on_a_side_stream_and_on_the_default_stream():
    dev = torch.device("cuda", torch.cuda.current_device())
    assert driver_batch_copy() is not None  # CUDA 12.8+ drivers have cuMemcpyBatchAsync
    srcs = sources(40, pin=True)
    side = torch.cuda.Stream(dev)
    with torch.cuda.stream(side):
        batch = CopyBatch(dev)
        dsts = [batch.upload(s) for s in srcs]
        batch.after(lambda: dsts[-1].mul_(2))
        batch.issue()
    side.synchronize()
    assert batch.use_driver  # the driver call succeeded
    assert torch.equal(dsts[-1].cpu(), srcs[-1] * 2)
    assert all(torch.equal(d.cpu(), s) for d, s in zip(dsts[:-1], srcs[:-1]))
    with torch.cuda.stream(torch.cuda.default_stream(dev)):  # whatever an earlier test left current
        # the legacy default stream, which cuMemcpyBatchAsync rejects: a side stream joined to it
        batch = CopyBatch(dev)
        assert torch.cuda.current_stream(dev).cuda_stream == 0
        dsts = [batch.upload(s) for s in srcs]
        batch.after(lambda: dsts[0].add_(1))
        batch.issue()
    torch.cuda.synchronize()
    assert batch.use_driver and torch.equal(dsts[0].cpu(), srcs[0] + 1)  # the default stream's work came after
    assert all(torch.equal(d.cpu(), s) for d, s in zip(dsts[1:], srcs[1:]))
