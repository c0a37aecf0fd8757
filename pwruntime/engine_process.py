"""EngineProcess: the engine loop (pwruntime.engine_core) in a process of its own, as vLLM's engine core runs.

The HTTP server's process parses requests, tokenizes chats, turns tokens into text and writes the streams; the
engine's process builds the model from the command line's options (pwruntime.cmd_generate.build_engine), captures
its CUDA graphs and steps it. In one process the two would share the GIL: every chunk a stream writes would delay
the next step. Requests go to the engine process and one batch of events per step comes back, each over a pipe of
its own (pickled); a thread of the server's process hands the batches to the requests (EngineClient._deliver).

The engine process ignores SIGINT (a Ctrl-C reaches the whole process group; the server's graceful shutdown decides
when the engine stops) and exits when the server's process goes away. A model that cannot be loaded is the user's
error, raised in the server's process with the same message; an engine process that dies while serving fails the
requests in flight with a 503 and /health says so. Its stats lines (`--log-stats-interval`) go to its stderr, which
is the server's. With `--record-trace DIR` its engine records what it serves (pwruntime.trace_recorder) and its loop
what the planner did (policies.plan_log), and the process writes both (the trace, and its `plans.parquet`) once its
loop has stopped, before it exits.
"""
from __future__ import annotations

import multiprocessing
import queue
import signal
import sys
import threading
import time
import traceback

from policies.plan_log import PlanLog
from pwruntime.engine_client import EngineClient
from pwruntime.engine_core import EngineCore
from pwruntime.stats_log import StatsLog, ready_line, serving_info
from traces.clikit import UserError


class EngineProcess(EngineClient):
    """An EngineCore over the engine `args` (the options of pwruntime.cmd_generate.add_engine_args) describe, in a
    child process."""

    @classmethod
    def launch(cls, args) -> "EngineProcess":
        """Start the engine process and wait until its model is loaded (UserError: the message of its user error)."""
        ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: nothing of this one's CUDA state or threads
        inbox_read, inbox = ctx.Pipe(duplex=False)
        outbox, outbox_write = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_engine_main, args=(args, inbox_read, outbox_write), name="pagedweight-engine",
                           daemon=True)
        proc.start()
        inbox_read.close()
        outbox_write.close()
        kind, *rest = _first_message(proc, outbox)
        if kind != "ready":
            proc.join(10)  # it returns after saying why
        if kind == "failed":
            raise UserError(rest[0])
        if kind != "ready":
            raise RuntimeError(f"the engine process failed while loading the model:\n{rest[0]}")
        return cls(proc, inbox, outbox, *rest)

    def __init__(self, proc, inbox, outbox, tokenizer, vocab: int, info: dict) -> None:
        """Over a running engine process `proc` whose loop reads `inbox` and writes `outbox` (use `launch`)."""
        super().__init__(tokenizer, vocab, info)
        self._proc, self._inbox, self._outbox = proc, inbox, outbox
        self._stopping = False
        self._send_lock = threading.Lock()
        threading.Thread(target=self._read, name="pagedweight-engine-events", daemon=True).start()

    @property
    def alive(self) -> bool:
        return super().alive and self._proc.is_alive()

    def stop(self, timeout: float = 10.0) -> None:
        """Let the engine process finish its turn and exit (killed after `timeout` seconds)."""
        self._stopping = True
        self._send(None)
        self._proc.join(timeout)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()

    def _send(self, item: tuple | None) -> None:
        try:
            with self._send_lock:
                self._inbox.send(item)
        except OSError:  # the engine process is gone: the reader fails what is in flight
            pass

    def _read(self) -> None:
        try:
            while True:
                self._deliver(self._outbox.recv())
        except (EOFError, OSError):
            pass
        self._proc.join(5)
        if self._stopping:
            self._fail_all("the server is shutting down")
        else:
            self._fail_all(f"the engine process exited (exit code {self._proc.exitcode}); its messages are in the "
                           "server's log; restart the server")


def _first_message(proc, outbox) -> tuple:
    """The engine process's first message ("ready", "failed" or "crashed"); RuntimeError if it exits without one."""
    while True:
        try:
            if outbox.poll(0.5):
                return outbox.recv()
        except (EOFError, OSError):
            pass
        else:
            if proc.is_alive():
                continue
        proc.join()
        raise RuntimeError(f"the engine process exited (exit code {proc.exitcode}) while loading the model; its "
                           "messages are above")


def _forward(conn, inbox: queue.Queue) -> None:
    """In the engine process: the server's items into the loop's inbox; None (stop) once the server is gone."""
    try:
        while True:
            inbox.put(conn.recv())
    except (EOFError, OSError):
        inbox.put(None)


def _log_line(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _engine_main(args, inbox, outbox) -> None:
    """The engine process: build the engine, say so (or why not), then serve until told to stop."""
    from policies.calibration import CalibrationError
    from policies.registry import PolicyError
    from pwruntime.cmd_generate import build_engine

    for sig in (signal.SIGINT, signal.SIGTERM):   # a stop signal sent to the group (Ctrl-C, systemd's stop) is the
        signal.signal(sig, signal.SIG_IGN)        # server's to handle: it drains, then closes the pipe, our stop
    start = time.perf_counter()
    try:
        recorder = _recorder(args)
        engine = build_engine(args, recorder)[0]
        engine.capture_graphs()  # before the first request, which would otherwise pay the captures its steps need
    except (UserError, CalibrationError, PolicyError) as e:
        outbox.send(("failed", str(e)))
        return
    except BaseException:
        outbox.send(("crashed", traceback.format_exc()))
        return
    info = serving_info(engine)
    _log_line(ready_line(info, time.perf_counter() - start))
    outbox.send(("ready", engine.tokenizer, engine.model.config.vocab, info))

    def emit(events: list) -> None:
        try:
            outbox.send(events)
        except OSError:  # the server is gone; _forward stops the loop
            pass

    log = StatsLog(args.log_stats_interval, _log_line) if args.log_stats_interval > 0 else None
    core = EngineCore(engine, emit, log, plan_log=PlanLog() if recorder is not None else None)
    threading.Thread(target=_forward, args=(inbox, core.inbox), name="pagedweight-inbox", daemon=True).start()
    core.run()
    if recorder is not None:
        _write_trace(recorder, core.plan_log, args.record_trace)
    sys.stderr.flush()


def _recorder(args):
    """The TraceRecorder `--record-trace` asks for (None without it)."""
    if args.record_trace is None:
        return None
    from pwruntime.cmd_generate import engine_model_dir
    from pwruntime.trace_recorder import TraceRecorder, card_for

    model_dir = engine_model_dir(args)
    card, card_json = card_for(model_dir)
    return TraceRecorder(card=card, card_json=card_json, domain="served", max_requests=args.record_trace_max_requests,
                         provenance={"model": str(model_dir), "recorded_by": "pwruntime serve"})


def _write_trace(recorder, plan_log: PlanLog, out: str) -> None:
    if recorder.num_requests == 0:
        _log_line(f"no request was served: no trace written to {out}")
        return
    try:
        recorder.write(out, from_first_arrival=True, plans=plan_log.columns())
    except (OSError, UserError) as e:  # a full disk, a folder gone, a trace the schema refuses
        _log_line(f"could not write the recorded trace to {out}: {e}")
        return
    skipped = (f"; {recorder.skipped} later requests not recorded (--record-trace-max-requests)"
               if recorder.skipped else "")
    _log_line(f"recorded {recorder.num_requests} requests and their routing to {out} (`pwsim run --trace {out}`), "
              f"and the {len(plan_log.rows)} rows of the planner's log (`pwsim plan-log {out}`){skipped}")
