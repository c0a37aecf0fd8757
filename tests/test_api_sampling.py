"""OpenAI's logit_bias and vLLM's extra sampling fields on both endpoints: top_k, min_p, ignore_eos, stop_token_ids,
min_tokens and the presence, frequency and repetition penalties; each bad value one 400 naming the field."""
from __future__ import annotations

import json
from collections import Counter

import pytest

from pwruntime.engine import EngineConfig, LLMEngine
from pwruntime.sampling import SamplingParams
from server_fixtures import base_url, client, model, post  # noqa: F401 (fixtures)

PROMPT = "And God said unto Moses"
EOS_SOON = "hi"  # greedy, the demo model ends it with EOS after 12 tokens
EOS_FIRST = "Who wrote the book of Psalms?"  # greedy, its first token is EOS
REPEATS = "Hello."  # greedy, it repeats "  I have a" over and over


def _complete(client, prompt=PROMPT, **kw):
    return client.completions.create(model="demo", prompt=prompt, **{"max_tokens": 24, "temperature": 0, **kw})


def test_top_k_one_is_greedy_and_minus_one_or_zero_no_cut(client):
    greedy = _complete(client).choices[0].text
    assert _complete(client, temperature=1.0, extra_body={"top_k": 1}).choices[0].text == greedy
    sampled = [_complete(client, temperature=1.0, seed=5, extra_body=extra).choices[0].text
               for extra in ({}, {"top_k": -1}, {"top_k": 0})]
    assert sampled[0] != greedy and sampled == [sampled[0]] * 3
    chat = dict(model="demo", messages=[{"role": "user", "content": "Who wrote Psalms?"}], max_tokens=8)
    assert (client.chat.completions.create(temperature=1.0, extra_body={"top_k": 1}, **chat).choices[0].message ==
            client.chat.completions.create(temperature=0, **chat).choices[0].message)


def test_min_p_one_is_greedy_and_a_small_one_keeps_sampling(client):
    """min_p 1 keeps only the most likely token; a seeded small min_p samples as vLLM's, the same on both calls."""
    greedy = _complete(client).choices[0].text
    assert _complete(client, temperature=1.5, seed=3, extra_body={"min_p": 1.0}).choices[0].text == greedy
    loose = [_complete(client, temperature=1.5, seed=3, extra_body={"min_p": 0.01}).choices[0].text for _ in range(2)]
    assert loose[0] == loose[1] != greedy


def test_include_stop_str_in_output_keeps_the_stop_string(client):
    full = _complete(client).choices[0].text
    stop = full[len(full) // 2:][:5]
    cut = _complete(client, stop=[stop, "zzz"])
    kept = _complete(client, stop=[stop, "zzz"], logprobs=0, extra_body={"include_stop_str_in_output": True})
    assert cut.choices[0].text + stop == kept.choices[0].text == full[:full.index(stop) + len(stop)]
    assert "".join(kept.choices[0].logprobs.tokens) == kept.choices[0].text  # the reported tokens join to it
    streamed = _complete(client, stop=[stop], stream=True, extra_body={"include_stop_str_in_output": True})
    assert "".join(c.choices[0].text for c in streamed) == kept.choices[0].text


def test_ignore_eos_runs_to_max_tokens(client):
    stopped = _complete(client, EOS_SOON, max_tokens=20)
    assert stopped.choices[0].finish_reason == "stop" and stopped.usage.completion_tokens < 20
    run_on = _complete(client, EOS_SOON, max_tokens=20, extra_body={"ignore_eos": True})
    assert run_on.choices[0].finish_reason == "length" and run_on.usage.completion_tokens == 20
    assert run_on.choices[0].text.startswith(stopped.choices[0].text)


def test_stop_token_ids_end_a_choice_at_that_token(client, model):
    greedy = LLMEngine(model, EngineConfig(num_kv_blocks=64)).generate([PROMPT], SamplingParams(max_tokens=24))[0]
    stop = greedy.token_ids[5]
    at = greedy.token_ids.index(stop)
    cut = _complete(client, extra_body={"stop_token_ids": [stop]})
    assert cut.choices[0].finish_reason == "stop" and cut.usage.completion_tokens == at + 1  # the stop token counts
    assert cut.choices[0].text == model.tokenizer.decode(greedy.token_ids[:at])  # and is not shown


def test_min_tokens_holds_back_eos_and_stop_strings(client):
    assert _complete(client, EOS_FIRST).usage.completion_tokens == 1
    held = _complete(client, EOS_FIRST, extra_body={"min_tokens": 5})
    assert held.usage.completion_tokens > 5 and held.choices[0].text
    whole = _complete(client).choices[0].text
    assert whole.startswith(",") and _complete(client, stop=",").choices[0].text == ""
    later = _complete(client, stop=",", extra_body={"min_tokens": 3}).choices[0]
    assert later.finish_reason == "stop" and later.text == whole[:whole.index(",", 1)]


@pytest.mark.parametrize("penalty", [{"frequency_penalty": 2.0}, {"presence_penalty": 2.0},
                                     {"repetition_penalty": 1.5}])
def test_penalties_break_a_greedy_repetition(client, model, penalty):
    def most_repeated(r) -> int:
        return Counter(model.tokenizer.encode(r.choices[0].text, add_special_tokens=False)).most_common(1)[0][1]

    plain = _complete(client, REPEATS, max_tokens=48)
    assert most_repeated(plain) >= 4
    penalized = _complete(client, REPEATS, max_tokens=48, extra_body=penalty)
    assert penalized.choices[0].text != plain.choices[0].text and most_repeated(penalized) <= 2
    streamed = list(_complete(client, REPEATS, max_tokens=48, stream=True, extra_body=penalty))
    assert "".join(c.choices[0].text for c in streamed) == penalized.choices[0].text


def test_logit_bias_bans_and_forces_tokens(client, model):
    """-100 keeps a token out of a greedy answer (its first token changes), 100 makes a token every token of it,
    greedy or sampled, streamed or not, on both endpoints (the openai client's own `logit_bias`)."""
    def ids(r) -> list[int]:
        return model.tokenizer.encode(r.choices[0].text, add_special_tokens=False)

    plain = _complete(client, max_tokens=12)
    first = ids(plain)[0]
    banned = _complete(client, max_tokens=12, logit_bias={str(first): -100})
    assert first not in ids(banned) and banned.choices[0].text != plain.choices[0].text
    forced = model.tokenizer.encode(" Moses", add_special_tokens=False)[0]
    want = model.tokenizer.decode([forced] * 6)
    for kw in ({}, {"temperature": 1.0, "seed": 3}):
        kw = {"max_tokens": 6, "logit_bias": {str(forced): 100}, **kw}
        assert _complete(client, **kw).choices[0].text == want
        assert "".join(c.choices[0].text for c in _complete(client, stream=True, **kw)) == want
    chat = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "Who wrote Psalms?"}],
                                          max_tokens=4, temperature=0, logit_bias={str(forced): 100})
    assert chat.choices[0].message.content == model.tokenizer.decode([forced] * 4)


def test_request_fields_take_openai_s_defaults_and_bounds():
    """What a body leaves out or sets at a bound: temperature 1 (OpenAI's default: it samples), up to four stop
    strings, chat's `max_completion_tokens` as max_tokens (at least 1, not 0 read as 1), and with `echo` the prompt
    records keep as many alternatives as the larger of `logprobs` and `prompt_logprobs`."""
    from pwruntime.api_request import MAX_STOPS, RequestError, sampling_params

    def params(body, chat=False, echo=False):
        return sampling_params(body, 16, chat, 4096, echo=echo)

    assert params({}).temperature == 1.0 and not params({}).greedy and params({}).max_tokens == 16
    stops = [f"s{i}" for i in range(MAX_STOPS)]
    assert params({"stop": stops}).stop == tuple(stops)
    with pytest.raises(RequestError, match=f"up to {MAX_STOPS} strings"):
        params({"stop": [*stops, "one more"]})
    assert params({"max_completion_tokens": 3}, chat=True).max_tokens == 3
    with pytest.raises(RequestError, match="'max_completion_tokens' must be at least 1, got 0"):
        params({"max_completion_tokens": 0}, chat=True)
    assert params({"logprobs": 2, "prompt_logprobs": 1}, echo=True).prompt_logprobs == 2
    assert params({"logprobs": 1, "prompt_logprobs": 3}, echo=True).prompt_logprobs == 3
    assert params({"logprobs": 2}).prompt_logprobs is None  # without echo only prompt_logprobs asks


@pytest.mark.parametrize("fields, message", [
    ({"top_k": -2}, "'top_k' must be at least -1, got -2"), ({"top_k": 1.5}, "'top_k' must be an integer"),
    ({"min_p": 1.5}, "'min_p' must lie in [0, 1], got 1.5"), ({"min_p": "0.1"}, "'min_p' must be a number"),
    ({"ignore_eos": "yes"}, "'ignore_eos' must be true or false"),
    ({"stop_token_ids": [4096]}, "'stop_token_ids' must be a list of token ids (integers in 0..4095), got [4096]"),
    ({"stop_token_ids": [-1]}, "'stop_token_ids' must be a list of token ids"),
    ({"stop_token_ids": 3}, "'stop_token_ids' must be a list of token ids"),
    ({"stop_token_ids": [True]}, "'stop_token_ids' must be a list of token ids"),
    ({"min_tokens": -1}, "'min_tokens' must be at least 0, got -1"),
    ({"min_tokens": 3, "max_tokens": 2}, "min_tokens must lie in 0..max_tokens (2), got 3"),
    ({"presence_penalty": 2.5}, "'presence_penalty' must lie in [-2, 2], got 2.5"),
    ({"frequency_penalty": "1"}, "'frequency_penalty' must be a number"),
    ({"repetition_penalty": 0}, "repetition_penalty must be a finite number > 0, got 0.0"),
    ({"repetition_penalty": -1.5}, "repetition_penalty must be a finite number > 0, got -1.5"),
    ({"logit_bias": {"4096": 1}}, "'logit_bias' must map token ids (strings of integers in 0..4095) to numbers in "
                                  "[-100, 100]; the key \"4096\" is not a token id"),
    ({"logit_bias": {"-1": 1}}, "the key \"-1\" is not a token id"),
    ({"logit_bias": {"x": 1}}, "the key \"x\" is not a token id"),
    ({"logit_bias": {"5": 101}}, "the key \"5\" has 101"),
    ({"logit_bias": {"5": "1"}}, "the key \"5\" has \"1\""),
    ({"logit_bias": {"5": True}}, "the key \"5\" has true"),
    ({"logit_bias": {"5": 1, "05": 2}}, "token 5 is named twice"),
    ({"logit_bias": [5]}, "'logit_bias' must map token ids"),
])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_bad_extra_fields_get_one_400_naming_them(base_url, path, fields, message):
    body = {"max_tokens": 2, **fields}
    body.update({"prompt": "hi"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]})
    status, out = post(base_url, path, json.dumps(body).encode())
    assert status == 400 and message in out["error"]["message"], out
