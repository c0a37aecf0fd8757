"""pwruntime.cuda_memory: expandable segments turned on unless the user configured the allocator; memory reports."""
from __future__ import annotations

import pytest
import torch

from pwruntime import cuda_memory
from pwruntime.kv_cache import KVCache
from pwruntime.vmm import DriverCalls


@pytest.fixture
def fake_cuda(monkeypatch):
    """A CUDA-capable torch as far as use_expandable_segments can tell, recording the settings it is given."""
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", calls.append, raising=False)
    for name in cuda_memory.ALLOC_CONF_VARS:
        monkeypatch.delenv(name, raising=False)
    return calls


def test_expandable_segments_are_turned_on_when_the_user_set_nothing(fake_cuda):
    assert cuda_memory.use_expandable_segments() is True
    assert fake_cuda == ["expandable_segments:True"]
    assert cuda_memory.user_alloc_conf() is None


@pytest.mark.parametrize("name", cuda_memory.ALLOC_CONF_VARS)
def test_the_users_allocator_configuration_stands(fake_cuda, monkeypatch, name):
    monkeypatch.setenv(name, "expandable_segments:False")
    assert cuda_memory.use_expandable_segments() is False
    assert fake_cuda == []  # nothing overrides it
    assert cuda_memory.user_alloc_conf() == f"{name}=expandable_segments:False"


def test_an_empty_variable_is_no_configuration(fake_cuda, monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "")
    assert cuda_memory.use_expandable_segments() is True and fake_cuda == ["expandable_segments:True"]


def test_nothing_changes_without_cuda(fake_cuda, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cuda_memory.use_expandable_segments() is False and fake_cuda == []


def test_reports_are_empty_off_cuda():
    assert cuda_memory.memory_report("cpu") is None
    assert cuda_memory.memory_gauges("cpu") == {}


def test_a_replay_prints_the_memory_held_and_the_driver_calls_of_each_mapping():
    from pwruntime.cmd_replay import gpu_memory_lines
    mem = {"peak_allocated_gib": 2.35, "peak_reserved_gib": 3.61, "kv_peak_mapped_gib": 5.94,
           "weights_peak_mapped_gib": 0.0, "peak_held_gib": 13.98, "peak_in_use_gib": 11.5,
           "driver_calls": {"kv": DriverCalls(40, 12, 0.0031, 38, 0.0125).as_dict(), "weights": DriverCalls().as_dict()}}
    memory, calls = gpu_memory_lines(mem, "12GiB")
    assert memory.startswith("GPU memory: peak 2.35 GiB")
    assert memory.endswith("planes; 11.50 GiB in use and 13.98 GiB held at most (budget 12GiB)")
    # the planes' mapping made no call (they are in torch's allocator): only the cache's are printed
    assert calls == ("the driver's virtual memory, since the engine started: the KV cache 40 handles mapped in 3.1 ms, "
                     "38 unmapped in 12.5 ms")
    mem["driver_calls"]["kv"] = DriverCalls().as_dict()
    assert gpu_memory_lines(mem, None) == [memory.replace(" (budget 12GiB)", "")]


@pytest.mark.gpu
def test_gpu_kv_resizes_reserve_little_beyond_the_cache_with_expandable_segments():
    if cuda_memory.user_alloc_conf() is not None:
        pytest.skip("the environment configures the CUDA allocator")
    assert cuda_memory.use_expandable_segments()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved()
    per_block = KVCache.bytes_per_block(8, 16, 8, 128, torch.bfloat16)  # 512 KiB a block over 8 layers, K and V
    kv = KVCache(8, 1024, 16, 8, 128, torch.bfloat16, "cuda", scratch=True, growable=False)  # 512 MiB, torch's
    gen = torch.Generator().manual_seed(0)
    for _ in range(40):  # a new size each time, as plans trade planes for blocks
        kv.resize(int(torch.randint(700, 1400, (1,), generator=gen)))
    torch.cuda.synchronize()
    grown = torch.cuda.memory_reserved() - before
    # the default allocator's fixed segments reserve several times the cache here (8x over 60 resizes of 3.5 GiB)
    assert grown < 2.5 * 1400 * per_block, grown / 2 ** 20
    gib = 2 ** 30
    mapped = cuda_memory.MappedMemory(kv=3 * gib, kv_peak=5 * gib, weights=gib, weights_peak=2 * gib,
                                      held_peak=1000 * gib, weights_calls=DriverCalls(4, 2, 0.0125, 3, 0.5),
                                      in_use_peak=900 * gib)
    report = cuda_memory.memory_report("cuda", mapped)
    assert report["expandable_segments"] >= 1 and report["user_alloc_conf"] is None
    assert report["peak_reserved_gib"] >= report["reserved_gib"] > 0
    assert report["kv_mapped_gib"] == 3 and report["kv_peak_mapped_gib"] == 5
    assert report["weights_mapped_gib"] == 1 and report["weights_peak_mapped_gib"] == 2
    assert report["peak_held_gib"] == 1000 and report["peak_in_use_gib"] == 900
    assert report["driver_calls"] == {"kv": DriverCalls().as_dict(), "weights": {
        "handles_mapped": 4, "access_grants": 2, "map_ms": 12.5, "handles_unmapped": 3, "unmap_ms": 500.0}}
    now = cuda_memory.memory_report("cuda", cuda_memory.MappedMemory(kv=3 * gib, weights=gib))  # no sample: held now
    assert now["peak_held_gib"] == pytest.approx(now["reserved_gib"] + 4, abs=2e-3)
    assert now["peak_in_use_gib"] == pytest.approx(torch.cuda.memory_allocated() / gib + 4, abs=2e-3)
    gauges = cuda_memory.memory_gauges("cuda", cuda_memory.MappedMemory(kv=7, weights=9, kv_calls=DriverCalls(
        3, 1, 0.25, 2, 0.5), weights_calls=DriverCalls(1, 1, 0.125, 0, 0.0)))
    assert (gauges["gpu_vmm_handles_mapped_total"], gauges["gpu_vmm_handles_unmapped_total"]) == (4, 2)
    assert gauges["gpu_vmm_driver_seconds_total"] == 0.875
    assert gauges["gpu_memory_reserved_bytes"] >= gauges["gpu_memory_allocated_bytes"] >= kv.nbytes
    assert gauges["gpu_memory_kv_mapped_bytes"] == 7 and gauges["gpu_memory_weights_mapped_bytes"] == 9
