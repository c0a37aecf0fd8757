"""`pwruntime bench plans`: what a plan's transitions cost the runtime's host, and its reloads the copy stream.

For each model shape, `layers` MoE layers of random AP experts are served by the runtime's own plan machinery: a
`DeviceExpertStore` following a `policies.PageTable`, a `CudaPageMover` and a `policies.PlanLoop`, driven by a
policy that plays given plans. A round is four iteration boundaries: a plan offloading every block from 8 bits to
`low_bits` (begin), the boundary after the device passed it (its offloads land), a plan reloading every block back
to 8 bits (begin), and the boundary after the copies (its reloads land). Each boundary's host time (`PlanLoop.step`,
what the engine's plan phase runs) is divided by the blocks it moved; the reloads' copy rate is their bytes over
their copy time on the copy stream. The median of `reps` rounds is reported after one warm-up round.

No forward runs between boundaries, so this is the plan loop's own cost: a replay's planning step adds the planner's
`plan_step`, the routing read and the KV cache's resize (`pwsim fidelity --fit-profile` fits those from a replay).
On the CPU the same code runs with CPU tensors, where every transfer lands at the boundary that began it.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from policies.apformat import MAX_BITS
from policies.contract import Observation, Plan
from policies.loop import PlanLoop
from policies.page_table import PageTable
from policies.planners.base import make_plan
from pwruntime.device_store import DeviceExpertStore
from pwruntime.kernels.bench import BITS
from pwruntime.kernels.bench import MODEL_SHAPES as SHAPES
from pwruntime.page_mover import CudaPageMover
from pwruntime.quant.dummy import random_layers
from traces.clikit import pyplot, write_png

PHASES = ("begin_offload", "land_offload", "begin_reload", "land_reload")


@dataclass(frozen=True)
class PlansConfig:
    models: tuple[str, ...] = tuple(SHAPES)
    layers: int = 1
    low_bits: int = 4
    reps: int = 5
    seed: int = 0
    plane_arena: bool = False  # the store's planes in a PlaneArena (pwruntime.plane_arena; CUDA)


class PlayedPlans:
    """A policy that returns the plan it was handed, once."""

    name = "played"

    def __init__(self) -> None:
        self.next: Plan | None = None

    def reset(self, table, calibration) -> None:
        return None

    def plan_step(self, table, observation) -> Plan | None:
        plan, self.next = self.next, None
        return plan


def drain(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class PlanMachinery:
    """The runtime's plan machinery over `layers` MoE layers of random AP experts of one model shape, every block at
    8 bits, driven by a policy that plays the plans it is handed (`policy.next`)."""
    table: PageTable
    store: DeviceExpertStore
    mover: CudaPageMover
    policy: PlayedPlans
    loop: PlanLoop
    observation: Observation   # what `loop.step` is given: no planner reads it

    @classmethod
    def build(cls, model: str, layers: int, seed: int, plane_arena: bool, device: torch.device,
              progress=lambda s: None) -> "PlanMachinery":
        hidden, intermediate, experts, _ = SHAPES[model]
        progress(f"{model}: random experts")
        weights = random_layers(hidden, intermediate, experts, layers, torch.Generator().manual_seed(seed))
        table = PageTable(layers, experts, hidden, intermediate, bits=BITS)
        store = DeviceExpertStore(weights, experts=experts, hidden=hidden, intermediate=intermediate, bits=BITS,
                                  device=device, table=table, arena=plane_arena)
        del weights  # the store holds its own (pinned) master
        mover, policy = CudaPageMover(store), PlayedPlans()
        observation = Observation(step=0, time_s=0.0, free_blocks=0, total_blocks=0, kv_block_bytes=0,
                                  free_block_threshold=0)
        return cls(table, store, mover, policy, PlanLoop(policy, table, mover), observation)


def measure(model: str, cfg: PlansConfig, device: torch.device, progress=lambda s: None) -> dict:
    """One model shape's row: host microseconds a transition for each boundary of `PHASES`, reload copy GB/s."""
    m = PlanMachinery.build(model, cfg.layers, cfg.seed, cfg.plane_arena, device, progress)
    table, store, mover, policy, loop, obs = m.table, m.store, m.mover, m.policy, m.loop, m.observation
    n = table.num_blocks
    per_round: dict[str, list[float]] = {p: [] for p in PHASES}
    copy_bytes, copy_s = 0, 0.0
    for r in range(cfg.reps + 1):
        progress(f"{model}: round {r + 1} of {cfg.reps + 1}")
        bytes0, seconds0 = mover.stats.bytes_reloaded, mover.stats.reload_seconds
        for phase, to_bits in zip(PHASES, (cfg.low_bits, None, MAX_BITS, None)):
            if to_bits is not None:
                policy.next = make_plan(table, np.arange(n), np.full(n, to_bits), 0.0, f"every block to {to_bits} bits")
            else:
                drain(device)
            t0 = time.perf_counter()
            result = loop.step(obs)
            us = (time.perf_counter() - t0) * 1e6
            if to_bits is not None and len(result.started) != n:
                raise RuntimeError(f"{model}: {len(result.rejected)} transitions refused: {result.rejected[:1]}")
            if r:
                per_round[phase].append(us / n)
        drain(device)
        loop.step(obs)  # anything still in flight (none after the drains) lands before the next round
        if r:
            copy_bytes += mover.stats.bytes_reloaded - bytes0
            copy_s += mover.stats.reload_seconds - seconds0
    if not np.all(table.q == MAX_BITS) or mover.num_pending:
        raise RuntimeError(f"{model}: blocks left at {sorted(set(table.q.tolist()))} bits, "
                           f"{mover.num_pending} transfers pending")
    row: dict = {"model": model, "layers": cfg.layers, "blocks": n, "low_bits": cfg.low_bits,
                 "reload_bytes_per_block": copy_bytes // (cfg.reps * n)}
    for phase in PHASES:
        row[f"{phase}_us"] = statistics.median(per_round[phase])
    row["transition_us"] = (sum(row[f"{p}_us"] for p in PHASES)) / 2
    row["reload_copy_gbps"] = copy_bytes / copy_s / 1e9 if copy_s > 0 else None
    if store.arena is not None:  # its moves a transition, over every round (the warm-up's included)
        row["arena_moves_per_transition"] = store.arena.moves / (2 * n * (cfg.reps + 1))
    return row


def run(cfg: PlansConfig, device: torch.device, progress=lambda s: None) -> dict:
    rows = []
    for model in cfg.models:
        rows.append(measure(model, cfg, device, progress))
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return {"layers": cfg.layers, "low_bits": cfg.low_bits, "reps": cfg.reps, "seed": cfg.seed,
            "plane_arena": cfg.plane_arena, "rows": rows}


def print_table(res: dict) -> None:
    arena = ", planes in a plane arena" if res.get("plane_arena") else ""
    print(f"plan transitions on {res['device']}{arena}: every block 8 -> {res['low_bits']} -> 8 bits, host us a "
          f"transition (median of {res['reps']} rounds)")
    print(f"{'model':<20}{'blocks':>7}{'begin off':>11}{'land off':>10}{'begin rel':>11}{'land rel':>10}"
          f"{'a transition':>14}{'copy GB/s':>11}")
    for r in res["rows"]:
        gbps = "-" if r["reload_copy_gbps"] is None else f"{r['reload_copy_gbps']:.1f}"
        print(f"{r['model']:<20}{r['blocks']:>7}{r['begin_offload_us']:>11.1f}{r['land_offload_us']:>10.1f}"
              f"{r['begin_reload_us']:>11.1f}{r['land_reload_us']:>10.1f}{r['transition_us']:>14.1f}{gbps:>11}")


def plot(res: dict, png: Path) -> Path:
    """A stacked bar per model shape: each boundary's host time a transition, the round's total on top."""
    plt = pyplot()
    rows = res["rows"]
    fig, ax = plt.subplots(figsize=(max(5.0, 1.3 * len(rows)), 4.2))
    labels = {"begin_offload": "boundary beginning the offloads", "land_offload": "next boundary (offloads land)",
              "begin_reload": "boundary beginning the reloads", "land_reload": "next boundary (reloads land)"}
    bottom = [0.0] * len(rows)
    for phase in PHASES:
        values = [r[f"{phase}_us"] / 2 for r in rows]  # a round is two transitions a block
        ax.bar(range(len(rows)), values, 0.6, bottom=bottom, label=labels[phase])
        bottom = [b + v for b, v in zip(bottom, values)]
    for x, r in enumerate(rows):
        ax.annotate(f"{r['transition_us']:.0f}", (x, r["transition_us"]), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(rows)), [f"{r['model']}\n{r['blocks']} blocks" for r in rows], fontsize=7)
    ax.set_ylabel("host us a transition")
    ax.set_title(f"A plan's transitions, 8 -> {res['low_bits']} -> 8 bits ({res['device']})", fontsize=9)
    ax.legend(fontsize=7)
    return write_png(fig, png, dpi=120)
