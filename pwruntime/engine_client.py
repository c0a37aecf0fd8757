"""EngineClient: the HTTP server's side of an EngineCore: each request's event queue, and the engine loop's batches
delivered to them. EngineWorker runs the loop in a thread of this process (tests, and a server over an engine
object); pwruntime.engine_process.EngineProcess runs it in a process of its own (`pwruntime serve`).

A handler `submit`s a request's engine requests (its choices) and reads `Live.events`, the events of
pwruntime.engine_core for its choices, in order; `cancel` aborts a request whose client left. Every batch the loop
emits (one per engine step) reaches each event loop in one `call_soon_threadsafe`. When the engine loop is gone,
every request in flight gets one ("error", (503, message)) and so does every later one.
"""
from __future__ import annotations

import asyncio
import itertools
import threading
from dataclasses import dataclass

from pwruntime.engine_core import EngineCore
from pwruntime.sampling import SamplingParams
from pwruntime.stats_log import serving_info


@dataclass(eq=False)
class Live:
    """One client request: its event queue (the events of all its choices), and the choices not yet done."""
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    key: int
    pending: int


def _put_all(items: list) -> None:
    for live, event in items:
        live.events.put_nowait(event)


class EngineClient:
    """What the server needs of an engine, wherever its loop runs: the tokenizer, the model's vocabulary, what the
    engine serves with (`info`: pwruntime.stats_log.serving_info, its positions `max_model_len` among them), and
    requests in and events out. A subclass sends the loop's inbox items (`_send`) and hands its batches to
    `_deliver`."""

    def __init__(self, tokenizer, vocab: int, info: dict) -> None:
        self.tokenizer, self.vocab, self.info = tokenizer, vocab, info
        self.max_position: int = info["max_model_len"]
        self._lives: dict[int, Live] = {}
        self._keys = itertools.count()
        self._gone: str | None = None  # why the engine loop is gone, once it is
        self._lock = threading.Lock()  # _open against _fail_all: no request registers after the last failure

    @property
    def alive(self) -> bool:
        return self._gone is None

    async def submit(self, requests: list[tuple[str | list[int], SamplingParams]], stream: bool) -> Live:
        """Queue one engine request per (prompt, params), all or none: choice i of the response is requests[i];
        `stream`: deltas come as tokens do (pwruntime.engine_core says what each event holds)."""
        live = self._open(len(requests))
        if self.alive:  # else the request already has its 503
            self._send(("add", live.key, requests, stream))
        return live

    def cancel(self, live: Live) -> None:
        """The client went away: abort its choices (their KV blocks are freed at the next step)."""
        if self._lives.pop(live.key, None) is not None:
            self._send(("abort", live.key))

    async def stats(self) -> dict:
        """The engine loop's counters, gauges and histograms (EngineCore.stats); RuntimeError once it is gone."""
        live = self._open(1)
        if self.alive:
            self._send(("stats", live.key))
        kind, payload = await live.events.get()
        if kind == "error":
            raise RuntimeError(payload[1])
        return payload

    def _open(self, choices: int) -> Live:
        live = Live(asyncio.get_running_loop(), asyncio.Queue(), next(self._keys), choices)
        with self._lock:
            if self._gone is None:
                self._lives[live.key] = live  # before the loop can answer it
                return live
        live.events.put_nowait(("error", (503, self._gone)))
        return live

    def _send(self, item: tuple | None) -> None:
        raise NotImplementedError

    def _deliver(self, events: list) -> None:
        """One batch of the engine loop (any thread): each event to its request's queue, one wake-up per event loop;
        a request is forgotten after its error, its stats or its last choice's "done"."""
        per_loop: dict = {}
        for key, event in events:
            live = self._lives.get(key)
            if live is None:  # cancelled: its client left
                continue
            if event[0] == "done":
                live.pending -= 1
            if event[0] in ("error", "stats") or live.pending == 0:
                self._lives.pop(key, None)
            per_loop.setdefault(live.loop, []).append((live, event))
        for loop, items in per_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # that event loop is closed: nobody waits for these events any more
                pass

    def in_flight(self) -> int:
        """Requests not answered yet."""
        return len(self._lives)

    def shut_down(self, message: str) -> None:
        """The server is stopping: each request in flight gets one ("error", (503, message)) and its choices are
        aborted, and so does every later one."""
        with self._lock:
            self._gone = message
            keys = list(self._lives)
        for key in keys:
            self._send(("abort", key))
        self._deliver([(key, ("error", (503, message))) for key in keys])

    def _fail_all(self, message: str) -> None:
        """The engine loop is gone: every request in flight, and every later one, gets a 503 with `message`."""
        with self._lock:
            self._gone = message
            keys = list(self._lives)
        self._deliver([(key, ("error", (503, message))) for key in keys])


class EngineWorker(EngineClient):
    """An EngineCore in a thread of this process, over an LLMEngine object (`engine`)."""

    def __init__(self, engine) -> None:
        config = engine.model.config
        super().__init__(engine.tokenizer, config.vocab, serving_info(engine))
        self.engine = engine
        self.core = EngineCore(engine, self._deliver)
        self._thread = threading.Thread(target=self._run, name="pagedweight-engine", daemon=True)

    def start(self) -> "EngineWorker":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._send(None)
        self._thread.join(timeout=10)

    def _send(self, item: tuple | None) -> None:
        self.core.inbox.put(item)

    def _run(self) -> None:
        try:
            self.core.run()
        finally:
            self._fail_all("the engine thread stopped; restart the server")
