"""`pwruntime serve` as a process: it answers the openai client, and a SIGTERM (or Ctrl-C) mid-request lets the
requests in flight finish (up to --shutdown-timeout, then a 503 each; at once on a second signal), refuses new
connections and exits 0; an engine process that dies fails what is in flight, and everything after, with a 503."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import openai
import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def server(request):
    """A `pwruntime serve` process on the demo model, on the CPU whatever the machine (these tests need a stream
    that lasts seconds; extra arguments: the test's `serve_args` parameter)."""
    with _serving(getattr(request, "param", [])) as running:
        yield running


@contextlib.contextmanager
def _serving(extra: list[str]):
    """(process, base URL) of `pwruntime serve --device cpu *extra` once /health answers; killed after the block if
    still running."""
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "pwruntime.cli", "serve", "--port", str(port), "--device", "cpu",
                             *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)   # a process group of its own, as a service manager's
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(240):
            try:
                urllib.request.urlopen(f"{url}/health", timeout=1)
                break
            except OSError:
                assert proc.poll() is None, proc.communicate()
                time.sleep(0.25)
        else:
            raise AssertionError("the server did not come up in 60 s")
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


def _long_stream(url: str):
    """A streamed request of 8 choices x 300 tokens, running: (the stream, its first chunk)."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0, timeout=120)
    stream = client.completions.create(model="demo_model", prompt="And God said", max_tokens=300, n=8,
                                       temperature=0, stream=True, extra_body={"ignore_eos": True})
    return stream, next(stream)


@pytest.mark.parametrize("server", [["--shutdown-timeout", "600"]], indirect=True)
@pytest.mark.parametrize("sig, group", [(signal.SIGTERM, False), (signal.SIGINT, False), (signal.SIGTERM, True)])
def test_a_stop_signal_lets_requests_in_flight_finish(server, sig, group):
    """To the server's process, or to its whole group as systemd's stop sends it (the engine process, which got it
    too, died at once before and failed the requests in flight). The timeout is long: on a loaded machine the
    stream took longer than the default 60 s once, and the drain cut it as it should."""
    proc, url = server
    stream, first = _long_stream(url)
    chunks = [first]
    if group:
        os.killpg(proc.pid, sig)
    else:
        proc.send_signal(sig)
    rest = threading.Thread(target=lambda: chunks.extend(stream))
    rest.start()
    time.sleep(0.5)
    with pytest.raises(OSError):  # no new connection once shutting down
        urllib.request.urlopen(f"{url}/health", timeout=2)
    assert rest.is_alive()  # the stream still runs (2400 tokens on a CPU take seconds)
    rest.join(600)
    assert proc.wait(60) == 0
    finished = {c.choices[0].index: c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason}
    assert finished == {i: "length" for i in range(8)}  # every choice ran to its end
    tokens = sum(1 for c in chunks if c.choices[0].text or c.choices[0].finish_reason)
    assert tokens >= 8 * 300 * 0.9  # (a choice's last chunk may carry several tokens' text)


def _cut(stream, chunks: list) -> str:
    """Read `stream` into `chunks` to its end: the error event it ends with (the openai client raises it)."""
    with pytest.raises(openai.APIError) as e:
        for c in stream:
            chunks.append(c)
    return str(e.value)


def _whole(url: str, box: dict) -> None:
    """A long non-streaming request; its status and body into `box`."""
    req = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(
        {"model": "demo_model", "prompt": "And God said", "max_tokens": 3000, "ignore_eos": True}).encode(),
        headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            box["r"] = r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        box["r"] = e.code, json.loads(e.read())


@pytest.mark.parametrize("server", [["--shutdown-timeout", "1"]], indirect=True)
def test_the_shutdown_timeout_answers_what_is_still_running_with_a_503(server):
    """Past --shutdown-timeout a stream still running ends with an error event (and [DONE]) and a non-streaming
    request gets a 503 in OpenAI's error shape, well before aiohttp's own wait: they were cut without a word, after
    twice the timeout."""
    proc, url = server
    stream, first = _long_stream(url)
    box: dict = {}
    whole = threading.Thread(target=_whole, args=(url, box))
    whole.start()
    time.sleep(0.5)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    chunks = [first]
    assert "shutting down" in _cut(stream, chunks)
    whole.join(60)
    status, body = box["r"]
    assert status == 503 and "shutting down" in body["error"]["message"] and body["error"]["type"] == "server_error"
    assert sum(1 for c in chunks if c.choices[0].finish_reason) < 8
    assert proc.wait(60) == 0 and time.monotonic() - t0 < 1 + 5  # the timeout, then aiohttp's short grace at most
    assert "Traceback" not in proc.stderr.read()


def test_a_second_stop_signal_answers_what_is_running_at_once(server):
    """A second SIGINT while the server waits for its requests (60 s by default): each gets its 503 at once and the
    server exits 0 without a traceback (aiohttp's own handler cut each with a traceback, and exit 1)."""
    proc, url = server
    stream, first = _long_stream(url)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.5)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    assert "shutting down" in _cut(stream, [first])
    assert proc.wait(60) == 0 and time.monotonic() - t0 < 10
    assert "Traceback" not in proc.stderr.read()


def _engine_pid(server_pid: int) -> int:
    """The engine process `pwruntime serve` started (a spawned child; multiprocessing's resource tracker is the
    other)."""
    import os
    from pathlib import Path

    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (stat.parent / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == server_pid and b"spawn_main" in cmdline:
            return int(stat.parent.name)
    raise AssertionError(f"no engine process under {server_pid} ({os.getpid()})")


@pytest.mark.skipif(sys.platform != "linux", reason="reads the process tree from /proc")
def test_an_engine_process_that_dies_fails_its_requests_and_health_says_so(server):
    """A killed engine process: the stream in flight ends with an error naming it, /health and every later request
    answer 503, and the server still shuts down cleanly."""
    import os

    proc, url = server
    stream, _ = _long_stream(url)
    os.kill(_engine_pid(proc.pid), signal.SIGKILL)
    with pytest.raises(openai.APIError, match="engine process exited"):
        list(stream)
    with pytest.raises(urllib.error.HTTPError) as health:
        urllib.request.urlopen(f"{url}/health", timeout=5)
    assert health.value.code == 503
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0, timeout=30)
    with pytest.raises(openai.InternalServerError, match="restart the server") as later:
        client.completions.create(model="demo_model", prompt="And God said", max_tokens=4)
    assert later.value.status_code == 503
    with pytest.raises(urllib.error.HTTPError) as metrics:
        urllib.request.urlopen(f"{url}/metrics", timeout=5)
    assert metrics.value.code == 503
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0


@pytest.mark.parametrize("server", [["--log-stats-interval", "0.2"]], indirect=True)
def test_the_engine_writes_stats_lines_while_it_works(server):
    proc, url = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0, timeout=120)
    out = client.completions.create(model="demo_model", prompt="And God said", max_tokens=200, n=4, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 800
    time.sleep(0.6)  # the line after the work ended
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    ready, *lines = [line for line in err.splitlines() if line.startswith("engine: ")]
    assert ready.startswith("engine: ready in ") and "KV blocks of 16 tokens" in ready, err
    assert lines and all("generation tokens/s" in line and "KV cache" in line for line in lines), err
    assert "experts in float32" in ready and not any("mean bits" in line for line in lines)  # not AP experts
    assert "0 running, 0 waiting" in lines[-1]


@pytest.mark.parametrize("server", [["--log-stats-interval", "0"]], indirect=True)
def test_an_interval_of_zero_serves_without_stats_lines(server):
    proc, url = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0, timeout=60)
    out = client.completions.create(model="demo_model", prompt="And God said", max_tokens=20, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 20
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0
    lines = [line for line in err.splitlines() if line.startswith("engine: ")]
    assert len(lines) == 1 and lines[0].startswith("engine: ready in "), err


def test_a_recorded_trace_holds_what_was_served_and_the_simulator_runs_it(tmp_path):
    """`--record-trace DIR --record-trace-max-requests 3`: when the server stops, DIR holds the first three requests
    (their prompt token ids, the outputs they got, arrivals from the first one's) and the routing the engine computed
    for every position of each; the fourth is counted, not recorded; `pwsim run --trace DIR` serves them again."""
    from pwsim.cli import main as sim_main
    from traces.io import read_trace_dir

    out = tmp_path / "served"
    with _serving(["--record-trace", str(out), "--record-trace-max-requests", "3"]) as (proc, url):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0, timeout=60)
        usage = []
        for prompt, n in (("And God said", 5), ("The os module provides a portable way", 9), ("A fool", 3),
                          ("Not recorded", 4)):
            r = client.completions.create(model="demo_model", prompt=prompt, max_tokens=n, temperature=0,
                                          extra_body={"ignore_eos": True})
            usage.append((r.usage.prompt_tokens, r.usage.completion_tokens))
        assert not out.exists()  # written when the server stops
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        err = proc.stderr.read()
    assert f"recorded 3 requests and their routing to {out}" in err and "1 later requests not recorded" in err
    assert f"rows of the planner's log (`pwsim plan-log {out}`)" in err
    trace = read_trace_dir(out)
    req, routing = trace.requests, trace.routing
    assert list(zip(req.prompt_tokens.tolist(), req.output_tokens.tolist())) == usage[:3] == [
        (usage[0][0], 5), (usage[1][0], 9), (usage[2][0], 3)]
    assert req.arrival_s[0] == 0 and (np.diff(req.arrival_s) > 0).all() and set(req.domain) == {"served"}
    assert routing.card == "PagedWeight-demo" and routing.has_features
    for rid, prompt, outputs in zip(req.request_id, req.prompt_tokens, req.output_tokens):
        positions = np.unique(routing.position[routing.request_id == rid])
        assert positions.tolist() == list(range(prompt + outputs - 1))  # each prompt token and fed-back output
    assert sim_main(["run", "--trace", str(out), "--budget", "48MiB", "--no-plots", "--json",
                     "--out", str(tmp_path / "sim")]) == 0
    # beside the trace, the planner's log (full-precision experts: nothing to move, nothing logged)
    assert sim_main(["plan-log", str(out), "--json"]) == 0


def test_record_trace_misuse_is_one_line_before_the_model_loads(tmp_path, capsys):
    from pwruntime.cli import main

    (tmp_path / "taken").mkdir()
    for argv, needle in ((["--record-trace", str(tmp_path / "taken")], "exists; give a new directory"),
                         (["--record-trace", str(tmp_path / "no" / "dir")], "cannot write in"),
                         (["--record-trace", str(tmp_path / "t"), "--record-trace-max-requests", "0"], ">= 1"),
                         (["--record-trace", str(tmp_path / "t"), "--enable-prefix-caching"], "prefix caching")):
        assert main(["serve", "--port", str(_free_port()), *argv]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and needle in err[0] and "Traceback" not in err[0], err
    assert not (tmp_path / "t").exists()


def test_the_engine_process_forwards_the_server_s_items_and_a_stop_once_the_server_is_gone():
    """Its inbox thread passes what the server sends to the loop, then None (stop) when the pipe closes, so an
    engine whose server died does not outlive it."""
    import queue

    from pwruntime.engine_process import _forward

    class Pipe:
        items = [("add", 1, [], False), ("abort", 1)]

        def recv(self):
            if self.items:
                return self.items.pop(0)
            raise EOFError

    inbox: queue.Queue = queue.Queue()
    _forward(Pipe(), inbox)
    assert [inbox.get_nowait() for _ in range(3)] == [("add", 1, [], False), ("abort", 1), None]


def test_a_recorder_that_served_nothing_writes_no_trace(tmp_path, capsys):
    from policies.plan_log import PlanLog
    from pwruntime.engine_process import _write_trace
    from pwruntime.trace_recorder import TraceRecorder

    _write_trace(TraceRecorder(card="PagedWeight-demo"), PlanLog(), str(tmp_path / "trace"))
    assert "no request was served: no trace written" in capsys.readouterr().err
    assert not (tmp_path / "trace").exists()


def test_a_recorded_trace_that_cannot_be_written_is_one_line_not_a_crash(tmp_path, capsys):
    """A folder gone or a file in the way (an OSError) when the engine writes its trace on the way out: said in one
    line, and the engine process still exits cleanly."""
    from policies.plan_log import PlanLog
    from pwruntime.engine_process import _write_trace
    from pwruntime.model_runner import RoutingArrays
    from pwruntime.trace_recorder import TraceRecorder

    rec = TraceRecorder(card="PagedWeight-demo")
    rec.set_model(1, 4, 2)
    rec.on_arrival(5, 0.0, [1, 2, 3])
    ids = np.stack([np.zeros((1, 3), np.int64), np.ones((1, 3), np.int64)], axis=-1)
    rec.on_routing([(5, 0, 3)], RoutingArrays(ids, np.full((1, 3, 2), 0.5, np.float32), np.ones((1, 3), np.float32),
                                              np.ones((1, 3, 2), np.float32), (3,)))
    rec.on_finish(5, 1)
    (tmp_path / "file").write_text("x")
    _write_trace(rec, PlanLog(), str(tmp_path / "file" / "trace"))
    err = capsys.readouterr().err
    assert f"could not write the recorded trace to {tmp_path / 'file' / 'trace'}" in err and "Not a directory" in err


def test_stop_kills_an_engine_process_that_outlives_its_timeout():
    """`stop` sends the stop item and waits `timeout`; an engine process still running then is killed, one that
    exited is left alone."""
    from pwruntime.engine_process import EngineProcess

    class Proc:
        def __init__(self, exits: bool):
            self.exits, self.running, self.killed, self.exitcode = exits, True, False, None

        def join(self, timeout=None):
            self.running = self.running and not self.exits

        def is_alive(self):
            return self.running

        def kill(self):
            self.killed, self.running = True, False

    class Pipe:
        def __init__(self):
            self.sent, self.closed = [], threading.Event()

        def send(self, item):
            self.sent.append(item)
            if item is None:
                self.closed.set()

        def recv(self):
            self.closed.wait(10)
            raise EOFError

    for exits in (True, False):
        proc, pipe = Proc(exits), Pipe()
        EngineProcess(proc, pipe, pipe, None, 128, {"max_model_len": 64}).stop(timeout=0.01)
        assert pipe.sent == [None] and proc.killed == (not exits) and not proc.is_alive()
