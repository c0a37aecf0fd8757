"""Hardware profiles: the coefficients of the simulator's cost model, as a typed, validated JSON file.

A profile is written by hand (the bundled roofline profiles) or by `pwruntime bench kernels` with
measured numbers, and read by pwsim's cost model; it lives in `traces/` so that both sides can use
it without importing each other. Units are in the key names (GB/s = 1e9 bytes/s, TFLOP/s = 1e12).

Format (JSON object, `format_version` 1):

    name, device                        str
    gpu_memory_bytes                    int, the device's capacity (a budget may not exceed it)
    hbm_gbps                            peak HBM bandwidth
    achieved_bandwidth_fraction         {op class: fraction of hbm_gbps a kernel of that class reaches}
                                        op classes: OP_CLASSES below
    fp16_tflops                         peak dense fp16 tensor-core throughput
    achieved_flops_fraction             fraction of fp16_tflops a GEMM reaches
    pcie_h2d_gbps, pcie_d2h_gbps        pinned host<->device copy bandwidth
    iteration_overhead_us               fixed cost of one engine iteration (host work, sampling, sync)
    layer_overhead_us                   kernel-launch cost per transformer layer per iteration
    token_overhead_us                   optional (default 0): host cost per token an iteration computes (the
                                        runtime's work that grows with the batch; `pwsim fidelity --fit-profile`
                                        measures it)
    sequence_overhead_us                optional (default 0): host cost per sequence an iteration schedules
                                        (staging its inputs, sampling and settling its token: what a decode
                                        step of one sequence costs beyond one token; `pwsim fidelity
                                        --fit-profile` measures it)
    routing_read_us                     optional (default 0): host cost of a planner step that reads the routing
                                        statistics (under pressure: the held routing folded, the prompt features
                                        merged, the steps scored, and the page moves and KV resizes its plan
                                        starts), charged to the next iteration; `pwsim fidelity` measures it from a
                                        replay that records which steps read them
    plan_transition_us                  optional (default 0): host cost per transition a plan starts (its page
                                        moves begun, the table's bookkeeping, its share of the KV resize),
                                        charged to the next iteration beside routing_read_us; a reload's copy
                                        goes out when its transition's host work begins, so small reloads land
                                        within a long plan (pwsim/link.py); `pwsim fidelity` measures both from
                                        a replay that records each step's transitions
    prefill_layer_overhead_us           optional (default 0): fixed cost of one MoE layer of a batch that takes the
                                        dequantize path (above ap_fused_max_tokens): the runtime's host work and
                                        launches for the layer's expert groups; `pwsim prefill-fit --fit-profile`
                                        measures it from `pwruntime bench prefill`
    prefill_chunk_overhead_us           optional (default 0): what each chunk of dequantized experts after a layer's
                                        first adds to it (the chunk's launches; a layer takes ceil(experts / those
                                        a chunk holds), policies.memory_budget.prefill_chunk_experts); fitted
                                        beside prefill_layer_overhead_us from a bench run at two chunk sizes
    ap_kernel_efficiency                {bits "3".."8": fraction of the moe bandwidth the fused AP kernel
                                        reaches when it reads that many planes}
    ap_fused_max_tokens                 a batch of at most this many tokens runs the fused AP kernel (the
                                        runtime's limit: 128); a larger one (prefill) dequantizes the active
                                        experts to fp16 and multiplies them with GEMMs
    ap_fused_launch_tokens              optional (default 64): tokens one launch set of the fused kernel takes; a
                                        batch of more runs ceil(T / this) launch sets, each reading the planes
    ap_efficiency_by_tokens             optional {bits: {tokens: fraction}}: the fused kernel's efficiency
                                        measured at several batch sizes; between two measured sizes it is
                                        interpolated in log(tokens), outside them the nearest is used, and
                                        bits it lacks use ap_kernel_efficiency
    ap_gemm_layer_overhead_us           optional (default 0): the fixed cost of a prefill MoE layer that takes the
                                        fused AP GEMM, in place of prefill_layer_overhead_us and its chunks' (fewer
                                        launches and no chunks); fitted beside them by `pwsim prefill-fit`
    ap_gemm_tflops                      optional {bits: {tile rows: TFLOP/s}}: the fused AP GEMM's rate over its
                                        tiles, padded rows included (a prefill layer whose blocks are all at 3-4
                                        bits and whose experts average few rows skips dequantizing them,
                                        policies.prefill_path); where it lacks a layer's bits or tile size the
                                        layer is priced on the dequantize path; `pwsim prefill-fit --fit-profile`
                                        measures it from `pwruntime bench prefill` (`ap_gemm_kernel_ms`)
    metadata                            {"measured": bool, "note": str, "sources": [...], ...}
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from traces.clikit import UserError, write_json_atomic

FORMAT_VERSION = 1
OP_CLASSES = ("attention", "kv", "moe", "dense", "lm_head")
AP_BITS = (3, 4, 5, 6, 7, 8)
BUNDLED_DIR = Path(__file__).resolve().parent / "hardware"


class HardwareProfileError(UserError):
    """A hardware profile file is missing or malformed."""


@dataclass(frozen=True)
class HardwareProfile:
    name: str
    device: str
    gpu_memory_bytes: int
    hbm_gbps: float
    achieved_bandwidth_fraction: dict[str, float]
    fp16_tflops: float
    achieved_flops_fraction: float
    pcie_h2d_gbps: float
    pcie_d2h_gbps: float
    iteration_overhead_us: float
    layer_overhead_us: float
    ap_kernel_efficiency: dict[int, float]
    ap_fused_max_tokens: int = 64
    ap_efficiency_by_tokens: dict[int, dict[int, float]] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)
    token_overhead_us: float = 0.0
    sequence_overhead_us: float = 0.0
    prefill_layer_overhead_us: float = 0.0
    ap_fused_launch_tokens: int = 64
    routing_read_us: float = 0.0
    plan_transition_us: float = 0.0
    prefill_chunk_overhead_us: float = 0.0
    ap_gemm_tflops: dict[int, dict[int, float]] = field(default_factory=dict)
    ap_gemm_layer_overhead_us: float = 0.0

    def __post_init__(self) -> None:
        validate(self)

    # -------------------------------------------------------------- derived
    @property
    def measured(self) -> bool:
        return bool(self.metadata.get("measured", False))

    def bandwidth(self, op_class: str) -> float:
        """Achieved bytes/s of a kernel of `op_class`."""
        return self.hbm_gbps * 1e9 * self.achieved_bandwidth_fraction[op_class]

    def ap_efficiency(self, bits: int, tokens: int) -> float:
        """The fused AP kernel's fraction of the moe bandwidth at `bits` for a batch of `tokens`."""
        table = self.ap_efficiency_by_tokens.get(bits)
        if not table:
            return self.ap_kernel_efficiency[bits]
        sizes = sorted(table)
        t = min(max(tokens, sizes[0]), sizes[-1])
        hi = next(s for s in sizes if s >= t)
        lo = max(s for s in sizes if s <= t)
        if hi == lo:
            return table[hi]
        w = (math.log(t) - math.log(lo)) / (math.log(hi) - math.log(lo))
        return table[lo] + w * (table[hi] - table[lo])

    def ap_gemm_rate(self, bits: int, tile_rows: int) -> float | None:
        """FLOP/s of the fused AP GEMM over its padded tiles at `bits` and `tile_rows`, or None where not measured."""
        tflops = self.ap_gemm_tflops.get(bits, {}).get(tile_rows)
        return None if tflops is None else tflops * 1e12

    @property
    def flops_per_s(self) -> float:
        return self.fp16_tflops * 1e12 * self.achieved_flops_fraction

    @property
    def h2d_bytes_per_s(self) -> float:
        return self.pcie_h2d_gbps * 1e9

    # ------------------------------------------------------------------ I/O
    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["ap_kernel_efficiency"] = {str(b): v for b, v in sorted(self.ap_kernel_efficiency.items())}
        d["ap_efficiency_by_tokens"] = {str(b): {str(t): v for t, v in sorted(tv.items())}
                                        for b, tv in sorted(self.ap_efficiency_by_tokens.items())}
        d["ap_gemm_tflops"] = {str(b): {str(r): v for r, v in sorted(rv.items())}
                               for b, rv in sorted(self.ap_gemm_tflops.items())}
        return {"format_version": FORMAT_VERSION, **d}

    def save(self, path: str | os.PathLike) -> Path:
        """Write atomically (temporary file in the same directory, then rename)."""
        return write_json_atomic(path, self.to_json())


def _positive(name: str, value: Any, *, allow_zero: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (value == 0 and not allow_zero):
        raise HardwareProfileError(f"hardware profile field {name} must be a {'non-negative' if allow_zero else 'positive'} "
                                   f"number, got {value!r}")


def _check_by_bits(name: str, table: dict, key: str) -> None:
    """A {bits: {integer >= 1 (`key`): positive number}} field."""
    for b, inner in table.items():
        if b not in AP_BITS:
            raise HardwareProfileError(f"{name} has bitwidth {b}; bitwidths are {list(AP_BITS)}")
        for k, v in inner.items():
            if not isinstance(k, int) or k < 1:
                raise HardwareProfileError(f"{name}[{b}] has {key} {k!r}; a {key} is an integer >= 1")
            _positive(f"{name}[{b}][{k}]", v)


def validate(p: HardwareProfile) -> None:
    """Raise HardwareProfileError naming the first bad field."""
    if not p.name:
        raise HardwareProfileError("hardware profile needs a non-empty name")
    for f in ("gpu_memory_bytes", "hbm_gbps", "fp16_tflops", "achieved_flops_fraction", "pcie_h2d_gbps",
              "pcie_d2h_gbps", "ap_fused_max_tokens", "ap_fused_launch_tokens"):
        _positive(f, getattr(p, f))
    for f in ("iteration_overhead_us", "layer_overhead_us", "token_overhead_us", "sequence_overhead_us",
              "prefill_layer_overhead_us", "prefill_chunk_overhead_us", "routing_read_us", "plan_transition_us",
              "ap_gemm_layer_overhead_us"):
        _positive(f, getattr(p, f), allow_zero=True)
    if p.achieved_flops_fraction > 1:
        raise HardwareProfileError(f"achieved_flops_fraction must be <= 1, got {p.achieved_flops_fraction}")
    missing = [c for c in OP_CLASSES if c not in p.achieved_bandwidth_fraction]
    if missing:
        raise HardwareProfileError(f"achieved_bandwidth_fraction lacks op classes {missing}; it needs {list(OP_CLASSES)}")
    for c, v in p.achieved_bandwidth_fraction.items():
        _positive(f"achieved_bandwidth_fraction[{c!r}]", v)
        if v > 1:
            raise HardwareProfileError(f"achieved_bandwidth_fraction[{c!r}] must be <= 1, got {v}")
    missing_b = [b for b in AP_BITS if b not in p.ap_kernel_efficiency]
    if missing_b:
        raise HardwareProfileError(f"ap_kernel_efficiency lacks bitwidths {missing_b}; it needs {list(AP_BITS)}")
    for b, v in p.ap_kernel_efficiency.items():
        _positive(f"ap_kernel_efficiency[{b}]", v)
    _check_by_bits("ap_efficiency_by_tokens", p.ap_efficiency_by_tokens, "batch size")
    _check_by_bits("ap_gemm_tflops", p.ap_gemm_tflops, "tile rows")
    if "measured" not in p.metadata:
        raise HardwareProfileError('hardware profile metadata must say "measured": true or false')


def from_json(data: dict[str, Any], source: str = "<dict>") -> HardwareProfile:
    if not isinstance(data, dict):
        raise HardwareProfileError(f"{source}: a hardware profile is a JSON object")
    version = data.get("format_version")
    if version != FORMAT_VERSION:
        raise HardwareProfileError(f"{source}: format_version {version!r}, this PagedWeight reads {FORMAT_VERSION}")
    known = set(HardwareProfile.__dataclass_fields__)
    unknown = sorted(set(data) - known - {"format_version"})
    if unknown:
        raise HardwareProfileError(f"{source}: unknown field(s) {unknown}")
    kwargs = {k: v for k, v in data.items() if k in known}
    try:
        eff = kwargs.get("ap_kernel_efficiency", {})
        kwargs["ap_kernel_efficiency"] = {int(b): float(v) for b, v in eff.items()}
        by_tok = kwargs.get("ap_efficiency_by_tokens", {})
        kwargs["ap_efficiency_by_tokens"] = {int(b): {int(t): float(v) for t, v in tv.items()}
                                             for b, tv in by_tok.items()}
        kwargs["ap_gemm_tflops"] = {int(b): {int(r): float(v) for r, v in rv.items()}
                                    for b, rv in kwargs.get("ap_gemm_tflops", {}).items()}
        kwargs["achieved_bandwidth_fraction"] = dict(kwargs.get("achieved_bandwidth_fraction", {}))
        return HardwareProfile(**kwargs)
    except HardwareProfileError as e:
        raise HardwareProfileError(f"{source}: {e}") from None
    except (TypeError, ValueError, AttributeError) as e:
        raise HardwareProfileError(f"{source}: malformed hardware profile ({e})") from None


def bundled_profiles() -> list[str]:
    return sorted(p.stem for p in BUNDLED_DIR.glob("*.json"))


def load_profile(path_or_name: str | os.PathLike) -> HardwareProfile:
    """Load a profile from a JSON path, or a bundled one by name (e.g. `h200-roofline`)."""
    p = Path(path_or_name)
    if not p.is_file():
        bundled = BUNDLED_DIR / f"{path_or_name}.json"
        if not bundled.is_file():
            what = "is a directory, not a JSON file" if p.is_dir() else "not found"
            raise HardwareProfileError(f"hardware profile {str(path_or_name)!r} {what}; pass a JSON file or one of "
                                       f"the bundled profiles: {', '.join(bundled_profiles())}")
        p = bundled
    try:
        data = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise HardwareProfileError(f"{p} is not valid JSON ({e})") from None
    except OSError as e:
        raise HardwareProfileError(f"cannot read hardware profile {p} ({e.strerror or e})") from None
    return from_json(data, str(p))
