"""pwruntime.vmm and the KV cache on it: a fixed address whose mapped memory follows resizes, content kept, the memory
a shrink gives up returned to the driver once the device is done with it."""
from __future__ import annotations

import pytest
import torch

from pwruntime import vmm
from pwruntime.kv_cache import KVCache
from vmm_fakes import HostBuffer

MIB = 1 << 20


def test_handle_sizes_cover_the_range_in_steps_no_larger_than_the_cap():
    assert vmm.handle_sizes(0, 1, 2 * MIB, 32 * MIB) == [2 * MIB]
    assert vmm.handle_sizes(4 * MIB, 4 * MIB, 2 * MIB, 32 * MIB) == []
    assert vmm.handle_sizes(2 * MIB, 71 * MIB, 2 * MIB, 32 * MIB) == [32 * MIB, 32 * MIB, 6 * MIB]
    assert vmm.handle_sizes(0, 5 * MIB, 2 * MIB, 3 * MIB) == [2 * MIB, 2 * MIB, 2 * MIB]  # a cap below a step: steps
    assert vmm.round_up(0, 8) == 0 and vmm.round_up(9, 8) == 16 and vmm.round_up(16, 8) == 16


@pytest.mark.parametrize("dtype", [torch.int32, torch.uint32, torch.float16, torch.bfloat16, torch.uint8])
def test_wrap_makes_a_tensor_of_the_dtype_over_the_memory_that_holds_its_owner_until_the_last_view_dies(dtype):
    memory = torch.arange(64, dtype=torch.uint8)
    gone = []

    class Owner:
        def __del__(self):
            gone.append(True)

    t = vmm.wrap(memory.data_ptr() + 16, (2, 8 // dtype.itemsize), dtype, torch.device("cpu"), Owner())
    assert t.dtype == dtype and t.shape == (2, 8 // dtype.itemsize) and t.data_ptr() == memory.data_ptr() + 16
    assert torch.equal(t.view(torch.uint8).flatten(), memory[16:32])
    view = t[1:]
    del t
    assert gone == []
    del view
    assert gone == [True]


def test_the_kv_cache_off_cuda_is_torch_tensors_and_maps_nothing():
    kv = KVCache(2, 6, 4, 2, 8, scratch=True)
    assert not kv.buffers and kv.mapped_bytes == 0 and kv.peak_mapped_bytes == 0
    kv.k[0][:6] = 1.0
    kv.resize(9)
    assert kv.k[0].shape == (10, 4, 2, 8) and bool((kv.k[0][:6] == 1).all()) and bool((kv.k[0][6:] == 0).all())


@pytest.mark.gpu
def test_gpu_buffer_grows_in_place_keeps_content_and_unmaps_a_shrinks_tail_once_the_device_is_done():
    buf = vmm.GrowableBuffer(1 << 30, "cuda", max_handle=4 * MIB)
    step = buf.step
    rows = buf.rows((1024,), torch.float32)        # 4 KiB rows
    per_mib = MIB // 4096
    buf.resize(10 * MIB)
    assert buf.mapped == vmm.round_up(10 * MIB, step) and rows.data_ptr() == buf.ptr
    data = torch.randn(10 * per_mib, 1024, device="cuda")
    rows[:10 * per_mib] = data
    buf.resize(30 * MIB)                             # grows behind the same address: nothing copied
    assert buf.mapped == vmm.round_up(30 * MIB, step) and torch.equal(rows[:10 * per_mib], data)
    rows[:30 * per_mib].fill_(2.0)
    rows[:10 * per_mib] = data
    torch.cuda._sleep(200_000_000)                   # the device busy for a while (~0.1 s): the retirement waits
    buf.resize(9 * MIB)                              # the handles wholly above 9 MiB retire; still mapped
    assert buf.mapped == vmm.round_up(30 * MIB, step)
    buf.resize(12 * MIB)                             # taken back without a new mapping: what was there is there
    assert torch.equal(rows[:10 * per_mib], data) and bool((rows[10 * per_mib:12 * per_mib] == 2).all())
    assert buf.mapped == vmm.round_up(30 * MIB, step)
    buf.resize(3 * MIB)
    torch.cuda.synchronize()
    assert buf.release_retired() > 0                 # the device is done: their memory goes back to the driver
    assert 3 * MIB <= buf.mapped <= 3 * MIB + buf.max_handle
    assert torch.equal(rows[:3 * per_mib], data[:3 * per_mib]) and buf.peak_mapped >= 30 * MIB
    with pytest.raises(ValueError, match="exceed"):
        buf.resize(buf.capacity + 1)
    del rows
    buf.close()
    assert buf.ptr is None


@pytest.mark.gpu
def test_gpu_a_growth_maps_handles_of_at_most_the_size_it_is_given():
    buf = vmm.GrowableBuffer(1 << 30, "cuda", max_handle=4 * MIB)
    buf.resize(20 * MIB)
    first = len(buf._handles)
    buf.resize(84 * MIB, max_handle=32 * MIB)   # the arena's way: a class's handle size changes as it fills
    sizes = [h.size for h in buf._handles]
    assert max(sizes[:first]) <= 4 * MIB and sizes[first:] == vmm.handle_sizes(buf._handles[first].offset, 84 * MIB,
                                                                                buf.step, 32 * MIB)
    assert max(sizes[first:]) == 32 * MIB and buf.max_handle == 4 * MIB   # told for one growth, not kept
    buf.resize(90 * MIB)
    assert max(h.size for h in buf._handles[len(sizes):]) <= 4 * MIB
    buf.close()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gpu_growable_kv_cache_follows_the_torch_one_through_resizes(dtype):
    gen = torch.Generator().manual_seed(3)
    kv = KVCache(3, 40, 16, 4, 64, dtype, "cuda", scratch=True)
    ref = KVCache(3, 40, 16, 4, 64, dtype, "cpu", scratch=True)
    assert kv.buffers and kv.graph_epoch == 0
    addresses = [t.data_ptr() for t in kv.k + kv.v]
    ptrs = kv.ptrs.cpu().tolist()
    for _ in range(25):
        n = int(torch.randint(1, 300, (1,), generator=gen))
        kv.resize(n)
        ref.resize(n)
        for got, want in zip(kv.k + kv.v, ref.k + ref.v):
            assert got.shape == want.shape and torch.equal(got.cpu(), want)
            fresh = torch.randn(want.shape, generator=gen).to(dtype)
            want.copy_(fresh)
            got.copy_(fresh)
    assert [t.data_ptr() for t in kv.k + kv.v] == addresses and kv.ptrs.cpu().tolist() == ptrs   # never moved
    assert kv.generation == 25 and kv.mapped_bytes >= kv.nbytes


@pytest.mark.gpu
def test_gpu_kv_resizes_leave_the_allocator_alone_and_map_about_the_cache():
    torch.cuda.synchronize()
    reserved = torch.cuda.memory_reserved()
    kv = KVCache(8, 1024, 16, 8, 128, torch.bfloat16, "cuda", scratch=True)   # 512 MiB
    gen = torch.Generator().manual_seed(0)
    for _ in range(40):
        kv.resize(int(torch.randint(700, 1400, (1,), generator=gen)))
    kv.resize(900)
    torch.cuda.synchronize()
    kv.resize(900 - 1)   # any resize first unmaps what earlier shrinks retired and the device is done with
    assert torch.cuda.memory_reserved() == reserved
    slack = 2 * kv.num_layers * 2 * kv.buffers[0].max_handle   # a straddling handle and one just retired, a buffer
    assert kv.nbytes <= kv.mapped_bytes <= kv.nbytes + slack
    assert kv.peak_mapped_bytes >= 1400 * KVCache.bytes_per_block(8, 16, 8, 128, torch.bfloat16)


@pytest.mark.gpu
def test_gpu_a_growth_the_device_cannot_back_leaves_the_cache_as_it_was(monkeypatch):
    kv = KVCache(3, 40, 16, 4, 64, torch.bfloat16, "cuda", scratch=True)
    for t in kv.k + kv.v:
        t.normal_()
    before = [t.clone() for t in kv.k + kv.v]
    ends = [b.size for b in kv.buffers]
    real_map = vmm.GrowableBuffer._map
    calls = []

    def fifth_fails(self, offset, size):   # the device runs out partway through the layers' buffers
        calls.append(offset)
        if len(calls) == 5:
            raise vmm.VmmOutOfMemory("cuMemCreate failed: CUDA driver error 2 (out of memory)")
        real_map(self, offset, size)

    monkeypatch.setattr(vmm.GrowableBuffer, "_map", fifth_fails)
    with pytest.raises(MemoryError):
        kv.resize(4000)
    assert kv.num_blocks == 40 and kv.generation == 0 and len(calls) == 5
    assert [b.size for b in kv.buffers] == ends   # the buffers that grew were taken back
    assert all(torch.equal(t, b) for t, b in zip(kv.k + kv.v, before))
    monkeypatch.setattr(vmm.GrowableBuffer, "_map", real_map)
    kv.resize(4000)   # and it grows once the device has the memory
    assert kv.num_blocks == 4000 and all(torch.equal(t[:40], b[:40]) for t, b in zip(kv.k + kv.v, before))


def test_the_mapped_kv_cache_zeroes_what_it_adds_keeps_the_rest_and_rolls_a_failed_growth_back(monkeypatch):
    class Props:
        total_memory = 1 << 22
    monkeypatch.setattr("pwruntime.kv_cache.GrowableBuffer", HostBuffer)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: Props)
    monkeypatch.setattr(HostBuffer, "growths_left", None)
    kv = KVCache(2, 10, 4, 2, 8, torch.float16, "cpu", scratch=True, growable=True)
    assert len(kv.buffers) == 4 and kv.k[0].shape == (11, 4, 2, 8) and bool((kv.k[0] == 0).all())
    base = [t.data_ptr() for t in kv.k + kv.v]
    for t in kv.k + kv.v:
        t.normal_()
    kept = [t[:10].clone() for t in kv.k + kv.v]
    kv.resize(30)
    assert [t.data_ptr() for t in kv.k + kv.v] == base and kv.k[1].shape == (31, 4, 2, 8)
    assert all(torch.equal(t[:10], k) and bool((t[10:] == 0).all()) for t, k in zip(kv.k + kv.v, kept))
    assert kv.mapped_bytes == 31 * sum(kv._row_bytes) == kv.nbytes and kv.generation == 1
    kv.resize(6)
    assert kv.v[0].shape == (7, 4, 2, 8) and all(torch.equal(t[:6], k[:6]) for t, k in zip(kv.k + kv.v, kept))
    assert kv.peak_mapped_bytes == 31 * sum(kv._row_bytes)
    monkeypatch.setattr(HostBuffer, "growths_left", 2)   # layer 0's K and V grow, layer 1's K cannot
    with pytest.raises(MemoryError):
        kv.resize(50)
    assert kv.num_blocks == 6 and kv.generation == 2 and kv.k[0].shape == (7, 4, 2, 8)
    assert [b.size for b in kv.buffers] == [7 * kv._row_bytes[0]] * 4   # the buffers that grew were taken back
    assert all(torch.equal(t[:6], k[:6]) for t, k in zip(kv.k + kv.v, kept))


def test_a_mapped_kv_cache_of_two_layer_geometries_sizes_each_buffer_by_its_own_rows(monkeypatch):
    """Gemma 4's layers differ in KV heads and head size: each layer's buffers hold rows of its shape, a block's bytes
    are their sum, and a failed growth takes every buffer back to its own old size."""
    class Props:
        total_memory = 1 << 22
    monkeypatch.setattr("pwruntime.kv_cache.GrowableBuffer", HostBuffer)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: Props)
    monkeypatch.setattr(HostBuffer, "growths_left", None)
    shapes = ((2, 8), (1, 32), (2, 8))
    kv = KVCache(3, 10, 4, 2, 8, torch.float16, "cpu", growable=True, layer_shapes=shapes)
    assert [tuple(t.shape[2:]) for t in kv.k] == list(shapes) == [tuple(t.shape[2:]) for t in kv.v]
    per_block = KVCache.bytes_per_block(3, 4, 2, 8, torch.float16, shapes)
    assert per_block == 2 * 4 * 2 * (16 + 32 + 16) and kv.nbytes == kv.mapped_bytes == 10 * per_block
    assert sum(b.capacity for b in kv.buffers) >= Props.total_memory   # each reserved for the whole device
    for t in kv.k + kv.v:
        t.normal_()
    kept = [t.clone() for t in kv.k + kv.v]
    monkeypatch.setattr(HostBuffer, "growths_left", 3)
    with pytest.raises(MemoryError):
        kv.resize(40)
    assert [b.size for b in kv.buffers] == [10 * 4 * h * d * 2 for h, d in shapes for _ in "kv"]
    monkeypatch.setattr(HostBuffer, "growths_left", None)
    kv.resize(40)
    assert kv.nbytes == 40 * per_block and all(torch.equal(t[:10], k) for t, k in zip(kv.k + kv.v, kept))


def test_a_mapped_hybrid_kv_cache_maps_a_buffer_for_each_place_that_its_groups_share(monkeypatch):
    """Hybrid KV groups (two groups of two layers: sliding 8-token blocks of 2 x 8, global 4-token ones of 1 x 32):
    K and V buffers for each of the two places, the layers at one place viewing the same mapped memory at their
    group's block size, and a resize keeping every page whichever group wrote it."""
    from policies.kv_groups import KVLayout

    class Props:
        total_memory = 1 << 22
    monkeypatch.setattr("pwruntime.kv_cache.GrowableBuffer", HostBuffer)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: Props)
    monkeypatch.setattr(HostBuffer, "growths_left", None)
    shapes = ((2, 8), (2, 8), (1, 32), (1, 32))
    layout = KVLayout.build([2 * h * d * 2 for h, d in shapes], [8, 8, None, None], 4)
    assert [(g.layers, g.block_size) for g in layout.groups] == [((0, 1), 8), ((2, 3), 4)]
    kv = KVCache(4, 10, 4, 2, 8, torch.float16, "cpu", scratch=True, growable=True, layer_shapes=shapes,
                 layout=layout)
    assert len(kv.buffers) == 4 and kv.nbytes == kv.mapped_bytes == 11 * layout.page_bytes
    assert kv.k[0].shape == (11, 8, 2, 8) and kv.k[2].shape == (11, 4, 1, 32)
    assert kv.k[0].data_ptr() == kv.k[2].data_ptr() != kv.k[1].data_ptr() == kv.k[3].data_ptr()
    kv.k[0][:5].normal_()   # pages 0-4 as the sliding group holds them, 5-9 as the global one
    kv.v[3][5:10].normal_()
    kept_k, kept_v = kv.k[0][:10].clone(), kv.v[3][:10].clone()
    kv.resize(30)
    assert kv.k[2].shape == (31, 4, 1, 32) and kv.mapped_bytes == 31 * layout.page_bytes
    assert torch.equal(kv.k[0][:10], kept_k) and torch.equal(kv.v[3][:10], kept_v) and not kv.v[1][10:].any()


class _FakeDriver:
    """The driver calls GrowableBuffer makes, over bookkeeping instead of a GPU: what is mapped where, which handles
    live, what was granted access; the next `oom` cuMemCreate calls answer out of memory, and with `creates_left`
    set every call after that many does."""
    GRANULE = 2 * MIB

    def __init__(self):
        self.maps, self.handles, self.granted, self.calls, self.oom, self.freed = {}, {}, [], [], 0, []
        self.creates_left: int | None = None

    def cuMemGetAllocationGranularity(self, out, prop, flags):
        out._obj.value = self.GRANULE
        return 0

    def cuMemAddressReserve(self, base, size, align, addr, flags):
        base._obj.value = 1 << 40
        return 0

    def cuMemAddressFree(self, ptr, size):
        self.freed.append((ptr, size))
        return 0

    def cuMemCreate(self, handle, size, prop, flags):
        self.calls.append("create")
        if self.oom or self.creates_left == 0:
            self.oom = max(0, self.oom - 1)
            return 2
        if self.creates_left is not None:
            self.creates_left -= 1
        handle._obj.value = len(self.calls)
        self.handles[handle._obj.value] = size
        return 0

    def cuMemMap(self, ptr, size, offset, handle, flags):
        assert self.handles[handle] == size and offset == 0
        self.maps[ptr] = (size, handle)
        return 0

    def cuMemSetAccess(self, ptr, size, desc, count):
        covered = sorted(p for p in self.maps if ptr <= p < ptr + size)
        assert sum(self.maps[p][0] for p in covered) == size   # only mapped memory gets access
        self.granted.append((ptr, size))
        return 0

    def cuMemUnmap(self, ptr, size):
        assert self.maps.pop(ptr)[0] == size
        return 0

    def cuMemRelease(self, handle):
        del self.handles[handle]
        return 0

    def cuGetErrorString(self, result, text):
        text._obj.value = b"out of memory" if result == 2 else b"error"
        return 0


class _FakeEvent:
    def __init__(self):
        self.recorded, self.done = False, False

    def record(self, stream):
        self.recorded = True

    def query(self) -> bool:
        return self.done or not self.recorded


@pytest.fixture
def fake_driver(monkeypatch):
    driver = _FakeDriver()
    monkeypatch.setattr(vmm, "_driver", lambda: driver)
    for name, fn in (("init", lambda: None), ("current_device", lambda: 0), ("current_stream", lambda device: None),
                     ("synchronize", lambda device=None: None), ("empty_cache", lambda: driver.calls.append("empty")),
                     ("is_current_stream_capturing", lambda: False), ("Event", _FakeEvent)):
        monkeypatch.setattr(torch.cuda, name, fn)
    return driver


def test_buffer_maps_retires_takes_back_and_unmaps_its_handles_in_order(fake_driver):
    buf = vmm.GrowableBuffer(1 << 30, "cuda:0", max_handle=4 * MIB)
    base = buf.ptr
    assert buf.mapped == 2 * MIB and fake_driver.granted == [(base, 2 * MIB)]
    buf.resize(11 * MIB)                                   # 2 + 4 + 4 + 2 MiB, granted access in one call
    assert buf.mapped == 12 * MIB and fake_driver.granted[-1] == (base + 2 * MIB, 10 * MIB)
    buf.resize(5 * MIB)                                    # keeps 6 MiB: the handles at 6 and 10 MiB retire
    retiring = buf._handles[buf._active].retiring
    assert buf.size == 6 * MIB and buf.mapped == 12 * MIB and buf.release_retired() == 0
    creates = fake_driver.calls.count("create")
    buf.resize(9 * MIB)                                    # the 6 MiB handle comes back: no driver call
    assert fake_driver.calls.count("create") == creates and buf.size == 10 * MIB
    retiring.done = True                                   # the device passed the shrink: the top one goes
    assert buf.release_retired() == 2 * MIB and buf.mapped == 10 * MIB and base + 10 * MIB not in fake_driver.maps
    assert buf.peak_mapped == 12 * MIB
    fake_driver.oom = 1                                    # torch's cache given back once, then it fits
    buf.resize(14 * MIB)
    assert fake_driver.calls[-3:] == ["create", "empty", "create"] and buf.mapped == 14 * MIB
    fake_driver.creates_left = 1                           # out of memory for good, partway: what got mapped is usable
    with pytest.raises(vmm.VmmOutOfMemory, match="cuMemCreate failed: CUDA driver error 2"):
        buf.resize(30 * MIB)
    assert fake_driver.granted[-1] == (base + 14 * MIB, 4 * MIB) and buf.mapped == 18 * MIB
    calls = buf.calls   # every handle made and mapped, every grant, every handle unmapped so far, and their time
    failed_creates = 3   # the one out of memory once, and the last growth's two tries
    assert calls.mapped == len(fake_driver.maps) + 1 == fake_driver.calls.count("create") - failed_creates
    assert calls.grants == len(fake_driver.granted) and calls.unmapped == 1
    assert calls.map_seconds > 0 and calls.unmap_seconds > 0
    assert (calls + calls).as_dict() == {"handles_mapped": 2 * calls.mapped, "access_grants": 2 * calls.grants,
                                         "map_ms": round(2e3 * calls.map_seconds, 3), "handles_unmapped": 2,
                                         "unmap_ms": round(2e3 * calls.unmap_seconds, 3)}
    buf.close()
    assert buf.calls.unmapped == calls.mapped and buf.calls.mapped == calls.mapped
    assert fake_driver.maps == {} and fake_driver.handles == {} and fake_driver.freed == [(base, buf.capacity)]
    assert buf.ptr is None


def test_a_kv_cache_gives_back_what_its_shrinks_retired_once_the_device_is_done(monkeypatch):
    """`KVCache.release_retired` waits for the device, then has each growable buffer unmap what its shrinks retired,
    and returns their bytes together; a cache of torch tensors has none, and neither waits nor touches CUDA."""
    class Props:
        total_memory = 1 << 22
    events = []

    class Retiring(HostBuffer):
        def release_retired(self) -> int:
            events.append("released")
            return self.step
    monkeypatch.setattr("pwruntime.kv_cache.GrowableBuffer", Retiring)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: Props)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: events.append("synchronized"))
    monkeypatch.setattr(HostBuffer, "growths_left", None)
    kv = KVCache(2, 10, 4, 2, 8, torch.float16, "cpu", scratch=True, growable=True)
    kv.resize(0)
    events.clear()
    assert kv.release_retired() == 4 * HostBuffer.step and events == ["synchronized"] + ["released"] * 4
    events.clear()
    assert KVCache(2, 10, 4, 2, 8, torch.float16, "cpu").release_retired() == 0 and events == []
