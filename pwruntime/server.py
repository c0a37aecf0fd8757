"""The OpenAI-compatible HTTP server: one engine thread, aiohttp handlers, SSE streaming, metrics.

`EngineWorker` owns the LLMEngine in a thread of its own: handlers submit requests through a
thread-safe queue and get events back on an asyncio queue (token deltas while streaming, then the
finished output). The engine thread steps while any request is unfinished and sleeps on the
submission queue otherwise. Routes: `/v1/completions`, `/v1/chat/completions` (both with
`stream`), `/v1/models`, `/health` and Prometheus `/metrics`. Bad requests get OpenAI's error shape
with status 400; nothing a client sends can stop the engine thread.
"""
from __future__ import annotations

import asyncio
import json
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field

from aiohttp import web

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

    async def submit(self, prompt, params: SamplingParams, stream: bool) -> _Live:
        """Queue a request; its `events`: ("delta", token ids), ("done", RequestOutput) or ("error", message)."""
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
                    self._emit(live, ("error", str(e)))
                item = self._next()
            if item is None or self._stop.is_set():
                break
            if not eng.has_unfinished():
                continue
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


def _error_payload(message: str) -> dict:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": "invalid_request_error", "code": None}}


def _error(message: str, status: int = 400) -> web.Response:
    return web.json_response(_error_payload(message), status=status)


def _params(body: dict) -> SamplingParams:
    def get(key: str, default):
        value = body.get(key)
        return default if value is None else value

    stop = get("stop", ())
    return SamplingParams(max_tokens=int(get("max_tokens", get("max_completion_tokens", 16))),
                          temperature=float(get("temperature", 1.0)), top_p=float(get("top_p", 1.0)),
                          seed=get("seed", None), stop=(stop,) if isinstance(stop, str) else tuple(stop))


class Server:
    """aiohttp application over an EngineWorker."""

    def __init__(self, worker: EngineWorker, model_name: str) -> None:
        self.worker, self.model_name = worker, model_name
        self.tokenizer = worker.engine.tokenizer
        self.app = web.Application()
        self.app.add_routes([web.get("/health", self.health), web.get("/v1/models", self.models),
                             web.get("/metrics", self.metrics), web.post("/v1/completions", self.completions),
                             web.post("/v1/chat/completions", self.chat)])

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.model_name, "object": "model", "created": 0, "owned_by": "pagedweight"}]})

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
            kind = "counter" if name.endswith("_total") else "gauge"
            lines += [f"# TYPE pagedweight_{name} {kind}", f"pagedweight_{name} {value}"]
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

    async def _body(self, request: web.Request) -> dict:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            body = None
            problem = "the body is not valid JSON"
        else:
            problem = "the body must be a JSON object"
        if not isinstance(body, dict):
            raise web.HTTPBadRequest(text=json.dumps(_error_payload(problem)), content_type="application/json")
        return body

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if not isinstance(prompt, str) or not prompt:
            return _error("'prompt' must be a non-empty string")
        return await self._serve(request, body, prompt, chat=False)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("content"), str) for m in messages):
            return _error("'messages' must be a non-empty list of {role, content} objects")
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        except Exception as e:
            return _error(f"cannot apply the chat template: {e}")
        return await self._serve(request, body, self.tokenizer.encode(text, add_special_tokens=False), chat=True)

    async def _serve(self, request: web.Request, body: dict, prompt, chat: bool) -> web.StreamResponse:
        try:
            params = _params(body)
        except (TypeError, ValueError) as e:
            return _error(f"bad sampling parameter: {e}")
        stream = bool(body.get("stream"))
        live = await self.worker.submit(prompt, params, stream)
        events = live.events
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        created = int(time.time())
        obj = "chat.completion" if chat else "text_completion"
        if not stream:
            kind, payload = await events.get()
            if kind == "error":
                return _error(payload)
            return web.json_response(self._final(rid, created, obj, payload, chat))
        try:
            return await self._stream(request, events, params, rid, created, chat)
        except ConnectionResetError:  # the client went away mid-stream
            self.worker.cancel(live)
            raise

    async def _stream(self, request: web.Request, events: asyncio.Queue, params: SamplingParams, rid: str,
                      created: int, chat: bool) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        sent = ""
        chunk_obj = "chat.completion.chunk" if chat else "text_completion"
        if chat:
            await self._sse(resp, self._chunk(rid, created, chunk_obj, {"role": "assistant", "content": ""}, None, chat))
        while True:
            kind, payload = await events.get()
            if kind == "error":
                await self._sse(resp, _error_payload(payload))
                break
            if kind == "delta":
                if params.stop:  # a stop string may still cut the text: send it when finished
                    continue
                text = self.tokenizer.decode(payload)
                if text.startswith(sent) and len(text) > len(sent) and not text.endswith("\ufffd"):
                    await self._sse(resp, self._chunk(rid, created, chunk_obj, text[len(sent):], None, chat))
                    sent = text
                continue
            rest = payload.text[len(sent):] if payload.text.startswith(sent) else ""
            await self._sse(resp, self._chunk(rid, created, chunk_obj, rest, FINISH[payload.finish_reason], chat))
            break
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    def _final(self, rid: str, created: int, obj: str, out, chat: bool) -> dict:
        choice = {"index": 0, "finish_reason": FINISH[out.finish_reason], "logprobs": None}
        choice.update({"message": {"role": "assistant", "content": out.text}} if chat else {"text": out.text})
        usage = {"prompt_tokens": len(out.prompt_token_ids), "completion_tokens": len(out.token_ids),
                 "total_tokens": len(out.prompt_token_ids) + len(out.token_ids)}
        return {"id": rid, "object": obj, "created": created, "model": self.model_name, "choices": [choice],
                "usage": usage}

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
