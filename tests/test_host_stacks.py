"""HostStackSampler: stretches where the sampled thread stood still, and nothing else."""
from __future__ import annotations

import time

import pytest

from pwruntime.host_stacks import HostStackSampler


def stand_still(seconds: float) -> None:
    time.sleep(seconds)


def busy(seconds: float) -> int:
    end, n = time.monotonic() + seconds, 0
    while time.monotonic() < end:
        n = (n * 31 + 7) % 1_000_003  # lines change under the sampler, so no stretch forms here
    return n


def test_a_long_call_is_a_stretch_with_its_stack():
    with HostStackSampler(interval_s=0.02, min_stretch_s=0.3) as sampler:
        origin = time.monotonic()
        busy(0.2)
        stand_still(0.8)
    got = sampler.stretches(origin)
    assert sampler.num_samples > 20 and got
    top = got[0]
    # time.sleep is C: the innermost Python frame is the line that called it
    assert top["stack"][0].endswith("stand_still") and top["stack"][1].endswith(
        "test_a_long_call_is_a_stretch_with_its_stack")
    assert 0.5 <= top["seconds"] <= 0.9 and 0.1 <= top["start_s"] <= 0.5
    assert all(s["seconds"] > 0.3 for s in got) and [s["seconds"] for s in got] == sorted(
        (s["seconds"] for s in got), reverse=True)


def test_the_side_thread_is_gone_after_stop_and_bad_settings_are_refused():
    sampler = HostStackSampler(interval_s=0.01).start()
    stand_still(0.05)
    sampler.stop()
    assert not sampler._thread.is_alive() and sampler.stretches() == []  # nothing stood still for 0.5 s
    for bad in ({"interval_s": 0}, {"min_stretch_s": -1}, {"depth": 2, "same_frames": 4}, {"same_frames": 0}):
        with pytest.raises(ValueError, match="interval_s"):
            HostStackSampler(**bad)
