"""Asynchronous scheduling: the scheduler's advance/settle halves (a step apart) and an engine that launches the next
batch before settling the last gives the same tokens, stops, log-probabilities and traces as a synchronous one."""
from __future__ import annotations

import numpy as np
import pytest

from model_fixtures import make_text, make_tiny_checkpoint
from policies.kv_blocks import BlockPool
from policies.scheduler import Scheduler
from policies.sequence import PENDING_TOKEN, Sequence, SequenceStatus
from pwruntime.engine import EngineConfig, LLMEngine
from pwruntime.model import load_model
from pwruntime.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------- scheduler halves
def _sched(blocks: int = 32, **kw) -> Scheduler:
    return Scheduler(BlockPool(blocks, 4), max_num_seqs=8, max_num_batched_tokens=64, **kw)


def test_advance_leaves_a_pending_token_that_the_next_schedule_decodes():
    s = _sched()
    a = Sequence("a", [1, 2, 3], max_tokens=4, eos_token_id=9)
    s.add(a)
    b0 = s.schedule()
    s.advance(b0)
    assert a.output_token_ids == [PENDING_TOKEN] and a.num_computed_tokens == 3 and a.num_settled_outputs == 0
    assert a.num_known_tokens == 3
    b1 = s.schedule()   # before b0 settles: a decodes its pending token
    assert [(e.start, e.num_new_tokens, e.sample, e.is_decode) for e in b1.entries] == [(3, 1, True, True)]
    s.advance(b1)
    assert s.settle(b0, [5]) == [] and a.output_token_ids == [5, PENDING_TOKEN]
    assert s.settle(b1, [6]) == [] and a.output_token_ids == [5, 6] and a.num_settled_outputs == 2
    with pytest.raises(ValueError, match="no pending token"):
        s.settle(b1, [6])


def test_a_stop_settled_late_drops_the_later_pending_token_and_its_entry():
    s = _sched()
    a, b = Sequence("a", [1, 2], max_tokens=8, eos_token_id=9), Sequence("b", [3], max_tokens=8, eos_token_id=9)
    s.add(a)
    s.add(b)
    b0 = s.schedule()
    s.advance(b0)
    b1 = s.schedule()
    s.advance(b1)
    assert s.settle(b0, [9, 4]) == [a]   # a sampled EOS in b0; b1 already computed its next token
    assert a.is_finished and a.finish_reason == "stop" and a.output_token_ids == [9]
    assert s.pool.num_blocks_of("a") == 0
    assert s.settle(b1, [7, 7]) == [] and a.output_token_ids == [9] and b.output_token_ids == [4, 7]


def test_a_sequence_awaiting_its_last_token_is_not_scheduled_and_is_no_stall():
    s = _sched(stall_limit=0)
    a = Sequence("a", [1, 2], max_tokens=1)
    s.add(a)
    b0 = s.schedule()
    s.advance(b0)
    b1 = s.schedule()       # a's one token is pending: nothing to run, and not a stall (stall_limit 0 would abort)
    assert b1.entries == () and not b1.stalled and b1.aborted == ()
    assert s.pending_blocks() == 0
    assert s.settle(b0, [4]) == [a] and a.finish_reason == "length" and a.output_token_ids == [4]


def test_a_sequence_awaiting_its_last_token_asks_no_block_of_the_next_step():
    s = _sched()
    a = Sequence("a", [1, 2, 3, 4], max_tokens=1)   # a full block: a next token would need a new one
    s.add(a)
    s.advance(s.schedule())
    assert a.awaits_last_token and s.pending_blocks() == 0


def test_max_tokens_counts_only_the_outputs_up_to_the_settled_one():
    s = _sched()
    a = Sequence("a", [1], max_tokens=2)
    s.add(a)
    b0 = s.schedule()
    s.advance(b0)
    b1 = s.schedule()
    s.advance(b1)           # a holds two pending tokens: the first settling must not count the second
    assert s.settle(b0, [5]) == [] and a.status == SequenceStatus.RUNNING
    assert s.settle(b1, [6]) == [a] and a.finish_reason == "length"


def test_abort_and_preemption_while_a_token_is_pending():
    s = _sched(blocks=2)
    a, b = Sequence("a", [1] * 4, max_tokens=8), Sequence("b", [2] * 3, max_tokens=8)
    s.add(a)
    s.add(b)
    b0 = s.schedule()
    s.advance(b0)
    b1 = s.schedule()   # a needs a second block for its pending token: b, the newest, is preempted
    assert b in b1.preempted and b.status == SequenceStatus.WAITING and b.output_token_ids == [PENDING_TOKEN]
    s.advance(b1)
    assert s.settle(b0, [7, 8]) == [] and b.output_token_ids == [8]   # settled while waiting: kept for its recompute
    assert s.abort("a") is a and a.output_token_ids == [7]           # its pending token (b1's) is never settled
    assert s.settle(b1, [3]) == [] and a.output_token_ids == [7]


def test_postprocess_is_advance_then_settle():
    s = _sched()
    a = Sequence("a", [1, 2, 3], max_tokens=2)
    s.add(a)
    b0 = s.schedule()
    assert s.postprocess(b0, [4]) == [] and a.output_token_ids == [4] and a.num_computed_tokens == 3
    b1 = s.schedule()
    assert s.postprocess(b1, None) == [a] and a.output_token_ids == [4, -1]   # a simulator's unknown token


# ---------------------------------------------------------------- engine
@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(make_tiny_checkpoint(tmp_path_factory.mktemp("async_model"), "qwen2_moe", seed=1))


def _prompts(model, lengths=(3, 29, 11, 6, 17)):
    words = make_text(300, seed=11).split()
    return [model.tokenizer.encode(" ".join(words[i * 7: i * 7 + n])) for i, n in enumerate(lengths)]


def _run(model, params, asynchronous: bool, **cfg):
    config = dict(num_kv_blocks=64, block_size=4, max_num_batched_tokens=16, record_traces=True)
    config.update(cfg)
    engine = LLMEngine(model, EngineConfig(async_scheduling=asynchronous, **config))
    outs = engine.generate(_prompts(model), params)
    assert not engine.has_unfinished() and engine.pool.num_free == engine.pool.capacity
    return engine, outs


def _routing(engine) -> tuple[np.ndarray, np.ndarray]:
    """The recorded routing as (request, position, layer) keys and expert ids, in key order."""
    t = engine.recorder.routing_trace()
    order = np.lexsort((t.layer, t.position, t.request_id))
    return np.stack([t.request_id, t.position, t.layer], 1)[order], t.expert_ids[order]


def _same(sync, asyn):
    for s, a in zip(sync, asyn):
        assert (a.token_ids, a.text, a.finish_reason, a.logprobs) == (s.token_ids, s.text, s.finish_reason, s.logprobs)


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=12, ignore_eos=True, logprobs=2),
    SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=3, logprobs=0),
    SamplingParams(max_tokens=12, temperature=0.9, seed=4, logprobs=1, logit_bias={5: 4.0, 17: -100.0}),
])
def test_async_engine_equals_sync(model, params):
    se, sync = _run(model, params, False)
    ae, asyn = _run(model, params, True)
    _same(sync, asyn)
    assert all(len(o.token_ids) == 12 and len(o.logprobs) == 12 for o in asyn)
    assert ae.num_steps >= se.num_steps   # the last tokens settle a step later
    (skeys, sids), (akeys, aids) = _routing(se), _routing(ae)
    assert np.array_equal(akeys, skeys) and np.array_equal(aids, sids)


def test_async_stops_drop_the_extra_token(model):
    """Stop tokens and stop strings found a step late: the outputs end where the synchronous engine's end."""
    _, free = _run(model, SamplingParams(max_tokens=10, ignore_eos=True), False)
    stop_id = free[1].token_ids[4]
    text = model.tokenizer.decode(free[3].token_ids[:6])
    params = [SamplingParams(max_tokens=10, ignore_eos=True, stop_token_ids=(stop_id,)),
              SamplingParams(max_tokens=10, ignore_eos=True, stop_token_ids=(stop_id,)),
              SamplingParams(max_tokens=10, ignore_eos=True, stop=(text[-3:],)),
              SamplingParams(max_tokens=10, ignore_eos=True, stop=(text[-3:],)),
              SamplingParams(max_tokens=3, ignore_eos=True)]
    se, sync = _run(model, params, False)
    ae, asyn = _run(model, params, True)
    _same(sync, asyn)
    assert any(o.finish_reason == "stop" for o in asyn)
    assert np.array_equal(_routing(ae)[0], _routing(se)[0])   # the extra tokens' routing is not recorded


def test_async_penalties_settle_first_and_match_sync(model):
    params = SamplingParams(max_tokens=8, ignore_eos=True, repetition_penalty=1.3, frequency_penalty=0.5)
    _, sync = _run(model, params, False)
    _, asyn = _run(model, params, True)
    _same(sync, asyn)


def test_async_preemption_and_prefix_caching_match_sync(model):
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    kw = dict(num_kv_blocks=14, max_num_batched_tokens=64, record_traces=False, prefix_caching=True)
    se, sync = _run(model, params, False, **kw)
    ae, asyn = _run(model, params, True, **kw)
    _same(sync, asyn)
    assert se.scheduler.num_preemptions > 0 and ae.scheduler.num_preemptions > 0


def test_async_streaming_view_and_abort_never_show_a_pending_token(model):
    engine = LLMEngine(model, EngineConfig(num_kv_blocks=64, block_size=4, async_scheduling=True))
    rid = engine.add_request(_prompts(model)[1], SamplingParams(max_tokens=20, ignore_eos=True))
    seen = []
    for _ in range(6):
        engine.step()
        seen.append(engine.tokens_so_far(rid))
        assert PENDING_TOKEN not in seen[-1]
    assert seen[0] == [] and len(seen[-1]) >= 3   # a step behind the device
    out = engine.abort(rid)
    assert out.finish_reason == "abort" and PENDING_TOKEN not in out.token_ids and out.token_ids[:len(seen[-1])] == seen[-1]
    while engine.has_unfinished():   # the launched batch still settles, and gives the aborted request nothing
        assert engine.step() == []
    assert engine.pool.num_free == engine.pool.capacity


@pytest.mark.gpu
def test_gpu_async_engine_replays_graphs_and_equals_sync():
    """On CUDA with decode and piecewise graphs: the next step's graph takes its tokens from the device, and the
    tokens (greedy and seeded) equal a synchronous engine's."""
    from pwruntime.cmd_perplexity import default_model_dir

    demo = load_model(default_model_dir(), dtype="bf16", device="cuda")
    prompts = ["And God said unto Moses", "def main(", "You will", "The os module provides", "A fool and his"] * 2
    params = [SamplingParams(max_tokens=24, ignore_eos=True),
              SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.9, seed=5, logprobs=1)]
    outs, engines = {}, {}
    for asynchronous in (False, True):
        engine = LLMEngine(demo, EngineConfig(num_kv_blocks=128, max_num_seqs=8, max_num_batched_tokens=64,
                                              async_scheduling=asynchronous))
        outs[asynchronous] = [engine.generate(prompts, p) for p in params]
        engines[asynchronous] = engine
        assert not engine.has_unfinished() and engine.pool.num_free == engine.pool.capacity
    runner = engines[True].runner
    assert runner.graphs.replays > 0 and runner.mixed_graphs.replays > 0
    for sync, asyn in zip(outs[False], outs[True]):
        for s_, a in zip(sync, asyn):
            assert a.token_ids == s_.token_ids and a.text == s_.text
            assert [r.token_id for r in a.logprobs] == [r.token_id for r in s_.logprobs]


def test_one_request_s_penalties_settle_every_step_of_a_batch_of_plain_ones(model):
    """A penalty reads every token so far, so asynchronous steps settle first while any request asks for one, not
    only when all do: beside plain requests, a request that two boosted tokens and a frequency penalty make switch
    between them (each token's count so far decides) gives the tokens it gives synchronously."""
    pair = SamplingParams(max_tokens=12, ignore_eos=True, frequency_penalty=1.0, logit_bias={50: 30.0, 90: 30.0})
    plain = SamplingParams(max_tokens=12, ignore_eos=True)
    params = [plain, pair, plain, plain, plain]
    sync, asyn = (_run(model, params, a, max_num_batched_tokens=64)[1] for a in (False, True))
    _same(sync, asyn)
    assert set(sync[1].token_ids) == {50, 90} and min(sync[1].token_ids.count(t) for t in (50, 90)) >= 4
