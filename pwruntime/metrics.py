"""Prometheus histograms of finished requests (latencies and token counts) and the text format of /metrics.

`RequestMetrics` observes each finished engine request (pwruntime.engine.RequestOutput, whose times are on the
engine's clock) into five histograms, named as vLLM's with the `pagedweight_` prefix:
`time_to_first_token_seconds` (first token - arrival), `time_per_output_token_seconds` ((finish - first token) /
(tokens - 1), of requests with at least two tokens), `e2e_request_latency_seconds` (finish - arrival),
`request_prompt_tokens` and `request_generation_tokens`; and each step's tokens (`LLMEngine.last_tokens`) into a
sixth, `inter_token_latency_seconds`: the time since the same request's previous token, every gap apart (a stall
shows in its tail, where a request's mean hides it). Observing and rendering take a lock, so a scrape from
another thread sees whole observations (each histogram's +Inf bucket equals its count).
"""
from __future__ import annotations

import bisect
import math
import numbers
import threading
from typing import Sequence as Seq

PREFIX = "pagedweight_"
# vLLM's buckets; per-token times start lower (a decode step of the demo model on a GPU takes about a millisecond)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)


def buckets_1_2_5(limit: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `limit` (vLLM's token-count buckets)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > limit:
                return tuple(out)
            out.append(float(m * scale))
        scale *= 10


def _number(value: float) -> str:
    """A sample value or bucket bound as Prometheus writes it (integers as integers)."""
    if isinstance(value, numbers.Integral):
        return str(int(value))
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


def scalar(name: str, kind: str, value: float) -> list[str]:
    """The lines of a counter or gauge `pagedweight_<name>`."""
    return [f"# TYPE {PREFIX}{name} {kind}", f"{PREFIX}{name} {_number(value)}"]


class Histogram:
    """A Prometheus histogram `pagedweight_<name>`: a value falls in every bucket whose bound is >= it."""

    def __init__(self, name: str, help: str, bounds: Seq[float]) -> None:
        if list(bounds) != sorted(set(bounds)) or not bounds:
            raise ValueError(f"bucket bounds must be increasing, got {bounds}")
        self.name, self.help, self.bounds = name, help, tuple(float(b) for b in bounds)
        self._counts = [0] * (len(self.bounds) + 1)  # per bucket, not cumulative; the last is (bounds[-1], +Inf)
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe(self, value: float) -> None:
        with self._lock:
            self._counts[bisect.bisect_left(self.bounds, value)] += 1
            self._sum += value

    def render(self) -> list[str]:
        """The exposition lines: HELP, TYPE, cumulative `_bucket{le=...}` (ending with +Inf), `_sum`, `_count`."""
        with self._lock:
            counts, total = list(self._counts), self._sum
        full, lines, seen = PREFIX + self.name, [], 0
        lines += [f"# HELP {full} {self.help}", f"# TYPE {full} histogram"]
        for bound, count in zip(self.bounds + (math.inf,), counts):
            seen += count
            lines.append(f'{full}_bucket{{le="{_number(bound)}"}} {seen}')
        return lines + [f"{full}_sum {_number(total)}", f"{full}_count {seen}"]


class RequestMetrics:
    """The histograms of finished requests (module docstring); `max_tokens`: the model's positions, the largest
    token-count bucket."""

    def __init__(self, max_tokens: int) -> None:
        tokens = buckets_1_2_5(max_tokens)
        self.ttft = Histogram("time_to_first_token_seconds", "Time to first token in seconds.", TTFT_BUCKETS)
        self.tpot = Histogram("time_per_output_token_seconds",
                              "Mean time per output token after the first, in seconds, of each finished request.",
                              TPOT_BUCKETS)
        self.e2e = Histogram("e2e_request_latency_seconds", "End-to-end request latency in seconds.", E2E_BUCKETS)
        self.prompt = Histogram("request_prompt_tokens", "Prompt tokens of each finished request.", tokens)
        self.generation = Histogram("request_generation_tokens", "Generated tokens of each finished request.", tokens)
        self.itl = Histogram("inter_token_latency_seconds",
                             "Time between two consecutive output tokens of a request, in seconds.", TPOT_BUCKETS)
        self._last_token: dict[int, float] = {}  # request id -> when its latest token came, while it runs

    def tokens(self, settled: list[tuple[int, float]]) -> None:
        """The tokens one engine step settled ((request id, engine time) each): the gap since each request's last."""
        for rid, now in settled:
            last = self._last_token.get(rid)
            if last is not None:
                self.itl.observe(now - last)
            self._last_token[rid] = now

    def observe(self, out) -> None:
        """One finished request (a pwruntime.engine.RequestOutput)."""
        self._last_token.pop(out.request_id, None)
        self.e2e.observe(out.finish_time - out.arrival_time)
        self.prompt.observe(len(out.prompt_token_ids))
        self.generation.observe(len(out.token_ids))
        if out.first_token_time is not None:
            self.ttft.observe(out.first_token_time - out.arrival_time)
            if len(out.token_ids) >= 2:
                self.tpot.observe((out.finish_time - out.first_token_time) / (len(out.token_ids) - 1))

    def render(self) -> list[str]:
        return [line for h in (self.ttft, self.tpot, self.itl, self.e2e, self.prompt, self.generation)
                for line in h.render()]
