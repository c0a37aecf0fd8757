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
        runner = web.AppRunner(server.app)
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

    url = urlparse(base_url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
    body = json.dumps({"prompt": PROMPT, "max_tokens": 2000, "temperature": 0, "stream": True})
    conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.readline().startswith(b"data: ")
    conn.close()  # leave after the first event
    metrics = ""
    for _ in range(100):
        metrics = urllib.request.urlopen(f"{base_url}/metrics").read().decode()
        if "pagedweight_aborted_total 1" in metrics:
            break
        time.sleep(0.1)
    assert "pagedweight_aborted_total 1" in metrics and "pagedweight_running_requests 0" in metrics
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
