"""pwruntime.plane_arena: tensors in the lowest free slot of their size's class, freed when they die, moved down into
the holes below them so that the classes' tails go back to the driver. CPU tests run it over host memory
(tests/vmm_fakes.py); the `gpu` one over mapped device memory."""
from __future__ import annotations

import gc

import pytest
import torch

from pwruntime import plane_arena
from pwruntime.copy_batch import CopyBatch
from pwruntime.plane_arena import ArenaFull, PlaneArena
from vmm_fakes import HostBuffer

PLANE, LUT = 2048, 1024   # bytes: an int32 [16, 32] "plane" and an fp16 [64, 8] "LUT"


@pytest.fixture
def host_arena(monkeypatch):
    monkeypatch.setattr(plane_arena, "GrowableBuffer", HostBuffer)
    monkeypatch.setattr(HostBuffer, "growths_left", None)
    return lambda sizes: PlaneArena("cpu", sizes)


def plane(arena: PlaneArena, fill: int) -> torch.Tensor:
    t = arena.empty((16, 32), torch.int32)
    t.fill_(fill)
    return t


def slot(arena: PlaneArena, t: torch.Tensor) -> int:
    cls = arena._classes[t.nbytes]
    return (t.data_ptr() - cls.buffer.ptr) // cls.size


def test_tensors_take_the_lowest_free_slot_of_their_class_and_free_it_when_they_die(host_arena):
    arena = host_arena({PLANE: 10, LUT: 4})
    a, b, c = (plane(arena, v) for v in (1, 2, 3))
    lut = arena.empty((64, 8), torch.float16)
    assert [slot(arena, t) for t in (a, b, c, lut)] == [0, 1, 2, 0]
    assert arena._classes[PLANE].buffer is not arena._classes[LUT].buffer
    view = b.view(-1)      # a view keeps the slot: it frees when the last tensor over it dies
    del b
    gc.collect()
    assert arena.holes() == 0
    del view
    assert arena.holes() == 1
    d = plane(arena, 4)
    assert slot(arena, d) == 1   # freed at once, and taken again first
    del c
    assert arena.used == 2 * PLANE + LUT and arena.holes() == 0       # a freed top slot is no hole
    with pytest.raises(ValueError, match="no class for tensors of 12 bytes"):
        arena.empty((3,), torch.int32)
    full = [plane(arena, 0) for _ in range(8)]
    with pytest.raises(ArenaFull, match="2048-byte class is full"):
        plane(arena, 0)
    assert len(full) == 8 and torch.equal(a, torch.full((16, 32), 1, dtype=torch.int32)) and d is not None


@pytest.mark.parametrize("freed", [[1], [3, 2]], ids=["a-hole-below", "the-slots-above"])
def test_a_slot_freed_while_another_is_allocated_leaves_the_books_straight(host_arena, monkeypatch, freed):
    """The garbage collector can drop a tensor inside an allocation: the slot being handed out is claimed first, so
    freeing others then neither drops it from the class nor gives it to anyone else."""
    arena = host_arena({PLANE: 16})
    ts = [plane(arena, v) for v in range(4)]
    ts[1] = None if freed == [3, 2] else ts[1]   # the allocation below takes hole 1 (or the slot past the top)
    real = plane_arena.wrap

    def collecting(*args, **kw):
        for v in freed:
            ts[v] = None
        return real(*args, **kw)

    monkeypatch.setattr(plane_arena, "wrap", collecting)
    new = arena.empty((16, 32), torch.int32)
    monkeypatch.setattr(plane_arena, "wrap", real)
    cls = arena._classes[PLANE]
    want = 1 if freed == [3, 2] else 4
    assert slot(arena, new) == want and cls.tokens[want] and cls.tensors[want]() is new
    alive = [slot(arena, t) for t in ts if t is not None] + [want]
    assert cls.live == len(alive) and cls.top == max(alive) + 1
    others = [plane(arena, 9) for _ in range(cls.top - cls.live)]   # the holes, then past the top: no slot twice
    assert len({slot(arena, t) for t in others} | set(alive)) == len(others) + len(alive)


def test_pack_moves_top_tensors_into_the_holes_below_keeping_content_and_telling_the_owner(host_arena):
    arena = host_arena({PLANE: 64})
    ts = [plane(arena, v) for v in range(10)]
    owner = {t.data_ptr(): v for v, t in enumerate(ts)}
    pinned = ts[8].data_ptr()   # say a copy is writing this one: it may not move
    for v in (1, 3, 4, 5):      # 8 KiB of holes: over the class's slack (one 4 KiB step here)
        ts[v] = None
    moved = []

    def relocate(old, new):
        v = owner.pop(old.data_ptr())
        owner[new.data_ptr()] = v
        ts[v] = new
        moved.append(v)

    batch = CopyBatch(torch.device("cpu"))
    assert arena.pack(lambda t: t.data_ptr() != pinned, relocate, batch) == 1
    assert moved == [9] and slot(arena, ts[9]) == 1   # 9 went to the lowest hole; 8 stopped the packing
    batch.issue()
    assert torch.equal(ts[9], torch.full((16, 32), 9, dtype=torch.int32))
    assert arena.holes() == 3 and arena._classes[PLANE].top == 9
    assert arena.pack(lambda t: True, relocate, batch) == 3 and batch._srcs
    batch.issue()
    assert moved == [9, 8, 7, 6] and arena.holes() == 0 and arena._classes[PLANE].top == 6 and arena.moves == 4
    assert sorted(slot(arena, t) for t in ts if t is not None) == list(range(6))
    assert all(torch.equal(t, torch.full((16, 32), v, dtype=torch.int32)) for v, t in enumerate(ts) if t is not None)
    late = plane(arena, 42)   # the moved-from slot is taken again; the old tensor's late death must not free it
    assert slot(arena, late) == 6 and arena.holes() == 0
    ts[2] = None                # a hole within the slack stays for the next allocation: no move
    assert arena.pack(lambda t: True, relocate, batch) == 0 and arena.holes() == 1
    assert slot(arena, plane(arena, 2)) == 2 and arena.moves == 4


def test_a_moved_tensor_that_dies_late_leaves_its_old_slot_to_whoever_took_it_since(host_arena):
    arena = host_arena({PLANE: 64})
    ts = [plane(arena, v) for v in range(4)]
    ts[0] = ts[1] = ts[2] = None   # three holes below slot 3: over the slack, so pack moves 3 down
    late_view = []

    def relocate(old, new):
        late_view.append(old.view(-1))   # a view of the moved-from tensor outlives the move
        ts[3] = new

    batch = CopyBatch(torch.device("cpu"))
    assert arena.pack(lambda t: True, relocate, batch) == 1 and slot(arena, ts[3]) == 0
    batch.issue()
    taken = [plane(arena, 10 + v) for v in range(3)]   # slots 1, 2 and the moved-from 3
    assert [slot(arena, t) for t in taken] == [1, 2, 3]
    late_view.clear()   # the old tensor dies now: slot 3 is not its any more
    assert arena.holes() == 0 and slot(arena, plane(arena, 99)) == 4
    assert torch.equal(taken[2], torch.full((16, 32), 12, dtype=torch.int32))


def test_a_class_keeps_a_64th_of_its_bytes_in_holes_without_moving_anything(host_arena):
    arena = host_arena({PLANE: 400})
    ts = [plane(arena, v) for v in range(300)]
    cls = arena._classes[PLANE]
    for v in (10, 20, 30):   # 6 KiB of holes: over one 4 KiB step, within a 64th of the 600 KiB the class holds
        ts[v] = None
    assert cls.slack == cls.live * PLANE // 64 > 3 * PLANE
    assert arena.pack(lambda t: True, lambda old, new: None, CopyBatch(torch.device("cpu"))) == 0
    assert arena.holes() == 3


def test_trim_gives_the_free_tail_back_beyond_the_slack(host_arena):
    arena = host_arena({PLANE: 256})
    cls = arena._classes[PLANE]
    buf = cls.buffer
    ts = [plane(arena, v) for v in range(40)]   # 80 KiB: the buffer grows its slack ahead of its top
    assert cls.slack == buf.step and 40 * PLANE <= buf.size <= 40 * PLANE + cls.slack and arena.mapped == buf.size
    peak = buf.size
    del ts[2:]
    assert arena.used == 2 * PLANE
    arena.trim()
    assert buf.size == 2 * PLANE + cls.slack and buf.peak_mapped == peak
    ts.append(plane(arena, 7))
    arena.trim()   # a tail within twice the slack stays: no resize back and forth at the edge
    assert buf.size == 2 * PLANE + cls.slack


def test_a_buffer_grows_its_slack_ahead_and_keeps_a_tail_up_to_twice_the_slack(host_arena):
    """Growth maps the class's slack beyond the slot it needs (not a driver call every slot or two), and a trim lets
    go only a tail over twice the slack, so a class at the edge is not resized back and forth."""
    arena = host_arena({PLANE: 256})
    cls = arena._classes[PLANE]
    buf = cls.buffer
    ts = [plane(arena, v) for v in range(40)]
    assert buf.calls.grants <= 40 * PLANE // (buf.step + PLANE) + 1
    del ts[4:]
    arena.trim()
    assert buf.size == 4 * PLANE + cls.slack
    del ts[3]   # a tail of the slack and one slot: within twice the slack
    arena.trim()
    assert buf.size == 4 * PLANE + cls.slack


def test_a_large_class_grows_in_a_few_handles_of_at_most_half_its_slack(host_arena):
    """The driver charges by the handle, so a growth maps the slack ahead in two or three handles, not one a step,
    and none over half the slack, so that a trim gives back nearly all it lets go."""
    arena = host_arena({PLANE: 8192})
    cls = arena._classes[PLANE]
    buf = cls.buffer
    ts = [plane(arena, v) for v in range(6000)]   # 12 MiB: a slack of 188 KiB, 47 steps of the fake's 4 KiB
    assert cls.slack == 6000 * PLANE // 64 and cls.handle_bytes == cls.slack // 2
    assert buf.calls.mapped <= 3 * buf.calls.grants and buf.calls.mapped < buf.size // buf.step // 3
    assert buf.largest_handle <= cls.slack // 2
    del ts[3000:]
    arena.trim()
    assert buf.size == 3000 * PLANE + cls.slack


def test_holes_of_exactly_the_slack_stay_where_they_are(host_arena):
    arena = host_arena({PLANE: 64})
    ts = [plane(arena, v) for v in range(6)]
    ts[1] = ts[2] = None   # 4 KiB: the class's slack (one step)
    assert arena._classes[PLANE].slack == 2 * PLANE
    assert arena.pack(lambda t: True, lambda old, new: None, CopyBatch(torch.device("cpu"))) == 0
    assert arena.holes() == 2


def test_slots_of_a_size_off_the_alignment_are_rounded_up_and_never_overlap(host_arena):
    arena = host_arena({1000: 8})   # e.g. a [500] fp16 LUT: slots of 1024 bytes
    a, b = arena.empty((500,), torch.float16).fill_(1), arena.empty((500,), torch.float16).fill_(2)
    assert b.data_ptr() - a.data_ptr() == 1024   # the next 256-byte boundary (SLOT_ALIGN)
    assert bool((a == 1).all()) and bool((b == 2).all())


def _check_books(arena: PlaneArena, live: dict, pinned_sizes: set[int]) -> None:
    """The invariants of the random churn test (a function, so that no tensor outlives the check in a local)."""
    spans = sorted((t.data_ptr(), t.data_ptr() + t.nbytes) for t, _ in live.values())
    assert all(a_end <= b for (_, a_end), (b, _) in zip(spans, spans[1:]))   # no overlap
    for t, v in live.values():
        assert bool((t == (v if t.dtype == torch.int32 else v % 1000)).all())
    for nbytes, cls in arena._classes.items():
        slots = [slot(arena, t) for t, _ in live.values() if t.nbytes == nbytes]
        assert cls.live == len(slots) and cls.top == 1 + max(slots, default=-1)
        if nbytes not in pinned_sizes:   # nothing stopped its packing
            assert (cls.top - cls.live) * cls.size <= cls.slack
        assert cls.buffer.size <= cls.top * cls.size + 2 * cls.slack + cls.size


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_allocations_frees_packs_and_trims_keep_every_tensor_whole_and_the_books_straight(host_arena, seed):
    """Seeded random churn over two classes, as plans make it: tensors allocated and dropped, some pinned (a copy in
    flight: they may not move), a pack and a trim at every 'flush'. No two live tensors share a byte, every tensor
    keeps its content through the moves, each class counts exactly its live slots and keeps its holes within its
    slack after a pack that nothing pinned stopped, and the buffers map no more than the tops plus twice the slack."""
    gen = torch.Generator().manual_seed(seed)
    arena = host_arena({PLANE: 400, LUT: 400})
    live: dict[int, tuple[torch.Tensor, int]] = {}   # key -> (tensor, value it holds)
    pinned: set[int] = set()
    owner: dict[int, int] = {}   # data_ptr -> key

    def relocate(old, new):
        key = owner.pop(old.data_ptr())
        owner[new.data_ptr()] = key
        live[key] = (new, live[key][1])

    key = 0
    for flush in range(60):
        for _ in range(int(torch.randint(1, 12, (1,), generator=gen))):
            if live and bool(torch.rand((), generator=gen) < 0.45):   # drop one
                k = list(live)[int(torch.randint(len(live), (1,), generator=gen))]
                owner.pop(live.pop(k)[0].data_ptr())
                pinned.discard(k)
            else:                                                    # allocate a plane or a LUT, filled
                key += 1   # (no local names the tensor: dropping it from `live` must free its slot)
                if bool(torch.rand((), generator=gen) < 0.5):
                    live[key] = (arena.empty((16, 32), torch.int32).fill_(key), key)
                else:
                    live[key] = (arena.empty((64, 8), torch.float16).fill_(key % 1000), key)
                owner[live[key][0].data_ptr()] = key
                if bool(torch.rand((), generator=gen) < 0.1):
                    pinned.add(key)
        pinned_ptrs = {live[k][0].data_ptr() for k in pinned}
        batch = CopyBatch(torch.device("cpu"))
        arena.pack(lambda t: t.data_ptr() not in pinned_ptrs, relocate, batch)
        batch.issue()
        arena.trim()
        _check_books(arena, live, {live[k][0].nbytes for k in pinned})
        pinned = {k for k in pinned if bool(torch.rand((), generator=gen) < 0.5)}   # copies land
    assert arena.moves > 0


@pytest.mark.gpu
def test_gpu_arena_maps_slots_moves_them_and_unmaps_what_trim_lets_go():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    size = 256 << 10   # an OLMoE down plane: eight to a 2 MiB handle
    arena = PlaneArena("cuda", {size: 1024})
    ts = [arena.empty((2048, 32), torch.int32) for _ in range(64)]   # 16 MiB
    for v in range(64):
        ts[v].fill_(v)
    mapped = arena.mapped
    assert mapped >= 16 << 20
    keep = {v: ts[v] for v in range(0, 64, 8)}   # one in eight survives: no handle is free without moving them
    del ts
    owner = {t.data_ptr(): v for v, t in keep.items()}

    def relocate(old, new):
        v = owner.pop(old.data_ptr())
        owner[new.data_ptr()] = v
        keep[v] = new

    batch = CopyBatch(torch.device("cuda"))
    assert arena.pack(lambda t: True, relocate, batch) == 7   # eight tensors end in slots 0..7
    batch.issue()
    arena.trim()
    torch.cuda.synchronize()
    arena.trim()   # the device passed the first trim: its handles are unmapped now
    assert arena.mapped <= 2 * (2 << 20) + (2 << 20) and arena.mapped < mapped
    assert all(bool((t == v).all()) for v, t in keep.items())
    assert sorted(slot(arena, t) for t in keep.values()) == list(range(8))
