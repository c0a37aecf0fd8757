"""Request traces from public production logs in CSV: arrival times and token counts as a RequestTrace.

`CsvColumns` names the three columns a log must have (arrival time, prompt tokens, output tokens) and optionally a
column whose values become the requests' domains; `FORMATS` has the layouts of two public logs:

* `azure`: the Azure LLM inference traces (2023, 2024): `TIMESTAMP` (a date and time), `ContextTokens`,
  `GeneratedTokens`;
* `burstgpt`: BurstGPT: `Timestamp` (seconds), `Request tokens`, `Response tokens`, and `Model` as the domain.

Times are either numbers (seconds) or dates and times; arrivals are seconds after the first request kept, in
time order (stable). Rows without a prompt or an output token (failed requests) are dropped and counted: a served
request needs at least one of each. Prompts have no token ids (prefix caching needs them) and the trace has no
routing: the simulator draws it (pwsim.workload).
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass

import numpy as np

from traces.clikit import UserError
from traces.generators import MAX_LENGTH
from traces.schema import RequestTrace, TraceError


@dataclass(frozen=True)
class CsvColumns:
    time: str
    prompt: str
    output: str
    domain: str | None = None  # a column whose values are the domains (None: every request gets one name)


FORMATS = {
    "azure": CsvColumns("TIMESTAMP", "ContextTokens", "GeneratedTokens"),
    "burstgpt": CsvColumns("Timestamp", "Request tokens", "Response tokens", domain="Model"),
}


@dataclass(frozen=True)
class Imported:
    trace: RequestTrace
    rows: int      # rows in the file
    dropped: int   # rows without a prompt or an output token (or with a missing value)


def _seconds(column, name: str) -> np.ndarray:
    """A time column as float seconds: numbers as they are, timestamps (or text that parses as dates) by their
    nanoseconds."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if pa.types.is_timestamp(column.type):
        return column.cast(pa.timestamp("ns")).cast(pa.int64()).to_numpy(zero_copy_only=False).astype(np.float64) / 1e9
    if pa.types.is_integer(column.type) or pa.types.is_floating(column.type):
        return column.cast(pa.float64()).to_numpy(zero_copy_only=False)
    text = pc.cast(column, pa.string()).to_numpy(zero_copy_only=False)
    try:
        stamps = np.array(text, dtype="datetime64[ns]")
    except ValueError as e:
        raise UserError(f"column {name!r} holds neither numbers (seconds) nor dates and times ({e})") from None
    return stamps.astype(np.int64).astype(np.float64) / 1e9


def _token_counts(values: np.ndarray, name: str, path: str | os.PathLike) -> np.ndarray:
    """A token-count column (missing values as 0, NaN as missing), refused at its first value that is not a whole
    number from 0 to MAX_LENGTH (a request trace holds them as int32)."""
    bad = np.flatnonzero(~np.isnan(values) & ((values < 0) | (values > MAX_LENGTH) | (values != np.floor(values))))
    if bad.size:
        raise TraceError(str(path), f"{values[bad[0]]:.15g} is not a token count", column=name, row=int(bad[0]),
                         fix=f"token counts are whole numbers from 0 to {MAX_LENGTH:,} (2**31 - 1); fix or drop "
                             "the row")
    return values


def read_csv_trace(path: str | os.PathLike, columns: CsvColumns, domain: str = "imported", start_s: float = 0.0,
                   max_requests: int | None = None) -> Imported:
    """The requests of a CSV log (see the module docstring): those arriving `start_s` seconds or more after its
    first request, at most `max_requests` of them, arrival times from the first of those."""
    import pyarrow as pa
    import pyarrow.compute as pc
    from pyarrow import csv

    if max_requests is not None and max_requests < 1:
        raise UserError(f"--max-requests must be at least 1, got {max_requests}")
    if not start_s >= 0:
        raise UserError(f"--start-s must be >= 0, got {start_s}")
    try:
        table = csv.read_csv(path)
    except FileNotFoundError:
        raise UserError(f"{path}: no such file; give a CSV log") from None
    except (pa.ArrowInvalid, OSError) as e:
        raise UserError(f"{path} is not a readable CSV file ({e})") from None
    wanted = [c for c in (columns.time, columns.prompt, columns.output, columns.domain) if c is not None]
    missing = [c for c in wanted if c not in table.column_names]
    if missing:
        raise UserError(f"{path} has no column {', '.join(map(repr, missing))}; it has {table.column_names} (choose "
                        "--format, or name the columns with --time-column / --prompt-column / --output-column)")
    times = _seconds(table[columns.time], columns.time)
    counts = []
    for name in (columns.prompt, columns.output):
        col = table[name]
        if not (pa.types.is_integer(col.type) or pa.types.is_floating(col.type) or pa.types.is_null(col.type)):
            raise UserError(f"column {name!r} must hold token counts (numbers), it holds {col.type}")
        counts.append(_token_counts(pc.fill_null(col.cast(pa.float64()), 0.0).to_numpy(zero_copy_only=False),
                                    name, path))
    prompt, output = counts
    keep = np.isfinite(times) & (prompt >= 1) & (output >= 1)
    order = np.flatnonzero(keep)[np.argsort(times[keep], kind="stable")]
    if order.size:
        order = order[times[order] - times[order[0]] >= start_s]
    if max_requests is not None:
        order = order[:max_requests]
    if order.size == 0:
        raise UserError(f"{path}: no request left (of {table.num_rows} rows, {int((~keep).sum())} lack a prompt or "
                        "an output token or a time; the rest are before --start-s)")
    if columns.domain is not None:
        names = pc.cast(table[columns.domain], pa.string()).to_numpy(zero_copy_only=False)[order]
        names = np.array([domain if v is None or v == "" else str(v) for v in names], dtype=object)
    else:
        names = np.full(order.size, domain, dtype=object)
    arrival = times[order] - times[order[0]]
    trace = RequestTrace.from_columns(np.arange(order.size), arrival, prompt[order].astype(np.int64),
                                      output[order].astype(np.int64), names,
                                      provenance={"kind": "imported", "file": os.path.basename(str(path)),
                                                  "columns": asdict(columns), "start_s": start_s,
                                                  "rows": table.num_rows, "dropped": int((~keep).sum())},
                                      source=str(path))
    return Imported(trace, table.num_rows, int((~keep).sum()))
