"""Prompts in responses: /v1/completions' `echo` (with `max_tokens` 0, as lm-evaluation-harness scores a
continuation) and vLLM's `prompt_logprobs`, through the official `openai` client, streamed and not. (The engine's
prompt records against a forward pass: test_prompt_logprobs.py.)"""
from __future__ import annotations

import pytest

from pwruntime.engine import EngineConfig, LLMEngine
from pwruntime.sampling import SamplingParams
from server_fixtures import assert_idle, base_url, client, model, post  # noqa: F401 (fixtures)
from test_server import LOGPROB_LISTS, _joined

PROMPT = "And God said unto Moses, Go"


@pytest.fixture(scope="module")
def engine_out(model):
    """What the engine alone gives for PROMPT: 12 greedy tokens, 3 alternatives for every token, prompt's too."""
    engine = LLMEngine(model, EngineConfig(num_kv_blocks=64))
    return engine.generate([PROMPT], SamplingParams(max_tokens=12, logprobs=3, prompt_logprobs=3))[0]


def _prompt_checks(lp, engine_out, n_prompt: int) -> None:
    """The first n_prompt entries of a completions `logprobs` are the prompt's, as the engine recorded them."""
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing precedes the first token
    assert lp.token_logprobs[1:n_prompt] == pytest.approx([r.logprob for r in engine_out.prompt_logprobs], abs=1e-5)
    for top, rec in zip(lp.top_logprobs[1:n_prompt], engine_out.prompt_logprobs):
        assert list(top.values()) == pytest.approx([v for _, v in rec.top][:len(top)], abs=1e-5)
        assert 1 <= len(top) <= 3


@pytest.mark.parametrize("as_ids", [False, True])
def test_echo_with_max_tokens_0_gives_the_prompt_and_its_logprobs(client, model, engine_out, as_ids):
    """lm-evaluation-harness's loglikelihood request: the prompt back, each token's log-probability, no completion."""
    prompt = engine_out.prompt_token_ids if as_ids else PROMPT
    r = client.completions.create(model="demo", prompt=prompt, max_tokens=0, echo=True, logprobs=3, temperature=0)
    choice, n = r.choices[0], len(engine_out.prompt_token_ids)
    assert choice.text == model.tokenizer.decode(engine_out.prompt_token_ids) == PROMPT
    assert choice.finish_reason == "length" and r.usage.completion_tokens == 0 and r.usage.prompt_tokens == n
    lp = choice.logprobs
    assert [len(getattr(lp, key)) for key in LOGPROB_LISTS] == [n] * 4 and "".join(lp.tokens) == PROMPT
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(n)]
    _prompt_checks(lp, engine_out, n)
    bare = client.completions.create(model="demo", prompt=prompt, max_tokens=0, echo=True)
    assert bare.choices[0].text == PROMPT and bare.choices[0].logprobs is None


def test_echo_with_a_completion_joins_prompt_and_output(client, engine_out):
    r = client.completions.create(model="demo", prompt=PROMPT, max_tokens=12, echo=True, logprobs=3, temperature=0)
    choice, n = r.choices[0], len(engine_out.prompt_token_ids)
    assert choice.text == PROMPT + engine_out.text and r.usage.completion_tokens == len(engine_out.token_ids)
    lp = choice.logprobs
    assert "".join(lp.tokens) == choice.text and len(lp.tokens) == n + len(engine_out.token_ids)
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(len(lp.tokens))]
    _prompt_checks(lp, engine_out, n)
    assert lp.token_logprobs[n:] == pytest.approx([r.logprob for r in engine_out.logprobs], abs=1e-5)
    plain = client.completions.create(model="demo", prompt=PROMPT, max_tokens=12, temperature=0, logprobs=3)
    assert plain.choices[0].text == engine_out.text  # echo changes nothing after the prompt
    assert plain.choices[0].logprobs.token_logprobs == pytest.approx(lp.token_logprobs[n:], abs=1e-6)


def test_an_echo_that_leaves_max_tokens_out_is_completed(client):
    """Only an explicit `max_tokens` 0 asks for the prompt alone: an echo without max_tokens gets a completion of the
    default length after the prompt."""
    r = client.completions.create(model="demo", prompt=PROMPT, echo=True, temperature=0)
    assert r.usage.completion_tokens > 0 and r.choices[0].text.startswith(PROMPT)
    assert len(r.choices[0].text) > len(PROMPT)


def test_lm_evaluation_harness_loglikelihood_requests(base_url, engine_out):
    """lm-evaluation-harness's `local-completions` scores a continuation with this body (its token-id prompts batched)
    and reads token_logprobs[ctxlen:-1] (the last entry is the completion's one token) and whether each continuation
    token was the most likely one there."""
    import json

    ctx, greedy = engine_out.prompt_token_ids, engine_out.token_ids[:4]
    other = [t + 1 for t in greedy]
    body = {"model": "demo", "prompt": [ctx + greedy, ctx + other], "temperature": 0, "max_tokens": 1, "logprobs": 1,
            "seed": 1234, "echo": True}
    status, out = post(base_url, "/v1/completions", json.dumps(body).encode())
    assert status == 200 and len(out["choices"]) == 2
    scores = []
    for choice in sorted(out["choices"], key=lambda c: c["index"]):
        logprobs = choice["logprobs"]["token_logprobs"][len(ctx):-1]
        tops = choice["logprobs"]["top_logprobs"][len(ctx):-1]
        scores.append((sum(logprobs), all(lp == max(top.values()) for lp, top in zip(logprobs, tops))))
    assert scores[0][0] == pytest.approx(sum(r.logprob for r in engine_out.logprobs[:4]), abs=1e-4)
    assert scores[0][1] and not scores[1][1] and scores[1][0] < scores[0][0]


@pytest.mark.parametrize("max_tokens", [0, 12])
def test_a_streamed_echo_joins_to_the_whole_one(client, base_url, max_tokens):
    kw = dict(model="demo", prompt=PROMPT, max_tokens=max_tokens, echo=True, logprobs=2, temperature=0, n=2)
    whole = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, **kw))
    for i in range(2):
        assert _joined(chunks, i) == (whole.choices[i].text, whole.choices[i].logprobs.model_dump())
        first = next(c.choices[0] for c in chunks if c.choices and c.choices[0].index == i)
        assert first.text == PROMPT  # the prompt goes first, on its own
        last = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == i][-1]
        assert last.finish_reason == whole.choices[i].finish_reason
    assert_idle(base_url)


def test_vllm_prompt_logprobs_on_both_endpoints(client, model, engine_out):
    r = client.completions.create(model="demo", prompt=PROMPT, max_tokens=2, temperature=0,
                                  extra_body={"prompt_logprobs": 2})
    entries = r.choices[0].model_extra["prompt_logprobs"]
    ids, records = engine_out.prompt_token_ids, engine_out.prompt_logprobs
    assert entries[0] is None and len(entries) == len(ids)
    for token, rec, entry in zip(ids[1:], records, entries[1:]):
        mine = entry[str(token)]
        assert mine["logprob"] == pytest.approx(rec.logprob, abs=1e-5) and mine["rank"] == rec.rank >= 1
        tops = [t for t, _ in rec.top[:2]]
        assert set(entry) == {str(t) for t in tops} | {str(token)}
        assert [entry[str(t)]["rank"] for t in tops if t != token] == [k + 1 for k, t in enumerate(tops) if t != token]
    assert any(entry[str(token)]["rank"] > 1 for token, entry in zip(ids[1:], entries[1:]))
    assert r.choices[0].text and r.usage.completion_tokens == 2  # a completion still comes
    plain = client.completions.create(model="demo", prompt=PROMPT, max_tokens=2, temperature=0)
    assert "prompt_logprobs" not in (plain.choices[0].model_extra or {})
    chat = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "Go"}], max_tokens=2,
                                          extra_body={"prompt_logprobs": 0})
    chat_entries = chat.choices[0].model_extra["prompt_logprobs"]
    assert chat_entries[0] is None and all(len(e) == 1 for e in chat_entries[1:]) and len(chat_entries) > 3
    streamed = list(client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "Go"}],
                                                   max_tokens=2, stream=True, extra_body={"prompt_logprobs": 0}))
    sent = [c.choices[0].model_extra.get("prompt_logprobs") for c in streamed if c.choices]
    assert [e for e in sent if e is not None] == [chat_entries]  # once, in the choice's first chunk after the role


@pytest.mark.parametrize("path, raw, message", [
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "echo": true}',
     "'echo' is a /v1/completions option"),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": 0}', "'max_tokens' must be at least 1, got 0"),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": 0, "echo": "yes"}', "'echo' must be true or false"),
    ("/v1/completions", b'{"prompt": "hi", "prompt_logprobs": 21}', "'prompt_logprobs' must be an integer in 0..20"),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": -1, "echo": true}', "'max_tokens' must be at least 0"),
])
def test_echo_and_prompt_logprobs_misuse_get_one_clear_400(base_url, path, raw, message):
    status, body = post(base_url, path, raw)
    assert status == 400 and message in body["error"]["message"], body
