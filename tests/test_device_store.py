"""DeviceExpertStore + CudaPageMover: rows follow the page table, planes really leave and come back.

CPU tests run the whole logic with CPU tensors (marks complete at once; a gate holds transfers in
flight where a test needs to look at them). Tests marked `gpu` repeat the checks on CUDA (fp16, the
fused kernel, a copy stream, `torch.cuda.memory_allocated`) and skip cleanly without a GPU.
"""
from __future__ import annotations

import gc
import json
import time
import weakref
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import pytest
import torch

from policies.contract import Observation, Transition
from policies.loop import PlanLoop
from policies.page_table import PageTable
from policies.planners.base import make_plan
from pwruntime import device_store, page_mover, plane_arena
from pwruntime.copy_batch import CopyBatch
from pwruntime.device_store import DeviceExpertStore
from pwruntime.prefill_layer import grouped_mm_prefill, prefill_group_limits, prefill_syncs
from pwruntime.engine import EngineConfig, LLMEngine
from pwruntime.kernels.device_table import device_layout
from pwruntime.kernels.moe import MoEShape, moe_plans
from pwruntime.page_mover import CudaPageMover
from pwruntime.quant.build import QuantizeOptions, quantize_checkpoint
from pwruntime.quant.store import APExpertStore, load_ap_model
from pwruntime.sampling import SamplingParams
from pwruntime.stream_marks import DeferredFree, Mark
from model_fixtures import make_tiny_checkpoint
from vmm_fakes import HostBuffer

CALIBRATION = Path(__file__).resolve().parents[1] / "traces" / "bundled" / "demo-calibration"
CUDA = torch.cuda.is_available()


@dataclass
class Scripted:
    """A planner that moves given blocks at given steps: {step: [(block, to_bits), ...]}."""
    moves: dict = field(default_factory=dict)
    initial_bits: int = 6
    in_place: bool = False
    name: str = "scripted"

    def reset(self, table, calibration) -> None:
        table.initialize(self.initial_bits)

    def plan_step(self, table, observation):
        m = [(b, t) for b, t in self.moves.get(observation.step, []) if not table.busy[b]]
        return make_plan(table, [b for b, _ in m], [t for _, t in m], 0.0, "scripted", self.in_place) if m else None


class Gate:
    """A stand-in CUDA event: transfers stay in flight until the test opens it."""
    is_open = False

    def query(self) -> bool:
        return self.is_open

    def elapsed_time(self, other) -> float:
        return 0.0


def gated(monkeypatch) -> Gate:
    gate = Gate()
    monkeypatch.setattr(page_mover, "mark", lambda device, stream=None, timing=False: Mark(gate, time.perf_counter()))
    return gate


def observation(step: int) -> Observation:
    return Observation(step=step, time_s=0.0, free_blocks=0, total_blocks=1, kv_block_bytes=1, free_block_threshold=0)


def stores(path: Path, bits, device: str = "cpu", dtype: torch.dtype = torch.float32, arena: bool = False,
           activation: str = "silu"):
    """(reference APExpertStore, PageTable both follow, DeviceExpertStore), their experts' gate `activation`."""
    ref, ap = APExpertStore.from_checkpoint(path), APExpertStore.from_checkpoint(path)
    ref.activation = ap.activation = activation
    table = PageTable(len(ref.layers), ref.experts, ref.hidden, ref.intermediate, bits=ref.bits, initial_bits=bits)
    ref.attach_table(table)
    dev = DeviceExpertStore.from_ap_store(ap, device=device, dtype=dtype, table=table, arena=arena)
    return ref, table, dev


@pytest.fixture
def host_arena(monkeypatch):
    """Stores built with `arena=True` off CUDA keep their planes in a PlaneArena over host memory."""
    monkeypatch.setattr(plane_arena, "GrowableBuffer", HostBuffer)
    monkeypatch.setattr(HostBuffer, "growths_left", None)


def assert_arena_dense(store: DeviceExpertStore, mover: CudaPageMover) -> None:
    """After an iteration boundary, the arena's slots in use are exactly what rows, transfers in flight and deferred
    frees name, and no class keeps more bytes in holes below its top than its slack."""
    arena = store.arena
    named = [t for i in range(store.num_blocks) for t in store.resident(i)[0] + store.resident(i)[1:] if t is not None]
    assert all((c.top - c.live) * c.size <= c.slack for c in arena._classes.values()) or mover.num_pending
    in_slots = sum(slot_bytes(t.nbytes) for t in named)
    assert arena.live >= in_slots and (arena.live == in_slots or mover.num_pending or store.deferred.nbytes)


def assert_rows_follow(store: DeviceExpertStore, table: PageTable) -> None:
    """Every idle row is at the table's bits and names exactly planes 0..q-1 (the leading planes if held)
    and LUT_q, bit-identical to the master in the device layout (top three planes packed); the device
    table agrees."""
    lead = table.leading_gpu_planes()
    for i in np.flatnonzero(~table.busy).tolist():
        q = int(table.q[i])
        planes, lut = store.resident(i)
        assert store.row_bits[i] == q and store.table.bits(i) == q
        assert len(planes) == (int(lead[i]) if table.held[i] else q)
        want = device_layout(store.master_planes(i, 0, len(planes))) if planes else []
        for p, w in zip(planes, want, strict=True):
            assert p.device == store.device and torch.equal(p.cpu(), w)
        if q:
            assert torch.equal(lut.cpu(), store.master_lut(i, q))
        else:
            assert lut is None and store.table.resident(i) is None


def routing(store, tokens: int, seed: int = 0, device: str = "cpu"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, store.hidden, generator=g)
    ids = torch.stack([torch.randperm(store.experts, generator=g)[:2] for _ in range(tokens)])
    w = torch.softmax(torch.randn(tokens, 2, generator=g), dim=-1)
    return x.to(device), ids.to(device), w.to(device)


def moe_pair(ref, dev, layer: int, tokens: int, dtype=torch.float32, device: str = "cpu", seed: int = 0):
    """(device store output, reference output, device down norms, reference down norms)."""
    x, ids, w = routing(dev, tokens, seed, device)
    n_dev = torch.empty(ids.shape, dtype=torch.float32, device=device)
    out = dev.moe(layer, x.to(dtype), ids, w, down_in_norm=n_dev)
    n_ref = torch.empty(ids.shape, dtype=torch.float32)
    want = ref.moe(layer, x.cpu(), ids.cpu(), w.cpu(), down_in_norm=n_ref)
    return out.float().cpu(), want, n_dev.cpu(), n_ref


def assert_same_moe(out: torch.Tensor, want: torch.Tensor) -> None:
    """Equal up to fp32 rounding: padded_moe batches the GEMMs the reference runs one expert at a time (a block
    at other bits than the reference's moves outputs by orders of magnitude more)."""
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


def blocks_of(dev: DeviceExpertStore, i: int) -> list:
    planes, lut = dev.resident(i)
    return [weakref.ref(t) for t in planes] + ([weakref.ref(lut)] if lut is not None else [])


def alive(refs) -> int:
    gc.collect()
    return sum(r() is not None for r in refs)


# ---------------------------------------------------------------------------------------------- CPU
def test_rows_hold_exactly_the_committed_planes(ap_path):
    rng = np.random.default_rng(0)
    ref = APExpertStore.from_checkpoint(ap_path)
    bits = rng.choice(ref.bits, size=ref.num_blocks)
    _, table, dev = stores(ap_path, bits)
    assert_rows_follow(dev, table)
    assert dev.resident_bytes() == table.resident_bytes() == table.committed_bytes()
    assert dev.master[0]["gate_up"].planes.dtype == torch.int32  # words travel as int32


def test_moe_and_weights_equal_the_ap_store(ap_path):
    rng = np.random.default_rng(1)
    ref, table, dev = stores(ap_path, rng.choice((3, 4, 5, 6, 7, 8), size=32))
    for layer in range(2):
        for e in range(8):
            for kind in ("gate_up", "down"):
                assert torch.equal(dev.weight(layer, e, kind), ref.weight(layer, e, kind))
        for tokens in (1, 5, 64, 65, 130):  # padded_moe (down norms asked on CPU, or prefill)
            out, want, n_dev, n_ref = moe_pair(ref, dev, layer, tokens, seed=tokens)
            assert_same_moe(out, want)
            assert_same_moe(n_dev, n_ref)
        for tokens in (7, 100):  # the fused kernel's pure-torch fallback, in two launch sets at 100 tokens
            x, ids, w = routing(dev, tokens, seed=layer)
            torch.testing.assert_close(dev.moe(layer, x, ids, w), ref.moe(layer, x, ids, w), rtol=1e-4, atol=1e-4)


def test_gelu_experts_equal_the_ap_store_s_and_differ_from_silu_ones(ap_path):
    """Gemma 4's experts (tanh GELU): the fused path's reference and the prefill path both take the store's
    activation, and the kernel build says so (PW_GELU, the gate_up launch only)."""
    bits = np.random.default_rng(3).choice((3, 4, 5, 6, 7, 8), size=32)
    ref, _, dev = stores(ap_path, bits, activation="gelu_tanh")
    silu_ref, _, _ = stores(ap_path, bits)
    assert dev.activation == "gelu_tanh" and dev.moe_shape(2).activation == "gelu_tanh"
    for tokens in (7, 130):   # the fused kernel's fallback, and prefill (padded_moe)
        x, ids, w = routing(dev, tokens, seed=tokens)
        want = ref.moe(1, x, ids, w)
        torch.testing.assert_close(dev.moe(1, x, ids, w), want, rtol=1e-4, atol=1e-4)
        assert float((silu_ref.moe(1, x, ids, w) - want).norm() / want.norm()) > 0.01   # far above the 1e-4
    p1, p2 = moe_plans(dev.moe_shape(2), 1)
    assert ("PW_GELU", 1) in p1.defines and ("PW_GELU", 1) not in p2.defines
    assert all(("PW_GELU", 1) not in p.defines for p in moe_plans(replace(dev.moe_shape(2), activation="silu"), 1))


def test_a_captured_moe_takes_tokens_up_to_what_its_rereads_allow(ap_path, monkeypatch):
    """Off CUDA the prefill path reads counts back, so a captured MoE of many tokens would run the fused launches,
    each reading the experts it routes to again: the store allows as many tokens as keep those re-reads under
    CAPTURE_REREAD_BYTES, and never fewer than the fused path's own FUSED_MAX_TOKENS."""
    _, _, dev = stores(ap_path, 5)
    launch = min(dev.experts, 64 * 2) * 3 * dev.hidden * dev.intermediate   # bytes at 8 bits, top-2
    assert dev.captured_tokens_limit(torch.float16, 2) > 2048                   # tiny experts: re-reads cost little
    monkeypatch.setattr(device_store, "CAPTURE_REREAD_BYTES", 2 * launch)
    assert dev.captured_tokens_limit(torch.float16, 2) == 3 * 64               # two launches' re-reads
    monkeypatch.setattr(device_store, "CAPTURE_REREAD_BYTES", launch - 1)
    assert dev.captured_tokens_limit(torch.float16, 2) == device_store.FUSED_MAX_TOKENS == 128


def test_deferred_frees_keep_tensors_until_their_mark_is_done():
    gate = Gate()
    deferred = DeferredFree(torch.device("cpu"))
    t = torch.zeros(16)
    deferred.add([t], Mark(gate, 0.0))   # a queued kernel may still read t
    deferred.add([])
    assert deferred.nbytes == t.nbytes and deferred.collect() == 0 and deferred.nbytes == t.nbytes
    gate.is_open = True
    assert deferred.collect() == t.nbytes and deferred.nbytes == 0


def test_prefill_with_a_chunk_smaller_than_one_expert_dequantizes_one_expert_at_a_time(ap_path):
    ref, _, dev = stores(ap_path, 5)
    dev.prefill_chunk_bytes = 1   # less than one expert's weights: still one expert a group
    out, want, n_dev, n_ref = moe_pair(ref, dev, 1, 130)
    assert_same_moe(out, want)
    assert_same_moe(n_dev, n_ref)


def test_a_launch_s_rereads_count_the_experts_its_tokens_top_k_can_reach(ap_path, monkeypatch):
    """A launch of MAX_TOKENS tokens routes to at most MAX_TOKENS * top_k experts (here 2 tokens of top-2: 4 of the 8),
    and that is what each of its re-reads costs."""
    _, _, dev = stores(ap_path, 5)
    monkeypatch.setattr(device_store, "MAX_TOKENS", 2)
    launch = 4 * 3 * dev.hidden * dev.intermediate   # bytes at 8 bits
    monkeypatch.setattr(device_store, "CAPTURE_REREAD_BYTES", 100 * launch)
    assert dev.captured_tokens_limit(torch.float16, 2) == 2 * (1 + 100)


def test_a_workspace_serves_every_token_count_of_its_bucket(ap_path):
    """One MoE workspace per bucket of 1, 2, 4, ... 64 tokens, reused by every count up to the bucket's."""
    _, _, dev = stores(ap_path, 5)
    ws = {t: dev.workspace(t, torch.float16, 2) for t in (1, 2, 3, 4, 5, 33, 64)}
    assert [ws[t].tokens for t in (1, 2, 3, 5, 64)] == [1, 2, 4, 8, 64]
    assert ws[3] is ws[4] and ws[5] is not ws[4] and ws[33] is ws[64] and ws[64].act.shape[0] == 64 * 2


def test_offload_lands_after_the_mark_and_frees_its_planes(ap_path, monkeypatch):
    ref, table, dev = stores(ap_path, 6)
    gate = gated(monkeypatch)
    mover = CudaPageMover(dev)
    moves = {0: [(0, 3), (5, 4), (9, 3)]}
    loop = PlanLoop(Scripted(moves), table, mover)
    surplus = {i: blocks_of(dev, i)[b:] for i, b in moves[0]}  # planes b..5 and LUT_6
    res = loop.step(observation(0))
    assert len(res.started) == 3 and res.committed == ()
    # committed at once: the device rows already read the lower bits, the surplus is still alive
    assert [int(dev.row_bits[i]) for i, _ in moves[0]] == [3, 4, 3] and table.busy[[0, 5, 9]].all()
    assert all(alive(r) == len(r) for r in surplus.values())
    assert mover.device_bytes() == table.resident_bytes()
    out, want, _, _ = moe_pair(ref, dev, 0, 80)
    assert_same_moe(out, want)
    assert loop.step(observation(1)).committed == ()  # the compute stream has not passed the mark
    gate.is_open = True
    res = loop.step(observation(2))
    assert sorted(res.committed) == [0, 5, 9] and not table.busy.any()
    assert all(alive(r) == 0 for r in surplus.values())  # surplus planes and old LUTs are gone
    assert mover.device_bytes() == dev.resident_bytes() == table.resident_bytes()
    assert mover.stats.offloads == 3 and mover.stats.bytes_freed == res.released_bytes
    assert_rows_follow(dev, table)
    table.check_invariants()


def test_a_boundarys_row_writes_reach_the_device_together_and_marks_follow_them(ap_path, monkeypatch):
    _, table, dev = stores(ap_path, 8)
    marks = []
    monkeypatch.setattr(page_mover, "mark", lambda device, stream=None, timing=False: marks.append(
        (stream, dev.table.dirty)) or Mark(None, time.perf_counter()))
    mover = CudaPageMover(dev)
    rows = dev.table.table.clone()
    for i in (3, 12, 20):
        table.begin_offload(i, 4)
        mover.start(Transition(i, 8, 4, 0), 0)
    assert dev.table.dirty and torch.equal(dev.table.table, rows)  # kernels still read 8 bits
    assert [int(dev.table.host[i, 9]) for i in (3, 12, 20)] == [4, 4, 4] and marks == []
    assert sorted(mover.landed()) == [3, 12, 20]
    assert marks == [(None, False)]  # one mark for the three offloads, recorded after their rows went out
    assert not dev.table.dirty and torch.equal(dev.table.table, torch.from_numpy(dev.table.host))
    for i, to in ((3, 7), (12, 5), (20, 8)):
        table.finish_offload(i)
        table.begin_reload(i, to)
        mover.start(Transition(i, 4, to, 0), 0)
    assert len(mover._batch) == 0 and mover.num_pending == 3  # queued: staged at the boundary, in one batch
    assert sorted(mover.landed()) == [3, 12, 20]
    assert not dev.table.dirty and [int(dev.table.table[i, 9]) for i in (3, 12, 20)] == [7, 5, 8]
    assert len(marks) == 3  # the three reloads' copies share one batch between two marks
    stats = mover.stats  # the batch's time counted once, split by the reloads' bytes
    assert stats.reloads == 3 and stats.reload_seconds == pytest.approx(stats.reload_seconds_max)


def test_reload_commits_only_when_landed_and_restores_the_planes(ap_path, monkeypatch):
    ref, table, dev = stores(ap_path, 6)
    gate = gated(monkeypatch)
    gate.is_open = True
    mover = CudaPageMover(dev)
    loop = PlanLoop(Scripted({0: [(0, 3), (7, 3)], 1: [(0, 8), (7, 5)]}), table, mover)
    loop.step(observation(0))
    before = {i: [weakref.ref(t) for t in dev.resident(i)[0]] for i in (0, 7)}
    old_luts = [weakref.ref(dev.resident(i)[1]) for i in (0, 7)]
    gate.is_open = False
    res = loop.step(observation(1))
    reserved = res.reserved_bytes
    assert res.committed == () and [int(table.q[i]) for i in (0, 7)] == [3, 3]
    assert [int(dev.row_bits[i]) for i in (0, 7)] == [3, 3]  # kernels keep reading 3 bits while planes copy
    assert mover.device_bytes() == table.resident_bytes() and mover.inflight_bytes() > 0
    out, want, _, _ = moe_pair(ref, dev, 0, 70)
    assert_same_moe(out, want)
    gate.is_open = True
    res = loop.step(observation(2))
    assert sorted(res.committed) == [0, 7] and [int(table.q[i]) for i in (0, 7)] == [8, 5]
    assert_rows_follow(dev, table)  # planes 3.. are fresh copies, bit-identical to the master
    assert all(dev.resident(i)[0][j] is before[i][j]() for i in (0, 7) for j in range(3))  # 0..2 never moved
    assert alive(old_luts) == 0 and dev.deferred.nbytes == 0
    assert mover.device_bytes() == dev.resident_bytes() == table.resident_bytes()
    assert mover.stats.reloads == 2 and mover.stats.bytes_reloaded == reserved  # planes + LUT, as the loop counts
    out, want, _, _ = moe_pair(ref, dev, 0, 70)
    assert_same_moe(out, want)


def test_in_place_commits_and_initialize_reach_the_device(ap_path):
    ref, table, dev = stores(ap_path, 8)
    mover = CudaPageMover(dev)
    loop = PlanLoop(Scripted({0: [(i, 4) for i in range(16)]}, in_place=True), table, mover)
    loop.step(observation(0))  # in place: the loop commits without the mover; landed() syncs the rows
    assert table.held[:16].all() and (dev.row_bits[:16] == 4).all() and (dev.row_planes[:16] == 8).all()
    assert_rows_follow(dev, table)
    out, want, _, _ = moe_pair(ref, dev, 0, 9)
    assert_same_moe(out, want)
    table.initialize(5)  # a policy's reset: the next moe() (or boundary) follows, held planes above 5 go
    out, want, _, _ = moe_pair(ref, dev, 1, 9)
    assert_same_moe(out, want)
    assert_rows_follow(dev, table)
    assert dev.resident_bytes() == table.resident_bytes()


def test_a_reset_to_the_bits_a_row_already_reads_drops_the_planes_an_in_place_commit_held(ap_path):
    _, table, dev = stores(ap_path, 8)
    mover = CudaPageMover(dev)
    loop = PlanLoop(Scripted({0: [(i, 4) for i in range(4)]}, in_place=True), table, mover)
    loop.step(observation(0))
    assert (dev.row_bits[:4] == 4).all() and (dev.row_planes[:4] == 8).all()
    table.initialize(4)   # nothing held any more: planes 4..7 of blocks 0..3 go at the next boundary
    loop.step(observation(1))
    assert_rows_follow(dev, table)
    assert dev.resident_bytes() == table.resident_bytes()


def test_a_transition_begun_before_a_reset_reached_the_rows_moves_from_the_committed_bits(ap_path, monkeypatch):
    """A policy's reset reaches the rows at the next boundary; an offload begun before that starts from the bits the
    table committed, so what is in flight and what it frees are the bytes the loop accounts for."""
    _, table, dev = stores(ap_path, 8)
    gate = gated(monkeypatch)
    mover = CudaPageMover(dev)
    loop = PlanLoop(Scripted({1: [(4, 3)]}, initial_bits=8), table, mover)
    loop.step(observation(0))
    table.initialize(6)  # no boundary since: row 4 still names 8 planes and LUT_8
    res = loop.step(observation(1))
    assert res.started and res.committed == ()
    assert mover.device_bytes() == table.resident_bytes()
    gate.is_open = True
    res = loop.step(observation(2))
    assert res.committed == (4,) and mover.stats.bytes_freed == res.released_bytes
    assert_rows_follow(dev, table)


def test_the_mover_s_metrics_count_every_host_to_device_byte(ap_path):
    """page_bytes_moved_total: the LUTs offloads upload plus the planes and LUTs reloads copy."""
    _, table, dev = stores(ap_path, 6)
    mover = CudaPageMover(dev)
    loop = PlanLoop(Scripted({0: [(0, 3)], 1: [(0, 5)]}), table, mover)
    loop.step(observation(0))
    loop.step(observation(1))
    lut3, lut5 = dev.master_lut(0, 3).nbytes, dev.master_lut(0, 5).nbytes
    planes = sum(p.nbytes for p in dev.resident(0)[0][3:5])
    m = mover.metrics()
    assert m["page_offloads_total"] == m["page_reloads_total"] == 1
    assert m["page_bytes_lut_uploaded_total"] == lut3 and m["page_bytes_reloaded_total"] == planes + lut5
    assert m["page_bytes_moved_total"] == lut3 + planes + lut5


def test_a_page_table_of_another_size_is_refused(ap_path):
    _, table, dev = stores(ap_path, 6)
    for layers in (dev.num_layers - 1, dev.num_layers + 1):   # fewer or more blocks than the store's
        other = PageTable(layers, dev.experts, dev.hidden, dev.intermediate, bits=dev.bits)
        with pytest.raises(ValueError, match="page table has"):
            dev.attach_table(other)


def test_offload_to_zero_bits_and_back(ap_path):
    _, table, dev = stores(ap_path, 5)
    mover = CudaPageMover(dev)
    loop = PlanLoop(Scripted({0: [(2, 0), (3, 0)], 1: [(2, 4)]}), table, mover)
    loop.step(observation(0))
    assert dev.table.resident(2) is None and dev.row_nbytes[2] == 0
    assert not dev.weight(0, 1, "gate_up").any()  # block 2 = L0.E1.gate_up: not resident reads as zeros
    loop.step(observation(1))
    assert table.q[2] == 4 and table.q[3] == 0
    assert_rows_follow(dev, table)
    assert mover.device_bytes() == table.resident_bytes()


@pytest.mark.parametrize("partly", [False, True], ids=["at-once", "after-some-planes"])
def test_failed_reload_stays_low_and_is_retried(ap_path, monkeypatch, partly):
    _, table, dev = stores(ap_path, 4)
    mover = CudaPageMover(dev)
    real = dev.stage_planes
    calls, issued = [], []

    def flaky(*a, **kw):
        calls.append(a)
        if len(calls) == 1:
            if partly:  # some of its planes were allocated and added to the batch before the allocation failed
                real(*a, **kw)
            raise torch.cuda.OutOfMemoryError("no room")
        return real(*a, **kw)

    issue = CopyBatch.issue
    monkeypatch.setattr(CopyBatch, "issue", lambda self: (issued.append(len(self)), issue(self))[1])
    monkeypatch.setattr(dev, "stage_planes", flaky)
    loop = PlanLoop(Scripted({0: [(1, 7)]}), table, mover)
    res = loop.step(observation(0))  # the allocation fails: nothing crashes, the block keeps 4 bits
    assert res.started and res.committed == () and table.q[1] == 4 and dev.row_bits[1] == 4
    assert mover.stats.failed_reloads == 1 and mover.num_pending == 1
    # the failed reload's copies were dropped before the batch went out: its tensors are freed unwritten
    assert issued and all(n == 0 for n in issued)
    res = loop.step(observation(1))  # retried at the next boundary
    assert res.committed == (1,) and table.q[1] == 7 and mover.num_pending == 0
    assert_rows_follow(dev, table)


def _engine(path: Path, policy, device_store: bool, device: str = "cpu", dtype: str = "fp32", calibration=None,
            arena: bool = False, **config):
    model, ap = load_ap_model(path, dtype=dtype, device=device, expert_device="cpu" if device_store else None)
    c = model.config
    table = PageTable(c.num_moe_layers, c.experts, c.hidden, c.expert_intermediate, bits=ap.bits)
    mover = None
    if device_store:
        store = DeviceExpertStore.from_ap_store(ap, device=model.device, dtype=model.dtype, table=table, arena=arena)
        model.experts, mover = store, CudaPageMover(store)
    else:
        ap.attach_table(table)
    return LLMEngine(model, EngineConfig(**config), policy=policy, table=table, calibration=calibration, mover=mover)


SCRIPT = {2: [(0, 3), (3, 4), (6, 3), (17, 5), (30, 3)], 4: [(1, 3), (12, 4), (25, 3)],
          7: [(0, 8), (17, 7), (30, 5)], 9: [(3, 6), (1, 4)], 11: [(8, 3), (9, 3)]}
PROMPTS = [[5, 9, 14, 3, 22, 7], [40, 41, 3, 8], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]]


def run_engine(engine, max_tokens: int = 16):
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    outs = engine.generate(PROMPTS, params)
    assert all(o.finish_reason == "length" and len(o.token_ids) == max_tokens for o in outs)  # nothing lost
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("observe,asynchronous", [(True, False), (False, False), (True, True)],
                         ids=["grouped", "fused-fallback", "async"])
def test_engine_outputs_equal_the_ap_store_while_pages_move(ap_path, observe, asynchronous):
    """The device store under the mover decodes the pure-torch AP store's tokens; with asynchronous scheduling too
    (both engines plan while their next batch is launched, so the same steps see the same bits)."""
    want_engine = _engine(ap_path, Scripted(dict(SCRIPT)), False, block_size=4, observe_routing=observe,
                          async_scheduling=asynchronous)
    want = run_engine(want_engine)
    engine = _engine(ap_path, Scripted(dict(SCRIPT)), True, block_size=4, observe_routing=observe,
                     async_scheduling=asynchronous)
    assert run_engine(engine) == want
    mover, table = engine.loop.mover, engine.table
    assert mover.num_pending == 0 and not table.busy.any()
    assert np.array_equal(table.q, want_engine.table.q) and engine.pool.capacity == want_engine.pool.capacity
    assert_rows_follow(engine.model.experts, table)
    assert mover.device_bytes() == table.resident_bytes()
    assert mover.stats.offloads == 10 and mover.stats.reloads == 5


def test_engine_with_a_plane_arena_decodes_the_same_and_keeps_it_dense(ap_path, host_arena):
    """Planes and LUTs in a PlaneArena: the same tokens as the AP store while pages move (asynchronous scheduling),
    the arena packed after every step, and what offloads freed given back."""
    want = run_engine(_engine(ap_path, Scripted(dict(SCRIPT)), False, block_size=4, async_scheduling=True))
    engine = _engine(ap_path, Scripted(dict(SCRIPT)), True, arena=True, block_size=4, async_scheduling=True)
    store, mover = engine.model.experts, engine.loop.mover
    peak = store.arena.used
    for prompt in PROMPTS:
        engine.add_request(prompt, SamplingParams(max_tokens=16, ignore_eos=True))
    outs = {}
    while engine.has_unfinished():
        outs.update((o.request_id, o.token_ids) for o in engine.step())
        assert_arena_dense(store, mover)
    assert [outs[k] for k in sorted(outs)] == want
    assert store.arena.moves > 0 and store.arena.used < peak   # the scripted plan ends lower than it starts
    assert mover.metrics()["page_arena_moves_total"] == store.arena.moves
    calls = store.arena.driver_calls   # what the arena's buffers mapped and gave back, as the engine reports it
    assert calls.mapped > calls.unmapped > 0 and engine.capacity.mapped_memory().weights_calls == calls
    assert_rows_follow(store, engine.table)


def test_engine_times_the_parts_of_its_plan_phase(ap_path):
    """`last_plan_costs`: the page mover's host time (it runs at every boundary, longer where transitions begin or
    land), the KV cache's resizes exactly on the steps where a plan's reloads shrink the pool or landed offloads grow
    it, each part inside the plan phase."""
    engine = _engine(ap_path, Scripted(dict(SCRIPT)), True, block_size=4)
    for prompt in PROMPTS:
        engine.add_request(prompt, SamplingParams(max_tokens=16, ignore_eos=True))
    costs, moved, resized = [], [], []
    while engine.has_unfinished():
        capacity, moves = engine.pool.capacity, engine.loop.mover.stats.offloads + engine.loop.mover.stats.reloads
        engine.step()
        c = engine.last_plan_costs
        costs.append(c)
        moved.append(bool(engine.last_loop.started) or engine.loop.mover.stats.offloads
                     + engine.loop.mover.stats.reloads > moves)
        resized.append(engine.pool.capacity != capacity)
        assert c.read_s == 0.0  # a scripted planner reads no routing
        assert 0 <= c.moves_s + c.kv_s <= engine.last_phases.plan_s
    assert any(moved) and all(c.moves_s > 0 for c in costs)
    assert any(resized) and all(c.kv_s > 0 for c, r in zip(costs, resized) if r)
    assert all(c.kv_s == 0 for c, r in zip(costs, resized) if not r)


@pytest.fixture(scope="module")
def demo_ap(tmp_path_factory) -> Path:
    from pwruntime.cmd_perplexity import default_model_dir

    out = tmp_path_factory.mktemp("demo") / "demo_ap"
    quantize_checkpoint(default_model_dir(), out, QuantizeOptions(weighting="none"), progress=False)
    return out


@pytest.mark.parametrize("arena", [False, True], ids=["torch-tensors", "plane-arena"])
def test_pagedweight_under_kv_pressure_matches_the_ap_store(ap_path, host_arena, arena):
    import policies
    from policies.synthetic import synthetic_calibration

    cal = synthetic_calibration((2, 8, 128, 64), initial_mean_bits=6)
    runs = []
    for on_device in (False, True):
        engine = _engine(ap_path, policies.get("pagedweight"), on_device, calibration=cal, num_kv_blocks=6,
                         block_size=4, arena=arena)
        runs.append((engine, run_engine(engine)))
    (ref, want), (engine, got) = runs
    assert got == want and engine.loop.num_plans == ref.loop.num_plans > 0
    assert np.array_equal(engine.table.q, ref.table.q) and engine.pool.capacity == ref.pool.capacity > 6
    mover = engine.loop.mover
    assert mover.stats.offloads > 0 and mover.device_bytes() == engine.table.resident_bytes()
    assert_rows_follow(engine.model.experts, engine.table)


def test_a_plane_arena_holds_twice_the_planes_and_four_luts_a_block_while_frees_wait_for_the_device(
        ap_path, host_arena, monkeypatch):
    """A policy's resets reach the rows at once (`sync`), and what the rows stop naming waits for the device: every
    block lowered to 3 bits and raised back to 8 (13 planes a block alive), then to 7 and back twice (15 planes, four
    LUT_8: three retired and the row's), fits the arena; once the device passes the marks the held ones go."""
    from pwruntime import stream_marks
    _, table, dev = stores(ap_path, 8, arena=True)
    gate = Gate()
    monkeypatch.setattr(stream_marks, "mark", lambda device, stream=None, timing=False: Mark(gate, time.perf_counter()))
    for bits in (3, 8, 7, 8, 7, 8):
        table.initialize(bits)
        dev.sync()
        assert (dev.row_bits == bits).all()
    assert_rows_follow(dev, table)
    held = [t for _, ts in dev.deferred._held for t in ts]
    assert len(held) == dev.num_blocks * (5 + 2 + 6)   # planes 3..7, plane 7 twice, and LUT 8, 3, 8, 7, 8, 7
    assert dev.arena.live == sum(slot_bytes(t.nbytes) for i in range(dev.num_blocks)
                                 for t in dev.resident(i)[0] + dev.resident(i)[1:]) + sum(slot_bytes(t.nbytes)
                                                                                         for t in held)
    gate.is_open = True
    del held
    dev.sync()
    assert dev.deferred.nbytes == 0
    assert dev.arena.live == sum(slot_bytes(t.nbytes) for i in range(dev.num_blocks)
                                 for t in dev.resident(i)[0] + dev.resident(i)[1:])

# ---------------------------------------------------------------------------------------------- GPU
def rounded(nbytes: int) -> int:
    """What the caching allocator charges for a tensor of `nbytes` (512-byte granules)."""
    return -(-nbytes // 512) * 512


def slot_bytes(nbytes: int) -> int:
    """What a plane arena's slot for a tensor of `nbytes` takes."""
    return -(-nbytes // plane_arena.SLOT_ALIGN) * plane_arena.SLOT_ALIGN


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_gpu_moe_matches_the_ap_store(ap_path, dtype, activation):
    rng = np.random.default_rng(2)
    ref, table, dev = stores(ap_path, rng.choice((3, 4, 5, 6, 7, 8), size=32), device="cuda", dtype=dtype,
                             activation=activation)
    assert dev.master[0]["down"].planes.is_pinned()
    for layer in range(2):
        for e in range(8):
            for kind in ("gate_up", "down"):
                want = ref.weight(layer, e, kind).to(dtype).float()
                assert torch.equal(dev.weight(layer, e, kind).float().cpu(), want)
        for tokens in (1, 3, 8, 64, 100, 200):  # fused kernel (two launch sets at 100 tokens), then dequantize + GEMM
            out, want, n_dev, n_ref = moe_pair(ref, dev, layer, tokens, dtype, "cuda", seed=tokens)
            tol = 2e-2 if dtype == torch.bfloat16 else 5e-3
            assert float((out - want).norm() / want.norm()) < tol
            assert float((n_dev - n_ref).norm() / n_ref.norm()) < tol
    assert {k[0] for k in dev._workspaces} <= {1, 4, 8, 64}  # one workspace per token bucket
    # the 200-token prefill above took torch's grouped GEMM in bf16 (on Hopper) and the padded batches in fp16
    x = torch.zeros(200, dev.hidden, device="cuda", dtype=dtype)
    hopper = torch.cuda.get_device_capability() >= (9, 0)
    assert grouped_mm_prefill(x, dev.moe_shape(2)) == (dtype == torch.bfloat16 and hopper)


def test_prefill_takes_the_grouped_gemm_only_in_bf16_on_cuda():
    shape = MoEShape(8, 128, 64, 2)
    assert not grouped_mm_prefill(torch.zeros(100, 128, dtype=torch.bfloat16), shape)  # CPU: padded batches
    assert not grouped_mm_prefill(torch.zeros(100, 128), shape)


@pytest.mark.gpu
def test_gpu_prefill_takes_the_grouped_gemm_for_small_experts_in_bf16():
    x = torch.zeros(100, 4096, dtype=torch.bfloat16, device="cuda")
    hopper = torch.cuda.get_device_capability() >= (9, 0)
    assert grouped_mm_prefill(x, MoEShape(64, 4096, 1024, 8)) == hopper
    assert not grouped_mm_prefill(x, MoEShape(8, 4096, 14336, 2))  # Mixtral's experts: padded batches
    assert not grouped_mm_prefill(x.half(), MoEShape(64, 4096, 1024, 8))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                    reason="needs a GPU of compute capability 9.0 or newer (the grouped GEMM)")
@pytest.mark.parametrize("chunk_experts", [8, 3])
def test_gpu_a_bf16_prefill_in_chunks_of_experts_reads_nothing_back(ap_path, chunk_experts):
    """The grouped GEMM's prefill takes the layer's experts a chunk at a time without reading their row counts back:
    it is captured in a CUDA graph (a read-back raises there), and its replay, on other tokens, gives the eager
    result, which is the reference's."""
    ref, _, dev = stores(ap_path, 5, device="cuda", dtype=torch.bfloat16)
    dev.prefill_chunk_bytes = chunk_experts * 3 * dev.hidden * dev.intermediate * 2
    assert prefill_group_limits(dev.moe_shape(2), 2, dev.prefill_chunk_bytes)[0] == chunk_experts
    assert not prefill_syncs(dev.moe_shape(2), torch.zeros(1, dev.hidden, dtype=torch.bfloat16, device="cuda"))
    tokens = 200
    x, ids, w = routing(dev, tokens, 1, "cuda")
    x = x.bfloat16()
    norms = torch.zeros(tokens, 2, device="cuda")
    dev.moe(1, x, ids, w, norms)   # warm-up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = dev.moe(1, x, ids, w, norms)
    x2, ids2, w2 = routing(dev, tokens, 2, "cuda")
    x.copy_(x2.bfloat16())
    ids.copy_(ids2)
    w.copy_(w2)
    graph.replay()
    want_norms = torch.zeros_like(norms)
    want = dev.moe(1, x, ids, w, want_norms)
    rel = lambda a, b: float((a.float().cpu() - b.float().cpu()).norm() / b.float().cpu().norm())  # noqa: E731
    assert rel(out, want) < 1e-3 and rel(norms, want_norms) < 1e-3
    n_ref = torch.empty(ids.shape)
    ref_out = ref.moe(1, x.float().cpu(), ids.cpu(), w.cpu(), down_in_norm=n_ref)
    assert rel(want, ref_out) < 2e-2 and rel(want_norms, n_ref) < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("arena", [False, True], ids=["torch-allocator", "plane-arena"])
def test_gpu_offload_frees_device_memory_and_reload_restores_it(ap_path, arena):
    """Offloads free exactly their surplus (the allocator's tensors, or the plane arena's slots once packed), and
    reloads take it again without reserving or mapping anything new."""
    ref, table, dev = stores(ap_path, 8, device="cuda", dtype=torch.float16, arena=arena)
    held = (lambda: dev.arena.live) if arena else torch.cuda.memory_allocated
    size = slot_bytes if arena else rounded
    cached = (lambda: dev.arena.mapped) if arena else torch.cuda.memory_reserved
    mover = CudaPageMover(dev)
    moved = [(i, 3) for i in range(0, 32, 3)]
    loop = PlanLoop(Scripted({0: moved, 2: [(i, 8) for i, _ in moved]}), table, mover)
    x, ids, w = routing(dev, 4, device="cuda")
    dev.moe(0, x.half(), ids, w)  # a kernel reading the old rows is queued before the offload
    torch.cuda.synchronize()
    gc.collect()  # what earlier tests left in reference cycles goes now, not inside the measurement
    before = held()
    expect = sum(size(p.nbytes) for i, b in moved for p in dev.resident(i)[0][b:]) \
        + sum(size(dev.resident(i)[1].nbytes) - size(dev.master_lut(i, b).nbytes) for i, b in moved)
    loop.step(observation(0))
    mover.drain()
    loop.step(observation(1))
    assert not table.busy.any() and mover.stats.offloads == len(moved)
    gc.collect()
    assert before - held() == expect  # the planes really left the GPU
    assert mover.device_bytes() == table.resident_bytes()
    out, want, _, _ = moe_pair(ref, dev, 1, 4, torch.float16, "cuda")  # 4 tokens: no new workspace
    assert float((out - want).norm() / want.norm()) < 5e-3
    reserved = cached()
    committed = loop.step(observation(2)).committed  # reloads start on the copy stream
    mover.drain()
    committed += loop.step(observation(3)).committed
    assert sorted(committed) == [i for i, _ in moved] and (table.q == 8).all()
    # their tensors came from the compute stream's cache (or the arena's free slots) where the offloads left theirs
    assert cached() == reserved
    assert_rows_follow(dev, table)
    torch.cuda.synchronize()
    dev.deferred.collect()  # the old LUT_3s: freed once the compute stream passed the row writes
    gc.collect()
    assert held() == before and mover.stats.reload_seconds > 0
    assert mover.stats.bytes_reloaded == sum(int(table.M[i, 8] - table.M[i, 3]) + dev.master_lut(i, 3).nbytes
                                             for i, _ in moved)
    out, want, _, _ = moe_pair(ref, dev, 1, 4, torch.float16, "cuda")
    assert float((out - want).norm() / want.norm()) < 5e-3


@pytest.mark.gpu
@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_gpu_engine_moves_pages_under_graph_replays(ap_path, asynchronous):
    """Decode steps replay captured graphs while rows change under them: same tokens as eager decoding (with
    asynchronous scheduling too, where the planner's moves start while the next batch runs)."""
    tokens = {}
    for graphs in (False, True):
        engine = _engine(ap_path, Scripted(dict(SCRIPT)), True, device="cuda", dtype="fp16", block_size=4,
                         num_kv_blocks=64, cuda_graphs=graphs, async_scheduling=asynchronous)
        tokens[graphs] = run_engine(engine)
        engine.loop.mover.drain()
        engine.step()  # one more boundary lands whatever was still in flight
        mover, table = engine.loop.mover, engine.table
        assert mover.num_pending == 0 and mover.stats.offloads == 10 and mover.stats.reloads == 5
        assert_rows_follow(engine.model.experts, table)
        assert mover.device_bytes() == table.resident_bytes()
    runner_graphs, mixed = engine.runner.graphs, engine.runner.mixed_graphs
    assert runner_graphs.disabled is None and runner_graphs.replays > 0
    assert mixed.disabled is None and mixed.replays > 0   # the prompts' steps replayed piecewise graphs
    assert tokens[True] == tokens[False]


def test_cpu_engine_has_no_kernels_to_compile(ap_path):
    engine = _engine(ap_path, Scripted({}), True, block_size=4, num_kv_blocks=64)
    assert engine.model.kernel_variants() == set() and engine.compile_kernels() == (0, 0.0)


@pytest.mark.gpu
def test_gpu_engine_compiles_every_kernel_its_steps_launch(ap_path, monkeypatch):
    """After `compile_kernels` no step asks for a kernel build it did not compile (a first use would wait for NVRTC
    inside the step): prefill (dequantized experts), mixed and decode steps of 1..150 tokens, eager and captured."""
    from pwruntime.kernels import compile as kc

    asked, real = [], kc._module
    monkeypatch.setattr(kc, "_module", lambda *key: asked.append(key) or real(*key))
    kc._function.cache_clear()  # so every build a step launches is asked of _module again
    engine = _engine(ap_path, Scripted(dict(SCRIPT)), True, device="cuda", dtype="fp16", block_size=4,
                     num_kv_blocks=256, max_num_seqs=8, max_num_batched_tokens=256, cuda_graphs=True)
    builds, _ = engine.compile_kernels()
    compiled = set(asked)
    assert builds == len(compiled) == len(asked) and {key[2] for key in compiled} >= {
        "ap_moe.cu", "ap_dequant.cu", "layer_ops.cu", "kv_write.cu", "paged_attention.cu"}
    asked.clear()
    prompts = [[(7 * j + n) % 50 + 3 for j in range(n)] for n in (1, 5, 17, 33, 40, 64, 100, 150)]
    outs = engine.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True))
    assert all(len(o.token_ids) == 6 for o in outs)
    assert asked and set(asked) <= compiled, set(asked) - compiled


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_gpu_a_step_s_forward_and_sampling_never_wait_for_the_gpu(ap_path, monkeypatch, graphs):
    """No forward (`ModelRunner.run`: inputs, attention metadata, experts, the sampled rows' logits) and no sampling
    (`ModelRunner.sample`) synchronizes with the device, so the host prepares the next work while the GPU runs
    (under torch's sync debug mode a synchronizing call raises): decode and mixed steps of 1..150 new tokens, greedy
    and sampled rows, bf16 (the prefill's grouped GEMM, which reads nothing back)."""
    from pwruntime.model_runner import ModelRunner

    engine = _engine(ap_path, Scripted(dict(SCRIPT)), True, device="cuda", dtype="bf16", block_size=4,
                     num_kv_blocks=256, max_num_seqs=8, max_num_batched_tokens=256, cuda_graphs=graphs)
    engine.compile_kernels()
    engine.capture_graphs()
    forwards = []

    def checked(fn):
        def call(self, *args, **kwargs):
            torch.cuda.set_sync_debug_mode("error")
            try:
                return fn(self, *args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        return call

    monkeypatch.setattr(ModelRunner, "sample", checked(ModelRunner.sample))
    run = checked(ModelRunner.run)
    monkeypatch.setattr(ModelRunner, "run", lambda self, batch, *a, **k: forwards.append(batch.num_tokens) or run(
        self, batch, *a, **k))
    prompts = [[(7 * j + n) % 50 + 3 for j in range(n)] for n in (1, 5, 17, 40, 100, 150)]
    params = [SamplingParams(max_tokens=6, ignore_eos=True, temperature=t, seed=3)
              for t in (0.0, 0.8, 0.0, 1.0, 0.7, 0.0)]
    outs = engine.generate(prompts, params)
    assert all(len(o.token_ids) == 6 for o in outs)
    assert max(forwards) > 128 and min(forwards) <= 8  # prefill, mixed and decode steps all ran


@pytest.mark.gpu
def test_gpu_generate_cli_uses_the_device_store(demo_ap, capsys):
    from pwruntime.cli import main

    rc = main(["generate", "--ap", str(demo_ap), "--calibration", str(CALIBRATION), "--policy", "pagedweight",
               "--prompt", "And God said unto Moses", "--prompt", "The os module provides", "--prompt", "A fool",
               "--max-tokens", "64", "--num-kv-blocks", "12", "--block-size", "4", "--device", "cuda", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["stats"]["plans"] > 0
    assert out["stats"]["page_moves"]["page_offloads_total"] > 0 and out["stats"]["kv_blocks"] > 12
    assert all(o["finish_reason"] in ("stop", "length") for o in out["outputs"])


def test_device_blocks_stay_at_three_bits_or_more(tmp_path):
    """The top three planes are stored together (nibble-packed), so a device store refuses 1-2-bit commits
    with a clear error, from a page table or from set_bits, even when the AP master has those LUTs."""
    src = make_tiny_checkpoint(tmp_path, "qwen2_moe", tokenizer=True, num_experts=4, hidden_size=64,
                               moe_intermediate_size=32)
    quantize_checkpoint(src, tmp_path / "ap", QuantizeOptions(bits=(2, 3, 8), weighting="none"), progress=False)
    ref = APExpertStore.from_checkpoint(tmp_path / "ap")
    assert ref.bits == (2, 3, 8)
    table = PageTable(len(ref.layers), ref.experts, ref.hidden, ref.intermediate, bits=ref.bits, initial_bits=3)
    with pytest.raises(ValueError, match="bitwidths must be 3..8"):
        DeviceExpertStore.from_ap_store(ref, device="cpu", dtype=torch.float32, table=table)
    dev = DeviceExpertStore.from_ap_store(APExpertStore.from_checkpoint(tmp_path / "ap"), device="cpu",
                                          dtype=torch.float32)
    dev.set_bits(3)
    with pytest.raises(ValueError, match=r"bitwidths \[2\].*3..8"):
        dev.set_bits(2)
    dev.sync()
    assert (dev.row_bits == 3).all()


def _cli_engine(ap_path, device: str, *flags):
    from engine_fixtures import cli_engine

    return cli_engine("--ap", str(ap_path), "--device", device, "--num-kv-blocks", "64", "--prompt", "x", *flags)


def test_off_cuda_the_cli_serves_ap_experts_without_a_plane_arena_and_says_so(ap_path):
    """The arena maps device memory: off CUDA the default leaves it out (an explicit --plane-arena is refused, see
    test_runtime_cli_misuse), --no-plane-arena is accepted, and the engine's serving info says which ran."""
    from pwruntime.stats_log import serving_info

    for flags in ((), ("--no-plane-arena",)):
        engine = _cli_engine(ap_path, "cpu", *flags)
        assert getattr(engine.model.experts, "arena", None) is None and serving_info(engine)["plane_arena"] is False
        assert serving_info(engine)["prefill_chunk_bytes"] is None   # the pure-torch AP store has no such chunk


@pytest.mark.gpu
@pytest.mark.parametrize("flags, arena", [((), True), (("--plane-arena",), True), (("--no-plane-arena",), False)])
def test_gpu_the_cli_serves_ap_experts_from_a_plane_arena_unless_told_not_to(ap_path, flags, arena):
    """On CUDA the AP experts' planes live in a plane arena by default, so offloads give their memory back to the
    device; --no-plane-arena leaves them to torch's caching allocator."""
    from pwruntime.stats_log import serving_info

    engine = _cli_engine(ap_path, "cuda", *flags)
    assert isinstance(engine.model.experts, DeviceExpertStore)
    assert (engine.model.experts.arena is not None) is arena and serving_info(engine)["plane_arena"] is arena


@pytest.mark.gpu
def test_gpu_prefill_chunk_sets_the_store_s_dequantized_weights_chunk(ap_path):
    """--prefill-chunk SIZE reaches the device store (default 1 GiB): what splits a layer's experts into chunks
    (test_gpu_a_bf16_prefill_in_chunks_of_experts_reads_nothing_back)."""
    from pwruntime.stats_log import serving_info

    default, small = (_cli_engine(ap_path, "cuda", *flags) for flags in ((), ("--prefill-chunk", "3MiB")))
    assert default.model.experts.prefill_chunk_bytes == device_store.DEFAULT_PREFILL_CHUNK_BYTES == 1 << 30
    assert small.model.experts.prefill_chunk_bytes == serving_info(small)["prefill_chunk_bytes"] == 3 << 20
