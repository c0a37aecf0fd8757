"""What an OpenAI-style request body asks for: its checked fields, or one `RequestError` naming the bad one.

`parse_body` reads the JSON (refusing NaN and Infinity, which JSON does not have), `sampling_params` the sampling
fields of /v1/completions and /v1/chat/completions, `check_unsupported` the options this server does not serve
(several choices, echo, log-probabilities), and `check_text` refuses strings that are not valid Unicode (lone
surrogates), which the tokenizer cannot encode. Each error names the field and what it accepts.
"""
from __future__ import annotations

import json
import math

from pwruntime.sampling import SamplingParams

MAX_STOPS = 4
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


class RequestError(ValueError):
    """A client error: `status` (400 unless the request names something that does not exist) and its message."""

    def __init__(self, message: str, status: int = 400, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.code = status, code


def parse_body(raw: bytes) -> dict:
    def no_constant(name: str):
        raise RequestError(f"the body contains {name}, which is not JSON; send numbers only")

    try:
        body = json.loads(raw.decode("utf-8"), parse_constant=no_constant)
    except RequestError:
        raise
    except (ValueError, RecursionError):  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise RequestError("the body is not valid JSON (UTF-8)") from None
    if not isinstance(body, dict):
        raise RequestError("the body must be a JSON object")
    return body


def _number(body: dict, key: str, default: float, lo: float, hi: float) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RequestError(f"'{key}' must be a number, got {json.dumps(value)}")
    if value < lo or value > hi:
        raise RequestError(f"'{key}' must lie in [{lo:g}, {hi:g}], got {value:g}")
    return float(value)


def _integer(body: dict, key: str, lo: int | None = None) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(f"'{key}' must be an integer, got {json.dumps(value)}")
    if lo is not None and value < lo:
        raise RequestError(f"'{key}' must be at least {lo}, got {value}")
    return value


def flag(body: dict, key: str) -> bool:
    value = body.get(key, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise RequestError(f"'{key}' must be true or false, got {json.dumps(value)}")
    return value


def sampling_params(body: dict, default_max_tokens: int) -> SamplingParams:
    """The sampling fields; `default_max_tokens` when neither max_tokens nor max_completion_tokens is given."""
    max_tokens = _integer(body, "max_tokens", 1)
    if max_tokens is None:
        max_tokens = _integer(body, "max_completion_tokens", 1)
    stop = body.get("stop")
    if stop is None:
        stop = ()
    elif isinstance(stop, str):
        stop = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop) and len(stop) <= MAX_STOPS:
        stop = tuple(stop)
    else:
        raise RequestError(f"'stop' must be a string or a list of up to {MAX_STOPS} strings, got {json.dumps(stop)}")
    for s in stop:
        check_text(s, "stop")
    try:
        return SamplingParams(max_tokens=default_max_tokens if max_tokens is None else max_tokens,
                              clip_to_context=max_tokens is None,  # as OpenAI: an explicit length must fit
                              temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
                              top_p=_number(body, "top_p", 1.0, 0.0, 1.0),
                              seed=_integer(body, "seed"), stop=stop)
    except ValueError as e:  # what SamplingParams itself refuses: top_p 0, an empty stop string
        raise RequestError(f"bad sampling parameter: {e}") from None


def check_unsupported(body: dict) -> None:
    """Options that would change what is returned and that this server does not serve: refused, not ignored."""
    for key in ("n", "best_of"):
        n = _integer(body, key, 1)
        if n is not None and n != 1:
            raise RequestError(f"'{key}' = {n} is not supported: this server returns one choice; send {key} = 1")
    if flag(body, "echo"):
        raise RequestError("'echo' is not supported; send the prompt's text yourself")
    logprobs = body.get("logprobs")
    if logprobs not in (None, False) or body.get("top_logprobs") not in (None, 0):
        raise RequestError("log-probabilities ('logprobs', 'top_logprobs') are not supported; leave them out")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise RequestError(f"'stream_options' must be an object, got {json.dumps(options)}")


def include_usage(body: dict) -> bool:
    options = body.get("stream_options") or {}
    return flag(options, "include_usage")


def completion_prompt(body: dict) -> str:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise RequestError("'prompt' must be a non-empty string")
    check_text(prompt, "prompt")
    return prompt


def check_text(text: str, field: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise RequestError(f"'{field}' is not valid Unicode text ({e.reason} at character {e.start})") from None


def chat_messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list of {role, content} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("content"), str):
            raise RequestError(f"messages[{i}] must be an object with a string 'content'")
        if m.get("role") not in CHAT_ROLES:
            raise RequestError(f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, got {json.dumps(m.get('role'))}")
        check_text(m["content"], f"messages[{i}].content")
    return messages
