"""Sampling: filters, logits processing (min_tokens, penalties), seeds independent of batch composition, stop
strings, EOS, max tokens."""
from __future__ import annotations

import math
import re

import pytest
import torch

from model_fixtures import make_text, make_tiny_checkpoint
from pwruntime.engine import EngineConfig, LLMEngine
from pwruntime.model import load_model
from pwruntime.sampling import (GREEDY_BELOW, GREEDY_ROW, ROW_VALUES, History, RequestDraws, SamplingParams,
                                adjust_logits, find_stop, needed_cuts, row_values, sample_rows, sample_tensor, sorted_probs,
                                token_logprobs)
from traces.clikit import UserError


def _support(logits: torch.Tensor, params: SamplingParams) -> set:
    """The tokens one row samples over a fine grid of numbers."""
    grid = [i / 4096 for i in range(4096)]
    return set(sample_tensor(logits.repeat(len(grid), 1), [params] * len(grid), grid).tolist())


def test_top_k_and_top_p_keep_what_they_should():
    logits = torch.log(torch.tensor([[0.05, 0.5, 0.1, 0.2, 0.15]]))
    assert _support(logits, SamplingParams(temperature=1.0, top_k=2)) == {1, 3}
    # nucleus: smallest prefix reaching 0.8 is {0.5, 0.2, 0.15}
    assert _support(logits, SamplingParams(temperature=1.0, top_p=0.8)) == {1, 3, 4}
    assert _support(logits, SamplingParams(temperature=1.0, top_p=0.5)) == {1}
    assert _support(logits, SamplingParams(temperature=1.0)) == {0, 1, 2, 3, 4}
    assert _support(logits, SamplingParams(temperature=1.0, top_k=3, top_p=0.8)) == {1, 3}  # k first, then p
    assert sample_tensor(logits, [SamplingParams(temperature=1.0)], [0.0]).item() == 1  # 0: the most likely token


def test_min_p_keeps_the_tokens_near_the_most_likely_one_before_top_p():
    """vLLM's min-p: tokens at least min_p times as likely as the most likely one, after the temperature; top-p then
    reaches its share of what min-p kept."""
    logits = torch.log(torch.tensor([[0.05, 0.5, 0.1, 0.2, 0.15]]))
    assert _support(logits, SamplingParams(temperature=1.0, min_p=0.29)) == {1, 3, 4}  # >= 0.145
    assert _support(logits, SamplingParams(temperature=1.0, min_p=0.19)) == {1, 2, 3, 4}  # >= 0.095
    assert _support(logits, SamplingParams(temperature=1.0, min_p=1.0)) == {1}
    # at temperature 2 the shares flatten (sqrt): 0.05 -> 0.32 of the largest, above 0.3
    assert _support(logits, SamplingParams(temperature=2.0, min_p=0.3)) == {0, 1, 2, 3, 4}
    # min-p leaves {0.5, 0.2, 0.15} = 0.85; top-p 0.6 of that is 0.51: 0.5 alone is short, 0.5 + 0.2 reaches it
    assert _support(logits, SamplingParams(temperature=1.0, min_p=0.29, top_p=0.6)) == {1, 3}
    assert _support(logits, SamplingParams(temperature=1.0, min_p=0.29, top_k=2)) == {1, 3}
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="min_p must be in"):
            SamplingParams(min_p=bad)


def test_top_p_reaches_its_share_of_what_min_p_kept_not_of_the_whole():
    """min-p renormalizes what it keeps: 0.5 of the {0.5, 0.2, 0.15} it keeps (0.85) is 0.59, which alone reaches a
    top-p of 0.55 (0.5 of the whole would not)."""
    logits = torch.log(torch.tensor([[0.05, 0.5, 0.1, 0.2, 0.15]]))
    assert _support(logits, SamplingParams(temperature=1.0, min_p=0.29, top_p=0.55)) == {1}
    assert _support(logits, SamplingParams(temperature=1.0, top_p=0.55)) == {1, 3}  # without min-p: 0.5 < 0.55


def test_a_stop_search_that_starts_before_the_text_searches_all_of_it():
    """The engine searches from (the characters checked before) - (the longest stop) + 1, below 0 at first: a stop
    inside the first token's text is found, not one only among the text's last characters."""
    assert find_stop("xaby", ("ab",), search_from=-1) == 1
    assert find_stop("abcd", ("bc", "a"), search_from=-5) == 0


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
    assert find_stop("abcd", ("a", "c")) == 0   # the earliest, whichever stop string comes first in the tuple


@pytest.mark.parametrize("k, want", [(2, 2), (0, 0), (9, 5)])
def test_token_logprobs_give_at_most_the_vocabulary_s_top_tokens(k, want):
    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0, -1.0]])
    chosen, top_ids, top_logp = token_logprobs(logits, torch.tensor([2]), k)
    assert top_ids.shape == top_logp.shape == (1, want)
    assert top_ids[0].tolist() == [1, 3, 2, 0, 4][:want]   # ties to the lower id
    assert chosen.item() == pytest.approx(torch.log_softmax(logits, -1)[0, 2].item())


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


def test_logit_bias_adds_to_the_listed_tokens_before_the_other_processing():
    """Each listed token gains its bias (a dict or pairs, kept sorted by id); the min_tokens mask still wins; a row
    with only a bias does not read its history."""
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 0.0]] * 2)
    history = History(prompt_ids=[0, 1], output_ids=[3], stop_ids={4})
    bias = SamplingParams(logit_bias={4: 100, 1: -2.5})
    assert bias.logit_bias == ((1, -2.5), (4, 100.0)) and bias.adjusts_logits and not bias.reads_history
    both = SamplingParams(logit_bias=((4, 100.0), (0, -100.0)), min_tokens=2)
    assert both.reads_history
    out = adjust_logits(logits, [bias, both], [history] * 2)
    assert out[0].tolist() == [2.0, -3.5, 0.5, 3.0, 98.0, 0.0]
    assert out[1].tolist() == [-98.0, -1.0, 0.5, 3.0, float("-inf"), 0.0]  # 1 output < min_tokens 2: 4 masked
    assert sample_tensor(out[:1], [bias], [None]).tolist() == [4]  # greedy takes the biased token


@pytest.mark.parametrize("bias, message", [
    ({3: 100.5}, "logit_bias values must lie in [-100, 100], got 100.5"),
    ({3: float("nan")}, "logit_bias values must lie in [-100, 100], got nan"),
    (((3, 1.0), (3, 2.0)), "logit_bias must name distinct token ids >= 0"),
    ({-1: 1.0}, "logit_bias must name distinct token ids >= 0, got [-1]"),
    ({3: 1.0, -1: 2.0}, "logit_bias must name distinct token ids >= 0, got [-1, 3]"),  # a negative id beside others
])
def test_logit_bias_is_checked(bias, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        SamplingParams(logit_bias=bias)


def test_engine_follows_logit_bias_and_refuses_a_token_past_the_vocabulary(model):
    cfg = EngineConfig(num_kv_blocks=64, block_size=4)
    plain = LLMEngine(model, cfg).generate([_prompt(1)], SamplingParams(max_tokens=6, ignore_eos=True))[0]
    forced = next(t for t in range(5, model.config.vocab) if t not in plain.token_ids)
    for kw in ({}, {"temperature": 1.0, "seed": 2}):
        out = LLMEngine(model, cfg).generate([_prompt(1)], SamplingParams(
            max_tokens=6, ignore_eos=True, logit_bias={forced: 100}, **kw))[0]
        assert out.token_ids == [forced] * 6
    banned = LLMEngine(model, cfg).generate([_prompt(1)], SamplingParams(
        max_tokens=6, ignore_eos=True, logit_bias={plain.token_ids[0]: -100}))[0]
    assert banned.token_ids[0] != plain.token_ids[0] and plain.token_ids[0] not in banned.token_ids
    with pytest.raises(UserError, match="logit_bias names token"):
        LLMEngine(model, cfg).add_request(_prompt(1), SamplingParams(logit_bias={model.config.vocab: 1.0}))


@pytest.mark.parametrize("kw, message", [
    (dict(min_tokens=-1), "min_tokens must lie in 0..max_tokens"), (dict(min_tokens=17), "min_tokens must lie in"),
    (dict(presence_penalty=2.5), "presence_penalty must lie in [-2, 2]"),
    (dict(frequency_penalty=float("nan")), "frequency_penalty must lie in [-2, 2]"),
    (dict(repetition_penalty=0.0), "repetition_penalty must be a finite number > 0"),
])
def test_logits_processing_params_are_checked(kw, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        SamplingParams(**kw)


def test_logits_processing_params_take_their_bounds():
    """The ends of each range are served: min_tokens up to max_tokens itself, penalties of exactly -2 and 2."""
    assert SamplingParams(max_tokens=4, min_tokens=4).min_tokens == 4
    for name in ("presence_penalty", "frequency_penalty"):
        for bound in (-2.0, 2.0):
            assert getattr(SamplingParams(**{name: bound}), name) == bound


def test_sampling_params_take_the_ends_of_their_ranges_and_refuse_infinities():
    assert SamplingParams(max_tokens=1).max_tokens == 1 and SamplingParams(prompt_logprobs=0).prompt_logprobs == 0
    assert SamplingParams(logprobs=0).logprobs == 0 and SamplingParams(temperature=0.0).greedy
    with pytest.raises(ValueError, match="temperature must be a finite number >= 0"):
        SamplingParams(temperature=math.inf)
    with pytest.raises(ValueError, match="repetition_penalty must be a finite number > 0"):
        SamplingParams(repetition_penalty=math.inf)


@pytest.mark.parametrize("kw, want", [
    (dict(presence_penalty=0.5), [2.0, -1.0, 0.0, 2.5, -2.0, 0.0]),      # each output token once: -0.5
    (dict(frequency_penalty=0.25), [2.0, -1.0, 0.25, 2.5, -2.0, 0.0]),   # by its count: 3 twice, 2 once
])
def test_a_presence_or_frequency_penalty_alone_applies(kw, want):
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 0.0]])
    history = History(prompt_ids=[0, 1], output_ids=[3, 3, 2], stop_ids={4, 5})
    assert SamplingParams(**kw).reads_history
    assert adjust_logits(logits, [SamplingParams(**kw)], [history])[0].tolist() == want


def test_a_temperature_below_greedy_below_is_greedy_not_a_sharp_sample():
    """A positive temperature under GREEDY_BELOW takes the argmax whatever the request's number: dividing by it would
    turn logits 1e-6 apart into a real choice (or overflow)."""
    logits = torch.tensor([[0.0, 1.0, 1.0 - 1e-6, -3.0]])
    tiny = SamplingParams(temperature=GREEDY_BELOW / 2)
    assert tiny.greedy and not SamplingParams(temperature=GREEDY_BELOW).greedy
    grid = [i / 16 for i in range(16)]
    assert sample_tensor(logits.repeat(16, 1), [tiny] * 16, grid).tolist() == [1] * 16


def test_seeded_sampling_follows_the_distribution_and_repeats():
    probs = torch.tensor([0.6, 0.3, 0.1])
    n = 3000
    logits = torch.log(probs)[None].repeat(n, 1)
    p = SamplingParams(temperature=1.0)
    d = RequestDraws(1)
    draws = sample_tensor(logits, [p] * n, [d.next() for _ in range(n)]).tolist()  # one request's stream of draws
    freq = torch.bincount(torch.tensor(draws), minlength=3).float() / n
    assert torch.allclose(freq, probs, atol=0.03)
    again = RequestDraws(1)
    assert sample_tensor(logits, [p] * n, [again.next() for _ in range(n)]).tolist() == draws
    other = RequestDraws(2)
    sharp = sample_tensor(logits[:200], [SamplingParams(temperature=0.05)] * 200, [other.next() for _ in range(200)])
    assert sharp.tolist() == [0] * 200  # low temperature concentrates on the argmax
    # top-k and top-p renormalize over what they keep: {0.6, 0.3} -> 2/3, 1/3
    for cut in (SamplingParams(temperature=1.0, top_k=2), SamplingParams(temperature=1.0, top_p=0.8)):
        d = RequestDraws(3)
        freq = torch.bincount(sample_tensor(logits, [cut] * n, [d.next() for _ in range(n)]), minlength=3).float() / n
        assert freq[2] == 0 and torch.allclose(freq[:2], torch.tensor([2 / 3, 1 / 3]), atol=0.03)


def test_request_draws_are_uniform_and_their_own():
    """Counter-based: a seed's numbers are the same whenever drawn, in [0, 1) on a grid of 2^-23, spread evenly, and
    another seed's (even a neighbouring one) are another stream."""
    first = RequestDraws(7).next()
    d7 = RequestDraws(7)
    xs = torch.tensor([d7.next() for _ in range(20000)], dtype=torch.float64)
    assert xs[0] == first and d7.drawn == 20000
    assert ((xs >= 0) & (xs < 1)).all() and torch.equal(xs * 2 ** 23, torch.round(xs * 2 ** 23))
    hist = torch.histc(xs, bins=10, min=0.0, max=1.0) / len(xs)
    assert torch.allclose(hist, torch.full((10,), 0.1, dtype=torch.float64), atol=0.01)
    assert abs(float(torch.corrcoef(torch.stack([xs[:-1], xs[1:]]))[0, 1])) < 0.03  # no lag-1 correlation
    d8 = RequestDraws(8)
    ys = torch.tensor([d8.next() for _ in range(20000)], dtype=torch.float64)
    assert (xs == ys).float().mean() < 0.001 and abs(float(torch.corrcoef(torch.stack([xs, ys]))[0, 1])) < 0.03


def test_a_request_s_draws_follow_the_documented_counter():
    """Draw i (1, 2, ...) of a seed is the top 23 bits of splitmix64's finalizer of (the seed, mixed) + i x gamma: a
    seeded request samples the same tokens in every version, not another stream of equally good numbers."""
    from pwruntime.sampling import _GAMMA, _MASK64, _mix64

    d = RequestDraws(123)
    key = _mix64(123)
    expect = [(_mix64((key + i * _GAMMA) & _MASK64) >> 41) / 2 ** 23 for i in (1, 2, 3)]
    assert [d.next() for _ in range(3)] == expect


def test_a_batch_samples_what_each_row_samples_alone():
    """One batched call (greedy rows, temperatures, top-k, top-p, both, a row's number next to 1) gives each row the
    token it gets alone, and never a token the row's cuts removed."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(9, 50, generator=g) * 3
    params = [SamplingParams(), SamplingParams(temperature=0.7), SamplingParams(temperature=1.3, top_k=5),
              SamplingParams(temperature=1.0, top_p=0.5), SamplingParams(temperature=0.9, top_k=10, top_p=0.9),
              SamplingParams(temperature=2.0, top_k=1), SamplingParams(temperature=1.0, top_k=3),
              SamplingParams(temperature=1.0, top_k=50), SamplingParams(temperature=1.0, top_p=0.3)]
    numbers = [0.5, 0.1, 0.9, 0.99, 0.3, 0.7, 1 - 2 ** -23, 0.0, 1 - 2 ** -23]
    batch = sample_tensor(logits, params, numbers).tolist()
    alone = [sample_tensor(logits[j:j + 1], [params[j]], [numbers[j]]).item() for j in range(len(params))]
    assert batch == alone
    assert batch[5] == int(logits[5].argmax()) and batch[0] == int(logits[0].argmax())  # top_k = 1 is greedy
    assert batch[6] in torch.topk(logits[6], 3).indices.tolist()  # the largest number stays inside the top 3
    assert batch[8] in _support(logits[8:9], params[8])
    assert batch[7] == int(logits[7].argmax())  # the number 0 picks the most likely token
    with pytest.raises(ValueError, match="numbers"):
        sample_tensor(logits, params, numbers[:-1])


def test_the_largest_number_picks_a_token_where_the_probabilities_add_up_below_it():
    """float32 probabilities can add up to less than the largest number a request draws (1 - 2^-23); the number is
    scaled to the row's total, so the pick is still a token of the row (not one past its end)."""
    for seed in range(3000):  # find such a row
        g = torch.Generator().manual_seed(seed)
        vocab = int(torch.randint(2, 4096, (1,), generator=g))
        logits = torch.randn(1, vocab, generator=g) * float(torch.rand(1, generator=g) * 5)
        if torch.cumsum(torch.softmax(logits, -1), -1)[0, -1] < 1 - 2 ** -23:
            break
    assert torch.cumsum(torch.softmax(logits, -1), -1)[0, -1] < 1 - 2 ** -23
    picked = sample_tensor(logits, [SamplingParams(temperature=1.0)], [1 - 2 ** -23]).item()
    assert 0 <= picked < vocab


def test_values_that_degenerate_still_sample_a_token_of_the_row():
    """What a server accepts and float32 cannot hold must not fail a batch (it failed every request beside it, with an
    index past the vocabulary): a top-p that is 0 in float32 keeps the most likely token; a repetition penalty that
    takes logits past float32 leaves them finite; a row whose every logit is -inf (min_tokens holding back every
    token) takes a token of the row."""
    logits = torch.tensor([[0.5, 3.0, 1.0, 2.0]])
    assert _support(logits, SamplingParams(temperature=1.0, top_p=1e-46)) == {1}
    tiny = SamplingParams(temperature=GREEDY_BELOW, repetition_penalty=1e-38)
    adjusted = adjust_logits(torch.full((1, 8), 5.0), [tiny], [History([1, 2], [3])])
    assert torch.isfinite(adjusted).all() and (adjusted[0, 1:4] > adjusted[0, 0]).all()
    assert set(sample_tensor(adjusted.repeat(64, 1), [tiny] * 64, [i / 64 for i in range(64)]).tolist()) == {1, 2, 3}
    stopped = SamplingParams(temperature=1.0, min_tokens=2, max_tokens=4)
    masked = adjust_logits(torch.randn(1, 8), [stopped], [History([1], [], stop_ids=range(8))])
    assert torch.isneginf(masked).all()
    assert 0 <= sample_tensor(masked, [stopped], [0.5]).item() < 8


def test_sorted_probs_cut_per_row():
    """Each row's own k and p, the kept mass a sorted prefix; a row without a nucleus cut keeps its tokens even where
    its probabilities' running sum reaches 1 early."""
    logits = torch.tensor([[30.0, 0.0, 0.0, 0.0], [0.1, 2.0, 0.5, 1.0], [0.1, 2.0, 0.5, 1.0]])
    assert (torch.cumsum(torch.softmax(logits[0], -1), -1)[:-1] >= 1.0).any()
    probs, order = sorted_probs(logits, torch.tensor([[3], [1], [3]]), torch.tensor([[float("inf")], [float("inf")],
                                                                                      [0.7]]))
    assert (probs[0] > 0).all() and order[0, 0] == 0
    assert order[1].tolist() == [1, 3, 2, 0] and (probs[1] > 0).tolist() == [True, True, False, False]
    assert (probs[2] > 0).tolist() == [True, True, False, False]  # 2.0 alone is below 0.7 of the mass


def test_every_row_through_sample_rows_matches_sample_tensor():
    """What a captured sampler runs (pwruntime.cuda_graphs): every row of the batch through `sample_rows` with both
    cuts, greedy rows as GREEDY_ROW, gives sample_tensor's tokens; a greedy row whose largest logit is tied takes
    the lowest id (argmax's), and a row that samples needs its number."""
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(8, 60, generator=g) * 2
    logits[0, [7, 19, 40]] = logits[1, [3, 59]] = 9.0  # ties for the largest logit in two greedy rows
    params = [SamplingParams(), SamplingParams(top_k=1, temperature=0.8), SamplingParams(temperature=0.7),
              SamplingParams(temperature=1.3, top_k=5), SamplingParams(temperature=1.0, top_p=0.5),
              SamplingParams(temperature=0.9, top_k=10, top_p=0.9), SamplingParams(), SamplingParams(temperature=1.1),
              SamplingParams(temperature=1.0, min_p=0.2), SamplingParams(temperature=0.8, top_k=8, top_p=0.7, min_p=0.1)]
    logits = torch.cat([logits, torch.randn(2, 60, generator=g) * 2])
    for trial in range(20):
        numbers = [None if p.greedy else float(u) for p, u in zip(params, torch.rand(10, generator=g))]
        if trial == 0:
            numbers[2], numbers[7] = 0.0, 1 - 2 ** -23
        values = torch.tensor([row_values(p, u, 60) for p, u in zip(params, numbers)], dtype=torch.float32)
        assert values.shape[1] == ROW_VALUES
        assert sample_rows(logits, values).tolist() == sample_tensor(logits, params, numbers).tolist()
    assert sample_rows(logits, values)[:2].tolist() == [7, 3]
    # the cuts a batch needs: greedy rows need none; a cut left out where no row has it changes no token
    for rows, cuts in (([0, 2, 7], (False, False, False)), ([1, 3, 6], (True, False, False)),
                       ([4, 2], (False, True, False)), ([5], (True, True, False)), ([0, 6], (False, False, False)),
                       ([8, 2], (False, False, True)), ([9], (True, True, True))):
        sub = [params[j] for j in rows]
        numbers = [None if p.greedy else float(u) for p, u in zip(sub, torch.rand(len(rows), generator=g))]
        values = [row_values(p, u, 60) for p, u in zip(sub, numbers)]
        assert needed_cuts(values, 60) == cuts
        got = sample_rows(logits[rows], torch.tensor(values, dtype=torch.float32), *cuts).tolist()
        assert got == sample_tensor(logits[rows], sub, numbers).tolist() == sample_rows(
            logits[rows], torch.tensor(values, dtype=torch.float32)).tolist()
    assert row_values(SamplingParams(), None, 60) == GREEDY_ROW
    assert row_values(SamplingParams(temperature=0.5, top_p=0.9, top_k=80), 0.25, 60) == (0.5, 0.9, 0.25, 59, 0.0)
    assert row_values(SamplingParams(temperature=0.5, min_p=0.3), 0.25, 60) == (0.5, math.inf, 0.25, 59, 0.3)
    with pytest.raises(ValueError, match="number"):
        row_values(SamplingParams(temperature=0.5), None, 60)


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


def test_requests_without_a_seed_each_draw_their_own_numbers(model):
    """Unseeded requests take the engine's seed mixed with their own id: the same prompt twice samples two answers
    (n choices without a seed), and the same engine seed repeats them."""
    cfg = EngineConfig(num_kv_blocks=64, block_size=4)
    p = SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True)
    outs = [o.token_ids for o in LLMEngine(model, cfg).generate([_prompt(0)] * 2, p)]
    assert outs[0] != outs[1]
    assert [o.token_ids for o in LLMEngine(model, cfg).generate([_prompt(0)] * 2, p)] == outs


def _first_new_text(model, token_ids, positions, wanted) -> tuple[int, str, str]:
    """The first n of `positions` where `wanted(before, upto, piece)` holds: before and upto the text of the first n and
    n + 1 tokens, piece what token n adds; (n, before, upto). No such n fails the test."""
    for n in positions:
        before, upto = (model.tokenizer.decode(token_ids[:k]) for k in (n, n + 1))
        if wanted(before, upto, upto[len(before):]):
            return n, before, upto
    raise AssertionError(f"no token at {positions} adds the text the test needs")


def test_a_stop_string_counts_only_once_min_tokens_are_out(model):
    """As vLLM: a stop string that the min_tokens-th output token (or an earlier one) completes does not end the
    request; one that the next token completes does."""
    cfg = EngineConfig(num_kv_blocks=64, block_size=4)
    full = LLMEngine(model, cfg).generate([_prompt(3)], SamplingParams(max_tokens=20, ignore_eos=True))[0]
    # the first token whose text is new: the stop string it completes
    n, before, upto = _first_new_text(model, full.token_ids, range(2, 16),
                                      lambda before, upto, piece: piece.strip() and upto.find(piece) == len(before))
    stop = upto[len(before):]

    def run(min_tokens):
        return LLMEngine(model, cfg).generate([_prompt(3)], SamplingParams(
            max_tokens=20, ignore_eos=True, stop=(stop,), min_tokens=min_tokens))[0]
    out = run(n)
    assert (out.text, len(out.token_ids), out.finish_reason) == (before, n + 1, "stop")
    held = run(n + 1)  # token n + 1 completes it: not yet counted
    assert len(held.token_ids) > n + 1 and held.token_ids == full.token_ids[:len(held.token_ids)]


def test_a_logit_bias_past_the_vocabulary_is_refused_beside_valid_ids(model):
    """Every listed id is checked, not only the lowest: a bias for token `vocab` beside token 0 is a UserError, not a
    failed step."""
    engine = LLMEngine(model, EngineConfig(num_kv_blocks=64, block_size=4))
    with pytest.raises(UserError, match="logit_bias names token"):
        engine.add_request(_prompt(1), SamplingParams(logit_bias={0: 1.0, model.config.vocab: 1.0}))
    assert not engine.has_unfinished()


def test_a_request_whose_values_degenerate_leaves_the_batch_beside_it_alone(model):
    """A server took these values and its engine step failed every request of the batch; now each finishes, and the
    others sample what they sample without it."""
    cfg = EngineConfig(num_kv_blocks=64, block_size=4, max_num_batched_tokens=8)
    p = SamplingParams(max_tokens=8, temperature=0.9, seed=5, ignore_eos=True)
    odd = [SamplingParams(max_tokens=6, temperature=1.0, top_p=1e-46, ignore_eos=True),
           SamplingParams(max_tokens=6, temperature=0.5, repetition_penalty=1e-38, ignore_eos=True)]
    alone = LLMEngine(model, cfg).generate([_prompt(0)], p)[0].token_ids
    out = LLMEngine(model, cfg).generate([_prompt(0), _prompt(1), _prompt(2)], [p, *odd])
    assert out[0].token_ids == alone and [len(o.token_ids) for o in out[1:]] == [6, 6]


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
    kept = LLMEngine(model, cfg).generate([_prompt(2)], SamplingParams(max_tokens=20, stop=(stop, "zzz"),
                                                                       ignore_eos=True, include_stop_str_in_output=True))[0]
    assert kept.text == expect_text + stop and kept.token_ids == out.token_ids and kept.finish_reason == "stop"


def test_a_kept_stop_is_the_longest_of_the_stops_one_token_completes(model):
    """Two stops that start at the same place and that the same token completes (one a prefix of the other): with
    include_stop_str_in_output the text keeps the longer one, as the whole match; without it neither."""
    cfg = EngineConfig(num_kv_blocks=64, block_size=4)
    full = LLMEngine(model, cfg).generate([_prompt(0)], SamplingParams(max_tokens=20, ignore_eos=True))[0]
    # a token whose text, and that text less its last character, first occur at its start
    n, before, upto = _first_new_text(model, full.token_ids, range(1, 20), lambda before, upto, piece: len(
        piece.strip()) >= 2 and upto.find(piece) == upto.find(piece[:-1]) == len(before))
    piece = upto[len(before):]
    stops = (piece[:-1], piece)
    for keep in (False, True):
        out = LLMEngine(model, cfg).generate([_prompt(0)], SamplingParams(
            max_tokens=20, ignore_eos=True, stop=stops, include_stop_str_in_output=keep))[0]
        assert (out.text, len(out.token_ids), out.finish_reason) == (upto if keep else before, n + 1, "stop")


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
