"""Prefix caching in the simulator: synthetic shared prefixes (traces.generators), known tokens only (a simulated
sequence's outputs are UNKNOWN_TOKEN, so only prompt blocks are cached and matched), the simulation with caching
off (bit-identical to a workload without token ids) and on (fewer computed tokens, lower TTFT), and the CLI."""
from __future__ import annotations

import json
import re

import numpy as np
import pytest

from policies.kv_blocks import BlockPool
from policies.scheduler import Scheduler
from policies.sequence import UNKNOWN_TOKEN, Sequence
from pwsim.cli import main
from pwsim.routing import TraceRouting, synthetic_routing
from pwsim.workload import synthetic
from sim_fixtures import same_arrays, summary_without_wall, tiny_card, tiny_sim
from traces.clikit import UserError
from traces.generators import (LengthDist, RoutingSpec, WorkloadSpec, arrival_times, generate_requests,
                               generate_routing)
from traces.model_card import load_card

# ---------------------------------------------------------------- generator


def _spec(**kw) -> WorkloadSpec:
    base = dict(requests=40, prompt=LengthDist.parse("uniform:8,100"), token_ids_vocab=1000)
    return WorkloadSpec(**{**base, **kw})


def _old_generate(spec: WorkloadSpec, seed: int) -> dict:
    """The request columns as generate_requests drew them before shared prefixes (SeedSequence.spawn(5))."""
    streams = [np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(5)]
    n = spec.requests
    w = np.full(len(spec.domains), 1.0 / len(spec.domains))
    prompt = spec.prompt.sample(n, streams[1])
    offsets = np.concatenate([[0], np.cumsum(prompt, dtype=np.int64)])
    return {"arrival_s": arrival_times(n, spec.rate, spec.burstiness, streams[0]), "prompt_tokens": prompt,
            "output_tokens": spec.output.sample(n, streams[2]),
            "domain_idx": streams[3].choice(len(spec.domains), size=n, p=w / w.sum()),
            "token_ids": streams[4].integers(0, spec.token_ids_vocab, size=int(offsets[-1]), dtype=np.int32)}


def test_without_shared_prefixes_the_requests_are_drawn_as_before():
    spec = _spec()
    new, old = generate_requests(spec, 11), _old_generate(spec, 11)
    for name, expected in old.items():
        np.testing.assert_array_equal(getattr(new, name), expected, err_msg=name)
    d = spec.describe()
    assert d["shared_prefix_tokens"] == 0 and d["prefix_groups"] == 1


def test_shared_prefixes_change_only_the_leading_prompt_ids():
    n_shared, groups = 32, 3
    base = generate_requests(_spec(), 5)
    shared = generate_requests(_spec(shared_prefix_tokens=n_shared, prefix_groups=groups), 5)
    for name in ("arrival_s", "prompt_tokens", "output_tokens", "domain_idx", "token_offsets"):
        np.testing.assert_array_equal(getattr(shared, name), getattr(base, name), err_msg=name)
    heads = []
    for i in range(len(shared)):
        ids, ref = shared.prompt_ids(i), base.prompt_ids(i)
        k = min(n_shared, len(ids) - 1)
        np.testing.assert_array_equal(ids[k:], ref[k:])  # the rest stays the request's own random ids
        heads.append(ids[:k])
    full = {tuple(h) for h in heads if len(h) == n_shared}
    assert len(full) == groups  # 40 requests, 3 groups: every group drawn, each with one prefix
    for h in heads:  # a short prompt starts with (all but its last token of) one of those prefixes
        assert sum(tuple(h) == f[:len(h)] for f in full) == 1
    assert len({f[0] for f in full}) == groups  # different groups differ from their first id


def test_one_token_prompts_keep_their_id_beside_prompts_that_share_a_prefix():
    """A prompt of one token has nothing to share (it keeps its own id); with only such prompts there is no prefix to
    draw at all, and beside longer ones the longer ones still share theirs."""
    only = _spec(prompt=LengthDist.parse("fixed:1"), shared_prefix_tokens=4)
    np.testing.assert_array_equal(generate_requests(only, 2).token_ids, generate_requests(
        _spec(prompt=LengthDist.parse("fixed:1")), 2).token_ids)
    mixed = generate_requests(_spec(prompt=LengthDist.parse("uniform:1,2"), shared_prefix_tokens=4, prefix_groups=1), 2)
    lens = mixed.prompt_tokens
    assert (lens == 1).any() and (lens == 2).any()
    heads = {int(mixed.prompt_ids(i)[0]) for i in range(len(mixed)) if lens[i] == 2}
    assert len(heads) == 1  # one group: every two-token prompt starts with its one shared id


def test_shared_prefixes_are_deterministic_by_seed():
    spec = _spec(shared_prefix_tokens=24, prefix_groups=4)
    a, b, c = (generate_requests(spec, s) for s in (3, 3, 4))
    np.testing.assert_array_equal(a.token_ids, b.token_ids)
    assert not np.array_equal(a.token_ids[:24], c.token_ids[:24])
    assert a.provenance["workload"]["shared_prefix_tokens"] == 24 and a.provenance["workload"]["prefix_groups"] == 4


@pytest.mark.parametrize("kw,needle", [
    ({"shared_prefix_tokens": -1}, "shared prefix tokens (--shared-prefix-tokens) must be >= 0"),
    ({"prefix_groups": 0}, "prefix groups (--prefix-groups) must be >= 1"),
    ({"shared_prefix_tokens": 8, "token_ids_vocab": 0}, "token id vocabulary"),
])
def test_bad_shared_prefix_settings_are_user_errors(kw, needle):
    with pytest.raises(UserError, match=re.escape(needle)):
        generate_requests(_spec(**kw), 0)


# ---------------------------------------------------------------- known tokens


def test_known_tokens():
    assert Sequence("x", prompt_len=5).num_known_tokens == 0  # length-only
    sim = Sequence("s", [1, 2, 3], max_tokens=4)
    sim.output_token_ids += [UNKNOWN_TOKEN, UNKNOWN_TOKEN]
    assert sim.num_known_tokens == 3 and sim.num_tokens == 5
    rt = Sequence("r", [1, 2, 3], max_tokens=4)
    rt.output_token_ids += [0, 9]
    assert rt.num_known_tokens == rt.num_tokens == 5


def _run_two(known: bool) -> tuple[tuple[int, int], Scheduler]:
    """Two sequences of 8-token prompts in a pool of 8 blocks of 4: the newer one is preempted after 8 outputs;
    returns (start, new tokens) of its re-admission. `known`: outputs are real ids (runtime), else UNKNOWN (sim)."""
    pool = BlockPool(8, block_size=4, prefix_caching=True)
    sched = Scheduler(pool, max_num_batched_tokens=64)
    a, b = Sequence("a", list(range(1, 9)), max_tokens=12), Sequence("b", list(range(50, 58)), max_tokens=12)
    sched.add(a)
    sched.add(b)
    readmit = None
    for step in range(100):
        batch = sched.schedule()
        for e in batch.entries:
            if e.seq is b and b.num_preemptions and not e.is_decode and readmit is None:
                readmit = (e.start, e.num_new_tokens)
        sched.postprocess(batch, [100 + step] * batch.num_sampled if known else None)
        pool.check_invariants()
        if not sched.has_unfinished():
            break
    assert a.is_finished and b.is_finished and b.num_preemptions == 1
    assert len(a.output_token_ids) == len(b.output_token_ids) == 12
    return readmit, sched


def test_a_readmitted_sim_sequence_matches_only_its_prompt_blocks():
    (start, new), sched = _run_two(known=False)
    assert (start, new) == (8, 9)  # its 2 prompt blocks; its 9 generated tokens (unknown ids) are recomputed
    assert sched.num_cached_tokens == 8
    assert sched.pool.num_cached_blocks == 4  # the two prompts' blocks, never a block holding an output


def test_a_readmitted_runtime_sequence_still_matches_its_output_blocks():
    (start, new), sched = _run_two(known=True)
    assert (start, new) == (12, 5)  # prompt blocks and the full block of known outputs
    assert sched.pool.num_cached_blocks > 4


def test_sim_sequences_with_the_same_prompt_never_share_output_blocks():
    pool = BlockPool(16, block_size=4, prefix_caching=True)
    sched = Scheduler(pool)
    prompt = list(range(1, 11))  # 2 full blocks and a partial one
    a = Sequence("a", prompt, max_tokens=12)
    sched.add(a)
    while sched.has_unfinished():
        sched.postprocess(sched.schedule())
    assert a.num_tokens == 22 and pool.num_cached_blocks == 2  # 5 blocks, only the prompt's full ones cached
    b = Sequence("b", prompt, max_tokens=12)
    sched.add(b)
    first = sched.schedule()
    assert [(e.start, e.num_new_tokens) for e in first.entries] == [(8, 2)]
    sched.postprocess(first)
    while sched.has_unfinished():
        sched.postprocess(sched.schedule())
        shared = [x for x in pool.block_table("b") if pool.ref_count(x) > 1]
        assert not shared  # a is gone; b's own blocks after the prompt are never registered
    assert pool.num_cached_blocks == 2
    pool.check_invariants()


# ---------------------------------------------------------------- routing of a first chunk after a cached prefix


def test_routing_of_a_chunk_after_cached_tokens_is_that_of_its_positions():
    card = load_card("PagedWeight-demo")
    req = generate_requests(WorkloadSpec(requests=3, prompt=LengthDist.parse("fixed:40"),
                                         output=LengthDist.parse("fixed:4")), 1)
    sources = [synthetic_routing(req, card, RoutingSpec(features=True), 1),
               TraceRouting.from_trace(generate_routing(req, card, RoutingSpec(features=True), 1), req)]
    for src in sources:
        whole = src.route(np.array([1]), np.array([0]), np.array([41]))
        tail = src.route(np.array([1]), np.array([32]), np.array([9]))  # a first chunk after 2 cached blocks
        np.testing.assert_array_equal(tail.ids, whole.ids[:, 32:])
        np.testing.assert_array_equal(tail.weights, whole.weights[:, 32:])
        np.testing.assert_array_equal(tail.gate_up_norm, whole.gate_up_norm[:, 32:])


# ---------------------------------------------------------------- the simulation


def _workload(shared: int = 48, vocab: int = 100, groups: int = 2):
    spec = WorkloadSpec(requests=24, rate=2000.0, prompt=LengthDist.parse("uniform:40,120"),
                        output=LengthDist.parse("uniform:4,48"), domains=("c4", "wikitext2", "code"),
                        token_ids_vocab=vocab, shared_prefix_tokens=shared, prefix_groups=groups)
    return synthetic(tiny_card(), spec, RoutingSpec(features=True), 0)


@pytest.mark.parametrize("kv_blocks", [12, 48])  # 12: preemptions, re-admissions over cached prompt blocks
def test_caching_skips_shared_prompt_blocks_and_lowers_ttft(kv_blocks):
    wl = _workload()
    off = tiny_sim(workload=wl, kv_blocks=kv_blocks).run()  # check_invariants=True in tiny_sim
    on_sim = tiny_sim(workload=wl, kv_blocks=kv_blocks, prefix_caching=True)
    assert on_sim.pool.prefix_caching and not tiny_sim(workload=wl, kv_blocks=kv_blocks).pool.prefix_caching
    on = on_sim.run()
    s_off, s_on = off.summary, on.summary
    assert s_off["prefix_cache_hit_tokens"] == 0 and s_on["prefix_cache_hit_tokens"] > 0
    assert s_on["prefix_cache_hit_tokens"] % 16 == 0  # whole blocks of prompt tokens
    assert s_on["completed"] == s_off["completed"] == 24
    assert set(s_on["finish_reasons"]) == {"length"}
    np.testing.assert_array_equal(on.requests["output_tokens"], off.requests["output_tokens"])
    assert s_on["computed_tokens"] < s_off["computed_tokens"]
    assert s_on["ttft_s"]["mean"] <= s_off["ttft_s"]["mean"]
    again = tiny_sim(workload=wl, kv_blocks=kv_blocks, prefix_caching=True).run()
    assert summary_without_wall(again.summary) == summary_without_wall(s_on)
    assert same_arrays(again.requests, on.requests) and same_arrays(again.timeline, on.timeline)


def test_caching_off_ignores_token_ids():
    with_ids, without = _workload(shared=48), _workload(shared=0, vocab=0)
    assert with_ids.requests.token_ids is not None and without.requests.token_ids is None
    a, b = tiny_sim(workload=with_ids, kv_blocks=16).run(), tiny_sim(workload=without, kv_blocks=16).run()
    assert summary_without_wall(a.summary) == summary_without_wall(b.summary)
    assert same_arrays(a.requests, b.requests) and same_arrays(a.timeline, b.timeline)
    assert a.summary["preemptions"] > 0  # a run under pressure, so the comparison says something


def test_caching_without_token_ids_is_a_user_error():
    with pytest.raises(UserError, match="--token-ids-vocab"):
        tiny_sim(workload=_workload(shared=0, vocab=0), prefix_caching=True)


# ---------------------------------------------------------------- the CLI

DEMO = ["--budget", "48MiB", "--trace", "synthetic", "--requests", "12", "--no-plots", "--no-progress"]


def test_run_with_prefix_caching_reports_hits(tmp_path, capsys):
    flags = [*DEMO, "--token-ids-vocab", "1000", "--shared-prefix-tokens", "128", "--prefix-groups", "2", "--json"]
    assert main(["run", *flags, "--out", str(tmp_path / "off")]) == 0
    off = json.loads(capsys.readouterr().out)
    assert main(["run", *flags, "--enable-prefix-caching", "--out", str(tmp_path / "on")]) == 0
    on = json.loads(capsys.readouterr().out)
    assert off["prefix_cache_hit_tokens"] == 0 < on["prefix_cache_hit_tokens"]
    assert on["completed"] == off["completed"] == 12 and on["computed_tokens"] < off["computed_tokens"]
    config = json.loads((tmp_path / "on" / "config.json").read_text())
    assert config["prefix_caching"] is True and config["workload"]["shared_prefix_tokens"] == 128
    assert main(["run", *DEMO, "--token-ids-vocab", "1000", "--shared-prefix-tokens", "128", "--prefix-groups", "2",
                 "--enable-prefix-caching", "--out", str(tmp_path / "text")]) == 0
    assert f"prefix caching: {on['prefix_cache_hit_tokens']:,} prompt tokens" in capsys.readouterr().out


def test_run_a_trace_directory_with_shared_prefixes_and_recorded_routing(tmp_path, capsys):
    trace = tmp_path / "trace"
    assert main(["gen-trace", "--out", str(trace), "--card", "PagedWeight-demo", "--requests", "8",
                 "--prompt-dist", "uniform:40,80", "--output-dist", "fixed:8", "--domains", "c4,wikitext2,code",
                 "--token-ids-vocab", "500", "--shared-prefix-tokens", "32", "--json"]) == 0
    capsys.readouterr()
    assert main(["trace-info", str(trace)]) == 0
    assert "shared prefixes of 32 tokens (1 group)" in capsys.readouterr().out
    assert main(["run", "--budget", "48MiB", "--trace", str(trace), "--enable-prefix-caching", "--json", "--no-plots",
                 "--out", str(tmp_path / "run")]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["completed"] == 8 and s["prefix_cache_hit_tokens"] > 0


@pytest.mark.parametrize("argv,needle", [
    (["run", *DEMO, "--enable-prefix-caching"], "--enable-prefix-caching needs prompt token ids"),
    (["run", *DEMO, "--shared-prefix-tokens", "16"], "shared prefixes are token ids: give a token id vocabulary"),
    (["run", *DEMO, "--token-ids-vocab", "9", "--prefix-groups", "0"], "(--prefix-groups) must be >= 1"),
    (["gen-trace", "--shared-prefix-tokens", "-2", "--token-ids-vocab", "9"], "(--shared-prefix-tokens) must be >= 0"),
    (["gen-trace", "--shared-prefix-tokens", "16"], "give a token id vocabulary too (--token-ids-vocab V"),
])
def test_prefix_flag_misuse_is_one_line_and_exit_2(tmp_path, capsys, argv, needle):
    assert main([*argv, "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0] and "Traceback" not in err[0]
    assert not (tmp_path / "x").exists()


def test_caching_on_a_trace_without_token_ids_exits_2(tmp_path, capsys):
    trace = tmp_path / "trace"
    assert main(["gen-trace", "--out", str(trace), "--card", "PagedWeight-demo", "--requests", "4", "--json"]) == 0
    capsys.readouterr()
    assert main(["run", "--budget", "48MiB", "--trace", str(trace), "--enable-prefix-caching", "--no-plots",
                 "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "needs the prompt token ids" in err[0] and "--token-ids-vocab" in err[0]
