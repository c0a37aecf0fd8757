"""`pwruntime calibrate` and `pwruntime quality-table` end to end on tiny checkpoints."""
from __future__ import annotations

import json

import numpy as np
import pytest

from model_fixtures import make_text, make_tiny_checkpoint
from policies import registry
from policies.calibration import Calibration, CalibrationError
from policies.contract import Observation, RoutingReadout
from policies.page_table import PageTable
from pwruntime.calibrate import model_fingerprint_of
from pwruntime.cli import main
from pwruntime.quant.build import QuantizeOptions, quantize_checkpoint

ARGS = ["--tokens", "1200", "--seq-len", "100", "--domain-tokens", "300"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("calib_cli")
    src = make_tiny_checkpoint(root, "qwen2_moe", seed=1)
    other = make_tiny_checkpoint(root, "qwen2_moe", seed=2)  # same architecture, other weights
    for name, seed in (("calib.txt", 2), ("a.txt", 3), ("b.txt", 4)):
        (root / name).write_text(make_text(1500 if name == "calib.txt" else 400, seed=seed))
    quantize_checkpoint(src, root / "ap", QuantizeOptions(), progress=False)
    quantize_checkpoint(other, root / "ap-other", QuantizeOptions(), progress=False)
    out = root / "cal"
    rc = main(["calibrate", "--model", str(src), "--ap", str(root / "ap"), "--data", str(root / "calib.txt"),
               "--out", str(out), "--domains", f"a={root / 'a.txt'}", f"b={root / 'b.txt'}", *ARGS, "--json"])
    assert rc == 0
    return root, src, other, out


def test_cli_writes_a_loadable_calibration_matching_the_page_table(setup, capsys):
    root, src, _, out = setup
    fp = model_fingerprint_of(src)
    assert fp == model_fingerprint_of(root / "ap") and "+w:" in fp
    cal = Calibration.load(out, expect_fingerprint=fp)
    table = PageTable(2, 4, 64, 32)  # the tiny qwen2_moe: 2 MoE layers x 4 experts, hidden 64, I 32
    assert cal.num_blocks == table.num_blocks and cal.bits == table.bits
    assert cal.sensitivity.shape == (table.num_blocks, 9) and cal.initial_bits.shape == (table.num_blocks,)
    s = cal.sensitivity[:, list(table.bits)]
    assert np.isfinite(s).all() and (s[:, -1] > 0).all() and (np.diff(s, axis=1) <= 0).all()
    assert np.isnan(cal.sensitivity[:, :3]).all() and (cal.initial_bits == 8).all()
    assert set(cal.domain_damage) == {"a", "b"} and (cal.domain_damage["a"][:, 8] == 0).all()
    assert ((cal.residual_confidence >= 0) & (cal.residual_confidence <= 1)).all()
    assert (cal.residual_clip[..., 0] <= cal.residual_clip[..., 1]).all()
    prov = cal.provenance
    assert prov["search"]["target_bytes"] > 0 and 1 <= len(prov["search"]["candidates"]) <= 30
    assert sum(r["chosen"] for r in prov["search"]["candidates"]) == 1
    assert prov["tokens"]["train"] + prov["tokens"]["heldout"] == 1200 and prov["seed"] == 0
    # the planner runs on it and, under pressure, frees the bytes asked for
    policy = registry.get("pagedweight")
    policy.reset(table, cal)
    obs = Observation(step=0, time_s=0.0, free_blocks=0, total_blocks=10, kv_block_bytes=200_000,
                      free_block_threshold=0, routing=RoutingReadout(np.full((2, 4), 0.25), np.ones((table.num_blocks, 3))))
    plan = policy.plan_step(table, obs)
    assert plan is not None and plan.bytes_freed >= 200_000


def test_fingerprint_of_another_model_is_refused(setup):
    _, _, other, out = setup
    with pytest.raises(CalibrationError, match="calibration was made for model"):
        Calibration.load(out, expect_fingerprint=model_fingerprint_of(other))


def test_round_trip_and_determinism(setup, tmp_path):
    root, src, _, out = setup
    cal = Calibration.load(out)
    cal.save(tmp_path / "copy")
    back = Calibration.load(tmp_path / "copy")
    for f in ("sensitivity", "initial_bits", "residual_weights", "residual_bias", "residual_confidence",
              "residual_clip"):
        np.testing.assert_array_equal(getattr(back, f), getattr(cal, f))
    assert back.provenance == cal.provenance and back.alpha == cal.alpha and back.floor_stages == cal.floor_stages
    np.testing.assert_array_equal(back.domain_damage["b"], cal.domain_damage["b"])
    # the same inputs and seed give the same calibration
    assert main(["calibrate", "--model", str(src), "--ap", str(root / "ap"), "--data", str(root / "calib.txt"),
                 "--out", str(tmp_path / "again"), "--domains", f"a={root / 'a.txt'}", f"b={root / 'b.txt'}",
                 *ARGS, "--json"]) == 0
    again = Calibration.load(tmp_path / "again")
    for f in ("sensitivity", "residual_weights", "residual_confidence"):
        np.testing.assert_array_equal(getattr(again, f), getattr(cal, f))
    assert again.provenance["search"]["candidates"] == cal.provenance["search"]["candidates"]


def test_cli_user_errors_exit_2_with_one_line(setup, capsys):
    root, src, _, _ = setup
    base = ["calibrate", "--model", str(src), "--out", str(root / "x"), *ARGS]
    capsys.readouterr()
    assert main([*base, "--ap", str(root / "ap"), "--data", str(root / "missing.txt")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "missing.txt does not exist" in err
    assert main([*base, "--ap", str(root / "ap-other"), "--data", str(root / "calib.txt")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "quantized from another model" in err
    assert main([*base, "--ap", str(root / "ap"), "--data", str(root / "calib.txt"), "--domains", "nofile"]) == 2
    assert "NAME=FILE" in capsys.readouterr().err
    assert not (root / "x").exists()  # no partial output


def test_quality_table_rows_bytes_and_fit_points(setup, capsys):
    root, src, _, out = setup
    fit = root / "fit.json"
    rc = main(["quality-table", "--model", str(src), "--ap", str(root / "ap"), "--data", f"a={root / 'a.txt'}",
               f"b={root / 'b.txt'}", "--bits", "8,4,3", "--context", "64", "--max-tokens", "200",
               "--calibration", str(out), "--fit-out", str(fit), "--json"])
    assert rc == 0
    res = json.loads(capsys.readouterr().out)
    rows = res["rows"]
    assert [r["bits"] for r in rows] == [16, 8, 4, 3]
    table = PageTable(2, 4, 64, 32)
    for r in rows[1:]:
        assert r["expert_bytes"] == int(table.M[:, r["bits"]].sum())
        assert r["nonexpert_bytes"] == rows[0]["nonexpert_bytes"] > 0
    assert rows[0]["expert_bytes"] == int((table.shapes[:, 0] * table.shapes[:, 1]).sum()) * 2
    ppl = {r["bits"]: r["perplexity"]["a"] for r in rows}
    assert abs(ppl[8] - ppl[16]) < 0.01 * ppl[16] and ppl[3] != ppl[8]
    assert rows[3]["damage_per_token"]["a"] > rows[2]["damage_per_token"]["a"] > rows[1]["damage_per_token"]["a"]
    assert res["markdown"].count("\n| AP uniform") == 3
    # the other weights in fp16, the token cap, the default stride (half the context) and the ratios
    from pwruntime.quant.ap_checkpoint import load_ap_checkpoint
    rest = sum(t.numel() for t in load_ap_checkpoint(root / "ap").nonexpert_state().values()) * 2
    assert rows[0]["nonexpert_bytes"] == rest and res["domains"] == {"a": 200, "b": 200} and res["stride"] == 32
    assert all(r["vs_fp16"] == r["total_bytes"] / rows[0]["total_bytes"] for r in rows)
    for p in res["fit_points"]:
        assert p["ppl_ratio"] == pytest.approx(p["ppl"] / rows[0]["perplexity"][p["domain"]])
    from pwsim.quality import load_fit_points
    f = load_fit_points(fit)
    assert f.n_points == 8 and f.measured
