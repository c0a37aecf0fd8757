"""Trace files: read (validating) and write (atomically) request/routing traces and trace directories.

A trace directory holds `requests.parquet` and optionally `routing.parquet`. Readers accept any
integer width for integer columns and any float (or integer) type for float columns; anything else
is refused with one `TraceError` naming the file, the column and the row. Writers validate first,
write to a temporary file in the target directory and `os.replace` it into place, so a reader
never sees a half-written trace.
"""
from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from traces.clikit import default_mode, write_json_atomic
from traces.schema import (META_KEY, REQUEST_COLUMNS, REQUESTS, ROUTING, TOKEN_IDS_TYPE, RequestTrace, RoutingTrace,
                           TraceError, check_routing_against_requests, decode_metadata, encode_metadata,
                           routing_columns)

REQUESTS_FILE, ROUTING_FILE = "requests.parquet", "routing.parquet"
# the routing a replay's warm-up computed for the trace's first requests (`pwruntime replay --record-routing`)
WARMUP_ROUTING_FILE = "warmup_routing.parquet"
# the model card of a recorded trace whose model no bundled card describes (`pwsim run --model DIR/card.json`)
CARD_FILE = "card.json"


@dataclass(frozen=True)
class Trace:
    """What a trace path holds: a directory has both parts (routing optional), a file one of them."""
    requests: RequestTrace | None = None
    routing: RoutingTrace | None = None
    warmup_routing: RoutingTrace | None = None  # a directory's: its first requests' routing in a warm-up


# ---------------------------------------------------------------- reading columns
def _open(path: str | os.PathLike) -> tuple[pa.Table, str]:
    p = Path(path)
    if not p.exists():
        raise TraceError(str(p), "does not exist")
    if p.is_dir():
        raise TraceError(str(p), "is a directory, expected a .parquet file")
    try:
        return pq.read_table(p), str(p)
    except (pa.ArrowException, OSError) as e:
        reason = str(e).splitlines()[0][:160]
        raise TraceError(str(p), f"not a Parquet file ({reason})", fix="pass a trace written by PagedWeight") from None


def _column(table: pa.Table, file: str, name: str, what: str) -> pa.Array:
    if name not in table.column_names:
        raise TraceError(file, "missing column", column=name,
                         fix=f"a {what} trace needs columns {', '.join(_expected(what))}")
    col = table.column(name).combine_chunks()
    if col.null_count:
        row = int(np.flatnonzero(pc.is_null(col).to_numpy(zero_copy_only=False))[0])
        raise TraceError(file, "null value", column=name, row=row)
    return col


def _expected(what: str) -> list[str]:
    return list(REQUEST_COLUMNS) if what == REQUESTS else list(routing_columns(1, False))


def _ints(col: pa.Array, file: str, name: str, dtype) -> np.ndarray:
    if not pa.types.is_integer(col.type):
        raise TraceError(file, f"has type {col.type}, expected an integer type ({np.dtype(dtype).name})", column=name)
    vals = col.to_numpy(zero_copy_only=False)
    info = np.iinfo(dtype)
    bad = np.flatnonzero((vals < info.min) | (vals > info.max)) if vals.dtype != dtype else np.array([], int)
    if bad.size:
        raise TraceError(file, f"value {vals[bad[0]]} does not fit {np.dtype(dtype).name}", column=name, row=int(bad[0]))
    return vals.astype(dtype, copy=False)


def _floats(col: pa.Array, file: str, name: str, dtype) -> np.ndarray:
    if not (pa.types.is_floating(col.type) or pa.types.is_integer(col.type)):
        raise TraceError(file, f"has type {col.type}, expected a float type ({np.dtype(dtype).name})", column=name)
    return col.to_numpy(zero_copy_only=False).astype(dtype, copy=False)


def _strings(col: pa.Array, file: str, name: str) -> pa.Array:
    t = col.type
    if pa.types.is_dictionary(t) and (pa.types.is_string(t.value_type) or pa.types.is_large_string(t.value_type)):
        return col.cast(pa.string())
    if not (pa.types.is_string(t) or pa.types.is_large_string(t)):
        raise TraceError(file, f"has type {t}, expected string", column=name)
    return col


def _lists(col: pa.Array, file: str, name: str, width: int | None, conv) -> tuple[np.ndarray, np.ndarray]:
    """(offsets int64 [n+1], flat values) of a list column; `width` demands that many items per row."""
    t = col.type
    if not (pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)):
        raise TraceError(file, f"has type {t}, expected a list type", column=name)
    lengths = col.value_lengths().to_numpy(zero_copy_only=False).astype(np.int64)
    if width is not None:
        bad = np.flatnonzero(lengths != width)
        if bad.size:
            raise TraceError(file, f"has {lengths[bad[0]]} entries, the metadata says top_k = {width}", column=name,
                             row=int(bad[0]), fix="the file's metadata and its lists disagree; regenerate the trace")
    flat = col.flatten()
    if flat.null_count:
        at = int(np.flatnonzero(pc.is_null(flat).to_numpy(zero_copy_only=False))[0])
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        raise TraceError(file, "null inside a list", column=name, row=int(np.searchsorted(offsets, at, side="right") - 1))
    return np.concatenate([[0], np.cumsum(lengths)]), conv(flat, file, name)


# ---------------------------------------------------------------- request traces
def read_requests(path: str | os.PathLike) -> RequestTrace:
    table, file = _open(path)
    meta = decode_metadata(file, table.schema.metadata, REQUESTS, required=False)
    c = lambda name: _column(table, file, name, REQUESTS)  # noqa: E731
    domain = pc.dictionary_encode(_strings(c("domain"), file, "domain"))
    found = domain.dictionary.to_pylist()
    domains = list(meta.get("domains") or [])
    domains += sorted(set(found) - set(domains))  # the writer's domain order; unknown ones appended
    remap = np.array([domains.index(d) for d in found], dtype=np.int32)
    offsets = ids = None
    if "prompt_token_ids" in table.column_names:
        offsets, ids = _lists(c("prompt_token_ids"), file, "prompt_token_ids", None,
                              lambda a, f, n: _ints(a, f, n, np.int32))
    return RequestTrace(
        request_id=_ints(c("request_id"), file, "request_id", np.int64),
        arrival_s=_floats(c("arrival_s"), file, "arrival_s", np.float64),
        prompt_tokens=_ints(c("prompt_tokens"), file, "prompt_tokens", np.int32),
        output_tokens=_ints(c("output_tokens"), file, "output_tokens", np.int32),
        domain_idx=remap[domain.indices.to_numpy(zero_copy_only=False)] if len(found) else np.zeros(0, np.int32),
        domains=tuple(domains), token_offsets=offsets, token_ids=ids,
        provenance=meta.get("provenance") or {}, source=file)


def requests_table(trace: RequestTrace) -> pa.Table:
    cols = {"request_id": pa.array(trace.request_id), "arrival_s": pa.array(trace.arrival_s),
            "prompt_tokens": pa.array(trace.prompt_tokens), "output_tokens": pa.array(trace.output_tokens),
            "domain": pa.array(list(trace.domains), pa.string()).take(pa.array(trace.domain_idx))}
    if trace.token_ids is not None:
        if trace.token_offsets[-1] < 2**31:
            cols["prompt_token_ids"] = pa.ListArray.from_arrays(pa.array(trace.token_offsets.astype(np.int32)),
                                                                pa.array(trace.token_ids), type=TOKEN_IDS_TYPE)
        else:  # more ids than 32-bit list offsets can address
            cols["prompt_token_ids"] = pa.LargeListArray.from_arrays(pa.array(trace.token_offsets),
                                                                     pa.array(trace.token_ids))
    table = pa.table(cols)
    return table.replace_schema_metadata(encode_metadata(REQUESTS, trace.provenance, domains=list(trace.domains)))


def write_requests(path: str | os.PathLike, trace: RequestTrace) -> Path:
    return write_tables_atomic({Path(path): requests_table(trace)})[0]


# ---------------------------------------------------------------- routing traces
def read_routing(path: str | os.PathLike, model=None) -> RoutingTrace:
    """Read and validate; `model` (a ModelSpec or card name) refuses a trace recorded for another model."""
    table, file = _open(path)
    meta = decode_metadata(file, table.schema.metadata, ROUTING, required=True)
    for key, typ in (("card", str), ("layers", int), ("experts", int), ("top_k", int)):
        if not isinstance(meta.get(key), typ) or isinstance(meta.get(key), bool):
            raise TraceError(file, f"metadata lacks a valid {key!r}", column=f"metadata.{key}",
                             fix="a routing trace records its model card, layers, experts and top_k")
    k = meta["top_k"]
    c = lambda name: _column(table, file, name, ROUTING)  # noqa: E731
    as2d = lambda flat: flat.reshape(-1, k)  # noqa: E731
    _, ids = _lists(c("expert_ids"), file, "expert_ids", k, lambda a, f, n: _ints(a, f, n, np.int16))
    _, w = _lists(c("weights"), file, "weights", k, lambda a, f, n: _floats(a, f, n, np.float32))
    gu = dn = None
    if "gate_up_in_norm" in table.column_names or "down_in_norm" in table.column_names:
        gu = _floats(c("gate_up_in_norm"), file, "gate_up_in_norm", np.float32)
        _, dn = _lists(c("down_in_norm"), file, "down_in_norm", k, lambda a, f, n: _floats(a, f, n, np.float32))
        dn = as2d(dn)
    attempt = _ints(c("attempt"), file, "attempt", np.int16) if "attempt" in table.column_names else None
    trace = RoutingTrace(card=meta["card"], layers=meta["layers"], experts=meta["experts"], top_k=k,
                         request_id=_ints(c("request_id"), file, "request_id", np.int64),
                         position=_ints(c("position"), file, "position", np.int32),
                         layer=_ints(c("layer"), file, "layer", np.int16), expert_ids=as2d(ids), weights=as2d(w),
                         gate_up_in_norm=gu, down_in_norm=dn, provenance=meta.get("provenance") or {}, source=file,
                         attempt=attempt)
    if model is not None:
        trace.check_model(_as_model(model))
    return trace


def routing_table(trace: RoutingTrace) -> pa.Table:
    k = trace.top_k
    fixed = lambda a: pa.FixedSizeListArray.from_arrays(pa.array(a.ravel()), k)  # noqa: E731
    cols = {"request_id": pa.array(trace.request_id), "position": pa.array(trace.position),
            "layer": pa.array(trace.layer), "expert_ids": fixed(trace.expert_ids), "weights": fixed(trace.weights)}
    if trace.has_features:
        cols.update(gate_up_in_norm=pa.array(trace.gate_up_in_norm), down_in_norm=fixed(trace.down_in_norm))
    if trace.attempt is not None:
        cols["attempt"] = pa.array(trace.attempt)
    table = pa.table(cols, schema=pa.schema(routing_columns(k, trace.has_features, trace.attempt is not None)))
    return table.replace_schema_metadata(encode_metadata(
        ROUTING, trace.provenance, card=trace.card, layers=trace.layers, experts=trace.experts, top_k=k))


def write_routing(path: str | os.PathLike, trace: RoutingTrace) -> Path:
    return write_tables_atomic({Path(path): routing_table(trace)})[0]


def _as_model(model):
    if isinstance(model, (str, os.PathLike)):
        from traces.model_card import load_card
        return load_card(model)
    return model


# ---------------------------------------------------------------- directories
def check_not_a_result(path: str | os.PathLike) -> None:
    """Refuse a run's result directory given as a trace: its requests.parquet holds what the run measured, not a
    trace (a replay recorded with --record-routing keeps its trace in `trace/`)."""
    from traces.results import RESULT_MARKER

    d = Path(path)
    if (d / RESULT_MARKER).is_file():
        own = d / "trace"
        fix = (f"give {own}, the trace its replay recorded" if (own / REQUESTS_FILE).is_file()
               else "give the trace directory the run served (its config.json names it)")
        raise TraceError(str(d), "is a run's result directory (summary.json), not a trace", fix=fix)


def read_trace_dir(path: str | os.PathLike, model=None) -> Trace:
    """`requests.parquet` (required), `routing.parquet` and `warmup_routing.parquet` (optional), checked against
    each other."""
    d = Path(path)
    check_not_a_result(d)
    if not d.is_dir():
        raise TraceError(str(d), "does not exist" if not d.exists() else "is not a directory",
                         fix=f"a trace directory holds {REQUESTS_FILE} and optionally {ROUTING_FILE}")
    if not (d / REQUESTS_FILE).exists():
        raise TraceError(str(d), f"has no {REQUESTS_FILE}",
                         fix=f"a trace directory holds {REQUESTS_FILE} and optionally {ROUTING_FILE} (make one with "
                             "`pwsim gen-trace`)")
    requests = read_requests(d / REQUESTS_FILE)
    routing = read_routing(d / ROUTING_FILE, model) if (d / ROUTING_FILE).exists() else None
    if routing is not None:
        check_routing_against_requests(routing, requests)
    warmup = read_routing(d / WARMUP_ROUTING_FILE, model) if (d / WARMUP_ROUTING_FILE).exists() else None
    if warmup is not None:
        check_warmup_routing(warmup, requests)
    return Trace(requests, routing, warmup)


def check_warmup_routing(warmup: RoutingTrace, requests: RequestTrace) -> None:
    """A warm-up's routing covers the trace's first requests, each inside its prompt and output."""
    k = warmup.num_requests
    if not set(warmup.request_id.tolist()) <= set(requests.request_id[:k].tolist()):
        raise TraceError(warmup.source, f"routes requests other than the trace's first {k}", column="request_id",
                         fix="a warm-up serves the trace's first requests; record it with `pwruntime replay "
                             "--warmup-requests N --record-routing`")
    check_routing_against_requests(warmup, requests.head(k))


def write_trace_dir(path: str | os.PathLike, trace: Trace, card: dict | None = None) -> Path:
    """Write its files (each atomically), and `card` (a model card's JSON, for a model without a bundled card) as
    CARD_FILE; a stale routing, warm-up routing or card file is removed where the trace has none."""
    if trace.requests is None:
        raise ValueError("a trace directory needs requests")
    d = Path(path)
    tables = {d / REQUESTS_FILE: requests_table(trace.requests)}
    if trace.routing is not None:
        check_routing_against_requests(trace.routing, trace.requests)
        tables[d / ROUTING_FILE] = routing_table(trace.routing)
    if trace.warmup_routing is not None:
        check_warmup_routing(trace.warmup_routing, trace.requests)
        tables[d / WARMUP_ROUTING_FILE] = routing_table(trace.warmup_routing)
    write_tables_atomic(tables)
    if card is not None:
        write_json_atomic(d / CARD_FILE, card)
    for part, name in ((trace.routing, ROUTING_FILE), (trace.warmup_routing, WARMUP_ROUTING_FILE),
                       (card, CARD_FILE)):
        if part is None and (d / name).exists():
            (d / name).unlink()
    return d


def read_trace(path: str | os.PathLike, model=None) -> Trace:
    """A trace directory, or a single request or routing file (told apart by its metadata)."""
    p = Path(path)
    if p.is_dir():
        return read_trace_dir(p, model)
    if _schema_kind(p) == ROUTING:
        return Trace(routing=read_routing(p, model))
    return Trace(requests=read_requests(p))


def _schema_kind(p: Path) -> str | None:
    try:
        raw = (pq.read_schema(p).metadata or {}).get(META_KEY)
        return json.loads(raw).get("schema") if raw else None
    except (pa.ArrowException, OSError, ValueError, AttributeError):
        return None  # the reader gives the proper error


def write_tables_atomic(tables: dict[Path, pa.Table]) -> list[Path]:
    """Write every table to a temporary sibling, then move them all into place (none is ever half-written)."""
    done: list[tuple[str, Path]] = []
    try:
        for path, table in tables.items():
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
            os.close(fd)
            done.append((tmp, path))
            pq.write_table(table, tmp, compression="snappy")
            default_mode(tmp)
        for tmp, path in done:
            os.replace(tmp, path)
    finally:
        for tmp, _ in done:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return [path for _, path in done]
