"""DenseExpertStore (grouped dispatch), the padded prefill dispatch, and the routing records of forward(record=True)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from model_fixtures import load_hf_model, make_tiny_checkpoint
from pwruntime.model import DenseExpertStore, ExpertStore, load_model, prefill_metadata
from pwruntime.model.experts import checked_block_index, expert_groups, grouped_mm_moe, padded_moe


def _naive_moe(gate_up, down, x, ids, weights):
    """Per token, per slot: the definition of the routed MoE output and the down-input norms."""
    out = torch.zeros_like(x)
    norms = torch.zeros(ids.shape)
    inter = down.shape[2]
    for t in range(x.shape[0]):
        for s in range(ids.shape[1]):
            e = int(ids[t, s])
            h = gate_up[e] @ x[t]
            act = F.silu(h[:inter]) * h[inter:]
            norms[t, s] = act.norm()
            out[t] += weights[t, s] * (down[e] @ act)
    return out, norms


def test_dense_store_matches_naive_definition():
    g = torch.Generator().manual_seed(0)
    n_layers, e_n, h, inter, t, k = 2, 6, 16, 8, 23, 3
    gate_up = [torch.randn(e_n, 2 * inter, h, generator=g) for _ in range(n_layers)]
    down = [torch.randn(e_n, h, inter, generator=g) for _ in range(n_layers)]
    store = DenseExpertStore(gate_up, down)
    assert isinstance(store, ExpertStore)
    x = torch.randn(t, h, generator=g)
    ids = torch.stack([torch.randperm(e_n, generator=g)[:k] for _ in range(t)])
    ids[:, 0] = 2                      # expert 2 is hot; some experts may be idle
    weights = torch.rand(t, k, generator=g)
    norms = torch.empty(t, k)
    got = store.moe(1, x, ids, weights, down_in_norm=norms)
    ref, ref_norms = _naive_moe(gate_up[1], down[1], x, ids, weights)
    assert torch.allclose(got, ref, atol=1e-4, rtol=1e-5)
    assert torch.allclose(norms, ref_norms, atol=1e-4, rtol=1e-5)
    assert torch.equal(store.moe(1, x, ids, weights), got)
    assert torch.equal(store.weight(0, 3, "gate_up"), gate_up[0][3])
    assert store.weight(1, 5, "down").shape == (h, inter)
    with pytest.raises(ValueError):
        store.weight(0, 0, "up")


def test_a_block_index_exists_only_for_the_store_s_layers_and_experts():
    assert checked_block_index(1, 7, "down", 2, 8) == (1 * 8 + 7) * 2 + 1   # the page table's row
    for layer, expert in ((2, 0), (0, 8), (-1, 0)):
        with pytest.raises(ValueError, match=f"no block L{layer}.E{expert}"):
            checked_block_index(layer, expert, "gate_up", 2, 8)


def test_expert_groups_cover_active_experts_once_within_the_padding_bound():
    assert expert_groups([0, 100, 10, 10, 0, 9], 8, 10) == [[1], [2, 3, 5]]  # 100 would pad the others by 271 rows
    assert expert_groups([0, 100, 10, 10, 0, 9], 8, 271) == [[1, 2, 3, 5]]
    assert expert_groups([5, 5, 5, 5, 5], 2, 0) == [[0, 1], [2, 3], [4]]
    assert expert_groups([3, 2, 1], 8, 0) == [[0], [1], [2]]
    assert expert_groups([0, 0], 4, 10) == []
    rng = np.random.default_rng(0)
    for _ in range(200):
        counts = rng.integers(0, 60, size=int(rng.integers(1, 40))) * (rng.random(1) < 0.9)
        cap, pad = int(rng.integers(1, 10)), int(rng.integers(0, 100))
        groups = expert_groups(counts.tolist(), cap, pad)
        assert sorted(e for g in groups for e in g) == [e for e, c in enumerate(counts) if c > 0]
        for g in groups:
            assert len(g) <= cap and counts[g[0]] == max(counts[g])
            assert len(g) * counts[g[0]] - counts[g].sum() <= pad
    with pytest.raises(ValueError, match="max_experts"):
        expert_groups([1], 0, 0)


@pytest.fixture
def garbage_past_the_groups(monkeypatch):
    """torch's grouped GEMM with NaN in the rows past its last offset (it leaves them unwritten): a dispatch that
    kept such a row would show it."""
    real = torch._grouped_mm

    def grouped_mm(a, b, offs):
        out = real(a, b, offs=offs)
        out[int(offs[-1]):] = float("nan")
        return out
    monkeypatch.setattr(torch, "_grouped_mm", grouped_mm)


@pytest.mark.parametrize("dispatch", ["padded", "grouped_mm"])
@pytest.mark.parametrize("tokens,cap,pad", [(1, 4, 0), (23, 1, 100), (23, 3, 5), (150, 6, 40), (150, 6, 10 ** 6),
                                             (2, 8, 0), (1, 2, 0)])
def test_batched_dispatches_equal_the_per_expert_one(dispatch, tokens, cap, pad, garbage_past_the_groups):
    """padded_moe (groups padded to their largest count) and grouped_mm_moe (torch's grouped GEMM over chunks of
    experts in id order, every expert asked for: nothing read back) give the per-expert dispatch's outputs and down
    norms, asking each expert's weights at most once; with few tokens chunks hold experts without rows, or none at
    all (one token of 3 experts: 3 chunks of two experts, at least one of them empty)."""
    g = torch.Generator().manual_seed(tokens)
    e_n, h, inter, k = 6, 16, 8, 3
    gate_up, down = torch.randn(e_n, 2 * inter, h, generator=g), torch.randn(e_n, h, inter, generator=g)
    store = DenseExpertStore([gate_up], [down])
    x = torch.randn(tokens, h, generator=g)
    ids = torch.stack([torch.randperm(e_n, generator=g)[:k] for _ in range(tokens)])
    ids[: tokens // 2, 0] = 4  # a hot expert: groups of very different counts
    weights = torch.rand(tokens, k, generator=g)
    asked: list[list[int]] = []

    def weights_of(group):
        asked.append(list(group))
        return gate_up[group], down[group]

    norms, want_norms = torch.empty(tokens, k), torch.empty(tokens, k)
    active = sorted(set(ids.flatten().tolist()))
    if dispatch == "padded":
        got = padded_moe(x, ids, weights, e_n, weights_of, cap, pad, down_in_norm=norms)
        assert sorted(e for grp in asked for e in grp) == active  # each active expert made once
    else:
        got = grouped_mm_moe(x, ids, weights, e_n, weights_of, cap, down_in_norm=norms)
        assert asked == [list(range(i, min(i + cap, e_n))) for i in range(0, e_n, cap)]   # every expert, in id order
    want = store.moe(0, x, ids, weights, down_in_norm=want_norms)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(norms, want_norms, rtol=1e-5, atol=1e-5)
    naive, naive_norms = _naive_moe(gate_up, down, x, ids, weights)   # the definition, no dispatch shared
    torch.testing.assert_close(got, naive, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(norms, naive_norms, rtol=1e-4, atol=1e-4)
    assert all(len(grp) <= cap for grp in asked)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                    reason="needs a GPU of compute capability 9.0 or newer (the grouped GEMM)")
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_gpu_grouped_mm_moe_in_chunks_equals_one_chunk_bit_for_bit(act, garbage_past_the_groups):
    """In bf16 on the GPU, the chunks' bounded moves, activations and norms (each chunk's rows only: the GEMMs leave
    NaN past them here) give one chunk's outputs and down norms exactly, whatever the chunk size, empty chunks too."""
    g = torch.Generator(device="cuda").manual_seed(0)
    e_n, h, inter, k, tokens = 24, 256, 128, 4, 300
    gate_up = (torch.randn(e_n, 2 * inter, h, device="cuda", generator=g) * 0.05).bfloat16()
    down = (torch.randn(e_n, h, inter, device="cuda", generator=g) * 0.05).bfloat16()
    x = torch.randn(tokens, h, device="cuda", generator=g).bfloat16()
    ids = torch.rand(tokens, e_n, device="cuda", generator=g)[:, :e_n - 5].argsort(1)[:, :k]   # 5 experts idle
    weights = torch.rand(tokens, k, device="cuda", generator=g)
    weights_of = lambda r: (gate_up[r.start:r.stop], down[r.start:r.stop])  # noqa: E731
    one_norms = torch.empty(tokens, k, device="cuda")
    one = grouped_mm_moe(x, ids, weights, e_n, weights_of, e_n, one_norms, act)
    assert not one.isnan().any()
    for chunk in (12, 7, 5, 1):
        norms = torch.full((tokens, k), float("nan"), device="cuda")
        got = grouped_mm_moe(x, ids, weights, e_n, weights_of, chunk, norms, act)
        assert torch.equal(got, one) and torch.equal(norms, one_norms), chunk


def test_routing_records_match_transformers_router(tmp_path):
    path = make_tiny_checkpoint(tmp_path, "qwen2_moe", seed=3, num_hidden_layers=3, mlp_only_layers=[1])
    hf, model = load_hf_model(path), load_model(path)
    ids = [1, 9, 33, 4, 70, 12, 5, 101, 64, 7]
    mlp_inputs = {}
    hooks = [hf.model.layers[i].mlp.register_forward_pre_hook(
        lambda mod, args, i=i: mlp_inputs.__setitem__(i, args[0][0].detach())) for i in (0, 2)]
    with torch.no_grad():
        hf(torch.tensor([ids]))
    for hk in hooks:
        hk.remove()
    out = model.forward(torch.tensor(ids), torch.arange(len(ids)), model.new_kv_cache(4, 4),
                        prefill_metadata(len(ids), 4), record=True)
    assert model.config.moe_layers == (0, 2)
    assert out.routing is not None and len(out.routing) == 2       # one per MoE layer, dense layer 1 skipped
    for rec, layer in zip(out.routing, (0, 2)):
        x = mlp_inputs[layer]
        with torch.no_grad():
            _, ref_w, ref_ids = hf.model.layers[layer].mlp.gate(x)
        assert rec.topk_ids.dtype == torch.int64 and rec.topk_weights.dtype == torch.float32
        assert torch.equal(rec.topk_ids, ref_ids)
        assert torch.allclose(rec.topk_weights, ref_w.float(), atol=1e-6)
        assert torch.allclose(rec.gate_up_in_norm, x.norm(dim=-1), atol=1e-5)
        experts = hf.model.layers[layer].mlp.experts.requires_grad_(False)
        inter = model.config.expert_intermediate
        for t in range(len(ids)):
            for s in range(model.config.top_k):
                h = experts.gate_up_proj[int(ref_ids[t, s])] @ x[t]
                act = F.silu(h[:inter]) * h[inter:]
                assert abs(float(rec.down_in_norm[t, s]) - float(act.norm())) < 1e-4
    assert model.forward(torch.tensor(ids), torch.arange(len(ids)), model.new_kv_cache(4, 4),
                         prefill_metadata(len(ids), 4)).routing is None


def test_replacing_the_store_changes_only_routed_experts(tmp_path):
    """The model reaches routed experts only through model.experts: a store that scales every expert
    output by 0 leaves exactly the non-expert path (attention + shared expert)."""
    path = make_tiny_checkpoint(tmp_path, "mixtral", seed=1)
    model = load_model(path)
    dense = model.experts

    class Zero:
        def weight(self, layer, expert, kind):
            return dense.weight(layer, expert, kind)

        def moe(self, layer, x, topk_ids, topk_weights, down_in_norm=None):
            return dense.moe(layer, x, topk_ids, topk_weights * 0, down_in_norm)

    ids = torch.tensor([1, 5, 9, 13])
    run = lambda: model.forward(ids, torch.arange(4), model.new_kv_cache(1, 4), prefill_metadata(4, 4)).hidden
    base = run()
    model.experts = Zero()
    zeroed = run()
    model.experts = dense
    assert not torch.allclose(base, zeroed)
    assert torch.equal(run(), base)
    no_experts = load_model(path, experts=Zero())
    assert torch.equal(no_experts.forward(ids, torch.arange(4), no_experts.new_kv_cache(1, 4),
                                          prefill_metadata(4, 4)).hidden, zeroed)
