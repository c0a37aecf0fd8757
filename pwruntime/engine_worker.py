"""EngineWorker: the thread that owns an LLMEngine while it serves HTTP requests.

Handlers `submit` a request's engine requests (its choices) through a thread-safe queue and get events back on the
request's asyncio queue (`Live.events`): token deltas while streaming, each choice's finished output, or one error.
The thread steps the engine while any request is unfinished and sleeps on the queue otherwise; a step that fails
fails the requests in flight and the thread goes on; `cancel` aborts a request whose client left.
"""
from __future__ import annotations

import asyncio
import queue
import sys
import threading
import traceback
from dataclasses import dataclass, field

from pwruntime.metrics import RequestMetrics
from pwruntime.sampling import SamplingParams


@dataclass(eq=False)
class Live:
    """One HTTP request: its event queue (the events of all its choices) and whether it streams."""
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    stream: bool


@dataclass
class _Choice:
    """One engine request: a choice of an HTTP request (its index in the response)."""
    live: Live
    index: int
    sent_tokens: int = 0


@dataclass
class EngineWorker:
    engine: object  # pwruntime.engine.LLMEngine
    _inbox: queue.Queue = field(default_factory=queue.Queue)
    _live: dict = field(default_factory=dict)  # engine request id -> _Choice
    _stop: threading.Event = field(default_factory=threading.Event)
    metrics: dict = field(default_factory=lambda: {"requests_total": 0, "generated_tokens_total": 0,
                                                    "request_errors_total": 0, "aborted_total": 0})

    def __post_init__(self) -> None:
        self.request_metrics = RequestMetrics(self.engine.model.config.max_position)

    def start(self) -> "EngineWorker":
        self._thread = threading.Thread(target=self._run, name="pagedweight-engine", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._inbox.put(None)
        self._thread.join(timeout=10)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    async def submit(self, requests: list[tuple[str | list[int], SamplingParams]], stream: bool) -> Live:
        """Queue one engine request per (prompt, params), all or none: choice i of the response is requests[i]. The
        `events`: ("delta", (choice index, token ids, their log-probability records, the engine's PromptOutput on a
        choice's first delta, else None)) while streaming, ("done",
        (choice index, RequestOutput)) for each choice, or one ("error", (status, message)), after which none of the
        choices runs any more."""
        live = Live(asyncio.get_running_loop(), asyncio.Queue(), stream)
        self._inbox.put(("add", requests, live))
        return live

    def cancel(self, live: Live) -> None:
        """The client went away: abort its choices (their KV blocks are freed at the next step)."""
        self._inbox.put(("abort", live))

    def _emit(self, live: Live, event: tuple) -> None:
        live.loop.call_soon_threadsafe(live.events.put_nowait, event)

    def _next(self):
        try:
            return self._inbox.get_nowait()
        except queue.Empty:
            return ()

    def _run(self) -> None:
        eng = self.engine
        while not self._stop.is_set():
            try:
                item = self._inbox.get(timeout=None if not eng.has_unfinished() else 0)
            except queue.Empty:
                item = ()
            while item:
                if item[0] == "abort":
                    self._abort(item[1])
                else:
                    self._add(*item[1:])
                item = self._next()
            if item is None or self._stop.is_set():
                break
            if not eng.has_unfinished():
                continue
            try:
                self._step()
            except Exception as e:  # a bug: fail the requests in flight, keep serving the next ones
                traceback.print_exc(file=sys.stderr)
                self._fail_all(f"the engine failed while generating ({type(e).__name__}: {e})")

    def _add(self, requests: list[tuple[str | list[int], SamplingParams]], live: Live) -> None:
        eng, rids = self.engine, []
        try:
            for prompt, params in requests:
                rids.append(eng.add_request(prompt, params))
        except Exception as e:  # a prompt the engine refuses (too long, empty ...)
            for rid in rids:
                eng.abort(rid)
            self.metrics["request_errors_total"] += len(requests)
            self._emit(live, ("error", (400, str(e))))
            return
        self._live.update({rid: _Choice(live, i) for i, rid in enumerate(rids)})
        self.metrics["requests_total"] += len(rids)

    def _abort(self, live: Live) -> None:
        rids = [rid for rid, choice in self._live.items() if choice.live is live]
        for rid in rids:
            del self._live[rid]
            self.engine.abort(rid)
        self.metrics["aborted_total"] += len(rids)

    def _fail_all(self, message: str) -> None:
        for live in dict.fromkeys(choice.live for choice in self._live.values()):
            self._emit(live, ("error", (500, message)))
        for rid in self._live:
            try:
                self.engine.abort(rid)
            except Exception:  # the engine may be in any state here; the next step will show it
                traceback.print_exc(file=sys.stderr)
        self.metrics["request_errors_total"] += len(self._live)
        self._live.clear()

    def _step(self) -> None:
        eng = self.engine
        for out in eng.step():
            choice = self._live.pop(out.request_id, None)
            self.metrics["generated_tokens_total"] += len(out.token_ids)
            self.request_metrics.observe(out)
            if choice is not None:
                self._emit(choice.live, ("done", (choice.index, out)))
        for rid, choice in self._live.items():
            if choice.live.stream:
                start = choice.sent_tokens
                toks = eng.tokens_so_far(rid, start)
                if toks:
                    head = eng.prompt_of(rid) if start == 0 else None
                    self._emit(choice.live, ("delta", (choice.index, toks, eng.logprobs_so_far(rid, start), head)))
                    choice.sent_tokens += len(toks)
