"""EngineCore and its clients: one batch of events per engine step whatever the number of requests, the streamed
deltas adding up to each choice's output, /metrics' numbers asked of the loop, and a client whose engine loop is
gone answering every request, in flight or later, with a 503."""
from __future__ import annotations

import asyncio
import queue
import threading

import pytest

from pwruntime.engine import EngineConfig, LLMEngine
from pwruntime.engine_client import EngineClient
from pwruntime.engine_core import EngineCore
from pwruntime.sampling import SamplingParams
from server_fixtures import model  # noqa: F401 (fixture)

PROMPT = "And God said"


def _run_core(engine: LLMEngine, items: list, until_done: int) -> tuple[list[list], EngineCore]:
    """Feed `items` to an EngineCore over `engine`; stop it once `until_done` "done" events came; its batches."""
    batches: list[list] = []
    done = threading.Event()

    def emit(events: list) -> None:
        batches.append(events)
        if sum(e[0] == "done" for b in batches for _, e in b) >= until_done:
            done.set()

    core = EngineCore(engine, emit)
    for item in items:
        core.inbox.put(item)
    thread = threading.Thread(target=core.run, daemon=True)
    thread.start()
    assert done.wait(120)
    core.inbox.put(("stats", "s"))
    core.inbox.put(None)
    thread.join(30)
    assert not thread.is_alive()
    return batches, core


def test_one_batch_per_step_carries_every_streaming_choice(model):  # noqa: F811
    engine = LLMEngine(model, EngineConfig(num_kv_blocks=64))
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    items = [("add", "a", [(PROMPT, params)] * 2, True), ("add", "b", [("In the beginning", params)], True),
             ("add", "c", [(PROMPT, SamplingParams(max_tokens=5))], False)]
    batches, core = _run_core(engine, items, until_done=4)
    steps = engine.num_steps
    assert len(batches) <= steps + 1  # one emit per turn of the loop (the last one: the stats), none per event
    # the three streaming choices' tokens came together: a step's batch holds a delta of each
    assert max(sum(e[0] == "delta" for _, e in b) for b in batches) == 3
    streamed: dict = {}
    outputs: dict = {}
    for batch in batches:
        for key, (kind, payload) in batch:
            if kind == "delta":
                streamed.setdefault((key, payload[0]), []).extend(payload[1])
            elif kind == "done":
                outputs[(key, payload[0])] = payload[1]
    assert sorted(outputs) == [("a", 0), ("a", 1), ("b", 0), ("c", 0)]
    assert ("c", 0) not in streamed  # a request that does not stream gets its output once
    for choice, out in outputs.items():
        if choice != ("c", 0):
            # the deltas before "done" and the tokens "done" adds make up the output, none twice
            assert out.token_ids[:len(streamed[choice])] == streamed[choice] and len(out.token_ids) == 12
    (stats,) = [e for b in batches for key, e in b if key == "s"]
    assert stats[0] == "stats" and stats[1]["counters"]["requests_total"] == 4
    assert stats[1]["counters"]["generated_tokens_total"] == 3 * 12 + len(outputs[("c", 0)].token_ids)
    assert stats[1]["gauges"]["running_requests"] == 0 and stats[1]["gauges"]["steps_total"] == steps
    assert not engine.has_unfinished() and engine.pool.num_free == engine.pool.capacity


def test_an_abort_ends_every_choice_of_its_request(model):  # noqa: F811
    engine = LLMEngine(model, EngineConfig(num_kv_blocks=64))
    long = SamplingParams(max_tokens=400, ignore_eos=True)
    items = [("add", "gone", [(PROMPT, long)] * 3, True), ("abort", "gone"),
             ("add", "kept", [(PROMPT, SamplingParams(max_tokens=4))], False)]
    batches, core = _run_core(engine, items, until_done=1)
    keys = {key for b in batches for key, _ in b}
    assert "gone" not in keys and core.counters["aborted_total"] == 3
    assert not engine.has_unfinished() and engine.pool.num_free == engine.pool.capacity


class _Loopback(EngineClient):
    """A client whose engine loop is a queue the test reads, answering by hand."""

    def __init__(self) -> None:
        super().__init__(tokenizer=None, vocab=10, max_position=64)
        self.sent: queue.Queue = queue.Queue()

    def _send(self, item) -> None:
        self.sent.put(item)


def test_a_client_whose_engine_is_gone_fails_requests_in_flight_and_later_with_a_503():
    async def run():
        client = _Loopback()
        first = await client.submit([("a", SamplingParams())] * 2, stream=True)
        second = await client.submit([("b", SamplingParams())], stream=False)
        key = client.sent.get_nowait()[1]
        assert key == first.key
        client._deliver([(first.key, ("delta", (0, [1], [], None))), (second.key, ("done", (0, "out")))])
        assert await first.events.get() == ("delta", (0, [1], [], None))
        assert await second.events.get() == ("done", (0, "out"))
        client._fail_all("the engine process exited (exit code -9)")
        assert not client.alive
        assert await first.events.get() == ("error", (503, "the engine process exited (exit code -9)"))
        assert second.events.empty()  # it had finished: nothing more for it
        later = await client.submit([("c", SamplingParams())], stream=False)
        assert await later.events.get() == ("error", (503, "the engine process exited (exit code -9)"))
        with pytest.raises(RuntimeError, match="exit code -9"):
            await client.stats()

    asyncio.run(run())
