"""`pwruntime serve`: the OpenAI-compatible HTTP server (pwruntime.server) over one engine.

Endpoints: POST /v1/completions and /v1/chat/completions (with `"stream": true` for server-sent
events), GET /v1/models, /health and Prometheus /metrics. The same model, engine and planner
options as `pwruntime generate` (--ap/--calibration/--policy serve AP experts with a planner).
Listens on 127.0.0.1 by default; stop it with Ctrl-C.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from traces.clikit import UserError


def register(subparsers) -> None:
    from pwruntime.cmd_generate import add_engine_args

    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--served-model-name", default=None, help="model id in the API (default: the model folder name)")
    add_engine_args(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from aiohttp import web

    from pwruntime.cmd_generate import build_engine
    from pwruntime.server import EngineWorker, Server

    if not 0 <= args.port <= 65535:
        raise UserError(f"--port must be in 0..65535, got {args.port}")
    engine, model_dir, _, _ = build_engine(args)
    worker = EngineWorker(engine).start()
    server = Server(worker, args.served_model_name or Path(str(model_dir)).name)
    print(f"serving {model_dir} on http://{args.host}:{args.port}/v1 (Ctrl-C to stop)", flush=True)
    try:
        web.run_app(server.app, host=args.host, port=args.port, print=None)
    except OSError as e:
        raise UserError(f"cannot listen on {args.host}:{args.port} ({e.strerror}); choose another --port") from None
    finally:
        worker.stop()
    return 0
