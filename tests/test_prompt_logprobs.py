"""Prompt log-probabilities: the rows a step needs, and the engine's records against one forward pass over the prompt,
chunked, preempted, beside the prefix cache and with asynchronous scheduling. (The server's `echo`: test_server.py.)"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from model_fixtures import make_text, make_tiny_checkpoint
from pwruntime.engine import EngineConfig, LLMEngine
from pwruntime.model import load_model
from pwruntime.model.attention_plan import prefill_metadata
from pwruntime.prompt_logprobs import needed_rows
from pwruntime.sampling import SamplingParams


def _entry(rid, prompt_len, start, n, k=1):
    seq = SimpleNamespace(seq_id=rid, prompt_token_ids=list(range(100, 100 + prompt_len)),
                          params=SimpleNamespace(prompt_logprobs=k))
    return SimpleNamespace(seq=seq, start=start, num_new_tokens=n)


def test_needed_rows_ask_each_prompt_position_once_in_flat_order():
    batch = SimpleNamespace(entries=(
        _entry(0, 10, 9, 1),        # a decode-like entry at the prompt's last position: predicts no prompt token
        _entry(1, 10, 0, 4, k=3),   # a first chunk: positions 0..3 predict tokens 1..4
        _entry(2, 6, 0, 6),         # not asking (no cursor)
        _entry(3, 8, 2, 6),         # recomputed after preemption, asked up to 5 already: positions 5, 6
    ))
    needed = needed_rows(batch, {0: 9, 1: 0, 3: 5})
    assert needed.rows == [1, 2, 3, 4, 14, 15]  # entry 1 starts at flat row 1, entry 3 at 11 (+ 3 and 4)
    assert needed.targets == [101, 102, 103, 104, 106, 107]
    assert needed.owners == [(1, 0, 4, 3), (3, 5, 2, 1)]
    assert needed.cursors() == {1: 4, 3: 7}
    assert needed_rows(batch, {0: 9}) is None and needed_rows(batch, {}) is None


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load_model(make_tiny_checkpoint(tmp_path_factory.mktemp("prompt_logprobs"), "qwen3_moe", seed=3))


def _prompt(model, n_words: int, seed: int) -> list[int]:
    return model.tokenizer.encode(" ".join(make_text(n_words + 20, seed=seed).split()[:n_words]))


def _reference(model, prompt: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits, float64 log-probabilities) at prompt positions 0 .. len - 2, by one prefill of the prompt."""
    ids = torch.tensor(prompt)
    kv = model.new_kv_cache(-(-len(ids) // 4), 4)
    logits = model.logits(model.forward(ids, torch.arange(len(ids)), kv, prefill_metadata(len(ids), 4)).hidden[:-1])
    return logits, torch.log_softmax(logits.double(), dim=-1)


def _check(model, prompt: list[int], records, k: int) -> None:
    logits, ref = _reference(model, prompt)
    assert [r.token_id for r in records] == prompt[1:]
    for row, rec in enumerate(records):
        assert rec.logprob == pytest.approx(ref[row, prompt[row + 1]].item(), abs=1e-4)
        order = torch.sort(logits[row], descending=True, stable=True).indices[:k].tolist()
        assert [i for i, _ in rec.top] == order
        assert [v for _, v in rec.top] == pytest.approx(ref[row, order].tolist(), abs=1e-4)
        assert rec.rank == 1 + int((logits[row] > logits[row, prompt[row + 1]]).sum())


@pytest.mark.parametrize("batched_tokens", [512, 8])  # the prompt in one step, or in chunks of 8
def test_prompt_logprobs_equal_a_forward_pass(tiny, batched_tokens):
    prompt = _prompt(tiny, 24, seed=5)
    assert len(prompt) > 2 * 8
    engine = LLMEngine(tiny, EngineConfig(num_kv_blocks=64, block_size=4, max_num_batched_tokens=batched_tokens))
    out = engine.generate([prompt], SamplingParams(max_tokens=3, ignore_eos=True, prompt_logprobs=3))[0]
    assert len(out.prompt_logprobs) == len(prompt) - 1 and out.logprobs == ()
    _check(tiny, prompt, out.prompt_logprobs, 3)
    plain = LLMEngine(tiny, EngineConfig(num_kv_blocks=64, block_size=4)).generate([prompt], SamplingParams(
        max_tokens=3, ignore_eos=True))[0]
    assert plain.prompt_logprobs == () and plain.token_ids == out.token_ids  # asking changes no token


def test_preempted_and_batched_requests_keep_one_record_per_prompt_token(tmp_path_factory):
    model = load_model(make_tiny_checkpoint(tmp_path_factory.mktemp("preempt"), "qwen2_moe", seed=1))
    prompts = [_prompt(model, n, seed=i) for i, n in enumerate((3, 29, 11, 6))]
    params = [SamplingParams(max_tokens=12, ignore_eos=True, prompt_logprobs=k) for k in (0, 2, None, 1)]
    # 12 blocks of 4 tokens: each request alone fits, all four together do not
    engine = LLMEngine(model, EngineConfig(num_kv_blocks=12, block_size=4, max_num_batched_tokens=64))
    outs = engine.generate(prompts, params)
    assert engine.scheduler.num_preemptions > 0 and any(o.num_preemptions for o in outs)
    for prompt, p, out in zip(prompts, params, outs):
        if p.prompt_logprobs is None:
            assert out.prompt_logprobs == ()
        else:
            _check(model, prompt, out.prompt_logprobs, p.prompt_logprobs)
            assert all(len(r.top) == p.prompt_logprobs for r in out.prompt_logprobs)
    assert not engine._prompt_cursors


def test_three_asking_prompts_in_one_step_each_get_their_own_records(tiny):
    """A step's records are read back owner after owner: the third asking prompt of a step gets its own rows, not
    the second's."""
    prompts = [_prompt(tiny, n, seed=20 + i) for i, n in enumerate((5, 9, 7))]
    engine = LLMEngine(tiny, EngineConfig(num_kv_blocks=64, block_size=4))
    outs = engine.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=1))
    assert engine.num_steps == 1  # the three prompts in one step
    for prompt, out in zip(prompts, outs):
        _check(tiny, prompt, out.prompt_logprobs, 1)


def test_a_request_preempted_inside_its_prompt_asks_no_position_twice(tiny):
    """An old request's growth preempts a young one between two chunks of its prompt; its recompute starts over at
    position 0 and must not ask for the positions its first chunks gave."""
    old, young = _prompt(tiny, 11, seed=11), _prompt(tiny, 40, seed=12)
    assert len(old) <= 12 and 36 <= len(young) <= 44
    engine = LLMEngine(tiny, EngineConfig(num_kv_blocks=12, block_size=4, max_num_batched_tokens=8))
    a = engine.add_request(old, SamplingParams(max_tokens=30, ignore_eos=True))
    b = engine.add_request(young, SamplingParams(max_tokens=2, ignore_eos=True, prompt_logprobs=1))
    outs, inside = {}, 0
    while engine.has_unfinished():
        outs.update((o.request_id, o) for o in engine.step())
        inside += any(s.seq_id == b for s in engine.last_batch.preempted) and b in engine._prompt_cursors
    assert inside and outs[a].finish_reason == "length"
    _check(tiny, young, outs[b].prompt_logprobs, 1)


def test_an_asking_request_computes_its_whole_prompt_beside_the_prefix_cache(tiny):
    prompt = _prompt(tiny, 30, seed=9)
    engine = LLMEngine(tiny, EngineConfig(num_kv_blocks=64, block_size=4, prefix_caching=True))
    engine.generate([prompt], SamplingParams(max_tokens=2))
    cached = engine.scheduler.num_cached_tokens
    out = engine.generate([prompt], SamplingParams(max_tokens=2, prompt_logprobs=1))[0]
    assert engine.scheduler.num_cached_tokens == cached  # it shared no cached block
    _check(tiny, prompt, out.prompt_logprobs, 1)
    engine.generate([prompt], SamplingParams(max_tokens=2))  # the cache still serves the others
    assert engine.scheduler.num_cached_tokens > cached


def test_asynchronous_steps_give_the_same_records_and_aborts_leave_nothing_behind(tiny):
    prompts = [_prompt(tiny, n, seed=20 + n) for n in (17, 9)]
    params = SamplingParams(max_tokens=5, ignore_eos=True, prompt_logprobs=2, logprobs=1)
    config = dict(num_kv_blocks=64, block_size=4, max_num_batched_tokens=16)
    sync = LLMEngine(tiny, EngineConfig(**config)).generate(prompts, params)
    engine = LLMEngine(tiny, EngineConfig(**config, async_scheduling=True))
    for a, b in zip(sync, engine.generate(prompts, params)):
        assert a.token_ids == b.token_ids
        assert [(r.token_id, r.top) for r in a.prompt_logprobs] == [(r.token_id, r.top) for r in b.prompt_logprobs]
    long = _prompt(tiny, 40, seed=3)
    assert len(long) > 2 * 16
    rid = engine.add_request(long, params)
    engine.step()  # its first chunk is launched, not settled
    assert rid in engine._prompt_cursors
    assert engine.abort(rid).prompt_logprobs == ()
    while engine.has_unfinished():
        engine.step()
    assert not engine._prompt_cursors


def test_an_abort_while_its_prompt_records_are_in_flight_leaves_the_request_beside_it_served(tiny):
    """Asynchronous steps: a request aborted after its prompt chunk was launched gets nothing when that batch settles
    (the step beside it does not fail), and the request sharing the batch runs to its end."""
    engine = LLMEngine(tiny, EngineConfig(num_kv_blocks=64, block_size=4, max_num_batched_tokens=16,
                                          async_scheduling=True))
    other = engine.add_request(_prompt(tiny, 5, seed=4), SamplingParams(max_tokens=6, ignore_eos=True))
    rid = engine.add_request(_prompt(tiny, 40, seed=3), SamplingParams(max_tokens=5, prompt_logprobs=2))
    engine.step()  # both launched, nothing settled
    assert rid in engine._prompt_cursors and engine.abort(rid).prompt_logprobs == ()
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert [o.request_id for o in outs] == [other] and len(outs[0].token_ids) == 6


def test_a_one_token_prompt_has_no_prompt_records(tiny):
    engine = LLMEngine(tiny, EngineConfig(num_kv_blocks=16, block_size=4))
    out = engine.generate([[5]], SamplingParams(max_tokens=2, prompt_logprobs=4))[0]
    assert out.prompt_logprobs == () and len(out.token_ids) == 2
    with pytest.raises(ValueError, match="prompt_logprobs must be >= 0"):
        SamplingParams(prompt_logprobs=-1)
