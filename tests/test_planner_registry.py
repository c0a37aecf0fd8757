"""Registry names and presets, `--policy-arg` parsing, every policy on a small table, synthetic calibrations."""
from __future__ import annotations

import numpy as np
import pytest

import policies
from policies import Calibration, Observation, PageTable, PolicyError, RoutingReadout, get, parse_policy_args
from policies.planners import apply_plan_now, weight_bytes
from policies.registry import describe, params_class
from policies.synthetic import (model_dims, synthetic_calibration, synthetic_features, synthetic_routing_mass,
                                synthetic_seed)

NAMES = ["noop", "pagedweight", "pagedweight-no-routing", "pagedweight-no-residual", "pagedweight-no-movement",
         "pagedweight-no-sensitivity", "fp16", "static-mixed", "dp-llm", "expert-lru"] + [f"uniform-{b}" for b in range(3, 9)]


@pytest.mark.parametrize("args, want", [
    (["reload=1", "no_routing=yes", "count_headroom=0"], {"reload": True, "no_routing": True, "count_headroom": False}),
    (["alpha=", "reload_threshold=none", "min_plan_blocks=8e0"], {"alpha": None, "reload_threshold": None,
                                                                  "min_plan_blocks": 8}),
])
def test_policy_args_take_the_usual_spellings(args, want):
    assert parse_policy_args("pagedweight", args) == want


def test_model_dims_of_a_page_table_and_synthetic_seeds():
    assert model_dims(PageTable(2, 4, 256, 128)) == (2, 4, 256, 128)
    assert model_dims(PageTable(2, 4, 512, 96)) == (2, 4, 512, 96)  # hidden != 2 * intermediate: not swapped
    assert [synthetic_seed(s, 5) for s in ("synthetic", "synthetic:3", "runs/cal")] == [5, 3, None]
    for bad in ("synthetic:-1", "synthetic:x"):
        with pytest.raises(ValueError, match="integer >= 0"):
            synthetic_seed(bad, 0)


def test_every_name_is_registered():
    assert sorted(NAMES) == policies.available()


def test_presets_and_params():
    assert get("pagedweight-no-routing").params.no_routing
    assert get("pagedweight-no-routing", no_residual=True).params.no_residual
    assert get("uniform-5").params.bits == 5
    assert get("pagedweight", alpha=0.25).params.alpha == 0.25
    assert get("dp-llm").name == "dp-llm" and get("uniform-3").name == "uniform-3"
    assert ("bits", "an integer", 6) in describe("uniform-6")
    assert params_class("static-mixed").__dataclass_params__.frozen


@pytest.mark.parametrize("call,match", [
    (lambda: get("nope"), "unknown policy 'nope'; available: dp-llm"),
    (lambda: get("pagedweight", alpah=1.0), "policy 'pagedweight' has no parameter 'alpah'; its parameters: no_routing"),
    (lambda: get("noop", x=1), "it takes no parameters"),
    (lambda: get("pagedweight", reload_to="sometimes"), "reload_to must be 'initial' or 'max'"),
    (lambda: get("uniform-4", bits=12), "bits must be in 1..8"),
    (lambda: parse_policy_args("pagedweight", ["alpha"]), "'alpha' is not KEY=VALUE"),
    (lambda: parse_policy_args("pagedweight", ["beta=1"]), "has no parameter 'beta'"),
    (lambda: parse_policy_args("pagedweight", ["alpha=high"]), "'alpha' expects a number or none, got 'high'"),
    (lambda: parse_policy_args("pagedweight", ["reload=maybe"]), "'reload' expects true/false"),
    (lambda: parse_policy_args("expert-lru", ["budget_bytes=2.5"]), "'budget_bytes' expects an integer"),
    (lambda: parse_policy_args("pagedweight", ["alpha=1", "alpha=2"]), "given twice"),
    (lambda: parse_policy_args("bogus", []), "unknown policy"),
])
def test_errors_name_the_problem_and_the_fix(call, match):
    with pytest.raises(PolicyError, match=match):
        call()
    assert issubclass(PolicyError, ValueError)


def test_parse_policy_args_converts_by_field_type():
    kw = parse_policy_args("pagedweight", ["alpha=0.5", "no_routing=yes", "reload_margin_blocks=6",
                                           "reload_to=max", "reload_threshold=none"])
    assert kw == {"alpha": 0.5, "no_routing": True, "reload_margin_blocks": 6, "reload_to": "max",
                  "reload_threshold": None}
    assert parse_policy_args("expert-lru", ["budget_bytes=8e9", "bits=3"]) == {"budget_bytes": 8_000_000_000, "bits": 3}
    assert parse_policy_args("pagedweight", ["reload=Off"]) == {"reload": False}
    p = get("pagedweight", **kw)
    assert p.params.reload_to == "max" and p.params.alpha == 0.5


@pytest.mark.parametrize("name", NAMES)
def test_every_policy_runs_the_contract(name):
    table = PageTable(2, 4, 256, 128)
    cal = synthetic_calibration(table, seed=1, initial_mean_bits=6.5)
    kw = {"budget_bytes": 4 * int(table.M[0, 4] + table.M[1, 4])} if name == "expert-lru" else {}
    pol = get(name, **kw)
    assert isinstance(pol, policies.Policy)
    pol.reset(table, cal)
    for step in range(8):
        o = Observation(step=step, time_s=0.1 * step, free_blocks=step * 6, total_blocks=100, kv_block_bytes=40_000,
                        free_block_threshold=8, routing=RoutingReadout(synthetic_routing_mass(2, 4, seed=step),
                                               synthetic_features(table.num_blocks, seed=step)))
        plan = pol.plan_step(table, o)
        apply_plan_now(table, plan)
        table.check_invariants()
        assert weight_bytes(pol, table) > 0


def test_synthetic_calibration_structure(tmp_path):
    table = PageTable(4, 8, 512, 256)
    cal = synthetic_calibration(table, seed=4)
    s = cal.sensitivity[:, 3:]
    assert (np.diff(s, axis=1) < 0).all()  # fewer bits, more damage, every block
    growth = s[:, :-1] / s[:, 1:]
    assert 3.0 < np.median(growth) < 5.5
    down = cal.sensitivity[1::2, 8] / (table.shapes[1::2, 0] * table.shapes[1::2, 1])
    gate = cal.sensitivity[0::2, 8] / (table.shapes[0::2, 0] * table.shapes[0::2, 1])
    assert np.median(down) > 2 * np.median(gate)  # down projections more sensitive per weight
    assert (cal.initial_bits == 8).all()
    assert set(cal.domain_damage) == {"c4", "wikitext2", "code"}
    back = Calibration.load(cal.save(tmp_path / "cal"), expect_fingerprint=cal.fingerprint)
    np.testing.assert_array_equal(back.sensitivity, cal.sensitivity)
    again = synthetic_calibration(table, seed=4)
    np.testing.assert_array_equal(again.residual_weights, cal.residual_weights)
    mixed = synthetic_calibration(table, seed=4, initial_mean_bits=5.0, reload_threshold=40)
    params = table.shapes[:, 0] * table.shapes[:, 1]
    assert np.dot(params, mixed.initial_bits) / params.sum() <= 5.0 and mixed.reload_threshold == 40


def test_synthetic_from_a_model_card():
    from traces.model_card import load_card
    spec = load_card("OLMoE-1B-7B-0924")
    assert model_dims(spec) == (16, 64, 2048, 1024)
    cal = synthetic_calibration(spec, seed=0)
    assert cal.fingerprint == spec.fingerprint() and cal.num_blocks == 16 * 64 * 2


def test_synthetic_residual_heads_only_for_lower_bitwidths():
    """Heads exist for every b -> b' < b of each kind, none for b -> b (no change) or b -> b' > b."""
    cal = synthetic_calibration(PageTable(2, 4, 256, 128), seed=0)
    for k in (0, 1):
        for b in cal.bits:
            for b2 in cal.bits:
                assert (cal.residual_confidence[k, b, b2] > 0) == (b2 < b), (k, b, b2)
