"""`pwruntime bench serve` against a server on the demo model (CPU): every request of the trace sent, streamed and
counted; its result directory read as a replay's; failures counted, never dropped; misuse one clear error."""
from __future__ import annotations

import json

import numpy as np
import pytest

from pwruntime.cli import main
from pwruntime.engine import EngineConfig, LLMEngine
from server_fixtures import model, serving  # noqa: F401 (fixtures)
from test_runtime_cli_misuse import misuse
from traces.io import read_requests
from traces.results import read_result_dir
from traces.schema import RequestTrace

TRACE = "traces/bundled/demo-trace"


@pytest.fixture(scope="module")
def url(model):
    with serving(LLMEngine(model, EngineConfig(num_kv_blocks=256))) as base:
        yield base


def test_every_request_is_served_and_timed_from_the_client(url, tmp_path, capsys):
    out = tmp_path / "bench"
    argv = ["bench", "serve", "--url", url, "--trace", TRACE, "--max-requests", "10", "--time-scale", "0.5",
            "--served-model-name", "demo", "--slo-ttft", "30", "--out", str(out), "--json"]
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out)
    trace = read_requests(f"{TRACE}/requests.parquet")
    assert summary["completed"] == summary["requests"] == 10 and summary["failed"] == 0 and summary["errors"] == []
    assert summary["output_tokens"] == int(trace.output_tokens[:10].sum()) and summary["model"] == "demo"
    assert summary["slo"]["met"] == 10
    saved, requests, timeline, config = read_result_dir(out)
    assert saved == summary and timeline == {} and config["api_key"] is None
    # what the run added to the engine's counters (nothing else used the server meanwhile), and what it ran with
    server = summary["server"]
    assert server["generated_tokens"] == summary["output_tokens"] and server["steps"] >= max(trace.output_tokens[:10])
    assert server["prompt_tokens_computed"] == int(trace.prompt_tokens[:10].sum())
    assert summary["plans"] == server["plans"] == 0 and summary["preemptions"] == 0
    assert config["server"]["engine"]["num_kv_blocks"] == config["num_kv_blocks"] == 256  # the fixture's pool
    assert config["async_scheduling"] is False and config["max_num_seqs"] == 32 and config["time_scale"] == 0.5
    assert "bits" not in config and "steps" not in config  # other targets' options are not this run's
    assert requests["output_tokens"].tolist() == trace.output_tokens[:10].tolist()
    assert requests["request_id"].tolist() == trace.request_id[:10].tolist()
    arrival = (trace.arrival_s[:10] - trace.arrival_s[:10].min()) * 0.5
    assert np.allclose(requests["arrival_s"], arrival)
    assert (requests["ttft_s"] > 0).all() and (requests["ttft_s"] <= requests["e2e_s"]).all()
    assert set(requests["finish_reason"]) == {"length"}
    # the gaps between text chunks: each request's longest lies inside its decode time, the longest of all is one
    many = requests["output_tokens"] > 1
    assert many.any() and (requests["max_itl_s"][many] > 0).all()
    assert (requests["max_itl_s"][many] <= (requests["e2e_s"] - requests["ttft_s"])[many]).all()
    assert summary["itl_s"]["max"] == pytest.approx(np.nanmax(requests["max_itl_s"]))
    assert 0 < summary["itl_s"]["p50"] <= summary["itl_s"]["p99"] <= summary["itl_s"]["max"]


def test_a_request_the_server_refuses_is_counted_as_failed(url, tmp_path, capsys):
    trace = read_requests(f"{TRACE}/requests.parquet")
    ids = [trace.prompt_ids(i) for i in range(3)]
    ids[1] = np.array([5, 10 ** 6])  # a token id outside the vocabulary: the server answers 400
    bad = RequestTrace.from_columns(trace.request_id[:3], trace.arrival_s[:3], np.array([len(i) for i in ids]),
                                    trace.output_tokens[:3], trace.domain[:3], prompt_token_ids=ids)
    src = tmp_path / "trace"
    src.mkdir()
    from traces.io import write_requests
    write_requests(src / "requests.parquet", bad)
    out = tmp_path / "bench"
    assert main(["bench", "serve", "--url", url, "--trace", str(src), "--out", str(out), "--json"]) == 1
    summary = json.loads(capsys.readouterr().out)
    assert summary["requests"] == 3 and summary["completed"] == 2 and summary["failed"] == 1
    assert "HTTP 400" in summary["errors"][0] and str(trace.request_id[1]) in summary["errors"][0]
    _, requests, _, _ = read_result_dir(out)
    assert requests["finish_reason"].tolist() == ["length", "error", "length"]
    assert np.isnan(requests["e2e_s"][1]) and summary["unfinished"] == 1


def test_the_probe_reads_our_counters_and_tolerates_a_server_without_them(url):
    from pwruntime import server_probe

    text = ("# TYPE pagedweight_plans_total counter\npagedweight_plans_total 7\n"
            "pagedweight_x_bucket{le=\"1\"} 3\nother 1\n")
    assert server_probe.parse_counters(text) == {"plans_total": 7.0}
    assert server_probe.counter_deltas({"plans_total": 7, "steps_total": 5}, {"plans_total": 9}) == {"plans": 2}
    assert server_probe.engine_settings(None) == {}

    async def probe(base: str):
        import aiohttp
        async with aiohttp.ClientSession() as session:
            return await server_probe.server_info(session, base), await server_probe.engine_counters(session, base)

    import asyncio
    info, counters = asyncio.run(probe(url))
    assert info["engine"]["num_kv_blocks"] == 256 and counters["kv_blocks_total"] == 256
    assert asyncio.run(probe(f"{url}/v1")) == (None, {})  # no /server_info, no /metrics there: nothing known
    assert asyncio.run(probe("http://127.0.0.1:9")) == (None, {})  # nothing listening


def test_request_rate_sends_the_trace_at_that_rate(url, tmp_path, capsys):
    """`--request-rate R --burstiness CV --seed S`: the trace's requests at the re-timed arrivals (those `pwsim run
    --request-rate` simulates), recorded in config.json."""
    from traces.generators import retimed_arrivals
    out = tmp_path / "bench"
    assert main(["bench", "serve", "--url", url, "--trace", TRACE, "--max-requests", "6", "--request-rate", "40",
                 "--burstiness", "2", "--seed", "3", "--out", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["completed"] == 6
    _, requests, _, config = read_result_dir(out)
    trace = read_requests(f"{TRACE}/requests.parquet")
    assert np.allclose(requests["arrival_s"], retimed_arrivals(trace.arrival_s[:6], 40.0, 2.0, 3))
    assert (config["request_rate"], config["burstiness"], config["seed"]) == (40.0, 2.0, 3)


def test_bench_serve_misuse_is_one_clear_error(capsys, tmp_path):
    misuse(capsys, ["bench", "serve"], "needs --url")
    misuse(capsys, ["bench", "serve", "--url", "http://127.0.0.1:9", "--out", tmp_path / "x"],
           "cannot reach an OpenAI-compatible server at http://127.0.0.1:9", "pwruntime serve")
    assert not (tmp_path / "x").exists()  # nothing written
    misuse(capsys, ["bench", "serve", "--url", "http://x", "--models", "olmoe-1b-7b"],
           "--models does not apply to `pwruntime bench serve`")
    misuse(capsys, ["bench", "serve", "--url", "http://x", "--time-scale", "-1"], "--time-scale must be a number >= 0")
    misuse(capsys, ["bench", "serve", "--url", "http://x", "--request-rate", "5", "--time-scale", "2"], "not both")
    misuse(capsys, ["bench", "serve", "--url", "http://x", "--burstiness", "2"], "give --request-rate R too")
    misuse(capsys, ["bench", "kernels", "--request-rate", "5"], "--request-rate belongs to `pwruntime bench serve`")
    misuse(capsys, ["bench", "serve", "--url", "http://x", "--max-concurrency", "0"], "--max-concurrency must be an integer >= 1")
    misuse(capsys, ["bench", "kernels", "--url", "http://x"], "--url belongs to `pwruntime bench serve`")
    misuse(capsys, ["bench", "serve", "--url", "http://x", "--trace", tmp_path], "holds no requests.parquet")


def test_max_concurrency_keeps_that_many_requests_in_flight(url, tmp_path, capsys):
    """All at once (--time-scale 0) through 3 slots: never more than 3 requests between send and end, each timed
    from its send, every one served."""
    out = tmp_path / "bench"
    assert main(["bench", "serve", "--url", url, "--trace", TRACE, "--max-requests", "12", "--time-scale", "0",
                 "--max-concurrency", "3", "--out", str(out), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["completed"] == 12 and summary["max_concurrency"] == 3 and summary["time_scale"] == 0
    _, requests, _, _ = read_result_dir(out)
    sent, end = requests["arrival_s"], requests["arrival_s"] + requests["e2e_s"]
    in_flight = [int(((sent <= t) & (end > t)).sum()) for t in sent]
    assert max(in_flight) == 3  # as many as the slots, no more
    assert sent.max() > end.min()  # the later ones went once earlier ones ended, not at the trace's arrival (0)
    assert (requests["ttft_s"] > 0).all() and (requests["ttft_s"] < requests["e2e_s"]).all()


def test_a_concurrency_sweep_writes_a_run_per_level_a_table_and_a_figure(url, tmp_path, capsys):
    out = tmp_path / "sweep"
    assert main(["bench", "serve", "--url", url, "--trace", TRACE, "--max-requests", "8", "--time-scale", "0",
                 "--max-concurrency", "1,4", "--out", str(out), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["max_concurrency"] for r in rows] == [1, 4] and all(r["completed"] == 8 for r in rows)
    assert sorted(p.name for p in out.iterdir()) == ["c1", "c4", "config.json", "summary.json", "sweep.png"]
    assert json.loads((out / "summary.json").read_text())["sweep"] == rows
    for level, row in zip((1, 4), rows):
        saved, requests, _, config = read_result_dir(out / f"c{level}")  # each level a result directory
        assert config["max_concurrency"] == level and saved["throughput_tokens_per_s"] == row["throughput_tokens_per_s"]
        sent, end = requests["arrival_s"], requests["arrival_s"] + requests["e2e_s"]
        assert max(int(((sent <= t) & (end > t)).sum()) for t in sent) == level
    assert (out / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # a second sweep into the same directory replaces the first; a list with a repeat or a 0 is refused
    assert main(["bench", "serve", "--url", url, "--trace", TRACE, "--max-requests", "2", "--time-scale", "0",
                 "--max-concurrency", "2,1", "--out", str(out), "--json"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["c1", "c2", "config.json", "summary.json", "sweep.png"]
    capsys.readouterr()
    misuse(capsys, ["bench", "serve", "--url", url, "--max-concurrency", "1,1"], "distinct")
    misuse(capsys, ["bench", "serve", "--url", url, "--max-concurrency", "4,x"], "--max-concurrency must be")
