"""What a run's plan log says about its planner: how much it moved, where, why, what it was refused, what it undid.

`summarize(plans)` reads the columns of a plan log (`policies.plan_log`, `plans.parquet` of a `pwsim run` or a
`pwruntime replay`) and returns a JSON-able dict: transitions begun, refused and landed; offloads and reloads begun
and their net GPU bytes (what offloads freed, what reloads took back: planes and LUTs, the old LUT netted out);
the planning steps; the transitions begun per layer and per kind; the plans' reasons (the text before the first
':') and the refusals' reasons; the blocks moved most; and round trips: a block lowered and later raised again,
whose reload copies back planes the planner had dropped. Round trips are the
planner's cost of changing its mind; how many, how far apart and what share of the reload bytes they take is what
a planner's design can act on (`pwsim plan-log`).
"""
from __future__ import annotations

from collections import Counter

import numpy as np

from policies.plan_log import kind_name, reason_kind


def summarize(plans: dict[str, np.ndarray], top: int = 5) -> dict:
    """The summary of one plan log (see the module docstring); `top`: how many of the most moved blocks to name."""
    status = np.asarray(plans.get("status", []), dtype=object)
    started = status == "started"
    block = np.asarray(plans.get("block", []), dtype=np.int64)
    up = np.asarray(plans.get("to_bits", []), dtype=np.int64) > np.asarray(plans.get("from_bits", []), dtype=np.int64)
    delta = np.asarray(plans.get("delta_bytes", []), dtype=np.int64)
    step = np.asarray(plans.get("step", []), dtype=np.int64)
    reloads, offloads = started & up, started & ~up
    out = {
        "transitions": {s: int((status == s).sum()) for s in ("started", "rejected", "landed")},
        "offloads": int(offloads.sum()), "reloads": int(reloads.sum()),
        "freed_bytes": int(delta[offloads].sum()), "taken_bytes": int(-delta[reloads].sum()),
        "planning_steps": int(len(np.unique(step[started]))),
        "by_layer": _counts(np.asarray(plans.get("layer", []))[started], offloads[started]),
        "by_kind": {kind_name(k): v
                    for k, v in _counts(np.asarray(plans.get("kind", []))[started], offloads[started]).items()},
        "plan_reasons": dict(Counter(reason_kind(r) for r in np.asarray(plans.get("reason", []))[started])
                             .most_common()),
        "refusals": dict(Counter(str(r) for r in np.asarray(plans.get("reason", []))[status == "rejected"])
                         .most_common()),
    }
    moved = Counter(block[started].tolist())
    layer, expert, kind = (np.asarray(plans.get(c, []), dtype=np.int64) for c in ("layer", "expert", "kind"))
    first_row = {int(b): int(i) for i, b in reversed(list(enumerate(block)))}
    out["most_moved"] = [{"block": b, "layer": int(layer[first_row[b]]), "expert": int(expert[first_row[b]]),
                          "kind": kind_name(int(kind[first_row[b]])),
                          "transitions": n} for b, n in moved.most_common(top)]
    out["round_trips"] = _round_trips(block[started], step[started], up[started], -delta[started],
                                      out["taken_bytes"])
    return out


def _counts(keys: np.ndarray, is_offload: np.ndarray) -> dict:
    """{key: {"offloads": n, "reloads": m}} in key order."""
    return {int(k): {"offloads": int((is_offload & (keys == k)).sum()),
                     "reloads": int((~is_offload & (keys == k)).sum())} for k in np.unique(keys)}


def _round_trips(block: np.ndarray, step: np.ndarray, up: np.ndarray, taken: np.ndarray, all_taken: int) -> dict:
    """Begun transitions in log order: each reload of a block whose previous transition was an offload closes a round
    trip (steps between the two starts; the bytes the reload took back)."""
    last_offload: dict[int, int] = {}  # block -> step of its offload not yet undone
    gaps, nbytes, blocks = [], 0, set()
    for b, s, is_up, rb in zip(block.tolist(), step.tolist(), up.tolist(), taken.tolist()):
        if not is_up:
            last_offload[b] = s
        elif b in last_offload:
            gaps.append(s - last_offload.pop(b))
            nbytes += rb
            blocks.add(b)
    return {"count": len(gaps), "blocks": len(blocks), "taken_bytes": int(nbytes),
            "share_of_taken_bytes": nbytes / all_taken if all_taken else None,
            "steps_apart_p50": float(np.median(gaps)) if gaps else None,
            "steps_apart_min": int(min(gaps)) if gaps else None}
