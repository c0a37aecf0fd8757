"""`pwruntime bench plans --plan-log DIR`: the plans a run made (its plan log, `plans.parquet`) played through the
runtime's plan machinery: what they cost the host a transition, and with `--plane-arena` the arena's moves, its
driver calls and the memory it maps above what its tensors take.

Where `bench plans` plays every block 8 -> low -> 8 bits, this plays the plans a planner really made, in their order
and sizes: a `pwsim run`'s (what the simulator predicts the planner does under a workload) or a `pwruntime
replay`'s, of the same model shape. The transitions each plan started in the first `layers` MoE layers begin at one
boundary (`PlanLoop.step`, as the engine's plan phase runs it) and land at the next, once the device has passed them;
no forward runs between. Each block starts at the bits its first transition in the log starts from (8 for a block
the log never moves), set before the clock starts.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from policies.planners.base import make_plan
from pwruntime.bench_plans import SHAPES, PlanMachinery, drain
from pwruntime.vmm import DriverCalls
from traces.clikit import UserError, pyplot, write_png
from traces.results import read_plan_log


@dataclass(frozen=True)
class PlanLogConfig:
    log: str  # a result directory holding plans.parquet
    model: str  # the shape the run served (bench_plans.SHAPES)
    layers: int = 1
    plane_arena: bool = False
    seed: int = 0


def started_plans(log: dict[str, np.ndarray], model: str, layers: int) -> list[tuple[int, np.ndarray, np.ndarray,
                                                                                   np.ndarray]]:
    """(step, blocks, from bits, to bits) of every step's started transitions in the first `layers` layers, in step
    order; a log whose blocks `model`'s page table numbers otherwise is a UserError."""
    _, _, experts, _ = SHAPES[model]
    started = (log["status"] == "started") & (log["layer"] < layers)
    block, layer, expert, kind = (log[c][started].astype(np.int64) for c in ("block", "layer", "expert", "kind"))
    if np.any(expert >= experts) or np.any(block != (layer * experts + expert) * 2 + kind):
        raise UserError(f"--plan-log: its blocks are not {model}'s ({experts} experts a layer, two blocks each); "
                        f"give --models the shape of the model the run served")
    steps = log["step"][started]
    order = np.argsort(steps, kind="stable")
    step, block = steps[order], block[order]
    frm, to = log["from_bits"][started][order].astype(np.int64), log["to_bits"][started][order].astype(np.int64)
    cuts = np.flatnonzero(np.diff(step)) + 1
    return [(int(s[0]), b, f, t) for s, b, f, t in zip(np.split(step, cuts), np.split(block, cuts),
                                                       np.split(frm, cuts), np.split(to, cuts)) if len(s)]


def log_plans(cfg: PlanLogConfig) -> list[tuple[int, np.ndarray, np.ndarray, np.ndarray]]:
    """`started_plans` of the config's log; a UserError when it holds no plan log or none of them in its layers."""
    log = read_plan_log(cfg.log, flag="--plan-log")
    if not log:
        raise UserError(f"--plan-log {cfg.log} holds no plan log (plans.parquet); give the --out of a `pwsim run` or "
                        "a `pwruntime replay`")
    plans = started_plans(log, cfg.model, cfg.layers)
    if not plans:
        raise UserError(f"--plan-log {cfg.log}: no transition started in the first {cfg.layers} layer(s)")
    return plans


def measure(cfg: PlanLogConfig, device: torch.device, plans: list, progress=lambda s: None) -> dict:
    """The row of the log's `plans` (`log_plans`) played: host microseconds a transition at the boundaries that begin
    and land them, and per plan its transitions and host time (and the arena's mapped memory over its tensors')."""
    m = PlanMachinery.build(cfg.model, cfg.layers, cfg.seed, cfg.plane_arena, device, progress)
    _start_where_the_log_starts(m, plans, device)
    arena = m.store.arena
    calls0, moves0 = (arena.driver_calls, arena.moves) if arena is not None else (DriverCalls(), 0)
    per_plan = []
    for k, (step, blocks, frm, to) in enumerate(plans):
        if k % 10 == 0:
            progress(f"plan {k + 1} of {len(plans)}")
        stale = np.flatnonzero(m.table.q[blocks] != frm)
        if len(stale):
            i = int(stale[0])
            raise UserError(f"--plan-log: step {step} moves block {int(blocks[i])} from {int(frm[i])} bits, but the "
                            f"log's earlier plans left it at {int(m.table.q[blocks[i]])}: the log is not one run's")
        m.policy.next = make_plan(m.table, blocks, to, 0.0, f"step {step} of the log")
        t0 = time.perf_counter()
        result = m.loop.step(m.observation)
        t1 = time.perf_counter()
        if len(result.started) != len(blocks):
            raise RuntimeError(f"step {step}: {len(result.rejected)} transitions refused: {result.rejected[:1]}")
        drain(device)
        t2 = time.perf_counter()
        m.loop.step(m.observation)
        t3 = time.perf_counter()
        per_plan.append({"step": step, "transitions": len(blocks), "offloads": int(np.sum(to < frm)),
                         "begin_us": (t1 - t0) * 1e6, "land_us": (t3 - t2) * 1e6,
                         "mapped_over_live": arena.mapped / arena.live if arena is not None and arena.live else None})
    n = sum(p["transitions"] for p in per_plan)
    row = {"model": cfg.model, "layers": cfg.layers, "plans": len(per_plan), "transitions": n,
           "offloads": sum(p["offloads"] for p in per_plan),
           "begin_us": sum(p["begin_us"] for p in per_plan) / n, "land_us": sum(p["land_us"] for p in per_plan) / n}
    row["transition_us"] = row["begin_us"] + row["land_us"]
    if arena is not None:
        calls = arena.driver_calls
        ratios = [p["mapped_over_live"] for p in per_plan if p["mapped_over_live"] is not None]
        row.update(arena_moves_per_transition=(arena.moves - moves0) / n,   # the log's plans', not its start's
                   handles_mapped_per_transition=(calls.mapped - calls0.mapped) / n,
                   handles_unmapped_per_transition=(calls.unmapped - calls0.unmapped) / n,
                   driver_us_per_transition=(calls.seconds - calls0.seconds) * 1e6 / n,
                   mapped_over_live_mean=float(np.mean(ratios)), mapped_over_live_max=float(np.max(ratios)))
    return {"plan_log": str(cfg.log), "layers": cfg.layers, "seed": cfg.seed, "plane_arena": cfg.plane_arena,
            "row": row, "per_plan": per_plan}


def _start_where_the_log_starts(m: PlanMachinery, plans, device: torch.device) -> None:
    """Lower each block the log moves to the bits its first transition starts from (one plan, landed)."""
    first: dict[int, int] = {}
    for _, blocks, frm, _ in plans:
        for b, f in zip(blocks.tolist(), frm.tolist()):
            first.setdefault(b, f)
    lower = {b: f for b, f in first.items() if f != int(m.table.q[b])}
    if lower:
        m.policy.next = make_plan(m.table, list(lower), list(lower.values()), 0.0, "the log's starting bits")
        if len(m.loop.step(m.observation).started) != len(lower):
            raise UserError("--plan-log: the store cannot take the bits the log's blocks start at")
        drain(device)
        m.loop.step(m.observation)


def print_table(res: dict) -> None:
    r = res["row"]
    arena = ", planes in a plane arena" if res["plane_arena"] else ""
    print(f"the plans of {res['plan_log']} on {res['device']}{arena}: {r['plans']} plans, {r['transitions']} "
          f"transitions ({r['offloads']} offloads) in {r['layers']} layer(s) of {r['model']}")
    print(f"host us a transition: {r['begin_us']:.1f} to begin, {r['land_us']:.1f} to land, {r['transition_us']:.1f} "
          "in all")
    if res["plane_arena"]:
        print(f"the arena a transition: {r['arena_moves_per_transition']:.2f} moves, "
              f"{r['handles_mapped_per_transition']:.2f} handles mapped and {r['handles_unmapped_per_transition']:.2f} "
              f"unmapped in {r['driver_us_per_transition']:.1f} us; mapped memory over its tensors' "
              f"{r['mapped_over_live_mean']:.4f} on average, {r['mapped_over_live_max']:.4f} at most")


def plot(res: dict, png) -> object:
    """Each plan's host time a transition (begin, land) in log order; with an arena, its mapped memory over its
    tensors' after each plan."""
    plt = pyplot()
    plans = res["per_plan"]
    x = np.arange(len(plans))
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.bar(x, [p["begin_us"] / p["transitions"] for p in plans], 0.8, label="begin (us a transition)")
    ax.bar(x, [p["land_us"] / p["transitions"] for p in plans], 0.8,
           bottom=[p["begin_us"] / p["transitions"] for p in plans], label="land (us a transition)")
    ax.set_xlabel("plan, in the log's order")
    ax.set_ylabel("host us a transition")
    ax.legend(fontsize=7, loc="upper left")
    if res["plane_arena"]:
        twin = ax.twinx()
        ratios = [np.nan if p["mapped_over_live"] is None else p["mapped_over_live"] for p in plans]
        twin.plot(x, ratios, color="k", lw=1, label="arena: mapped / its tensors")
        twin.set_ylabel("mapped over live")
        twin.legend(fontsize=7, loc="upper right")
    ax.set_title(f"The plans of {res['plan_log']}, {res['row']['model']} ({res['device']})", fontsize=9)
    return write_png(fig, png, dpi=120)
