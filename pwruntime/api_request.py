"""What an OpenAI-style request body asks for: its checked fields, or one `RequestError` naming the bad one.

`parse_body` reads the JSON (refusing NaN and Infinity, which JSON does not have), `sampling_params` the sampling
fields of /v1/completions and /v1/chat/completions (log-probabilities included: completions' `logprobs` N, chat's
`logprobs` true with `top_logprobs` N; `logit_bias`; and vLLM's extra fields `top_k`, `min_p`, `min_tokens`, `ignore_eos`, `include_stop_str_in_output`,
`stop_token_ids`, `presence_penalty`, `frequency_penalty`, `repetition_penalty`), `completion_prompts` the prompts of
/v1/completions in each OpenAI form (a string, a list of strings, a list of token ids, a list of token-id lists),
`num_choices` and `engine_requests` the engine requests of a body: each prompt's `n` choices, prompt-major (choice
i of a request with `seed` s samples with seed s + i), `check_unsupported` the options this server does not serve
(best_of, a chat's echo, suffix, tools, a response_format other than text), and `check_text` refuses strings that are not
valid Unicode (lone surrogates), which the tokenizer cannot encode. /v1/completions' `echo` (with `max_tokens` 0
allowed: `prompt_only`) and vLLM's `prompt_logprobs` ask for prompt log-probabilities (pwruntime.prompt_logprobs). Each error names the field and what it accepts.
"""
from __future__ import annotations

import dataclasses
import json
import math

from pwruntime.sampling import SamplingParams

MAX_STOPS = 4
MAX_CHOICES = 16  # `n`
MAX_ENGINE_REQUESTS = 64  # prompts x n of one request
MAX_LOGPROBS = 20  # top log-probabilities per token: vLLM's limit (OpenAI's is 5 for completions, 20 for chat)
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
# vLLM's options that change what is returned and that this server does not serve (refused, not ignored)
UNSERVED_OPTIONS = (("guided_json", "constrained decoding"), ("guided_regex", "constrained decoding"),
                    ("guided_choice", "constrained decoding"), ("guided_grammar", "constrained decoding"),
                    ("structured_outputs", "constrained decoding"), ("allowed_token_ids", "a token whitelist"),
                    ("bad_words", "banned words"), ("use_beam_search", "beam search"),
                    ("truncate_prompt_tokens", "prompt truncation"))


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


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _integer(body: dict, key: str, lo: int | None = None, hi: int | None = None) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    span = f"an integer in {lo}..{hi}" if hi is not None else None  # hi comes with lo
    if not _is_int(value):
        raise RequestError(f"'{key}' must be {span or 'an integer'}, got {json.dumps(value)}")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise RequestError(f"'{key}' must be {span or f'at least {lo}'}, got {value}")
    return value


def flag(body: dict, key: str) -> bool:
    value = body.get(key, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise RequestError(f"'{key}' must be true or false, got {json.dumps(value)}")
    return value


def _is_token(value, vocab: int) -> bool:
    return _is_int(value) and 0 <= value < vocab


def brief(value) -> str:
    """A value as JSON, cut short: an error message does not echo a whole prompt."""
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def token_ids(body: dict, key: str, vocab: int) -> tuple[int, ...]:
    value = body.get(key)
    if value is None:
        return ()
    if not isinstance(value, list) or not all(_is_token(t, vocab) for t in value):
        raise RequestError(f"'{key}' must be a list of token ids (integers in 0..{vocab - 1}), got {brief(value)}")
    return tuple(value)


def _logit_bias(body: dict, vocab: int) -> dict[int, float]:
    """`logit_bias`, as OpenAI's: an object mapping token ids (as strings) to biases in [-100, 100]."""
    value = body.get("logit_bias")
    if value is None:
        return {}
    form = f"'logit_bias' must map token ids (strings of integers in 0..{vocab - 1}) to numbers in [-100, 100]"
    if not isinstance(value, dict):
        raise RequestError(f"{form}, got {brief(value)}")
    out = {}
    for key, bias in value.items():
        token = int(key) if key.isascii() and key.isdigit() else -1
        if not 0 <= token < vocab:
            raise RequestError(f"{form}; the key {brief(key)} is not a token id")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
            raise RequestError(f"{form}; the key {brief(key)} has {brief(bias)}")
        if token in out:
            raise RequestError(f"{form}; token {token} is named twice")
        out[token] = float(bias)
    return out


def sampling_params(body: dict, default_max_tokens: int, chat: bool, vocab: int, echo: bool = False) -> SamplingParams:
    """The sampling fields; `default_max_tokens` when neither max_tokens nor max_completion_tokens is given; token
    ids lie in 0..vocab - 1. `top_k` -1 or 0 is no cut, as vLLM's -1. `echo` (/v1/completions): the choices begin
    with the prompt, so `max_tokens` may be 0 (`prompt_only`: the engine computes one token, which the response
    leaves out) and `logprobs` N asks for the prompt's too; vLLM's `prompt_logprobs` N asks for them on its own."""
    max_tokens = _integer(body, "max_tokens", 0 if echo else 1)
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
    logprobs = _chat_logprobs(body) if chat else _completion_logprobs(body)
    try:
        return SamplingParams(max_tokens=default_max_tokens if max_tokens is None else max(max_tokens, 1),
                              clip_to_context=max_tokens is None,  # as OpenAI: an explicit length must fit
                              temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
                              top_p=_number(body, "top_p", 1.0, 0.0, 1.0),
                              top_k=max(_integer(body, "top_k", -1) or 0, 0),
                              min_p=_number(body, "min_p", 0.0, 0.0, 1.0),
                              seed=_integer(body, "seed"), stop=stop,
                              stop_token_ids=token_ids(body, "stop_token_ids", vocab),
                              ignore_eos=flag(body, "ignore_eos"),
                              include_stop_str_in_output=flag(body, "include_stop_str_in_output"),
                              min_tokens=_integer(body, "min_tokens", 0) or 0,
                              presence_penalty=_number(body, "presence_penalty", 0.0, -2.0, 2.0),
                              frequency_penalty=_number(body, "frequency_penalty", 0.0, -2.0, 2.0),
                              repetition_penalty=_number(body, "repetition_penalty", 1.0, -math.inf, math.inf),
                              logit_bias=_logit_bias(body, vocab), logprobs=logprobs,
                              prompt_logprobs=_prompt_logprobs(body, logprobs if echo else None))
    except ValueError as e:  # what SamplingParams refuses: top_p 0, an empty stop string, min_tokens > max_tokens ...
        raise RequestError(f"bad sampling parameter: {e}") from None


def _prompt_logprobs(body: dict, echoed: int | None) -> int | None:
    """The top tokens each prompt record keeps: vLLM's `prompt_logprobs` N, or what echoed log-probabilities show."""
    asked = _integer(body, "prompt_logprobs", 0, MAX_LOGPROBS)
    if asked is None or echoed is None:
        return echoed if asked is None else asked
    return max(asked, echoed)


def prompt_only(body: dict) -> bool:
    """An echo with `max_tokens` 0: the response holds the prompt alone (its fields checked by `sampling_params`)."""
    return flag(body, "echo") and body.get("max_tokens") == 0


def _completion_logprobs(body: dict) -> int | None:
    """/v1/completions: `logprobs` N, the N most likely tokens beside each sampled one's log-probability."""
    if body.get("top_logprobs") is not None:
        raise RequestError("'top_logprobs' is a chat option; /v1/completions takes 'logprobs': N "
                           f"(an integer in 0..{MAX_LOGPROBS})")
    return _integer(body, "logprobs", 0, MAX_LOGPROBS)


def _chat_logprobs(body: dict) -> int | None:
    """/v1/chat/completions: `logprobs` true, with `top_logprobs` N (0 when left out) most likely tokens."""
    top = _integer(body, "top_logprobs", 0, MAX_LOGPROBS)
    if not flag(body, "logprobs"):
        if top is not None:
            raise RequestError("'top_logprobs' needs 'logprobs': true")
        return None
    return top or 0


def num_choices(body: dict) -> int:
    """`n`: how many independent choices of the prompt to return."""
    n = _integer(body, "n", 1, MAX_CHOICES)
    return 1 if n is None else n


def choice_params(params: SamplingParams, n: int) -> list[SamplingParams]:
    """The params of each of `n` choices: with a seed s, choice i samples with seed s + i (so choice i equals an
    n = 1 request with seed s + i); without one, each choice gets the engine's seed for its request."""
    if params.seed is None:
        return [params] * n
    return [dataclasses.replace(params, seed=params.seed + i) for i in range(n)]


def engine_requests(prompts: list[tuple[list[int], str | None]], params: SamplingParams,
                    n: int) -> list[tuple[list[int], SamplingParams, str | None]]:
    """The (token ids, params, their text) of each engine request, from each prompt's (token ids, text): `n` choices
    of each prompt, prompt-major (choice j of prompt i is the response's choice i * n + j, and samples as choice j of
    a request for that prompt alone)."""
    if len(prompts) * n > MAX_ENGINE_REQUESTS:
        raise RequestError(f"'prompt' holds {len(prompts)} prompts and 'n' is {n}: a request may ask for at most "
                           f"{MAX_ENGINE_REQUESTS} choices in all (prompts x n)")
    choices = choice_params(params, n)
    return [(ids, p, text) for ids, text in prompts for p in choices]


def check_unsupported(body: dict, chat: bool) -> None:
    """Options that would change what is returned and that this server does not serve: refused, not ignored."""
    best_of = _integer(body, "best_of", 1)
    if best_of is not None and best_of != 1:
        raise RequestError(f"'best_of' = {best_of} is not supported: ask for 'n' choices and pick one yourself; "
                           "send best_of = 1")
    if chat and flag(body, "echo"):
        raise RequestError("'echo' is a /v1/completions option; a chat's messages are what you sent")
    if body.get("suffix"):
        raise RequestError("'suffix' (text after the completion) is not supported; leave it out")
    for key in ("tools", "functions"):
        if body.get(key):
            raise RequestError(f"'{key}' (tool calls) is not supported; leave it out and describe the tools in a "
                               "message if the model should know of them")
    response_format = body.get("response_format")
    if response_format is not None and response_format != {"type": "text"}:
        raise RequestError(f"'response_format' {brief(response_format)} is not supported (no constrained "
                           "decoding); leave it out or send {\"type\": \"text\"}")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise RequestError(f"'stream_options' must be an object, got {json.dumps(options)}")
    if isinstance(options, dict) and flag(options, "continuous_usage_stats"):
        raise RequestError("'stream_options.continuous_usage_stats' is not supported: usage comes once, in the last "
                           "chunk ('include_usage')")
    for key, what in UNSERVED_OPTIONS:
        if body.get(key) not in (None, False, [], {}):
            raise RequestError(f"'{key}' ({what}) is not supported; leave it out")
    if body.get("skip_special_tokens") is False:
        raise RequestError("'skip_special_tokens' = false is not supported: the text leaves special tokens out")


def include_usage(body: dict) -> bool:
    options = body.get("stream_options") or {}
    return flag(options, "include_usage")


def completion_prompts(body: dict, vocab: int) -> list[str | list[int]]:
    """`prompt` in any of OpenAI's forms: the prompts in order, each a string or a list of token ids."""
    prompt = body.get("prompt")
    forms = ("'prompt' must be a non-empty string, a list of non-empty strings, a list of token ids or a list of "
             f"non-empty token-id lists (token ids are integers in 0..{vocab - 1})")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt)):
        prompts, names = [prompt], ["prompt"]
    elif isinstance(prompt, list) and prompt and any(all(isinstance(p, kind) for p in prompt) for kind in (str, list)):
        prompts, names = prompt, [f"prompt[{i}]" for i in range(len(prompt))]
    else:
        raise RequestError(f"{forms}, got {brief(prompt)}")
    for p, name in zip(prompts, names):
        if not p:
            raise RequestError(f"{forms}; {name} is empty")
        if isinstance(p, str):
            check_text(p, name)
            continue
        bad = next((k for k, t in enumerate(p) if not _is_token(t, vocab)), None)
        if bad is not None:
            raise RequestError(f"{forms}; {name}[{bad}] is {brief(p[bad])}")
    return prompts


def check_text(text: str, field: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise RequestError(f"'{field}' is not valid Unicode text ({e.reason} at character {e.start})") from None


def chat_messages(body: dict) -> list[dict]:
    """The messages, each {role, content} with its content as one string: OpenAI's list of text parts is joined, as
    vLLM joins them (other parts, such as images, are refused)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise RequestError(f"messages[{i}] must be an object with a 'content' string or list of text parts")
        if m.get("role") not in CHAT_ROLES:
            raise RequestError(f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, got "
                               f"{json.dumps(m.get('role'))}")
        content = _message_text(m.get("content"), f"messages[{i}].content")
        check_text(content, f"messages[{i}].content")
        out.append({**m, "content": content})
    return out


def _message_text(content, field: str) -> str:
    """A message's content: a string, or a list of {"type": "text", "text": ...} parts, joined by newlines."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not content:
        raise RequestError(f"'{field}' must be a string or a non-empty list of text parts, got {brief(content)}")
    texts = []
    for k, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else None
            raise RequestError(f"'{field}[{k}]' must be a text part {{\"type\": \"text\", \"text\": ...}}"
                               + (f"; '{kind}' parts are not supported (a text-only model)" if kind else ""))
        texts.append(part["text"])
    return "\n".join(texts)
