"""Step-by-step fidelity (`pwsim.fidelity.decisions`) and the recorder's routing of some requests under other ids."""
from __future__ import annotations

import numpy as np

from pwruntime.model_runner import RoutingArrays
from pwruntime.trace_recorder import TraceRecorder
from pwsim.fidelity import decisions


def _timeline(steps, blocks, bits, **extra):
    n = len(steps)
    return {"step": np.asarray(steps), "total_blocks": np.asarray(blocks), "mean_bits": np.asarray(bits, dtype=float),
            "iter_s": np.ones(n), **extra}


def test_decisions_join_on_step_and_name_the_first_difference():
    sim = _timeline([3, 4, 5, 6, 7], [10, 10, 12, 12, 14], [6.0, 6.0, 5.5, 5.5, 5.0])
    rt = _timeline([4, 5, 6, 7, 8], [10, 12, 13, 14, 14], [6.0, 5.5, 5.5, 5.0 + 1e-9, 5.0])
    d = decisions(sim, rt)
    # steps 4..7 are in both; 6 holds another pool; mean bits within float noise count as equal
    assert d["steps"] == 4 and d["agreeing_steps"] == 3
    assert d["first_difference"] == 6 and d["differing_columns"] == ["total_blocks"]
    assert d["values"] == {"total_blocks": [12.0, 13.0]}  # simulated, runtime
    assert d["columns"] == ["total_blocks", "mean_bits"]  # only the decision columns both record
    same = decisions(sim, sim)
    assert same["first_difference"] is None and same["agreeing_steps"] == same["steps"] == 5
    assert decisions({"step": np.arange(3), "iter_s": np.ones(3)}, rt) is None  # no decision column in common


def _routing(query_lens: tuple[int, ...], seed: int) -> RoutingArrays:
    tokens = sum(query_lens)
    rng = np.random.default_rng(seed)
    ids = np.stack([rng.permutation(4)[:2] for _ in range(2 * tokens)]).reshape(2, tokens, 2)
    return RoutingArrays(ids.astype(np.int64), np.full((2, tokens, 2), 0.5, np.float32),
                         np.ones((2, tokens), np.float32), np.ones((2, tokens, 2), np.float32), query_lens)


def test_recorder_gives_the_routing_of_some_requests_under_other_ids():
    rec = TraceRecorder(card="PagedWeight-demo")
    rec.set_model(2, 4, 2)
    for rid in (0, 1, 2):
        rec.on_arrival(rid, 0.0, [1, 2, 3])
    rec.on_routing([(0, 0, 3), (1, 0, 3), (2, 0, 3)], _routing((3, 3, 3), 0))
    rec.on_routing([(1, 3, 1), (2, 3, 1)], _routing((1, 1), 1))
    whole = rec.routing_trace()
    some = rec.routing_trace({1: 101, 2: 102})  # request 0 (a warm-up's, say) is left out
    assert sorted(set(whole.request_id.tolist())) == [0, 1, 2]
    assert sorted(set(some.request_id.tolist())) == [101, 102] and len(some) == 2 * (4 + 4)
    for old, new in ((1, 101), (2, 102)):
        np.testing.assert_array_equal(some.expert_ids[some.request_id == new], whole.expert_ids[whole.request_id == old])


def test_decisions_tell_apart_the_plan_transitions_begun_and_a_small_change_of_bits():
    """A plan that began another number of transitions is another decision; so is a mean bitwidth a block's move
    apart on a model of many blocks (1e-4), not only float noise (1e-9)."""
    sim = _timeline([0, 1, 2], [10, 10, 10], [6.0, 6.0, 6.0], plan_transitions=np.array([0, 3, 0]))
    rt = _timeline([0, 1, 2], [10, 10, 10], [6.0, 6.0, 6.0 + 1e-4], plan_transitions=np.array([0, 4, 0]))
    d = decisions(sim, rt)
    assert d["columns"] == ["total_blocks", "mean_bits", "plan_transitions"] and d["agreeing_steps"] == 1
    assert d["first_difference"] == 1 and d["values"] == {"plan_transitions": [3.0, 4.0]}
