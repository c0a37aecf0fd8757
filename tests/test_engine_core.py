"""EngineCore and its clients: one batch of events per engine step whatever the number of requests, the streamed
deltas adding up to each choice's output, /metrics' numbers asked of the loop, and a client whose engine loop is
gone answering every request, in flight or later, with a 503; the periodic stats line."""
from __future__ import annotations

import asyncio
import queue
import threading
import time

import pytest

from pwruntime.engine import EngineConfig, LLMEngine
from pwruntime.engine_client import EngineClient
from pwruntime.engine_core import EngineCore
from pwruntime.sampling import SamplingParams
from pwruntime.stats_log import StatsLog, stats_line
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
    assert stats[1]["gauges"]["preemptions_total"] == engine.scheduler.num_preemptions
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


def test_a_refused_request_counts_each_of_its_choices_and_leaves_none_running(model):  # noqa: F811
    """A request whose second prompt the engine refuses gets one 400; request_errors_total counts its engine requests
    (as requests_total does), and the prompt added before the refused one does not run; the next request, ended by
    its max_tokens, is no KV capacity cut."""
    engine = LLMEngine(model, EngineConfig(num_kv_blocks=64))
    p, long = SamplingParams(max_tokens=4, ignore_eos=True), SamplingParams(max_tokens=100, ignore_eos=True)
    too_long = list(range(5, 5 + engine.max_model_len))
    items = [("add", "bad", [(PROMPT, long), (too_long, p), (PROMPT, long)], False),
             ("add", "ok", [(PROMPT, p)], False)]
    batches, core = _run_core(engine, items, until_done=1)
    events = [(key, e[0]) for b in batches for key, e in b if e[0] != "stats"]
    assert events == [("bad", "error"), ("ok", "done")]
    assert core.counters["request_errors_total"] == 3 and core.counters["requests_total"] == 1
    assert core.counters["kv_capacity_cuts_total"] == 0  # "ok" ended by its length: no KV cut
    assert not engine.has_unfinished() and engine.pool.num_free == engine.pool.capacity


def test_the_gauges_show_the_engine_mid_request(model):  # noqa: F811
    """/metrics' gauges are the engine's state when asked: while a request runs, its blocks are not free."""
    engine = LLMEngine(model, EngineConfig(num_kv_blocks=64))
    core = EngineCore(engine, lambda events: None)
    engine.add_request(PROMPT, SamplingParams(max_tokens=40, ignore_eos=True))
    engine.add_request(PROMPT, SamplingParams(max_tokens=40, ignore_eos=True))
    for _ in range(3):
        engine.step()
    g = core.stats()["gauges"]
    assert (g["running_requests"], g["waiting_requests"], g["steps_total"]) == (2, 0, 3)
    assert g["kv_blocks_free"] == engine.pool.num_free < g["kv_blocks_total"] == engine.pool.capacity == 64


class _Loopback(EngineClient):
    """A client whose engine loop is a queue the test reads, answering by hand."""

    def __init__(self) -> None:
        super().__init__(tokenizer=None, vocab=10, info={"max_model_len": 64})
        self.sent: queue.Queue = queue.Queue()

    def _send(self, item) -> None:
        self.sent.put(item)


async def _next(live):
    """The request's next event (a missing one fails the test instead of hanging it)."""
    return await asyncio.wait_for(live.events.get(), 5)


def test_a_client_whose_engine_is_gone_fails_requests_in_flight_and_later_with_a_503():
    async def run():
        client = _Loopback()
        first = await client.submit([("a", SamplingParams())] * 2, stream=True)
        second = await client.submit([("b", SamplingParams())], stream=False)
        key = client.sent.get_nowait()[1]
        assert key == first.key
        client._deliver([(first.key, ("delta", (0, [1], [], None))), (second.key, ("done", (0, "out")))])
        assert await _next(first) == ("delta", (0, [1], [], None))
        assert await _next(second) == ("done", (0, "out"))
        client._fail_all("the engine process exited (exit code -9)")
        assert not client.alive
        assert await _next(first) == ("error", (503, "the engine process exited (exit code -9)"))
        assert second.events.empty()  # it had finished: nothing more for it
        client.sent.get_nowait()  # the second request's "add"
        later = await client.submit([("c", SamplingParams())], stream=False)
        assert await _next(later) == ("error", (503, "the engine process exited (exit code -9)"))
        with pytest.raises(RuntimeError, match="exit code -9"):
            await client.stats()
        assert client.sent.empty()  # nothing was sent to the engine that is gone

    asyncio.run(run())


def test_a_client_forgets_a_request_when_its_last_choice_is_done_its_stats_come_or_its_client_leaves():
    async def run():
        client = _Loopback()
        two = await client.submit([("a", SamplingParams())] * 2, stream=False)
        left = await client.submit([("b", SamplingParams())], stream=True)
        client.sent.get_nowait(), client.sent.get_nowait()   # the two "add"s
        client._deliver([(two.key, ("done", (0, "x")))])
        assert client.in_flight() == 2   # one choice of `two` still runs
        client._deliver([(two.key, ("done", (1, "y")))])
        assert [await _next(two) for _ in range(2)] == [("done", (0, "x")), ("done", (1, "y"))]
        client.cancel(left)
        assert client.sent.get_nowait() == ("abort", left.key)
        client.cancel(left)   # a second cancel of the same request sends nothing
        assert client.sent.empty()
        client._deliver([(left.key, ("delta", (0, [1], [], None)))])   # late events of a cancelled request: dropped
        assert left.events.empty() and client.in_flight() == 0
        task = asyncio.ensure_future(client.stats())
        await asyncio.sleep(0)
        kind, key = client.sent.get_nowait()
        assert kind == "stats" and client.in_flight() == 1
        client._deliver([(key, ("stats", {"gauges": {}}))])
        assert await asyncio.wait_for(task, 5) == {"gauges": {}} and client.in_flight() == 0

    asyncio.run(run())


def test_shutting_down_aborts_what_is_in_flight_and_answers_it_and_every_later_request_with_a_503():
    async def run():
        client = _Loopback()
        live = await client.submit([("a", SamplingParams())], stream=True)
        client.sent.get_nowait()
        client.shut_down("the server is shutting down")
        assert client.sent.get_nowait() == ("abort", live.key)   # its KV blocks go at the engine's next step
        assert await _next(live) == ("error", (503, "the server is shutting down"))
        assert client.in_flight() == 0 and not client.alive
        later = await client.submit([("b", SamplingParams())], stream=False)
        assert await _next(later) == ("error", (503, "the server is shutting down")) and client.sent.empty()

    asyncio.run(run())


class _Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


GAUGES = {"running_requests": 2, "waiting_requests": 1, "kv_blocks_free": 75, "kv_blocks_total": 100,
          "mean_committed_bits": 4.5, "expert_resident_bytes": 3 * 2**20, "plans_total": 7,
          "prefix_cache_hit_tokens_total": 0}


def test_the_stats_log_writes_rates_since_its_last_line_and_nothing_when_idle():
    clock, lines = _Clock(), []
    log = StatsLog(10.0, lines.append, clock)
    counters = {"prompt_tokens_total": 0, "generated_tokens_total": 0}
    assert log.wait_s(counters) is None  # nothing happened yet: no line to wait for
    counters = {"prompt_tokens_total": 400, "generated_tokens_total": 1000}
    clock.t += 4
    log.tick(counters, lambda: GAUGES)
    assert lines == [] and log.wait_s(counters) == 6.0  # not due yet; an idle loop wakes when it is
    clock.t += 6
    log.tick(counters, lambda: GAUGES)
    assert lines == ["engine: 40.0 prompt tokens/s, 100.0 generation tokens/s, 2 running, 1 waiting, KV cache 25.0% "
                     "of 100 blocks used, experts at 4.50 mean bits, 3.0 MiB resident, 7 plans"]
    assert log.wait_s(counters) is None  # nothing since: an idle loop sleeps until a request comes
    clock.t += 20
    idle = {**GAUGES, "running_requests": 0, "waiting_requests": 0}
    log.tick(counters, lambda: idle)
    assert len(lines) == 1  # an idle engine writes nothing
    clock.t += 100  # idle, then a request wakes the loop
    log.resume()
    counters = {"prompt_tokens_total": 400, "generated_tokens_total": 1500}
    clock.t += 10
    log.tick(counters, lambda: {**idle, "plans_total": 9, "prefix_cache_hit_tokens_total": 32})
    assert lines[1].startswith("engine: 0.0 prompt tokens/s, 50.0 generation tokens/s, 0 running, 0 waiting")
    assert lines[1].endswith(", 2 plans, 32 prompt tokens from the prefix cache")  # since the last line
    dense_gauges = {k: v for k, v in GAUGES.items() if k not in ("mean_committed_bits", "expert_resident_bytes")}
    dense = stats_line(counters, {}, dense_gauges, 1.0)  # full-precision experts: no bits to show
    assert "mean bits" not in dense and dense.endswith("KV cache 25.0% of 100 blocks used, 7 plans")


def test_the_stats_log_keeps_writing_for_waiting_requests_and_never_asks_a_negative_sleep():
    """Requests that only wait (nothing ran since the last line) still get a line, which names no plans when none
    were made; a line overdue while the loop sat idle is due now (0 s), never a negative timeout for the inbox; an
    interval of 0 is refused."""
    clock, lines = _Clock(), []
    log = StatsLog(10.0, lines.append, clock)
    counters = {"prompt_tokens_total": 0, "generated_tokens_total": 0}
    waiting = {**GAUGES, "running_requests": 0, "waiting_requests": 3}
    clock.t += 10
    log.tick(counters, lambda: waiting)
    clock.t += 10
    log.tick(counters, lambda: waiting)  # nothing happened, the 7 plans were there at the last line
    assert len(lines) == 2 and "0 running, 3 waiting" in lines[1] and "plans" not in lines[1]
    counters = {**counters, "generated_tokens_total": 5}
    clock.t += 25
    assert log.wait_s(counters) == 0.0
    with pytest.raises(ValueError, match="interval_s must be > 0"):
        StatsLog(0.0, lines.append, clock)


def test_the_engine_loop_logs_while_it_works_and_once_after(model):  # noqa: F811
    engine = LLMEngine(model, EngineConfig(num_kv_blocks=64))
    lines: list[str] = []
    core = EngineCore(engine, lambda events: None, StatsLog(0.05, lines.append))
    thread = threading.Thread(target=core.run, daemon=True)
    thread.start()
    core.inbox.put(("add", "a", [(PROMPT, SamplingParams(max_tokens=40, ignore_eos=True))] * 2, False))
    deadline = time.monotonic() + 60
    while engine.num_steps < 40 or engine.has_unfinished():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    time.sleep(0.3)
    after = len(lines)
    time.sleep(0.3)  # idle: no more lines
    core.inbox.put(None)
    thread.join(30)
    assert after >= 1 and len(lines) == after
    assert core.counters["prompt_tokens_total"] == 2 * len(engine.tokenizer.encode(PROMPT))
    assert all(line.startswith("engine: ") and "generation tokens/s" in line for line in lines)
    assert "0 running, 0 waiting" in lines[-1]  # the line after the work ended


@pytest.mark.parametrize("asynchronous", [False, True])
def test_the_engine_counts_each_output_token_once_as_it_settles(model, asynchronous):  # noqa: F811
    """The generation counter grows as tokens settle, and at the end equals the outputs' tokens: a sequence that
    stopped is not counted for the step launched past its end (asynchronous scheduling launches one), nor is it in
    `last_tokens` (the inter-token gaps of /metrics and a replay)."""
    engine = LLMEngine(model, EngineConfig(num_kv_blocks=64, async_scheduling=asynchronous))
    params = [SamplingParams(max_tokens=30, ignore_eos=True), SamplingParams(max_tokens=30, stop=("e",)),
              SamplingParams(max_tokens=7, temperature=1.0, seed=3)]
    ids = [engine.add_request(PROMPT, p) for p in params]
    seen, outputs, settled = [], {}, []
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id] = out
        seen.append(engine.num_generated_tokens)
        settled += [rid for rid, _ in engine.last_tokens]
    assert seen == sorted(seen) and len(set(seen)) > 5  # it grew step by step
    assert engine.num_generated_tokens == sum(len(outputs[i].token_ids) for i in ids) == len(settled)
    assert sorted(settled) == sorted(i for i in ids for _ in outputs[i].token_ids)  # last_tokens: the kept ones
    assert len(outputs[ids[1]].token_ids) < 30  # the stop string ended one early


def test_max_model_len_bounds_prompts_and_outputs(model):  # noqa: F811
    from traces.clikit import UserError

    engine = LLMEngine(model, EngineConfig(num_kv_blocks=64, max_model_len=48))
    ids = engine.tokenizer.encode(PROMPT)
    with pytest.raises(UserError, match="the engine's context holds at most 48 positions"):
        engine.add_request(list(range(5, 53)), SamplingParams(max_tokens=1))
    with pytest.raises(UserError, match=f"ask for at most {48 - len(ids)} tokens"):
        engine.add_request(PROMPT, SamplingParams(max_tokens=100, clip_to_context=False))
    (out,) = engine.generate([PROMPT], SamplingParams(max_tokens=100, ignore_eos=True))
    assert len(out.token_ids) == 48 - len(ids) and out.finish_reason == "length"  # cut at the engine's context
    positions = model.config.max_position
    with pytest.raises(UserError, match=rf"max_model_len \(--max-model-len\) must be in 2..{positions}"):
        LLMEngine(model, EngineConfig(num_kv_blocks=8, max_model_len=positions + 1))


def test_an_explicit_length_that_fills_the_context_exactly_is_served(model):  # noqa: F811
    """clip_to_context False (an API request's explicit max_tokens): prompt + max_tokens up to the context's positions
    is served, one more is refused."""
    from traces.clikit import UserError

    engine = LLMEngine(model, EngineConfig(num_kv_blocks=64, max_model_len=24))
    n = len(engine.tokenizer.encode(PROMPT))
    (out,) = engine.generate([PROMPT], SamplingParams(max_tokens=24 - n, ignore_eos=True, clip_to_context=False))
    assert len(out.token_ids) == 24 - n and out.finish_reason == "length"
    with pytest.raises(UserError, match=f"ask for at most {24 - n} tokens"):
        engine.add_request(PROMPT, SamplingParams(max_tokens=25 - n, clip_to_context=False))


def test_a_request_s_first_token_time_is_its_first_token_s(model):  # noqa: F811
    """first_token_time (time to first token in /metrics) is when the first token settled, not the latest."""
    ticks = iter(range(10**6))
    engine = LLMEngine(model, EngineConfig(num_kv_blocks=64), clock=lambda: float(next(ticks)))
    rid = engine.add_request(PROMPT, SamplingParams(max_tokens=4, ignore_eos=True))
    times, outs = [], []
    while engine.has_unfinished():
        outs += engine.step()
        times += [t for r, t in engine.last_tokens if r == rid]
    assert len(times) == 4 and outs[0].first_token_time == times[0] < times[-1]
