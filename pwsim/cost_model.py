"""The cost model: how long one engine iteration takes on a hardware profile, per operator.

A roofline per operator (Vidur style): each operator takes `max(bytes / bandwidth, flops / rate)`
with the profile's achieved bandwidth for its op class and achieved GEMM rate, summed over layers.

* attention: q/k/v/o projection weights (fp16) and their GEMM FLOPs, plus the KV cache each
  sequence reads (its context and new tokens; sliding-window layers keep at most the window) and
  the score/value FLOPs (causal within a chunk).
* moe: the routed experts actually routed to this iteration, each linear-block at its committed
  bits (`q` planes + LUT_q, policies.apformat). As in the runtime, a batch of at most
  `ap_fused_max_tokens` tokens runs the fused AP kernel, in launch sets of at most `ap_fused_launch_tokens`
  that each read the planes, at `profile.ap_efficiency(q, tokens)` of the moe bandwidth (measured per
  batch size where the profile has it); a larger batch (prefill)
  dequantizes every active expert to fp16 (read AP, write and re-read fp16) and multiplies it by a
  GEMM, moves the dispatch's activations (`_dispatch_time`: gathered rows, GEMM inputs and outputs, the
  activation, the combine; in more than one chunk each row's scatter and the later chunks' rotation; the fp16
  experts' layers move them too), and pays the profile's
  `prefill_layer_overhead_us` once per layer with an active expert (the runtime's host work and launches
  for the layer's expert groups) and `prefill_chunk_overhead_us` for each
  chunk of experts after the first (the runtime takes a layer's experts `prefill_chunk_experts` at a time, as
  many as `prefill_chunk_bytes` of dequantized weights hold). A prefill layer that `policies.prefill_path` sends
  through the fused AP GEMM (every block at 3-4 bits, few rows an expert) skips the dequantization and the fp16
  GEMMs: each active expert's rows in whole tiles, at the profile's `ap_gemm_tflops` for its blocks' bits
  (`fused_gemm_times`; a profile without those rates prices the layer on the dequantize path), and it takes no
  chunks (no rows scattered or rotated); its fixed cost is `ap_gemm_layer_overhead_us`. With `fp16_experts` the
  experts are plain fp16 matrices (the fp16 baseline).
* dense: shared experts, dense MLP layers, routers, norms and the embedding gather.
* lm_head: the output projection for the sampled rows only.
* overhead: the profile's per-iteration and per-layer launch costs, and its host costs per token computed and
  per sequence scheduled.

`iteration_cost` is a pure function of (card, profile, batch, committed bits, routed experts);
`CostModel` is the same with the card- and profile-derived constants computed once (and the
per-block read times cached for the last committed bits seen: a cache, not state).
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

from policies import memory_budget
from policies.memory_budget import DEFAULT_PREFILL_CHUNK_BYTES
from policies.prefill_path import FUSED_GEMM_MAX_BITS, fused_gemm_layer, fused_gemm_tile_rows
from traces.hardware import AP_BITS, HardwareProfile
from traces.model_card import ModelSpec

FP16 = 2


@dataclass(frozen=True)
class BatchShape:
    """What one iteration computes: per scheduled sequence its new tokens and prior context."""

    new_tokens: np.ndarray  # [S] tokens computed this iteration per sequence
    context: np.ndarray  # [S] tokens already in the KV cache per sequence
    num_sampled: int  # sequences that sample a token (rows through the LM head)

    @classmethod
    def of(cls, new_tokens, context, num_sampled: int) -> "BatchShape":
        return cls(np.asarray(new_tokens, dtype=np.int64), np.asarray(context, dtype=np.int64), int(num_sampled))

    @property
    def num_tokens(self) -> int:
        return int(self.new_tokens.sum())


@dataclass(frozen=True)
class CostBreakdown:
    """Seconds per operator class of one iteration (or a sum over iterations)."""

    attention: float = 0.0
    moe: float = 0.0
    dense: float = 0.0
    lm_head: float = 0.0
    overhead: float = 0.0

    @property
    def device(self) -> float:
        """The GPU's work: every operator but the host's overhead."""
        return self.attention + self.moe + self.dense + self.lm_head

    @property
    def total(self) -> float:
        return self.device + self.overhead

    def __add__(self, other: "CostBreakdown") -> "CostBreakdown":
        return CostBreakdown(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    def to_json(self) -> dict:
        return {**{f.name: getattr(self, f.name) for f in fields(self)}, "total": self.total}


def prefill_chunks(card: ModelSpec, chunk_bytes: int) -> int:
    """The chunks a prefill MoE layer takes its experts in when `chunk_bytes` of them, dequantized to 16 bits, are
    alive at once (the runtime asks for every expert, `prefill_chunk_experts` at a time)."""
    return memory_budget.prefill_chunks(card.experts, card.hidden, card.expert_intermediate, FP16, chunk_bytes)


def _roof(nbytes, flops, bw: float, rate: float):
    return np.maximum(np.asarray(nbytes, dtype=np.float64) / bw, np.asarray(flops, dtype=np.float64) / rate)


class CostModel:
    """`iteration_cost` with the constants of one (card, profile) pair precomputed."""

    def __init__(self, card: ModelSpec, profile: HardwareProfile, fp16_experts: bool = False,
                 prefill_chunk_bytes: int = DEFAULT_PREFILL_CHUNK_BYTES) -> None:
        self.card, self.profile, self.fp16_experts = card, profile, fp16_experts
        c, p = card, profile
        self.rate = p.flops_per_s
        self.bw = {k: p.bandwidth(k) for k in p.achieved_bandwidth_fraction}
        self.L, self.E = c.moe_layers, c.experts
        # attention: weight bytes (sum over layers) and per-token KV bytes of full / sliding layers
        attn_params = np.array([c.attention_params(l) for l in range(c.layers)], dtype=np.float64)
        self.attn_weight_bytes = FP16 * attn_params.sum()
        self.attn_weight_flops_per_token = 2 * attn_params.sum()
        kv_tok, qk_dim = np.zeros(c.layers), np.zeros(c.layers)
        sliding = np.zeros(c.layers, dtype=bool)
        for l in range(c.layers):
            hd, kvh, _ = c.attention_geometry(l)
            kv_tok[l] = 2 * kvh * hd * FP16
            qk_dim[l] = c.heads * hd
            sliding[l] = bool(c.sliding_window) and l not in c.global_layers
        self.kv_full, self.kv_slide = kv_tok[~sliding].sum(), kv_tok[sliding].sum()
        self.qk_full, self.qk_slide = qk_dim[~sliding].sum(), qk_dim[sliding].sum()
        self.window = int(c.sliding_window)
        # dense: everything per layer that is neither attention nor routed experts
        dense = 0.0
        for l in range(c.layers):
            mlp = c.mlp_params(l)
            if l not in c.dense_layers:
                mlp -= c.experts * c.expert_params()
            dense += mlp + c.norms_per_layer * c.hidden
        self.dense_params = dense
        self.lm_params = c.vocab * c.hidden
        # moe: per-block bytes at each bitwidth, fp16 bytes and FLOPs per token
        shapes = c.block_shapes()
        self.block_bytes = c.block_byte_table().astype(np.float64)  # [2, 9]
        self.block_params = (shapes[:, 0] * shapes[:, 1]).astype(np.float64)  # [2]
        self.fused_max, self.launch_tokens = p.ap_fused_max_tokens, p.ap_fused_launch_tokens
        self._q_cache: tuple[np.ndarray, np.ndarray, np.ndarray, dict] | None = None
        self._flops_time = (2 * self.block_params / self.rate)[None, :]  # [1, 2] seconds per token
        self._fp16_time = (FP16 * self.block_params / self.bw["moe"])[None, :]  # [1, 2] seconds to stream fp16
        self.overhead = p.iteration_overhead_us * 1e-6 + c.layers * p.layer_overhead_us * 1e-6
        self.token_overhead = p.token_overhead_us * 1e-6
        self.sequence_overhead = p.sequence_overhead_us * 1e-6
        self.prefill_chunk_experts = memory_budget.prefill_chunk_experts(c.hidden, c.expert_intermediate, FP16,
                                                                         prefill_chunk_bytes)
        self.prefill_chunks = prefill_chunks(c, prefill_chunk_bytes)
        # the fused AP GEMM's FLOP/s by bits (0: a block of zeros, free; NaN: not measured), per tile size measured
        self._gemm_rates = {tile: np.array([np.inf] + [p.ap_gemm_rate(b, tile) or np.nan for b in range(1, 9)])
                            for tile in {t for table in p.ap_gemm_tflops.values() for t in table}}
        # a prefill layer's fixed host cost and what its chunks after the first add; a fused GEMM layer's (no chunks)
        self.prefill_layer_overhead = p.prefill_layer_overhead_us * 1e-6
        self.prefill_chunks_overhead = (self.prefill_chunks - 1) * p.prefill_chunk_overhead_us * 1e-6
        self.ap_gemm_layer_overhead = p.ap_gemm_layer_overhead_us * 1e-6

    # ------------------------------------------------------------------ parts
    def attention(self, batch: BatchShape) -> float:
        n, ctx = batch.new_tokens.astype(np.float64), batch.context.astype(np.float64)
        total = ctx + n
        t = n.sum()
        proj = _roof(self.attn_weight_bytes, self.attn_weight_flops_per_token * t, self.bw["attention"], self.rate)
        # causal attention: token j of a chunk sees ctx + j + 1 keys -> n*ctx + n(n+1)/2 pairs
        pairs_full = (n * ctx + n * (n + 1) / 2).sum()
        kv_full = total.sum()
        if self.window:
            w = float(self.window)
            kv_slide = np.minimum(total, w).sum()
            pairs_slide = (n * np.minimum(ctx + (n + 1) / 2, w)).sum()
        else:
            kv_slide, pairs_slide = kv_full, pairs_full
        kv_bytes = self.kv_full * kv_full + self.kv_slide * kv_slide
        flops = 4 * (self.qk_full * pairs_full + self.qk_slide * pairs_slide)
        return float(proj + _roof(kv_bytes, flops, self.bw["kv"], self.rate))

    def moe(self, q: np.ndarray, expert_tokens: np.ndarray, batch_tokens: int | None = None) -> float:
        """Routed experts: `q` committed bits per block (page-table order), `expert_tokens [L, E]` and the
        batch's token count (default: the most tokens routed in a layer / top-k)."""
        tok = np.asarray(expert_tokens).reshape(self.L, self.E)
        active = tok > 0
        n = tok[active].astype(np.float64)[:, None]  # [A, 1] tokens per active expert
        if not n.size:
            return 0.0
        compute = n * self._flops_time  # [A, 2] seconds of GEMM FLOPs per block
        if batch_tokens is None:
            batch_tokens = int(np.ceil(tok.sum(axis=1).max() / self.card.top_k))
        if self.fp16_experts:
            return float(np.maximum(self._fp16_time, compute).sum() + self._dispatch_time(tok, batch_tokens, False))
        if batch_tokens <= self.fused_max:  # launch sets of at most launch_tokens, each reading the planes
            launches = -(-batch_tokens // self.launch_tokens)
            per = -(-batch_tokens // launches)
            return float(launches * np.maximum(self._read_times(q, per)[active], compute / launches).sum())
        read_ap = self._read_times(q, 1)[active]  # [A, 2] the dequantize kernel reads each block once
        dequantized = (read_ap + self._fp16_time + np.maximum(self._fp16_time, compute)).sum(axis=1)  # write, GEMM
        fused = self.fused_gemm_times(q, tok)  # [L], NaN where a layer dequantizes
        on = ~np.isnan(fused)
        layers = active.any(axis=1)  # layers with an active expert pay the fixed prefill cost of their path
        return float(dequantized[~on[np.nonzero(active)[0]]].sum() + fused[on].sum()
                     + self._dispatch_time(tok, batch_tokens, self.prefill_chunks > 1, on)
                     + (layers & ~on).sum() * (self.prefill_layer_overhead + self.prefill_chunks_overhead)
                     + (layers & on).sum() * self.ap_gemm_layer_overhead)

    def fused_gemm_times(self, q: np.ndarray, tok: np.ndarray) -> np.ndarray:
        """Per MoE layer the seconds of its fused AP GEMMs (gate_up and down over every active expert's rows in whole
        tiles, padding included, at the profile's rate for each block's bits and the layer's tile rows), or NaN where
        the layer dequantizes: `policies.prefill_path` rules it out, a block is above FUSED_GEMM_MAX_BITS, or the
        profile has no rate for a block's bits at that tile size."""
        out = np.full(self.L, np.nan)
        if not self._gemm_rates:
            return out
        bits = np.asarray(q).astype(np.int64).reshape(self.L, self.E, 2)
        c, rows = self.card, tok.sum(axis=1)
        for layer in np.flatnonzero((rows > 0) & (bits.max(axis=(1, 2)) <= FUSED_GEMM_MAX_BITS)):
            if not fused_gemm_layer(int(rows[layer]), self.E, c.hidden, c.expert_intermediate):
                continue
            tile = fused_gemm_tile_rows(int(rows[layer]), self.E)
            rates = self._gemm_rates.get(tile)
            if rates is None:
                continue
            active = tok[layer] > 0
            padded = -(-tok[layer][active] // tile) * tile  # whole tiles of rows
            seconds = (padded[:, None] * 2 * self.block_params[None, :]
                       / rates[bits[layer][active]])  # a block at 0 bits (zeros) costs nothing
            if not np.isnan(seconds).any():
                out[layer] = seconds.sum()
        return out

    def _dispatch_time(self, tok: np.ndarray, batch_tokens: int, chunked: bool,
                       fused: np.ndarray | None = None) -> float:
        """Seconds the dispatch around the experts' GEMMs moves activations (the runtime's `grouped_mm_moe`), at the
        moe bandwidth: per routed row its input gathered (read, write), the gate/up GEMM's input and output, the
        activation (read [gate | up], write the product), the down GEMM's input and output and the combine's read;
        in more than one chunk (`chunked`) also each row's output scattered into slot order (read, write) and each
        row of a chunk after the first rotated to its chunk's start (read, write: a chunk moves only its own rows),
        except in the layers `fused` marks, whose fused GEMM takes every row at once (as a step the runtime does not
        capture runs them; a captured one also scatters their rows); and each token's output, in layers with a
        routed row."""
        h, i = self.card.hidden, self.card.expert_intermediate
        rows = tok.sum(axis=1).astype(np.float64)
        elements = rows.sum() * (5 * h + 6 * i) + int((rows > 0).sum()) * batch_tokens * h
        if chunked:
            chunks = slice(None) if fused is None else ~fused
            elements += 2 * h * (rows[chunks].sum() + float(tok[chunks, self.prefill_chunk_experts:].sum()))
        return FP16 * elements / self.bw["moe"]

    def _read_times(self, q: np.ndarray, tokens: int) -> np.ndarray:
        """Seconds the AP kernel takes to read each block at its bits (planes + LUT) in a batch of `tokens`,
        `[L, E, 2]`; cached for the last `q` seen (a cache, not state)."""
        q = np.asarray(q)
        if self._q_cache is None or not np.array_equal(self._q_cache[0], q):
            bits = q.astype(np.int64).reshape(self.L, self.E, 2)
            self._q_cache = (q.copy(), bits, self.block_bytes[[0, 1], bits], {})
        _, bits, nbytes, by_tokens = self._q_cache
        if tokens not in by_tokens:
            eff = np.ones(9)
            for b in AP_BITS:
                eff[b] = self.profile.ap_efficiency(b, tokens)
            by_tokens[tokens] = nbytes / (self.bw["moe"] * eff[bits])
        return by_tokens[tokens]

    def dense(self, batch: BatchShape) -> float:
        t = float(batch.new_tokens.sum())
        return float(_roof(FP16 * self.dense_params + FP16 * t * self.card.hidden, 2 * t * self.dense_params,
                           self.bw["dense"], self.rate))

    def lm_head(self, batch: BatchShape) -> float:
        if batch.num_sampled <= 0:
            return 0.0
        return float(_roof(FP16 * self.lm_params, 2 * batch.num_sampled * self.lm_params, self.bw["lm_head"], self.rate))

    def iteration(self, batch: BatchShape, q: np.ndarray, expert_tokens: np.ndarray) -> CostBreakdown:
        """The time of one iteration; an empty batch costs only the overhead."""
        if batch.num_tokens == 0:
            return CostBreakdown(overhead=self.overhead)
        return CostBreakdown(self.attention(batch), self.moe(q, expert_tokens, batch.num_tokens), self.dense(batch),
                             self.lm_head(batch), self.overhead + batch.num_tokens * self.token_overhead
                             + len(batch.new_tokens) * self.sequence_overhead)


def iteration_cost(card: ModelSpec, profile: HardwareProfile, batch: BatchShape, q: np.ndarray,
                   expert_tokens: np.ndarray, fp16_experts: bool = False) -> CostBreakdown:
    """Pure function form of `CostModel(card, profile).iteration(...)`."""
    return CostModel(card, profile, fp16_experts).iteration(batch, q, expert_tokens)
