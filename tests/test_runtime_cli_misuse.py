"""`pwruntime` misuse on a CPU-only machine: one `error:` line, exit 2, no traceback, no output left behind.

Each case here printed a traceback, exited 1, named the wrong flag or fix, or wrote (or destroyed) output
before the fix it guards.
"""
from __future__ import annotations

import errno
import json
import shutil
import socket
from pathlib import Path

import pytest

from demo_fixtures import write_corpus
from model_fixtures import make_text, make_tiny_checkpoint
from pwruntime.cli import main

DEMO_TRACE = Path(__file__).resolve().parent.parent / "traces" / "bundled" / "demo-trace"


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """A tiny checkpoint, its AP checkpoint, a text file and a plain file, shared by the module."""
    from pwruntime.quant.build import QuantizeOptions, quantize_checkpoint

    root = tmp_path_factory.mktemp("misuse")
    ckpt = make_tiny_checkpoint(root, "qwen2_moe", seed=5)
    ap = root / "ap"
    quantize_checkpoint(ckpt, ap, QuantizeOptions(), progress=False)
    text = root / "text.txt"
    text.write_text(make_text(400, seed=1))
    plain = root / "plain.txt"
    plain.write_text("keep me\n")
    return {"root": root, "ckpt": str(ckpt), "ap": str(ap), "text": str(text), "plain": plain}


def misuse(capsys, argv, *needles) -> str:
    """Run the CLI; assert exit 2 with one error line that contains every needle; return it."""
    capsys.readouterr()
    rc = main([str(a) for a in argv])
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    for needle in needles:
        assert needle in err, err
    return err


def entries(d: Path) -> set[str]:
    return {p.name for p in d.iterdir()}


# -------------------------------------------------------------------------------------------- every command
@pytest.mark.parametrize("argv", [
    ["generate", "--prompt", "ba"],                                                   # accepted
    ["replay", "--trace", DEMO_TRACE, "--out", "OUT"],                                # accepted
    ["quantize", "--model", "CKPT", "--out", "OUT", "--weighting", "none"],          # accepted
    ["calibrate", "--model", "CKPT", "--ap", "AP", "--data", "TEXT", "--out", "OUT"],  # ValueError traceback
    ["record-trace", "--data", "a=TEXT", "--out", "OUT"],                             # ValueError traceback
    ["bench", "plans"],
    ["demo", "train", "--corpus", "TEXT", "--out", "OUT"],
])
def test_negative_seed_is_refused(env, capsys, tmp_path, argv):
    subs = {"CKPT": env["ckpt"], "AP": env["ap"], "TEXT": env["text"], "a=TEXT": f"a={env['text']}",
            "OUT": tmp_path / "out"}
    misuse(capsys, [*(subs.get(a, a) for a in argv), "--seed", "-1"], "--seed must be >= 0, got -1")
    assert entries(tmp_path) == set()


# ----------------------------------------------------------------------------------------- generate / serve
def test_generate_planner_without_calibration_is_a_user_error(env, capsys):
    # PolicyError from the planner's reset used to escape as a traceback (exit 1)
    misuse(capsys, ["generate", "--ap", env["ap"], "--policy", "pagedweight", "--prompt", "ba", "--max-tokens", "1"],
           "needs a calibration", "--calibration")


@pytest.mark.parametrize("extra, needles", [
    (["--policy", "uniform-4"], ["--policy uniform-4 needs --ap"]),      # was: ran, the planner moving nothing
    (["--ap", "AP"], ["--model or --ap, not both"]),                      # was: --model silently ignored
    (["--max-model-len", "1"], ["--max-model-len", "must be in 2.."]),
    (["--plane-arena"], ["--plane-arena keeps AP expert planes", "--ap DIR"]),
    (["--prefill-chunk", "2GiB"], ["--prefill-chunk sizes the dequantized AP experts", "--ap DIR"]),
])
def test_generate_incompatible_model_options(env, capsys, extra, needles):
    extra = [env["ap"] if a == "AP" else a for a in extra]
    misuse(capsys, ["generate", "--model", env["ckpt"], *extra, "--prompt", "ba", "--max-tokens", "1"], *needles)


def test_lut_room_pool_without_ap_is_a_user_error(env, capsys):
    # was ignored: --model's full-precision experts never offload
    misuse(capsys, ["generate", "--model", env["ckpt"], "--lut-room", "pool", "--prompt", "ba", "--max-tokens", "1"],
           "--lut-room pool", "--ap DIR")


def test_corrupt_ap_expert_file_names_it(env, capsys, tmp_path):
    # was: SafetensorError "Error while deserializing header" traceback
    ap = tmp_path / "ap"
    shutil.copytree(env["ap"], ap)
    (ap / "experts-L001.safetensors").write_bytes(b"\x00garbage" * 50)
    misuse(capsys, ["generate", "--ap", ap, "--device", "cpu", "--prompt", "ba", "--max-tokens", "1"],
           "cannot open", "experts-L001.safetensors", "pwruntime quantize")
    misuse(capsys, ["calibrate", "--model", env["ckpt"], "--ap", ap, "--data", env["text"], "--out", tmp_path / "cal"],
           "experts-L001.safetensors", "pwruntime quantize")
    assert not (tmp_path / "cal").exists()
    from pwruntime.calibrate.quality import nonexpert_fp16_bytes   # quality-table's count of the other weights
    from pwruntime.quant.ap_checkpoint import APCheckpointError, load_ap_checkpoint
    other = ap / load_ap_checkpoint(ap).meta["nonexpert_file"]
    other.write_bytes(b"\x00garbage" * 50)
    with pytest.raises(APCheckpointError, match=f"cannot open {other}.*pwruntime quantize"):
        nonexpert_fp16_bytes(ap)


def test_kv_cache_past_the_memory_there_is(env, capsys, monkeypatch):
    # was: RuntimeError "DefaultCPUAllocator: can't allocate memory" traceback (`--gpu-memory-budget 1TiB`)
    from pwruntime.kv_cache import KVCache

    def no_memory(self, *a, **k):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory")

    monkeypatch.setattr(KVCache, "__init__", no_memory)
    misuse(capsys, ["generate", "--ap", env["ap"], "--device", "cpu", "--num-kv-blocks", "64", "--prompt", "ba",
                    "--max-tokens", "1"], "cannot allocate a KV cache of 64 blocks", "lower --gpu-memory-budget")


def test_a_budget_past_the_host_memory_is_refused_before_the_pool(env, capsys, monkeypatch):
    # was: 4 s and ~5 GB building a pool of 134M blocks for `--gpu-memory-budget 1TiB` on the CPU, then a traceback
    from pwruntime import kv_capacity

    monkeypatch.setattr(kv_capacity, "_host_free_bytes", lambda: 1 << 20)
    misuse(capsys, ["generate", "--ap", env["ap"], "--device", "cpu", "--gpu-memory-budget", "64MiB", "--prompt", "ba",
                    "--max-tokens", "1"], "more than the 1.00 MiB free on cpu", "lower --gpu-memory-budget")


def test_a_planner_that_starts_experts_absent_is_refused_by_the_runtime(env, capsys, tmp_path):
    """0 bits is an absent expert, which the simulator fetches when routed to and the runtime cannot serve (its CPU
    store failed with a traceback, its CUDA store would have read zeros)."""
    (tmp_path / "absent.py").write_text(
        "from dataclasses import dataclass\n@dataclass\nclass Absent:\n    name: str = 'absent'\n"
        "    def reset(self, table, calibration):\n        table.initialize(0)\n"
        "    def plan_step(self, table, observation):\n        return None\n")
    misuse(capsys, ["generate", "--ap", env["ap"], "--device", "cpu", "--policy", f"{tmp_path / 'absent.py'}:Absent",
                    "--calibration", "synthetic", "--prompt", "ba", "--max-tokens", "1"],
           "policy absent leaves L0.E0.gate_up at 0 bits (an absent expert)", "the runtime does not fetch")


def test_plane_arena_off_cuda_is_a_user_error(env, capsys):
    misuse(capsys, ["generate", "--ap", env["ap"], "--device", "cpu", "--plane-arena", "--prompt", "ba",
                    "--max-tokens", "1"], "--plane-arena needs a CUDA device")


def test_model_paths_name_the_problem(env, capsys):
    # an AP checkpoint passed as --model failed on a missing tensor, "use the config.json of these weights"
    misuse(capsys, ["generate", "--model", env["ap"], "--prompt", "ba", "--max-tokens", "1"],
           "is an AP checkpoint", "--ap")
    misuse(capsys, ["perplexity", "--model", env["ap"], "--data", env["text"]], "is an AP checkpoint")
    # a file given as the model directory was reported as not existing
    misuse(capsys, ["generate", "--model", env["plain"], "--prompt", "ba"], "is a file, not a directory")


def test_serve_checks_the_address_before_loading_the_model(capsys, monkeypatch):
    from pwruntime.engine_process import EngineProcess

    def no_load(args):
        raise AssertionError("the engine process was started before the address was checked")

    monkeypatch.setattr(EngineProcess, "launch", no_load)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        misuse(capsys, ["serve", "--port", port], "cannot listen", "choose another --port")
    # an address of another machine: the fix is --host, not --port (TEST-NET-1, no name lookup)
    err = misuse(capsys, ["serve", "--host", "192.0.2.1", "--port", "0"], "cannot listen", "--host")
    assert "another --port" not in err
    for bad in ("0", "-1", "inf", "nan"):
        misuse(capsys, ["serve", "--port", "0", "--shutdown-timeout", bad], "--shutdown-timeout must be a number")
    for bad in ("-1", "inf", "nan"):
        misuse(capsys, ["serve", "--port", "0", "--log-stats-interval", bad], "--log-stats-interval must be")


def test_serve_reports_the_engine_process_user_error(env, capsys):
    # the model is loaded in the engine's process: its user error is the server's, one line, exit 2
    misuse(capsys, ["serve", "--port", "0", "--model", env["ap"]], "is an AP checkpoint", "--ap")
    misuse(capsys, ["serve", "--port", "0", "--ap", env["ap"], "--policy", "pagedweight"], "needs a calibration",
           "--calibration")


# ----------------------------------------------------------------------------------------------- perplexity
def test_perplexity_data_that_is_a_directory_or_empty(env, capsys, tmp_path):
    misuse(capsys, ["perplexity", "--model", env["ckpt"], "--data", tmp_path], "is a directory", "--data")
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    misuse(capsys, ["perplexity", "--model", env["ckpt"], "--data", empty], "holds no text", "--data")


# ------------------------------------------------------------------------------------------------- quantize
def test_quantize_refuses_unwritable_or_destructive_outputs(env, capsys, tmp_path):
    plain = env["plain"]
    # under a file: FileExistsError traceback before
    misuse(capsys, ["quantize", "--model", env["ckpt"], "--out", plain / "ap", "--weighting", "none"],
           "--out", "is a file, not a directory")
    # a file with --overwrite: refused, the file is kept
    misuse(capsys, ["quantize", "--model", env["ckpt"], "--out", plain, "--weighting", "none", "--overwrite"],
           "--out", "is a file")
    assert plain.read_text() == "keep me\n"
    # --out == --model with --overwrite used to replace the source model by its AP checkpoint
    before = entries(Path(env["ckpt"]))
    misuse(capsys, ["quantize", "--model", env["ckpt"], "--out", env["ckpt"], "--weighting", "none", "--overwrite"],
           "is the --model directory")
    assert entries(Path(env["ckpt"])) == before
    assert not any(p.name.startswith(".") for p in Path(env["ckpt"]).parent.iterdir())


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux /proc")
def test_quantize_out_in_an_unwritable_place(env, capsys):
    misuse(capsys, ["quantize", "--model", env["ckpt"], "--out", "/proc/pw-misuse/ap", "--weighting", "none"],
           "--out /proc/pw-misuse/ap", "cannot write")


@pytest.mark.parametrize("extra, needles", [
    # exit 0, then every use: "bitwidths [8] are not stored in this AP checkpoint"
    (["--bits", "3,4"], ["--bits '3,4' must include 8"]),
    (["--bits", "3,3"], ["names a bitwidth more than once"]),
    (["--bits", "3,4,8,8"], ["names a bitwidth more than once"]),
    (["--load-format", "dummy", "--bits", "3..7"], ["must include 8"]),
    (["--calib-data", "TEXT"], ["--weighting none reads no calibration text", "drop --calib-data"]),  # was ignored
    (["--bits", "0..8"], ["must name bitwidths in 1..8"]),
    (["--weighting", "hessian", "--calib-data", "TEXT", "--calib-seq-len", "1"], ["--calib-seq-len must be at least"]),
    (["--weighting", "hessian", "--calib-data", "TEXT", "--calib-tokens", "1"], ["--calib-tokens and"]),
    (["--weighting", "hessian", "--calib-data", "/no/such/calib.txt"], ["calibration file /no/such/calib.txt does not "
                                                                          "exist", "--calib-data"]),
    (["--load-format", "dummy", "--calib-data", "TEXT"], ["--load-format dummy makes random weights"]),
])
def test_quantize_options_that_make_no_usable_checkpoint(env, capsys, tmp_path, extra, needles):
    extra = [env["text"] if a == "TEXT" else a for a in extra]
    misuse(capsys, ["quantize", "--model", env["ckpt"], "--out", tmp_path / "ap", "--weighting", "none", *extra],
           *needles)
    assert entries(tmp_path) == set()


# --------------------------------------------------------------------------------------------- record-trace
@pytest.mark.parametrize("extra, needles", [
    (["--temperature", "-1"], ["--temperature"]),                # ValueError traceback before
    (["--max-num-seqs", "0"], ["--max-num-seqs"]),               # said "num_kv_blocks must be >= 1"
    (["--requests-per-domain", "0"], ["--requests-per-domain must be positive, got 0"]),  # named --rate too
    (["--rate", "0"], ["--rate must be > 0", "got 0.0"]),                                # named no value
    (["--card", "no-such-card"], ["--card", "no-such-card"]),   # was accepted and written into the trace
    (["--out", "PLAIN"], ["--out", "is a file"]),                 # FileExistsError after the whole recording
])
def test_record_trace_misuse(env, capsys, tmp_path, extra, needles):
    out = tmp_path / "trace"
    extra = [str(env["plain"]) if a == "PLAIN" else a for a in extra]
    misuse(capsys, _record(env, out, *extra), *needles)
    assert not out.exists() and env["plain"].read_text() == "keep me\n"


def _record(env, out, *extra):
    return ["record-trace", "--model", env["ckpt"], "--data", f"a={env['text']}", "--out", out,
            "--requests-per-domain", "1", "--prompt-tokens", "4,8", "--output-tokens", "2,3", *extra]


def test_record_trace_card_of_another_shape(env, capsys, tmp_path):
    # was: exit 0, routing of 2 layers x 4 experts labelled Mixtral (32 x 8), which no `pwsim run` could read
    misuse(capsys, _record(env, tmp_path / "trace", "--card", "Mixtral-8x7B-v0.1"),
           "--card Mixtral-8x7B-v0.1 has 32 MoE layers of 8 experts", "2 of 4", "drop --card")
    assert entries(tmp_path) == set()


def test_record_trace_does_not_overwrite_without_force(env, capsys, tmp_path):
    trace, other, result = tmp_path / "trace", tmp_path / "other", tmp_path / "result"
    assert main([str(a) for a in _record(env, trace)]) == 0
    before = (trace / "requests.parquet").read_bytes()
    other.mkdir()
    (other / "keep.txt").write_text("x")
    result.mkdir()
    (result / "summary.json").write_text("{}")
    (result / "requests.parquet").write_bytes(b"measured")
    # each was overwritten or written into silently
    misuse(capsys, _record(env, trace, "--seed", "1"), "already holds a trace", "--force")
    assert (trace / "requests.parquet").read_bytes() == before
    misuse(capsys, _record(env, other), "is not empty", "--force")
    misuse(capsys, _record(env, result, "--force"), "is a run's result directory")
    assert entries(other) == {"keep.txt"} and (result / "requests.parquet").read_bytes() == b"measured"
    assert main([str(a) for a in _record(env, trace, "--seed", "1", "--force")]) == 0
    assert (trace / "requests.parquet").read_bytes() != before


def test_record_trace_write_failure_leaves_no_out(env, capsys, tmp_path, monkeypatch):
    import traces.io

    def disk_full(tables):
        next(iter(tables)).parent.mkdir(parents=True, exist_ok=True)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(traces.io, "write_tables_atomic", disk_full)
    misuse(capsys, _record(env, tmp_path / "new" / "trace", "--json"), "cannot write the trace", "No space left")
    assert entries(tmp_path) == set()  # was: an empty --out (and its parent) left behind


# --------------------------------------------------------------------------------------------------- replay
def test_replay_trace_of_another_tokenizer(env, capsys, tmp_path):
    # the demo trace's token ids do not fit the tiny model's 128-token vocabulary: was "prompt token ids must
    # lie in 0..127", naming neither the trace nor the fix
    out = tmp_path / "res"
    misuse(capsys, ["replay", "--trace", DEMO_TRACE, "--out", out, "--model", env["ckpt"], "--max-requests", "1",
                    "--num-kv-blocks", "64"], "outside the model's vocabulary", "requests.parquet")
    assert not out.exists()


def test_replay_trace_dir_without_requests_and_planner_without_ap(env, capsys, tmp_path):
    out = tmp_path / "res"
    misuse(capsys, ["replay", "--trace", tmp_path, "--out", out], "--trace", "holds no requests.parquet")
    misuse(capsys, ["replay", "--trace", DEMO_TRACE, "--out", out, "--policy", "pagedweight"],
           "--policy pagedweight needs --ap")
    misuse(capsys, ["replay", "--trace", DEMO_TRACE, "--out", out, "--request-rate", "5", "--time-scale", "2"],
           "give --request-rate or --time-scale, not both")
    misuse(capsys, ["replay", "--trace", DEMO_TRACE, "--out", out, "--request-rate", "0"],
           "rate and burstiness must be positive")
    assert not out.exists()


def test_replay_of_no_requests_or_a_longer_warm_up(env, capsys, tmp_path):
    from traces.io import Trace, read_requests, write_trace_dir

    empty = write_trace_dir(tmp_path / "empty", Trace(read_requests(DEMO_TRACE / "requests.parquet").head(0), None))
    out = tmp_path / "res"
    # was: exit 0, "replayed 0 requests" and an empty result
    misuse(capsys, ["replay", "--trace", empty, "--out", out], "holds no requests")
    # was: accepted, the warm-up serving only the 2 there are
    misuse(capsys, ["replay", "--trace", DEMO_TRACE, "--out", out, "--max-requests", "2", "--warmup-requests", "3"],
           "--warmup-requests must lie in 0..2")
    assert not out.exists()


def test_replay_routing_hint_without_a_budget(env, capsys, tmp_path):
    # was: "`pwsim run --like-replay DIR` simulates it", which refuses a replay without --gpu-memory-budget
    trace, out = tmp_path / "trace", tmp_path / "res"
    assert main([str(a) for a in _record(env, trace)]) == 0
    capsys.readouterr()
    assert main(["replay", "--trace", str(trace), "--out", str(out), "--model", env["ckpt"], "--num-kv-blocks", "64",
                 "--time-scale", "0", "--record-routing"]) == 0
    printed = capsys.readouterr().out
    assert "needs a replay with --gpu-memory-budget" in printed and f"--like-replay {out}" not in printed


# ------------------------------------------------------------------------------------------------ calibrate
def _calibrate(env, out, *extra):
    return ["calibrate", "--model", env["ckpt"], "--ap", env["ap"], "--data", env["text"], "--out", out,
            "--tokens", "200", "--seq-len", "50", *extra]


def test_calibrate_overwrite_refuses_what_is_not_a_calibration(env, capsys, tmp_path):
    plain = env["plain"]
    # a file with --overwrite: NotADirectoryError after the whole run, the file moved to a hidden .old
    misuse(capsys, _calibrate(env, plain, "--overwrite"), "--out", "is a file")
    assert plain.read_text() == "keep me\n" and not (plain.parent / f".{plain.name}.old").exists()
    # a directory holding a folder: IsADirectoryError, the directory left renamed to .other.old
    other = tmp_path / "other"
    (other / "sub").mkdir(parents=True)
    (other / "keep.txt").write_text("x")
    misuse(capsys, _calibrate(env, other, "--overwrite"), "not a calibration directory")
    assert entries(other) == {"sub", "keep.txt"} and entries(tmp_path) == {"other"}


def test_calibrate_bad_output_place_and_initial_bits(env, capsys, tmp_path):
    misuse(capsys, _calibrate(env, env["plain"] / "cal"), "--out", "is a file, not a directory")
    # below the lowest stored bitwidth: PolicyError traceback before, not naming the flag
    out = tmp_path / "cal"
    misuse(capsys, _calibrate(env, out, "--initial-mean-bits", "0"), "--initial-mean-bits")
    assert not out.exists()


# -------------------------------------------------------------------------------------------- quality-table
@pytest.mark.parametrize("extra, needles", [
    (["--data", "TEXT"], ["--data entry"]),                       # said "--domains entry"
    (["--stride", "0"], ["--stride"]),                            # was taken as the default stride
    (["--context", "0"], ["--context"]),                          # was taken as the default context
    (["--context", "16", "--stride", "32"], ["--stride 32 exceeds the context"]),  # skipped tokens silently
    (["--calibration", "CAL", "--fit-out", "DIR"], ["--fit-out", "is a directory"]),  # traceback after the work
    (["--calibration", "CAL", "--fit-out", "PLAIN/fit.json"], ["--fit-out", "is a file, not a directory"]),
])
def test_quality_table_misuse(env, capsys, tmp_path, monkeypatch, extra, needles):
    import pwruntime.calibrate.quality as q

    def no_work(*a, **k):
        raise AssertionError("quality_table ran before the arguments were checked")

    if "--fit-out" in extra:
        monkeypatch.setattr(q, "quality_table", no_work)
    subs = {"TEXT": env["text"], "CAL": str(tmp_path), "DIR": str(tmp_path),
            "PLAIN/fit.json": str(env["plain"] / "fit.json")}
    extra = [subs.get(a, a) for a in extra]
    data = [] if "--data" in extra else ["--data", f"a={env['text']}"]
    misuse(capsys, ["quality-table", "--model", env["ckpt"], "--ap", env["ap"], *data, "--bits", "8",
                    "--max-tokens", "64", *extra], *needles)
    assert entries(tmp_path) == set()


# ----------------------------------------------------------------------------------------------------- demo
@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus"), train_docs=3, valid_docs=2)


@pytest.mark.parametrize("extra, needles", [
    (["--device", "tpu"], ["--device 'tpu'"]),                   # RuntimeError traceback, OUT left behind
    (["--lr", "-1"], ["--lr"]),                                   # ValueError traceback from the optimizer
    (["--max-minutes", "-1"], ["--max-minutes"]),                 # stopped at once, exit 0
    (["--warmup-steps", "-1"], ["--warmup-steps"]),               # accepted
    (["--batch-size", "2"], ["batch size 2"]),                    # refused, but the run folder stayed
])
def test_demo_train_misuse_leaves_no_run_folder(corpus, capsys, tmp_path, extra, needles):
    out = tmp_path / "run"
    misuse(capsys, ["demo", "train", "--corpus", corpus, "--out", out, "--device", "cpu", "--no-progress",
                    "--vocab-size", "280", *extra], *needles)
    assert not out.exists()


def test_demo_train_out_that_is_a_file(env, corpus, capsys):
    misuse(capsys, ["demo", "train", "--corpus", corpus, "--out", env["plain"], "--device", "cpu"],
           "--out", "is a file")
    assert env["plain"].read_text() == "keep me\n"


def test_demo_stats_refuses_models_it_cannot_evaluate(env, corpus, capsys, tmp_path):
    out = tmp_path / "stats"
    # an AP checkpoint: its experts were randomly initialised by transformers and the stats written (exit 0)
    misuse(capsys, ["demo", "stats", "--model", env["ap"], "--corpus", corpus, "--out", out], "AP checkpoint")
    # a model that is not demo-format: TypeError traceback
    misuse(capsys, ["demo", "stats", "--model", env["ckpt"], "--corpus", corpus, "--out", out],
           "not a demo-format model")
    assert not out.exists()


def test_demo_stats_bad_device_or_out(corpus, capsys, env, tmp_path):
    from pwruntime.cmd_perplexity import default_model_dir

    if default_model_dir() is None:
        pytest.skip("no bundled demo model")
    args = ["demo", "stats", "--model", default_model_dir(), "--corpus", corpus]
    misuse(capsys, [*args, "--out", tmp_path / "stats", "--device", "tpu"], "--device 'tpu'")  # RuntimeError before
    misuse(capsys, [*args, "--out", env["plain"]], "--out", "is a file")  # FileExistsError after the evaluation
    assert env["plain"].read_text() == "keep me\n" and entries(tmp_path) == set()


# ---------------------------------------------------------------------------------------------------- bench
def test_bench_routing_must_be_uniform_or_zipf_and_only_for_kernels(capsys):
    for bad in ("zipf", "zipf:0", "zipf:-1", "zipf:x", "zipf:inf", "skewed:1"):
        misuse(capsys, ["bench", "kernels", "--routing", bad], "--routing", "uniform or zipf:ALPHA")
    misuse(capsys, ["bench", "prefill", "--routing", "zipf:1"], "--routing belongs to `pwruntime bench kernels`")
    misuse(capsys, ["bench", "prefix-cache", "--routing", "zipf:1"], "--routing")


def test_bench_plot_from_another_json_keeps_its_figure(capsys, tmp_path):
    # a `bench prefill` result (or any JSON) was drawn as empty axes over the PNG beside it, exit 0
    src = tmp_path / "prefill.json"
    src.write_text(json.dumps({"device": "x", "rows": []}))
    png = tmp_path / "prefill.png"
    png.write_bytes(b"the prefill figure")
    misuse(capsys, ["bench", "kernels", "--plot-from", src], "--plot-from", "not a `pwruntime bench kernels --out`")
    assert png.read_bytes() == b"the prefill figure"


@pytest.mark.parametrize("target", ["prefix-cache", "decode", "plans", "step-inputs", "mixed", "kv-resize"])
def test_bench_out_is_checked_before_the_benchmark(env, capsys, tmp_path, target):
    # the benchmark ran, then IsADirectoryError / FileExistsError / OSError tracebacks writing --out
    misuse(capsys, ["bench", target, "--out", tmp_path], "--out", "is a directory; give a file name")
    misuse(capsys, ["bench", target, "--out", env["plain"] / "x.json"], "is a file, not a directory")
    if Path("/proc/self").is_dir():
        misuse(capsys, ["bench", target, "--out", "/proc/pw-misuse/x.json"], "cannot write")
    assert entries(tmp_path) == set() and env["plain"].read_text() == "keep me\n"


def test_bench_write_failure_is_a_user_error(capsys, tmp_path, monkeypatch):
    import pwruntime.bench_step_inputs as bsi
    import traces.clikit as clikit

    def disk_full(path, obj):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(bsi, "measure", lambda *a, **k: {})
    monkeypatch.setattr(clikit, "write_json_atomic", disk_full)  # what every bench's report writes with
    assert main(["bench", "step-inputs", "--out", str(tmp_path / "x.json")]) == 2
    err = capsys.readouterr().err  # after the benchmark's progress line
    assert "Traceback" not in err and "cannot write it" in err and "No space left" in err, err


@pytest.mark.parametrize("size, needles", [("2GiB", ["--prefill-chunk sizes the CUDA kernels'", "--device cuda"]),
                                           ("lots", ["--prefill-chunk:", "lots"])])
def test_prefill_chunk_off_cuda_or_unreadable_is_a_user_error(env, capsys, size, needles):
    misuse(capsys, ["generate", "--ap", env["ap"], "--device", "cpu", "--prefill-chunk", size, "--prompt", "ba",
                    "--max-tokens", "1"], *needles)


@pytest.mark.parametrize("argv, prog, needle", [
    (["generate"], "pwruntime generate", "the following arguments are required: --prompt"),
    (["generate", "--prompt", "ba", "--nosuch"], "pwruntime generate", "unrecognized arguments: --nosuch"),
    (["demo", "train", "--corpus", "c", "--out", "o", "--nosuch"], "pwruntime demo train",
     "unrecognized arguments: --nosuch"),
    (["replay", "--trace", str(DEMO_TRACE), "--out", "x", "--dtype", "fp8"], "pwruntime replay",
     "invalid choice: 'fp8'"),
])
def test_argparse_errors_are_one_line_naming_the_command_and_its_help(capsys, argv, prog, needle):
    """One line, the (sub)command's own name (a nested one's too) and where its options are listed, exit 2; not the
    command's whole usage first, nor an unknown flag reported by the top-level `pwruntime` parser."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    out, err = capsys.readouterr()
    assert exc.value.code == 2 and out == ""
    assert err.splitlines() == [err.strip()] and err.startswith(f"{prog}: error: ") and needle in err, err
    assert err.strip().endswith(f"(see `{prog} --help`)"), err
