"""`pwruntime bench kernels` off the GPU: redrawing the figure of a saved result, and its errors."""
from __future__ import annotations

import json

from pwruntime.cli import main


def _result() -> dict:
    """A small result in the shape `pwruntime bench kernels --out` writes."""
    single = [{"out": 64, "in": 128, "tokens": t, "bits": b, "ap_us": 10.0 + b + t, "fp16_us": 20.0}
              for t in (1, 8) for b in (3, 4, 8)]
    moe = [{"model": m, "tokens": t, "bits": b, "vs_roofline": 2.0 + t / 8}
           for m in ("olmoe-1b-7b", "mixtral-8x7b") for t in (1, 16) for b in (3, "mixed")]
    return {"device": "test GPU", "single_block": single, "moe": moe}


def test_plot_from_a_saved_result_writes_a_png(tmp_path, capsys):
    src = tmp_path / "bench.json"
    src.write_text(json.dumps(_result()))
    assert main(["bench", "kernels", "--plot-from", str(src)]) == 0
    png = tmp_path / "bench.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert str(png) in capsys.readouterr().out


def test_plot_from_a_wrong_file_is_one_clear_error(tmp_path, capsys):
    src = tmp_path / "bench.json"
    src.write_text(json.dumps({"single_block": [{"tokens": 1}]}))   # rows without their fields
    assert main(["bench", "kernels", "--plot-from", str(src)]) == 2
    err = capsys.readouterr().err
    assert "not a `pwruntime bench kernels --out` result" in err and "Traceback" not in err
    assert not (tmp_path / "bench.png").exists()
    assert main(["bench", "kernels", "--plot-from", str(tmp_path / "missing.json")]) == 2
