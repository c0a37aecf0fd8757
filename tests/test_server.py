"""The OpenAI-compatible server, driven by the official `openai` client over loopback."""
from __future__ import annotations

import asyncio
import threading
import urllib.request

import openai
import pytest
from aiohttp import web

from pwruntime.cmd_perplexity import default_model_dir
from pwruntime.engine import EngineConfig, LLMEngine
from pwruntime.model import load_model
from pwruntime.sampling import SamplingParams
from pwruntime.server import EngineWorker, Server

PROMPT = "And God said unto Moses"


@pytest.fixture(scope="module")
def model():
    return load_model(default_model_dir())


@pytest.fixture(scope="module")
def base_url(model):
    worker = EngineWorker(LLMEngine(model, EngineConfig(num_kv_blocks=256))).start()
    server = Server(worker, "demo")
    loop = asyncio.new_event_loop()
    started = threading.Event()
    box = {}

    def serve():
        asyncio.set_event_loop(loop)
        runner = web.AppRunner(server.app, handler_cancellation=True)  # as `pwruntime serve` runs it
        loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)
        loop.run_until_complete(site.start())
        box["port"] = site._server.sockets[0].getsockname()[1]
        box["runner"] = runner
        started.set()
        loop.run_forever()
        loop.run_until_complete(runner.cleanup())

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    assert started.wait(30)
    yield f"http://127.0.0.1:{box['port']}"
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    worker.stop()


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def expected(model):
    """What the engine alone generates for PROMPT, greedy, 24 tokens."""
    out = LLMEngine(model, EngineConfig(num_kv_blocks=64)).generate([PROMPT], SamplingParams(max_tokens=24))[0]
    return out


def test_completion_equals_the_engine(client, expected):
    r = client.completions.create(model="demo", prompt=PROMPT, max_tokens=24, temperature=0)
    assert r.choices[0].text == expected.text
    assert r.usage.completion_tokens == len(expected.token_ids)
    assert r.choices[0].finish_reason in ("stop", "length")


def test_streamed_completion_concatenates_to_the_same_text(client, expected):
    chunks = list(client.completions.create(model="demo", prompt=PROMPT, max_tokens=24, temperature=0, stream=True))
    assert len(chunks) >= 2  # really streamed: more than one event
    assert "".join(c.choices[0].text for c in chunks) == expected.text
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_chat_completion_and_stream(client):
    msgs = [{"role": "user", "content": "Who wrote the book of Psalms?"}]
    r = client.chat.completions.create(model="demo", messages=msgs, max_tokens=16, temperature=0)
    text = r.choices[0].message.content
    assert r.choices[0].message.role == "assistant" and r.usage.completion_tokens >= 1
    chunks = list(client.chat.completions.create(model="demo", messages=msgs, max_tokens=16, temperature=0,
                                                 stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text


def test_concurrent_requests_all_complete(client, expected):
    results = [None] * 6
    def one(i):
        results[i] = client.completions.create(model="demo", prompt=PROMPT, max_tokens=24, temperature=0)
    threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(r is not None and r.choices[0].text == expected.text for r in results)


def test_models_health_metrics(client, base_url):
    assert [m.id for m in client.models.list().data] == ["demo"]
    assert urllib.request.urlopen(f"{base_url}/health").status == 200
    metrics = urllib.request.urlopen(f"{base_url}/metrics").read().decode()
    assert "pagedweight_requests_total" in metrics and "pagedweight_kv_blocks_free" in metrics
    total = [line for line in metrics.splitlines() if line.startswith("pagedweight_requests_total")][0]
    assert int(total.split()[1]) >= 1


def test_bad_requests_get_400(client):
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="demo", prompt="", max_tokens=4)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="demo", prompt="hi", max_tokens=0)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="demo", messages=[], max_tokens=4)


def test_client_leaving_mid_stream_aborts_its_request(client, base_url):
    import http.client
    import json
    import time
    from urllib.parse import urlparse

    before = _metric(base_url, "aborted_total")
    url = urlparse(base_url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
    body = json.dumps({"prompt": PROMPT, "max_tokens": 2000, "temperature": 0, "stream": True})
    conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.readline().startswith(b"data: ")
    conn.close()  # leave after the first event
    for _ in range(100):
        if _metric(base_url, "aborted_total") > before and _metric(base_url, "running_requests") == 0:
            break
        time.sleep(0.1)
    assert _metric(base_url, "aborted_total") == before + 1 and _metric(base_url, "running_requests") == 0
    # the server still answers
    assert client.completions.create(model="demo", prompt="A fool", max_tokens=4, temperature=0).choices[0].text


@pytest.mark.parametrize("raw, message", [(b"not json", "not valid JSON"), (b"[1, 2]", "JSON object")])
def test_malformed_bodies_get_400(base_url, raw, message):
    import json
    import urllib.error

    req = urllib.request.Request(f"{base_url}/v1/completions", data=raw, headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req)
    assert err.value.code == 400
    assert message in json.loads(err.value.read())["error"]["message"]


def _post(base_url: str, path: str, raw: bytes, content_type: str = "application/json"):
    """(status, parsed JSON body) of a raw POST."""
    import json
    import urllib.error

    req = urllib.request.Request(f"{base_url}{path}", data=raw, headers={"Content-Type": content_type})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _metric(base_url: str, name: str) -> float:
    text = urllib.request.urlopen(f"{base_url}/metrics").read().decode()
    return float(next(line.split()[1] for line in text.splitlines() if line.startswith(f"pagedweight_{name} ")))


@pytest.mark.parametrize("raw, message", [
    (b'{"prompt": "hi", "temperature": NaN, "max_tokens": 4}', "NaN"),
    (b'{"prompt": "hi", "max_tokens": Infinity}', "Infinity"),
    (b'{"prompt": "hi", "max_tokens": 4, "stop": [1, 2]}', "'stop' must be a string or a list"),
    (b'{"prompt": "hi", "max_tokens": 2.9}', "'max_tokens' must be an integer"),
    (b'{"prompt": "hi", "max_tokens": 4, "stream": "false"}', "'stream' must be true or false"),
    (b'{"prompt": "hi", "max_tokens": 4, "temperature": 3}', "'temperature' must lie in [0, 2]"),
    (b'{"prompt": "hi", "max_tokens": 4, "n": 2}', "'n' = 2 is not supported"),
    (b'{"prompt": "hi", "max_tokens": 4, "logprobs": 1}', "log-probabilities"),
    (b'{"prompt": "hi", "max_tokens": 4, "echo": true}', "'echo' is not supported"),
    (b'{"prompt": "\\ud800", "max_tokens": 4}', "'prompt' is not valid Unicode"),
    (b"[" * 100000 + b"]" * 100000, "not valid JSON"),
])
def test_bad_fields_get_one_clear_400_and_the_engine_keeps_serving(base_url, client, raw, message):
    status, body = _post(base_url, "/v1/completions", raw)
    assert status == 400 and message in body["error"]["message"], body
    assert urllib.request.urlopen(f"{base_url}/health").status == 200
    assert client.completions.create(model="demo", prompt="A fool", max_tokens=2, temperature=0).choices[0].text


def test_chat_and_transport_misuse_get_json_errors(base_url):
    bad_role = b'{"messages": [{"role": "wizard", "content": "hi"}], "max_tokens": 2}'
    status, body = _post(base_url, "/v1/chat/completions", bad_role)
    assert status == 400 and "messages[0].role must be one of" in body["error"]["message"]
    status, body = _post(base_url, "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud800"}]}')
    assert status == 400 and "messages[0].content" in body["error"]["message"]
    # JSON is UTF-8 (RFC 8259): an unknown charset label is ignored, not a 500
    status, body = _post(base_url, "/v1/completions", b'{"prompt": "hi", "max_tokens": 2}', "application/json; charset=foo")
    assert status == 200 and body["usage"]["completion_tokens"] == 2
    status, body = _post(base_url, "/v1/nowhere", b"{}")
    assert status == 404 and "no route POST /v1/nowhere" in body["error"]["message"]
    status, body = _post(base_url, "/v1/models", b"{}")
    assert status == 405 and "POST is not allowed" in body["error"]["message"]


def test_tiny_temperature_is_greedy(client, expected):
    r = client.completions.create(model="demo", prompt=PROMPT, max_tokens=24, temperature=1e-45)
    assert r.choices[0].text == expected.text  # dividing the logits by 1e-45 used to stop the engine thread


def test_unknown_model_is_404_and_the_served_one_can_be_retrieved(client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="hi", max_tokens=2)
    assert client.models.retrieve("demo").id == "demo"


def test_streamed_errors_are_plain_400s(client):
    with pytest.raises(openai.BadRequestError, match="shorten the prompt"):
        list(client.completions.create(model="demo", prompt="word " * 5000, max_tokens=4, stream=True))


def test_stop_strings_still_stream_and_usage_can_be_streamed(client, expected):
    kw = dict(model="demo", prompt=PROMPT, max_tokens=24, temperature=0, stop=["no such stop string"])
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert len(texts) >= 3 and "".join(texts) == expected.text  # streamed, not held to the end
    assert chunks[-1].usage.completion_tokens == len(expected.token_ids) and not chunks[-1].choices


def test_a_client_timing_out_aborts_its_request(base_url):
    import time

    before = _metric(base_url, "aborted_total")
    quick = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=0.5)
    with pytest.raises(openai.APITimeoutError):
        quick.completions.create(model="demo", prompt=PROMPT, max_tokens=2000, temperature=0)
    for _ in range(100):
        if _metric(base_url, "aborted_total") > before and _metric(base_url, "running_requests") == 0:
            break
        time.sleep(0.1)
    assert _metric(base_url, "aborted_total") == before + 1 and _metric(base_url, "running_requests") == 0


def test_a_failing_engine_step_fails_its_requests_and_serving_goes_on(model):
    """A bug in a step must not end the engine thread: the requests in flight get an error, the next ones run."""
    engine = LLMEngine(model, EngineConfig(num_kv_blocks=32))
    real_step, calls = engine.step, {"n": 0}

    def step():
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected failure")
        return real_step()

    engine.step = step
    worker = EngineWorker(engine).start()

    async def one():
        live = await worker.submit(PROMPT, SamplingParams(max_tokens=8), stream=False)
        return await asyncio.wait_for(live.events.get(), 60)

    try:
        kind, payload = asyncio.run(one())
        assert kind == "error" and payload[0] == 500 and "injected failure" in payload[1]
        kind, out = asyncio.run(one())
        assert kind == "done" and len(out.token_ids) == 8 and worker.alive
        assert not engine.has_unfinished()  # the failed request was aborted, its blocks freed
    finally:
        worker.stop()


def test_max_tokens_beyond_the_context_is_a_400(client):
    with pytest.raises(openai.BadRequestError, match="ask for at most"):
        client.completions.create(model="demo", prompt=PROMPT, max_tokens=10**6)
    with pytest.raises(openai.BadRequestError, match="ask for at most"):
        list(client.completions.create(model="demo", prompt=PROMPT, max_tokens=10**6, stream=True))
