"""The OpenAI-compatible HTTP server: aiohttp handlers over one engine loop, SSE streaming, metrics.

An EngineClient (pwruntime.engine_client) stands for the engine loop, which runs in a process of its own under
`pwruntime serve` (pwruntime.engine_process) or in a thread (EngineWorker, over an engine object); the handlers
submit requests to it and answer from its events. A stream writes the chunks of all the events that have arrived
in one write. Routes: `/v1/completions`, `/v1/chat/completions` (both with `stream`), `/v1/models`, `/health`,
`/version`, `/server_info` (what the engine serves with), Prometheus `/metrics`, and vLLM's `/tokenize` and
`/detokenize`. Bad requests get OpenAI's error shape with status 400 (pwruntime.api_request checks the fields),
unknown models and routes 404, a /v1 request without the server's API key (when it has one) 401, and nothing a
client sends can stop the engine loop: a failing step fails the requests in it (status 500) and the loop goes on; an
engine loop that is gone fails every request with a 503. A
client that leaves (a closed stream, or a timed-out non-streaming request; the server runs with aiohttp's handler
cancellation) has its request aborted and its KV blocks freed.

A request is a list of engine requests (its prompts' `n` choices each, prompt-major: pwruntime.api_request),
added together or not at all; one failing fails the request and ends the others, and a client that leaves aborts
them all. The request counters and histograms of /metrics count engine requests (a request for n choices of k
prompts counts k x n; the histograms: pwruntime.metrics). Choice text and log-probabilities: pwruntime.api_tokens.
A choice shows its prompt with completions' `echo` (its text, and its log-probabilities when asked; `max_tokens` 0:
the prompt alone, the engine's one token left out) and with vLLM's `prompt_logprobs`; streamed, in the choice's
first chunk (`_Reply.prompt_parts`).
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import signal
import threading
import time
import uuid
from dataclasses import dataclass

from aiohttp import web

from pwruntime import api_request as api
from pwruntime import api_tokens
from pwruntime.engine_client import EngineClient, Live
from pwruntime.metrics import scalar
from pwruntime.sampling import SamplingParams

def _package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("pagedweight")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


FINISH = {"stop": "stop", "length": "length", "kv_capacity": "length", "abort": "stop"}


MAX_BODY_BYTES = 256 << 20  # a request's JSON: 64 prompts of 100k token ids fit (aiohttp's default is 1 MiB)
PARSE_OFF_LOOP_BYTES = 1 << 20  # a larger body is parsed in a thread, as every text is encoded: the event loop streams
# the other requests meanwhile
NORMALIZER_SLACK = 4  # characters a tokenizer's normalizer may fold into one (NFKC composes at most a few)

GAUGES_NAMED_TOTAL = ("kv_blocks_total",)  # the KV pool's blocks, which go down as well as up: every other *_total
# scalar (the requests', the engine's, the page mover's) is a counter


def _error_payload(message: str, status: int = 400, code: str | None = None) -> dict:
    """OpenAI's error object."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}


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


def _bearer(api_key: str):
    """Middleware: a /v1 request without `Authorization: Bearer <api_key>` gets a 401 in OpenAI's shape (/health,
    /metrics and the tokenizer routes stay open, as vLLM's)."""
    want = f"Bearer {api_key}".encode()

    @web.middleware
    async def check(request: web.Request, handler):
        given = request.headers.get("Authorization", "").encode()
        if request.path.startswith("/v1") and not hmac.compare_digest(given, want):
            return _error("a valid API key is needed: send 'Authorization: Bearer <key>' with the server's key "
                          "(--api-key)", 401, "invalid_api_key")
        return await handler(request)
    return check


@dataclass(frozen=True)
class _Reply:
    """What the response (or every chunk) of one request shares."""
    id: str
    created: int
    model: str
    chat: bool
    logprobs: bool  # asked for
    n: int  # choices per prompt: choice i is of prompt i // n
    echo: bool = False  # completions: each choice's text begins with its prompt
    generates: bool = True  # False: an echo with max_tokens 0 (the prompt alone; the engine's one token left out)
    echo_top: int | None = None  # the alternatives an echoed prompt token shows (`logprobs` N)
    prompt_top: int | None = None  # vLLM's `prompt_logprobs` N: each choice has its prompt's records

    @property
    def object(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    @property
    def chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def logprobs_of(self, pieces: list, offset: int) -> dict | None:
        """The `logprobs` of a choice or chunk that carries `pieces` (None when not asked for); `offset`: where
        their text starts in the choice's text."""
        if not self.logprobs:
            return None
        return api_tokens.chat_logprobs(pieces) if self.chat else api_tokens.completion_logprobs(pieces, offset)

    @property
    def shows_prompt(self) -> bool:
        return self.echo or self.prompt_top is not None

    def prompt_parts(self, tokenizer, head) -> tuple[str, dict | None, list | None]:
        """What a choice shows of its prompt (`head`: a RequestOutput or PromptOutput): the echoed text, its
        log-probabilities (when echoed and asked) and vLLM's `prompt_logprobs` (when asked); ("", None, None) when
        it shows none."""
        text, logprobs, entries = "", None, None
        ids, records = head.prompt_token_ids, head.prompt_logprobs
        if self.echo:
            text = head.prompt if head.prompt is not None else tokenizer.decode(ids)
            if self.logprobs:
                logprobs = self.logprobs_of(api_tokens.prompt_pieces(tokenizer, ids, records, self.echo_top), 0)
        if self.prompt_top is not None:
            entries = api_tokens.prompt_logprobs_entries(api_tokens.prompt_pieces(tokenizer, ids, records,
                                                                                  self.prompt_top))
        return text, logprobs, entries

    def chunk(self, index: int, delta, logprobs: dict | None, finish: str | None) -> dict:
        """A streamed chunk of choice `index`: `delta` is its text (or, in chat, a whole delta object)."""
        choice = {"index": index, "finish_reason": finish, "logprobs": logprobs}
        if self.chat:
            choice["delta"] = delta if isinstance(delta, dict) else ({"content": delta} if delta else {})
        else:
            choice["text"] = delta
        return {**self.head(self.chunk_object), "choices": [choice]}


class Server:
    """aiohttp application over an engine loop (its EngineClient)."""

    def __init__(self, worker: EngineClient, model_name: str, api_key: str | None = None,
                 shutdown_timeout: float = 60.0) -> None:
        """`api_key`: when given, every /v1 route needs `Authorization: Bearer <api_key>` (as vLLM's --api-key).
        `shutdown_timeout`: how long requests in flight may run once the server stops (`_drain`)."""
        self.worker, self.model_name, self.shutdown_timeout = worker, model_name, shutdown_timeout
        self.tokenizer, self.vocab = worker.tokenizer, worker.vocab
        # a text longer than this cannot fit the context: refused before it is encoded
        self.max_prompt_chars = worker.max_position * self.tokenizer.longest_token_chars() * NORMALIZER_SLACK
        self.app = web.Application(middlewares=[_json_errors] + ([_bearer(api_key)] if api_key else []),
                                   client_max_size=MAX_BODY_BYTES)
        self.app.add_routes([web.get("/health", self.health), web.get("/version", self.version),
                             web.get("/server_info", self.server_info),
                             web.get("/v1/models", self.models),
                             web.get("/v1/models/{model}", self.model), web.get("/metrics", self.metrics),
                             web.post("/v1/completions", self.completions), web.post("/v1/chat/completions", self.chat),
                             web.post("/tokenize", self.tokenize), web.post("/detokenize", self.detokenize)])
        self.app.on_shutdown.append(self._drain)

    async def _drain(self, app: web.Application) -> None:
        """Once the server stops listening: let the requests in flight run up to `shutdown_timeout` seconds, then
        end each one still running with a 503 (a stream with an error event and [DONE]), which aiohttp's own wait
        then sees finish. A second Ctrl-C or SIGTERM meanwhile ends them at once (aiohttp's handler for it would
        cut them with a traceback each)."""
        loop, now = asyncio.get_running_loop(), asyncio.Event()
        _take_signals(loop, now.set)  # until aiohttp's cleanup removes them
        deadline = loop.time() + self.shutdown_timeout
        while self.worker.in_flight() and not now.is_set() and loop.time() < deadline:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(now.wait(), min(0.05, max(0.0, deadline - loop.time())))
        if self.worker.in_flight():
            self.worker.shut_down("the server is shutting down; send the request again once it is back")

    async def health(self, request: web.Request) -> web.Response:
        if not self.worker.alive:
            return web.json_response({"status": "engine stopped"}, status=503)
        return web.json_response({"status": "ok"})

    async def version(self, request: web.Request) -> web.Response:
        """vLLM's /version: this server's package version."""
        return web.json_response({"version": _package_version()})

    async def server_info(self, request: web.Request) -> web.Response:
        """What the server serves with (as vLLM's /server_info): the model's name, the package version, and the
        engine's device, scheduler limits, KV pool at start and experts (pwruntime.stats_log.serving_info)."""
        return web.json_response({"model": self.model_name, "version": _package_version(),
                                  "engine": self.worker.info})

    def _model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": 0, "owned_by": "pagedweight",
                "max_model_len": self.worker.max_position}

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
        try:
            stats = await self.worker.stats()  # asked of the engine loop, between two of its steps
        except RuntimeError as e:
            return _error(str(e), 503)
        lines = []
        for name, value in {**stats["counters"], **stats["gauges"]}.items():
            counter = name.endswith("_total") and name not in GAUGES_NAMED_TOTAL
            lines += scalar(name, "counter" if counter else "gauge", value)
        lines += stats["histograms"]
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

    async def _parsed(self, request: web.Request) -> dict:
        """The JSON body, for the served model (a `model` naming another is a 404)."""
        raw = await request.read()
        body = api.parse_body(raw) if len(raw) <= PARSE_OFF_LOOP_BYTES else await _off_loop(api.parse_body, raw)
        self._check_model(body.get("model"))
        return body

    def _check_length(self, named: list[tuple[str, str]]) -> None:
        """Refuse a text that cannot fit the context, of (text, its name), before spending the time to encode it."""
        for text, name in named:
            if len(text) > self.max_prompt_chars:
                raise api.RequestError(f"{name} has {len(text):,} characters, more than the model's context of "
                                       f"{self.worker.max_position:,} tokens can hold; shorten it")

    def _encoded(self, prompts: list) -> list[tuple[list[int], str | None]]:
        """Each prompt's token ids, and the text they were encoded from (None for a prompt of token ids)."""
        return [(self.tokenizer.encode(p), p) if isinstance(p, str) else (list(p), None) for p in prompts]

    async def _body(self, request: web.Request, chat: bool) -> dict:
        """A completion's body, without the options this server does not serve."""
        body = await self._parsed(request)
        api.check_unsupported(body, chat)
        return body

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request, chat=False)
        prompts = api.completion_prompts(body, self.vocab)
        params = api.sampling_params(body, 16, chat=False, vocab=self.vocab, echo=api.flag(body, "echo"))
        self._check_length([(p, "prompt" if len(prompts) == 1 else f"prompt[{i}]") for i, p in enumerate(prompts)
                            if isinstance(p, str)])
        return await self._serve(request, body, await _off_loop(self._encoded, prompts), params, chat=False)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request, chat=True)
        messages = api.chat_messages(body)
        params = api.sampling_params(body, 1 << 30, chat=True, vocab=self.vocab)
        self._check_length([("".join(m["content"] for m in messages), "'messages'")])
        ids = await _off_loop(self._chat_ids, messages, True)
        # as OpenAI: without max_tokens an answer may run to the end of the context (the engine stops it there)
        return await self._serve(request, body, [(ids, None)], params, chat=True)

    def _chat_ids(self, messages: list[dict], add_generation_prompt: bool) -> list[int]:
        """The prompt token ids of a conversation: the chat template's text (which holds the BOS token)."""
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
            return self.tokenizer.encode(text, add_special_tokens=False)
        except Exception as e:
            raise api.RequestError(f"cannot apply the chat template to 'messages': {e}") from None

    async def tokenize(self, request: web.Request) -> web.Response:
        """vLLM's /tokenize: the token ids a completion's `prompt` (a string; `add_special_tokens`, default true) or
        a chat's `messages` (`add_generation_prompt`, default true) becomes, as the endpoints encode them."""
        body = await self._parsed(request)
        if ("prompt" in body) == ("messages" in body):
            raise api.RequestError("/tokenize takes a 'prompt' (a string) or 'messages' (a chat), one of them")
        def flag_on(key: str) -> bool:  # true unless sent false
            return body.get(key) is None or api.flag(body, key)

        if "messages" in body:
            ids = await _off_loop(self._chat_ids, api.chat_messages(body), flag_on("add_generation_prompt"))
        else:
            prompt = body["prompt"]
            if not isinstance(prompt, str):
                raise api.RequestError(f"'prompt' must be a string, got {api.brief(prompt)}")
            api.check_text(prompt, "prompt")
            ids = await _off_loop(self.tokenizer.encode, prompt, flag_on("add_special_tokens"))
        return web.json_response({"count": len(ids), "max_model_len": self.worker.max_position,
                                  "tokens": ids})

    async def detokenize(self, request: web.Request) -> web.Response:
        """vLLM's /detokenize: the text of `tokens` (token ids; special tokens left out, as in a choice's text)."""
        body = await self._parsed(request)
        if "tokens" not in body:
            raise api.RequestError("/detokenize takes 'tokens': a list of token ids")
        return web.json_response({"prompt": self.tokenizer.decode(list(api.token_ids(body, "tokens", self.vocab)))})

    async def _serve(self, request: web.Request, body: dict, prompts: list, params: SamplingParams,
                     chat: bool) -> web.StreamResponse:
        stream, usage = api.flag(body, "stream"), api.include_usage(body)
        n = api.num_choices(body)
        requests = api.engine_requests(prompts, params, n)
        live = await self.worker.submit(requests, stream)
        try:
            kind, payload = first = await live.events.get()  # an error is still a plain error response
            if kind == "error":
                return _error(payload[1], payload[0])
            echo = api.flag(body, "echo")
            reply = _Reply(f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}", int(time.time()),
                           self.model_name, chat, params.logprobs is not None, n, echo, not api.prompt_only(body),
                           params.logprobs, body.get("prompt_logprobs"))
            if not stream:
                return await self._whole(live, first, len(requests), reply)
            return await self._stream(request, live, first, params, len(requests), reply, usage)
        except asyncio.CancelledError:  # the client left (aiohttp cancels the handler): free its choices
            self.worker.cancel(live)
            raise

    async def _whole(self, live: Live, event: tuple, total: int, reply: _Reply) -> web.Response:
        """The response once each of its `total` choices is done (an error fails them all: the worker ended the
        others)."""
        outs = [None] * total
        while True:
            kind, payload = event
            if kind == "error":
                return _error(payload[1], payload[0])
            outs[payload[0]] = payload[1]
            if all(out is not None for out in outs):
                break
            event = await live.events.get()
        choices = []
        for i, out in enumerate(outs):
            text = out.text if reply.generates else ""
            pieces = api_tokens.choice_pieces(self.tokenizer, out) if reply.logprobs and reply.generates else []
            shown, logprobs, entries = reply.prompt_parts(self.tokenizer, out)
            finish = FINISH[out.finish_reason] if reply.generates else "length"
            choice = {"index": i, "finish_reason": finish,
                      "logprobs": _joined(logprobs, reply.logprobs_of(pieces, len(shown)))}
            choice.update({"message": {"role": "assistant", "content": text}} if reply.chat else {"text": shown + text})
            if reply.prompt_top is not None:
                choice["prompt_logprobs"] = entries
            choices.append(choice)
        usage = _usage(outs, reply.n, reply.generates)
        return web.json_response({**reply.head(reply.object), "choices": choices, "usage": usage})

    async def _stream(self, request: web.Request, live: Live, first: tuple, params: SamplingParams,
                      total: int, reply: _Reply, usage: bool) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        try:
            await self._events(resp, live.events, first, params, total, reply, usage)
        except ConnectionResetError:  # the client left while an event was written: free its choices, no traceback
            self.worker.cancel(live)
        return resp

    async def _events(self, resp: web.StreamResponse, events: asyncio.Queue, event: tuple, params: SamplingParams,
                      total: int, reply: _Reply, usage: bool) -> None:
        """The chunks of the `total` choices as their tokens come, interleaved, each choice ending with a chunk that
        carries its finish reason; then the usage chunk when asked for. A stop string may still cut the text: as many
        characters as could begin one are held back (pwruntime.api_tokens.TextStream)."""
        hold = max((len(s) for s in params.stop), default=1) - 1
        streams = [api_tokens.TextStream(self.tokenizer, hold) for _ in range(total)]
        outs = [None] * total
        shown: list[int | None] = [None] * total  # per choice, once its prompt went out: the prompt's characters
        pending: list[bytes] = []  # the chunks not yet written
        send = pending.append
        if reply.chat:
            for i in range(total):
                send(_sse(reply.chunk(i, {"role": "assistant", "content": ""}, None, None)))
        while True:
            kind, payload = event
            if kind == "error":
                send(_sse(_error_payload(payload[1], payload[0])))
                break
            i = payload[0]
            if shown[i] is None:  # the choice's first event: its prompt first (echo, prompt_logprobs)
                shown[i] = 0
                if reply.shows_prompt:
                    text, logprobs, entries = reply.prompt_parts(self.tokenizer, payload[1] if kind == "done"
                                                                 else payload[3])
                    chunk = reply.chunk(i, text, logprobs, None)
                    if reply.prompt_top is not None:
                        chunk["choices"][0]["prompt_logprobs"] = entries
                    send(_sse(chunk))
                    shown[i] = len(text)
            offset = shown[i] + streams[i].sent_chars
            if kind == "delta":
                text, pieces = streams[i].push(*payload[1:3])
                if reply.generates and (text or (reply.logprobs and pieces)):
                    send(_sse(reply.chunk(i, text, reply.logprobs_of(pieces, offset), None)))
            else:
                outs[i] = payload[1]
                text, pieces = streams[i].finish(outs[i])
                if reply.generates:
                    send(_sse(reply.chunk(i, text, reply.logprobs_of(pieces, offset),
                                          FINISH[outs[i].finish_reason])))
                else:
                    send(_sse(reply.chunk(i, "", reply.logprobs_of([], offset), "length")))
                if all(out is not None for out in outs):
                    if usage:
                        usage_chunk = {**reply.head(reply.chunk_object), "choices": [],
                                       "usage": _usage(outs, reply.n, reply.generates)}
                        send(_sse(usage_chunk))
                    break
            if pending and events.empty():  # nothing more has arrived: what came so far goes out now
                await resp.write(b"".join(pending))
                pending.clear()
            event = await events.get()
        send(b"data: [DONE]\n\n")
        await resp.write(b"".join(pending))
        await resp.write_eof()


def _take_signals(loop: asyncio.AbstractEventLoop, handler) -> None:
    """Point SIGINT and SIGTERM at `handler` where this loop handles signals (the main thread of `pwruntime
    serve`)."""
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                loop.add_signal_handler(sig, handler)


async def _off_loop(fn, *args):
    """`fn(*args)` in a thread of the event loop's executor: parsing a large body, encoding a long text or rendering a
    chat template holds up no other request's stream (the tokenizer's encoding runs without the GIL)."""
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)


def _usage(outs: list, n: int, generates: bool = True) -> dict:
    """Each prompt counted once (its choices are outs[i * n: (i + 1) * n]), the completion tokens of every choice
    (none when the response leaves them out: `generates` False)."""
    prompt = sum(len(out.prompt_token_ids) for out in outs[::n])
    completion = sum(len(out.token_ids) for out in outs) if generates else 0
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _joined(first: dict | None, then: dict | None) -> dict | None:
    """Two completions-shaped `logprobs` objects (an echoed prompt's, then the output's) as one."""
    if first is None or then is None:
        return first or then
    return {key: first[key] + then[key] for key in first}


def _sse(data: dict) -> bytes:
    """One server-sent event."""
    return f"data: {json.dumps(data)}\n\n".encode()
