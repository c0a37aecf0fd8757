"""`pwsim models`, `pwsim gen-trace`, `pwsim trace-info`: output, exit codes, one-line errors; import hygiene."""
from __future__ import annotations

import json
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq

from pwsim.cli import main


def _run(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_models_json_lists_the_five_cards(capsys):
    rc, out, _ = _run(capsys, "models", "--json")
    rows = {r["name"]: r for r in json.loads(out)}
    assert rc == 0 and set(rows) == {"Qwen1.5-MoE-A2.7B", "Mixtral-8x7B-v0.1", "OLMoE-1B-7B-0924", "Qwen3-30B-A3B",
                                     "Gemma-4-26B-A4B", "PagedWeight-demo"}
    assert abs(rows["Qwen1.5-MoE-A2.7B"]["total_params"] / 14.3e9 - 1) < 0.02
    assert abs(rows["Mixtral-8x7B-v0.1"]["total_params"] / 46.7e9 - 1) < 0.02
    for r in rows.values():
        assert {"fp16_gib", "expert_share", "kv_bytes_per_token", "source"} <= set(r)


def test_models_table(capsys):
    rc, out, _ = _run(capsys, "models")
    assert rc == 0 and "Gemma-4-26B-A4B" in out and "fp16 GiB" in out and "KV B/token" in out


def test_gen_trace_then_trace_info(tmp_path, capsys):
    out_dir = tmp_path / "trace"
    rc, out, err = _run(capsys, "gen-trace", "--out", str(out_dir), "--requests", "5", "--prompt-dist", "uniform:2,6",
                        "--output-dist", "fixed:3", "--domains", "chat:2,code:1", "--card", "OLMoE-1B-7B-0924",
                        "--seed", "4", "--json")
    assert rc == 0, err
    summary = json.loads(out)
    assert summary["requests"]["requests"] == 5 and summary["routing"]["card"] == "OLMoE-1B-7B-0924"
    rc, out, _ = _run(capsys, "trace-info", str(out_dir), "--json", "--card", "OLMoE-1B-7B-0924")
    info = json.loads(out)
    assert rc == 0 and info["valid"] and info["routing"]["top_k"] == 8 and info["requests"]["requests"] == 5
    assert info["warmup_routing"] is None
    rc, out, _ = _run(capsys, "trace-info", str(out_dir / "requests.parquet"))
    assert rc == 0 and "valid trace" in out and "routing" not in out
    # a replay's recorded warm-up routing (`pwruntime replay --record-routing`) is described beside the trace's
    from traces.io import ROUTING_FILE, WARMUP_ROUTING_FILE, read_routing, write_routing
    routing = read_routing(out_dir / ROUTING_FILE)
    first = routing.request_id == routing.request_id.min()
    write_routing(out_dir / WARMUP_ROUTING_FILE, type(routing)(
        routing.card, routing.layers, routing.experts, routing.top_k, routing.request_id[first],
        routing.position[first], routing.layer[first], routing.expert_ids[first], routing.weights[first]))
    rc, out, _ = _run(capsys, "trace-info", str(out_dir))
    assert rc == 0 and f"warm-up       {int(first.sum()):,} rows" in out and "first 1 request (" in out
    # same seed, same files
    rc, _, _ = _run(capsys, "gen-trace", "--out", str(tmp_path / "again"), "--requests", "5", "--prompt-dist",
                    "uniform:2,6", "--output-dist", "fixed:3", "--domains", "chat:2,code:1", "--card",
                    "OLMoE-1B-7B-0924", "--seed", "4")
    a, b = (pq.read_table(d / "routing.parquet") for d in (out_dir, tmp_path / "again"))
    assert rc == 0 and a.equals(b)


def test_gen_trace_without_routing_and_refusing_to_overwrite(tmp_path, capsys):
    rc, _, _ = _run(capsys, "gen-trace", "--out", str(tmp_path), "--requests", "3", "--no-routing")
    assert rc == 0 and not (tmp_path / "routing.parquet").exists()
    rc, _, err = _run(capsys, "gen-trace", "--out", str(tmp_path), "--requests", "3", "--no-routing")
    assert rc == 2 and "--force" in err and len(err.strip().splitlines()) == 1


def _one_error_line(capsys, *argv) -> str:
    rc, out, err = _run(capsys, *argv)
    lines = err.strip().splitlines()
    assert rc == 2 and out == "" and len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_malformed_traces_exit_2_with_one_line(tmp_path, capsys):
    junk = tmp_path / "junk.parquet"
    junk.write_bytes(b"PAR1 this is not really parquet")
    assert "not a Parquet file" in _one_error_line(capsys, "trace-info", str(junk))
    bad = tmp_path / "requests.parquet"
    pq.write_table(pa.table({"request_id": [0, 1], "arrival_s": [0.0, 1.0], "prompt_tokens": [3, -1],
                             "output_tokens": [1, 1], "domain": ["a", "b"]}), bad)
    line = _one_error_line(capsys, "trace-info", str(bad))
    assert str(bad) in line and "column 'prompt_tokens', row 1" in line
    line = _one_error_line(capsys, "trace-info", str(tmp_path))
    assert "prompt_tokens" in line
    assert "no model card" in _one_error_line(capsys, "trace-info", str(tmp_path), "--card", "nope")
    assert "does not exist" in _one_error_line(capsys, "trace-info", str(tmp_path / "missing"))


def test_bad_generator_flags_exit_2(tmp_path, capsys):
    for flags in (["--prompt-dist", "gauss:3"], ["--rate", "0"], ["--domains", "a,a"], ["--card", "GPT-5"]):
        assert _one_error_line(capsys, "gen-trace", "--out", str(tmp_path / "x"), "--requests", "2", *flags)
    assert not (tmp_path / "x" / "requests.parquet").exists()


def test_gen_trace_refuses_what_it_cannot_draw_up_front(tmp_path, capsys):
    line = _one_error_line(capsys, "gen-trace", "--out", str(tmp_path / "x"), "--requests", "100000000")
    assert "--requests must be at least 1 and at most 10,000,000" in line
    line = _one_error_line(capsys, "gen-trace", "--out", str(tmp_path / "x"), "--prefix-groups", "3")
    assert "--prefix-groups 3 groups shared prefixes: give their length too (--shared-prefix-tokens N)" in line
    assert not (tmp_path / "x").exists()


def test_trace_commands_refuse_a_non_empty_out_unless_forced(tmp_path, capsys):
    log = tmp_path / "log.csv"
    log.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n0,10,5\n1,20,6\n")
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    for argv in (["gen-trace", "--requests", "3", "--no-routing"], ["import-trace", str(log)]):
        line = _one_error_line(capsys, *argv, "--out", str(out))
        assert f"--out {out} is not empty; choose another directory or pass --force" in line
        assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    rc, _, err = _run(capsys, "import-trace", str(log), "--out", str(out), "--force")
    assert rc == 0, err
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt", "requests.parquet"]


def test_import_trace_refuses_token_counts_a_trace_cannot_hold(tmp_path, capsys):
    for value in ("99999999999999", "3000000000", "10.5", "-3"):
        log = tmp_path / "log.csv"
        log.write_text(f"TIMESTAMP,ContextTokens,GeneratedTokens\n0,10,5\n1,{value},6\n2,,6\n")
        line = _one_error_line(capsys, "import-trace", str(log), "--out", str(tmp_path / "trace"))
        assert f"{log}: column 'ContextTokens', row 1: {value} is not a token count" in line
        assert "whole numbers from 0 to 2,147,483,647" in line
        assert not (tmp_path / "trace").exists()


def test_importing_traces_pulls_no_torch_simpy_or_cupy():
    code = ("import sys, traces, traces.schema, traces.io, traces.generators, traces.model_card; "
            "print(sorted(m for m in ('torch', 'simpy', 'cupy', 'tqdm') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
