"""policies.memory_budget: how a budget splits between weights, the KV pool and the slack; prefill chunks."""
import pytest

from policies.memory_budget import (DEFAULT_PREFILL_CHUNK_BYTES, MiB, allocator_slack_bytes, kv_room_bytes,
                                    lut_slack_bytes, prefill_chunk_experts, prefill_chunks)

GiB = 1 << 30


@pytest.mark.parametrize("budget, slack", [(32 * MiB, 1 * MiB), (1 * GiB, 32 * MiB), (2 * GiB, 64 * MiB),
                                           (80 * GiB, 64 * MiB), (0, 0)])
def test_the_slack_is_64_mib_or_a_32nd_of_a_smaller_budget(budget, slack):
    assert allocator_slack_bytes(budget) == slack


def test_the_kv_pool_gets_what_weights_slack_and_activations_leave():
    assert kv_room_bytes(1 * GiB, 600 * MiB) == 1 * GiB - 32 * MiB - 600 * MiB
    assert kv_room_bytes(1 * GiB, 600 * MiB, slack_bytes=0, activation_bytes=100 * MiB) == 1 * GiB - 700 * MiB
    assert kv_room_bytes(1 * GiB, 2 * GiB) < 0   # the weights alone exceed it: the caller refuses the budget


def test_an_offload_s_lut_borrows_the_slack_only_under_slack():
    assert lut_slack_bytes("slack", 64 * MiB) == 64 * MiB and lut_slack_bytes("pool", 64 * MiB) == 0
    with pytest.raises(ValueError, match="lut_room must be one of"):
        lut_slack_bytes("kv", 64 * MiB)


def test_a_prefill_chunk_holds_whole_experts_and_at_least_one():
    # OLMoE's experts (2048 x 1024, bf16): 12 MiB each, 85 in the default 1 GiB, so 64 take one chunk
    assert prefill_chunk_experts(2048, 1024, 2) == DEFAULT_PREFILL_CHUNK_BYTES // (3 * 2048 * 1024 * 2) == 85
    assert prefill_chunks(64, 2048, 1024, 2) == 1
    # Mixtral's (4096 x 14336, bf16): 336 MiB each, 3 a chunk, so 8 experts take 3 chunks
    assert prefill_chunk_experts(4096, 14336, 2) == 3 and prefill_chunks(8, 4096, 14336, 2) == 3
    assert prefill_chunks(9, 4096, 14336, 2) == 3 and prefill_chunks(10, 4096, 14336, 2) == 4
    # a chunk smaller than one expert still takes one at a time
    assert prefill_chunk_experts(4096, 14336, 2, chunk_bytes=MiB) == 1 and prefill_chunks(8, 4096, 14336, 2, MiB) == 8
