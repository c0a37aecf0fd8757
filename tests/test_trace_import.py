"""`pwsim import-trace` and traces.csv_import: production logs in CSV as trace directories the simulator runs."""
from __future__ import annotations

import json

import numpy as np
import pytest

from pwsim.cli import main
from traces.csv_import import FORMATS, CsvColumns, read_csv_trace
from traces.io import read_trace_dir

AZURE = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:15:50.7049120,3180,8
2023-11-16 18:15:46.6805900,4808,10
2023-11-16 18:15:51.1000000,120,0
2023-11-16 18:15:52.5000000,700,44
2023-11-16 18:15:52.5000000,90,3
"""
BURSTGPT = """Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type
5,ChatGPT,472,18,490,Conversation log
45,ChatGPT,1087,0,1087,Conversation log
118,GPT-4,417,217,634,Conversation log
118.5,,80,12,92,API log
"""


def _csv(tmp_path, text: str, name: str = "log.csv"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_azure_log_in_time_order_without_failed_rows(tmp_path):
    """Dates and times to seconds after the first request, sorted (ties keep the file's order); a row without an
    output token dropped and counted."""
    got = read_csv_trace(_csv(tmp_path, AZURE), FORMATS["azure"])
    t = got.trace
    assert (got.rows, got.dropped, len(t)) == (5, 1, 4)
    assert t.prompt_tokens.tolist() == [4808, 3180, 700, 90] and t.output_tokens.tolist() == [10, 8, 44, 3]
    assert np.allclose(t.arrival_s, [0.0, 4.024322, 5.81941, 5.81941]) and t.request_id.tolist() == [0, 1, 2, 3]
    assert t.domains == ("imported",) and t.provenance["dropped"] == 1 and t.token_ids is None
    late = read_csv_trace(_csv(tmp_path, AZURE), FORMATS["azure"], start_s=4.0, max_requests=2).trace
    assert late.prompt_tokens.tolist() == [3180, 700] and np.allclose(late.arrival_s, [0.0, 1.795088])


def test_burstgpt_models_become_domains_and_named_columns_read_the_same(tmp_path):
    got = read_csv_trace(_csv(tmp_path, BURSTGPT), FORMATS["burstgpt"], domain="other")
    assert got.dropped == 1 and got.trace.arrival_s.tolist() == [0.0, 113.0, 113.5]
    names = [got.trace.domains[i] for i in got.trace.domain_idx]
    assert names == ["ChatGPT", "GPT-4", "other"]  # an empty model name takes --domain
    named = read_csv_trace(_csv(tmp_path, BURSTGPT), CsvColumns("Timestamp", "Request tokens", "Response tokens"))
    assert named.trace.prompt_tokens.tolist() == got.trace.prompt_tokens.tolist()
    assert named.trace.domains == ("imported",)


def test_import_trace_command_writes_a_trace_the_simulator_runs(tmp_path, capsys):
    log, out = _csv(tmp_path, AZURE), tmp_path / "trace"
    assert main(["import-trace", str(log), "--out", str(out)]) == 0
    assert "wrote" in capsys.readouterr().out
    trace = read_trace_dir(out)
    assert len(trace.requests) == 4 and trace.routing is None
    run = tmp_path / "run"
    assert main(["run", "--trace", str(out), "--budget", "32MiB", "--no-plots", "--json", "--out", str(run)]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["completed"] == 4 and summary["workload"]["routing"].startswith("synthetic routing")
    assert main(["import-trace", str(_csv(tmp_path, BURSTGPT, "b.csv")), "--format", "burstgpt", "--out", str(out),
                 "--force", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["requests"]["domains"] == {"ChatGPT": 1, "GPT-4": 1, "imported": 1}


@pytest.mark.parametrize("text, argv, needle", [
    (AZURE, ["--format", "burstgpt"], "has no column 'Timestamp', 'Request tokens', 'Response tokens', 'Model'"),
    (AZURE, ["--format", "columns", "--time-column", "TIMESTAMP"], "--format columns needs --time-column"),
    (AZURE, ["--time-column", "TIMESTAMP"], "--format azure names its columns itself"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,5,5\n", [], "holds neither numbers (seconds) nor dates"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n1,five,5\n", [], "'ContextTokens' must hold token counts"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n1,5,0\n2,0,4\n", [], "no request left (of 2 rows, 2 lack"),
    (AZURE, ["--max-requests", "0"], "--max-requests must be at least 1"),
    (AZURE, ["--start-s", "100"], "the rest are before --start-s"),
])
def test_import_trace_misuse_is_one_line_and_writes_nothing(tmp_path, capsys, text, argv, needle):
    out = tmp_path / "trace"
    rc = main(["import-trace", str(_csv(tmp_path, text)), "--out", str(out), *argv])
    _, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2 and len(lines) == 1 and needle in lines[0] and "Traceback" not in err, err
    assert not out.exists()


def test_import_trace_refuses_a_missing_file_and_an_existing_trace(tmp_path, capsys):
    assert main(["import-trace", str(tmp_path / "nope.csv"), "--out", str(tmp_path / "t")]) == 2
    assert "no such file" in capsys.readouterr().err
    log, out = _csv(tmp_path, AZURE), tmp_path / "t2"
    assert main(["import-trace", str(log), "--out", str(out)]) == 0
    assert main(["import-trace", str(log), "--out", str(out)]) == 2
    assert "already holds a trace" in capsys.readouterr().err


def test_one_token_prompts_and_outputs_are_kept_and_the_count_bounds_hold(tmp_path):
    """A request of one prompt token and one output token is a request; a count of 2**31 - 1 is one, 2**31 is not; a
    column that is empty everywhere reads as missing counts (every row dropped), and one request may be asked for."""
    from traces.clikit import UserError
    from traces.schema import TraceError
    got = read_csv_trace(_csv(tmp_path, "t,p,o\n0,1,1\n1,0,5\n2,5,0\n"), CsvColumns("t", "p", "o"), max_requests=1)
    assert (len(got.trace), got.dropped) == (1, 2) and got.trace.prompt_tokens.tolist() == [1]
    top = read_csv_trace(_csv(tmp_path, f"t,p,o\n0,{2**31 - 1},1\n"), CsvColumns("t", "p", "o"))
    assert top.trace.prompt_tokens.tolist() == [2**31 - 1]
    with pytest.raises(TraceError, match="is not a token count"):
        read_csv_trace(_csv(tmp_path, f"t,p,o\n0,{2**31},1\n"), CsvColumns("t", "p", "o"))
    with pytest.raises(UserError, match="no request left"):
        read_csv_trace(_csv(tmp_path, "t,p,o\n0,,1\n1,,2\n"), CsvColumns("t", "p", "o"))
