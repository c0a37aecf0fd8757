"""`pwruntime serve`: the OpenAI-compatible HTTP server (pwruntime.server) over one engine.

Endpoints: POST /v1/completions and /v1/chat/completions (with `"stream": true` for server-sent
events), GET /v1/models, /health, /version and Prometheus /metrics, POST /tokenize and /detokenize. The same model,
engine and planner options as `pwruntime generate` (--ap/--calibration/--policy serve AP experts with a planner); the
engine runs in a process of its own (pwruntime.engine_process) and logs a stats line every --log-stats-interval.
Listens on 127.0.0.1 by default; with --api-key (or $PAGEDWEIGHT_API_KEY) every /v1 request needs it as a bearer
token. Stop it with Ctrl-C or SIGTERM: it stops accepting connections at once and gives the requests in flight up to
--shutdown-timeout seconds to finish, then answers each one still running with a 503 (a stream ends with an error
event and [DONE]); a second Ctrl-C or SIGTERM does that at once. It exits 0. With --record-trace DIR the engine
records the requests it served (arrival times, prompt token ids, output lengths) and the routing its forwards
computed for them, and writes them as a trace directory when the server stops, the planner's log beside them: `pwsim
run --trace DIR` simulates what was served, `pwsim plan-log DIR` shows what the planner moved.
"""
from __future__ import annotations

import argparse
import errno
import os
import socket

from traces.clikit import UserError

API_KEY_ENV = "PAGEDWEIGHT_API_KEY"
SHUTDOWN_GRACE_S = 5.0  # after the drain: for handlers to write their last bytes


def register(subparsers) -> None:
    from pwruntime.cmd_generate import add_engine_args

    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--served-model-name", default=None, help="model id in the API (default: the model folder name)")
    p.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                   help=f"require 'Authorization: Bearer KEY' on every /v1 request (default: ${API_KEY_ENV}, if set; "
                        "none: open)")
    p.add_argument("--shutdown-timeout", type=float, default=60.0, metavar="SECONDS",
                   help="on Ctrl-C or SIGTERM, how long requests in flight may take to finish (default 60)")
    p.add_argument("--log-stats-interval", type=float, default=10.0, metavar="SECONDS",
                   help="while requests run, log a line of throughput, queue, KV cache and expert bits this often "
                        "(default 10; 0: never, as vLLM's --disable-log-stats)")
    p.add_argument("--record-trace", default=None, metavar="DIR",
                   help="record the requests served, the routing computed for them and the planner's log; written "
                        "to DIR (a new directory) as a trace when the server stops, for `pwsim run --trace DIR` and "
                        "`pwsim plan-log DIR`")
    p.add_argument("--record-trace-max-requests", type=int, default=1000, metavar="N",
                   help="record the first N requests (default 1000; a request's routing takes about "
                        "layers x top_k x 12 bytes a token of host memory)")
    add_engine_args(p)
    p.set_defaults(func=run)


def _check_record_trace(args) -> None:
    from pathlib import Path

    if args.record_trace is None:
        return
    out = Path(args.record_trace)
    if out.exists():
        raise UserError(f"--record-trace {out} exists; give a new directory (a trace is written there when the "
                        "server stops)")
    if not out.parent.is_dir() or not os.access(out.parent, os.W_OK):
        raise UserError(f"--record-trace {out}: cannot write in {out.parent}; give a directory in a writable folder")
    if args.record_trace_max_requests < 1:
        raise UserError(f"--record-trace-max-requests must be >= 1, got {args.record_trace_max_requests}")
    if args.enable_prefix_caching:
        raise UserError("--record-trace records the routing of every prompt token, which prefix caching skips: "
                        "drop --enable-prefix-caching")


def _listen_error(host: str, port: int, e: OSError) -> UserError:
    if e.errno in (errno.EADDRINUSE, errno.EACCES):
        fix = "choose another --port" + (" (above 1023)" if e.errno == errno.EACCES else "")
    else:  # a name that does not resolve, an address that is not this machine's
        fix = "give a --host of this machine (127.0.0.1, or 0.0.0.0 for every interface)"
    return UserError(f"cannot listen on {host}:{port} ({e.strerror or e}); {fix}")


def _check_listen(host: str, port: int) -> None:
    """Bind (and release) every address the server will listen on, as asyncio does, before the model is loaded."""
    try:
        for family, _, _, _, addr in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE):
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6:
                    s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                s.bind(addr)
    except OSError as e:
        raise _listen_error(host, port, e) from None


def run(args) -> int:
    from aiohttp import web

    from pwruntime.cmd_generate import engine_model_dir
    from pwruntime.engine_process import EngineProcess
    from pwruntime.server import Server

    if not 0 <= args.port <= 65535:
        raise UserError(f"--port must be in 0..65535, got {args.port}")
    if not 0 < args.shutdown_timeout < float("inf"):
        raise UserError(f"--shutdown-timeout must be a number of seconds > 0, got {args.shutdown_timeout}")
    if not 0 <= args.log_stats_interval < float("inf"):
        raise UserError(f"--log-stats-interval must be a number of seconds >= 0 (0: no stats lines), got "
                        f"{args.log_stats_interval}")
    _check_listen(args.host, args.port)
    _check_record_trace(args)
    model_dir = engine_model_dir(args)
    worker = EngineProcess.launch(args)  # loads the model and captures its CUDA graphs, in the engine's process
    server = Server(worker, args.served_model_name or model_dir.name, api_key=args.api_key or None,
                    shutdown_timeout=args.shutdown_timeout)
    print(f"serving {model_dir} on http://{args.host}:{args.port}/v1 (Ctrl-C to stop)", flush=True)
    try:
        # handler cancellation: a client that leaves cancels its handler, which aborts its request (pwruntime.server)
        # the server's drain ends what still runs after --shutdown-timeout with a 503 each; aiohttp's own wait after
        # it only sees their handlers write that (it waited the timeout twice, then cut streams without an error)
        web.run_app(server.app, host=args.host, port=args.port, print=None, handler_cancellation=True,
                    shutdown_timeout=SHUTDOWN_GRACE_S)
    except OSError as e:
        raise _listen_error(args.host, args.port, e) from None
    finally:
        worker.stop(timeout=10.0 if args.record_trace is None else 600.0)  # the engine writes the trace, then exits
    return 0
