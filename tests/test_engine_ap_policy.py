"""`pwruntime generate --ap --policy --calibration`: a planner moves real AP expert bits under KV pressure."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from policies.calibration import Calibration
from pwruntime.cli import main
from pwruntime.cmd_perplexity import default_model_dir
from pwruntime.quant.build import QuantizeOptions, quantize_checkpoint

CALIBRATION = Path(__file__).resolve().parents[1] / "traces" / "bundled" / "demo-calibration"
PROMPTS = ["--prompt", "And God said unto Moses", "--prompt", "The os module provides", "--prompt", "A fool and his"]


@pytest.fixture(scope="module")
def ap_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("ap") / "demo_ap"
    quantize_checkpoint(default_model_dir(), out, QuantizeOptions(weighting="none"), progress=False)
    return out


def _generate(capsys, *argv) -> tuple[int, dict | None, str]:
    rc = main(["generate", *argv, "--json"])
    cap = capsys.readouterr()
    return rc, (json.loads(cap.out) if rc == 0 else None), cap.err


def test_pressure_lowers_bits_and_grows_the_kv_pool(ap_dir, capsys):
    rc, out, _ = _generate(capsys, "--ap", str(ap_dir), "--calibration", str(CALIBRATION), "--policy", "pagedweight",
                           *PROMPTS, "--max-tokens", "64", "--num-kv-blocks", "12", "--block-size", "4")
    assert rc == 0
    stats = out["stats"]
    cal = Calibration.load(CALIBRATION)
    assert stats["mean_bits_start"] == pytest.approx(float(np.mean(cal.initial_bits)), abs=1e-4)  # its start
    assert stats["plans"] > 0 and stats["mean_bits_end"] < stats["mean_bits_start"]  # the planner offloaded
    assert stats["kv_blocks"] > 12  # ... and the released bytes became KV blocks
    assert all(o["finish_reason"] in ("stop", "length") for o in out["outputs"])


def test_without_pressure_nothing_moves(ap_dir, capsys):
    args = ["--ap", str(ap_dir), "--calibration", str(CALIBRATION), *PROMPTS, "--max-tokens", "16"]
    rc, paged, _ = _generate(capsys, *args, "--policy", "pagedweight", "--num-kv-blocks", "256")
    assert rc == 0 and paged["stats"]["plans"] == 0
    assert paged["stats"]["mean_bits_end"] == paged["stats"]["mean_bits_start"]


def test_calibration_of_another_model_is_refused(ap_dir, capsys, tmp_path):
    cal = Calibration.load(CALIBRATION)
    cal.fingerprint = "arch:000000000000"
    cal.save(tmp_path / "other")
    rc, _, err = _generate(capsys, "--ap", str(ap_dir), "--calibration", str(tmp_path / "other"), "--prompt", "x")
    assert rc == 2 and "pwruntime calibrate" in err and "Traceback" not in err


def test_calibration_without_ap_exit_2(capsys):
    rc, _, err = _generate(capsys, "--calibration", str(CALIBRATION), "--prompt", "x")
    assert rc == 2 and "--ap" in err


def test_engine_records_the_steps_whose_planner_read_the_routing(ap_dir):
    """Under pressure the planner reads the routing statistics on some steps (which folds the held step at once)
    and not on others (nothing is merged then); the engine records which (`last_routing_read`, the replay's
    `routing_read` column, what `pwsim fidelity` measures the reads' cost from)."""
    from pwruntime.cli import _registrars
    from pwruntime.cmd_generate import build_engine
    from pwruntime.sampling import SamplingParams
    from traces.clikit import build_parser
    args = build_parser("pwruntime", "", _registrars()).parse_args(
        ["generate", "--ap", str(ap_dir), "--calibration", str(CALIBRATION), "--policy", "pagedweight",
         "--num-kv-blocks", "12", "--block-size", "4", "--prompt", "x"])
    engine, *_ = build_engine(args)
    for prompt in PROMPTS[1::2]:
        engine.add_request(prompt, SamplingParams(max_tokens=64, ignore_eos=True))
    reads = []
    while engine.has_unfinished():
        engine.step()
        reads.append(engine.last_routing_read)
        assert engine.last_observation.routing.read == engine.last_routing_read
        if engine.last_routing_read:
            assert engine.routing._held is None  # reading folded the step's routing
    assert any(reads) and not all(reads), reads
