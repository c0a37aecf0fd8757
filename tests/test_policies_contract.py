"""AP byte sizes, the calibration directory format, the registry, and import hygiene."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

import policies
from policies.apformat import ap_block_bytes, byte_table, lut_bytes, lut_bytes_of
from policies.calibration import Calibration, CalibrationError, free_block_threshold, model_fingerprint


def test_ap_bytes_are_exact():
    # 1408 inputs -> 44 words per row; 2048 rows; 3 planes + LUT_3 (2048 rows * 8 codes * 2 bytes)
    assert ap_block_bytes(2048, 1408, 3) == 3 * 2048 * 44 * 4 + 2048 * 8 * 2
    # 50 inputs pad to 2 words per row
    assert ap_block_bytes(10, 50, 8) == 8 * 10 * 2 * 4 + 10 * 256 * 2
    assert ap_block_bytes(10, 50, 0) == 0
    shapes = np.array([[2816, 2048], [2048, 1408], [7, 33]])
    table = byte_table(shapes)
    for r, (o, i) in enumerate(shapes):
        assert [ap_block_bytes(int(o), int(i), b) for b in range(9)] == list(table[r])


def test_a_block_at_0_bits_holds_no_lut():
    assert lut_bytes_of(np.array([64, 64, 96]), np.array([0, 3, 8])).tolist() == [0, 64 * 8 * 2, 96 * 256 * 2]
    with pytest.raises(ValueError, match="bits must be in 1..8"):
        lut_bytes(64, 0)


def _observation(free: int = 0, total: int = 4, block_bytes: int = 1, routing=None):
    return policies.Observation(step=0, time_s=0.0, free_blocks=free, total_blocks=total, kv_block_bytes=block_bytes,
                                free_block_threshold=0, routing=routing)


@pytest.mark.parametrize("free, total", [(5, 4), (-1, 4), (0, -1)])
def test_an_observation_refuses_free_blocks_outside_its_pool(free, total):
    with pytest.raises(ValueError, match=f"free blocks {free} not within 0..{total}"):
        _observation(free, total)


def test_an_observation_takes_an_empty_or_full_pool_and_refuses_negative_block_bytes():
    assert _observation(0, 0).total_blocks == 0 and _observation(4, 4).free_blocks == 4
    assert _observation(block_bytes=0).kv_block_bytes == 0
    with pytest.raises(ValueError, match="kv_block_bytes must be non-negative"):
        _observation(block_bytes=-1)


def test_routing_statistics_are_computed_once_when_a_planner_first_reads_them():
    import time
    calls = []

    def mass():
        calls.append("mass")
        time.sleep(0.002)
        return np.full((1, 2), 0.5)
    readout = policies.RoutingReadout(mass, None)
    obs = _observation(routing=readout)
    assert not obs.routing_read and readout.seconds == 0.0
    assert obs.routing_mass.tolist() == [[0.5, 0.5]] and obs.routing_mass is obs.routing_mass
    assert calls == ["mass"] and obs.routing_read and readout.seconds >= 0.002
    other = _observation(routing=policies.RoutingReadout(None, None))
    assert other.prompt_features is None and other.routing_read  # reading None still counts as a read
    assert not _observation().routing_read and _observation().routing_mass is None


def test_only_a_paged_lowering_is_an_offload():
    assert policies.Transition(0, 8, 4, 100).is_offload
    assert not policies.Transition(0, 4, 4, 0).is_offload
    assert not policies.Transition(0, 8, 4, 0, in_place=True).is_offload   # dp-llm: no page moves
    assert not policies.Transition(0, 4, 8, -100).is_offload


def _calibration(fp: str = "arch:abc") -> Calibration:
    rng = np.random.default_rng(0)
    n = 2 * 3 * 2
    return Calibration(
        fingerprint=fp, layers=2, experts=3, bits=(3, 4, 5, 6, 7, 8),
        sensitivity=rng.random((n, 9)), initial_bits=np.full(n, 6),
        domain_damage={"pydocs": rng.random((n, 9))}, provenance={"seed": 0},
    )


def test_calibration_round_trip(tmp_path):
    cal = _calibration()
    out = cal.save(tmp_path / "cal")
    assert sorted(p.name for p in out.iterdir()) == ["arrays.npz", "calibration.json"]
    back = Calibration.load(out, expect_fingerprint="arch:abc")
    np.testing.assert_array_equal(back.sensitivity, cal.sensitivity)
    np.testing.assert_array_equal(back.domain_damage["pydocs"], cal.domain_damage["pydocs"])
    assert back.floor_stages == cal.floor_stages and back.provenance == {"seed": 0}
    cal.save(out)  # overwrite in place leaves no stray temp dirs
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cal"]
    (out / "notes").mkdir()  # whatever the previous folder held goes with it (a sub-folder used to crash the save)
    (out / "notes" / "a.txt").write_text("x")
    cal.save(out)
    assert sorted(p.name for p in out.iterdir()) == ["arrays.npz", "calibration.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cal"]
    assert out.stat().st_mode & 0o077 == 0o777 & ~_umask() & 0o077  # not tempfile's private 0700


def _umask() -> int:
    import os
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_calibration_refuses_another_model(tmp_path):
    _calibration().save(tmp_path / "cal")
    with pytest.raises(CalibrationError, match="pwruntime calibrate"):
        Calibration.load(tmp_path / "cal", expect_fingerprint="arch:other")


def test_calibration_fingerprint_with_weights():
    assert model_fingerprint({"layers": 2, "experts": 8}) == model_fingerprint({"experts": 8, "layers": 2})
    assert model_fingerprint({"layers": 2, "experts": 8}) != model_fingerprint({"layers": 2, "experts": 4})
    fp = model_fingerprint({"layers": 2}, "w1")
    assert fp.endswith("+w:w1")
    cal = _calibration(fp)
    cal.check_fingerprint(model_fingerprint({"layers": 2}))  # no digest on one side: arch decides
    with pytest.raises(CalibrationError):
        cal.check_fingerprint(model_fingerprint({"layers": 2}, "w2"))


def test_calibration_missing_or_malformed(tmp_path):
    with pytest.raises(CalibrationError, match="missing"):
        Calibration.load(tmp_path)
    _calibration().save(tmp_path / "cal")
    meta = tmp_path / "cal" / "calibration.json"
    data = json.loads(meta.read_text())
    data["format_version"] = 99
    meta.write_text(json.dumps(data))
    with pytest.raises(CalibrationError, match="format_version"):
        Calibration.load(tmp_path / "cal")
    with pytest.raises(CalibrationError, match="shape"):
        Calibration(fingerprint="x", layers=2, experts=3, bits=(3,), sensitivity=np.zeros((5, 9)),
                    initial_bits=np.zeros(12))


def test_calibration_scalars_and_checks(tmp_path):
    """Tuples load back as tuples; a file without a format version is refused; depth caps need one entry a stage."""
    cal = _calibration()
    loaded = Calibration.load(cal.save(tmp_path / "cal"))
    assert (loaded.bits, loaded.bucket_bounds, loaded.depth_caps) == (cal.bits, cal.bucket_bounds, cal.depth_caps)
    meta = tmp_path / "cal" / "calibration.json"
    data = json.loads(meta.read_text())
    del data["format_version"]
    meta.write_text(json.dumps(data))
    with pytest.raises(CalibrationError, match="format_version None"):
        Calibration.load(tmp_path / "cal")
    with pytest.raises(CalibrationError, match="depth_caps needs one entry per floor stage"):
        Calibration(fingerprint="x", layers=2, experts=3, bits=(3,), sensitivity=np.zeros((12, 9)),
                    initial_bits=np.zeros(12), depth_caps=(1, 2))
    assert free_block_threshold(cal, 0) == 0 and free_block_threshold(cal) == cal.free_block_threshold
    cal.free_block_threshold = 3  # a calibration's own threshold, not the default's; none given: the default
    assert (free_block_threshold(cal), free_block_threshold(None)) == (3, 8)
    assert Calibration.load(cal.save(tmp_path / "new" / "nested" / "cal")).free_block_threshold == 3


def test_registry():
    assert "noop" in policies.available()
    p = policies.get("noop")
    assert isinstance(p, policies.Policy)
    with pytest.raises(ValueError, match="unknown policy"):
        policies.get("nope")


def test_core_packages_do_not_import_heavy_frameworks():
    code = ("import sys, policies, traces; import policies.registry; "
            "heavy = [m for m in ('torch', 'cupy', 'simpy') if m in sys.modules]; print(','.join(heavy))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
