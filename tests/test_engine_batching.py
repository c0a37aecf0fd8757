"""LLMEngine with the real tiny models: continuous batching equals running alone, preemption, KV resizing,
observations and traces."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest

from model_fixtures import CPU_ARCHS, make_text, make_tiny_checkpoint
from policies.contract import Plan, Transition
from pwruntime.engine import EngineConfig, LLMEngine
from pwruntime.model import load_model
from pwruntime.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


def _prompts(model, lengths=(3, 29, 11, 6)):
    words = make_text(200, seed=7).split()
    out = []
    for i, n in enumerate(lengths):
        ids = model.tokenizer.encode(" ".join(words[i * 5: i * 5 + n]))
        assert len(ids) >= n
        out.append(ids)
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine_models")
    return {arch: load_model(make_tiny_checkpoint(root, arch, seed=1)) for arch in CPU_ARCHS}


def _alone(model, prompt, params=GREEDY):
    engine = LLMEngine(model, EngineConfig(num_kv_blocks=64, block_size=4))
    (out,) = engine.generate([prompt], params)
    assert engine.scheduler.num_preemptions == 0
    return out.token_ids


@pytest.mark.parametrize("arch", CPU_ARCHS)
def test_batched_equals_alone(models, arch):
    model = models[arch]
    prompts = _prompts(model)
    # a small token budget forces chunked prefill of the long prompt alongside decodes
    engine = LLMEngine(model, EngineConfig(num_kv_blocks=64, block_size=4, max_num_batched_tokens=10))
    outs = engine.generate(prompts, GREEDY)
    assert [o.finish_reason for o in outs] == ["length"] * 4
    assert all(len(o.token_ids) == 12 for o in outs)
    assert len({tuple(o.token_ids) for o in outs}) > 1  # not degenerate
    assert [o.token_ids for o in outs] == [_alone(model, p) for p in prompts]
    assert engine.pool.num_free == engine.pool.capacity


def test_a_forward_s_routing_reaches_the_host_as_it_was(models):
    """routing_to_host packs every MoE layer's routing into int32 words and RoutingCopy.arrays reads it back: the
    same ids, weights and norms, layer by layer."""
    import torch

    from pwruntime.model.moe_model import LayerRouting
    from pwruntime.model_runner import routing_to_host

    g = torch.Generator().manual_seed(0)
    layers = [LayerRouting(torch.randint(0, 60, (5, 2), generator=g), torch.rand(5, 2, generator=g),
                           torch.rand(5, generator=g), torch.rand(5, 2, generator=g)) for _ in range(3)]
    got = routing_to_host(layers, (2, 3)).arrays()
    assert got.query_lens == (2, 3)
    for name in ("topk_ids", "topk_weights", "gate_up_in_norm", "down_in_norm"):
        want = np.stack([getattr(x, name).numpy() for x in layers])
        assert np.array_equal(getattr(got, name), want), name


def test_a_step_keeps_as_many_sampled_tokens_as_the_runner_has_rows(models):
    import torch

    from pwruntime.model_runner import ModelRunner

    model = models["qwen2_moe"]
    runner = ModelRunner(model, model.new_kv_cache(4, 4), max_num_seqs=3)
    runner.keep_sampled(torch.tensor([7, 8, 9]), ["a", "b", "c"])
    assert runner.sampled.tolist() == [7, 8, 9]
    with pytest.raises(ValueError, match="4 sampled tokens for a buffer of 3"):
        runner.keep_sampled(torch.tensor([1, 2, 3, 4]), ["a", "b", "c", "d"])


@pytest.mark.parametrize("arch", ["qwen2_moe", "gemma4"])
def test_batched_with_preemption_equals_alone(models, arch):
    model = models[arch]
    prompts = _prompts(model)
    # 12 blocks of 4 tokens of every layer (one table: hybrid groups count pages of one group's block): each request
    # alone fits (<= 41 tokens), all four together (>= 90) do not
    engine = LLMEngine(model, EngineConfig(num_kv_blocks=12, block_size=4, max_num_batched_tokens=64,
                                           record_traces=True, hybrid_kv_cache=False))
    outs = engine.generate(prompts, GREEDY)
    assert engine.scheduler.num_preemptions > 0
    # a recompute's positions are traced again, as its request's next attempt; each request's last computation whole
    r, layers = engine.recorder.routing_trace(), model.config.num_moe_layers
    assert r.attempts.max() >= 1
    for rid, p in zip(sorted(set(r.request_id.tolist())), prompts):
        last = r.attempts[r.request_id == rid].max()
        assert ((r.request_id == rid) & (r.attempts == last)).sum() == (len(p) + GREEDY.max_tokens - 1) * layers
    assert sum(o.num_preemptions for o in outs) == engine.scheduler.num_preemptions
    assert [o.finish_reason for o in outs] == ["length"] * 4
    assert [o.token_ids for o in outs] == [_alone(model, p) for p in prompts]


def test_prompt_too_large_for_pool_is_a_clear_error(models):
    from traces.clikit import UserError

    engine = LLMEngine(models["mixtral"], EngineConfig(num_kv_blocks=2, block_size=4))
    with pytest.raises(UserError, match="KV blocks"):
        engine.add_request(list(range(3, 12)))
    with pytest.raises(UserError, match="needs 3 KV blocks"):  # 8 tokens fill the pool: no room for one more
        engine.add_request(list(range(3, 11)))
    with pytest.raises(UserError, match="no tokens"):
        engine.add_request([])


def test_a_pool_sized_from_host_memory_takes_whole_blocks_up_to_max_num_seqs_requests(models):
    """On CPU the pool takes cpu_kv_cache_bytes' whole blocks, never more than max_num_seqs full-length requests hold;
    bytes short of one block, or num_kv_blocks below 1, are a UserError naming the setting."""
    from traces.clikit import UserError

    model = models["mixtral"]
    one = LLMEngine(model, EngineConfig(num_kv_blocks=1, block_size=4))
    b, per_request = one.block_bytes, one.kv_blocks_per_request
    assert LLMEngine(model, EngineConfig(block_size=4, cpu_kv_cache_bytes=5 * b + b // 2)).pool.capacity == 5
    capped = LLMEngine(model, EngineConfig(block_size=4, max_num_seqs=2, cpu_kv_cache_bytes=3 * per_request * b))
    assert capped.pool.capacity == 2 * per_request
    with pytest.raises(UserError, match="no memory left for the KV cache"):
        LLMEngine(model, EngineConfig(block_size=4, cpu_kv_cache_bytes=b - 1))
    with pytest.raises(UserError, match="num_kv_blocks must be >= 1, got 0"):
        LLMEngine(model, EngineConfig(num_kv_blocks=0, block_size=4))


def test_observation_routing_mass_and_features(models):
    model = models["olmoe"]
    engine = LLMEngine(model, EngineConfig(num_kv_blocks=64, block_size=4, observe_routing=True))
    for p in _prompts(model)[:2]:
        engine.add_request(p, GREEDY)
    engine.step()
    obs = engine.last_observation
    cfg = model.config
    assert obs.routing_mass.shape == (cfg.num_moe_layers, cfg.experts)
    np.testing.assert_allclose(obs.routing_mass.sum(axis=1), 1.0, rtol=1e-9)
    assert obs.prompt_features.shape == (cfg.num_moe_layers * cfg.experts * 2, 3)
    phi = obs.prompt_features
    assert (phi >= 0).all() and (phi[:, 0] > 0).any()
    seen = phi[:, 0] > 0
    assert (phi[seen, 0] <= phi[seen, 1] + 1e-9).all() and (phi[seen, 1] <= phi[seen, 2] + 1e-9).all()  # mean<=rms<=max
    assert obs.total_blocks == 64 and obs.free_blocks == 64 - engine.pool.num_used
    assert obs.num_running == 2 and obs.kv_block_bytes == engine.block_bytes
    while engine.has_unfinished():
        engine.step()
    assert np.all(engine.last_observation.prompt_features == 0)  # nobody running


class _Watching:
    """A planner that reads each observation and never changes a bit."""
    name = "watching"

    def reset(self, table, calibration) -> None:
        return None

    def plan_step(self, table, observation):
        return None


@pytest.mark.parametrize("policy,observed", [("noop", False), ("uniform-4", False), (_Watching, True)])
def test_routing_is_observed_only_for_a_policy_that_plans(models, policy, observed):
    """No routing to the host, routing mass or prompt features for the policies that never plan (nothing reads them);
    a planner gets them; `observe_routing` overrides either way."""
    model = models["olmoe"]
    for override in (None, not observed):
        cfg = EngineConfig(num_kv_blocks=64, block_size=4, policy=policy if isinstance(policy, str) else "noop",
                           observe_routing=override)
        engine = LLMEngine(model, cfg, policy=None if isinstance(policy, str) else policy())
        calls = []
        observe = engine._observe_routing
        engine._observe_routing = lambda batch, r: (calls.append(r), observe(batch, r))
        engine.add_request(_prompts(model)[0], GREEDY)
        engine.step()
        want = observed if override is None else override
        assert bool(calls) == want
        obs = engine.last_observation
        assert (obs.routing_mass is not None) == want and (obs.prompt_features is not None) == want


@pytest.mark.parametrize("arch", ["qwen3_moe", "gemma4"])   # Gemma 4: layers of two KV geometries
def test_shrink_with_compaction_and_grow_keep_outputs(models, arch):
    model = models[arch]
    short, long_ = _prompts(model, (3, 9))
    expect = _alone(model, long_, SamplingParams(max_tokens=20, ignore_eos=True))
    engine = LLMEngine(model, EngineConfig(num_kv_blocks=16, block_size=4, hybrid_kv_cache=False))  # one table
    engine.add_request(short, SamplingParams(max_tokens=1))  # takes block 0 and finishes at once
    rid = engine.add_request(long_, SamplingParams(max_tokens=20, ignore_eos=True))
    engine.step()
    before = engine.pool.block_table(rid)
    assert min(before) > 0 and engine.pool.num_free == 16 - len(before)
    assert not engine.capacity.shrink(engine.pool.num_free + 1)
    # retire every free block, block 0 included: a hole under live blocks, so the top one moves down into it
    assert engine.capacity.shrink(engine.pool.num_free)
    after = engine.pool.block_table(rid)
    assert sorted(after) == list(range(len(before))) and after != before
    assert engine.pool.id_limit == engine.kv.num_blocks == engine.pool.capacity == len(before)
    outputs = []
    while engine.has_unfinished():  # the request stalls when its blocks are full, until the pool grows
        outputs += engine.step()
        if engine.num_steps == 5:
            engine.capacity.grow(8)
            assert engine.kv.num_blocks == engine.pool.id_limit == len(before) + 8
    assert outputs[-1].token_ids == expect and outputs[-1].finish_reason == "length"


@dataclass
class OffloadOnce:
    """A policy that lowers block 0 from 8 to 4 bits at step 1, then does nothing."""

    name: str = "offload-once"
    plans: list = field(default_factory=list)

    def reset(self, table, calibration):
        return None

    def plan_step(self, table, observation):
        if observation.step != 1:
            return None
        plan = Plan((Transition(0, 8, 4, int(table.M[0, 8] - table.M[0, 4])),))
        self.plans.append(plan)
        return plan


def test_released_weight_bytes_grow_the_kv_pool(models):
    model = models["mixtral"]
    engine = LLMEngine(model, EngineConfig(num_kv_blocks=8, block_size=4), policy=OffloadOnce())
    engine.add_request(_prompts(model)[0], GREEDY)
    engine.step()
    engine.step()
    freed = engine.policy.plans[0].bytes_freed
    from policies.apformat import lut_bytes

    lut4 = lut_bytes(int(engine.table.shapes[0, 0]), 4)  # reserved at the offload, given back at commit
    assert engine.last_loop.committed == (0,) and engine.last_loop.released_bytes == freed + lut4
    assert engine.table.q[0] == 4
    grown = freed // engine.block_bytes
    assert engine.pool.capacity == 8 + grown and engine.kv.num_blocks == engine.pool.id_limit
    assert engine.capacity.spare_bytes == freed - grown * engine.block_bytes


def test_weight_bytes_freed_outside_the_loop_grow_the_kv_pool(models):
    engine = LLMEngine(models["mixtral"], EngineConfig(num_kv_blocks=8, block_size=4))
    b = engine.block_bytes
    assert engine.capacity.give(b // 2) == 0 and engine.pool.capacity == 8   # half a block waits as spare
    assert engine.capacity.give(b * 2) == 2 and engine.pool.capacity == 10   # 2.5 blocks: two more, half spare
    assert engine.kv.num_blocks == engine.pool.id_limit and engine.capacity.spare_bytes == b // 2


def test_a_growth_the_device_refuses_is_tried_again_only_once_more_bytes_come(models, monkeypatch):
    """A growth with no memory behind it leaves its bytes spare; the release(0) of every step does not try it again,
    more released bytes do, and once one succeeds any later release grows the pool again."""
    engine = LLMEngine(models["mixtral"], EngineConfig(num_kv_blocks=8, block_size=4))
    cap, b, resize = engine.capacity, engine.block_bytes, engine.kv.resize

    def no_memory(num_blocks):
        raise MemoryError("out of device memory")

    monkeypatch.setattr(engine.kv, "resize", no_memory)
    cap.release(3 * b)
    assert cap.grow_failures == 1 and cap.spare_bytes == 3 * b and engine.pool.capacity == 8
    cap.release(0)
    assert cap.grow_failures == 1  # nothing new: not tried again
    cap.release(b)
    assert cap.grow_failures == 2 and cap.spare_bytes == 4 * b
    monkeypatch.setattr(engine.kv, "resize", resize)
    cap.release(b)
    assert engine.pool.capacity == 13 and cap.spare_bytes == 0
    cap.release(2 * b)  # fewer bytes than the refused growth had: grows, the refusal is forgotten
    assert engine.pool.capacity == 15 and engine.kv.num_blocks == engine.pool.id_limit


def test_trace_recording(models, tmp_path):
    from traces.io import read_trace_dir
    from traces.schema import check_routing_against_requests

    model = models["qwen2_moe"]
    prompts = _prompts(model, (4, 7))
    engine = LLMEngine(model, EngineConfig(num_kv_blocks=64, block_size=4, record_traces=True,
                                           routing_half_life_tokens=None))
    outs = engine.generate(prompts, SamplingParams(max_tokens=5, ignore_eos=True))
    req = engine.recorder.request_trace()
    rt = engine.recorder.routing_trace()
    assert list(req.prompt_tokens) == [len(p) for p in prompts] and list(req.output_tokens) == [5, 5]
    assert list(req.prompt_ids(1)) == prompts[1]
    cfg = model.config
    assert len(rt) == sum(len(p) + 5 - 1 for p in prompts) * cfg.num_moe_layers and rt.has_features
    check_routing_against_requests(rt, req)
    np.testing.assert_allclose(rt.routing_mass(), engine.routing.mass(), rtol=1e-5)
    assert [o.request_id for o in outs] == list(req.request_id)
    back = read_trace_dir(engine.recorder.write(tmp_path / "trace"))
    assert len(back.routing) == len(rt) and list(back.requests.prompt_tokens) == list(req.prompt_tokens)
    np.testing.assert_array_equal(back.routing.expert_ids, rt.expert_ids)


def test_request_outgrowing_the_pool_finishes_with_kv_capacity_and_abort(models):
    model = models["mixtral"]
    engine = LLMEngine(model, EngineConfig(num_kv_blocks=3, block_size=4, stall_limit=2))
    prompt = _prompts(model, (5,))[0]
    expect = _alone(model, prompt)
    rid = engine.add_request(prompt, GREEDY)  # 12 slots hold prompt + 7 outputs, then it stalls
    other = engine.add_request(prompt, GREEDY)
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
        if engine.num_steps == 3:
            aborted = engine.abort(other)
            assert aborted.finish_reason == "abort" and aborted.request_id == other
    (out,) = outs
    assert out.request_id == rid and out.finish_reason == "kv_capacity"
    n = 12 - len(prompt) + 1
    assert out.token_ids == expect[:n]
    assert engine.pool.num_free == 3


def test_prompt_features_of_a_batch_equal_per_sequence_updates(models):
    """The engine feeds the prompt features a whole batch at a time; the result equals feeding each sequence's
    tokens on its own, through prefill chunks and decode steps."""
    from policies.features import BatchedPromptFeatures
    from policies.observe import split_tokens

    model = models["qwen2_moe"]
    engine = LLMEngine(model, EngineConfig(num_kv_blocks=64, block_size=4, max_num_batched_tokens=16,
                                           observe_routing=True))
    c = model.config
    ref = BatchedPromptFeatures(c.num_moe_layers or c.layers, c.experts)
    observe = engine._observe_routing

    def both(batch, r):
        observe(batch, r)
        for (a, b), e in zip(split_tokens(r.query_lens), batch.entries):
            ref.update(e.seq.seq_id, r.topk_ids[:, a:b], r.topk_weights[:, a:b], r.gate_up_in_norm[:, a:b],
                       r.down_in_norm[:, a:b])

    engine._observe_routing = both
    for p in _prompts(model):
        engine.add_request(p, SamplingParams(max_tokens=6, ignore_eos=True))
    compared = 0
    while engine.has_unfinished():
        engine.step()
        for s in engine.scheduler.running:
            np.testing.assert_allclose(engine.routing.sequence_features(s.seq_id), ref.sequence_features(s.seq_id),
                                       rtol=1e-12, atol=1e-12)
            compared += 1
    assert compared > 10
