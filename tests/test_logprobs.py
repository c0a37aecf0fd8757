"""Log-probabilities: the sampler's records, token texts and the stop-string rule, the engine against a forward pass
and under preemption. (The server's shapes, streamed and not: test_server.py.)"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from model_fixtures import make_text, make_tiny_checkpoint
from pwruntime.api_tokens import Piece, TextStream, TokenTexts, choice_pieces, reported
from pwruntime.cmd_perplexity import default_model_dir
from pwruntime.engine import EngineConfig, LLMEngine
from pwruntime.model import load_model
from pwruntime.model.attention_plan import prefill_metadata
from pwruntime.sampling import SamplingParams, TokenLogprob, logprobs_on_device


# ------------------------------------------------------------------------------------------------- the sampler
def test_records_rank_the_raw_logits_with_ties_to_the_lower_id():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [0.0, 0.0, 0.0, 5.0], [2.0, 1.0, 0.0, -1.0]])
    params = [SamplingParams(logprobs=2, temperature=0.3, top_k=1), SamplingParams(),
              SamplingParams(logprobs=9, temperature=1.5, top_p=0.1)]  # sampling settings do not change them
    first, skipped, last = logprobs_on_device(logits, params, torch.tensor([2, 3, 3])).records(params)
    ref = torch.log_softmax(logits.double(), dim=-1)
    assert skipped is None
    assert first.token_id == 2 and first.logprob == pytest.approx(ref[0, 2].item(), abs=1e-6)
    assert [i for i, _ in first.top] == [1, 2]  # a tie: the lower id first, as argmax
    assert [i for i, _ in last.top] == [0, 1, 2, 3]  # N beyond the vocabulary: all of it
    assert [v for _, v in last.top] == pytest.approx(ref[2].tolist(), abs=1e-6)
    assert last.logprob == pytest.approx(ref[2, 3].item(), abs=1e-6)  # a token outside any top-p set still has one
    zero = [SamplingParams(logprobs=0)] * 3
    assert logprobs_on_device(logits, zero, torch.tensor([0, 0, 0])).records(zero)[1].top == ()
    assert logprobs_on_device(logits, [SamplingParams()] * 3, torch.tensor([0, 0, 0])) is None   # no row asks
    with pytest.raises(ValueError, match="logprobs must be >= 0"):
        SamplingParams(logprobs=-1)


# ------------------------------------------------------------------------------------------------- token texts
@pytest.fixture(scope="module")
def demo_tokenizer():
    return load_model(default_model_dir()).tokenizer  # byte-level BPE: some characters span several tokens


def test_a_token_ending_inside_a_character_adds_nothing_until_one_completes_it(demo_tokenizer):
    tok = demo_tokenizer
    ids = tok.encode("naïve café — 日本語 ok", add_special_tokens=False)
    texts = TokenTexts(tok)
    for i in ids:  # one at a time, as a stream gets them
        texts.add([i])
    pieces = [p.text for p in texts.pieces]
    assert "".join(pieces) == tok.decode(ids) and "" in pieces and "\ufffd" not in "".join(pieces)
    assert pieces[pieces.index("") + 1] == "ï"  # the token that completes a character carries all of it
    whole = TokenTexts(tok)
    whole.add(ids)
    assert [p.text for p in whole.pieces] == pieces
    cut = TokenTexts(tok)  # ends inside "ï": flush gives what is left to the last token
    cut.add(ids[:2])
    cut.flush()
    assert [p.text for p in cut.pieces] == ["na", "\ufffd"] == ["na", tok.decode(ids[:2])[2:]]
    alt = TokenTexts(tok)  # alternatives read as they would in the same place
    alt.add(ids[:1])
    alt.add(ids[1:2], [TokenLogprob(ids[1], -1.0, ((ids[4], -1.0), (ids[1], -2.0)))])
    assert alt.pieces[1].top_texts == (" ca", "\ufffd")


class _LeadingSpaceTokenizer:
    """Decodes as SentencePiece's tokenizers do: a text's leading space is dropped, so a word read alone loses it."""
    words = ("And", " God", " said")

    def decode(self, ids) -> str:
        return "".join(self.words[i] for i in ids).lstrip(" ")


def test_a_token_s_text_is_decoded_after_the_tokens_before_it():
    """A token's text is what it adds after the settled tokens before it, not the token decoded alone: the space
    before a word stays with its token."""
    texts = TokenTexts(_LeadingSpaceTokenizer())
    for i in range(3):
        texts.add([i])
    assert [p.text for p in texts.pieces] == ["And", " God", " said"]


def _pieces(*texts: str) -> list[Piece]:
    return [Piece(t) for t in texts]


@pytest.mark.parametrize("text, expect", [
    ("abcdef", ["ab", "cd", "", "ef", ""]),  # no cut: every token, the final one that adds nothing (EOS) included
    ("abc", ["ab", "c"]),  # the token the cut falls inside is reported, its text cut; none after it
    ("abcd", ["ab", "cd", ""]),  # a token that adds nothing ends where it stands: at the cut
    ("", []),
])
def test_reported_tokens_join_to_the_returned_text(text, expect):
    assert [p.text for p in reported(_pieces("ab", "cd", "", "ef", ""), text)] == expect


def test_a_stream_releases_whole_tokens_no_stop_string_can_cut(demo_tokenizer):
    tok = demo_tokenizer
    ids = tok.encode(" And God said unto Moses, Go and tell", add_special_tokens=False)
    assert tok.decode(ids[-1:]) == " tell"  # completes the stop string "ell": the engine's last token
    out = SimpleNamespace(token_ids=ids, logprobs=(), text=" And God said unto Moses, Go and t")
    stream, texts = TextStream(tok, hold=2), []
    for i in ids[:-1]:  # the last token comes with the output
        text, pieces = stream.push([i], ())
        assert text == "".join(p.text for p in pieces) and stream.sent_chars <= stream.texts.chars - 2
        texts.append(text)
    text, pieces = stream.finish(out)
    assert "".join(texts) + text == out.text and sum(1 for t in texts if t) >= 5
    assert [p.text for p in pieces][-1] == " t"
    assert stream.sent == len(choice_pieces(tok, out)) == len(tok.encode(out.text, add_special_tokens=False))


def test_a_stream_without_stop_strings_sends_each_token_as_it_comes(demo_tokenizer):
    """hold 0 (no stop string can cut into the text): each push sends the whole tokens it brought, none a push late."""
    tok = demo_tokenizer
    ids = tok.encode(" And God said unto Moses", add_special_tokens=False)
    whole = TokenTexts(tok)
    whole.add(ids)
    stream = TextStream(tok, hold=0)
    assert [stream.push([i], ())[0] for i in ids] == [p.text for p in whole.pieces]
    assert stream.sent == len(ids)


def test_the_shapes_floor_log_probabilities_and_keep_the_likelier_of_two_alternatives_that_read_alike():
    """JSON has no -Infinity: a log-probability below OpenAI's -9999 reads -9999.0; two alternatives whose texts are
    the same (two halves of a character, both U+FFFD) share one key of the completions shape, the more likely's."""
    from pwruntime.api_tokens import chat_logprobs, completion_logprobs

    p = Piece("a", TokenLogprob(5, float("-inf"), ((7, -1.5), (6, -3.0), (8, -20000.0))), ("\ufffd", "\ufffd", "b"))
    comp = completion_logprobs([p], 0)
    assert comp["token_logprobs"] == [-9999.0] and comp["top_logprobs"] == [{"\ufffd": -1.5, "b": -9999.0}]
    chat = chat_logprobs([p])["content"][0]
    assert chat["logprob"] == -9999.0 and [t["logprob"] for t in chat["top_logprobs"]] == [-1.5, -3.0, -9999.0]


def test_prompt_pieces_keep_the_alternatives_asked_for(demo_tokenizer):
    """The engine's prompt records may hold more alternatives than a choice shows (an echo's `logprobs` N beside a
    larger `prompt_logprobs`): each piece keeps the first `top`, None keeping all; the first token has no record."""
    from pwruntime.api_tokens import prompt_pieces

    tok = demo_tokenizer
    ids = tok.encode(" And God said", add_special_tokens=False)
    records = [TokenLogprob(t, -1.0, ((t, -1.0), (ids[0], -2.0), (ids[1], -3.0))) for t in ids[1:]]
    one = prompt_pieces(tok, ids, records, 1)
    assert one[0].record is None and all(len(p.record.top) == len(p.top_texts) == 1 for p in one[1:])
    assert all(len(p.record.top) == 3 for p in prompt_pieces(tok, ids, records, None)[1:])


# ------------------------------------------------------------------------------------------------- the engine
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load_model(make_tiny_checkpoint(tmp_path_factory.mktemp("logprobs"), "qwen3_moe", seed=2))


def _forward_logprobs(model, prompt: list[int], tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits, float64 log-probabilities) before each of `tokens`, by one prefill of the prompt and tokens."""
    ids = torch.tensor(prompt + tokens[:-1])
    kv = model.new_kv_cache(-(-len(ids) // 4), 4)
    hidden = model.forward(ids, torch.arange(len(ids)), kv, prefill_metadata(len(ids), 4)).hidden
    logits = model.logits(hidden[len(prompt) - 1:])
    return logits, torch.log_softmax(logits.double(), dim=-1)


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=10, ignore_eos=True, logprobs=4),
    SamplingParams(max_tokens=10, ignore_eos=True, logprobs=4, temperature=0.7, top_k=5, seed=1),
])
def test_engine_logprobs_equal_a_forward_pass(tiny, params):
    """Of the raw distribution, whatever the temperature and top-k: what one prefill over the answer gives."""
    prompt = tiny.tokenizer.encode(" ".join(make_text(40, seed=5).split()[:9]))
    out = LLMEngine(tiny, EngineConfig(num_kv_blocks=64, block_size=4)).generate([prompt], params)[0]
    assert [r.token_id for r in out.logprobs] == out.token_ids
    logits, ref = _forward_logprobs(tiny, prompt, out.token_ids)
    for row, (token, rec) in enumerate(zip(out.token_ids, out.logprobs)):
        assert rec.logprob == pytest.approx(ref[row, token].item(), abs=1e-4)
        order = torch.sort(logits[row], descending=True, stable=True).indices[:4].tolist()
        assert [i for i, _ in rec.top] == order
        assert [v for _, v in rec.top] == pytest.approx(ref[row, order].tolist(), abs=1e-4)
        if params.greedy:
            assert rec.top[0] == (token, rec.logprob)


def test_logprobs_are_computed_only_when_asked_and_kept_while_running(tiny):
    engine = LLMEngine(tiny, EngineConfig(num_kv_blocks=64, block_size=4))
    asked = engine.add_request("ba be bi", SamplingParams(max_tokens=6, ignore_eos=True, logprobs=1))
    plain = engine.add_request("ba be bi", SamplingParams(max_tokens=6, ignore_eos=True))
    for _ in range(3):
        engine.step()
    tokens = engine.tokens_so_far(asked)
    assert tokens and [r.token_id for r in engine.logprobs_so_far(asked)] == tokens
    assert [r.token_id for r in engine.logprobs_so_far(asked, 1)] == engine.tokens_so_far(asked, 1) == tokens[1:]
    assert engine.tokens_so_far(plain) and engine.logprobs_so_far(plain) == []
    outs = {}
    while engine.has_unfinished():
        outs.update((o.request_id, o) for o in engine.step())
    assert len(outs[asked].logprobs) == 6 and outs[plain].logprobs == ()


def test_preempted_requests_keep_one_record_per_token(tmp_path_factory):
    """Preemption recomputes a sequence's K/V and keeps its tokens: the records neither repeat nor go missing."""
    model = load_model(make_tiny_checkpoint(tmp_path_factory.mktemp("preempt"), "qwen2_moe", seed=1))
    words = make_text(200, seed=7).split()
    prompts = [model.tokenizer.encode(" ".join(words[i * 5: i * 5 + n])) for i, n in enumerate((3, 29, 11, 6))]
    params = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=2)
    # 12 blocks of 4 tokens: each request alone fits, all four together do not
    engine = LLMEngine(model, EngineConfig(num_kv_blocks=12, block_size=4, max_num_batched_tokens=64))
    outs = engine.generate(prompts, params)
    assert engine.scheduler.num_preemptions > 0 and any(o.num_preemptions for o in outs)
    for prompt, out in zip(prompts, outs):
        alone = LLMEngine(model, EngineConfig(num_kv_blocks=64, block_size=4)).generate([prompt], params)[0]
        assert [r.token_id for r in out.logprobs] == out.token_ids == alone.token_ids
        assert [r.logprob for r in out.logprobs] == pytest.approx([r.logprob for r in alone.logprobs], abs=1e-4)
