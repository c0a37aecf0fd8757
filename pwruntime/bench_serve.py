"""`pwruntime bench serve`: a serving benchmark from the client's side (as vLLM's benchmark_serving): a request trace
sent to a running OpenAI-compatible server at its arrival times, each request streamed and timed by the client.

Request i of the trace (its recorded prompt token ids and output length) is sent at its arrival time (times
`time_scale`, on the client's clock from the first request) to /v1/completions: the ids as the prompt, max_tokens
its output length, `ignore_eos`, greedy, streamed with usage. The client records when each chunk of text arrived
(the first: TTFT; the gaps between them: ITL, `traces.results.TokenGaps`) and when its stream ended (seconds from
the trace's start, latencies measured from the scheduled arrival, as `pwruntime replay` measures them) and the
output tokens the server counted; a request that fails (an HTTP error, an error event, a stream cut short, fewer
tokens than asked) keeps its place with finish reason "error" and its message, so nothing is dropped silently. With
`max_concurrency` N at most N requests are in flight, as vLLM's --max-concurrency (N users): a request whose arrival
finds N in flight waits for one to end, and its latencies count from when it was sent; `time_scale` 0 sends the
whole trace at once (vLLM's --request-rate inf). The result directory has the request columns and summary of
`pwruntime replay` and `pwsim run` (traces.results): `pwsim fidelity --runtime DIR` and `--slo-*` read it, and it
sets the HTTP server's costs beside the engine's own replay of the same trace. Several concurrency levels make a
sweep (traces.sweep).
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import numpy as np

from pwruntime import server_probe
from traces.clikit import UserError, check_time_scale
from traces.results import TokenGaps, request_columns, request_summary
from traces.schema import RequestTrace


@dataclass
class Timing:
    """What the client saw of one request (seconds on its clock, from the trace's start)."""
    first_s: float = float("nan")
    finish_s: float = float("nan")
    text_s: list[float] = field(default_factory=list)  # when each chunk with text came (the first at first_s)
    tokens: int = 0
    reason: str = "error"
    error: str | None = None


def _headers(api_key: str | None) -> dict:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def served_model(session, url: str, api_key: str | None) -> str:
    """The model the server serves (the first of /v1/models); a server that cannot be reached is a UserError."""
    import aiohttp

    try:
        async with session.get(f"{url}/v1/models", headers=_headers(api_key)) as resp:
            if resp.status == 401:
                raise UserError(f"{url} wants an API key: pass --api-key")
            if resp.status != 200:
                raise UserError(f"{url}/v1/models answered {resp.status}; give the base URL of an OpenAI-compatible "
                                "server (e.g. http://127.0.0.1:8000)")
            return (await resp.json())["data"][0]["id"]
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError, IndexError) as e:
        raise UserError(f"cannot reach an OpenAI-compatible server at {url} ({type(e).__name__}: {e}); start one "
                        "(`pwruntime serve`) or fix --url") from None


async def _one(session, url: str, body: dict, api_key: str | None, t0: float, timing: Timing) -> None:
    """Send one request and read its stream into `timing`."""
    import aiohttp

    try:
        async with session.post(f"{url}/v1/completions", json=body, headers=_headers(api_key)) as resp:
            if resp.status != 200:
                timing.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return
            done = False
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data: "):
                    continue
                if line == b"data: [DONE]":
                    done = True
                    break
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    timing.error = f"error event: {chunk['error'].get('message', chunk['error'])}"
                    return
                if any(choice.get("text") for choice in chunk.get("choices", [])):
                    timing.text_s.append(time.perf_counter() - t0)
                    if np.isnan(timing.first_s):
                        timing.first_s = timing.text_s[0]
                for choice in chunk.get("choices", []):
                    if choice.get("finish_reason"):
                        timing.reason = choice["finish_reason"]
                if chunk.get("usage"):
                    timing.tokens = int(chunk["usage"]["completion_tokens"])
            timing.finish_s = time.perf_counter() - t0
            if not done:
                timing.error = "the stream ended without [DONE]"
            elif timing.tokens != body["max_tokens"]:
                timing.error = f"{timing.tokens} output tokens of {body['max_tokens']} asked"
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
        timing.error = f"{type(e).__name__}: {e}"
    finally:
        if timing.error is not None:
            timing.reason, timing.first_s, timing.finish_s, timing.text_s = "error", float("nan"), float("nan"), []


async def _limited(slots: asyncio.Semaphore, sent: np.ndarray, i: int, session, url: str, body: dict,
                   api_key: str | None, t0: float, timing: Timing) -> None:
    """`_one` once a slot is free; `sent[i]`: when it went (seconds from t0)."""
    async with slots:
        sent[i] = time.perf_counter() - t0
        await _one(session, url, body, api_key, t0, timing)


async def run_trace(url: str, trace: RequestTrace, *, time_scale: float = 1.0, max_concurrency: int | None = None,
                    api_key: str | None = None, model: str | None = None, timeout_s: float = 600.0,
                    progress: bool = False) -> dict:
    """Send every request of `trace` at its arrival time (with `max_concurrency`: once a slot is free) and wait for
    all; returns {"requests": columns (trace order), "summary": ..., "model": the model asked, "server_info": the
    server's /server_info or None}. The summary's `server` holds what the run added to the engine's counters
    (pwruntime.server_probe), and `plans` and `preemptions` are among them, as a replay's summary has them."""
    import aiohttp
    from tqdm import tqdm

    if trace.token_ids is None:
        raise UserError(f"{trace.source} has no prompt token ids (prompt_token_ids); the benchmark sends the prompts "
                        "themselves: record the trace with `pwruntime record-trace`")
    url = url.rstrip("/")
    timings = [Timing() for _ in range(len(trace))]
    arrival = np.asarray(trace.arrival_s, dtype=np.float64) * time_scale
    arrival = arrival - (arrival.min() if len(arrival) else 0.0)
    sent = arrival.copy()  # when each request went: its arrival, or later when it waited for a slot
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    connector = aiohttp.TCPConnector(limit=0)  # one connection per request in flight, as clients do
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        model = model or await served_model(session, url, api_key)
        info = await server_probe.server_info(session, url)
        before = await server_probe.engine_counters(session, url)
        bar = tqdm(total=len(trace), desc="requests", unit="req", disable=not progress)
        t0, late, tasks = time.perf_counter(), 0.0, []
        for i in np.argsort(arrival, kind="stable"):
            wait = arrival[i] - (time.perf_counter() - t0)
            if wait > 0:
                await asyncio.sleep(wait)
            late = max(late, -wait)
            body = {"model": model, "prompt": trace.prompt_ids(int(i)).tolist(), "max_tokens": int(trace.output_tokens[i]),
                    "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
            if slots is None:
                task = asyncio.create_task(_one(session, url, body, api_key, t0, timings[i]))
            else:
                task = asyncio.create_task(_limited(slots, sent, int(i), session, url, body, api_key, t0, timings[i]))
            task.add_done_callback(lambda _: bar.update(1))
            tasks.append(task)
        await asyncio.gather(*tasks)
        bar.close()
        counted = server_probe.counter_deltas(before, await server_probe.engine_counters(session, url))
    first = np.array([t.first_s for t in timings])
    finish = np.array([t.finish_s for t in timings])
    gaps = TokenGaps(len(timings))  # between chunks: a chunk may hold more than one token, as in vLLM's benchmark
    for i, t in enumerate(timings):
        for when in t.text_s:
            gaps.settled([i], when)
    requests = request_columns(trace.request_id, trace.domain, sent, trace.prompt_tokens,
                               np.array([t.tokens for t in timings]), first, finish, np.zeros(len(trace), np.int64),
                               np.array([t.reason for t in timings], dtype=object), max_itl_s=gaps.max_s)
    errors = [f"request {trace.request_id[i]}: {t.error}" for i, t in enumerate(timings) if t.error is not None]
    summary = {**request_summary(requests, gaps.all()), "failed": len(errors), "errors": errors[:10],
               "max_send_lateness_s": late, "time_scale": time_scale, "max_concurrency": max_concurrency,
               "server": counted, **{k: counted[k] for k in ("plans", "preemptions") if k in counted}}
    return {"requests": requests, "summary": summary, "model": model, "server_info": info}


# ---------------------------------------------------------------- the command
SERVE_FLAGS = ("url", "trace", "time_scale", "request_rate", "burstiness", "max_concurrency", "max_requests",
               "api_key", "served_model_name", "slo_ttft", "slo_tpot")
OTHER_FLAGS = ("models", "tokens", "reps", "prompts", "model", "steps", "prompt_tokens", "ap", "calibration", "policy",
               "num_kv_blocks", "temperature", "top_p", "routing", "profile_out", "plot_from", "dtype")


def add_args(parser) -> None:
    """The options of `pwruntime bench serve` (None by default: the other targets refuse them)."""
    from pwruntime.cmd_replay import add_request_rate_flags

    s = parser.add_argument_group("serve (a running OpenAI-compatible server, from the client's side)")
    s.add_argument("--url", default=None, help="serve: the server's base URL, e.g. http://127.0.0.1:8000")
    s.add_argument("--trace", default=None,
                   help="serve: trace directory with prompt token ids (default: the bundled demo trace)")
    s.add_argument("--time-scale", type=float, default=None, metavar="S",
                   help="serve: multiply the arrival times by S (default 1; below 1 the load is heavier; 0: every "
                        "request at once, as vLLM's --request-rate inf)")
    add_request_rate_flags(s)
    s.add_argument("--max-concurrency", default=None, metavar="N[,N...]",
                   help="serve: at most N requests in flight (N users, as vLLM's); one that arrives while N are in "
                        "flight waits, and its latencies count from when it was sent (default: no limit); several "
                        "levels (1,4,16,64): one run each, a result directory each under --out, summary.json and "
                        "sweep.png")
    s.add_argument("--max-requests", type=int, default=None, help="serve: only the trace's first N requests")
    s.add_argument("--api-key", default=None, help="serve: the server's API key (bearer token)")
    s.add_argument("--served-model-name", default=None, help="serve: the model to ask for (default: the server's)")
    s.add_argument("--slo-ttft", type=float, default=None, metavar="SECONDS",
                   help="serve: also report the share of requests with TTFT at most this (and TPOT within --slo-tpot)")
    s.add_argument("--slo-tpot", type=float, default=None, metavar="MS", help="serve: the TPOT bound of that share")
    s.add_argument("--force", action="store_true", help="serve: overwrite a non-empty --out that is not a result")


def run_cli(args, command: str) -> int:
    """`pwruntime bench serve`: send the trace, write the result directory (--out, default runs/bench-serve); with
    several --max-concurrency levels, one run per level (traces.sweep)."""
    import sys
    from pathlib import Path

    from traces import sweep
    from pwruntime.cmd_replay import _requests, arrival_args
    from traces.results import prepare_dir, slo_attainment, slo_bounds, slo_line, write_result_dir

    for name in OTHER_FLAGS:
        if getattr(args, name) is not None:
            raise UserError(f"--{name.replace('_', '-')} does not apply to `pwruntime bench serve` (it takes --url, "
                            "--trace, --time-scale, --request-rate, --burstiness, --seed, --max-concurrency, "
                            "--max-requests, --api-key, --served-model-name, --slo-ttft, --slo-tpot, --out, --force, "
                            "--json)")
    if args.no_cuda_graphs or args.async_scheduling or args.max_tokens != 16:
        raise UserError("`pwruntime bench serve` measures a running server: its engine options are `pwruntime "
                        "serve`'s; give --url, --trace and --time-scale")
    if not args.url:
        raise UserError("`pwruntime bench serve` needs --url: the base URL of a running server (`pwruntime serve`)")
    scale = check_time_scale(1.0 if args.time_scale is None else args.time_scale)
    levels = sweep.parse_levels(args.max_concurrency)
    rate, burstiness = arrival_args(args)
    trace = _requests(args.trace or str(Path(__file__).resolve().parents[1] / "traces/bundled/demo-trace"),
                      args.max_requests, rate, burstiness, args.seed)
    slo = slo_bounds(args)
    out = Path(args.out or "runs/bench-serve")
    prepare_dir(out, args.force, tool="bench serve")
    config = {"command": "bench", "target": "serve", **{k: getattr(args, k) for k in SERVE_FLAGS},
              "time_scale": scale, "seed": args.seed, "out": str(out), "api_key": None,
              "argv": [a if a != args.api_key else "***" for a in sys.argv[1:]]}
    runs = []  # (level, summary, requests)
    for level in levels:
        result = asyncio.run(run_trace(args.url, trace, time_scale=scale, max_concurrency=level, api_key=args.api_key,
                                       model=args.served_model_name, progress=not args.json))
        summary = {**result["summary"], "url": args.url, "model": result["model"], "command": command}
        if slo is not None:
            summary["slo"] = slo_attainment(result["requests"], *slo)
        # what the server ran with, its scheduler settings named as a replay's (what `pwsim fidelity` reads)
        config.update(server=result["server_info"], **server_probe.engine_settings(result["server_info"]))
        runs.append((level, summary, result["requests"]))
    failed = sum(summary["failed"] for _, summary, _ in runs)
    if len(runs) == 1:
        _, summary, requests = runs[0]
        write_result_dir(out, {"requests": requests},
                         {"summary": summary, "config": {**config, "max_concurrency": levels[0]}},
                         force=args.force, tool="bench serve")
        if args.json:
            print(json.dumps(summary))
        else:
            _print_run(summary, args.url, slo_line(summary["slo"]) if slo is not None else None)
    else:
        rows = [sweep.sweep_row(level, summary) for level, summary, _ in runs]

        def write_levels(tmp: Path) -> None:
            for level, summary, requests in runs:
                write_result_dir(tmp / f"c{level}", {"requests": requests},
                                 {"summary": summary, "config": {**config, "max_concurrency": level}},
                                 tool="bench serve")
            sweep.plot_sweep(rows, tmp / "sweep.png", f"{command} ({trace.source})")

        write_result_dir(out, {}, {"summary": {"sweep": rows, "url": args.url, "command": command},
                                   "config": config}, extra=write_levels, force=args.force, tool="bench serve")
        print(json.dumps(rows) if args.json else sweep.table(rows))
    print(f"\nreproduce: {command}\nresults: {out}", file=sys.stderr if args.json else sys.stdout)
    return 1 if failed else 0


def _print_run(summary: dict, url: str, slo: str | None) -> None:
    t, f, itl = summary["tpot_s"]["p50"], summary["ttft_s"]["p50"], summary["itl_s"]["p99"]
    print(f"sent {summary['requests']} requests to {url}: {summary['completed']} completed, {summary['failed']} "
          f"failed; {summary['output_tokens']} output tokens in {summary['makespan_s']:.2f} s, "
          f"{summary['throughput_tokens_per_s']:.0f} tokens/s; median TTFT "
          f"{'n/a' if f is None else f'{f * 1e3:.1f} ms'}, TPOT {'n/a' if t is None else f'{t * 1e3:.2f} ms'}, "
          f"ITL p99 {'n/a' if itl is None else f'{itl * 1e3:.2f} ms'}")
    for e in summary["errors"]:
        print(f"  {e}")
    server = summary["server"]
    if server:
        print(f"the engine meanwhile: {server.get('steps', 'n/a')} steps, {server.get('plans', 'n/a')} plans, "
              f"{server.get('preemptions', 'n/a')} preemptions")
    if slo is not None:
        print("SLO " + slo)
