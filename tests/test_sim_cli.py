"""`pwsim run`, `pwsim compare` and `pwsim bench sim` end to end, on small workloads."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pyarrow.parquet as pq
import pytest

from pwsim.cli import main
from pwsim.runner import RunConfig, execute
from sim_fixtures import summary_without_wall

# the large-model setup with a synthetic calibration and workload (not the bundled demo default)
SMALL = ["--model", "Qwen1.5-MoE-A2.7B", "--calibration", "synthetic", "--trace", "synthetic", "--quality-fit", "none",
         "--requests", "10", "--prompt-dist", "fixed:48", "--output-dist", "fixed:24", "--rate", "200"]


def test_run_writes_results_and_its_config_reproduces_them(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["run", "--policy", "pagedweight", "--budget", "19GiB", "--out", str(out), *SMALL]) == 0
    text = capsys.readouterr().out
    assert "10/10 requests completed" in text and "perplexity fit unmeasured" in text
    for name in ("requests.parquet", "timeline.parquet", "summary.json", "config.json", "events.json",
                 "timeline.png", "latency.png"):
        assert (out / name).is_file(), name
    req = pq.read_table(out / "requests.parquet").to_pydict()
    assert len(req["request_id"]) == 10 and set(req["finish_reason"]) == {"length"}
    assert all(t > 0 for t in req["ttft_s"]) and all(o == 24 for o in req["output_tokens"])
    tl = pq.read_table(out / "timeline.parquet")
    assert {"time_s", "weight_bytes", "kv_pool_bytes", "mean_bits", "free_blocks"} <= set(tl.column_names)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["memory"]["budget_bytes"] == 19 * 2**30 and summary["hardware"]["measured"] is False
    again = execute(RunConfig.from_json(json.loads((out / "config.json").read_text())))
    assert summary_without_wall(json.loads(json.dumps(again.summary, default=float))).keys() == \
        summary_without_wall(summary).keys()
    assert again.summary["iterations"] == summary["iterations"]
    assert again.summary["quality"]["mean_damage_per_token"] == pytest.approx(summary["quality"]["mean_damage_per_token"])


def test_max_num_batched_tokens_is_the_runtime_s_flag_and_the_old_name_still_works(tmp_path, capsys):
    """`pwsim run --max-num-batched-tokens` (vLLM's and `pwruntime`'s name) limits each iteration's tokens; the
    simulator's older `--max-batched-tokens` means the same."""
    configs = []
    for name, flag in (("new", "--max-num-batched-tokens"), ("old", "--max-batched-tokens")):
        assert main(["run", "--policy", "pagedweight", "--budget", "19GiB", "--out", str(tmp_path / name), *SMALL,
                     flag, "32"]) == 0
        configs.append(json.loads((tmp_path / name / "config.json").read_text()))
        tl = pq.read_table(tmp_path / name / "timeline.parquet").to_pydict()
        assert max(tl["batch_tokens"]) == 32  # the 48-token prompts go in chunks
    capsys.readouterr()
    assert configs[0]["max_num_batched_tokens"] == configs[1]["max_num_batched_tokens"] == 32


def test_a_concurrency_sweep_runs_each_level_and_fidelity_pairs_two_sweeps(tmp_path, capsys):
    """`pwsim run --max-concurrency 1,4` writes a run per level (as `pwruntime bench serve` does), and `pwsim
    fidelity` compares two sweeps level by level; a sweep against a single run, or a sweep with --fit-profile, is
    refused."""
    out = tmp_path / "sweep"
    assert main(["run", "--budget", "19GiB", "--max-concurrency", "1,4", "--out", str(out), "--no-plots", "--json",
                 *SMALL]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["max_concurrency"] for r in rows] == [1, 4] and all(r["completed"] == r["requests"] == 10 for r in rows)
    assert rows[0]["throughput_tokens_per_s"] < rows[1]["throughput_tokens_per_s"]  # one user is slower than four
    assert sorted(p.name for p in out.iterdir()) == ["c1", "c4", "config.json", "summary.json"]
    for level in (1, 4):
        saved = json.loads((out / f"c{level}" / "summary.json").read_text())
        assert saved["throughput_tokens_per_s"] == pytest.approx(rows[[1, 4].index(level)]["throughput_tokens_per_s"])
        assert saved["itl_s"]["p99"] == rows[[1, 4].index(level)]["itl_p99_s"] > 0
        assert json.loads((out / f"c{level}" / "config.json").read_text())["max_concurrency"] == level
    assert json.loads((out / "summary.json").read_text())["sweep"] == rows
    # the same sweep against itself, as `pwruntime bench serve` would have written it: every ratio 1
    served = tmp_path / "served"
    shutil.copytree(out, served)
    (served / "config.json").write_text(json.dumps({"command": "bench", "target": "serve"}))
    assert main(["fidelity", "--sim", str(out), "--runtime", str(served), "--out", str(tmp_path / "fid"),
                 "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [r["max_concurrency"] for r in report["levels"]] == [1, 4] and set(report["reports"]) == {"1", "4"}
    assert all(r["throughput_ratio"] == pytest.approx(1.0) and r["tpot_s_ratio_p50"] == pytest.approx(1.0)
               for r in report["levels"])
    assert (tmp_path / "fid" / "fidelity.png").stat().st_size > 10_000
    for argv, needle in ((["--runtime", str(out / "c4")], "--sim is a concurrency sweep and --runtime is not"),
                         (["--runtime", str(out), "--fit-profile", str(tmp_path / "p.json")], "give one level")):
        assert main(["fidelity", "--sim", str(out), *argv, "--out", str(tmp_path / "fid2")]) == 2
        assert needle in capsys.readouterr().err
    assert main(["compare", "--max-concurrency", "1,4", "--out", str(tmp_path / "cmp"), *SMALL]) == 2
    assert "which `pwsim run` runs" in capsys.readouterr().err
    assert main(["chrome-trace", str(out), "--out", str(tmp_path / "t.json")]) == 2  # a sweep is not one run
    assert f"is a concurrency sweep, not one run; give one of its levels ({out / 'c1'}, {out / 'c4'})" in \
        capsys.readouterr().err


def test_compare_table_is_the_same_with_one_or_two_jobs(tmp_path, capsys):
    args = ["compare", "--policies", "fp16,uniform-4,pagedweight", "--budgets", "19GiB,30GiB", "--json",
            "--no-progress", *SMALL]
    assert main([*args, "--jobs", "1", "--out", str(tmp_path / "a")]) == 0
    one = json.loads(capsys.readouterr().out)
    assert main([*args, "--jobs", "2", "--out", str(tmp_path / "b")]) == 0
    two = json.loads(capsys.readouterr().out)
    strip = lambda rows: [{k: v for k, v in r.items() if k != "wall_s"} for r in rows]  # noqa: E731
    assert strip(one["rows"]) == strip(two["rows"]) and len(one["rows"]) == 6
    status = {(r["policy"], r["budget"]): r["status"] for r in one["rows"]}
    assert status[("fp16", "19GiB")] == "infeasible" and status[("fp16", "30GiB")] == "ok"
    ok = [r for r in one["rows"] if r["status"] == "ok"]
    assert all(r["completed"] == 10 for r in ok)
    u4 = next(r for r in ok if r["policy"] == "uniform-4")
    fp = next(r for r in ok if r["policy"] == "fp16")
    assert u4["weights_gib"] < fp["weights_gib"] and fp["damage_per_token"] == 0 < u4["damage_per_token"]
    for name in ("compare.json", "compare.csv", "quality_vs_memory.png", "throughput.png", "timelines.png"):
        assert (tmp_path / "b" / name).is_file(), name
    csv_lines = (tmp_path / "b" / "compare.csv").read_text().splitlines()
    assert len(csv_lines) == 7 and csv_lines[0].startswith("policy,budget,status")


def test_compare_sweeps_a_planner_parameter_beside_policies_without_it(tmp_path, capsys):
    """`--sweep K=V1,V2` runs each policy that has K once per value (a row each, labelled with the value) and the
    others once; each row is the run `--policy-arg K=V` gives; the reproduce line carries the sweep (the bundled
    demo default under pressure, 24 MiB)."""
    args = ["compare", "--policies", "pagedweight,uniform-4", "--budgets", "24MiB", "--sweep", "min_plan_blocks=1,16",
            "--sweep", "alpha=0.5,1", "--no-progress", "--jobs", "1"]
    assert main([*args, "--out", str(tmp_path / "cmp")]) == 0
    text = capsys.readouterr().out
    report = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    labels = [r["policy"] for r in report["rows"]]
    assert labels == ["pagedweight,alpha=0.5,min_plan_blocks=1", "pagedweight,alpha=1.0,min_plan_blocks=1",
                      "pagedweight,alpha=0.5,min_plan_blocks=16", "pagedweight,alpha=1.0,min_plan_blocks=16",
                      "uniform-4"]  # the first --sweep's values in the outer loop
    assert "--sweep min_plan_blocks=1,16 --sweep alpha=0.5,1" in text
    rows = {r["policy"]: r for r in report["rows"]}
    # each parameter reached the planner
    assert rows["pagedweight,alpha=0.5,min_plan_blocks=16"]["mean_bits"] != \
        rows["pagedweight,alpha=1.0,min_plan_blocks=16"]["mean_bits"]
    assert rows["pagedweight,alpha=0.5,min_plan_blocks=1"]["throughput_tok_s"] != \
        rows["pagedweight,alpha=0.5,min_plan_blocks=16"]["throughput_tok_s"]
    assert main(["run", "--policy", "pagedweight", "--policy-arg", "alpha=0.5", "--policy-arg", "min_plan_blocks=16",
                 "--budget", "24MiB", "--json", "--no-plots", "--out", str(tmp_path / "one")]) == 0
    one = json.loads(capsys.readouterr().out)
    row = rows["pagedweight,alpha=0.5,min_plan_blocks=16"]
    assert (one["throughput_tokens_per_s"], one["mean_committed_bits"]) == (row["throughput_tok_s"], row["mean_bits"])
    # each row also counts its planner's round trips, as `pwsim plan-log` does on the run's plan log
    from pwsim.plan_stats import summarize
    from traces.results import read_plan_log
    trips = summarize(read_plan_log(tmp_path / "one"))["round_trips"]
    assert (row["round_trips"], row["round_trip_share"]) == (trips["count"], trips["share_of_taken_bytes"])
    assert row["round_trips"] > 0 and rows["uniform-4"]["round_trips"] == 0


@pytest.mark.parametrize("argv,needle", [
    (["compare", "--sweep", "min_plan_blocks"], "is not K=V1,V2"),
    (["compare", "--sweep", "min_plan_blocks=1,1"], "a value is given twice"),
    (["compare", "--sweep", "min_plan_blocks=1", "--sweep", "min_plan_blocks=2"], "given twice"),
    (["compare", "--policies", "uniform-4,fp16", "--sweep", "alpha=1,2"], "no policy of --policies uniform-4,fp16"),
    (["compare", "--policies", "pagedweight", "--sweep", "alpha=1,2", "--policy-arg", "alpha=3"], "give one"),
    (["compare", "--policies", "pagedweight", "--sweep", "min_plan_blocks=1,lots"], "expects an integer"),
    (["capacity", "--slo-ttft", "1", "--policies", "uniform-4", "--sweep", "alpha=1,2"], "has that parameter"),
])
def test_sweep_misuse_is_one_line_and_writes_nothing(tmp_path, capsys, argv, needle):
    assert main([*argv, "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0] and "Traceback" not in err[0], err
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("argv,needle", [
    (["run", "--budget", "lots"], "cannot read size"),
    (["run", "--trace", "/no/such/trace"], "not a trace directory"),
    (["run", "--policy", "nonsense"], "unknown policy"),
    (["run", "--policy", "pagedweight", "--policy-arg", "alpha"], "KEY=VALUE"),
    (["run", "--hardware", "no-such-gpu"], "hardware profile"),
    (["run", "--calibration", "/no/such/dir"], "calibration"),
    (["run", "--budget", "2GiB", *SMALL], "cannot hold the weights"),
    (["compare", "--policies", "uniform-4,fp16", "--policy-arg", "bits=3"], "single policy"),
])
def test_user_errors_are_one_line_and_exit_2(tmp_path, capsys, argv, needle):
    argv = [*argv, "--out", str(tmp_path / "x")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0] and "Traceback" not in err[0]
    assert not (tmp_path / "x" / "summary.json").exists()


def test_bench_sim_reports_tokens_per_wall_second(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["bench", "sim", "--requests", "12", "--output-dist", "fixed:32", "--no-pin", "--json",
                 "--out", str(out)]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["target"] == "sim" and res["completed"] == 12 and res["output_tokens"] == 12 * 32
    assert res["sim_tokens_per_wall_s"] > 0 and res["command"].startswith("pwsim bench sim")
    assert json.loads(out.read_text())["computed_tokens"] == res["computed_tokens"]


def test_the_bundled_quality_fit_applies_only_to_the_model_and_calibration_it_was_measured_on(tmp_path):
    """The demo fit on another model's (or a synthetic calibration's) damages predicted perplexities of 1e90."""
    from pwsim.defaults import DEFAULTS
    from pwsim.runner import make_config
    assert make_config("24MiB").uses_quality_fit
    assert not make_config("20GiB", model="Qwen1.5-MoE-A2.7B", calibration="synthetic").uses_quality_fit
    assert not make_config("24MiB", calibration="synthetic").uses_quality_fit
    assert not make_config("24MiB", quality_fit="none").uses_quality_fit
    own = tmp_path / "fit.json"  # a fit the user gives is theirs to match
    own.write_text(open(DEFAULTS.quality_fit).read())
    assert make_config("20GiB", model="Qwen1.5-MoE-A2.7B", calibration="synthetic", quality_fit=str(own)).uses_quality_fit


def test_the_reproduce_line_names_every_setting_and_reproduces_the_run(tmp_path, capsys):
    """`reproduce:` (and summary.json's `command`) carries every option the run changed, engine limits and SLOs
    included (it left out --block-size, --max-num-seqs, ...), and running it gives the same result."""
    import shlex
    argv = ["run", "--policy", "uniform-4", "--budget", "24MiB", "--max-num-seqs", "8", "--block-size", "32",
            "--max-num-batched-tokens", "256", "--slo-ttft", "0.5", "--no-hybrid-kv-cache", "--requests", "12",
            "--trace", "synthetic", "--out", str(tmp_path / "a"), "--no-plots"]
    assert main(argv) == 0
    line = capsys.readouterr().out.splitlines()[-1]
    first = json.loads((tmp_path / "a" / "summary.json").read_text())
    assert line == f"reproduce: {first['command']}"
    for flag in ("--max-num-seqs 8", "--block-size 32", "--max-num-batched-tokens 256", "--slo-ttft 0.5",
                 "--no-hybrid-kv-cache", "--policy uniform-4", "--budget 24MiB"):
        assert flag in line, flag
    again = shlex.split(line.removeprefix("reproduce: pwsim "))
    assert main([*again, "--force"]) == 0
    capsys.readouterr()
    second = json.loads((tmp_path / "a" / "summary.json").read_text())
    assert summary_without_wall(second) == summary_without_wall(first) and second["command"] == first["command"]


def test_plots_do_not_depend_on_the_order_levels_and_budgets_are_named_in(tmp_path):
    """The default budget a compare or capacity run plots is the middle one by size, and a sweep's plot draws its
    levels in order: named in another order, the same plots (they zig-zagged, or showed another budget)."""
    from pwsim.cmd_run import middle_budget
    from traces.sweep import plot_sweep
    assert middle_budget(["48MiB", "24MiB", "32MiB"]) == middle_budget(["24MiB", "32MiB", "48MiB"]) == "32MiB"
    assert middle_budget(["1GiB", "512MiB"]) == "1GiB"
    rows = [{"max_concurrency": n, "throughput_tokens_per_s": 100.0 * n, "ttft_p50_s": 0.01 * n, "ttft_p99_s": 0.02 * n,
             "tpot_p50_s": 0.001 * n, "tpot_p99_s": None if n == 4 else 0.002 * n} for n in (1, 4, 16)]
    a = plot_sweep(rows, tmp_path / "a.png", "t").read_bytes()
    assert plot_sweep(rows[::-1], tmp_path / "b.png", "t").read_bytes() == a


def test_a_png_names_no_matplotlib_version(tmp_path):
    from traces.clikit import pyplot, write_png
    fig = pyplot().figure()
    assert b"Matplotlib" not in write_png(fig, tmp_path / "p.png").read_bytes()


def test_a_trace_runs_config_holds_no_synthetic_requests_it_never_drew(tmp_path, capsys):
    """config.json of a run on a trace directory keeps the synthetic routing's settings (used where the trace has no
    routing) but not the synthetic requests' (it showed 100 requests at rate 30 for a trace of 96), and still
    reproduces the run."""
    from pwsim.runner import ROUTING_FIELDS
    assert main(["run", "--budget", "24MiB", "--out", str(tmp_path / "r"), "--no-plots", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    config = json.loads((tmp_path / "r" / "config.json").read_text())
    assert set(config["workload"]) == set(ROUTING_FIELDS)
    again = execute(RunConfig.from_json(config))
    assert again.summary["iterations"] == summary["iterations"] and again.summary["requests"] == summary["requests"]


def test_a_concurrency_sweep_keeps_each_levels_slo(tmp_path, capsys):
    """With --slo-ttft, each level's row keeps its attainment and goodput, and the table shows them (they were only
    in the levels' own summaries)."""
    assert main(["run", "--budget", "48MiB", "--max-concurrency", "1,8", "--time-scale", "0", "--slo-ttft", "0.01",
                 "--out", str(tmp_path / "s"), "--no-plots"]) == 0
    text = capsys.readouterr().out
    rows = json.loads((tmp_path / "s" / "summary.json").read_text())["sweep"]
    for row in rows:
        level = json.loads((tmp_path / "s" / f"c{row['max_concurrency']}" / "summary.json").read_text())["slo"]
        assert row["goodput_rps"] == level["goodput_rps"] and row["slo_attainment"] == level["attainment"]
    assert "goodput req/s" in text.splitlines()[0] and rows[0]["goodput_rps"] != rows[1]["goodput_rps"]


def test_a_trace_run_s_config_reads_back_as_the_same_config():
    """Every synthetic routing setting (used where the trace has no routing) survives config.json, and what it leaves
    out (the synthetic requests', their domains among them) reads back as the defaults it had."""
    from pwsim.runner import SyntheticWorkload, make_config
    cfg = make_config("24MiB", workload=SyntheticWorkload(skew=2.0, domain_shift=0.1, drift=0.2, features=False))
    assert RunConfig.from_json(json.loads(json.dumps(cfg.to_json()))) == cfg


def test_a_config_s_json_names_its_budget_and_its_policy_parameters():
    """config.json holds the budget in words beside its bytes and the parameters as a mapping; given in any order
    they read back as the same config (and the same label)."""
    from pwsim.runner import make_config
    cfg = make_config("24MiB", policy_params={"min_plan_blocks": 4, "alpha": 0.5})
    d = cfg.to_json()
    assert d["budget"] == "24.00 MiB" and d["budget_bytes"] == 24 << 20
    assert d["policy_params"] == {"alpha": 0.5, "min_plan_blocks": 4}
    again = RunConfig.from_json({**d, "policy_params": {"min_plan_blocks": 4, "alpha": 0.5}})
    assert again == cfg and again.label == "pagedweight,alpha=0.5,min_plan_blocks=4@24.00 MiB"


def test_a_synthetic_workload_s_specs_carry_each_of_its_settings():
    from pwsim.runner import SyntheticWorkload
    from traces.generators import LengthDist, RoutingSpec
    w, r = SyntheticWorkload(requests=7, rate=3.0, burstiness=2.5, prompt="fixed:48", output="fixed:24",
                             domains=("a", "b"), skew=2.0, domain_shift=0.1, drift=0.2, features=False,
                             token_ids_vocab=50, shared_prefix_tokens=8, prefix_groups=3).specs()
    assert (w.requests, w.rate, w.burstiness, w.domains) == (7, 3.0, 2.5, ("a", "b"))
    assert (w.prompt, w.output) == (LengthDist.parse("fixed:48"), LengthDist.parse("fixed:24"))
    assert (w.token_ids_vocab, w.shared_prefix_tokens, w.prefix_groups) == (50, 8, 3)
    assert r == RoutingSpec(skew=2.0, domain_shift=0.1, drift=0.2, features=False)


def test_a_quality_fit_of_none_in_any_case_turns_the_fit_off():
    from pwsim.runner import make_config
    assert not any(make_config("24MiB", quality_fit=v).uses_quality_fit for v in ("none", "None", "NONE", ""))


def test_a_run_config_gives_the_simulator_every_engine_setting():
    from pwsim.runner import make_config
    cfg = make_config("24MiB", block_size=32, max_num_seqs=8, max_num_batched_tokens=256, allocator_slack_bytes=0,
                      timeline_stride=3, prefix_caching=True, hybrid_kv=False, async_scheduling=True,
                      instant_page_moves=True, lut_room="pool", activation_reserve_bytes=1 << 20, warmup_requests=4,
                      max_concurrency=2)
    s = cfg.sim_config()
    assert (s.budget_bytes, s.block_size, s.max_num_seqs, s.max_num_batched_tokens) == (24 << 20, 32, 8, 256)
    assert s.allocator_slack_bytes == cfg.slack_bytes == 0  # no slack, not the budget's default
    assert (s.timeline_stride, s.prefix_caching, s.hybrid_kv, s.async_scheduling) == (3, True, False, True)
    assert (s.instant_page_moves, s.lut_room, s.activation_bytes) == (True, "pool", 1 << 20)
    assert (s.warmup_requests, s.max_concurrency) == (4, 2)


def test_a_config_records_the_kv_layout_its_model_runs():
    """A model without sliding-window layers keeps one table whatever was asked (a replay of it records
    hybrid_kv_cache false, and fidelity compares the two); one with them keeps the groups unless told not to."""
    from pwsim.runner import make_config
    assert make_config("24MiB").hybrid_kv is False
    assert make_config("20GiB", model="gemma-4-26b-a4b", calibration="synthetic").hybrid_kv is True
    assert make_config("20GiB", model="gemma-4-26b-a4b", calibration="synthetic", hybrid_kv=False).hybrid_kv is False


def test_a_config_refuses_a_client_limit_below_one():
    """As a config.json read back (`pwsim compare`'s workers) or built by a caller: no simulation to fail later."""
    from pwsim.runner import make_config
    from traces.clikit import UserError
    with pytest.raises(UserError, match="--max-concurrency must be >= 1"):
        RunConfig.from_json({**make_config("24MiB").to_json(), "max_concurrency": 0})


def test_a_synthetic_calibration_is_drawn_from_the_run_s_seed():
    from policies.synthetic import synthetic_calibration
    from pwsim.runner import build, make_config
    sims = {seed: build(make_config("48MiB", calibration="synthetic", seed=seed)) for seed in (0, 3)}
    three = synthetic_calibration(sims[3].card, seed=3)
    assert np.array_equal(sims[3].cal.sensitivity, three.sensitivity, equal_nan=True)  # nan: bitwidths it does not hold
    assert not np.array_equal(sims[0].cal.sensitivity, sims[3].cal.sensitivity, equal_nan=True)


def test_a_trace_without_routing_draws_it_from_the_run_s_seed(tmp_path):
    from pwsim.defaults import DEFAULTS
    from pwsim.runner import build_workload, make_config
    (tmp_path / "t").mkdir()
    shutil.copy(f"{DEFAULTS.trace}/requests.parquet", tmp_path / "t" / "requests.parquet")  # no routing.parquet

    def routing(seed: int) -> np.ndarray:
        return build_workload(make_config("24MiB", trace=str(tmp_path / "t"), seed=seed)).routing.p
    assert np.array_equal(routing(7), routing(7)) and not np.array_equal(routing(0), routing(7))


def test_a_result_says_which_hardware_and_calibration_it_ran_on():
    from pwsim.hardware import load_profile
    from pwsim.runner import make_config
    s = execute(make_config("48MiB", hardware="h200-measured", calibration="synthetic")).summary
    note = load_profile("h200-measured").metadata["note"]
    assert s["hardware"] == {"name": "h200-measured", "measured": True, "note": note} and note
    assert s["calibration"] == {"source": "synthetic", "synthetic": True}
    assert execute(make_config("48MiB")).summary["calibration"]["synthetic"] is False  # the bundled, measured one


def test_a_budget_may_take_the_whole_card_and_no_more(tmp_path):
    from dataclasses import replace
    from pwsim.hardware import load_profile
    from pwsim.runner import build, make_config
    from traces.clikit import UserError
    small = replace(load_profile("h200-roofline"), gpu_memory_bytes=48 << 20).save(tmp_path / "small.json")
    assert build(make_config("48MiB", hardware=str(small))).cfg.budget_bytes == 48 << 20
    with pytest.raises(UserError, match="exceeds the"):
        build(make_config("49MiB", hardware=str(small)))
