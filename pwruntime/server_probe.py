"""What `pwruntime bench serve` reads of the server beside its requests: what the engine serves with (/server_info)
and the engine's counters around a run (/metrics).

`server_info` is the server's /server_info document (pwruntime.server), or None from a server without one (vLLM
outside its development mode, another OpenAI-compatible server): the benchmark then cannot say what the engine ran
with. `engine_counters` reads the `pagedweight_` counters of /metrics ({} from a server that has none);
`counter_deltas` is what a run added to them: the engine's steps, plans, preemptions and computed prompt tokens.
They count the whole server's work, so they describe the run only when nothing else sent requests meanwhile.
`engine_settings` takes the scheduler keys of the info document into a result's config.json, named as `pwruntime
replay` names them, so `pwsim fidelity` reads a served run as it reads a replay.
"""
from __future__ import annotations

import asyncio

PREFIX = "pagedweight_"
# the counters a run adds to -> the name its summary gives the difference
RUN_COUNTERS = {"steps_total": "steps", "plans_total": "plans", "preemptions_total": "preemptions",
                "prompt_tokens_total": "prompt_tokens_computed", "generated_tokens_total": "generated_tokens",
                "prefix_cache_hit_tokens_total": "prefix_cache_hit_tokens"}
ENGINE_SETTINGS = ("block_size", "num_kv_blocks", "max_num_seqs", "max_num_batched_tokens", "enable_prefix_caching",
                   "hybrid_kv_cache", "async_scheduling", "max_model_len", "policy", "lut_room",
                   "activation_reserve", "serving_reserve")


async def _get(session, url: str) -> tuple[int, str] | None:
    import aiohttp

    try:
        async with session.get(url) as resp:
            return resp.status, await resp.text()
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return None


async def server_info(session, url: str) -> dict | None:
    """The server's /server_info document, or None where it has none."""
    import json

    got = await _get(session, f"{url}/server_info")
    if got is None or got[0] != 200:
        return None
    try:
        doc = json.loads(got[1])
    except ValueError:
        return None
    return doc if isinstance(doc, dict) and isinstance(doc.get("engine"), dict) else None


def parse_counters(text: str) -> dict[str, float]:
    """The unlabelled `pagedweight_` samples of Prometheus text, by name without the prefix."""
    out = {}
    for line in text.splitlines():
        if not line.startswith(PREFIX) or "{" in line:
            continue
        name, _, value = line.partition(" ")
        try:
            out[name.removeprefix(PREFIX)] = float(value)
        except ValueError:
            continue
    return out


async def engine_counters(session, url: str) -> dict[str, float]:
    """The engine's counters and gauges now ({} where /metrics has none of ours)."""
    got = await _get(session, f"{url}/metrics")
    return parse_counters(got[1]) if got is not None and got[0] == 200 else {}


def counter_deltas(before: dict[str, float], after: dict[str, float]) -> dict[str, int]:
    """What a run added to each of RUN_COUNTERS that the server reported both times, by its summary name."""
    return {name: int(after[key] - before[key]) for key, name in RUN_COUNTERS.items()
            if key in before and key in after}


def engine_settings(info: dict | None) -> dict:
    """The scheduler settings of an info document, as a replay's config.json names them ({} without one)."""
    engine = (info or {}).get("engine", {})
    return {key: engine[key] for key in ENGINE_SETTINGS if key in engine}
