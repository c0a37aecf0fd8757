"""Long texts at the server: one that cannot fit the context is refused before it is encoded, and encoding (and a
chat template) runs beside the event loop, so no other request waits for it."""
from __future__ import annotations

import json
import threading
import urllib.request

import pytest

from pwruntime.engine import EngineConfig, LLMEngine
from pwruntime.server import NORMALIZER_SLACK
from server_fixtures import metric, model, post, serving  # noqa: F401 (fixtures)


def test_a_text_the_context_cannot_hold_is_refused_before_it_is_encoded(model, monkeypatch):
    """Past max_model_len x the longest token's characters (x the normalizer's slack), a completion's prompt or a
    chat's messages are a 400 naming the characters, and the tokenizer never sees them (a 20 MB prompt once held
    every stream up for 13 s while it was encoded)."""
    tok = model.tokenizer
    limit = 4096 * tok.longest_token_chars() * NORMALIZER_SLACK
    encoded = []
    real = tok.encode
    monkeypatch.setattr(tok, "encode", lambda text, *a, **k: encoded.append(len(text)) or real(text, *a, **k))
    with serving(LLMEngine(model, EngineConfig(num_kv_blocks=64))) as url:
        long = "a" * (limit + 1)
        status, body = post(url, "/v1/completions", json.dumps({"prompt": ["ok", long], "max_tokens": 1}).encode())
        assert status == 400 and f"prompt[1] has {limit + 1:,} characters" in body["error"]["message"]
        status, body = post(url, "/v1/chat/completions", json.dumps(
            {"messages": [{"role": "user", "content": long[:limit // 2]}, {"role": "user", "content": long}]}).encode())
        assert status == 400 and "'messages' has" in body["error"]["message"]
        assert all(n <= limit for n in encoded) and metric(url, "requests_total") == 0
        status, body = post(url, "/v1/completions", json.dumps({"prompt": "And God said", "max_tokens": 2}).encode())
        assert status == 200 and body["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "GATE"}], "max_tokens": 2}),
    ("/v1/completions", {"prompt": "GATE", "max_tokens": 2, "echo": True}),
    ("/tokenize", {"prompt": "GATE"})])
def test_encoding_a_text_holds_up_no_other_request(model, monkeypatch, path, body):
    """While one request's text is being encoded (held here until /health has answered), the server answers others:
    the encoding runs in a thread, not on the event loop, and the echo shows the text the ids came from."""
    tok = model.tokenizer
    entered, release = threading.Event(), threading.Event()
    real = tok.encode

    def gated(text, *a, **k):
        if "GATE" in text:
            entered.set()
            assert release.wait(30), "never released"
        return real(text, *a, **k)

    monkeypatch.setattr(tok, "encode", gated)
    with serving(LLMEngine(model, EngineConfig(num_kv_blocks=64))) as url:
        box = {}
        sender = threading.Thread(target=lambda: box.update(r=post(url, path, json.dumps(body).encode())))
        sender.start()
        try:
            assert entered.wait(30)
            with urllib.request.urlopen(f"{url}/health", timeout=10) as r:  # timed out when encoding held the loop
                assert r.status == 200
        finally:
            release.set()
            sender.join(60)
        status, answer = box["r"]
        assert status == 200
        if path == "/v1/completions":
            assert answer["choices"][0]["text"].startswith("GATE")


def test_an_answer_the_kv_pool_cannot_hold_is_counted_and_logged_as_cut(model, capfd):
    """A pool smaller than one request of the full context: the ready line warns, and an answer that outgrows the
    pool ends early with finish_reason "length", counted in kv_capacity_cuts_total and logged (it was silent)."""
    from pwruntime.stats_log import ready_line, serving_info
    engine = LLMEngine(model, EngineConfig(num_kv_blocks=8, block_size=16))
    assert "is cut short" in ready_line(serving_info(engine), 1.0)
    with serving(engine) as url:
        status, body = post(url, "/v1/completions", json.dumps(
            {"prompt": "And God said", "max_tokens": 400, "ignore_eos": True}).encode())
        assert status == 200 and body["choices"][0]["finish_reason"] == "length"
        assert body["usage"]["completion_tokens"] < 8 * 16
        assert metric(url, "kv_capacity_cuts_total") == 1
    assert "cut short after" in capfd.readouterr().err
    roomy = LLMEngine(model, EngineConfig(num_kv_blocks=256, block_size=16))
    assert "cut short" not in ready_line(serving_info(roomy), 1.0)
