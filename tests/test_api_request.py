"""pwruntime.api_request on its own (no server): the edges of what a request body may ask for."""
import pytest

from pwruntime.api_request import MAX_LOGPROBS, RequestError, chat_messages, flag, sampling_params


def _params(body: dict):
    return sampling_params(body, 16, chat=False, vocab=100)


def test_an_integer_field_takes_its_upper_bound_and_refuses_one_more():
    assert _params({"logprobs": MAX_LOGPROBS}).logprobs == MAX_LOGPROBS
    with pytest.raises(RequestError, match=f"'logprobs' must be an integer in 0..{MAX_LOGPROBS}, got 21"):
        _params({"logprobs": MAX_LOGPROBS + 1})


def test_logit_bias_takes_token_0_and_the_last_token():
    assert _params({"logit_bias": {"0": 5, "99": -1}}).logit_bias == ((0, 5.0), (99, -1.0))
    with pytest.raises(RequestError, match="the key \"100\" is not a token id"):
        _params({"logit_bias": {"100": 1}})


def test_a_flag_left_null_is_false_and_a_non_boolean_is_refused():
    assert flag({"echo": None}, "echo") is False and flag({}, "echo") is False and flag({"echo": True}, "echo")
    with pytest.raises(RequestError, match="'echo' must be true or false, got 1"):
        flag({"echo": 1}, "echo")


@pytest.mark.parametrize("content, needle", [
    (5, "'messages[0].content' must be a string or a non-empty list of text parts, got 5"),
    ([], "'messages[0].content' must be a string or a non-empty list"),
    (["hi"], "'messages[0].content[0]' must be a text part"),
    ([{"type": "input_audio", "text": "x"}], "'input_audio' parts are not supported (a text-only model)"),
])
def test_a_message_content_that_is_not_text_parts_is_one_clear_error(content, needle):
    with pytest.raises(RequestError) as raised:
        chat_messages({"messages": [{"role": "user", "content": content}]})
    assert needle in str(raised.value)


def test_text_parts_join_by_newlines():
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert chat_messages({"messages": [{"role": "user", "content": parts}]}) == [{"role": "user", "content": "a\nb"}]
