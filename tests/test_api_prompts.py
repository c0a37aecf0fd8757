"""/v1/completions prompts in each OpenAI form (strings, token ids, lists of them): choices prompt-major, usage,
streaming, the checks of the field and all-or-none admission."""
from __future__ import annotations

import json

import openai
import pytest

from pwruntime.api_request import MAX_ENGINE_REQUESTS
from server_fixtures import assert_idle, base_url, client, metric, model, post  # noqa: F401 (fixtures)

PROMPTS = ["And God said unto Moses", "A fool"]


def _single(client, prompt, **kw):
    return client.completions.create(model="demo", prompt=prompt, **kw)


def test_several_prompts_with_n_choices_are_prompt_major(client):
    kw = dict(max_tokens=12, temperature=0)
    singles = [_single(client, p, **kw) for p in PROMPTS]
    r = _single(client, PROMPTS, n=2, **kw)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == [s.choices[0].text for s in singles for _ in range(2)]
    assert singles[0].choices[0].text != singles[1].choices[0].text  # so the order is seen
    assert r.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)  # each prompt once
    assert r.usage.completion_tokens == 2 * sum(s.usage.completion_tokens for s in singles)
    chunks = list(_single(client, PROMPTS, n=2, stream=True, stream_options={"include_usage": True}, **kw))
    assert ["".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i)
            for i in range(4)] == [c.text for c in r.choices]
    assert sorted(c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason) == [0, 1, 2, 3]
    assert not chunks[-1].choices and chunks[-1].usage == r.usage


def test_choice_j_of_each_prompt_samples_with_seed_plus_j(client):
    kw = dict(max_tokens=8, temperature=1.0, seed=11)
    r = _single(client, PROMPTS, n=2, **kw)
    singles = [_single(client, p, **{**kw, "seed": 11 + j}).choices[0].text for p in PROMPTS for j in range(2)]
    assert [c.text for c in r.choices] == singles and len(set(singles)) == 4


def test_token_id_prompts_equal_the_text_they_encode(client, model):
    kw = dict(max_tokens=12, temperature=0)
    ids = [model.tokenizer.encode(p) for p in PROMPTS]  # as the engine encodes a text prompt
    texts = [_single(client, p, **kw) for p in PROMPTS]
    one = _single(client, ids[0], **kw)
    assert one.choices[0].text == texts[0].choices[0].text and one.usage == texts[0].usage
    both = _single(client, ids, **kw)
    assert [c.text for c in both.choices] == [t.choices[0].text for t in texts]
    assert both.usage.prompt_tokens == len(ids[0]) + len(ids[1])


@pytest.mark.parametrize("prompt, detail", [
    (None, "got null"), (5, "got 5"), ({"text": "hi"}, "got {"), ([], "got []"), ("", "prompt is empty"),
    ([""], "prompt[0] is empty"), (["hi", ""], "prompt[1] is empty"), (["hi", 1], "got [\"hi\", 1]"),
    ([[1, 2], "hi"], "got [[1, 2], \"hi\"]"), ([1.5], "got [1.5]"), ([True], "got [true]"),
    ([[]], "prompt[0] is empty"),
    ([-1], "prompt[0] is -1"), ([4096], "prompt[0] is 4096"), ([[1], [2, 4096]], "prompt[1][1] is 4096"),
    ([[1, "2"]], "prompt[0][1] is \"2\""), (["\ud800"], "'prompt[0]' is not valid Unicode"),
])
def test_bad_prompts_get_one_400_naming_the_field(base_url, prompt, detail):
    status, body = post(base_url, "/v1/completions", json.dumps({"prompt": prompt, "max_tokens": 2}).encode())
    message = body["error"]["message"]
    assert status == 400 and "'prompt" in message and detail in message, message
    if "Unicode" not in detail:
        assert "a list of token ids" in message and "0..4095" in message  # what it accepts


@pytest.mark.parametrize("prompts, n", [(MAX_ENGINE_REQUESTS + 1, 1), (MAX_ENGINE_REQUESTS // 2 + 1, 2)])
def test_more_than_the_cap_of_choices_is_a_400(base_url, prompts, n):
    status, body = post(base_url, "/v1/completions", json.dumps({"prompt": ["hi"] * prompts, "n": n,
                                                                  "max_tokens": 2}).encode())
    assert status == 400 and f"'prompt' holds {prompts} prompts and 'n' is {n}" in body["error"]["message"]
    assert f"at most {MAX_ENGINE_REQUESTS} choices" in body["error"]["message"]


def test_the_cap_itself_is_served(client):
    r = _single(client, ["hi"] * (MAX_ENGINE_REQUESTS // 2), n=2, max_tokens=1, temperature=0)
    assert [c.index for c in r.choices] == list(range(MAX_ENGINE_REQUESTS))


@pytest.mark.parametrize("stream", [False, True])
def test_a_prompt_too_long_refuses_them_all_and_leaves_nothing_behind(client, base_url, stream):
    requests, errors = metric(base_url, "requests_total"), metric(base_url, "request_errors_total")
    with pytest.raises(openai.BadRequestError, match="shorten the prompt"):
        out = _single(client, [PROMPTS[0], "word " * 5000], n=2, max_tokens=4, stream=stream)
        list(out) if stream else out
    assert metric(base_url, "requests_total") == requests  # the first prompt's choices were added, then aborted
    assert metric(base_url, "request_errors_total") == errors + 4
    assert_idle(base_url)
    assert _single(client, PROMPTS[0], max_tokens=2, temperature=0).usage.completion_tokens == 2
