"""TraceRecorder: collects the request and routing traces of an engine run in the traces/ schema.

The engine calls `on_arrival`, `on_routing` (after every forward) and `on_finish`; the recorder keeps
numpy columns, builds `traces.schema.RequestTrace` / `RoutingTrace` on demand and `write(dir)`s a
trace directory through `traces.io` (requests.parquet + routing.parquet, atomically). Positions
recomputed after a preemption are recorded again, as the request's next attempt (the schema's `attempt`
column: the recompute runs at the bits of its time and may route otherwise), so the simulator's recompute
replays them. Routing that reaches the recorder after its request finished (the
one step an asynchronously scheduled sequence runs past its stop) is not recorded, as it was never computed
without asynchronous scheduling. `routing_trace(rename=...)` keeps some requests under other ids (a replay's, under
its trace's ids); `card_for(model_dir)` names the bundled card of a checkpoint's architecture, or makes the card of a
model no bundled card describes, which the trace directory then carries (`traces.io.CARD_FILE`). A server's recorder
(`pwruntime serve --record-trace`) keeps at most `max_requests` requests (the later ones are counted in `skipped`),
and its trace holds only the requests that were computed (a request aborted before its first step has no routing).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from pwruntime.model_runner import RoutingArrays


def card_for(model_dir) -> tuple[str, dict | None]:
    """(the name of the bundled model card with the architecture of the checkpoint in `model_dir`, None), so `pwsim`
    can simulate its traces; for an architecture no bundled card has, (the name of a card made from its config.json,
    that card's JSON)."""
    from traces.model_card import ModelSpec, available_cards, load_card

    spec = ModelSpec.from_hf_config(json.loads((Path(model_dir) / "config.json").read_text()))
    matches = [n for n in available_cards() if load_card(n).fingerprint() == spec.fingerprint()]
    return (matches[0], None) if matches else (spec.name, spec.to_dict())


@dataclass
class TraceRecorder:
    card: str = "runtime"
    card_json: dict | None = None   # the card's JSON, written beside the trace, when no bundled card is `card`
    features: bool = True  # record gate_up / down input norms
    domain: str = "unknown"
    provenance: dict = field(default_factory=dict)
    max_requests: int | None = None  # record the first this many requests (None: all)
    skipped: int = 0  # requests that arrived past max_requests, not recorded
    _requests: dict = field(default_factory=dict)  # request id -> [arrival_s, prompt ids, outputs, domain]
    _next: dict = field(default_factory=dict)  # request id -> the position after the last one routed
    _attempt: dict = field(default_factory=dict)  # request id -> its computation (0, then 1 after a preemption, ...)
    _finished: set = field(default_factory=set)
    _chunks: list = field(default_factory=list)
    _shape: tuple[int, int, int] | None = None  # layers, experts, top_k

    def on_arrival(self, request_id: int, arrival_s: float, prompt_token_ids: list[int], domain: str | None = None,
                   ) -> None:
        if self.max_requests is not None and len(self._requests) >= self.max_requests:
            self.skipped += 1
            return
        self._requests[request_id] = [float(arrival_s), list(prompt_token_ids), 0, domain or self.domain]
        self._next[request_id], self._attempt[request_id] = 0, 0

    def set_model(self, layers: int, experts: int, top_k: int) -> None:
        self._shape = (layers, experts, top_k)

    def on_routing(self, entries: list[tuple[int, int, int]], routing: RoutingArrays) -> None:
        """`entries`: (request id, start position, new tokens) in the batch's flattening order. Positions routed again
        (a recompute after preemption, at the bits of its time) are recorded as the request's next attempt."""
        offset = 0
        for rid, start, n in entries:
            if rid in self._requests and rid not in self._finished:
                attempt = self._attempt.get(rid, 0) + (start < self._next.get(rid, 0))  # positions routed before
                self._attempt[rid], self._next[rid] = attempt, start + n
                req = self._requests[rid]  # outputs so far, at least (a request cut before it finished keeps them)
                req[2] = max(req[2], start + n - len(req[1]) + 1)
                sl = slice(offset, offset + n)
                self._chunks.append((rid, attempt, start, routing.topk_ids[:, sl],
                                     routing.topk_weights[:, sl], routing.gate_up_in_norm[:, sl],
                                     routing.down_in_norm[:, sl]))
            offset += n

    def on_finish(self, request_id: int, num_output_tokens: int) -> None:
        if request_id in self._requests:
            self._requests[request_id][2] = int(num_output_tokens)
            self._finished.add(request_id)

    @property
    def num_requests(self) -> int:
        """Requests the trace holds: those recorded that were computed."""
        return len(self._computed())

    def write(self, path, from_first_arrival: bool = False, plans: dict | None = None) -> "Path":
        """Write requests.parquet and routing.parquet (when routing was recorded) into directory `path`; with
        `from_first_arrival`, arrival times count from the first request's (a server's clock starts before it); with
        `plans` (a `policies.plan_log` PlanLog's columns, on the engine's clock too) also plans.parquet."""
        from traces.io import Trace, write_trace_dir

        routing = self.routing_trace() if self._shape is not None and self._chunks else None
        t0 = self._first_arrival() if from_first_arrival else 0.0
        out = write_trace_dir(path, Trace(self.request_trace(t0), routing), self.card_json)
        if plans:
            from traces.io import write_tables_atomic
            from traces.results import columns_table
            write_tables_atomic({out / "plans.parquet": columns_table({**plans, "time_s": plans["time_s"] - t0})})
        return out

    def _first_arrival(self) -> float:
        return min((self._requests[r][0] for r in self._computed()), default=0.0)

    def _computed(self) -> list[int]:
        """Ids of the recorded requests that were routed (all of them when no routing is recorded)."""
        return [r for r in self._requests if self._next[r] > 0 or not self._chunks]

    def request_trace(self, t0: float = 0.0):
        """The recorded requests that were computed, in arrival order, their arrival times counted from `t0`."""
        from traces.schema import RequestTrace

        ids = sorted(self._computed(), key=lambda r: (self._requests[r][0], r))
        rows = [self._requests[r] for r in ids]
        return RequestTrace.from_columns(
            request_id=ids, arrival_s=[r[0] - t0 for r in rows], prompt_tokens=[len(r[1]) for r in rows],
            output_tokens=[max(1, r[2]) for r in rows], domain=[r[3] for r in rows],
            prompt_token_ids=[r[1] for r in rows], provenance={"source": "pwruntime", **self.provenance})

    def routing_trace(self, rename: dict[int, int] | None = None):
        """The recorded routing; with `rename` (engine request id -> id to record), only those requests', renamed."""
        from traces.schema import RoutingTrace

        if self._shape is None:
            raise ValueError("set_model() was not called: the routing trace needs layers, experts and top_k")
        layers, experts, top_k = self._shape
        rid, att, pos, layer, eids, w, gu, dn = [], [], [], [], [], [], [], []
        for r, a, first, ids, wt, g, d in self._chunks:
            if rename is not None:
                if r not in rename:
                    continue
                r = rename[r]
            n = ids.shape[1]
            rid.append(np.full(n * layers, r, dtype=np.int64))
            att.append(np.full(n * layers, a, dtype=np.int16))
            pos.append(np.repeat(np.arange(first, first + n, dtype=np.int32), layers))
            layer.append(np.tile(np.arange(layers, dtype=np.int16), n))
            eids.append(ids.transpose(1, 0, 2).reshape(-1, top_k))
            w.append(wt.transpose(1, 0, 2).reshape(-1, top_k))
            gu.append(g.T.reshape(-1))
            dn.append(d.transpose(1, 0, 2).reshape(-1, top_k))

        def cat(parts, dtype, shape):
            return np.concatenate(parts).astype(dtype) if parts else np.zeros(shape, dtype)
        return RoutingTrace(
            self.card, layers, experts, top_k, cat(rid, np.int64, (0,)), cat(pos, np.int32, (0,)),
            cat(layer, np.int16, (0,)), cat(eids, np.int16, (0, top_k)), cat(w, np.float32, (0, top_k)),
            cat(gu, np.float32, (0,)) if self.features else None,
            cat(dn, np.float32, (0, top_k)) if self.features else None,
            provenance={"source": "pwruntime", **self.provenance},
            attempt=attempts if (attempts := cat(att, np.int16, (0,))).any() else None).sorted()
