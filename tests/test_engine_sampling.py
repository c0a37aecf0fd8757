"""Sampling: filters, logits processing (min_tokens, penalties), seeds independent of batch composition, stop
strings, EOS, max tokens."""
from __future__ import annotations

import re

import pytest
import torch

from model_fixtures import make_text, make_tiny_checkpoint
from pwruntime.engine import EngineConfig, LLMEngine
from pwruntime.model import load_model
from pwruntime.sampling import (History, SamplingParams, adjust_logits, filter_logits, find_stop, make_generator,
                                sample_tensor)


def test_filter_top_k_and_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]]))
    kept = torch.isfinite(filter_logits(logits, 2, 1.0))[0].tolist()
    assert kept == [True, True, False, False, False]
    # nucleus: smallest prefix reaching 0.8 is {0.5, 0.2, 0.15}
    assert torch.isfinite(filter_logits(logits, 0, 0.8))[0].tolist() == [True, True, True, False, False]
    assert torch.isfinite(filter_logits(logits, 0, 0.5))[0].tolist() == [True, False, False, False, False]
    assert torch.isfinite(filter_logits(logits, 0, 1.0)).all()


def test_params_validation_and_stop_search():
    with pytest.raises(ValueError):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError):
        SamplingParams(stop=("",))
    assert SamplingParams(stop="x").stop == ("x",)
    assert SamplingParams(temperature=0.7, top_k=1).greedy
    assert find_stop("abcabd", ("bd", "ca")) == 2 and find_stop("abc", ("z",)) == -1
    assert find_stop("abcabd", ("ab",), search_from=1) == 3


def test_adjust_logits_follows_vllms_formulas():
    """Repetition p over prompt and output tokens (positive logits / p, others * p), then each output token loses
    frequency x its count and presence once; min_tokens masks the stop tokens until the output is long enough."""
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 0.0]] * 3)
    history = History(prompt_ids=[0, 1], output_ids=[3, 3, 2], stop_ids={4, 5})
    params = [SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25),
              SamplingParams(temperature=0.8), SamplingParams(min_tokens=4)]
    out = adjust_logits(logits, params, [history] * 3)
    # 0, 1, 2, 3 seen: 2/2, -1*2, 0.5/2, 3/2; output 3 (twice): -0.25*2 - 0.5; output 2 (once): -0.25 - 0.5
    assert out[0].tolist() == [1.0, -2.0, -0.5, 0.5, -2.0, 0.0]
    assert torch.equal(out[1], logits[1])  # a row that does not ask is left alone
    assert out[2].tolist() == [2.0, -1.0, 0.5, 3.0, float("-inf"), float("-inf")]  # 3 outputs < min_tokens 4
    longer = History([0, 1], [3, 3, 2, 1], {4, 5})
    assert torch.equal(adjust_logits(logits[:1], [params[2]], [longer]), logits[:1])  # 4 outputs: stops allowed
    assert adjust_logits(logits, [SamplingParams()] * 3, [history] * 3) is logits
    assert logits[0, 0] == 2.0  # the input is not changed
    assert params[0].greedy and sample_tensor(logits[:1], params[:1], [None]).tolist() == [3]
    assert sample_tensor(out[:1], params[:1], [None]).tolist() == [0]  # greedy: the argmax of the processed logits


@pytest.mark.parametrize("kw, message", [
    (dict(min_tokens=-1), "min_tokens must lie in 0..max_tokens"), (dict(min_tokens=17), "min_tokens must lie in"),
    (dict(presence_penalty=2.5), "presence_penalty must lie in [-2, 2]"),
    (dict(frequency_penalty=float("nan")), "frequency_penalty must lie in [-2, 2]"),
    (dict(repetition_penalty=0.0), "repetition_penalty must be a finite number > 0"),
])
def test_logits_processing_params_are_checked(kw, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        SamplingParams(**kw)


def test_seeded_sampling_follows_the_distribution_and_repeats():
    probs = torch.tensor([0.6, 0.3, 0.1])
    n = 3000
    logits = torch.log(probs)[None].repeat(n, 1)
    p = SamplingParams(temperature=1.0)
    draws = sample_tensor(logits, [p] * n, [make_generator(1)] * n).tolist()  # one generator: one stream of draws
    freq = torch.bincount(torch.tensor(draws), minlength=3).float() / n
    assert torch.allclose(freq, probs, atol=0.03)
    assert sample_tensor(logits, [p] * n, [make_generator(1)] * n).tolist() == draws
    sharp = sample_tensor(logits[:200], [SamplingParams(temperature=0.05)] * 200, [make_generator(2)] * 200).tolist()
    assert sharp == [0] * 200  # low temperature concentrates on the argmax


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("sampling"), "qwen3_moe", seed=2)


@pytest.fixture(scope="module")
def model(ckpt):
    return load_model(ckpt)


def _prompt(i: int) -> str:
    return " ".join(make_text(80, seed=11).split()[i * 4: i * 4 + 5 + i])


def test_seed_reproducible_and_independent_of_batch(model):
    cfg = EngineConfig(num_kv_blocks=64, block_size=4, max_num_batched_tokens=8)
    p = SamplingParams(max_tokens=16, temperature=0.9, top_k=40, top_p=0.95, seed=123, ignore_eos=True)
    alone = LLMEngine(model, cfg).generate([_prompt(0)], p)[0].token_ids
    others = [SamplingParams(max_tokens=9, temperature=1.2, seed=7, ignore_eos=True),
              SamplingParams(max_tokens=5, ignore_eos=True),
              SamplingParams(max_tokens=14, temperature=0.8, ignore_eos=True)]  # unseeded: engine seed
    batch = LLMEngine(model, cfg).generate([_prompt(1), _prompt(0), _prompt(2), _prompt(3)],
                                           [others[0], p, others[1], others[2]])
    assert batch[1].token_ids == alone
    assert LLMEngine(model, cfg).generate([_prompt(0)], p)[0].token_ids == alone
    reseeded = [LLMEngine(model, cfg).generate([_prompt(0)], SamplingParams(
        max_tokens=16, temperature=0.9, top_k=40, top_p=0.95, seed=s, ignore_eos=True))[0].token_ids for s in (1, 2)]
    assert any(r != alone for r in reseeded)
    # requests without a seed are deterministic given the engine seed
    again = LLMEngine(model, cfg).generate([_prompt(1), _prompt(0), _prompt(2), _prompt(3)],
                                           [others[0], p, others[1], others[2]])
    assert [o.token_ids for o in again] == [o.token_ids for o in batch]


def test_stop_string_cuts_text_and_ends_early(model):
    cfg = EngineConfig(num_kv_blocks=64, block_size=4)
    full = LLMEngine(model, cfg).generate([_prompt(2)], SamplingParams(max_tokens=20, ignore_eos=True))[0]
    words = full.text.split()
    stop = " ".join(words[3:5])  # spans two tokens
    expect_text = full.text[:full.text.find(stop)]
    out = LLMEngine(model, cfg).generate([_prompt(2)], SamplingParams(max_tokens=20, stop=(stop, "zzz"),
                                                                      ignore_eos=True))[0]
    assert out.finish_reason == "stop" and out.text == expect_text
    assert len(out.token_ids) < 20 and out.token_ids == full.token_ids[:len(out.token_ids)]
    assert stop not in out.text


def test_max_tokens_and_eos(model, tmp_path):
    cfg = EngineConfig(num_kv_blocks=64, block_size=4)
    full = LLMEngine(model, cfg).generate([_prompt(1)], SamplingParams(max_tokens=10, ignore_eos=True))[0]
    assert full.finish_reason == "length" and len(full.token_ids) == 10
    j = next(i for i in range(2, 10) if full.token_ids[i] not in full.token_ids[:i])
    eos = full.token_ids[j]
    # the same weights, with that token declared end-of-sequence
    eos_model = load_model(make_tiny_checkpoint(tmp_path, "qwen3_moe", seed=2, eos_token_id=eos))
    out = LLMEngine(eos_model, cfg).generate([_prompt(1)], SamplingParams(max_tokens=10))[0]
    assert out.finish_reason == "stop" and out.token_ids == full.token_ids[:j + 1]
    assert out.text == eos_model.tokenizer.decode(full.token_ids[:j])
    ignored = LLMEngine(eos_model, cfg).generate([_prompt(1)], SamplingParams(max_tokens=10, ignore_eos=True))[0]
    assert ignored.token_ids == full.token_ids
    by_id = LLMEngine(model, cfg).generate([_prompt(1)], SamplingParams(max_tokens=10, stop_token_ids=(eos,)))[0]
    assert by_id.finish_reason == "stop" and by_id.token_ids == full.token_ids[:j + 1]
