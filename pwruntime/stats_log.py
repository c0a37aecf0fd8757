"""What a serving engine says about itself: StatsLog, its periodic log line (vLLM's "Avg prompt throughput ..."
line), and `serving_info` / `ready_line`, what it serves with (/server_info, the ready line, a replay's record).

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


def serves_from_plane_arena(engine) -> bool:
    """Whether the engine's expert planes live in a plane arena (pwruntime.plane_arena; AP experts on CUDA by
    default) rather than in torch's caching allocator."""
    return getattr(engine.model.experts, "arena", None) is not None


def prefill_chunk_bytes(engine) -> int | None:
    """The dequantized expert weights a prefill's MoE layer holds at once (`--prefill-chunk`), where the CUDA expert
    store serves; None elsewhere."""
    return getattr(engine.model.experts, "prefill_chunk_bytes", None)


def lut_room(engine) -> str:
    """Where the engine's offloads find room for their lower LUTs in flight: "slack" where its plan loop may borrow a
    budget's allocator slack (`--lut-room slack` with `--gpu-memory-budget`), else "pool" (policies.memory_budget)."""
    return "slack" if engine.loop.lut_slack_bytes else "pool"


def serving_info(engine) -> dict:
    """What the engine serves with, once it is ready: its device, scheduler limits, KV pool and experts (the server's
    /server_info, the ready line, and what `pwruntime bench serve` records of the server). The scheduler keys are
    named as `pwruntime replay` names them in its config.json."""
    cfg, pool = engine.config, engine.pool
    ap = serves_ap_experts(engine)
    return {"device": str(engine.model.device), "dtype": str(engine.model.dtype).removeprefix("torch."),
            "block_size": cfg.block_size, "num_kv_blocks": pool.capacity,
            "kv_cache_bytes": pool.capacity * engine.block_bytes, "max_model_len": engine.max_model_len,
            "max_num_seqs": cfg.max_num_seqs, "max_num_batched_tokens": cfg.max_num_batched_tokens,
            "enable_prefix_caching": cfg.prefix_caching, "async_scheduling": cfg.async_scheduling,
            "hybrid_kv_cache": engine.kv_layout.hybrid, "activation_reserve": engine.activation_reserve,
            "serving_reserve": engine.serving_reserve, "kv_blocks_per_request": engine.kv_blocks_per_request,
            "ap_experts": ap, "policy": engine.policy.name if ap else None, "lut_room": lut_room(engine) if ap else None,
            "plane_arena": serves_from_plane_arena(engine),
            "prefill_chunk_bytes": prefill_chunk_bytes(engine),
            "mean_committed_bits": engine.table.mean_bits() if ap else None,
            "expert_resident_bytes": engine.table.resident_bytes() if ap else None}


def ready_line(info: dict, seconds: float) -> str:
    """The engine's start-up line (as vLLM's: the KV cache and the room it leaves), of its `serving_info`."""
    blocks, context = info["num_kv_blocks"], info["max_model_len"]
    blocks_per_request = info.get("kv_blocks_per_request") or -(-context // info["block_size"])
    unit = ("KV pages of its hybrid groups" if info.get("hybrid_kv_cache")
            else f"KV blocks of {info['block_size']} tokens")
    if info["ap_experts"]:  # the page table describes them
        experts = (f"experts at {info['mean_committed_bits']:.2f} mean bits "
                   f"({info['expert_resident_bytes'] / 2**20:.1f} MiB), policy {info['policy']}")
    else:
        experts = f"experts in {info['dtype']}"
    reserve, serving = info.get("activation_reserve"), info.get("serving_reserve")
    kept = "".join(f", {n / 2**20:.0f} MiB kept for {what}" for n, what in ((reserve, "activations"),
                                                                          (serving, "graphs and buffers")) if n)
    short = ("; a request that outgrows the pool is cut short (finish_reason length, kv_capacity_cuts_total in "
             "/metrics): lower --max-model-len or raise the KV cache" if blocks < blocks_per_request else "")
    return (f"engine: ready in {seconds:.1f} s on {info['device']} ({info['dtype']}): {blocks} {unit} "
            f"({info['kv_cache_bytes'] / 2**20:.1f} MiB{kept}), "
            f"room for {blocks / blocks_per_request:.1f} requests of the full {context}-token context; "
            f"{experts}; at most {info['max_num_seqs']} sequences and {info['max_num_batched_tokens']} "
            f"tokens a step{short}")


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
