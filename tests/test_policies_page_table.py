"""Property tests of the page-table protocol: legal sequences keep the invariants, illegal ones raise."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies import PageTable, PageTableError, PlaneState
from policies.apformat import ap_block_bytes, lut_bytes, plane_bytes
from policies.planners.base import in_flight_split

OPS = ("begin_offload", "finish_offload", "begin_reload", "finish_reload")


def make_table() -> PageTable:
    return PageTable(layers=2, experts=3, hidden=48, intermediate=40, bits=(3, 4, 5, 6, 7, 8))


def snapshot(t: PageTable) -> tuple:
    return tuple(a.copy().tobytes() for a in (t.q, t.d, t.planes, t.target))


def expected_in_flight(t: PageTable) -> tuple[int, int]:
    """Independent recomputation of (what offloads in flight hold, what reloads in flight hold) beyond M[i, q]: their
    planes in flight and the extra LUT (an offload's old one, a reload's new one)."""
    offloads = reloads = 0
    for i in range(t.num_blocks):
        out_f, in_f = (int(x) for x in t.shapes[i])
        q = int(t.q[i])
        moving = int(np.isin(t.planes[i], (PlaneState.TO_GPU, PlaneState.TO_CPU)).sum()) * plane_bytes(out_f, in_f)
        if t.target[i] > q:  # reload: the new LUT is being copied in
            reloads += moving + lut_bytes(out_f, int(t.target[i]))
        elif t.target[i] >= 0:  # offload: the old LUT is still held
            old = q + int((t.planes[i] == PlaneState.TO_CPU).sum())
            offloads += moving + lut_bytes(out_f, old)
    return offloads, reloads


def expected_resident(t: PageTable) -> int:
    """Independent recomputation: committed bytes + bytes of planes in flight + the extra LUT held."""
    committed = sum(ap_block_bytes(*(int(x) for x in t.shapes[i]), int(t.q[i])) for i in range(t.num_blocks))
    return committed + sum(expected_in_flight(t))


def check_invariants(t: PageTable) -> None:
    t.check_invariants()
    lead = t.leading_gpu_planes()
    assert (t.q <= lead).all(), "q exceeds the leading GPU-resident planes"
    assert t.resident_bytes() == expected_resident(t)
    assert in_flight_split(t) == expected_in_flight(t)


op_strategy = st.lists(
    st.tuples(st.sampled_from(OPS), st.integers(0, 11), st.integers(0, 9)), min_size=1, max_size=60
)


@settings(max_examples=300, deadline=None)
@given(op_strategy)
def test_random_operation_sequences_keep_invariants(ops):
    t = make_table()
    check_invariants(t)
    for name, block, bits in ops:
        before = snapshot(t)
        q_before = int(t.q[block])
        args = (block,) if name.startswith("finish") else (block, bits)
        try:
            getattr(t, name)(*args)
        except PageTableError:
            assert snapshot(t) == before, f"illegal {name}{args} changed the table"
            continue
        check_invariants(t)
        if name == "begin_offload":
            # offload lowers q first, before any plane is released
            assert t.q[block] == bits < q_before
            assert (t.planes[block, bits:q_before] == PlaneState.TO_CPU).all()
        if name == "begin_reload":
            # reload does not raise q until planes are resident
            assert t.q[block] == q_before
            assert (t.planes[block, q_before:bits] == PlaneState.TO_GPU).all()
        if name == "finish_reload":
            assert (t.planes[block, : t.q[block]] == PlaneState.GPU).all()


def test_offload_then_reload_round_trip_restores_bytes():
    t = make_table()
    full = t.resident_bytes()
    freed = t.begin_offload(0, 3)
    assert freed == t.M[0, 8] - t.M[0, 3]
    t.finish_offload(0)
    assert t.resident_bytes() == full - freed
    copied = t.begin_reload(0, 8)
    assert copied == 5 * plane_bytes(*t.shapes[0]) + lut_bytes(int(t.shapes[0, 0]), 8)
    assert t.q[0] == 3
    t.finish_reload(0)
    assert t.q[0] == 8 and t.resident_bytes() == full


@pytest.mark.parametrize("call", [
    lambda t: t.begin_offload(0, 8),          # not lower
    lambda t: t.begin_offload(0, 2),          # unsupported bitwidth
    lambda t: t.begin_reload(0, 8),           # already at 8
    lambda t: t.finish_offload(0),            # nothing in flight
    lambda t: t.finish_reload(0),
    lambda t: t.begin_offload(99, 4),         # out of range
    lambda t: t.begin_offload(t.num_blocks, 4),  # one past the last block
])
def test_illegal_calls_raise_and_change_nothing(call):
    t = make_table()
    before = snapshot(t)
    with pytest.raises(PageTableError):
        call(t)
    assert snapshot(t) == before


def test_second_transfer_on_busy_block_is_refused():
    t = make_table()
    t.begin_offload(1, 5)
    with pytest.raises(PageTableError, match="in flight"):
        t.begin_reload(1, 6)
    with pytest.raises(PageTableError, match="in flight"):
        t.begin_offload(1, 3)


def test_invariant_checker_catches_a_corrupted_table():
    """The checker the property test relies on must fail on a broken table."""
    t = make_table()
    t.planes[0, 2] = PlaneState.CPU  # a hole under q
    with pytest.raises(PageTableError, match="exceeds leading GPU planes"):
        t.check_invariants()
    t = make_table()
    t.begin_offload(0, 4)
    t.finish_offload(0)
    t.planes[0, 5] = PlaneState.GPU  # a stray GPU plane above q
    with pytest.raises(PageTableError, match="above q"):
        t.check_invariants()


def test_block_layout_and_shapes():
    t = PageTable(layers=3, experts=4, hidden=64, intermediate=32)
    i = t.index(2, 1, 1)
    assert t.block_id(i).layer == 2 and t.block_id(i).expert == 1 and t.block_id(i).kind == 1
    assert tuple(t.shapes[t.index(0, 0, 0)]) == (64, 64)  # gate_up [2I, H]
    assert tuple(t.shapes[t.index(0, 0, 1)]) == (64, 32)  # down [H, I]
    assert str(t.block_id(i)) == "L2.E1.down"


def test_initialize_validates_bits():
    t = make_table()
    with pytest.raises(PageTableError, match="not in"):
        t.initialize(2)
    t.initialize(np.array([3, 4] * 6))
    assert t.mean_bits() == 3.5
    check_invariants(t)


def test_desired_bits_follow_initialize_and_each_transfer():
    """d: the bits the planner last moved a block to; set by initialize and at begin (a reload's q lags behind it)."""
    t = make_table()
    t.initialize(4)
    assert (t.d == 4).all() and (t.q == 4).all()
    t.begin_reload(0, 6)
    assert (t.q[0], t.d[0]) == (4, 6)
    t.finish_reload(0)
    assert (t.q[0], t.d[0]) == (6, 6)
    t.begin_offload(1, 3)
    assert (t.q[1], t.d[1]) == (3, 3)
    t.finish_offload(1)
    t.initialize(5)
    assert (t.d == 5).all()


def test_committing_in_place_back_to_all_resident_planes_frees_the_block_for_page_moves():
    """A block whose in-place q is back at its leading GPU planes holds nothing above q: it may offload again."""
    t = make_table()
    t.commit_in_place(0, 5)
    assert t.held[0]
    t.commit_in_place(0, 8)
    assert not t.held[0]
    t.begin_offload(0, 4)
    t.finish_offload(0)
    check_invariants(t)


def test_a_busy_block_refuses_an_in_place_commit():
    t = make_table()
    t.begin_offload(0, 4)
    before = snapshot(t)
    with pytest.raises(PageTableError, match="in flight"):
        t.commit_in_place(0, 3)
    assert snapshot(t) == before


@pytest.mark.parametrize("layers, experts", [(0, 3), (2, 0)])
def test_a_table_needs_a_layer_and_an_expert(layers, experts):
    with pytest.raises(ValueError, match="at least one layer and one expert"):
        PageTable(layers=layers, experts=experts, hidden=48, intermediate=40)


def test_a_block_offloading_to_0_bits_is_busy_until_it_lands():
    """Target 0 (an expert leaving the GPU whole) is a transfer in flight like any other."""
    t = make_table()
    t.begin_offload(2, 0)
    for call in (lambda: t.begin_reload(2, 4), lambda: t.begin_offload(2, 0), lambda: t.commit_in_place(2, 3)):
        with pytest.raises(PageTableError, match="in flight"):
            call()
    t.finish_offload(2)
    assert t.q[2] == 0 and not t.busy[2] and (t.planes[2] == PlaneState.CPU).all()
    t.begin_reload(2, 3)
    check_invariants(t)


def test_initialize_takes_0_bits_for_an_absent_block_and_refuses_negative_bits():
    t = make_table()
    t.initialize(np.array([0, 8] * 6))
    assert t.q.tolist() == [0, 8] * 6 and (t.planes[0] == PlaneState.CPU).all()
    check_invariants(t)
    with pytest.raises(PageTableError, match="initial bits -1"):
        t.initialize(-1)


@pytest.mark.parametrize("bits, ok", [((1, 8), True), ((0, 8), False), ((3, 9), False), ((), False)])
def test_supported_bitwidths_lie_in_1_to_8(bits, ok):
    if ok:
        assert PageTable(1, 1, hidden=48, intermediate=40, bits=bits).bits == bits
    else:
        with pytest.raises(ValueError, match="must lie in 1..8"):
            PageTable(1, 1, hidden=48, intermediate=40, bits=bits)
