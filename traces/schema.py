"""Trace schemas: Parquet layouts, file metadata, and the validated columnar in-memory traces.

Two kinds of trace, each a Parquet file whose schema metadata holds one JSON entry under the key
`pagedweight`: {"schema": "requests" | "routing", "version": 1, "provenance": {...}} and, for
routing traces, also "card" (the model card name), "layers" (MoE layers), "experts", "top_k".

* request trace (`requests.parquet`), one row per request: request_id int64 (unique, >= 0),
  arrival_s float64 (finite, >= 0, non-decreasing), prompt_tokens int32 (>= 1), output_tokens
  int32 (>= 1), domain string, optional prompt_token_ids list<int32> (prompt_tokens ids each).
* routing trace (`routing.parquet`), one row per (request_id, position, layer), unique:
  request_id int64, position int32 (token position in the request, >= 0), layer int16 (MoE-layer
  ordinal), expert_ids fixed_size_list<int16>[top_k] (distinct, in 0..experts-1), weights
  fixed_size_list<float32>[top_k] (router weights, >= 0), optional gate_up_in_norm float32 (norm
  of the tokens' input to the experts' gate_up blocks) and down_in_norm
  fixed_size_list<float32>[top_k] (norm of each selected expert's input to its down block), optional
  attempt int16 (>= 0; absent: 0): which computation of the position the row is, 1 for the recompute after a
  request's first preemption and so on (a runtime recomputes at the bits of its time, so it may route otherwise);
  rows are then unique per (request_id, attempt, position, layer).

In memory both are frozen dataclasses of numpy arrays (no per-row Python objects) that validate
on construction. Every problem raises one `TraceError` naming the file, the column and (0-based)
row where it applies.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, replace

import numpy as np
import pyarrow as pa

from traces.clikit import UserError

SCHEMA_VERSION = 1
META_KEY = b"pagedweight"
REQUESTS, ROUTING = "requests", "routing"

REQUEST_COLUMNS = {"request_id": pa.int64(), "arrival_s": pa.float64(), "prompt_tokens": pa.int32(),
                   "output_tokens": pa.int32(), "domain": pa.string()}
TOKEN_IDS_TYPE = pa.list_(pa.int32())


def routing_columns(top_k: int, features: bool, attempts: bool = False) -> dict[str, pa.DataType]:
    cols = {"request_id": pa.int64(), "position": pa.int32(), "layer": pa.int16(),
            "expert_ids": pa.list_(pa.int16(), top_k), "weights": pa.list_(pa.float32(), top_k)}
    if features:
        cols.update(gate_up_in_norm=pa.float32(), down_in_norm=pa.list_(pa.float32(), top_k))
    if attempts:
        cols["attempt"] = pa.int16()
    return cols


class TraceError(UserError):
    """A trace file (or in-memory trace) is malformed; names the file, column and row."""

    def __init__(self, file: str, problem: str, column: str | None = None, row: int | None = None,
                 fix: str | None = None) -> None:
        self.file, self.column, self.row, self.problem, self.fix = str(file), column, row, problem, fix
        if column and column.startswith("metadata"):
            label = f": metadata field '{column[9:]}'" if "." in column else ": metadata"
        else:
            label = f": column '{column}'" if column else ""
        where = self.file + label + (f", row {row}" if row is not None else "")
        super().__init__(f"{where}: {problem}" + (f"; {fix}" if fix else ""))

    def __reduce__(self):  # picklable, so an error raised in a worker process (`pwsim compare --jobs`) reaches the CLI
        return type(self), (self.file, self.problem, self.column, self.row, self.fix)


# ---------------------------------------------------------------- metadata
def _json_default(obj):
    if isinstance(obj, (np.generic, np.ndarray)):
        return obj.tolist()
    return str(obj)


def encode_metadata(kind: str, provenance: dict, **extra) -> dict[bytes, bytes]:
    body = {"schema": kind, "version": SCHEMA_VERSION, **extra, "provenance": provenance}
    return {META_KEY: json.dumps(body, default=_json_default, sort_keys=True).encode()}


def decode_metadata(file: str, metadata: dict | None, kind: str, required: bool) -> dict:
    """The `pagedweight` entry of a file's metadata, checked against the expected schema kind."""
    raw = (metadata or {}).get(META_KEY)
    if raw is None:
        if required:
            raise TraceError(file, f"no PagedWeight metadata; a {kind} trace records its schema, model card, "
                             "layers, experts and top_k", column="metadata",
                             fix="write it with traces.io (e.g. `pwsim gen-trace`)")
        return {"schema": kind, "version": SCHEMA_VERSION, "provenance": {}}
    try:
        meta = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TraceError(file, f"metadata is not valid JSON ({e})", column="metadata") from None
    if not isinstance(meta, dict) or meta.get("schema") != kind:
        found = meta.get("schema") if isinstance(meta, dict) else None
        raise TraceError(file, f"is a {found!r} trace, expected a {kind!r} trace", column="metadata.schema",
                         fix=f"pass the {kind} file ({kind}.parquet) or the trace directory")
    if meta.get("version") != SCHEMA_VERSION:
        raise TraceError(file, f"schema version {meta.get('version')!r}, this PagedWeight reads {SCHEMA_VERSION}",
                         column="metadata.version", fix="regenerate the trace with this version")
    return meta


# ---------------------------------------------------------------- validation helpers
def _check(bad: np.ndarray, file: str, column: str, values: np.ndarray, problem: str, fix: str | None = None) -> None:
    """Raise for the first row where `bad` holds; `problem` may use {v} for that row's value."""
    rows = np.flatnonzero(bad.reshape(len(bad), -1).any(axis=1)) if bad.size else np.array([], int)
    if rows.size:
        r = int(rows[0])
        v = values[r].tolist() if isinstance(values[r], np.ndarray) else values[r]
        raise TraceError(file, problem.format(v=v), column=column, row=r, fix=fix)


def _duplicates_at(keys: list[np.ndarray]) -> int | None:
    """First row (in array order) whose key tuple already occurred at an earlier row."""
    n = len(keys[0])
    if n < 2:
        return None
    order = np.lexsort(keys[::-1])  # lexsort sorts by the last key first; stable
    same = np.ones(n - 1, dtype=bool)
    for k in keys:
        s = k[order]
        same &= s[1:] == s[:-1]
    return int(order[1:][same].min()) if same.any() else None


def _as(name: str, arr, dtype, ndim: int = 1) -> np.ndarray:
    a = np.ascontiguousarray(arr, dtype=dtype)
    if a.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {a.shape}")
    return a


# ---------------------------------------------------------------- request traces
@dataclass(frozen=True, eq=False)
class RequestTrace:
    request_id: np.ndarray  # int64 [n]
    arrival_s: np.ndarray  # float64 [n]
    prompt_tokens: np.ndarray  # int32 [n]
    output_tokens: np.ndarray  # int32 [n]
    domain_idx: np.ndarray  # int32 [n], index into `domains`
    domains: tuple[str, ...]
    token_offsets: np.ndarray | None = None  # int64 [n+1]: ids of request i are token_ids[o[i]:o[i+1]]
    token_ids: np.ndarray | None = None  # int32
    provenance: dict = field(default_factory=dict)
    source: str = "<in-memory request trace>"

    def __post_init__(self) -> None:
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731
        for name, dt in (("request_id", np.int64), ("arrival_s", np.float64), ("prompt_tokens", np.int32),
                         ("output_tokens", np.int32), ("domain_idx", np.int32)):
            set_(name, _as(name, getattr(self, name), dt))
        set_("domains", tuple(str(d) for d in self.domains))
        if (self.token_offsets is None) != (self.token_ids is None):
            raise ValueError("token_offsets and token_ids go together")
        if self.token_ids is not None:
            set_("token_offsets", _as("token_offsets", self.token_offsets, np.int64))
            set_("token_ids", _as("token_ids", self.token_ids, np.int32))
        self.validate()

    @classmethod
    def from_columns(cls, request_id, arrival_s, prompt_tokens, output_tokens, domain,
                     prompt_token_ids=None, provenance: dict | None = None, source: str | None = None) -> "RequestTrace":
        """Build from plain columns; `domain` is a sequence of strings, ids a list of int sequences."""
        domains, idx = np.unique(np.asarray(domain, dtype=object).astype(str), return_inverse=True)
        offsets = ids = None
        if prompt_token_ids is not None:
            lens = np.array([len(x) for x in prompt_token_ids], dtype=np.int64)
            offsets = np.concatenate([[0], np.cumsum(lens)])
            ids = np.concatenate([np.asarray(x, dtype=np.int64) for x in prompt_token_ids]) if len(lens) else []
        kw = {"source": source} if source else {}
        return cls(request_id, arrival_s, prompt_tokens, output_tokens, idx, tuple(domains), offsets, ids,
                   dict(provenance or {}), **kw)

    def __len__(self) -> int:
        return len(self.request_id)

    @property
    def domain(self) -> np.ndarray:
        """Domain name per request (object array)."""
        return np.asarray(self.domains, dtype=object)[self.domain_idx] if self.domains else np.array([], object)

    def prompt_ids(self, i: int) -> np.ndarray | None:
        if self.token_ids is None:
            return None
        return self.token_ids[self.token_offsets[i]:self.token_offsets[i + 1]]

    def head(self, k: int) -> "RequestTrace":
        """The first `k` requests (all of them when there are no more)."""
        k = min(int(k), len(self))
        offsets = ids = None
        if self.token_ids is not None:
            offsets, ids = self.token_offsets[:k + 1], self.token_ids[:self.token_offsets[k]]
        return replace(self, request_id=self.request_id[:k], arrival_s=self.arrival_s[:k],
                       prompt_tokens=self.prompt_tokens[:k], output_tokens=self.output_tokens[:k],
                       domain_idx=self.domain_idx[:k], token_offsets=offsets, token_ids=ids)

    def validate(self) -> None:
        f, n = self.source, len(self.request_id)
        for name in ("arrival_s", "prompt_tokens", "output_tokens", "domain_idx"):
            if len(getattr(self, name)) != n:
                raise TraceError(f, f"has {len(getattr(self, name))} rows, request_id has {n}", column=name)
        ids = self.request_id
        _check(ids < 0, f, "request_id", ids, "negative request id {v}")
        dup = _duplicates_at([ids])
        if dup is not None:
            first = int(np.flatnonzero(ids == ids[dup])[0])
            raise TraceError(f, f"duplicate request id {ids[dup]} (first at row {first})", column="request_id",
                             row=dup, fix="request ids must be unique")
        t = self.arrival_s
        _check(~np.isfinite(t) | (t < 0), f, "arrival_s", t, "arrival time {v} must be finite and >= 0")
        _check(np.concatenate([[False], t[1:] < t[:-1]]), f, "arrival_s", t,
               "arrival time {v} is earlier than the previous row's", fix="sort the requests by arrival_s")
        for name in ("prompt_tokens", "output_tokens"):
            v = getattr(self, name)
            _check(v < 1, f, name, v, "length {v} is not positive (every request needs >= 1 token)")
        _check((self.domain_idx < 0) | (self.domain_idx >= len(self.domains)), f, "domain", self.domain_idx,
               "domain index {v} out of range")
        if self.token_ids is not None:
            self._validate_token_ids()

    def _validate_token_ids(self) -> None:
        f, o = self.source, self.token_offsets
        if len(o) != len(self) + 1 or o[0] != 0 or (np.diff(o) < 0).any() or o[-1] != len(self.token_ids):
            raise TraceError(f, "token offsets are inconsistent", column="prompt_token_ids")
        lens = np.diff(o)
        _check(lens != self.prompt_tokens, f, "prompt_token_ids", lens,
               "has {v} token ids but prompt_tokens says otherwise", fix="give exactly prompt_tokens ids per request")
        neg = np.flatnonzero(self.token_ids < 0)
        if neg.size:
            row = int(np.searchsorted(o, neg[0], side="right") - 1)
            raise TraceError(f, f"negative token id {self.token_ids[neg[0]]}", column="prompt_token_ids", row=row)

    def summary(self) -> dict:
        n = len(self)
        q = lambda a, p: float(np.percentile(a, p)) if n else 0.0  # noqa: E731
        duration = float(self.arrival_s[-1] - self.arrival_s[0]) if n > 1 else 0.0
        counts = np.bincount(self.domain_idx, minlength=len(self.domains)) if n else np.zeros(len(self.domains), int)
        return {"requests": n, "duration_s": duration, "rate_per_s": (n - 1) / duration if duration > 0 else 0.0,
                "prompt_tokens": {"mean": float(self.prompt_tokens.mean()) if n else 0.0, "p50": q(self.prompt_tokens, 50),
                                  "p99": q(self.prompt_tokens, 99), "max": int(self.prompt_tokens.max()) if n else 0},
                "output_tokens": {"mean": float(self.output_tokens.mean()) if n else 0.0, "p50": q(self.output_tokens, 50),
                                  "p99": q(self.output_tokens, 99), "max": int(self.output_tokens.max()) if n else 0},
                "total_tokens": int(self.prompt_tokens.sum() + self.output_tokens.sum()),
                "domains": {d: int(c) for d, c in zip(self.domains, counts)},
                "prompt_token_ids": self.token_ids is not None}


# ---------------------------------------------------------------- routing traces
@dataclass(frozen=True, eq=False)
class RoutingTrace:
    card: str  # model card name the routing belongs to
    layers: int  # MoE layers
    experts: int
    top_k: int
    request_id: np.ndarray  # int64 [n]
    position: np.ndarray  # int32 [n]
    layer: np.ndarray  # int16 [n]
    expert_ids: np.ndarray  # int16 [n, top_k]
    weights: np.ndarray  # float32 [n, top_k]
    gate_up_in_norm: np.ndarray | None = None  # float32 [n]
    down_in_norm: np.ndarray | None = None  # float32 [n, top_k]
    provenance: dict = field(default_factory=dict)
    source: str = "<in-memory routing trace>"
    attempt: np.ndarray | None = None  # int16 [n]: the computation of the position (None: every row the first)

    def __post_init__(self) -> None:
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731
        for name, dt, nd in (("request_id", np.int64, 1), ("position", np.int32, 1), ("layer", np.int16, 1),
                             ("expert_ids", np.int16, 2), ("weights", np.float32, 2)):
            set_(name, _as(name, getattr(self, name), dt, nd))
        if self.attempt is not None:
            set_("attempt", _as("attempt", self.attempt, np.int16))
        if (self.gate_up_in_norm is None) != (self.down_in_norm is None):
            raise ValueError("gate_up_in_norm and down_in_norm go together")
        if self.gate_up_in_norm is not None:
            set_("gate_up_in_norm", _as("gate_up_in_norm", self.gate_up_in_norm, np.float32))
            set_("down_in_norm", _as("down_in_norm", self.down_in_norm, np.float32, 2))
        for k in ("layers", "experts", "top_k"):
            set_(k, int(getattr(self, k)))
        self.validate()

    def __len__(self) -> int:
        return len(self.request_id)

    @property
    def has_features(self) -> bool:
        return self.gate_up_in_norm is not None

    def validate(self) -> None:
        f, n, k = self.source, len(self.request_id), self.top_k
        if not self.card:
            raise TraceError(f, "routing trace names no model card", column="metadata.card")
        if not (0 < k <= self.experts <= np.iinfo(np.int16).max and self.layers > 0):
            raise TraceError(f, f"layers {self.layers}, experts {self.experts}, top_k {k} are not a valid MoE shape",
                             column="metadata.top_k")
        shapes = {"position": (n,), "layer": (n,), "expert_ids": (n, k), "weights": (n, k)}
        if self.has_features:
            shapes.update(gate_up_in_norm=(n,), down_in_norm=(n, k))
        if self.attempt is not None:
            shapes.update(attempt=(n,))
        for name, shape in shapes.items():
            if getattr(self, name).shape != shape:
                raise TraceError(f, f"has shape {getattr(self, name).shape}, expected {shape} (top_k {k})", column=name)
        _check(self.request_id < 0, f, "request_id", self.request_id, "negative request id {v}")
        _check(self.position < 0, f, "position", self.position, "negative position {v}")
        _check((self.layer < 0) | (self.layer >= self.layers), f, "layer", self.layer,
               f"layer {{v}} out of range 0..{self.layers - 1}")
        e = self.expert_ids
        _check((e < 0) | (e >= self.experts), f, "expert_ids", e, f"expert id out of range 0..{self.experts - 1} in {{v}}",
               fix="check the trace's model card")
        s = np.sort(e, axis=1)
        _check(s[:, 1:] == s[:, :-1], f, "expert_ids", e, "repeated expert in {v} (top-k experts are distinct)")
        _check(~np.isfinite(self.weights) | (self.weights < 0), f, "weights", self.weights,
               "routing weights {v} must be finite and >= 0")
        if self.has_features:
            for name in ("gate_up_in_norm", "down_in_norm"):
                v = getattr(self, name)
                _check(~np.isfinite(v) | (v < 0), f, name, v, "norm {v} must be finite and >= 0")
        if self.attempt is not None:
            _check(self.attempt < 0, f, "attempt", self.attempt, "negative attempt {v}")
        key = [self.request_id, self.attempts, self.position, self.layer]
        dup = None if self.is_sorted(strict=True) else _duplicates_at(key)
        if dup is not None:
            again = f", attempt {self.attempts[dup]}" if self.attempt is not None else ""
            raise TraceError(f, f"duplicate (request {self.request_id[dup]}{again}, position {self.position[dup]}, "
                             f"layer {self.layer[dup]})", column="layer", row=dup,
                             fix="one row per (request, attempt, position, layer)")

    @property
    def num_requests(self) -> int:
        """Requests the trace routes."""
        return int(np.unique(self.request_id).size)

    @property
    def attempts(self) -> np.ndarray:
        """Each row's computation of its position: 0 the first, 1 the recompute after a first preemption, ..."""
        return self.attempt if self.attempt is not None else np.zeros(len(self.request_id), dtype=np.int16)

    def is_sorted(self, strict: bool = False) -> bool:
        """Rows ordered by (request_id, attempt, position, layer); `strict` also rules out equal keys."""
        r = self.request_id
        if len(r) < 2:
            return True
        dr = np.diff(r)
        da = np.diff(self.attempts.astype(np.int64))
        dp, dl = np.diff(self.position.astype(np.int64)), np.diff(self.layer.astype(np.int64))
        layer_ok = (dl > 0) if strict else (dl >= 0)
        ok = (dr > 0) | ((dr == 0) & ((da > 0) | ((da == 0) & ((dp > 0) | ((dp == 0) & layer_ok)))))
        return bool(ok.all())

    def sorted(self) -> "RoutingTrace":
        """A copy ordered by (request_id, attempt, position, layer)."""
        if self.is_sorted():
            return self
        order = np.lexsort((self.layer, self.position, self.attempts, self.request_id))
        take = lambda a: None if a is None else a[order]  # noqa: E731
        return replace(self, request_id=take(self.request_id), position=take(self.position), layer=take(self.layer),
                       expert_ids=take(self.expert_ids), weights=take(self.weights),
                       gate_up_in_norm=take(self.gate_up_in_norm), down_in_norm=take(self.down_in_norm),
                       attempt=take(self.attempt))

    def request_ranges(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(request ids, start rows, stop rows) of a sorted trace: rows of ids[j] are start[j]:stop[j]."""
        if not self.is_sorted():
            raise ValueError("request_ranges needs a sorted trace; call .sorted() first")
        ids, starts = np.unique(self.request_id, return_index=True)
        return ids, starts, np.append(starts[1:], len(self)).astype(starts.dtype)

    def routing_mass(self, rows: slice | np.ndarray | None = None) -> np.ndarray:
        """Eq. 1: `[layers, experts]` share of routing weight per expert within each layer."""
        sel = slice(None) if rows is None else rows
        ids, w, lay = self.expert_ids[sel], self.weights[sel], self.layer[sel]
        flat = (lay.astype(np.int64)[:, None] * self.experts + ids).ravel()
        mass = np.bincount(flat, weights=w.ravel().astype(np.float64), minlength=self.layers * self.experts)
        mass = mass.astype(np.float64).reshape(self.layers, self.experts)  # bincount of nothing is int
        tot = mass.sum(axis=1, keepdims=True)
        return np.divide(mass, tot, out=np.zeros_like(mass), where=tot > 0)

    def check_model(self, model) -> None:
        """Refuse a trace recorded for another model; `model` has name, moe_layers, experts, top_k (a ModelSpec)."""
        fix = f"record or generate a routing trace for {model.name} (pwsim gen-trace --card {model.name})"
        if self.card.lower() != str(model.name).lower():
            raise TraceError(self.source, f"routing trace is for model card {self.card!r}, not {model.name!r}",
                             column="metadata.card", fix=fix)
        for key, want in (("layers", model.moe_layers), ("experts", model.experts), ("top_k", model.top_k)):
            if getattr(self, key) != want:
                raise TraceError(self.source, f"{key} is {getattr(self, key)} but {model.name} has {want}",
                                 column=f"metadata.{key}", fix=fix)

    def summary(self) -> dict:
        mass = self.routing_mass()
        top = np.sort(mass, axis=1)[:, ::-1]
        hot = max(1, self.experts // 10)
        used = mass.sum(axis=1) > 0
        return {"card": self.card, "layers": self.layers, "experts": self.experts, "top_k": self.top_k,
                "rows": len(self), "requests": self.num_requests,
                "recomputed_rows": int((self.attempts > 0).sum()),
                "features": self.has_features,
                "hottest_10pct_mass": float(top[used, :hot].sum(axis=1).mean()) if used.any() else 0.0}


def check_routing_against_requests(routing: RoutingTrace, requests: RequestTrace) -> None:
    """Every routing row belongs to a request of the trace and to a position inside that request."""
    order = np.argsort(requests.request_id, kind="stable")
    ids = requests.request_id[order]
    j = np.clip(np.searchsorted(ids, routing.request_id), 0, max(len(ids) - 1, 0))
    known = (ids[j] == routing.request_id) if len(ids) else np.zeros(len(routing), bool)
    _check(~known, routing.source, "request_id", routing.request_id, "request {v} is not in the request trace",
           fix="routing and request traces must come from the same run")
    length = (requests.prompt_tokens.astype(np.int64) + requests.output_tokens)[order][j]
    _check(routing.position >= length, routing.source, "position", routing.position,
           "position {v} is past the request's prompt + output tokens")
