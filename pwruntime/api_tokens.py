"""A choice's tokens as OpenAI response pieces: each token's text, which tokens a returned text reports, streamed
text released a whole token at a time, and log-probabilities in the completions and chat shapes.

Token text: the characters a token adds to the decoded output, decoded in the context of the tokens before it
(incrementally, as vLLM's detokenizer). A token that ends inside a multi-byte UTF-8 character adds nothing ("")
and the token that completes the character carries all of it, so the texts of a choice's tokens join to its text.
A top alternative's text is what it would add in the same place (an incomplete character reads U+FFFD).

Reported tokens (the rule under stop strings): a choice's text is cut before a stop string, and a token is reported
when its text ends within the returned text (a token that adds no text, such as the EOS token that ended the
choice, counts as ending where it stands); the token whose text straddles the cut is reported with its text cut
there, and no token after it. So the reported tokens' texts always join to the returned text, and without a stop
string every token is reported.

Prompts (/v1/completions' `echo`, vLLM's `prompt_logprobs`): `prompt_pieces` are the prompt's tokens as pieces, the
first without a record (nothing precedes it: its log-probability is null, as OpenAI's), the others with the
engine's prompt records (pwruntime.prompt_logprobs); `prompt_logprobs_entries` is vLLM's per-token shape.

Streaming: text goes out a whole token at a time once no stop string can cut into it (the last `hold` characters,
as many as could begin a stop string, wait), each chunk with the log-probabilities of the tokens whose text it
carries; the final chunk carries the rest of the reported tokens. So a stream joins to the non-streamed response.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence as Seq

from pwruntime.sampling import TokenLogprob

CONTEXT_TOKENS = 5  # settled tokens decoded before a token to find its text (vLLM's detokenizer uses 5)
LOGPROB_FLOOR = -9999.0  # OpenAI's value for a log-probability too small to show (JSON has no -Infinity)


@dataclass(frozen=True)
class Piece:
    """One token of a choice: its text, its log-probabilities (None when not asked) and its alternatives' texts."""
    text: str
    record: TokenLogprob | None = None
    top_texts: tuple[str, ...] = ()  # aligned with record.top


class TokenTexts:
    """The texts of a choice's tokens (module docstring), decoded as they come: `add`, then `flush` at the end."""

    def __init__(self, tokenizer) -> None:
        self._tok = tokenizer
        self.ids: list[int] = []
        self.pieces: list[Piece] = []
        self.settled = 0  # tokens whose text is final; those after it end inside an incomplete character
        self.chars = 0  # the length of the pieces' texts joined

    def add(self, ids: Seq[int], records: Seq[TokenLogprob] = ()) -> None:
        """Tokens and, when log-probabilities were asked for, their records (one per token)."""
        for i, token in enumerate(ids):
            record = records[i] if records else None
            start, before = self._window()
            context = self.ids[start:]
            text = self._tok.decode(context + [token])[len(before):]
            tops = tuple(self._tok.decode(context + [t])[len(before):] for t, _ in record.top) if record else ()
            self.ids.append(token)
            complete = not text.endswith("\ufffd")
            self.pieces.append(Piece(text if complete else "", record, tops))
            if complete:
                self.settled, self.chars = len(self.ids), self.chars + len(text)

    def flush(self) -> None:
        """The choice ended: an incomplete character left at its end goes, as U+FFFD, to the last token."""
        if self.settled < len(self.ids):
            start, before = self._window()
            rest = self._tok.decode(self.ids[start:])[len(before):]
            self.pieces[-1] = replace(self.pieces[-1], text=rest)
            self.settled, self.chars = len(self.ids), self.chars + len(rest)

    def _window(self) -> tuple[int, str]:
        """Where the decoding context starts, and the text of its settled tokens."""
        start = max(0, self.settled - CONTEXT_TOKENS)
        return start, self._tok.decode(self.ids[start:self.settled])


def reported(pieces: Seq[Piece], text: str) -> list[Piece]:
    """The pieces reported for a choice that returned `text` (the rule in the module docstring)."""
    out, at = [], 0
    for p in pieces:
        if at + len(p.text) <= len(text):
            out.append(p)
        elif at < len(text):
            out.append(replace(p, text=p.text[:len(text) - at]))
        else:
            break
        at += len(p.text)
    return out


def choice_pieces(tokenizer, out) -> list[Piece]:
    """The reported pieces of a finished engine output (pwruntime.engine.RequestOutput)."""
    texts = TokenTexts(tokenizer)
    texts.add(out.token_ids, out.logprobs)
    texts.flush()
    return reported(texts.pieces, out.text)


def prompt_pieces(tokenizer, ids: Seq[int], records: Seq[TokenLogprob], top: int | None) -> list[Piece]:
    """A prompt's pieces: `records` (one per token after the first, or none when not computed), each keeping its
    `top` most likely alternatives (None: all it has)."""
    texts = TokenTexts(tokenizer)
    texts.add(ids, [None, *(replace(r, top=r.top[:top]) for r in records)] if records else ())
    texts.flush()
    return texts.pieces


def prompt_logprobs_entries(pieces: Seq[Piece]) -> list[dict | None]:
    """vLLM's `prompt_logprobs`: None for the first token, then per token {token id: {logprob, rank, decoded_token}}
    over its alternatives (ranks 1, 2, ...) and the token itself (its own rank)."""
    out: list[dict | None] = [None]
    for p in pieces[1:]:
        entry = {str(t): {"logprob": _logprob(lp), "rank": i + 1, "decoded_token": text}
                 for i, ((t, lp), text) in enumerate(zip(p.record.top, p.top_texts))}
        entry[str(p.record.token_id)] = {"logprob": _logprob(p.record.logprob), "rank": p.record.rank,
                                         "decoded_token": p.text}
        out.append(entry)
    return out


class TextStream:
    """One streamed choice: `push` the tokens of each engine step, `finish` with the engine's output. Each returns
    (text, pieces) to send; `sent_chars` is where the next text starts in the choice's text."""

    def __init__(self, tokenizer, hold: int) -> None:
        self.texts, self.hold = TokenTexts(tokenizer), hold
        self.sent = 0  # pieces sent
        self.sent_chars = 0

    def push(self, ids: Seq[int], records: Seq[TokenLogprob]) -> tuple[str, list[Piece]]:
        t = self.texts
        t.add(ids, records)
        end, at = self.sent, self.sent_chars
        while end < t.settled and at + len(t.pieces[end].text) <= t.chars - self.hold:
            at += len(t.pieces[end].text)
            end += 1
        pieces = t.pieces[self.sent:end]
        return self._sent("".join(p.text for p in pieces), pieces)

    def finish(self, out) -> tuple[str, list[Piece]]:
        t = self.texts
        t.add(out.token_ids[len(t.ids):], out.logprobs[len(t.ids):])
        t.flush()
        return self._sent(out.text[self.sent_chars:], reported(t.pieces, out.text)[self.sent:])

    def _sent(self, text: str, pieces: list[Piece]) -> tuple[str, list[Piece]]:
        self.sent, self.sent_chars = self.sent + len(pieces), self.sent_chars + len(text)
        return text, pieces


def _logprob(value: float) -> float:
    return max(value, LOGPROB_FLOOR)


def _top_dict(p: Piece) -> dict[str, float]:
    """Two alternatives that read the same share a key: the more likely keeps it."""
    top: dict[str, float] = {}
    for text, (_, lp) in zip(p.top_texts, p.record.top):
        top.setdefault(text, _logprob(lp))
    return top


def completion_logprobs(pieces: Seq[Piece], offset: int) -> dict:
    """OpenAI's legacy completions shape; `offset`: where the first piece's text starts in the choice's text. A piece
    without a record (an echoed prompt's first token) has null log-probabilities."""
    offsets = []
    for p in pieces:
        offsets.append(offset)
        offset += len(p.text)
    return {"tokens": [p.text for p in pieces],
            "token_logprobs": [None if p.record is None else _logprob(p.record.logprob) for p in pieces],
            "top_logprobs": [None if p.record is None else _top_dict(p) for p in pieces], "text_offset": offsets}


def _chat_entry(text: str, logprob: float) -> dict:
    return {"token": text, "logprob": _logprob(logprob), "bytes": list(text.encode("utf-8"))}


def chat_logprobs(pieces: Seq[Piece]) -> dict:
    """OpenAI's chat shape; `bytes` are the UTF-8 of the token's text (so a choice's bytes join to its text's)."""
    return {"content": [{**_chat_entry(p.text, p.record.logprob),
                         "top_logprobs": [_chat_entry(t, lp) for t, (_, lp) in zip(p.top_texts, p.record.top)]}
                        for p in pieces]}
