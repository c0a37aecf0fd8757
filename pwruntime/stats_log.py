"""StatsLog: the serving engine's periodic log line (vLLM's "Avg prompt throughput ..." line).

Every `interval_s` seconds while the engine has work, and once more after its work ends, one line goes to `write`:
the prompt and generation tokens per second since the last line, the requests running and waiting, how full the KV
cache is, the experts' mean committed bits and resident bytes, and the planner's plans and prefix-cache hits since
the last line when there were any. An idle engine writes nothing. The engine loop (pwruntime.engine_core) calls
`tick` after each of its turns, sleeps no longer than `wait_s` while idle, and calls `resume` when it wakes from
a sleep that had no end.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable


CUMULATIVE = ("plans_total", "prefix_cache_hit_tokens_total")  # gauges of EngineCore that only grow


@dataclass
class StatsLog:
    interval_s: float
    write: Callable[[str], None]
    clock: Callable[[], float] = time.monotonic
    _last_t: float = field(init=False)
    _last: dict = field(init=False)  # the counters at the last line
    _last_totals: dict = field(init=False)  # the gauges that only grow (CUMULATIVE), at the last line

    def __post_init__(self) -> None:
        if not self.interval_s > 0:
            raise ValueError(f"interval_s must be > 0, got {self.interval_s}")
        self._last_t = self.clock()
        self._last, self._last_totals = {}, {}

    def wait_s(self, counters: dict) -> float | None:
        """How long an idle loop may sleep before the next line is due: None (as long as it likes) when nothing
        happened since the last line."""
        if not self._changed(counters):
            return None
        return max(0.0, self._last_t + self.interval_s - self.clock())

    def _changed(self, counters: dict) -> bool:
        return any(value != self._last.get(name, 0) for name, value in counters.items())

    def resume(self) -> None:
        """The loop woke from an idle sleep (one `wait_s` allowed to last): the next line's rates count from now."""
        self._last_t = self.clock()

    def tick(self, counters: dict, gauges: Callable[[], dict]) -> None:
        """Write a line if one is due and something happened since the last (`gauges()`: EngineCore's gauges)."""
        now = self.clock()
        if now - self._last_t < self.interval_s:
            return
        g = gauges()
        if self._changed(counters) or g["running_requests"] or g["waiting_requests"]:
            self.write(stats_line(counters, {**self._last, **self._last_totals}, g, now - self._last_t))
        self._last_t, self._last = now, dict(counters)
        self._last_totals = {name: g.get(name, 0) for name in CUMULATIVE}


def serves_ap_experts(engine) -> bool:
    """Whether the engine's experts are AP ones, which its page table describes (full-precision ones it does not)."""
    from pwruntime.model.experts import DenseExpertStore

    return not isinstance(engine.model.experts, DenseExpertStore)


def ready_line(engine, seconds: float) -> str:
    """What the engine serves with, once it is ready (as vLLM's start-up lines: the KV cache and the room it
    leaves)."""
    cfg, pool, context = engine.config, engine.pool, engine.max_model_len
    blocks_per_request = -(-context // cfg.block_size)
    dtype = str(engine.model.dtype).removeprefix("torch.")
    if not serves_ap_experts(engine):
        experts = f"experts in {dtype}"
    else:  # AP experts: the page table describes them
        experts = (f"experts at {engine.table.mean_bits():.2f} mean bits "
                   f"({engine.table.resident_bytes() / 2**20:.1f} MiB), policy {engine.policy.name}")
    return (f"engine: ready in {seconds:.1f} s on {engine.model.device} ({dtype}): {pool.capacity} KV blocks of "
            f"{cfg.block_size} tokens ({pool.capacity * engine.block_bytes / 2**20:.1f} MiB), "
            f"room for {pool.capacity / blocks_per_request:.1f} requests of the full {context}-token context; "
            f"{experts}; at most {cfg.max_num_seqs} sequences and {cfg.max_num_batched_tokens} "
            "tokens a step")


def stats_line(counters: dict, before: dict, gauges: dict, seconds: float) -> str:
    """One log line: rates over the `seconds` since the counters were `before`, then the gauges now (the experts'
    bits when the gauges have them: AP experts)."""
    def since(name: str) -> float:
        return counters.get(name, 0) - before.get(name, 0)

    total = gauges["kv_blocks_total"]
    used = 100.0 * (total - gauges["kv_blocks_free"]) / total if total else 0.0
    parts = [f"{since('prompt_tokens_total') / seconds:.1f} prompt tokens/s",
             f"{since('generated_tokens_total') / seconds:.1f} generation tokens/s",
             f"{gauges['running_requests']} running, {gauges['waiting_requests']} waiting",
             f"KV cache {used:.1f}% of {total} blocks used"]
    if "mean_committed_bits" in gauges:
        parts.append(f"experts at {gauges['mean_committed_bits']:.2f} mean bits, "
                     f"{gauges['expert_resident_bytes'] / 2**20:.1f} MiB resident")
    plans = gauges.get("plans_total", 0) - before.get("plans_total", 0)
    if plans:
        parts.append(f"{plans} plans")
    hits = gauges.get("prefix_cache_hit_tokens_total", 0) - before.get("prefix_cache_hit_tokens_total", 0)
    if hits:
        parts.append(f"{hits} prompt tokens from the prefix cache")
    return "engine: " + ", ".join(parts)
