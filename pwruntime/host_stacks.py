"""HostStackSampler: where the host's main thread stood still for a while (a compile, a wait, a long Python call).

A side thread reads the main thread's Python stack every `interval_s` seconds while the sampler runs. A stretch is a
run of samples whose innermost `same_frames` frames stayed the same for longer than `min_stretch_s`; `stretches()`
gives them longest first, with their start on a given clock and the stack of their first sample (innermost first).
It found the 7 s NVRTC compiles inside replayed steps in session 39 (`pwruntime replay --sample-host-stacks`). It
costs the host a stack walk per sample; it sees Python frames only, so a C call shows as the line that made it.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable


class HostStackSampler:
    """Samples the stack of the thread that creates it; use as a context manager (or `start`, then `stop`)."""

    def __init__(self, interval_s: float = 0.05, min_stretch_s: float = 0.5, depth: int = 16, same_frames: int = 4,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if interval_s <= 0 or min_stretch_s < 0 or depth < same_frames or same_frames < 1:
            raise ValueError("need interval_s > 0, min_stretch_s >= 0 and depth >= same_frames >= 1")
        self.interval_s, self.min_stretch_s = interval_s, min_stretch_s
        self.depth, self.same_frames = depth, same_frames
        self.clock = clock
        self._target = threading.get_ident()
        self._samples: list[tuple[float, tuple[str, ...]]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> HostStackSampler:
        self._thread = threading.Thread(target=self._run, name="pagedweight-host-stacks", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop sampling and wait for the side thread (so it never outlives the interpreter's shutdown)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def __enter__(self) -> HostStackSampler:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def num_samples(self) -> int:
        return len(self._samples)

    def stretches(self, origin: float = 0.0) -> list[dict]:
        """The stretches, longest first: `start_s` (on the sampler's clock, minus `origin`), `seconds`, `stack`."""
        out, samples, k = [], self._samples, self.same_frames
        i = 0
        while i < len(samples):
            j = i
            while j + 1 < len(samples) and samples[j + 1][1][:k] == samples[i][1][:k]:
                j += 1
            seconds = samples[j][0] - samples[i][0]
            if seconds > self.min_stretch_s:
                out.append({"start_s": round(samples[i][0] - origin, 3), "seconds": round(seconds, 3),
                            "stack": list(samples[i][1])})
            i = j + 1
        return sorted(out, key=lambda s: -s["seconds"])

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            frame = sys._current_frames().get(self._target)
            if frame is not None:
                self._samples.append((self.clock(), self._stack(frame)))

    def _stack(self, frame) -> tuple[str, ...]:
        out = []
        while frame is not None and len(out) < self.depth:
            code = frame.f_code
            out.append(f"{os.path.basename(code.co_filename)}:{frame.f_lineno} {code.co_name}")
            frame = frame.f_back
        return tuple(out)
