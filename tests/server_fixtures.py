"""The server fixtures shared by the server tests: the demo model, a running `Server` over an `EngineWorker` on
loopback (`serving` runs one over any engine) and the official `openai` client of it, and helpers that read raw
responses and /metrics."""
from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator

import openai
import pytest
from aiohttp import web

from pwruntime.cmd_perplexity import default_model_dir
from pwruntime.engine import EngineConfig, LLMEngine
from pwruntime.model import load_model
from pwruntime.engine_client import EngineWorker
from pwruntime.server import Server


@pytest.fixture(scope="module")
def model():
    return load_model(default_model_dir())


@pytest.fixture(scope="module")
def base_url(model):
    with serving(LLMEngine(model, EngineConfig(num_kv_blocks=256))) as url:
        yield url


@contextlib.contextmanager
def serving(engine: LLMEngine, api_key: str | None = None) -> Iterator[str]:
    """The base URL of a `Server` named "demo" over `engine` (needing `api_key`, if given), on loopback until the
    block ends."""
    worker = EngineWorker(engine).start()
    server = Server(worker, "demo", api_key=api_key)
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
    try:
        yield f"http://127.0.0.1:{box['port']}"
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        worker.stop()


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=60)


def post(base_url: str, path: str, raw: bytes, content_type: str = "application/json"):
    """(status, parsed JSON body) of a raw POST."""
    req = urllib.request.Request(f"{base_url}{path}", data=raw, headers={"Content-Type": content_type})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def metrics_text(base_url: str) -> str:
    return urllib.request.urlopen(f"{base_url}/metrics").read().decode()


def metric(base_url: str, name: str) -> float:
    """The value of the sample `pagedweight_<name>` (with its labels, if any, as in `name`)."""
    return float(next(line.split()[-1] for line in metrics_text(base_url).splitlines()
                      if line.startswith(f"pagedweight_{name} ")))


def assert_idle(base_url: str) -> None:
    """Nothing runs or waits, and every KV block is free."""
    assert metric(base_url, "running_requests") == 0 and metric(base_url, "waiting_requests") == 0
    assert metric(base_url, "kv_blocks_free") == metric(base_url, "kv_blocks_total")
