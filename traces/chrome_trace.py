"""Result directories as one Chrome trace (the Trace Event Format's JSON), to look at in Perfetto or chrome://tracing.

Any result directory (`pwsim run`, `pwruntime replay`, `pwruntime bench serve`) becomes one process of the trace,
on the trace's clock (0: its first arrival), so a simulation and a replay of the same trace lie one above the other:
- "iterations": one slice per engine iteration ("decode" or "mixed"; its tokens, batch and queue in its args) and,
  where the timeline times them (`pwruntime replay`), its phases nested inside (schedule, forward, sample, observe,
  plan);
- counters: requests running and waiting, free and total KV blocks, the experts' mean committed bits, and (in a
  simulation) the bytes of weights and KV pool;
- "link transfers" (a simulation's reloads on the PCIe link), "stalls" and "plans" (instants) from `events.json`;
- page moves from the plan log (`plans.parquet`, both engines write it): each transition an async slice "reload" or
  "offload" from the boundary that began it to the one it landed at (its block, layer, expert, kind and bits in its
  args), and each one the plan loop refused an instant on the "refused moves" thread, with the reason;
- "requests": per request, an async slice from its arrival to its first token ("waiting for first token") and one
  from there to its end ("decoding"), each with its request id, prompt and output tokens.
Times are microseconds (the format's unit).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from policies.plan_log import kind_name
from traces.results import read_plan_log, read_result_dir

US = 1e6
PHASES = ("schedule_s", "forward_s", "sample_s", "observe_s", "plan_s")
COUNTERS = {"requests": ("running", "waiting"), "KV blocks": ("free_blocks", "total_blocks"),
            "mean bits": ("mean_bits",), "memory bytes": ("weight_bytes", "kv_pool_bytes")}
TID_ITERATIONS, TID_LINK, TID_STALLS, TID_PLANS, TID_REFUSED = 1, 2, 3, 4, 5


def result_events(path: str | Path, pid: int, label: str | None = None) -> list[dict]:
    """The trace events of one result directory, as process `pid` named `label` (default: its folder and tool)."""
    path = Path(path)
    summary, requests, timeline, config = read_result_dir(path, flag="a result directory")
    tool = "simulation" if "hardware" in config or "budget" in config else "runtime"
    name = label or f"{path.name} ({tool})"
    events = [_meta(pid, None, "process_name", name), _meta(pid, None, "process_sort_index", pid, key="sort_index"),
              _meta(pid, TID_ITERATIONS, "thread_name", "iterations")]
    events += _iterations(timeline, pid)
    events += _counters(timeline, pid)
    events += _events_file(path / "events.json", pid)
    events += _page_moves(read_plan_log(path, flag="a result directory"), pid)
    events += _requests(requests, pid)
    return events


def chrome_trace(paths: list[str | Path], labels: list[str] | None = None) -> dict:
    """The JSON object of one trace holding every result directory in `paths` (process i + 1 for paths[i])."""
    events: list[dict] = []
    for i, path in enumerate(paths):
        events += result_events(path, i + 1, labels[i] if labels else None)
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"sources": [str(p) for p in paths], "clock": "seconds of the trace, from its first arrival"}}


def _meta(pid: int, tid: int | None, what: str, value, key: str = "name") -> dict:
    event = {"ph": "M", "pid": pid, "name": what, "args": {key: value}}
    if tid is not None:
        event["tid"] = tid
    return event


def _us(seconds: float) -> float:
    return round(float(seconds) * US, 3)


def _iterations(timeline: dict[str, np.ndarray], pid: int) -> list[dict]:
    if "iter_s" not in timeline:
        return []
    out = []
    phases = [p for p in PHASES if p in timeline]
    for i in range(len(timeline["time_s"])):
        end, dur = float(timeline["time_s"][i]), float(timeline["iter_s"][i])
        tokens, decode = int(timeline["batch_tokens"][i]), int(timeline["decode_tokens"][i])
        args = {"step": int(timeline["step"][i]), "tokens": tokens, "decode_tokens": decode}
        args.update({k: int(timeline[k][i]) for k in ("running", "waiting") if k in timeline})
        start = end - dur
        out.append({"ph": "X", "pid": pid, "tid": TID_ITERATIONS, "name": "decode" if tokens == decode else "mixed",
                    "cat": "iteration", "ts": _us(start), "dur": _us(dur), "args": args})
        at = start
        for phase in phases:  # back to back from the iteration's start, as the engine runs them
            length = min(float(timeline[phase][i]), end - at)  # inside its iteration, whatever the rounding
            if length > 0:
                out.append({"ph": "X", "pid": pid, "tid": TID_ITERATIONS, "name": phase[:-2], "cat": "phase",
                            "ts": _us(at), "dur": _us(length)})
            at += length
    return out


def _counters(timeline: dict[str, np.ndarray], pid: int) -> list[dict]:
    out = []
    for name, columns in COUNTERS.items():
        present = [c for c in columns if c in timeline]
        if not present:
            continue
        for i in range(len(timeline["time_s"])):
            values = {c: float(timeline[c][i]) for c in present}
            if all(np.isfinite(v) for v in values.values()):
                out.append({"ph": "C", "pid": pid, "name": name, "ts": _us(timeline["time_s"][i]), "args": values})
    return out


def _events_file(path: Path, pid: int) -> list[dict]:
    """A simulation's link transfers, stalls and plans (a replay has no events.json)."""
    if not path.is_file():
        return []
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return []  # the result's own reader vouched for the rest; a damaged extra file only loses these tracks
    out = [_meta(pid, TID_LINK, "thread_name", "link transfers"), _meta(pid, TID_STALLS, "thread_name", "stalls"),
           _meta(pid, TID_PLANS, "thread_name", "plans")]
    for t in doc.get("link_transfers", []):
        out.append({"ph": "X", "pid": pid, "tid": TID_LINK, "name": f"reload block {t['block']}", "cat": "link",
                    "ts": _us(t["start_s"]), "dur": _us(t["end_s"] - t["start_s"]), "args": {"bytes": t["bytes"]}})
    for s in doc.get("stalls", []):
        start, duration = s.get("start_s", s.get("time_s")), s.get("duration_s", 0.0)
        if start is not None:
            out.append({"ph": "X", "pid": pid, "tid": TID_STALLS, "name": str(s.get("kind", "stall")),
                        "cat": "stall", "ts": _us(start), "dur": _us(duration)})
    for p in doc.get("plans", []):
        if "time_s" in p:
            out.append({"ph": "i", "s": "t", "pid": pid, "tid": TID_PLANS, "name": "plan", "cat": "plan",
                        "ts": _us(p["time_s"]), "args": {k: v for k, v in p.items() if k != "time_s"}})
    return out


def _page_moves(plans: dict[str, np.ndarray], pid: int) -> list[dict]:
    """The plan log's transitions: an async slice from each start row to its block's next landed row (one begun in
    place, or not landed when the run ended, is left out), and an instant for each refused one."""
    if not plans or not len(plans["step"]):
        return []
    out = [_meta(pid, TID_REFUSED, "thread_name", "refused moves")]
    begun: dict[int, int] = {}  # block -> its start row, until it lands
    for i, status in enumerate(plans["status"]):
        block = int(plans["block"][i])
        name = "reload" if plans["to_bits"][i] > plans["from_bits"][i] else "offload"
        args = {"block": block, "layer": int(plans["layer"][i]), "expert": int(plans["expert"][i]),
                "kind": kind_name(int(plans["kind"][i])),
                "bits": f"{int(plans['from_bits'][i])}->{int(plans['to_bits'][i])}", "step": int(plans["step"][i])}
        if status == "started":
            begun[block] = i
        elif status == "rejected":
            out.append({"ph": "i", "s": "t", "pid": pid, "tid": TID_REFUSED, "name": f"refused {name}",
                        "cat": "page move", "ts": _us(plans["time_s"][i]),
                        "args": {**args, "reason": str(plans["reason"][i])}})
        elif status == "landed" and block in begun:
            s = begun.pop(block)
            ident = f"{pid}-move-{s}"
            out.append({"ph": "b", "pid": pid, "cat": "page move", "id": ident, "name": name,
                        "ts": _us(plans["time_s"][s]), "args": {**args, "reason": str(plans["reason"][s])}})
            out.append({"ph": "e", "pid": pid, "cat": "page move", "id": ident, "name": name,
                        "ts": _us(plans["time_s"][i])})
    return out


def _requests(requests: dict[str, np.ndarray], pid: int) -> list[dict]:
    out = []
    for i in range(len(requests["arrival_s"])):
        arrival, first, finish = (float(requests[k][i]) for k in ("arrival_s", "first_token_s", "finish_s"))
        args = {"request_id": str(requests["request_id"][i]), "prompt_tokens": int(requests["prompt_tokens"][i]),
                "output_tokens": int(requests["output_tokens"][i]),
                "finish_reason": str(requests["finish_reason"][i])}
        spans = [("waiting for first token", arrival, first), ("decoding", first, finish)]
        for name, start, end in spans:
            if np.isfinite(start) and np.isfinite(end) and end >= start:
                ident = f"{pid}-{i}"
                out.append({"ph": "b", "pid": pid, "cat": "request", "id": ident, "name": name, "ts": _us(start),
                            "args": args})
                out.append({"ph": "e", "pid": pid, "cat": "request", "id": ident, "name": name, "ts": _us(end)})
    return out
