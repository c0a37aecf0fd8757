"""Workloads for the simulator: requests plus the routing of their tokens, from traces or synthetic.

* `from_trace_dir(path, card)`: a trace directory (`requests.parquet`, optional `routing.parquet`,
  `traces.io`). With a routing trace the routing is replayed as recorded; without one it is
  synthetic (`routing_spec`, seeded). A recorded warm-up's routing (`warmup_routing.parquet`, from
  `pwruntime replay --record-routing`) routes the simulator's warm-up.
* `synthetic(card, workload_spec, routing_spec, seed)`: requests from `traces.generators` and the
  fast synthetic routing source (`pwsim.routing.synthetic_routing`, same popularity model).

Prompt token ids travel with the requests when the trace has them (`RequestTrace.token_ids`); only a
prefix-caching simulation reads them.
"""
from __future__ import annotations

import os

from pwsim.engine import Workload
from pwsim.routing import RoutingSource, TraceRouting, synthetic_routing
from traces.clikit import UserError
from traces.generators import RoutingSpec, WorkloadSpec, generate_requests
from traces.io import read_trace_dir
from traces.model_card import ModelSpec


def synthetic(card: ModelSpec, workload_spec: WorkloadSpec, routing_spec: RoutingSpec, seed: int) -> Workload:
    requests = generate_requests(workload_spec, seed)
    routing = synthetic_routing(requests, card, routing_spec, seed)
    rspec = {k: getattr(routing_spec, k) for k in routing_spec.__dataclass_fields__}
    return Workload(requests, routing, {"kind": "synthetic", "seed": seed, "workload": workload_spec.describe(),
                                        "routing": rspec})


def from_trace_dir(path: str | os.PathLike, card: ModelSpec, routing_spec: RoutingSpec | None = None,
                   seed: int = 0) -> Workload:
    trace = read_trace_dir(path, card)
    requests = trace.requests
    if len(requests) == 0:
        raise UserError(f"trace {path} holds no requests; give a trace with at least one (`pwsim gen-trace "
                        "--requests N`)")
    if trace.routing is not None:
        routing: RoutingSource = TraceRouting.from_trace(trace.routing, requests)
        kind = "recorded routing"
    else:
        routing = synthetic_routing(requests, card, routing_spec or RoutingSpec(features=True), seed)
        kind = "synthetic routing (the trace has no routing.parquet)"
    warmup = None
    if trace.warmup_routing is not None:
        first = requests.head(trace.warmup_routing.num_requests)
        warmup = TraceRouting.from_trace(trace.warmup_routing, first)
        kind += f", and a recorded warm-up's for the first {len(first)} requests"
    return Workload(requests, routing, {"kind": "trace", "path": str(path), "routing": kind,
                                        "requests": requests.summary()}, warmup)
