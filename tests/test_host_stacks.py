"""HostStackSampler: stretches where the sampled thread stood still, and nothing else."""
from __future__ import annotations

import sys
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


def test_stretches_of_given_samples_are_the_runs_of_one_innermost_stack_longer_than_the_minimum():
    """stretches() on samples set by hand (no thread, no clock): runs whose innermost `same_frames` frames stay
    equal, longer than min_stretch_s only (a run of exactly it is none), longest first, counted from `origin`."""
    sampler = HostStackSampler(min_stretch_s=0.5, same_frames=2, depth=4)
    wait = ("a.py:3 wait", "a.py:9 step", "a.py:20 loop")
    wait_elsewhere = ("a.py:3 wait", "a.py:9 step", "b.py:5 main")   # the same innermost two frames
    compile_ = ("c.py:7 compile", "a.py:9 step", "a.py:20 loop")
    sampler._samples = [(10.0, wait), (10.25, wait_elsewhere), (10.75, wait),     # 0.75 s: a stretch
                        (11.0, compile_), (11.5, compile_),                         # exactly 0.5 s: none
                        (11.75, wait), (12.75, wait)]                               # 1.0 s: the longest
    got = sampler.stretches(origin=10.0)
    assert [(s["start_s"], s["seconds"]) for s in got] == [(1.75, 1.0), (0.0, 0.75)]
    assert got[1]["stack"] == list(wait)


def test_a_sample_keeps_depth_frames_innermost_first_and_depth_may_equal_same_frames():
    sampler = HostStackSampler(depth=2, same_frames=2)
    stack = sampler._stack(sys._getframe())
    assert len(stack) == 2 and stack[0].endswith(
        "test_a_sample_keeps_depth_frames_innermost_first_and_depth_may_equal_same_frames")
