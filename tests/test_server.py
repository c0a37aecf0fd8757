"""The OpenAI-compatible server, driven by the official `openai` client over loopback."""
from __future__ import annotations

import asyncio
import json
import math
import threading
import time
import urllib.request

import openai
import pytest

from pwruntime import api_tokens
from pwruntime.engine import EngineConfig, LLMEngine
from pwruntime.sampling import SamplingParams
from pwruntime.server import Server, _error_payload
from pwruntime.engine_client import EngineWorker
from server_fixtures import assert_idle, base_url, client, metric, model, post, serving  # noqa: F401 (fixtures)
from traces.clikit import UserError

PROMPT = "And God said unto Moses"


@pytest.fixture(scope="module")
def expected(model):
    """What the engine alone generates for PROMPT, greedy, 24 tokens (with the 5 most likely tokens of each)."""
    return LLMEngine(model, EngineConfig(num_kv_blocks=64)).generate([PROMPT], SamplingParams(max_tokens=24,
                                                                                              logprobs=5))[0]


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


def test_an_async_scheduling_engine_serves_the_same_completions_and_streams(model, expected):
    """Served with asynchronous scheduling: the completion, its stream, its log-probabilities and a stop string cut
    as without it, and nothing left running."""
    with serving(LLMEngine(model, EngineConfig(num_kv_blocks=64, async_scheduling=True))) as url:
        c = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        r = c.completions.create(model="demo", prompt=PROMPT, max_tokens=24, temperature=0, logprobs=5)
        assert r.choices[0].text == expected.text and r.usage.completion_tokens == len(expected.token_ids)
        assert r.choices[0].logprobs.token_logprobs == pytest.approx([t.logprob for t in expected.logprobs], abs=1e-5)
        chunks = list(c.completions.create(model="demo", prompt=PROMPT, max_tokens=24, temperature=0, stream=True))
        assert len(chunks) >= 2 and "".join(ch.choices[0].text for ch in chunks) == expected.text
        stop = expected.text[len(expected.text) // 2:][:4]
        cut = c.completions.create(model="demo", prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop])
        assert cut.choices[0].text == expected.text[:expected.text.index(stop)]
        assert cut.choices[0].finish_reason == "stop"


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


def test_a_prompt_reading_abort_is_served(client):
    """The worker's inbox tags its items: a prompt "abort" once read as an abort and was never answered."""
    r = client.with_options(timeout=20).completions.create(model="demo", prompt="abort", max_tokens=2, temperature=0)
    assert r.usage.completion_tokens == 2


def test_models_health_metrics(client, base_url):
    client.completions.create(model="demo", prompt=PROMPT, max_tokens=2)  # at least one request counted
    assert [m.id for m in client.models.list().data] == ["demo"]
    assert urllib.request.urlopen(f"{base_url}/health").status == 200
    from importlib.metadata import version
    assert json.loads(urllib.request.urlopen(f"{base_url}/version").read()) == {"version": version("pagedweight")}
    info = json.loads(urllib.request.urlopen(f"{base_url}/server_info").read())
    assert info["model"] == "demo" and info["version"] == version("pagedweight")
    engine = info["engine"]  # the fixture's engine: EngineConfig(num_kv_blocks=256), a full-precision model
    assert engine["num_kv_blocks"] == 256 and engine["block_size"] == 16 and engine["max_num_seqs"] == 32
    assert engine["async_scheduling"] is False and engine["ap_experts"] is False and engine["policy"] is None
    assert engine["max_model_len"] == client.models.list().data[0].model_extra["max_model_len"]
    metrics = urllib.request.urlopen(f"{base_url}/metrics").read().decode()
    assert "pagedweight_requests_total" in metrics and "pagedweight_kv_blocks_free" in metrics
    total = [line for line in metrics.splitlines() if line.startswith("pagedweight_requests_total")][0]
    assert int(total.split()[1]) >= 1
    types = dict(line.split()[2:4] for line in metrics.splitlines() if line.startswith("# TYPE"))
    assert types["pagedweight_steps_total"] == types["pagedweight_requests_total"] == "counter"
    assert types["pagedweight_kv_blocks_total"] == types["pagedweight_kv_blocks_free"] == "gauge"


def test_bad_requests_get_400(client):
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="demo", prompt="", max_tokens=4)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="demo", prompt="hi", max_tokens=0)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="demo", messages=[], max_tokens=4)


@pytest.mark.parametrize("n", [1, 3])
def test_client_leaving_mid_stream_aborts_its_request(client, base_url, n):
    import http.client
    from urllib.parse import urlparse

    before = metric(base_url, "aborted_total")
    url = urlparse(base_url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
    body = json.dumps({"prompt": PROMPT, "max_tokens": 2000, "temperature": 0, "stream": True, "n": n})
    conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.readline().startswith(b"data: ")
    conn.close()  # leave after the first event
    _expect_aborted(base_url, before, n)
    # the server still answers
    assert client.completions.create(model="demo", prompt="A fool", max_tokens=4, temperature=0).choices[0].text


@pytest.mark.parametrize("raw, message", [(b"not json", "not valid JSON"), (b"[1, 2]", "JSON object")])
def test_malformed_bodies_get_400(base_url, raw, message):
    import urllib.error

    req = urllib.request.Request(f"{base_url}/v1/completions", data=raw, headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req)
    assert err.value.code == 400
    assert message in json.loads(err.value.read())["error"]["message"]


def _expect_aborted(base_url: str, before: float, n: int) -> None:
    """`n` engine requests (choices) were aborted since `before`, and nothing runs, waits or holds KV blocks."""
    for _ in range(100):
        if metric(base_url, "aborted_total") >= before + n and metric(base_url, "running_requests") == 0:
            break
        time.sleep(0.1)
    assert metric(base_url, "aborted_total") == before + n
    assert_idle(base_url)


@pytest.mark.parametrize("raw, message", [
    (b'{"prompt": "hi", "temperature": NaN, "max_tokens": 4}', "NaN"),
    (b'{"prompt": "hi", "max_tokens": Infinity}', "Infinity"),
    (b'{"prompt": "hi", "max_tokens": 4, "stop": [1, 2]}', "'stop' must be a string or a list"),
    (b'{"prompt": "hi", "max_tokens": 2.9}', "'max_tokens' must be an integer"),
    (b'{"prompt": "hi", "max_tokens": 4, "stream": "false"}', "'stream' must be true or false"),
    (b'{"prompt": "hi", "max_tokens": 4, "temperature": 3}', "'temperature' must lie in [0, 2]"),
    (b'{"prompt": "hi", "max_tokens": 4, "n": 0}', "'n' must be an integer in 1..16, got 0"),
    (b'{"prompt": "hi", "max_tokens": 4, "n": 100}', "'n' must be an integer in 1..16, got 100"),
    (b'{"prompt": "hi", "max_tokens": 4, "n": "3"}', "'n' must be an integer in 1..16, got \"3\""),
    (b'{"prompt": "hi", "max_tokens": 4, "best_of": 2}', "'best_of' = 2 is not supported"),
    (b'{"prompt": "hi", "max_tokens": 4, "logprobs": -1}', "'logprobs' must be an integer in 0..20, got -1"),
    (b'{"prompt": "hi", "max_tokens": 4, "logprobs": 21}', "'logprobs' must be an integer in 0..20, got 21"),
    (b'{"prompt": "hi", "max_tokens": 4, "logprobs": true}', "'logprobs' must be an integer in 0..20, got true"),
    (b'{"prompt": "hi", "max_tokens": 4, "logprobs": 2.5}', "'logprobs' must be an integer in 0..20, got 2.5"),
    (b'{"prompt": "hi", "max_tokens": 4, "top_logprobs": 2}', "'top_logprobs' is a chat option"),
    (b'{"prompt": "hi", "max_tokens": 4, "suffix": "end"}', "'suffix' (text after the completion) is not supported"),
    (b'{"prompt": "hi", "max_tokens": 4, "tools": [{"type": "function"}]}', "'tools' (tool calls) is not supported"),
    (b'{"prompt": "hi", "max_tokens": 4, "response_format": {"type": "json_object"}}',
     "'response_format' {\"type\": \"json_object\"} is not supported"),
    (b'{"prompt": "hi", "max_tokens": 4, "guided_choice": ["a", "b"]}', "'guided_choice' (constrained decoding)"),
    (b'{"prompt": "hi", "max_tokens": 4, "allowed_token_ids": [1, 2]}', "'allowed_token_ids' (a token whitelist)"),
    (b'{"prompt": "hi", "max_tokens": 4, "use_beam_search": true}', "'use_beam_search' (beam search)"),
    (b'{"prompt": "hi", "max_tokens": 4, "skip_special_tokens": false}', "'skip_special_tokens' = false"),
    (b'{"prompt": "hi", "max_tokens": 4, "stream": true, "stream_options": {"continuous_usage_stats": true}}',
     "'stream_options.continuous_usage_stats' is not supported"),
    (b'{"prompt": "\\ud800", "max_tokens": 4}', "'prompt' is not valid Unicode"),
    (b"[" * 100000 + b"]" * 100000, "not valid JSON"),
])
def test_bad_fields_get_one_clear_400_and_the_engine_keeps_serving(base_url, client, raw, message):
    status, body = post(base_url, "/v1/completions", raw)
    assert status == 400 and message in body["error"]["message"], body
    assert urllib.request.urlopen(f"{base_url}/health").status == 200
    assert client.completions.create(model="demo", prompt="A fool", max_tokens=2, temperature=0).choices[0].text


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_unserved_options_at_values_that_ask_for_nothing_are_served(base_url, path):
    """best_of 1, a text response_format and empty or false constrained-decoding fields ask for nothing this server
    lacks (clients send them so): served, not refused."""
    body = {"max_tokens": 2, "temperature": 0, "best_of": 1, "response_format": {"type": "text"},
            "allowed_token_ids": [], "structured_outputs": {}, "guided_json": None, "use_beam_search": False}
    body.update({"prompt": "hi"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]})
    status, out = post(base_url, path, json.dumps(body).encode())
    assert status == 200 and out["usage"]["completion_tokens"] == 2, out


def test_chat_and_transport_misuse_get_json_errors(base_url):
    bad_role = b'{"messages": [{"role": "wizard", "content": "hi"}], "max_tokens": 2}'
    status, body = post(base_url, "/v1/chat/completions", bad_role)
    assert status == 400 and "messages[0].role must be one of" in body["error"]["message"]
    status, body = post(base_url, "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud800"}]}')
    assert status == 400 and "messages[0].content" in body["error"]["message"]
    # JSON is UTF-8 (RFC 8259): an unknown charset label is ignored, not a 500
    status, body = post(base_url, "/v1/completions", b'{"prompt": "hi", "max_tokens": 2}', "application/json; charset=foo")
    assert status == 200 and body["usage"]["completion_tokens"] == 2
    status, body = post(base_url, "/v1/nowhere", b"{}")
    assert status == 404 and "no route POST /v1/nowhere" in body["error"]["message"]
    assert set(body["error"]) == {"message", "type", "param", "code"}   # OpenAI's error object
    image = b'{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}'
    status, body = post(base_url, "/v1/chat/completions", image)
    assert status == 400 and "'image_url' parts are not supported" in body["error"]["message"]
    status, body = post(base_url, "/v1/models", b"{}")
    assert status == 405 and "POST is not allowed" in body["error"]["message"]


def test_chat_content_as_text_parts_is_the_joined_text(client):
    """OpenAI's (and vLLM's) list of text parts: the same chat as their text joined by newlines."""
    def reply(content):
        return client.chat.completions.create(model="demo", messages=[{"role": "user", "content": content}],
                                              max_tokens=8, temperature=0).choices[0].message.content
    assert reply([{"type": "text", "text": "And God"}, {"type": "text", "text": "said"}]) == reply("And God\nsaid")


def test_a_body_past_aiohttps_default_1_mib_is_served(base_url):
    """Prompts of token ids take about 6 bytes a token (64 of 4,000 make 1.5 MB), which aiohttp refused (413) past
    1 MiB; a body of that size (JSON's whitespace, which costs no forward) is served."""
    status, body = post(base_url, "/v1/completions", b'{"prompt": "hi", "max_tokens": 1' + b" " * 1_500_000 + b"}")
    assert status == 200 and body["usage"]["completion_tokens"] == 1


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


@pytest.mark.parametrize("n", [1, 3])
def test_a_client_timing_out_aborts_its_request(base_url, n):
    before = metric(base_url, "aborted_total")
    quick = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=0.5)
    with pytest.raises(openai.APITimeoutError):
        quick.completions.create(model="demo", prompt=PROMPT, max_tokens=2000, temperature=0, n=n)
    _expect_aborted(base_url, before, n)


def _request_events(worker: EngineWorker, n: int) -> list[tuple]:
    """The events of a request for n greedy choices of 8 tokens: until each choice is done or an error came, and
    any that still come within 0.2 s."""
    async def run():
        live = await worker.submit([(PROMPT, SamplingParams(max_tokens=8))] * n, stream=False)
        events = []
        while len(events) < n and not (events and events[-1][0] == "error"):
            events.append(await asyncio.wait_for(live.events.get(), 60))
        await asyncio.sleep(0.2)
        while not live.events.empty():
            events.append(live.events.get_nowait())
        return events
    return asyncio.run(run())


def _serves_on(worker: EngineWorker, n: int) -> None:
    """The worker still serves requests for n choices, and an idle engine holds no KV blocks."""
    events = _request_events(worker, n)
    assert sorted(payload[0] for _, payload in events) == list(range(n)) and worker.alive
    assert all(kind == "done" and len(payload[1].token_ids) == 8 for kind, payload in events)
    engine = worker.engine
    assert not engine.has_unfinished() and engine.pool.num_free == engine.pool.capacity


@pytest.mark.parametrize("n,asynchronous", [(1, False), (3, False), (3, True)])
def test_a_failing_engine_step_fails_its_requests_and_serving_goes_on(model, n, asynchronous):
    """A bug in a step must not end the engine thread: the requests in flight get an error (one per request, for
    all its choices), the next ones run (with asynchronous scheduling too, a batch of them in flight)."""
    engine = LLMEngine(model, EngineConfig(num_kv_blocks=32, async_scheduling=asynchronous))
    real_step, calls = engine.step, {"n": 0}

    def step():
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected failure")
        return real_step()

    engine.step = step
    worker = EngineWorker(engine).start()
    try:
        (event,) = _request_events(worker, n)
        assert event[0] == "error" and event[1][0] == 500 and "injected failure" in event[1][1]
        assert not engine.has_unfinished()  # every choice of the failed request was aborted, its blocks freed
        assert worker.core.counters["request_errors_total"] == n  # each of its choices
        _serves_on(worker, n)
    finally:
        worker.stop()


def test_a_choice_the_engine_refuses_fails_the_request_and_ends_the_others(model):
    """Choices are added all or none: when the engine refuses the second, the first is aborted at once."""
    engine = LLMEngine(model, EngineConfig(num_kv_blocks=32))
    real_add, calls = engine.add_request, {"n": 0}

    def add_request(prompt, params, **kw):
        calls["n"] += 1
        if calls["n"] == 2:
            raise UserError("injected refusal")
        return real_add(prompt, params, **kw)

    engine.add_request = add_request
    worker = EngineWorker(engine).start()
    try:
        assert _request_events(worker, 3) == [("error", (400, "injected refusal"))]
        assert not engine.has_unfinished() and worker.core.counters["requests_total"] == 0
        _serves_on(worker, 3)
    finally:
        worker.stop()


def test_max_tokens_beyond_the_context_is_a_400(client):
    with pytest.raises(openai.BadRequestError, match="ask for at most"):
        client.completions.create(model="demo", prompt=PROMPT, max_tokens=10**6)
    with pytest.raises(openai.BadRequestError, match="ask for at most"):
        list(client.completions.create(model="demo", prompt=PROMPT, max_tokens=10**6, stream=True))


# ------------------------------------------------------------------------------------------ log-probabilities
LOGPROB_LISTS = ("tokens", "token_logprobs", "top_logprobs", "text_offset")


def test_completion_logprobs_of_a_greedy_answer(client, expected):
    r = client.completions.create(model="demo", prompt=PROMPT, max_tokens=24, temperature=0, logprobs=5)
    text, lp = r.choices[0].text, r.choices[0].logprobs
    assert text == expected.text and "".join(lp.tokens) == text
    n = len(expected.token_ids)  # no stop string: every token is reported
    assert [len(getattr(lp, key)) for key in LOGPROB_LISTS] == [n] * 4
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(n)]
    for token, chosen, top, rec in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, expected.logprobs):
        values = list(top.values())
        assert len(top) == 5 and values == sorted(values, reverse=True)
        assert chosen == values[0] == top[token]  # greedy: the answer's token is the most likely
        assert sum(math.exp(v) for v in values) <= 1 + 1e-6
        assert chosen == pytest.approx(rec.logprob, abs=1e-5)  # the engine's own records (checked against a
        assert values == pytest.approx([v for _, v in rec.top], abs=1e-5)  # forward pass in test_logprobs.py)
    bare = client.completions.create(model="demo", prompt=PROMPT, max_tokens=24, temperature=0, logprobs=0)
    assert bare.choices[0].logprobs.tokens == lp.tokens and bare.choices[0].logprobs.top_logprobs == [{}] * n
    assert bare.choices[0].logprobs.token_logprobs == pytest.approx(lp.token_logprobs, abs=1e-6)
    plain = client.completions.create(model="demo", prompt=PROMPT, max_tokens=4, temperature=0)
    assert plain.choices[0].logprobs is None


def _stop_inside_a_token(tokenizer, out) -> tuple[str, int, int]:
    """(a stop string of 3 characters that first occurs inside a token of `out`, where it cuts the text, that
    token's index)."""
    at = 0
    for i, piece in enumerate(api_tokens.choice_pieces(tokenizer, out)):
        for j in range(1, len(piece.text)):
            stop = out.text[at + j:at + j + 3]
            if i >= 5 and len(stop) == 3 and out.text.find(stop) == at + j:
                return stop, at + j, i
        at += len(piece.text)
    raise AssertionError("no token to cut inside")


def _joined(chunks, index: int = 0) -> tuple[str, dict]:
    """The text and the completions log-probability lists of choice `index`, joined over the streamed chunks;
    each chunk's tokens join to its text."""
    mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == index]
    for choice in mine:
        assert "".join(choice.logprobs.tokens) == choice.text
    return "".join(c.text for c in mine), {key: sum((getattr(c.logprobs, key) for c in mine), []) for key in LOGPROB_LISTS}


@pytest.mark.parametrize("cut", [False, True])
def test_streamed_logprobs_join_to_the_whole_ones(client, model, expected, cut):
    """With a stop string, the tokens after the one it cuts into are not reported, and that one's text is cut."""
    kw = dict(model="demo", prompt=PROMPT, max_tokens=24, temperature=0, logprobs=3)
    if cut:
        stop, at, straddler = _stop_inside_a_token(model.tokenizer, expected)
        kw["stop"] = stop
    whole = client.completions.create(**kw).choices[0]
    chunks = list(client.completions.create(stream=True, **kw))
    assert len(chunks) >= 3 and _joined(chunks) == (whole.text, whole.logprobs.model_dump())
    assert "".join(whole.logprobs.tokens) == whole.text
    if cut:
        assert whole.text == expected.text[:at] and whole.finish_reason == "stop"
        assert len(whole.logprobs.tokens) == straddler + 1
        assert expected.text[whole.logprobs.text_offset[-1]:].startswith(whole.logprobs.tokens[-1] + stop)


def test_chat_logprobs_parsed_by_the_client(client):
    kw = dict(model="demo", messages=[{"role": "user", "content": "Who wrote the book of Psalms?"}], max_tokens=12,
              temperature=0)
    r = client.chat.completions.create(logprobs=True, top_logprobs=3, **kw)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens and "".join(c.token for c in content) == r.choices[0].message.content
    for c in content:
        values = [t.logprob for t in c.top_logprobs]
        assert len(values) == 3 and values == sorted(values, reverse=True)
        assert (c.token, c.logprob) == (c.top_logprobs[0].token, values[0])  # greedy
        assert c.bytes == list(c.token.encode()) and all(t.bytes == list(t.token.encode()) for t in c.top_logprobs)
    bare = client.chat.completions.create(logprobs=True, **kw).choices[0].logprobs.content
    assert [(c.token, c.top_logprobs) for c in bare] == [(c.token, []) for c in content]
    chunks = list(client.chat.completions.create(logprobs=True, top_logprobs=3, stream=True, **kw))
    streamed = [c for ch in chunks if ch.choices and ch.choices[0].logprobs for c in ch.choices[0].logprobs.content]
    assert streamed == content
    assert client.chat.completions.create(**kw).choices[0].logprobs is None


def _flat(content) -> tuple[list[str], list[float]]:
    """The tokens and the log-probabilities (chosen, then top) of chat logprobs content."""
    return ([t for c in content for t in [c.token] + [t.token for t in c.top_logprobs]],
            [v for c in content for v in [c.logprob] + [t.logprob for t in c.top_logprobs]])


@pytest.mark.parametrize("fields, message", [
    ({"logprobs": 3}, "'logprobs' must be true or false, got 3"),
    ({"top_logprobs": 2}, "'top_logprobs' needs 'logprobs': true"),
    ({"logprobs": False, "top_logprobs": 0}, "'top_logprobs' needs 'logprobs': true"),
    ({"logprobs": True, "top_logprobs": 21}, "'top_logprobs' must be an integer in 0..20, got 21"),
    ({"logprobs": True, "top_logprobs": "2"}, "'top_logprobs' must be an integer in 0..20, got \"2\""),
    ({"n": 17}, "'n' must be an integer in 1..16, got 17"),
])
def test_bad_chat_logprobs_and_n_get_one_clear_400(base_url, fields, message):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **fields}
    status, out = post(base_url, "/v1/chat/completions", json.dumps(body).encode())
    assert status == 400 and message in out["error"]["message"], out


# ----------------------------------------------------------------------------------------------- n choices
def test_n_choices_with_a_seed(client):
    """Choice i samples with seed + i: it equals an n = 1 request with that seed; streamed, the choices interleave
    and join to the same texts."""
    kw = dict(model="demo", prompt=PROMPT, max_tokens=12, temperature=1.0, seed=7)
    r = client.completions.create(n=3, **kw)
    texts = [c.text for c in r.choices]
    assert [c.index for c in r.choices] == [0, 1, 2] and len(set(texts)) > 1
    assert [c.text for c in client.completions.create(n=3, **kw).choices] == texts
    singles = [client.completions.create(**{**kw, "seed": 7 + i}) for i in range(3)]
    assert [s.choices[0].text for s in singles] == texts
    assert r.usage.prompt_tokens == singles[0].usage.prompt_tokens
    assert r.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)
    chunks = list(client.completions.create(n=3, stream=True, stream_options={"include_usage": True}, **kw))
    order = [c.choices[0].index for c in chunks if c.choices]
    assert order != sorted(order)  # interleaved
    assert ["".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i)
            for i in range(3)] == texts
    assert sorted(c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason) == [0, 1, 2]
    assert not chunks[-1].choices and chunks[-1].usage == r.usage


def test_n_greedy_chat_choices_are_identical_with_logprobs_streamed_or_not(client):
    kw = dict(model="demo", messages=[{"role": "user", "content": "Who wrote the book of Psalms?"}], max_tokens=8,
              temperature=0, n=2, logprobs=True, top_logprobs=2)
    r = client.chat.completions.create(**kw)
    assert [c.index for c in r.choices] == [0, 1] and r.choices[0].message == r.choices[1].message
    first, second = (_flat(c.logprobs.content) for c in r.choices)  # two rows of a batch: equal up to rounding
    assert first[0] == second[0] and first[1] == pytest.approx(second[1], abs=1e-4)
    chunks = list(client.chat.completions.create(stream=True, **kw))
    for i in range(2):
        mine = [c.choices[0] for c in chunks if c.choices[0].index == i]
        assert mine[0].delta.role == "assistant"
        assert "".join(c.delta.content or "" for c in mine) == r.choices[i].message.content
        assert [e for c in mine if c.logprobs for e in c.logprobs.content] == r.choices[i].logprobs.content


def test_n_completion_choices_with_logprobs_stream_like_the_whole_ones(client):
    kw = dict(model="demo", prompt=PROMPT, max_tokens=10, temperature=0.8, seed=3, n=2, logprobs=2)
    whole = client.completions.create(**kw).choices
    chunks = list(client.completions.create(stream=True, **kw))
    assert [_joined(chunks, i) for i in range(2)] == [(c.text, c.logprobs.model_dump()) for c in whole]


def test_tokenize_and_detokenize_as_the_endpoints_encode(client, base_url, model):
    """/tokenize gives the ids a completion's prompt and a chat's messages become (their usage counts them), without
    special tokens or the generation prompt when asked; /detokenize gives their text back; misuse is one 400 (404 for
    another model)."""
    prompt = "And God said unto Moses"
    status, tok = post(base_url, "/tokenize", json.dumps({"model": "demo", "prompt": prompt}).encode())
    assert status == 200 and tok["tokens"] == model.tokenizer.encode(prompt) and tok["count"] == len(tok["tokens"])
    assert tok["max_model_len"] == model.config.max_position
    usage = client.completions.create(model="demo", prompt=prompt, max_tokens=1, temperature=0).usage
    assert usage.prompt_tokens == tok["count"]
    _, bare = post(base_url, "/tokenize", json.dumps({"prompt": prompt, "add_special_tokens": False}).encode())
    assert bare["tokens"] == model.tokenizer.encode(prompt, add_special_tokens=False)
    _, back = post(base_url, "/detokenize", json.dumps({"tokens": bare["tokens"]}).encode())
    assert back["prompt"] == prompt
    msgs = [{"role": "user", "content": "Who wrote the book of Psalms?"}]
    _, chat = post(base_url, "/tokenize", json.dumps({"messages": msgs}).encode())
    assert client.chat.completions.create(model="demo", messages=msgs, max_tokens=1).usage.prompt_tokens == chat["count"]
    _, plain = post(base_url, "/tokenize", json.dumps({"messages": msgs, "add_generation_prompt": False}).encode())
    assert plain["tokens"] == chat["tokens"]  # the demo's chat template adds no generation prompt
    for path, body, status, message in (
            ("/tokenize", {}, 400, "takes a 'prompt' (a string) or 'messages'"),
            ("/tokenize", {"prompt": "a", "messages": msgs}, 400, "one of them"),
            ("/tokenize", {"prompt": ["a"]}, 400, "'prompt' must be a string"),
            ("/tokenize", {"prompt": "a", "add_special_tokens": "no"}, 400, "'add_special_tokens' must be true or false"),
            ("/tokenize", {"messages": msgs, "add_generation_prompt": 1}, 400, "'add_generation_prompt' must be true"),
            ("/tokenize", {"model": "gpt-4", "prompt": "a"}, 404, "does not exist"),
            ("/detokenize", {}, 400, "takes 'tokens'"),
            ("/detokenize", {"tokens": [model.config.vocab]}, 400, "'tokens' must be a list of token ids")):
        got, out = post(base_url, path, json.dumps(body).encode())
        assert got == status and message in out["error"]["message"], (path, body, out)


def test_an_api_key_guards_the_v1_routes(model):
    """With a key, a /v1 request needs it as a bearer token (the openai client sends its api_key so): a wrong or
    missing key is a 401 in OpenAI's shape and nothing is queued; /health, /metrics and /tokenize stay open."""
    with serving(LLMEngine(model, EngineConfig(num_kv_blocks=64)), api_key="s3cret") as url:
        good = openai.OpenAI(base_url=f"{url}/v1", api_key="s3cret", max_retries=0, timeout=60)
        assert good.completions.create(model="demo", prompt="A fool", max_tokens=2, temperature=0).choices[0].text
        bad = openai.OpenAI(base_url=f"{url}/v1", api_key="guess", max_retries=0, timeout=60)
        with pytest.raises(openai.AuthenticationError, match="a valid API key is needed"):
            bad.completions.create(model="demo", prompt="A fool", max_tokens=2)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        status, body = post(url, "/v1/completions", b'{"prompt": "hi", "max_tokens": 2}')
        assert status == 401 and body["error"]["code"] == "invalid_api_key"
        assert urllib.request.urlopen(f"{url}/health").status == 200
        assert post(url, "/tokenize", b'{"prompt": "hi"}')[0] == 200
        assert metric(url, "requests_total") == 1   # the refused requests never reached the engine


def test_max_model_len_is_the_server_s_context(model):
    """An engine with a shorter context than the model's: the model card and /tokenize say so, a request past it is
    a 400 naming the room left, and a chat without max_tokens stops there."""
    with serving(LLMEngine(model, EngineConfig(num_kv_blocks=64, max_model_len=64))) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0, timeout=60)
        card = json.loads(urllib.request.urlopen(f"{url}/v1/models/demo").read())
        assert card["max_model_len"] == 64
        req = urllib.request.Request(f"{url}/tokenize", data=json.dumps({"prompt": PROMPT}).encode(),
                                     headers={"Content-Type": "application/json"})
        tokens = json.loads(urllib.request.urlopen(req).read())
        assert tokens["max_model_len"] == 64
        with pytest.raises(openai.BadRequestError, match=f"ask for at most {64 - tokens['count']} tokens"):
            client.completions.create(model="demo", prompt=PROMPT, max_tokens=100)
        chat = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "hi"}],
                                              extra_body={"ignore_eos": True})
        assert chat.usage.prompt_tokens + chat.usage.completion_tokens == 64
        assert chat.choices[0].finish_reason == "length"


def test_error_objects_name_client_and_server_errors_as_openai_does():
    """OpenAI's error object: a 4xx is an "invalid_request_error", a 5xx (an engine step's failure: 500; no engine:
    503) a "server_error", each with its message and code."""
    assert _error_payload("bad", 400) == {"error": {"message": "bad", "type": "invalid_request_error", "param": None,
                                                    "code": None}}
    assert _error_payload("gone", 404, "model_not_found")["error"]["type"] == "invalid_request_error"
    for status in (500, 503):
        error = _error_payload("boom", status)["error"]
        assert error["type"] == "server_error" and error["message"] == "boom"


def test_a_stream_without_stop_strings_holds_back_no_token(client, expected):
    """With no stop string to wait for, nothing is held back: each streamed chunk carries the one token generated
    (its text and its log-probability), the last token too, and not a chunk later."""
    chunks = list(client.completions.create(model="demo", prompt=PROMPT, max_tokens=12, temperature=0, stream=True,
                                            logprobs=1))
    assert len(chunks) == 12
    assert [len(c.choices[0].logprobs.tokens) for c in chunks] == [1] * 12
    assert [c.choices[0].text for c in chunks] == [c.choices[0].logprobs.tokens[0] for c in chunks]
    assert expected.text.startswith("".join(c.choices[0].text for c in chunks))   # the engine's first 12 tokens


def test_health_is_503_once_the_engine_loop_is_gone(model):
    """/health answers 200 while the engine loop runs and 503 ("engine stopped") once it is gone, so a load balancer
    stops sending requests to a server that can only fail them."""
    worker = EngineWorker(LLMEngine(model, EngineConfig(num_kv_blocks=32)))
    server = Server(worker, "demo")
    assert asyncio.run(server.health(None)).status == 200
    worker.shut_down("stopping")
    response = asyncio.run(server.health(None))
    assert response.status == 503 and json.loads(response.text) == {"status": "engine stopped"}
