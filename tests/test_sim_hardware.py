"""Hardware profiles (traces.hardware, re-exported by pwsim.hardware) and memory sizes."""
from __future__ import annotations

import json

import pytest

from pwsim.hardware import HardwareProfileError, bundled_profiles, format_size, load_profile, parse_size
from traces.clikit import UserError


def test_bundled_h200_roofline_is_marked_unmeasured_and_uses_the_design_numbers():
    assert "h200-roofline" in bundled_profiles()
    p = load_profile("h200-roofline")
    assert p.measured is False and "roofline" in p.metadata["note"].lower()
    assert p.pcie_h2d_gbps == 51.0 and p.pcie_d2h_gbps == 55.0
    assert p.bandwidth("moe") == pytest.approx(3.96e12)  # the measured fp16 GEMV anchor
    assert set(p.ap_kernel_efficiency) == {3, 4, 5, 6, 7, 8}
    assert p.gpu_memory_bytes > 140 * 10**9


def test_bundled_h200_measured_profile_comes_from_the_kernel_benchmark():
    p = load_profile("h200-measured")
    assert p.measured is True and "pwruntime bench kernels" in p.metadata["command"]
    assert p.pcie_h2d_gbps > 40 and p.hbm_gbps > 3000  # pinned copies and a device copy on the H200
    # the fused AP kernel never beats the fp16 GEMV's bandwidth, and lowering the bits still saves time:
    # the time of a layer's bytes (b planes) at the measured efficiency falls with b
    eff = p.ap_kernel_efficiency
    assert all(0 < e <= 1 for e in eff.values())
    times = [b / eff[b] for b in sorted(eff)]
    assert times == sorted(times)


def test_ap_efficiency_interpolates_in_log_tokens_and_falls_back_per_bits(tmp_path):
    import dataclasses
    p = dataclasses.replace(load_profile("h200-roofline"), ap_efficiency_by_tokens={3: {1: 0.2, 4: 0.4, 16: 0.1}})
    assert p.ap_efficiency(3, 1) == 0.2 and p.ap_efficiency(3, 4) == 0.4
    assert p.ap_efficiency(3, 2) == pytest.approx(0.3) and p.ap_efficiency(3, 8) == pytest.approx(0.25)
    assert p.ap_efficiency(3, 64) == 0.1  # beyond the largest measured size: the nearest
    assert p.ap_efficiency(5, 7) == p.ap_kernel_efficiency[5]  # bits without a table
    assert load_profile(p.save(tmp_path / "t.json")) == p


def test_round_trip_and_validation(tmp_path):
    p = load_profile("h200-roofline")
    path = p.save(tmp_path / "x.json")
    assert load_profile(path) == p
    data = json.loads(path.read_text())
    for mutate, msg in [
        (lambda d: d["achieved_bandwidth_fraction"].pop("kv"), "lacks op classes"),
        (lambda d: d["achieved_bandwidth_fraction"].__setitem__("moe", 1.5), "must be <= 1"),
        (lambda d: d["ap_kernel_efficiency"].pop("3"), "lacks bitwidths"),
        (lambda d: d.__setitem__("pcie_h2d_gbps", -1), "pcie_h2d_gbps"),
        (lambda d: d.__setitem__("hbm_gbps", 0), "hbm_gbps must be a positive number"),
        (lambda d: d.__setitem__("hbm_gbps", True), "hbm_gbps must be a positive number, got True"),
        (lambda d: d.__setitem__("fp16_tflops", float("nan")), "fp16_tflops must be a positive number, got nan"),
        (lambda d: d.__setitem__("fp16_tflops", float("inf")), "fp16_tflops must be a positive number, got inf"),
        (lambda d: d.__setitem__("routing_read_us", -5.0), "routing_read_us"),
        (lambda d: d["metadata"].pop("measured"), "measured"),
        (lambda d: d.__setitem__("format_version", 9), "format_version"),
        (lambda d: d.__setitem__("surprise", 1), "unknown field"),
        (lambda d: d.__setitem__("ap_efficiency_by_tokens", {"9": {"1": 0.5}}), "bitwidth 9"),
        (lambda d: d.__setitem__("ap_efficiency_by_tokens", {"3": {"0": 0.5}}), "batch size 0"),
        (lambda d: d.__setitem__("ap_efficiency_by_tokens", {"3": {"4": -1}}), r"ap_efficiency_by_tokens\[3\]\[4\]"),
    ]:
        bad = json.loads(json.dumps(data))
        mutate(bad)
        (tmp_path / "bad.json").write_text(json.dumps(bad))
        with pytest.raises(HardwareProfileError, match=msg):
            load_profile(tmp_path / "bad.json")
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(HardwareProfileError, match="not valid JSON"):
        load_profile(tmp_path / "broken.json")
    with pytest.raises(HardwareProfileError, match="bundled profiles"):
        load_profile("no-such-gpu")


def test_sizes():
    assert parse_size("20GiB") == 20 * 2**30
    assert parse_size("16 GB") == 16 * 10**9
    assert parse_size("512MiB") == 512 * 2**20
    assert parse_size("1.5e9") == 1_500_000_000
    for bad in ("twenty", "20XB", "-3GiB", "0"):
        with pytest.raises(UserError):
            parse_size(bad)
    assert format_size(20 * 2**30) == "20.00 GiB"


def test_atomic_json_write_leaves_nothing_behind_when_it_fails(tmp_path):
    from traces.clikit import write_json_atomic, write_text_atomic
    path = write_json_atomic(tmp_path / "sub" / "a.json", {"x": 1})
    assert json.loads(path.read_text()) == {"x": 1} and path.read_text().endswith("}\n")
    with pytest.raises(UnicodeEncodeError):  # fails while writing the temporary file: the old file stays
        write_text_atomic(path, "\ud800")
    assert json.loads(path.read_text()) == {"x": 1}
    assert sorted(p.name for p in (tmp_path / "sub").iterdir()) == ["a.json"]  # no temporary file left


def test_figures_are_written_whole_and_closed(tmp_path):
    """write_png writes a PNG and closes the figure; a figure that fails to draw leaves the old file and no
    temporary file behind, and is closed too."""
    from traces.clikit import pyplot, write_png
    plt = pyplot()
    fig, ax = plt.subplots()
    ax.plot([0, 1], [1, 0])
    path = write_png(fig, tmp_path / "figs" / "a.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and not plt.fignum_exists(fig.number)
    before = path.read_bytes()
    fig, ax = plt.subplots()
    ax.set_title("$\\frac{$")   # bad mathtext: drawing the figure fails
    with pytest.raises(ValueError):
        write_png(fig, path)
    assert path.read_bytes() == before and not plt.fignum_exists(fig.number)
    assert [p.name for p in (tmp_path / "figs").iterdir()] == ["a.png"]


def test_pwsim_hardware_lists_the_bundled_profiles_with_their_host_costs(capsys):
    from pwsim.cli import main
    from pwsim.cmd_hardware import HOST_TERMS, gemm_rates

    assert main(["hardware", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["name"] for r in rows] == bundled_profiles()
    for r in rows:
        p = load_profile(r["name"])
        assert all(r[k] == getattr(p, k) for k in HOST_TERMS) and r["measured"] == p.measured
    olmoe = next(r for r in rows if r["name"] == "h200-olmoe-runtime")
    assert olmoe["plan_transition_us"] > 0 and olmoe["origin"].startswith("h200-measured with the host costs")
    h100 = next(r for r in rows if r["name"] == "h100-measured")
    assert h100["device"].startswith("NVIDIA H100") and h100["prefill_chunk_overhead_us"] > 0
    assert main(["hardware", "h200-roofline"]) == 0
    out = capsys.readouterr().out
    assert "h200-roofline" in out and "h200-measured " not in out and "Roofline profile" in out
    assert main(["hardware", "h100-measured"]) == 0
    head, row = capsys.readouterr().out.splitlines()[:3:2]
    prof = load_profile("h100-measured")
    rates = gemm_rates(prof.to_json()["ap_gemm_tflops"])
    assert "device" in head and "prefill chunk us" in head and "AP GEMM TFLOP/s" in head and "NVIDIA H100" in row
    assert row.removesuffix(rates).split()[-2:] == [f"{prof.prefill_chunk_overhead_us:,.0f}",
                                                    f"{prof.ap_gemm_layer_overhead_us:,.0f}"] and row.endswith(rates)
    assert gemm_rates({}) == "-" and gemm_rates({"3": {"64": 210.4, "128": 320.0}}) == "3b 210/320 (64/128-row tiles)"
    assert main(["hardware", "no-such-profile"]) == 2
    err = capsys.readouterr().err
    assert "no-such-profile" in err and "h200-olmoe-runtime" in err and "Traceback" not in err


def test_reloads_cross_the_host_to_device_link():
    p = load_profile("h200-roofline")
    assert p.pcie_h2d_gbps != p.pcie_d2h_gbps and p.h2d_bytes_per_s == p.pcie_h2d_gbps * 1e9


def test_a_profile_may_achieve_the_full_flops_rate_and_bandwidth():
    from dataclasses import replace
    p = replace(load_profile("h200-roofline"), achieved_flops_fraction=1.0)  # validated on construction: accepted
    assert p.achieved_flops_fraction == 1.0
    full = replace(p, achieved_bandwidth_fraction={**p.achieved_bandwidth_fraction, "moe": 1.0})
    assert full.bandwidth("moe") == full.hbm_gbps * 1e9
    with pytest.raises(HardwareProfileError, match="achieved_flops_fraction must be <= 1"):
        replace(p, achieved_flops_fraction=1.5)
