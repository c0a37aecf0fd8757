"""The runtime's hybrid KV groups (`--hybrid-kv-cache`): a tiny Gemma 4 whose sliding and global layers keep their KV
in groups of their own generates what one table generates, holding fewer pages; the cache shares a page's memory
between groups; resizes, compaction and preemption keep the outputs; what is refused."""
from __future__ import annotations

import json

import pytest
import torch

from model_fixtures import make_text, make_tiny_checkpoint
from policies.kv_blocks import NULL_BLOCK
from policies.kv_groups import GroupedBlockPool
from pwruntime.cli import main
from pwruntime.engine import EngineConfig, LLMEngine
from pwruntime.model import load_model
from pwruntime.sampling import SamplingParams
from pwruntime.stats_log import ready_line, serving_info
from traces.clikit import UserError

pytestmark = pytest.mark.usefixtures("one_thread")
GREEDY = SamplingParams(max_tokens=20, ignore_eos=True, logprobs=0)
# six layers: sliding (window 8) at 2 KV heads of 16, global at 1 KV head of 64, so a token of a global layer is twice a
# sliding one's: sliding blocks hold 8 tokens, global ones 4 (block_size), and groups are two layers each
LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention"] * 2


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("hybrid"), "gemma4", seed=3, num_hidden_layers=6,
                                layer_types=LAYER_TYPES, global_head_dim=64)
    return load_model(path)


def _prompts(lengths=(5, 19, 33, 12)) -> list[list[int]]:
    return [[(7 * i + 3 * j) % 120 + 3 for j in range(n)] for i, n in enumerate(lengths)]


def test_the_layout_and_the_cache_share_a_page_between_groups(model):
    layout = model.kv_layout(4, hybrid=True)
    assert [(g.layers, g.block_size, g.window) for g in layout.groups] == [
        ((0, 1), 8, 8), ((3, 4), 8, 8), ((2, 5), 4, None)]
    kv = model.new_kv_cache(5, 4, hybrid=True)
    assert kv.layout == layout and kv.nbytes == 5 * layout.page_bytes
    assert kv.k[0].shape == (5, 8, 2, 16) and kv.v[5].shape == (5, 4, 1, 64)
    # place 0 of every group is one buffer, place 1 another
    assert kv.k[0].data_ptr() == kv.k[3].data_ptr() == kv.k[2].data_ptr() != kv.k[1].data_ptr()
    assert kv.v[1].data_ptr() == kv.v[4].data_ptr() == kv.v[5].data_ptr() != kv.k[1].data_ptr()
    kv.k[2][1].normal_()   # page 1 as a global layer writes it
    kv.v[4][1].normal_()
    page_k, page_v = kv.k[3][1].clone(), kv.v[1][1].clone()   # the same bytes, seen by a sliding layer
    assert page_k.abs().sum() > 0 and torch.equal(page_k.flatten(), kv.k[2][1].flatten())
    kv.resize(7)
    assert kv.k[2].shape == (7, 4, 1, 64) and torch.equal(kv.k[3][1], page_k) and not kv.k[0][5:].any()
    kv.copy_blocks(torch.tensor([1]), torch.tensor([6]))   # every buffer: both places' K and V
    assert torch.equal(kv.k[0][6], page_k) and torch.equal(kv.v[1][6], page_v)
    one_table = model.new_kv_cache(5, 4)
    assert one_table.k[0].data_ptr() != one_table.k[3].data_ptr() and one_table.k[2].shape == (5, 4, 1, 64)
    assert one_table.nbytes == 5 * model.kv_layout(4).page_bytes == 5 * 2 * layout.page_bytes  # 4 tokens of all six


def test_a_layout_whose_shares_do_not_match_the_layers_is_refused(model):
    from pwruntime.kv_cache import KVCache

    layout = model.kv_layout(4, hybrid=True)
    with pytest.raises(ValueError, match="share of a page"):
        KVCache(6, 2, 4, 2, 16, layer_shapes=[(2, 16)] * 6, layout=layout)


def _run(model, hybrid: bool, prompts, **config) -> tuple[list, int, bool]:
    """Every request's tokens and logprobs, the most KV bytes the pool held at once, and whether a sliding group's
    table had released a block at some step."""
    engine = LLMEngine(model, EngineConfig(block_size=4, max_num_batched_tokens=16, hybrid_kv_cache=hybrid, **config))
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    outputs, peak, released = {}, 0, False
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id] = out
        peak = max(peak, engine.pool.num_used * engine.block_bytes)
        if isinstance(engine.pool, GroupedBlockPool):
            released |= any(NULL_BLOCK in engine.pool.group_table(rid, 0) for rid in ids)
    return [outputs[i] for i in ids], peak, released


def test_hybrid_groups_generate_what_one_table_generates_in_less_memory(model):
    """Greedy outputs and their logprobs are the same: each sliding layer reads its window through its group's
    table (a chunk after its context gathers from the window's first block on), each global layer its whole context.
    And the pool holds less: blocks a sliding window has left go back."""
    prompts = _prompts()
    ones, one_peak, _ = _run(model, False, prompts, num_kv_blocks=64)
    groups, group_peak, released = _run(model, True, prompts, num_kv_blocks=128)
    assert [o.token_ids for o in groups] == [o.token_ids for o in ones]
    for a, b in zip(groups, ones):
        assert max(abs(x.logprob - y.logprob) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4
    assert released and group_peak < 0.8 * one_peak


def test_a_tight_hybrid_pool_preempts_and_still_agrees(model):
    """Pages enough for about one long sequence: requests are preempted and recomputed, the outputs unchanged."""
    prompts = _prompts((30, 31, 29))
    ones, _, _ = _run(model, False, prompts, num_kv_blocks=64)
    engine = LLMEngine(model, EngineConfig(block_size=4, num_kv_blocks=20, max_num_batched_tokens=16,
                                           hybrid_kv_cache=True))
    outs = engine.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ones]
    assert sum(o.num_preemptions for o in outs) > 0


def test_shrinking_with_compaction_keeps_every_group_s_pages(model):
    """The planner's shrink compacts live pages downwards: each moves with both places' K and V, whichever group
    holds it, and the request goes on as if nothing moved."""
    (prompt,) = _prompts((26,))
    (expect,), _, _ = _run(model, False, [prompt], num_kv_blocks=64)
    engine = LLMEngine(model, EngineConfig(block_size=4, num_kv_blocks=24, hybrid_kv_cache=True))
    engine.add_request([5, 6, 7], SamplingParams(max_tokens=1))   # takes the lowest pages and finishes at once
    rid = engine.add_request(prompt, GREEDY)
    engine.step()
    before = [engine.pool.group_table(rid, g) for g in range(3)]
    assert engine.capacity.shrink(engine.pool.num_free)
    after = [engine.pool.group_table(rid, g) for g in range(3)]
    assert after != before and engine.kv.num_blocks == engine.pool.capacity
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
        if engine.num_steps == 3:
            engine.capacity.grow(16)
    assert outputs[-1].token_ids == expect.token_ids


def test_what_hybrid_groups_report_and_refuse(model, tmp_path):
    engine = LLMEngine(model, EngineConfig(block_size=4, num_kv_blocks=40, hybrid_kv_cache=True))
    info = serving_info(engine)
    length = engine.max_model_len
    assert info["hybrid_kv_cache"] and info["kv_blocks_per_request"] == engine.kv_layout.pages(length - 1, length)
    assert "40 KV pages of its hybrid groups" in ready_line(info, 1.0)
    with pytest.raises(UserError, match="the prompt needs 10 KV pages but the pool has 8"):
        LLMEngine(model, EngineConfig(block_size=4, num_kv_blocks=8, hybrid_kv_cache=True)).add_request(
            list(range(3, 23)))   # 21 tokens: global blocks 6, sliding (window 8) 2 a group


def test_prefix_caching_over_hybrid_groups_shares_the_window_and_generates_the_same(model):
    """Prompts that share 40 leading tokens (window 8): later requests start from the cached prefix (each sliding group
    only its window's blocks, the global group all of them) and generate what they generate without caching, one
    request at a time so that each finds the ones before it cached."""
    shared = [(5 * j) % 120 + 3 for j in range(40)]
    prompts = [shared + [(11 * i + j) % 120 + 3 for j in range(3 + i)] for i in range(4)]
    runs = []
    for caching in (False, True):
        engine = LLMEngine(model, EngineConfig(block_size=4, num_kv_blocks=200, max_num_seqs=1, hybrid_kv_cache=True,
                                               prefix_caching=caching))
        runs.append([o.token_ids for o in engine.generate(prompts, GREEDY)])
        engine.pool.check_invariants()
    assert runs[0] == runs[1]
    assert engine.scheduler.num_cached_tokens == 3 * 40   # each later prompt's 40 shared tokens (multiples of 8)


@pytest.mark.parametrize("caching", [False, True])
def test_asynchronous_scheduling_over_hybrid_groups_generates_what_synchronous_does(model, caching):
    """The next step is scheduled before the last one's tokens are known: a sliding group's blocks leave its window
    and go back one token ahead of what has landed, under a pool tight enough to preempt (and, with prefix caching,
    prompts sharing 24 tokens). The tokens are those of synchronous scheduling."""
    shared = [(5 * j) % 120 + 3 for j in range(24)]
    prompts = [shared + p for p in _prompts((3, 9, 6, 13))]
    runs = []
    for async_scheduling in (False, True):
        engine = LLMEngine(model, EngineConfig(block_size=4, num_kv_blocks=24, max_num_batched_tokens=16,
                                               hybrid_kv_cache=True, prefix_caching=caching,
                                               async_scheduling=async_scheduling))
        outs = engine.generate(prompts, GREEDY)
        engine.pool.check_invariants()
        runs.append(([o.token_ids for o in outs], sum(o.num_preemptions for o in outs)))
    assert runs[1][0] == runs[0][0]
    assert runs[0][1] > 0 and runs[1][1] > 0


def test_a_model_without_sliding_layers_keeps_one_table(tmp_path):
    model = load_model(make_tiny_checkpoint(tmp_path, "mixtral", seed=1))
    engine = LLMEngine(model, EngineConfig(block_size=4, num_kv_blocks=16, hybrid_kv_cache=True))
    assert not engine.kv_layout.hybrid and not isinstance(engine.pool, GroupedBlockPool)


def test_generate_takes_the_flag(tmp_path, capsys):
    path = make_tiny_checkpoint(tmp_path, "gemma4", seed=3, num_hidden_layers=6, layer_types=LAYER_TYPES,
                                global_head_dim=64)
    args = ["generate", "--model", str(path), "--device", "cpu", "--prompt", make_text(30, seed=1), "--prompt",
            make_text(12, seed=2), "--max-tokens", "12", "--ignore-eos", "--json", "--block-size", "4"]
    runs = []
    for extra in (["--no-hybrid-kv-cache"], []):  # on by default
        assert main(args + extra) == 0
        runs.append(json.loads(capsys.readouterr().out))
    assert [r["stats"]["hybrid_kv_cache"] for r in runs] == [False, True]
    assert [o["token_ids"] for o in runs[0]["outputs"]] == [o["token_ids"] for o in runs[1]["outputs"]]


@pytest.mark.gpu
@pytest.mark.parametrize("global_kv_heads", [2, 1])
def test_cuda_hybrid_groups_run_the_kernels_and_graphs_as_one_table_does(tmp_path, capsys, global_kv_heads):
    """On CUDA in bf16 at Gemma 4's head sizes (sliding 4 x 256, window 16; global 2 x 512: a token's bytes alike, so
    three groups of one layer, 16-token blocks each; global 1 x 512: its group's blocks of 32 tokens, so a kernel or
    a graph's input that took another group's block size would read the wrong rows): the GQA decode kernel over
    sliding tables whose blocks before the window are released, flash attention's chunks gathering keys from the
    window on (16-token chunks after their context), and the global layer's whole context. The same data in the same
    order as one table's, so the same tokens; and the same again through decode graphs and mixed steps' pieces (each
    group's tables and slots in their static inputs). The graphs' tables are the model's 4096 positions wide, so their
    decode kernel cuts a context into parts of which only the first has keys, and the merge writes that part's output
    as it is: the eager steps' kernel, of one part, writes the same."""
    from test_model_gpu import _gemma4_at_its_head_sizes

    path = _gemma4_at_its_head_sizes(tmp_path, window=16, global_kv_heads=global_kv_heads)
    args = ["generate", "--model", str(path), "--device", "cuda", "--dtype", "bf16", "--prompt", make_text(60, seed=1),
            "--prompt", make_text(25, seed=2), "--max-tokens", "48", "--ignore-eos", "--max-num-batched-tokens", "16",
            "--json"]
    runs = {}
    for name, extra in (("eager", ["--no-cuda-graphs", "--no-hybrid-kv-cache"]), ("hybrid eager", ["--no-cuda-graphs"]),
                        ("hybrid graphs", [])):
        assert main(args + extra) == 0
        runs[name] = json.loads(capsys.readouterr().out)
    assert [r["stats"]["hybrid_kv_cache"] for r in runs.values()] == [False, True, True]
    stats = runs["hybrid graphs"]["stats"]
    assert stats["cuda_graph_replays"] > 16 and stats["mixed_graph_replays"] > 0
    tokens = {name: [o["token_ids"] for o in r["outputs"]] for name, r in runs.items()}
    assert tokens["eager"] == tokens["hybrid eager"] == tokens["hybrid graphs"]
    assert all(len(t) == 48 for t in tokens["eager"])
