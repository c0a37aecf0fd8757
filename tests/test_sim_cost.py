"""The cost model: per-operator breakdown, roofline anchors, scaling with bits, tokens and context."""
from __future__ import annotations

import numpy as np
import pytest

from pwsim.cost_model import BatchShape, CostModel, _roof, iteration_cost
from traces.hardware import load_profile
from traces.model_card import load_card


@pytest.fixture(scope="module")
def qwen():
    return load_card("Qwen1.5-MoE-A2.7B"), load_profile("h200-roofline")


def _decode_routing(L, E, active=4):
    et = np.zeros((L, E))
    et[:, :active] = 1
    return et


def test_breakdown_sums_to_total_and_empty_batch_costs_only_overhead(qwen):
    card, prof = qwen
    cm = CostModel(card, prof)
    q = np.full(card.moe_layers * card.experts * 2, 5)
    b = BatchShape.of([1, 1, 37], [100, 900, 0], 2)
    et = _decode_routing(card.moe_layers, card.experts, 12)
    c = cm.iteration(b, q, et)
    parts = [c.attention, c.moe, c.dense, c.lm_head, c.overhead]
    assert all(p > 0 for p in parts) and c.total == pytest.approx(sum(parts))
    assert c.to_json()["total"] == pytest.approx(c.total)
    empty = cm.iteration(BatchShape.of([], [], 0), q, np.zeros_like(et))
    overhead = (prof.iteration_overhead_us + card.layers * prof.layer_overhead_us) * 1e-6
    assert empty.total == empty.overhead == pytest.approx(overhead)
    # the host's costs per token computed and per sequence scheduled (39 tokens of 3 sequences)
    from dataclasses import replace
    hosted = CostModel(card, replace(prof, token_overhead_us=2.0, sequence_overhead_us=30.0)).iteration(b, q, et)
    assert hosted.overhead == pytest.approx(c.overhead + (39 * 2.0 + 3 * 30.0) * 1e-6)
    assert hosted.moe == c.moe and hosted.attention == c.attention


def test_moe_matches_the_design_roofline_anchors(qwen):
    """DESIGN.md: Qwen1.5-MoE, T=1, 4 active experts: fp16 roofline 17.5 us per layer, 3-bit 3.3 us."""
    card, prof = qwen
    et = _decode_routing(card.moe_layers, card.experts)
    q3 = np.full(card.moe_layers * card.experts * 2, 3)
    fp16 = CostModel(card, prof, fp16_experts=True).moe(q3, et) / card.moe_layers
    ap3 = CostModel(card, prof).moe(q3, et) / card.moe_layers
    assert fp16 * 1e6 == pytest.approx(17.5, abs=0.05)
    assert ap3 * 1e6 == pytest.approx(3.3, abs=0.06)


def test_moe_time_scales_with_committed_bits_and_only_routed_experts_count(qwen):
    card, prof = qwen
    cm = CostModel(card, prof)
    n = card.moe_layers * card.experts * 2
    et = _decode_routing(card.moe_layers, card.experts)
    times = [cm.moe(np.full(n, b), et) for b in range(3, 9)]
    assert all(a < b for a, b in zip(times, times[1:]))
    # bytes are exact: time = (planes + LUT) bytes / bandwidth for each routed block
    bt = card.block_byte_table()
    expect = card.moe_layers * 4 * (bt[0, 5] + bt[1, 5]) / prof.bandwidth("moe")
    assert cm.moe(np.full(n, 5), et) == pytest.approx(expect, rel=1e-12)
    # lowering an expert nobody routes to changes nothing; lowering a routed one does
    q = np.full(n, 8)
    base = cm.moe(q, et)
    q_cold = q.copy()
    q_cold[(0 * card.experts + 10) * 2] = 3
    assert cm.moe(q_cold, et) == base
    q_hot = q.copy()
    q_hot[(0 * card.experts + 1) * 2] = 3
    assert cm.moe(q_hot, et) < base
    assert cm.moe(q, et) == base  # the per-bits cache does not leak between calls


def test_prefill_is_compute_bound_and_dequantizes(qwen):
    card, prof = qwen
    cm = CostModel(card, prof)
    n = card.moe_layers * card.experts * 2
    q3, q8 = np.full(n, 3), np.full(n, 8)
    big = np.full((card.moe_layers, card.experts), 2048 * 4 / card.experts)
    small = np.full((card.moe_layers, card.experts), 4.0)
    # many tokens per expert: the dequantize + GEMM path, nearly independent of bits; few tokens: bytes dominate
    assert cm.moe(q3, big) / cm.moe(q8, big) > 0.8
    assert cm.moe(q3, small) / cm.moe(q8, small) < 0.5
    fp = CostModel(card, prof, fp16_experts=True)
    assert cm.moe(q8, big) > fp.moe(q8, big)  # dequantizing costs more than reading fp16 once


def test_attention_grows_with_context_and_pure_function_agrees(qwen):
    card, prof = qwen
    cm = CostModel(card, prof)
    a = [cm.attention(BatchShape.of([1] * 8, [ctx] * 8, 8)) for ctx in (128, 1024, 8192)]
    assert a[0] < a[1] < a[2]
    a0 = cm.attention(BatchShape.of([1] * 8, [0] * 8, 8))
    # decode attention is memory bound: 8 sequences read 8192 more cached tokens each
    assert a[2] - a0 == pytest.approx(card.kv_bytes_per_token() * 8 * 8192 / prof.bandwidth("kv"), rel=1e-9)
    q = np.full(card.moe_layers * card.experts * 2, 4)
    b = BatchShape.of([1, 64], [300, 0], 2)
    et = _decode_routing(card.moe_layers, card.experts, 20)
    assert iteration_cost(card, prof, b, q, et) == cm.iteration(b, q, et)


def test_lm_head_charged_only_for_sampled_rows(qwen):
    card, prof = qwen
    cm = CostModel(card, prof)
    assert cm.lm_head(BatchShape.of([512], [0], 0)) == 0.0
    one = cm.lm_head(BatchShape.of([1], [10], 1))
    assert one == pytest.approx(2 * card.vocab * card.hidden / prof.bandwidth("lm_head"), rel=1e-12)


def test_fused_kernel_or_dequantize_is_decided_by_the_batch_as_in_the_runtime(qwen):
    import dataclasses
    card, prof = qwen
    n = card.moe_layers * card.experts * 2
    q = np.full(n, 3)
    et = _decode_routing(card.moe_layers, card.experts, 4)  # one token on each of 4 experts
    cm = CostModel(card, prof)
    fused, two, dequant = cm.moe(q, et, batch_tokens=64), cm.moe(q, et, batch_tokens=65), cm.moe(q, et, batch_tokens=129)
    assert fused == pytest.approx(card.moe_layers * 4 * (card.block_byte_table()[:, 3].sum()) / prof.bandwidth("moe"))
    assert two == pytest.approx(2 * fused)  # 65..128 tokens: two launch sets of the fused kernel, each reading the planes
    assert dequant > 3 * fused  # above the runtime's 128 tokens every active expert is dequantized first
    assert cm.moe(q, et) == fused  # default: tokens routed per layer / top-k = 1
    # a profile measured per batch size: the fused time follows the interpolated efficiency
    measured = dataclasses.replace(prof, ap_efficiency_by_tokens={3: {1: 0.5, 16: 0.25}})
    cm2 = CostModel(card, measured)
    assert cm2.moe(q, et, batch_tokens=1) == pytest.approx(fused / 0.5)
    assert cm2.moe(q, et, batch_tokens=4) == pytest.approx(fused / 0.375)
    assert cm2.moe(q, et, batch_tokens=64) == pytest.approx(fused / 0.25)
    # a batch in launch sets: each set's share of the tokens, at that share's efficiency
    assert cm2.moe(q, et, batch_tokens=8) == pytest.approx(fused / (0.5 - 0.25 * 3 / 4))  # log2(8) / log2(16)
    one_set = CostModel(card, dataclasses.replace(measured, ap_fused_launch_tokens=128))
    assert cm2.moe(q, et, batch_tokens=128) == pytest.approx(2 * one_set.moe(q, et, batch_tokens=64))


def test_a_batch_in_uneven_launch_sets_is_timed_at_its_largest_set_s_efficiency(qwen):
    """9 tokens in launch sets of at most 8: two sets, of 5 and 4 tokens; each reads the planes at the efficiency of
    the larger share (5 tokens, rounded up), not the smaller."""
    import dataclasses
    card, prof = qwen
    q = np.full(card.moe_layers * card.experts * 2, 3)
    et = _decode_routing(card.moe_layers, card.experts, 4)
    fused = CostModel(card, prof).moe(q, et, batch_tokens=1)
    measured = dataclasses.replace(prof, ap_efficiency_by_tokens={3: {1: 0.5, 16: 0.25}}, ap_fused_launch_tokens=8)
    cm = CostModel(card, measured)
    assert cm.moe(q, et, batch_tokens=9) == pytest.approx(2 * fused / (0.5 - 0.25 * np.log2(5) / 4))
    assert cm.moe(q, et, batch_tokens=8) == pytest.approx(fused / (0.5 - 0.25 * 3 / 4))  # one set of 8


def test_a_long_prefill_s_attention_counts_the_causal_pairs_and_its_lm_head_one_row(qwen):
    """A prompt of n tokens from an empty cache: token j attends to j + 1 keys, n(n + 1)/2 pairs (compute bound at
    this length); it samples one row, so its LM head costs what one decode row's does."""
    card, prof = qwen
    cm = CostModel(card, prof)
    n = 8192
    b = BatchShape.of([n], [0], 1)
    proj = _roof(cm.attn_weight_bytes, cm.attn_weight_flops_per_token * n, cm.bw["attention"], cm.rate)
    pairs = n * (n + 1) / 2
    flops = 4 * (cm.qk_full + cm.qk_slide) * pairs
    assert flops / cm.rate > (cm.kv_full + cm.kv_slide) * n / cm.bw["kv"]       # compute bound
    assert cm.attention(b) == pytest.approx(float(proj) + flops / cm.rate, rel=1e-12)
    assert cm.lm_head(b) == cm.lm_head(BatchShape.of([1], [100], 1))


def test_sliding_layers_read_the_new_token_s_key_too():
    """A decode after 100 tokens on Gemma 4 (window 1024): every layer reads 101 keys, sliding ones included."""
    card, prof = load_card("gemma-4-26b-a4b"), load_profile("h200-roofline")
    cm = CostModel(card, prof)
    assert cm.window == 1024
    b = BatchShape.of([1], [100], 1)
    proj = float(_roof(cm.attn_weight_bytes, cm.attn_weight_flops_per_token, cm.bw["attention"], cm.rate))
    assert cm.attention(b) - proj == pytest.approx((cm.kv_full + cm.kv_slide) * 101 / cm.bw["kv"], rel=1e-9)


def test_layer_launch_overhead_is_charged_over_every_decoder_layer_dense_ones_too(qwen):
    """A model whose first layers are dense launches kernels for them too: the per-layer overhead counts all the
    decoder layers, not only the MoE ones."""
    from dataclasses import replace
    card, prof = qwen
    dense = replace(card, dense_layers=(0, 1, 2), dense_intermediate=5632)
    assert dense.layers == 24 and dense.moe_layers == 21
    prof = replace(prof, iteration_overhead_us=100.0, layer_overhead_us=10.0)
    cm = CostModel(dense, prof)
    assert cm.overhead == pytest.approx((100.0 + 24 * 10.0) * 1e-6)
    q = np.full(dense.moe_layers * dense.experts * 2, 4)
    empty = cm.iteration(BatchShape.of([], [], 0), q, np.zeros((dense.moe_layers, dense.experts)))
    assert empty.total == empty.overhead == pytest.approx((100.0 + 24 * 10.0) * 1e-6)


def test_a_window_the_context_never_reaches_costs_what_no_window_does():
    """A 1000-token prefill on Gemma 4 (window 1024): its sliding layers see every causal pair, as full ones do."""
    from dataclasses import replace
    card, prof = load_card("gemma-4-26b-a4b"), load_profile("h200-roofline")
    b = BatchShape.of([1000], [0], 1)
    windowed, unwindowed = CostModel(card, prof), CostModel(replace(card, sliding_window=0), prof)
    assert windowed.window == 1024 and unwindowed.window == 0
    assert windowed.attention(b) == pytest.approx(unwindowed.attention(b), rel=1e-12)


def test_a_long_decode_reads_the_window_on_sliding_layers_and_everything_on_global_ones():
    card, prof = load_card("gemma-4-26b-a4b"), load_profile("h200-roofline")
    cm = CostModel(card, prof)
    per_layer = {l: 2 * card.attention_geometry(l)[1] * card.attention_geometry(l)[0] * 2 for l in range(card.layers)}
    assert card.global_layers and cm.kv_full == sum(per_layer[l] for l in card.global_layers)
    b = BatchShape.of([1], [5000], 1)
    proj = float(_roof(cm.attn_weight_bytes, cm.attn_weight_flops_per_token, cm.bw["attention"], cm.rate))
    assert cm.attention(b) - proj == pytest.approx((cm.kv_full * 5001 + cm.kv_slide * 1024) / cm.bw["kv"], rel=1e-9)


def test_dense_parameters_are_the_model_less_attention_routed_experts_and_embeddings(qwen):
    card, prof = qwen
    cm = CostModel(card, prof)
    attention = sum(card.attention_params(l) for l in range(card.layers))
    assert cm.dense_params + attention + card.routed_expert_params() + card.embedding_params() == card.total_params()


def test_dense_reads_each_token_s_activations(qwen):
    """Even where the dense weights' read dominates, a batch of more tokens reads more activations."""
    card, prof = qwen
    cm = CostModel(card, prof)
    assert cm.dense(BatchShape.of([2], [0], 1)) > cm.dense(BatchShape.of([1], [0], 1))


def test_moe_batch_tokens_default_to_the_busiest_layer_over_top_k(qwen):
    card, prof = qwen
    cm = CostModel(card, prof)
    q = np.full(card.moe_layers * card.experts * 2, 4)
    tok = _decode_routing(card.moe_layers, card.experts, active=card.top_k)  # one token a layer ...
    tok[0, :card.top_k] = 200  # ... but 200 in layer 0: beyond the fused kernel's batch
    assert cm.moe(q, tok) == cm.moe(q, tok, batch_tokens=200)
    assert cm.moe(q, tok) != cm.moe(q, tok, batch_tokens=1)
