"""`pwsim hardware`: the bundled hardware profiles `--hardware` takes, with the host costs each charges and its origin."""
from __future__ import annotations

import argparse
import json

from traces.clikit import text_table
from traces.hardware import HardwareProfile, bundled_profiles, load_profile

HOST_TERMS = ("iteration_overhead_us", "sequence_overhead_us", "token_overhead_us", "routing_read_us",
              "plan_transition_us", "prefill_layer_overhead_us", "prefill_chunk_overhead_us",
              "ap_gemm_layer_overhead_us")


def origin(profile: HardwareProfile, limit: int = 240) -> str:
    """The first sentence of how the profile was made (its `fitted` note, else its `note`), cut at `limit`."""
    text = str(profile.metadata.get("fitted") or profile.metadata.get("note") or "")
    head, dot, _ = text.partition(". ")
    head += "." if dot else ""
    return head if len(head) <= limit else head[:limit - 3].rstrip() + "..."


def profile_row(name: str) -> dict:
    p = load_profile(name)
    return {"name": p.name, "device": p.device, "measured": p.measured, "hbm_gbps": p.hbm_gbps,
            **{k: getattr(p, k) for k in HOST_TERMS}, "ap_gemm_tflops": p.to_json()["ap_gemm_tflops"],
            "origin": origin(p)}


def gemm_rates(rates: dict[str, dict[str, float]]) -> str:
    """The fused AP GEMM's rates as `3b 210/320 (64/128-row tiles)`, or - where the profile has none."""
    return "; ".join(f"{b}b " + "/".join(f"{v:.0f}" for v in tiles.values()) + f" ({'/'.join(tiles)}-row tiles)"
                     for b, tiles in rates.items()) or "-"


def _table(rows: list[dict]) -> str:
    head = ("profile", "device", "measured", "step us", "seq us", "token us", "routing read us",
            "plan transition us", "prefill layer us", "prefill chunk us", "AP GEMM layer us", "AP GEMM TFLOP/s")
    body = [(r["name"], r["device"], "yes" if r["measured"] else "no",
             *(f"{r[k]:,.0f}" if k != "token_overhead_us" else f"{r[k]:.1f}" for k in HOST_TERMS),
             gemm_rates(r["ap_gemm_tflops"])) for r in rows]
    return "\n".join([text_table(head, body, left=2), ""] + [f"{r['name']}: {r['origin']}" for r in rows])


def run(args: argparse.Namespace) -> int:
    rows = [profile_row(name) for name in (args.names or bundled_profiles())]
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print(_table(rows))
        print("\nThe host costs the simulator charges besides the kernels' time (`pwsim fidelity --fit-profile` fits "
              "a step's, a sequence's, a token's and a read's from a replay, `pwsim prefill-fit` a prefill MoE "
              "layer's and its chunks' from `pwruntime bench prefill`), and the fused AP GEMM's rate where a profile "
              "prices 3-4-bit prefill layers with it (`pwsim prefill-fit`, from the bench's kernel times); the full "
              "profile: traces/hardware/<profile>.json.")
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("hardware", help="list the bundled hardware profiles",
                              description="List the hardware profiles `--hardware` takes by name: whether each is "
                                          "measured, its device, the host costs it charges (a step, a sequence, a "
                                          "token, a read of the routing statistics, a plan transition, a prefill MoE "
                                          "layer and each chunk of its experts after the first) and how it was made.")
    p.add_argument("names", nargs="*", metavar="PROFILE", help="profiles to show (a bundled name or a JSON path; "
                                                               "default: every bundled one)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)
