"""Small, fast simulator set-ups for the tests/test_sim_*.py files.

`tiny_card()` is a two-layer MoE model card (8 experts, top-2) whose weights and KV cache are a few
hundred KiB, so a budget in KiB puts real pressure on the KV cache and a run takes well under a
second. `tiny_sim(...)` builds a Simulation of it with a synthetic workload and calibration.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

import policies
from policies.synthetic import synthetic_calibration
from pwsim.engine import SimConfig, Simulation
from pwsim.workload import synthetic
from traces.generators import LengthDist, RoutingSpec, WorkloadSpec
from traces.hardware import load_profile
from traces.model_card import ModelSpec

KiB = 1024


def tiny_card() -> ModelSpec:
    return ModelSpec(name="tiny-moe", arch="qwen2_moe", layers=2, hidden=64, expert_intermediate=32, experts=8,
                     shared_experts=1, shared_intermediate=64, top_k=2, heads=4, kv_heads=2, head_dim=16,
                     vocab=256, tied_embeddings=False)


def tiny_workload(card: ModelSpec, n: int = 24, seed: int = 0, rate: float = 2000.0, features: bool = True,
                  prompt: str = "uniform:8,64", output: str = "uniform:4,48", domains=("c4", "wikitext2", "code")):
    spec = WorkloadSpec(requests=n, rate=rate, prompt=LengthDist.parse(prompt), output=LengthDist.parse(output),
                        domains=tuple(domains))
    return synthetic(card, spec, RoutingSpec(features=features), seed)


def weights_at(card: ModelSpec, bits: int) -> int:
    """Non-expert fp16 bytes plus every expert block at `bits` (planes and LUTs)."""
    return card.fp16_bytes() - 2 * card.routed_expert_params() + card.expert_bytes(bits)


def tiny_sim(policy: str = "pagedweight", kv_blocks: int = 24, seed: int = 0, n: int = 24, card=None, cal=None,
             workload=None, params: dict | None = None, slack: int = 0, profile=None, **cfg) -> Simulation:
    """A Simulation whose budget holds the 8-bit weights plus `kv_blocks` KV blocks (plus `slack`), on `profile`
    (default h200-roofline)."""
    card = card or tiny_card()
    cal = cal if cal is not None else synthetic_calibration(card, seed=seed)
    workload = workload if workload is not None else tiny_workload(card, n=n, seed=seed)
    block = 16 * card.kv_bytes_per_token()
    budget = weights_at(card, 8) + kv_blocks * block + slack
    config = SimConfig(budget_bytes=budget, allocator_slack_bytes=slack, check_invariants=True, **cfg)
    return Simulation(card, profile or load_profile("h200-roofline"), workload, policies.get(policy, **(params or {})),
                      cal, config)


def summary_without_wall(summary: dict) -> dict:
    s = dict(summary)
    for k in ("wall_s", "sim_tokens_per_wall_s", "output_tokens_per_wall_s", "command"):
        s.pop(k, None)
    return s


def same_arrays(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    for k in a:
        x, y = np.asarray(a[k]), np.asarray(b[k])
        if x.shape != y.shape:
            return False
        if x.dtype.kind == "f":
            if not np.array_equal(x, y, equal_nan=True):
                return False
        elif not (x == y).all():
            return False
    return True


__all__ = ["tiny_card", "tiny_workload", "tiny_sim", "weights_at", "summary_without_wall", "same_arrays", "replace"]
