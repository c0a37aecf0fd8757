"""The simulator with hybrid KV groups (`SimConfig.hybrid_kv`, `pwsim run --hybrid-kv-cache`): sliding-window layers'
blocks handed back as they leave the window (policies.kv_groups), on a tiny Gemma-like card."""
from __future__ import annotations

import json
from dataclasses import replace

from policies.kv_groups import GroupedBlockPool
from pwsim.cli import main
from sim_fixtures import summary_without_wall, tiny_card, tiny_sim, tiny_workload


def tiny_gemma():
    """Three sliding layers (window 16, 128 B a token) and a global one (64 B a token: 32-token blocks)."""
    return replace(tiny_card(), name="tiny-gemma", arch="gemma4", layers=4, global_layers=(3,), sliding_window=16,
                   global_head_dim=16, global_kv_heads=1)


def _run(card, hybrid: bool, kv_blocks: int = 12, **kw):
    wl = tiny_workload(card, n=24, prompt="uniform:40,160", output="uniform:8,64")
    sim = tiny_sim("pagedweight", kv_blocks=kv_blocks, card=card, workload=wl, hybrid_kv=hybrid, **kw)
    room = sim.pool.capacity * sim.kv_block_bytes   # the KV pool's bytes before the planner moves them
    return sim, room, sim.run().summary


def test_hybrid_groups_hold_less_kv_and_preempt_less_at_the_same_budget():
    card = tiny_gemma()
    single, single_room, s = _run(card, False)
    hybrid, hybrid_room, h = _run(card, True)
    assert isinstance(hybrid.pool, GroupedBlockPool) and not isinstance(single.pool, GroupedBlockPool)
    assert hybrid.kv_block_bytes == card.kv_layout(16).page_bytes == 2048 < single.kv_block_bytes == 16 * 448
    assert s["completed"] == h["completed"] == 24 and s["output_tokens"] == h["output_tokens"]
    # the same KV room in bytes, counted in pages of 2 KiB instead of blocks of 7 KiB
    assert single_room - single.kv_block_bytes < hybrid_room <= single_room + hybrid.kv_block_bytes
    assert h["preemptions"] < s["preemptions"]
    assert h["throughput_tokens_per_s"] > s["throughput_tokens_per_s"]


def test_models_without_sliding_windows_run_alike_with_the_flag():
    card = tiny_card()
    *_, off = _run(card, False)
    *_, on = _run(card, True)
    assert summary_without_wall(off) == summary_without_wall(on)


def test_prefix_caching_over_hybrid_groups_skips_shared_prompt_tokens():
    """Requests with 64 shared leading prompt tokens of two groups, over hybrid groups (16-token sliding blocks,
    window 16; 32-token global ones): cached prefixes skip whole multiples of 32 tokens, the outputs are the same, and
    the run repeats itself exactly."""
    from pwsim.workload import synthetic
    from traces.generators import LengthDist, RoutingSpec, WorkloadSpec

    card = tiny_gemma()
    spec = WorkloadSpec(requests=24, rate=2000.0, prompt=LengthDist.parse("uniform:70,160"),
                        output=LengthDist.parse("uniform:4,48"), domains=("c4", "code"), token_ids_vocab=100,
                        shared_prefix_tokens=64, prefix_groups=2)
    wl = synthetic(card, spec, RoutingSpec(features=True), 0)
    sims = [tiny_sim(kv_blocks=12, card=card, workload=wl, hybrid_kv=True, prefix_caching=caching)
            for caching in (False, True, True)]
    assert isinstance(sims[1].pool, GroupedBlockPool) and sims[1].pool.prefix_caching
    off, on, again = (sim.run().summary for sim in sims)
    assert off["prefix_cache_hit_tokens"] == 0 and on["prefix_cache_hit_tokens"] > 0
    assert on["prefix_cache_hit_tokens"] % 32 == 0 and on["computed_tokens"] < off["computed_tokens"]
    assert on["completed"] == off["completed"] == 24 and on["output_tokens"] == off["output_tokens"]
    assert summary_without_wall(again) == summary_without_wall(on)


def test_the_cli_takes_the_flag(tmp_path):
    out = tmp_path / "run"
    assert main(["run", "--trace", "synthetic", "--model", "Gemma-4-26B-A4B", "--calibration", "synthetic",
                 "--budget", "40GiB", "--requests", "8", "--prompt-dist", "uniform:2000,3000",
                 "--output-dist", "uniform:16,32", "--out", str(out)]) == 0  # on by default
    assert json.loads((out / "config.json").read_text())["hybrid_kv"] is True
    # turned off, and a model without sliding layers, which keeps one table either way: its config says so
    for name, extra in (("off", ["--model", "Gemma-4-26B-A4B", "--no-hybrid-kv-cache"]), ("one-table", [])):
        assert main(["run", "--trace", "synthetic", "--calibration", "synthetic", "--budget", "40GiB", "--requests",
                     "4", "--output-dist", "uniform:4,8", "--out", str(tmp_path / name), *extra]) == 0
        assert json.loads((tmp_path / name / "config.json").read_text())["hybrid_kv"] is False
