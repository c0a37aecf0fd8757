"""The OpenAI-compatible HTTP server: one engine thread, aiohttp handlers, SSE streaming, metrics.

`EngineWorker` owns the LLMEngine in a thread of its own: handlers submit requests through a
thread-safe queue and get events back on an asyncio queue (token deltas while streaming, then the
finished output). The engine thread steps while any request is unfinished and sleeps on the
submission queue otherwise. Routes: `/v1/completions`, `/v1/chat/completions` (both with
`stream`), `/v1/models`, `/health` and Prometheus `/metrics`. Bad requests get OpenAI's error shape
with status 400 (pwruntime.api_request checks the fields), unknown models and routes 404, and nothing a client
sends can stop the engine thread: a failing step fails the requests in it (status 500) and the thread goes on. A
client that leaves (a closed stream, or a timed-out non-streaming request; the server runs with aiohttp's handler
cancellation) has its request aborted and its KV blocks freed.
"""
from __future__ import annotations

import asyncio
import json
import queue
import sys
import threading
import time
import traceback
import uuid
from dataclasses import dataclass, field

from aiohttp import web

from pwruntime import api_request as api
from pwruntime.sampling import SamplingParams

FINISH = {"stop": "stop", "length": "length", "kv_capacity": "length", "abort": "stop"}


@dataclass
class _Live:
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    stream: bool
    sent_tokens: int = 0


@dataclass
class EngineWorker:
    engine: object  # pwruntime.engine.LLMEngine
    _inbox: queue.Queue = field(default_factory=queue.Queue)
    _live: dict = field(default_factory=dict)  # request id -> _Live
    _stop: threading.Event = field(default_factory=threading.Event)
    metrics: dict = field(default_factory=lambda: {"requests_total": 0, "generated_tokens_total": 0,
                                                    "request_errors_total": 0, "aborted_total": 0})

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

    async def submit(self, prompt, params: SamplingParams, stream: bool) -> _Live:
        """Queue a request; its `events`: ("delta", token ids), ("done", RequestOutput) or ("error", (status,
        message))."""
        live = _Live(asyncio.get_running_loop(), asyncio.Queue(), stream)
        self._inbox.put((prompt, params, live))
        return live

    def cancel(self, live: _Live) -> None:
        """The client went away: abort its request (its KV blocks are freed at the next step)."""
        self._inbox.put(("abort", None, live))

    def _emit(self, live: _Live, event: tuple) -> None:
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
                prompt, params, live = item
                if prompt == "abort":
                    rid = next((r for r, lv in self._live.items() if lv is live), None)
                    if rid is not None:
                        self._live.pop(rid)
                        eng.abort(rid)
                        self.metrics["aborted_total"] += 1
                    item = self._next()
                    continue
                try:
                    rid = eng.add_request(prompt, params)
                    self._live[rid] = live
                    self.metrics["requests_total"] += 1
                except Exception as e:  # a prompt the engine refuses (too long, empty ...)
                    self.metrics["request_errors_total"] += 1
                    self._emit(live, ("error", (400, str(e))))
                item = self._next()
            if item is None or self._stop.is_set():
                break
            if not eng.has_unfinished():
                continue
            try:
                self._step()
            except Exception as e:  # a bug: fail the requests in flight, keep serving the next ones
                traceback.print_exc(file=sys.stderr)
                for rid, live in self._live.items():
                    self._emit(live, ("error", (500, f"the engine failed while generating ({type(e).__name__}: {e})")))
                    try:
                        eng.abort(rid)
                    except Exception:  # the engine may be in any state here; the next step will show it
                        traceback.print_exc(file=sys.stderr)
                self.metrics["request_errors_total"] += len(self._live)
                self._live.clear()

    def _step(self) -> None:
        eng = self.engine
        for out in eng.step():
            live = self._live.pop(out.request_id, None)
            self.metrics["generated_tokens_total"] += len(out.token_ids)
            if live is not None:
                self._emit(live, ("done", out))
        for rid, live in self._live.items():
            if live.stream:
                toks = eng.tokens_so_far(rid)
                if len(toks) > live.sent_tokens:
                    self._emit(live, ("delta", toks))  # tokens_so_far returns a copy
                    live.sent_tokens = len(toks)


COUNTERS = ("requests_total", "generated_tokens_total", "request_errors_total", "aborted_total", "plans_total",
            "steps_total")


def _error_payload(message: str, status: int = 400, code: str | None = None) -> dict:
    """OpenAI's error object."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "code": code}}


def _error(message: str, status: int = 400, code: str | None = None) -> web.Response:
    return web.json_response(_error_payload(message, status, code), status=status)


@web.middleware
async def _json_errors(request: web.Request, handler):
    """aiohttp's own errors (unknown route, wrong method, body too large, a bad request) in OpenAI's shape."""
    try:
        return await handler(request)
    except api.RequestError as e:
        return _error(str(e), e.status, e.code)
    except web.HTTPException as e:
        if e.content_type == "application/json" or e.status < 400:
            raise
        message = {404: f"no route {request.method} {request.path}",
                   405: f"{request.method} is not allowed on {request.path}"}.get(e.status, e.text or e.reason)
        return _error(message, e.status)


class Server:
    """aiohttp application over an EngineWorker."""

    def __init__(self, worker: EngineWorker, model_name: str) -> None:
        self.worker, self.model_name = worker, model_name
        self.tokenizer = worker.engine.tokenizer
        self.app = web.Application(middlewares=[_json_errors])
        self.app.add_routes([web.get("/health", self.health), web.get("/v1/models", self.models),
                             web.get("/v1/models/{model}", self.model), web.get("/metrics", self.metrics),
                             web.post("/v1/completions", self.completions), web.post("/v1/chat/completions", self.chat)])

    async def health(self, request: web.Request) -> web.Response:
        if not self.worker.alive:
            return web.json_response({"status": "engine stopped"}, status=503)
        return web.json_response({"status": "ok"})

    def _model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": 0, "owned_by": "pagedweight"}

    def _check_model(self, name) -> None:
        if name is not None and name != self.model_name:
            raise api.RequestError(f"the model {json.dumps(name)} does not exist; this server serves "
                                   f"{json.dumps(self.model_name)}", 404, "model_not_found")

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._model_card()]})

    async def model(self, request: web.Request) -> web.Response:
        self._check_model(request.match_info["model"])
        return web.json_response(self._model_card())

    async def metrics(self, request: web.Request) -> web.Response:
        eng, m = self.worker.engine, dict(self.worker.metrics)
        lines = []
        gauges = {"running_requests": len(eng.scheduler.running), "waiting_requests": len(eng.scheduler.waiting),
                  "kv_blocks_free": eng.pool.num_free, "kv_blocks_total": eng.pool.capacity,
                  "mean_committed_bits": eng.table.mean_bits(), "expert_resident_bytes": eng.table.resident_bytes(),
                  "plans_total": eng.loop.num_plans, "steps_total": eng.num_steps}
        if hasattr(eng.loop.mover, "metrics"):  # page moves: transfers, bytes, copy times
            gauges.update(eng.loop.mover.metrics())
        for name, value in {**m, **gauges}.items():
            kind = "counter" if name in COUNTERS else "gauge"
            lines += [f"# TYPE pagedweight_{name} {kind}", f"pagedweight_{name} {value}"]
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

    async def _body(self, request: web.Request) -> dict:
        body = api.parse_body(await request.read())
        self._check_model(body.get("model"))
        api.check_unsupported(body)
        return body

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        prompt = api.completion_prompt(body)
        return await self._serve(request, body, prompt, api.sampling_params(body, 16), chat=False)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        messages = api.chat_messages(body)
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
            ids = self.tokenizer.encode(text, add_special_tokens=False)
        except Exception as e:
            return _error(f"cannot apply the chat template to 'messages': {e}")
        # as OpenAI: without max_tokens an answer may run to the end of the context (the engine stops it there)
        return await self._serve(request, body, ids, api.sampling_params(body, 1 << 30), chat=True)

    async def _serve(self, request: web.Request, body: dict, prompt, params: SamplingParams,
                     chat: bool) -> web.StreamResponse:
        stream, usage = api.flag(body, "stream"), api.include_usage(body)
        live = await self.worker.submit(prompt, params, stream)
        try:
            kind, payload = await live.events.get()  # the first event: an error is still a plain error response
            if kind == "error":
                return _error(payload[1], payload[0])
            rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
            obj = "chat.completion" if chat else "text_completion"
            if not stream:
                return web.json_response(self._final(rid, int(time.time()), obj, payload, chat))
            return await self._stream(request, live, (kind, payload), params, rid, chat, usage)
        except asyncio.CancelledError:  # the client left (aiohttp cancels the handler): free its request
            self.worker.cancel(live)
            raise

    async def _stream(self, request: web.Request, live: _Live, first: tuple, params: SamplingParams, rid: str,
                      chat: bool, usage: bool) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        try:
            await self._events(resp, live.events, first, params, rid, chat, usage)
        except ConnectionResetError:  # the client left while an event was written: free its request, no traceback
            self.worker.cancel(live)
        return resp

    async def _events(self, resp: web.StreamResponse, events: asyncio.Queue, first: tuple, params: SamplingParams,
                      rid: str, chat: bool, usage: bool) -> None:
        created, sent = int(time.time()), ""
        chunk_obj = "chat.completion.chunk" if chat else "text_completion"
        # a stop string may still cut the text: hold back as many characters as could begin one
        hold = max((len(s) for s in params.stop), default=1) - 1
        if chat:
            await self._sse(resp, self._chunk(rid, created, chunk_obj, {"role": "assistant", "content": ""}, None, chat))
        kind, payload = first
        while True:
            if kind == "error":
                await self._sse(resp, _error_payload(payload[1], payload[0]))
                break
            if kind == "delta":
                text = self.tokenizer.decode(payload)
                ready = text[:len(text) - hold] if hold else text
                if ready.startswith(sent) and len(ready) > len(sent) and not ready.endswith("\ufffd"):
                    await self._sse(resp, self._chunk(rid, created, chunk_obj, ready[len(sent):], None, chat))
                    sent = ready
                kind, payload = await events.get()
                continue
            rest = payload.text[len(sent):] if payload.text.startswith(sent) else ""
            await self._sse(resp, self._chunk(rid, created, chunk_obj, rest, FINISH[payload.finish_reason], chat))
            if usage:
                await self._sse(resp, {"id": rid, "object": chunk_obj, "created": created, "model": self.model_name,
                                       "choices": [], "usage": self._usage(payload)})
            break
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()

    def _final(self, rid: str, created: int, obj: str, out, chat: bool) -> dict:
        choice = {"index": 0, "finish_reason": FINISH[out.finish_reason], "logprobs": None}
        choice.update({"message": {"role": "assistant", "content": out.text}} if chat else {"text": out.text})
        return {"id": rid, "object": obj, "created": created, "model": self.model_name, "choices": [choice],
                "usage": self._usage(out)}

    @staticmethod
    def _usage(out) -> dict:
        return {"prompt_tokens": len(out.prompt_token_ids), "completion_tokens": len(out.token_ids),
                "total_tokens": len(out.prompt_token_ids) + len(out.token_ids)}

    def _chunk(self, rid: str, created: int, obj: str, delta, finish: str | None, chat: bool) -> dict:
        choice = {"index": 0, "finish_reason": finish, "logprobs": None}
        if chat:
            choice["delta"] = delta if isinstance(delta, dict) else ({"content": delta} if delta else {})
        else:
            choice["text"] = delta
        return {"id": rid, "object": obj, "created": created, "model": self.model_name, "choices": [choice]}

    @staticmethod
    async def _sse(resp: web.StreamResponse, data: dict) -> None:
        await resp.write(f"data: {json.dumps(data)}\n\n".encode())
