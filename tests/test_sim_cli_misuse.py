"""`pwsim` under misuse: every user error is one line `error: ...`, exit code 2, no traceback, and no output left
behind (an output directory or file is complete or untouched). Each case here once crashed, exited otherwise, or
left partial output."""
from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest

from pwsim.cli import main
from traces.results import write_result_dir

ROOT = Path(__file__).resolve().parents[1]
BUNDLED = ROOT / "traces" / "bundled"
# the large-model setup of tests/test_sim_cli.py, smaller: a run takes about a second
SMALL = ["--model", "Qwen1.5-MoE-A2.7B", "--calibration", "synthetic", "--trace", "synthetic", "--quality-fit", "none",
         "--requests", "5", "--prompt-dist", "fixed:48", "--output-dist", "fixed:24", "--rate", "200"]
UNWRITABLE = "/proc/pwsim-misuse/out"  # mkdir there fails, as root too
needs_proc = pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux /proc")


def _misuse(capsys, argv: list[str], needle: str) -> str:
    """Run `pwsim argv`: exit code 2, exactly one stderr line naming `needle`, no traceback, nothing on stdout."""
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2, err
    assert "Traceback" not in err and len(lines) == 1, err
    assert lines[0].startswith("pwsim ") and "error:" in lines[0] and needle in lines[0], lines[0]
    assert out == ""
    return lines[0]


def _listing(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir())


# ---------------------------------------------------------------- gen-trace
@pytest.mark.parametrize("flags, needle", [
    (["--requests", "0"], "--requests must be at least 1"),
    (["--seed", "-1"], "--seed must be >= 0"),
    (["--routing-tokens", "-1"], "--routing-tokens must be >= 0"),
    (["--token-ids-vocab", "-5"], "(--token-ids-vocab) must be >= 0"),
    (["--rate", "nan"], "rate and burstiness must be positive and finite"),
    (["--rate", "inf"], "rate and burstiness must be positive and finite"),
    (["--burstiness", "inf"], "rate and burstiness must be positive and finite"),
    (["--skew", "nan"], "got skew nan"),
    (["--prompt-dist", "fixed:inf"], "value must be a finite number"),
    (["--prompt-dist", "uniform:1,inf"], "max must be a finite number"),
    (["--prompt-dist", "uniform:1,1e30"], "max must be a finite number"),
    (["--output-dist", "lognormal:nan,1"], "median must be a finite number"),
])
def test_gen_trace_bad_numbers(tmp_path, capsys, flags, needle):
    _misuse(capsys, ["gen-trace", "--out", tmp_path / "trace", "--requests", "3", *flags], needle)
    assert not (tmp_path / "trace").exists()


def test_gen_trace_out_under_a_file(tmp_path, capsys):
    (tmp_path / "afile").write_text("keep me")
    line = _misuse(capsys, ["gen-trace", "--out", tmp_path / "afile" / "trace", "--requests", "3"], "is a file")
    assert str(tmp_path / "afile") in line and (tmp_path / "afile").read_text() == "keep me"


@needs_proc
def test_gen_trace_unwritable_out(capsys):
    _misuse(capsys, ["gen-trace", "--out", UNWRITABLE, "--requests", "3"], "cannot write in /proc")


# ---------------------------------------------------------------- run
def _corrupt_calibration(tmp_path: Path, how: str) -> Path:
    cal = tmp_path / f"cal-{how}"
    shutil.copytree(BUNDLED / "demo-calibration", cal)
    if how == "truncated-npz":
        data = (cal / "arrays.npz").read_bytes()
        (cal / "arrays.npz").write_bytes(data[: len(data) // 3])
    elif how == "json-list":
        (cal / "calibration.json").write_text("[1, 2]")
    elif how == "npz-missing-array":
        np.savez(cal / "arrays.npz", unrelated=np.zeros(3))
    elif how == "random-bytes":
        (cal / "arrays.npz").write_bytes(np.random.default_rng(0).bytes(1000))
    elif how == "object-array":
        np.savez(cal / "arrays.npz", sensitivity=np.array([{"a": 1}], dtype=object))
    return cal


@pytest.mark.parametrize("how", ["truncated-npz", "json-list", "npz-missing-array", "random-bytes", "object-array"])
def test_run_corrupt_calibration(tmp_path, capsys, how):
    cal = _corrupt_calibration(tmp_path, how)
    line = _misuse(capsys, ["run", "--budget", "32MiB", "--calibration", cal, "--out", tmp_path / "run"],
                   "is corrupt or incomplete")
    assert "pickle" not in line and "unsafe" not in line
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("how", ["truncated-npz", "npz-missing-array", "random-bytes", "object-array"])
def test_a_corrupt_calibration_archive_is_a_calibration_error(tmp_path, how):
    """What `pwruntime` (generate, quality-table, bench decode) prints as a user error: one naming the file and the
    way to make it again, never numpy's advice to unpickle it."""
    from policies.calibration import Calibration, CalibrationError
    cal = _corrupt_calibration(tmp_path, how)
    with pytest.raises(CalibrationError, match="re-run `pwruntime calibrate`") as e:
        Calibration.load(cal)
    assert str(cal / "arrays.npz") in str(e.value) and "pickle" not in str(e.value)


@pytest.mark.parametrize("flags, needle", [
    (["--budget", "1e400"], "is not a finite number of bytes"),
    (["--calibration", "synthetic:abc"], "the seed after 'synthetic:' must be an integer >= 0"),
    (["--calibration", "synthetic:-1"], "the seed after 'synthetic:' must be an integer >= 0"),
    (["--seed", "-1"], "--seed must be >= 0"),
    (["--warmup-requests", "-1"], "--warmup-requests must be >= 0"),
    (["--max-concurrency", "0"], "--max-concurrency must be an integer >= 1"),
    (["--max-concurrency", "4,4"], "a list of distinct ones"),
    (["--rate", "nan"], "rate and burstiness must be positive and finite"),
    (["--prompt-dist", "fixed:inf"], "--prompt-dist: length distribution"),
    (["--prefill-chunk", "0"], "--prefill-chunk: size '0' must be positive"),
    (["--prefill-chunk", "1x"], "--prefill-chunk: cannot read size '1x'"),
])
def test_run_bad_values(tmp_path, capsys, flags, needle):
    _misuse(capsys, ["run", *SMALL, "--budget", "20GiB", *flags, "--out", tmp_path / "run"], needle)
    assert not (tmp_path / "run").exists()


def test_run_bad_input_files(tmp_path, capsys):
    out = tmp_path / "run"
    _misuse(capsys, ["run", *SMALL, "--budget", "20GiB", "--quality-fit", tmp_path, "--out", out], "is a directory")
    one = tmp_path / "one-point.json"
    one.write_text(json.dumps({"points": [{"damage": 1.0, "ppl": 2.0}]}))
    line = _misuse(capsys, ["run", *SMALL, "--budget", "20GiB", "--quality-fit", one, "--out", out], "two points")
    assert str(one) in line
    binary = tmp_path / "profile.json"
    binary.write_bytes(b"\xff\xfe\x00")
    _misuse(capsys, ["run", *SMALL, "--budget", "20GiB", "--hardware", binary, "--out", out], "not valid JSON")
    card = json.loads((ROOT / "traces" / "cards" / "qwen1.5-moe-a2.7b.json").read_text())
    card = {k: v for k, v in card.items() if k not in ("hf_config", "notes")}
    bad_card = tmp_path / "card.json"
    bad_card.write_text(json.dumps({**card, "dense_layers": "abc"}))
    line = _misuse(capsys, ["run", *SMALL, "--budget", "20GiB", "--model", bad_card, "--out", out], "invalid literal")
    assert str(bad_card) in line
    assert not out.exists()


def test_run_names_a_hardware_profile_that_is_a_directory(tmp_path, capsys):
    _misuse(capsys, ["run", *SMALL, "--budget", "20GiB", "--hardware", tmp_path, "--out", tmp_path / "run"],
            "is a directory, not a JSON file")
    assert not (tmp_path / "run").exists()


def test_run_refuses_an_empty_out(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # where the default --out would go
    _misuse(capsys, ["run", *SMALL, "--budget", "20GiB", "--out", ""], "--out is empty")
    assert _listing(tmp_path) == []


@pytest.mark.parametrize("command, flags, needle", [
    ("run", ["--requests", "5"], "--requests: only a synthetic trace (--trace synthetic) takes it"),
    ("run", ["--rate", "3", "--domains", "a,b"], "--rate, --domains: only a synthetic trace"),
    ("run", ["--token-ids-vocab", "9", "--prefix-groups", "2"], "--token-ids-vocab, --prefix-groups: only a synth"),
    ("run", ["--burstiness", "2"], "--burstiness shapes the gaps of --request-rate's arrivals"),
    ("compare", ["--output-dist", "fixed:8"], "--output-dist: only a synthetic trace"),
    ("capacity", ["--slo-ttft", "1", "--prompt-dist", "fixed:8"], "--prompt-dist: only a synthetic trace"),
])
def test_a_trace_directory_refuses_the_synthetic_trace_s_flags(tmp_path, capsys, command, flags, needle):
    _misuse(capsys, [command, "--trace", BUNDLED / "demo-trace", *flags, "--out", tmp_path / "out"], needle)
    assert not (tmp_path / "out").exists()


def _fake_replay(path: Path, **config) -> Path:
    """A `pwruntime replay --record-routing` result as `--like-replay` reads it: the demo trace as what it served."""
    path.mkdir()
    shutil.copytree(BUNDLED / "demo-trace", path / "trace")
    (path / "config.json").write_text(json.dumps({"command": "replay", "gpu_memory_budget": "32MiB",
                                                  "policy": "pagedweight", "policy_arg": [], "seed": 0, **config}))
    (path / "summary.json").write_text(json.dumps({"device": "cuda"}))
    return path


@pytest.mark.parametrize("flags, needle", [
    (["--budget", "48MiB"], "takes --budget from the replay; leave it out"),
    (["--policy", "fp16", "--seed", "3"], "takes --policy, --seed from the replay; leave them out"),
    (["--trace", "synthetic", "--max-num-seqs", "8"], "takes --trace, --max-num-seqs from the replay"),
    (["--requests", "4"], "--requests: only a synthetic trace"),
])
def test_like_replay_refuses_the_flags_the_replay_sets(tmp_path, capsys, flags, needle):
    replay = _fake_replay(tmp_path / "replay", max_num_seqs=32)
    _misuse(capsys, ["run", "--like-replay", replay, *flags, "--out", tmp_path / "run"], needle)
    assert not (tmp_path / "run").exists()


def test_like_replay_takes_a_flag_the_replay_did_not_record(tmp_path, capsys):
    """A setting an older replay did not record (here the calibration) stays the flag's: nothing is refused."""
    replay = _fake_replay(tmp_path / "replay")
    assert main(["run", "--like-replay", str(replay), "--max-num-seqs", "8", "--no-plots", "--no-progress", "--json",
                 "--out", str(tmp_path / "run")]) == 0
    capsys.readouterr()
    assert json.loads((tmp_path / "run" / "config.json").read_text())["max_num_seqs"] == 8


@pytest.mark.parametrize("recorded, kept", [({"activation_reserve": 1 << 20, "serving_reserve": 512 << 10}, 3 << 19),
                                            ({"activation_reserve": 1 << 20}, 1 << 20),   # a replay before session 62
                                            ({"serving_reserve": 512 << 10}, 512 << 10)])
def test_like_replay_keeps_out_the_replay_s_activation_and_serving_reserves_together(tmp_path, capsys, recorded,
                                                                                     kept):
    """The simulator has no CUDA graphs or runner buffers: what the replay kept out of its pool for them joins what it
    kept for a step's activations, and the simulation keeps their sum out of its own (`--activation-reserve`)."""
    replay = _fake_replay(tmp_path / "replay", **recorded)
    assert main(["run", "--like-replay", str(replay), "--no-plots", "--no-progress",
                 "--out", str(tmp_path / "run")]) == 0
    assert f"--activation-reserve {kept}" in capsys.readouterr().out
    assert json.loads((tmp_path / "run" / "config.json").read_text())["activation_reserve_bytes"] == kept


@pytest.mark.parametrize("recorded, taken", [(2 << 30, 2 << 30), (None, 1 << 30)])
def test_like_replay_chunks_prefill_experts_as_the_replay_did(tmp_path, capsys, recorded, taken):
    """The replay's `prefill_chunk_bytes` (None: a store without AP experts) is the simulation's --prefill-chunk,
    which sets how many chunks the cost model's prefill layers take."""
    replay = _fake_replay(tmp_path / "replay", prefill_chunk_bytes=recorded)
    assert main(["run", "--like-replay", str(replay), "--no-plots", "--no-progress",
                 "--out", str(tmp_path / "run")]) == 0
    assert (f"--prefill-chunk {recorded}" in capsys.readouterr().out) == (recorded is not None)
    assert json.loads((tmp_path / "run" / "config.json").read_text())["prefill_chunk_bytes"] == taken


def test_run_trace_without_requests(tmp_path, capsys):
    from traces.generators import WorkloadSpec, generate_requests
    from traces.io import Trace, write_trace_dir
    write_trace_dir(tmp_path / "trace", Trace(generate_requests(WorkloadSpec(requests=0), 0)))
    _misuse(capsys, ["run", "--budget", "32MiB", "--trace", tmp_path / "trace", "--out", tmp_path / "run"],
            "holds no requests")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("where", ["under-a-file", pytest.param("proc", marks=needs_proc)])
def test_run_unwritable_out_fails_before_simulating(tmp_path, capsys, where):
    (tmp_path / "afile").write_text("keep me")
    out = tmp_path / "afile" / "run" if where == "under-a-file" else Path(UNWRITABLE)
    _misuse(capsys, ["run", *SMALL, "--budget", "20GiB", "--out", out],
            "is a file, not a directory" if where == "under-a-file" else "cannot write in /proc")
    assert (tmp_path / "afile").read_text() == "keep me"


# ---------------------------------------------------------------- compare
def test_compare_out_that_is_a_file(tmp_path, capsys):
    out = tmp_path / "out"
    out.write_text("keep me")
    _misuse(capsys, ["compare", *SMALL, "--policies", "uniform-4", "--budgets", "20GiB", "--no-progress",
                     "--out", out], "is a file; give a directory")
    assert out.read_text() == "keep me"


@needs_proc
def test_compare_unwritable_out(capsys):
    _misuse(capsys, ["compare", *SMALL, "--policies", "uniform-4", "--budgets", "20GiB", "--no-progress",
                     "--out", UNWRITABLE], "cannot write in /proc")


@pytest.mark.parametrize("flags, needle", [
    (["--jobs", "0"], "--jobs must be at least 1"),
    (["--jobs", "-2"], "--jobs must be at least 1"),
    (["--budgets", "20GiB,30GiB", "--timeline-budget", "40GiB"], "is not one of --budgets"),
    (["--budgets", "30GiB,2000GiB"], "exceeds"),  # fails in the second run, after the first finished
    (["--rate", "nan", "--jobs", "2"], "rate and burstiness must be positive and finite"),
    (["--seed", "-1"], "--seed must be >= 0"),
    (["--calibration", "synthetic:x"], "the seed after 'synthetic:'"),
])
def test_compare_misuse_leaves_no_output_directory(tmp_path, capsys, flags, needle):
    budgets = [] if "--budgets" in flags else ["--budgets", "20GiB"]
    _misuse(capsys, ["compare", *SMALL, "--policies", "uniform-4,pagedweight", *budgets, "--no-progress",
                     *flags, "--out", tmp_path / "cmp"], needle)
    assert not (tmp_path / "cmp").exists()


@pytest.mark.parametrize("flags, needle", [
    (["--budgets", "24GiB,24GiB"], "--budgets: a value is given twice (24GiB,24GiB)"),
    (["--budgets", "24GiB,24576MiB"], "--budgets: a value is given twice"),  # the same bytes
    (["--policies", "uniform-4,uniform-4"], "--policies: a value is given twice"),
])
def test_compare_refuses_duplicate_runs(tmp_path, capsys, flags, needle):
    policies = [] if "--policies" in flags else ["--policies", "uniform-4"]
    budgets = [] if "--budgets" in flags else ["--budgets", "20GiB"]
    _misuse(capsys, ["compare", *SMALL, *policies, *budgets, *flags, "--no-progress", "--out", tmp_path / "cmp"],
            needle)
    assert not (tmp_path / "cmp").exists()


def test_compare_failing_while_writing_keeps_a_previous_result_as_it_was(tmp_path, capsys, monkeypatch):
    from pwsim import plots
    out = tmp_path / "cmp"
    out.mkdir()
    (out / "compare.csv").write_text("old")
    (out / "compare.json").write_text("{}")  # a previous result, which compare may replace

    def broken(*args, **kwargs):
        raise RuntimeError("the last plot fails")

    monkeypatch.setattr(plots, "compare_timelines", broken)
    with pytest.raises(RuntimeError, match="the last plot fails"):  # not a user error: it keeps its traceback
        main(["compare", *SMALL, "--policies", "uniform-4", "--budgets", "30GiB", "--jobs", "1", "--no-progress",
              "--out", str(out)])
    assert _listing(out) == ["compare.csv", "compare.json"] and (out / "compare.csv").read_text() == "old"


def test_write_files_is_all_or_nothing(tmp_path):
    from pwsim.output import write_files
    out = tmp_path / "out"
    out.mkdir()
    (out / "a.txt").write_text("old a")

    def fail(path: Path) -> None:
        raise RuntimeError("plot failed")

    with pytest.raises(RuntimeError):
        write_files(out, {"a.txt": lambda p: p.write_text("new a"), "b.png": fail})
    assert _listing(out) == ["a.txt"] and (out / "a.txt").read_text() == "old a"
    with pytest.raises(RuntimeError):
        write_files(tmp_path / "new", {"a.txt": lambda p: p.write_text("a"), "b.png": fail})
    assert not (tmp_path / "new").exists()
    write_files(out, {"a.txt": lambda p: p.write_text("new a"), "b.png": lambda p: p.write_text("b")})
    assert _listing(out) == ["a.txt", "b.png"] and (out / "a.txt").read_text() == "new a"


# ---------------------------------------------------------------- what --out may hold
def _fake_result(path: Path, config: dict | None) -> Path:
    """A result directory as `tool` wrote it, told apart by its config.json (`traces.results.result_tool`)."""
    requests = {"request_id": np.arange(2), "ttft_s": np.ones(2), "tpot_s": np.ones(2), "e2e_s": np.ones(2)}
    return write_result_dir(path, {"requests": requests},
                            {"summary": {"requests": 2}, **({} if config is None else {"config": config})})


REPLAY_CONFIG = {"command": "replay", "gpu_memory_budget": "32MiB"}
SERVE_CONFIG = {"command": "bench", "target": "serve"}
SIM_CONFIG = {"budget_bytes": 1 << 30, "hardware": "h200-roofline"}


def test_run_refuses_to_replace_a_replay(tmp_path, capsys):
    replay = _fake_result(tmp_path / "replay", REPLAY_CONFIG)
    before = {p.name: p.read_bytes() for p in replay.iterdir()}
    _misuse(capsys, ["run", *SMALL, "--budget", "20GiB", "--out", replay],
            "holds a `pwruntime replay` result, not a `pwsim run` one; choose another directory or pass --force")
    assert {p.name: p.read_bytes() for p in replay.iterdir()} == before


@pytest.mark.parametrize("config, tool, refused", [
    (SIM_CONFIG, "replay", "`pwsim run`"), (SIM_CONFIG, "bench serve", "`pwsim run`"),
    (SERVE_CONFIG, "replay", "`pwruntime bench serve`"), (REPLAY_CONFIG, "bench serve", "`pwruntime replay`"),
    (REPLAY_CONFIG, "replay", None), (SIM_CONFIG, "pwsim", None),
    (None, "replay", None), ({"hardware": "h200-roofline"}, "replay", None),  # results that do not say: as before
])
def test_a_result_directory_is_replaced_only_by_its_own_tool(tmp_path, config, tool, refused):
    from traces.clikit import UserError
    from traces.results import prepare_dir
    out = _fake_result(tmp_path / "out", config)
    if refused is None:
        assert prepare_dir(out, False, tool) == out
    else:
        with pytest.raises(UserError, match=f"holds a {refused} result"):
            prepare_dir(out, False, tool)
    assert prepare_dir(out, True, tool) == out  # --force


def test_a_run_does_not_replace_a_result_holding_files_of_ones_own(tmp_path, capsys):
    """A run's result replaces its directory whole: one holding a file no result writes (a note beside a previous
    run, in it or a folder below) is refused without --force, and left as it was (it was deleted)."""
    for where in ("notes.txt", "c1/notes.txt"):
        out = _fake_result(tmp_path / where.replace("/", "_"), SIM_CONFIG)
        (out / where).parent.mkdir(exist_ok=True)
        (out / where).write_text("keep me")
        before = _listing(out)
        _misuse(capsys, ["run", *SMALL, "--budget", "20GiB", "--out", out],
                f"holds a previous result and also {out / where}, which a result does not")
        assert _listing(out) == before
    assert main(["run", *SMALL, "--budget", "20GiB", "--out", str(out), "--force", "--json"]) == 0
    assert not (out / "c1").exists()
    capsys.readouterr()


@pytest.mark.parametrize("command, argv, marker", [
    ("compare", [*SMALL, "--policies", "uniform-4", "--budgets", "20GiB", "--no-progress"], "compare.json"),
    ("capacity", [*SMALL, "--policies", "uniform-4", "--budgets", "20GiB", "--slo-ttft", "1", "--no-progress"],
     "capacity.json"),
    ("fidelity", ["--sim", "{sim}", "--runtime", "{rt}"], "fidelity.json"),
    ("prefill-fit", [], "prefill_fit.json"),
])
@pytest.mark.parametrize("holding", ["unrelated", "a run"])
def test_reports_refuse_a_directory_that_holds_something_else(tmp_path, capsys, command, argv, marker, holding):
    sim, rt = _result(tmp_path / "sim"), _fake_result(tmp_path / "rt", REPLAY_CONFIG)
    argv = [str(a).format(sim=sim, rt=rt) for a in argv]
    if holding == "unrelated":
        out = tmp_path / "mine"
        out.mkdir()
        (out / "notes.txt").write_text("keep me")
    else:
        out = _fake_result(tmp_path / "run", SIM_CONFIG)
    before = _listing(out)
    _misuse(capsys, [command, *argv, "--out", out],
            f"--out {out} is not empty and holds no previous `pwsim {command}` result; choose another directory or "
            "pass --force")
    assert _listing(out) == before
    (out / marker).write_text("{}")  # a previous result of the command: replaced without --force
    assert main([command, *argv, "--out", str(out), "--json"]) == 0
    capsys.readouterr()


# ---------------------------------------------------------------- fidelity
def _result(path: Path, hardware: str = "h200-roofline") -> Path:
    tokens = np.array([1, 2, 4, 8])
    requests = {"request_id": np.array([1, 2]), "ttft_s": np.array([0.1, 0.2]), "tpot_s": np.array([0.01, 0.02]),
                "e2e_s": np.array([1.0, 2.0])}
    timeline = {"iter_s": 0.001 + 1e-4 * tokens, "batch_tokens": tokens}
    return write_result_dir(path, {"requests": requests, "timeline": timeline},
                            {"summary": {"throughput_tokens_per_s": 100.0, "makespan_s": 2.0},
                             "config": {"hardware": hardware}})


def _break(run: Path, how: str) -> None:
    import pyarrow.parquet as pq
    if how == "empty-summary":
        (run / "summary.json").write_text("")
    elif how == "summary-list":
        (run / "summary.json").write_text("[1]")
    elif how == "junk-requests":
        (run / "requests.parquet").write_bytes(b"junk")
    elif how == "junk-timeline":
        (run / "timeline.parquet").write_bytes(b"junk")
    elif how == "junk-config":
        (run / "config.json").write_text("{")
    elif how == "no-ttft":
        pq.write_table(pq.read_table(run / "requests.parquet").drop(["ttft_s"]), run / "requests.parquet")
    elif how == "no-request-id":
        pq.write_table(pq.read_table(run / "requests.parquet").drop(["request_id"]), run / "requests.parquet")


@pytest.mark.parametrize("how, needle", [
    ("empty-summary", "summary.json is not readable JSON"), ("summary-list", "summary.json is not a JSON object"),
    ("junk-requests", "requests.parquet is not a readable Parquet file"),
    ("junk-timeline", "timeline.parquet is not a readable Parquet file"),
    ("junk-config", "config.json is not readable JSON"), ("no-ttft", "lacks column(s) ttft_s"),
    ("no-request-id", "lacks column(s) request_id"),
])
def test_fidelity_corrupt_result_directory(tmp_path, capsys, how, needle):
    sim, rt = _result(tmp_path / "sim"), _result(tmp_path / "rt")
    _break(sim, how)
    line = _misuse(capsys, ["fidelity", "--sim", sim, "--runtime", rt, "--out", tmp_path / "fid"], needle)
    assert f"--sim {sim}" in line
    assert not (tmp_path / "fid").exists()


@pytest.mark.parametrize("where", ["directory", "under-a-file", pytest.param("proc", marks=needs_proc)])
def test_fidelity_bad_fit_profile_writes_no_report(tmp_path, capsys, where):
    sim, rt = _result(tmp_path / "sim"), _result(tmp_path / "rt")
    (tmp_path / "afile").write_text("keep me")
    (tmp_path / "adir").mkdir()
    fit, needle = {"directory": (tmp_path / "adir", "is a directory; give a file name"),
                   "under-a-file": (tmp_path / "afile" / "fit.json", "is a file, not a directory"),
                   "proc": (Path(UNWRITABLE), "cannot write in /proc")}[where]
    _misuse(capsys, ["fidelity", "--sim", sim, "--runtime", rt, "--out", tmp_path / "fid", "--fit-profile", fit],
            f"--fit-profile {fit}")
    assert not (tmp_path / "fid").exists() and _listing(tmp_path / "adir") == []


@needs_proc
def test_fidelity_unwritable_out(tmp_path, capsys):
    sim, rt = _result(tmp_path / "sim"), _result(tmp_path / "rt")
    _misuse(capsys, ["fidelity", "--sim", sim, "--runtime", rt, "--out", UNWRITABLE], "cannot write in /proc")


@pytest.mark.parametrize("sim, runtime, needle", [
    ("rt", "sim", "--sim {rt} is a `pwruntime replay` result"),
    ("sim", "sim2", "--runtime {sim2} is a `pwsim run` result"),
    ("served", "rt", "--sim {served} is a `pwruntime bench serve` result"),
    ("plain", "plain", "--sim and --runtime are the same directory {plain}"),
])
def test_fidelity_refuses_swapped_or_equal_sides(tmp_path, capsys, sim, runtime, needle):
    paths = {"sim": _fake_result(tmp_path / "sim", SIM_CONFIG), "sim2": _fake_result(tmp_path / "sim2", SIM_CONFIG),
             "rt": _fake_result(tmp_path / "rt", REPLAY_CONFIG), "served": _fake_result(tmp_path / "sv", SERVE_CONFIG),
             "plain": _result(tmp_path / "plain")}
    line = _misuse(capsys, ["fidelity", "--sim", paths[sim], "--runtime", paths[runtime], "--out", tmp_path / "fid"],
                   needle.format(**paths))
    assert "give --sim the --out of a `pwsim run` and --runtime that of a `pwruntime replay`" in line
    assert not (tmp_path / "fid").exists()


# ---------------------------------------------------------------- chrome-trace, plan-log
def test_chrome_trace_on_a_full_disk_writes_nothing(tmp_path, capsys, monkeypatch):
    import errno

    from traces import clikit

    def full(path):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr("traces.chrome_trace.chrome_trace", lambda paths, labels: {"traceEvents": []})
    monkeypatch.setattr(clikit, "default_mode", full)  # the atomic write's last step before its rename
    out = tmp_path / "trace.json"
    _misuse(capsys, ["chrome-trace", _result(tmp_path / "sim"), "--out", out],
            f"--out {out}: cannot write it ({os.strerror(errno.ENOSPC)}); nothing was written")
    assert _listing(tmp_path) == ["sim"]


def test_chrome_trace_of_a_directory_that_does_not_exist(tmp_path, capsys):
    _misuse(capsys, ["chrome-trace", tmp_path / "nowhere", "--out", tmp_path / "t.json"],
            f"{tmp_path / 'nowhere'} does not exist")
    assert _listing(tmp_path) == []


def test_plan_log_plot_must_be_a_png(tmp_path, capsys):
    _misuse(capsys, ["plan-log", _result(tmp_path / "sim"), "--plot", tmp_path / "moves.pdf"],
            "give a file name ending in .png")
    assert _listing(tmp_path) == ["sim"]


# ---------------------------------------------------------------- capacity
@pytest.mark.parametrize("flags, needle", [
    (["--slo-tpot", "50", "--attainment", "0.9", "--percentile", "90"], "--percentile and --attainment are two ways"),
    (["--slo-tpot", "50", "--attainment", "0.9", "--percentile", "99"], "--percentile and --attainment are two ways"),
    (["--slo-tpot", "-5"], "the TPOT bound must be a number > 0, got -5 ms"),
])
def test_capacity_slo_misuse(tmp_path, capsys, flags, needle):
    _misuse(capsys, ["capacity", *flags, "--out", tmp_path / "cap"], needle)
    assert not (tmp_path / "cap").exists()


# ---------------------------------------------------------------- prefill-fit
def test_prefill_fit_bad_fit_profile_writes_no_report(tmp_path, capsys):
    (tmp_path / "adir").mkdir()
    _misuse(capsys, ["prefill-fit", "--out", tmp_path / "pf", "--fit-profile", tmp_path / "adir"],
            "is a directory; give a file name")
    assert not (tmp_path / "pf").exists()


@needs_proc
def test_prefill_fit_unwritable_paths(tmp_path, capsys):
    _misuse(capsys, ["prefill-fit", "--out", UNWRITABLE], "cannot write in /proc")
    _misuse(capsys, ["prefill-fit", "--out", tmp_path / "pf", "--fit-profile", UNWRITABLE], "--fit-profile")
    assert not (tmp_path / "pf").exists()


def test_prefill_fit_bench_that_is_a_directory(tmp_path, capsys):
    _misuse(capsys, ["prefill-fit", "--bench", tmp_path, "--out", tmp_path / "pf"], "is a directory")
    assert not (tmp_path / "pf").exists()


# ---------------------------------------------------------------- bench
@pytest.mark.parametrize("flags, needle", [
    (["--models", ","], "--models needs at least one card name"),
    (["--warmup", "-1"], "--warmup must be at least 0"),
    (["--max-batch", "0"], "--max-batch must be at least 1"),
    (["--seed", "-1"], "--seed must be at least 0"),
    (["--initial-mean-bits", "nan"], "--initial-mean-bits must be a finite number"),
    (["--initial-mean-bits", "100"], "--initial-mean-bits must be a finite number from 3 to 8"),
    (["--initial-mean-bits", "0"], "--initial-mean-bits must be a finite number from 3 to 8"),
    (["--out", "{tmp}"], "is a directory; give a file name"),
    (["--out", "{tmp}/afile/bench.json"], "is a file, not a directory"),
])
def test_bench_planner_misuse(tmp_path, capsys, flags, needle):
    (tmp_path / "afile").write_text("keep me")
    flags = [f.replace("{tmp}", str(tmp_path)) for f in flags]
    _misuse(capsys, ["bench", "planner", "--models", "PagedWeight-demo", "--steps", "8", "--no-pin", "--no-progress",
                     *flags], needle)


@pytest.mark.parametrize("flags, needle", [
    (["--budget", "1e400"], "is not a finite number of bytes"),
    (["--seed", "-1"], "--seed must be >= 0"),
    (["--out", "{tmp}"], "is a directory; give a file name"),
    (["--rate", "nan"], "rate and burstiness must be positive and finite"),  # raised in the worker process
    (["--requests", "0"], "--requests must be positive, got 0"),
])
def test_bench_sim_misuse(tmp_path, capsys, flags, needle):
    flags = [f.replace("{tmp}", str(tmp_path)) for f in flags]
    _misuse(capsys, ["bench", "sim", "--requests", "3", "--output-dist", "fixed:8", "--no-pin", *flags], needle)


@needs_proc
def test_bench_unwritable_out(capsys):
    _misuse(capsys, ["bench", "planner", "--models", "PagedWeight-demo", "--steps", "8", "--no-pin", "--no-progress",
                     "--out", UNWRITABLE + ".json"], "cannot write in /proc")


# ---------------------------------------------------------------- the pieces underneath
def test_trace_errors_survive_a_worker_process():
    from traces.schema import TraceError
    e = TraceError("trace/requests.parquet", "arrival time nan must be finite", column="arrival_s", row=3, fix="fix it")
    again = pickle.loads(pickle.dumps(e))
    assert type(again) is TraceError and str(again) == str(e) and again.row == 3


def test_sizes_and_distributions_refuse_non_finite_values():
    from pwsim.hardware import parse_size
    from traces.clikit import UserError
    from traces.generators import LengthDist, RoutingSpec
    for bad in ("1e400", "1e300TiB"):
        with pytest.raises(UserError, match="not a finite number of bytes"):
            parse_size(bad)
    for spec in ("fixed:inf", "uniform:1,1e30", "lognormal:nan,1", "zipf:inf"):
        with pytest.raises(UserError, match="finite number"):
            LengthDist.parse(spec)
    for kw in ({"skew": float("nan")}, {"drift": float("inf")}, {"tokens_per_request": -1}):
        with pytest.raises(UserError):
            RoutingSpec(**kw)


def test_compare_with_no_feasible_run_is_one_clear_error(tmp_path, capsys):
    """Every budget below the weights: one error naming why, and no empty table, plots or files."""
    out = tmp_path / "cmp"
    assert main(["compare", "--budgets", "1KiB,2KiB", "--out", str(out), "--no-progress", "--jobs", "1"]) == 2
    err = capsys.readouterr().err
    assert "no run is feasible at --budgets 1KiB,2KiB" in err and "weights" in err and "Traceback" not in err
    assert not out.exists()


def test_a_reader_that_leaves_ends_the_command_quietly():
    """`pwsim models | head -1`: once the reader closes the pipe, the command stops with 141 and no traceback."""
    import subprocess
    import sys
    proc = subprocess.Popen([sys.executable, "-m", "pwsim.cli", "models"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    proc.stdout.close()  # the reader is gone before the first line
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 141 and "Traceback" not in err, err


def test_run_calibration_that_is_a_file(tmp_path, capsys):
    cal = tmp_path / "cal.json"
    cal.write_text("{}")
    _misuse(capsys, ["run", "--budget", "32MiB", "--calibration", cal, "--out", tmp_path / "run"],
            "is not a directory")
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------- argparse's own errors
@pytest.mark.parametrize("argv, head, needle", [
    (["run", "--nosuch", "1"], "pwsim run: error:", "unrecognized arguments: --nosuch 1"),
    (["bench", "planner", "--nosuch"], "pwsim bench planner: error:", "unrecognized arguments: --nosuch"),
    (["compare", "--budgets"], "pwsim compare: error:", "--budgets: expected one argument"),
    (["nosuch"], "pwsim: error:", "invalid choice: 'nosuch'"),
])
def test_argparse_errors_are_one_line_naming_the_command_and_its_help(capsys, argv, head, needle):
    """Usage errors name the (sub)command they belong to, not the top-level parser, in one line with where its
    options are listed; before, a flag the command did not know was reported as `pwsim: error:` under the usage of
    `pwsim` itself, and every other usage error printed the command's whole usage first."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    out, err = capsys.readouterr()
    assert exc.value.code == 2 and out == ""
    lines = err.splitlines()
    prog = head.split(": error:")[0]
    assert len(lines) == 1 and lines[0].startswith(head) and needle in lines[0], err
    assert lines[0].endswith(f"(see `{prog} --help`)"), err


@pytest.mark.parametrize("flag", ["--requests", "--block-size", "--max-num-seqs", "--max-num-batched-tokens",
                                  "--timeline-stride"])
def test_run_names_the_one_count_that_is_not_positive(tmp_path, capsys, flag):
    """The error names the flag given 0 and its value; it used to list all five flags whichever was wrong."""
    line = _misuse(capsys, ["run", *SMALL, flag, "0", "--out", tmp_path / "o"], f"{flag} must be positive, got 0")
    others = {"--requests", "--block-size", "--max-num-seqs", "--max-num-batched-tokens", "--timeline-stride"} - {flag}
    assert not any(f"{o} " in line or line.endswith(o) for o in others), line
    assert not (tmp_path / "o").exists()
