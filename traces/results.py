"""Run results both engines write: per-request latency columns, their statistics, and atomic result directories.

`pwsim run` and `pwruntime replay` describe a served trace the same way, so `pwsim fidelity` can put
one beside the other: `requests.parquet` (one row per request: request_id, arrival_s, first_token_s,
finish_s, ttft_s, tpot_s, e2e_s, output_tokens, ...), `timeline.parquet` (one row per iteration
boundary: time_s, iter_s, batch_tokens, ...), `plans.parquet` (one row per plan transition begun, refused or
landed: `policies.plan_log`; `read_plan_log`), `summary.json` and `config.json`. Times are seconds
from the start of the trace (its arrival clock). Both may warm up first (`--warmup-requests N`): the trace's first N
prompts at once, WARMUP_TOKENS output tokens each, before the clock starts and outside every metric.
"""
from __future__ import annotations

import json
import math
from collections import Counter
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from traces.clikit import UserError, check_output, default_mode

RESULT_MARKER = "summary.json"
WARMUP_TOKENS = 16  # output tokens of each warm-up request (at most its recorded output length)
REQUIRED_REQUEST_COLUMNS = ("request_id", "ttft_s", "tpot_s", "e2e_s")  # what `pwsim fidelity` pairs and compares


# ---------------------------------------------------------------- latency metrics
def latency_columns(arrival_s, first_token_s, finish_s, output_tokens) -> dict[str, np.ndarray]:
    """TTFT, TPOT and end-to-end latency per request (NaN where a request has no first token or finish;
    TPOT only for requests of more than one output token: (finish - first) / (tokens - 1))."""
    arrival, first, finish = (np.asarray(a, dtype=np.float64) for a in (arrival_s, first_token_s, finish_s))
    out = np.asarray(output_tokens, dtype=np.int64)
    with np.errstate(invalid="ignore", divide="ignore"):
        tpot = np.where(out > 1, (finish - first) / (out - 1), np.nan)
    return {"ttft_s": first - arrival, "tpot_s": tpot, "e2e_s": finish - arrival}


def percentile(a, p: float) -> float | None:
    a = np.asarray(a, dtype=np.float64)
    a = a[np.isfinite(a)]
    return float(np.percentile(a, p)) if a.size else None


def stats(a) -> dict:
    """mean, p50, p90, p95, p99 and max of the finite values (None when there are none)."""
    a = np.asarray(a, dtype=np.float64)
    f = a[np.isfinite(a)]
    return {"mean": float(f.mean()) if f.size else None, "p50": percentile(f, 50), "p90": percentile(f, 90),
            "p95": percentile(f, 95), "p99": percentile(f, 99), "max": float(f.max()) if f.size else None}


class TokenGaps:
    """Inter-token latency (vLLM's ITL): the time between consecutive output tokens of each of `n` requests, from the
    times an engine settles them (or a streaming client receives them). Unlike TPOT, a request's mean, it keeps each
    gap, so a stall (a prefill beside the decodes, a wait for a page move, a recompute after preemption) shows in
    its tail. `max_s`: each request's longest gap (NaN before its second token); `all()`: every gap so far."""

    def __init__(self, n: int) -> None:
        self.last_s = np.full(n, np.nan)  # when each request's latest token came
        self.max_s = np.full(n, np.nan)
        self._gaps: list[np.ndarray] = []

    def settled(self, rows, now) -> None:
        """Requests `rows` (each once) got a token at `now` (one time, or one a row)."""
        rows = np.asarray(rows, dtype=np.int64)
        now = np.broadcast_to(np.asarray(now, dtype=np.float64), rows.shape)
        prev = self.last_s[rows]
        seen = ~np.isnan(prev)
        if seen.any():
            gap, r = now[seen] - prev[seen], rows[seen]
            self._gaps.append(gap)
            self.max_s[r] = np.fmax(self.max_s[r], gap)
        self.last_s[rows] = now

    def all(self) -> np.ndarray:
        return np.concatenate(self._gaps) if self._gaps else np.empty(0)


def request_columns(request_id, domain, arrival_s, prompt_tokens, output_tokens, first_token_s, finish_s, preemptions,
                    finish_reason, first_scheduled_s=None, max_itl_s=None) -> dict[str, np.ndarray]:
    """The per-request table of a result directory (`requests.parquet`), latencies included, in trace order; with
    `first_scheduled_s` (an engine's: when a batch first held each request) its queueing delay `queue_s` too, and with
    `max_itl_s` (`TokenGaps.max_s`) each request's longest time between two of its tokens."""
    n = len(arrival_s)
    extra = {}  # the optional columns
    if first_scheduled_s is not None:
        scheduled = np.asarray(first_scheduled_s, dtype=np.float64)
        extra |= {"first_scheduled_s": scheduled, "queue_s": scheduled - np.asarray(arrival_s, dtype=np.float64)}
    if max_itl_s is not None:
        extra["max_itl_s"] = np.asarray(max_itl_s, dtype=np.float64)
    return {"request": np.arange(n), "request_id": np.asarray(request_id), "domain": np.asarray(domain, dtype=object),
            "arrival_s": np.asarray(arrival_s, dtype=np.float64), "prompt_tokens": np.asarray(prompt_tokens, dtype=np.int64),
            "output_tokens": np.asarray(output_tokens, dtype=np.int64), "first_token_s": np.asarray(first_token_s),
            "finish_s": np.asarray(finish_s), **extra,
            **latency_columns(arrival_s, first_token_s, finish_s, output_tokens),
            "preemptions": np.asarray(preemptions), "finish_reason": np.asarray(finish_reason).astype(str)}


def request_summary(requests: dict[str, np.ndarray], itl_s: np.ndarray | None = None) -> dict:
    """What a run's summary says about its requests (from `request_columns`): completions, makespan (first arrival
    to last finish), throughputs over it (output tokens, as vLLM's benchmark's "output token throughput"; prompt and
    output tokens; completed requests), and latency statistics of the requests that have them; with `itl_s`
    (`TokenGaps.all()`) those of every gap between two tokens of a request."""
    arrival, finish, reason = requests["arrival_s"], requests["finish_s"], requests["finish_reason"]
    n = len(arrival)
    start = float(arrival.min()) if n else 0.0
    end = float(np.nanmax(finish)) if n and np.isfinite(finish).any() else start  # nothing finished: no span
    out_total, span = int(requests["output_tokens"].sum()), max(end - start, 1e-12)
    completed = int(np.isin(reason, ("length", "stop")).sum())
    return {"requests": n, "completed": completed,
            "finish_reasons": dict(Counter(reason.tolist())), "unfinished": int(np.isnan(finish).sum()),
            "makespan_s": end - start, "output_tokens": out_total,
            "throughput_tokens_per_s": out_total / span,
            "total_tokens_per_s": (int(requests["prompt_tokens"].sum()) + out_total) / span,
            "requests_per_s": completed / span,
            "ttft_s": stats(requests["ttft_s"]), "tpot_s": stats(requests["tpot_s"]), "e2e_s": stats(requests["e2e_s"]),
            **({"queue_s": stats(requests["queue_s"])} if "queue_s" in requests else {}),
            **({"itl_s": stats(itl_s)} if itl_s is not None else {})}


def slo_attainment(requests: dict[str, np.ndarray], ttft_s: float | None, tpot_s: float | None) -> dict:
    """How many requests (`request_columns`) completed within the latency bounds (None: not bounded): TTFT at most
    `ttft_s` and TPOT at most `tpot_s` (a one-token output has no TPOT and passes it); unfinished requests miss. The
    share of requests that met them (`attainment`) and their rate over the makespan (`goodput_rps`)."""
    met = np.isin(requests["finish_reason"], ("length", "stop"))
    if ttft_s is not None:
        met &= np.asarray(requests["ttft_s"], dtype=np.float64) <= ttft_s
    if tpot_s is not None:
        met &= ~(np.asarray(requests["tpot_s"], dtype=np.float64) > tpot_s)
    n, span = len(met), request_summary(requests)["makespan_s"]
    return {"ttft_s": ttft_s, "tpot_s": tpot_s, "met": int(met.sum()), "requests": n,
            "attainment": float(met.mean()) if n else None, "goodput_rps": float(met.sum()) / max(span, 1e-12)}


def slo_line(slo: dict) -> str:
    """`traces.results.slo_attainment`'s result in words."""
    bounds = " and ".join(b for b in (None if slo["ttft_s"] is None else f"TTFT <= {slo['ttft_s'] * 1e3:g} ms",
                                      None if slo["tpot_s"] is None else f"TPOT <= {slo['tpot_s'] * 1e3:g} ms") if b)
    return (f"{bounds}: {slo['met']}/{slo['requests']} requests ({100 * (slo['attainment'] or 0):.1f}%), goodput "
            f"{slo['goodput_rps']:.3g} requests/s")


def add_slo_flags(parser) -> None:
    """`--slo-ttft SECONDS` and `--slo-tpot MS`: report `slo_attainment` in the summary (`slo_bounds` reads them)."""
    parser.add_argument("--slo-ttft", type=float, default=None, metavar="SECONDS",
                        help="also report the share of requests that completed with a TTFT at most this (and TPOT "
                             "within --slo-tpot), and their rate (goodput)")
    parser.add_argument("--slo-tpot", type=float, default=None, metavar="MS",
                        help="the TPOT bound of that share, in milliseconds")


def slo_bounds(args) -> tuple[float | None, float | None] | None:
    """(TTFT s, TPOT s) from `add_slo_flags`'s flags; None when neither is given. A bound must be a number > 0."""
    if args.slo_ttft is None and args.slo_tpot is None:
        return None
    for flag, v in (("--slo-ttft", args.slo_ttft), ("--slo-tpot", args.slo_tpot)):
        if v is not None and not 0 < v < math.inf:
            raise UserError(f"{flag} must be a number > 0, got {v}")
    return args.slo_ttft, None if args.slo_tpot is None else args.slo_tpot / 1e3


# ---------------------------------------------------------------- JSON and Parquet
def clean(obj):
    """JSON-safe copy: numpy scalars/arrays to Python, NaN/inf to None."""
    if isinstance(obj, dict):
        return {str(k): clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [clean(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return clean(obj.tolist())
    if isinstance(obj, np.generic):
        return clean(obj.item())
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


def dumps(obj) -> str:
    return json.dumps(clean(obj), indent=2, sort_keys=False)


def columns_table(cols: dict) -> pa.Table:
    out = {}
    for k, v in cols.items():
        a = np.asarray(v)
        out[k] = pa.array(a.tolist() if a.dtype == object else a)
    return pa.table(out)


def read_columns(path: Path) -> dict[str, np.ndarray]:
    table = pq.read_table(path)
    return {name: table.column(name).to_numpy(zero_copy_only=False) for name in table.column_names}


# ---------------------------------------------------------------- result directories
RUNTIME_TOOLS = ("replay", "bench serve")  # the `tool` names of the runtime's results (`result_tool`)
_COMMANDS = {"pwsim": "pwsim run", "replay": "pwruntime replay", "bench serve": "pwruntime bench serve"}


def result_tool(path: str | os.PathLike) -> str | None:
    """Which tool wrote the result directory `path`, as its config.json records it: "replay" or "bench serve" (their
    `command`, `target`), "pwsim" (a `pwsim run`: its RunConfig, `budget_bytes`); None where it does not say."""
    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    if config.get("command") == "replay":
        return "replay"
    if config.get("command") == "bench" and config.get("target") == "serve":
        return "bench serve"
    return "pwsim" if "budget_bytes" in config else None


def command_of(tool: str) -> str:
    """A `tool` name (`result_tool`, `prepare_dir`) as the command line that writes such results."""
    return _COMMANDS.get(tool, tool)


def prepare_dir(out: str | os.PathLike, force: bool, tool: str = "pwsim", marker: str = RESULT_MARKER) -> Path:
    """Refuse, unless forced, to write into a directory that holds something other than a previous result of `tool`
    (one with `marker`, and for a run's result one that no other tool wrote: `result_tool`; one that does not say is
    taken as `tool`'s), and an `out` that cannot be written (`check_output`)."""
    out = check_output(out)
    if force or not out.is_dir() or not any(out.iterdir()):
        return out
    if not (out / marker).exists():
        raise UserError(f"--out {out} is not empty and holds no previous `{command_of(tool)}` result; choose another "
                        "directory or pass --force")
    other = result_tool(out) if marker == RESULT_MARKER else None
    if other not in (None, tool):
        raise UserError(f"--out {out} holds a `{command_of(other)}` result, not a `{command_of(tool)}` one; choose "
                        "another directory or pass --force to replace it")
    stranger = _not_a_result_file(out) if marker == RESULT_MARKER else None  # a run's result replaces the directory
    if stranger is not None:
        raise UserError(f"--out {out} holds a previous result and also {stranger}, which a result does not; choose "
                        "another directory or pass --force to replace it all")
    return out


RESULT_SUFFIXES = (".json", ".parquet", ".png", ".csv")  # what the tools' results are made of


def _not_a_result_file(folder: Path) -> Path | None:
    """The first file under `folder` that no result writes (a note of one's own, say), or None."""
    for entry in sorted(folder.iterdir()):
        if entry.is_dir() and not entry.is_symlink():
            inner = _not_a_result_file(entry)
            if inner is not None:
                return inner
        elif not (entry.is_file() and entry.suffix in RESULT_SUFFIXES):
            return entry
    return None


def prepare_trace_dir(out: str | os.PathLike, force: bool) -> Path:
    """--out as a trace directory to write (`check_output`): refused when it is a run's result directory, and unless
    `force` when it holds anything (a trace among them)."""
    from traces.io import REQUESTS_FILE

    out = check_output(out)
    if (out / RESULT_MARKER).is_file():
        raise UserError(f"--out {out} is a run's result directory ({RESULT_MARKER}), not a trace directory; choose "
                        "another directory")
    if not force and out.is_dir() and any(out.iterdir()):
        what = f"already holds a trace ({REQUESTS_FILE})" if (out / REQUESTS_FILE).exists() else "is not empty"
        raise UserError(f"--out {out} {what}; choose another directory or pass --force to write the trace there")
    return out


def _replace_dir(tmp: Path, out: Path) -> None:
    if out.exists():
        old = out.with_name(f".{out.name}.old")
        if old.exists():
            shutil.rmtree(old)
        out.rename(old)
        tmp.rename(out)
        shutil.rmtree(old)
    else:
        tmp.rename(out)


def write_result_dir(out: str | os.PathLike, tables: dict[str, dict], documents: dict[str, object],
                     extra: Callable[[Path], None] | None = None, force: bool = False, tool: str = "pwsim") -> Path:
    """Write `<name>.parquet` per table (columns) and `<name>.json` per document into `out`, then call
    `extra(dir)` (plots); all in a temporary sibling renamed into place, so `out` is never half-written."""
    out = Path(out)
    prepare_dir(out, force, tool)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = default_mode(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        for name, cols in tables.items():
            pq.write_table(columns_table(cols), tmp / f"{name}.parquet", compression="zstd")
        for name, doc in documents.items():
            (tmp / f"{name}.json").write_text(dumps(doc))
        if extra is not None:
            extra(tmp)
        _replace_dir(tmp, out)
    except OSError as e:  # a disk that fills up, a folder that went away: nothing of the result stays
        shutil.rmtree(tmp, ignore_errors=True)
        raise UserError(f"cannot write the result to {out} ({e.strerror or e}); nothing was written") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def instant_page_moves(summary: dict) -> bool | None:
    """Whether a runtime result's page moves landed at the boundary that began them: a replay's summary says so; one
    older than that did when it ran on the CPU (its runtime has no copy stream); None where a result does not say
    (a served run)."""
    if "instant_page_moves" in summary:
        return bool(summary["instant_page_moves"])
    return summary["device"] == "cpu" if "device" in summary else None


def kept_out_of_pool(config: dict) -> int:
    """What a runtime result's KV pool left out of its budget beside the weights, as the simulator's
    `--activation-reserve` keeps it: the activation reserve and the serving reserve (its CUDA graphs and buffers), each
    0 where a result older than it has none."""
    return int(config.get("activation_reserve") or 0) + int(config.get("serving_reserve") or 0)


_INCOMPLETE = "give the --out of a complete `pwsim run` or `pwruntime replay` (or run it again)"


def _result_table(path: Path, name: str, flag: str) -> dict[str, np.ndarray]:
    """The Parquet table `name` of the result directory `path`; an unreadable one is a UserError naming it."""
    try:
        return read_columns(path / name)
    except (OSError, pa.ArrowException) as e:
        reason = str(e).splitlines()[0][:160]
        raise UserError(f"{flag} {path}: {name} is not a readable Parquet file ({reason}); {_INCOMPLETE}") from None


def read_plan_log(path: str | os.PathLike, flag: str = "--run") -> dict[str, np.ndarray]:
    """The plan log of a result directory (`plans.parquet`, `policies.plan_log` columns); empty where the run wrote
    none (an older result, a served run)."""
    path = Path(path)
    return _result_table(path, "plans.parquet", flag) if (path / "plans.parquet").is_file() else {}


def read_result_dir(path: str | os.PathLike, flag: str = "--run") -> tuple[dict, dict[str, np.ndarray], dict[str, np.ndarray], dict]:
    """(summary, request columns, timeline columns, config) of a result directory; a missing or partial one is a
    UserError."""
    path = Path(path)
    if not path.is_dir():
        raise UserError(f"{flag} {path} {'is a file' if path.exists() else 'does not exist'}; give the --out "
                        "directory of a `pwsim run` or `pwruntime replay`")
    if not (path / RESULT_MARKER).is_file() or not (path / "requests.parquet").is_file():
        levels = sorted(p.name for p in path.glob("c[0-9]*") if (p / "requests.parquet").is_file())
        if levels:  # a concurrency sweep (traces.sweep): its levels are the result directories
            raise UserError(f"{flag} {path} is a concurrency sweep, not one run; give one of its levels "
                            f"({', '.join(str(path / name) for name in levels)})")
        raise UserError(f"{flag} {path} is not a result directory (no summary.json and requests.parquet); give the "
                        "--out of a `pwsim run` or `pwruntime replay`")

    def document(name: str) -> dict:
        try:
            doc = json.loads((path / name).read_text())
        except (OSError, ValueError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            raise UserError(f"{flag} {path}: {name} is not readable JSON ({e}); {_INCOMPLETE}") from None
        if not isinstance(doc, dict):
            raise UserError(f"{flag} {path}: {name} is not a JSON object; {_INCOMPLETE}")
        return doc

    summary = document(RESULT_MARKER)
    requests = _result_table(path, "requests.parquet", flag)
    missing = [c for c in REQUIRED_REQUEST_COLUMNS if c not in requests]
    if missing:
        raise UserError(f"{flag} {path}: requests.parquet lacks column(s) {', '.join(missing)}; {_INCOMPLETE}")
    timeline = _result_table(path, "timeline.parquet", flag) if (path / "timeline.parquet").is_file() else {}
    config = document("config.json") if (path / "config.json").is_file() else {}
    return summary, requests, timeline, config
