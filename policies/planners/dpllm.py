"""The dp-llm baseline: every plane stays resident; per-layer precision is chosen at run time.

Like DP-LLM, the model keeps its high-precision weights on the GPU and picks, per layer and per
step, which precision to compute with, from an input-dependent estimate of the error, so that the
mean bitwidth meets a target. Expressed in the page-table protocol: `reset` puts every block at
the top bitwidth (all planes resident) and every plan is made of `in_place` transitions
(`delta_bytes` 0) that engines apply with `PageTable.commit_in_place`: `q` moves, no page does.
Its real footprint is all planes plus every LUT (`weight_bytes`), its theoretical footprint the
committed bits (`theoretical_weight_bytes`), as the paper reports both.

Error estimate of layer l at b bits: `E[l, b] = sum_{i in l} w_i * s[i, b]`, with `w_i` the
expert's routing mass times the number of experts (1 when unobserved) times the block's squared
routing-weighted RMS input norm relative to its mean over the blocks the running requests use
(1 when no features are supplied; 0 for a block no running request routes to). Layers share the
target through the chain greedy of `scoring` (least estimated error per bit dropped).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from policies.apformat import lut_bytes_of
from policies.contract import Observation, Plan
from policies.planners.base import PolicyError, check_calibration, make_plan
from policies.planners.scoring import block_chain_greedy


@dataclass(frozen=True)
class DpLlmParams:
    target_bits: float = 4.0  # mean bitwidth over the expert weights
    update_interval: int = 1  # re-choose the layer precisions every this many steps
    use_features: bool = True
    use_routing: bool = True

    def __post_init__(self) -> None:
        if not 1 <= self.target_bits <= 8:
            raise ValueError(f"target_bits must be in 1..8, got {self.target_bits}")
        if self.update_interval < 1:
            raise ValueError(f"update_interval must be >= 1, got {self.update_interval}")


@dataclass
class DpLlmPolicy:
    params: DpLlmParams = field(default_factory=DpLlmParams)
    name: str = "dp-llm"
    layer_bits: np.ndarray | None = None
    _sens: np.ndarray | None = None

    def reset(self, table, calibration) -> None:
        cal = check_calibration(table, calibration, self.name)
        if self.params.target_bits < min(table.bits):
            raise PolicyError(f"dp-llm target {self.params.target_bits} bits is below the lowest supported "
                              f"bitwidth {min(table.bits)}")
        self._sens = np.asarray(cal.sensitivity, dtype=np.float64)
        table.initialize(max(table.bits))
        self.layer_bits = self.choose(table, None)
        bits = np.repeat(self.layer_bits, 2 * table.experts)
        for i in np.flatnonzero(bits != table.q):
            table.commit_in_place(int(i), int(bits[i]))

    def block_weights(self, table, obs: Observation | None) -> np.ndarray:
        w = np.ones(table.num_blocks)
        if obs is None:
            return w
        if self.params.use_routing and obs.routing_mass is not None:
            m = np.asarray(obs.routing_mass, dtype=np.float64) * table.experts
            seen = m.sum(axis=1, keepdims=True) > 0
            w *= np.repeat(np.where(seen, m, 1.0).reshape(-1), 2)
        if self.params.use_features and obs.prompt_features is not None:
            rms2 = np.asarray(obs.prompt_features, dtype=np.float64)[:, 1] ** 2
            used = rms2 > 0
            if used.any():
                w *= rms2 / rms2[used].mean()
        return w

    def choose(self, table, obs: Observation | None) -> np.ndarray:
        """[layers] bits per layer meeting the mean-bit target with the least estimated error."""
        bits = np.array(sorted(table.bits, reverse=True))
        frm, to = bits[:-1], bits[1:]
        L = table.layers
        if frm.size == 0:
            return np.full(L, bits[0])
        w = self.block_weights(table, obs)
        s = np.nan_to_num(self._sens[:, bits], nan=np.inf)  # [n, K] top-down
        err = np.zeros((L, bits.size))
        per_layer = 2 * table.experts
        for j in range(bits.size):  # sum_i w_i s_i^b per layer; inf * 0 counts as 0
            with np.errstate(invalid="ignore"):
                contrib = np.where(w > 0, w * s[:, j], 0.0)
            err[:, j] = contrib.reshape(L, per_layer).sum(axis=1)
        g = np.maximum(err[:, 1:] - err[:, :-1], 0.0)
        g[~np.isfinite(g)] = np.inf
        unit = np.broadcast_to((frm - to).astype(np.float64), g.shape)
        ok = np.isfinite(g)
        need = (bits[0] - self.params.target_bits) * L
        rows, cols = block_chain_greedy(np.where(ok, g, 0.0) / unit, unit, ok, np.zeros(L, dtype=np.int64),
                                        np.full(L, frm.size - 1), need)
        out = np.full(L, bits[0], dtype=np.int64)
        np.minimum.at(out, rows, to[cols])
        return out

    def plan_step(self, table, observation: Observation) -> Plan | None:
        if self._sens is None:
            raise PolicyError("policy 'dp-llm': call reset(table, calibration) before plan_step")
        if observation.step % self.params.update_interval:
            return None
        self.layer_bits = self.choose(table, observation)
        bits = np.repeat(self.layer_bits, 2 * table.experts)
        change = np.flatnonzero((bits != table.q) & (table.target < 0))
        return make_plan(table, change, bits[change], 0.0, "dp-llm: per-layer precision", in_place=True)

    def weight_bytes(self, table) -> int:
        """Real footprint: every plane and every supported bitwidth's LUT stay resident."""
        top = max(table.bits)
        luts = sum(lut_bytes_of(table.shapes[:, 0], b) for b in table.bits if b != top)
        return int(table.M[:, top].sum() + np.sum(luts))

    def theoretical_weight_bytes(self, table) -> int:
        return table.committed_bytes()
