"""`pwsim run --like-replay DIR`: a runtime replay's settings as the simulator's flags, so it simulates what was served.

A `pwruntime replay --record-routing` result holds the replayed requests and the routing they took (`DIR/trace`) and,
in `config.json`, the flags it ran with. `apply` sets the `pwsim run` arguments that have a counterpart there: the
trace and its model card, the memory budget, the policy and its parameters, the calibration, the scheduler limits,
prefix caching, hybrid KV groups, asynchronous scheduling, where offloads' LUTs found room (`--lut-room`: "pool" for a
replay older than the flag), the dequantized experts a prefill layer held at once (`--prefill-chunk`), what it kept out
of its KV pool for a step's activations and for its CUDA graphs and buffers (`--activation-reserve`, their sum), the
warm-up and the arrival settings, and, from its `summary.json`, whether its page moves landed at once
(`--instant-page-moves`: the CPU runtime's, which has no copy stream). What the simulator adds of its own (the hardware
profile, the output) stays as given. A replay whose KV pool was not sized by `--gpu-memory-budget` has no budget the
simulator could take, and one that recorded no routing no trace of what it served: both are refused.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from policies.synthetic import SYNTHETIC
from pwsim.cmd_run import check_trace_flags, given
from traces.clikit import UserError

# (the replay's config.json key, `pwsim run`'s argument, its flag)
SETTINGS = (
    ("gpu_memory_budget", "budget", "--budget"),
    ("policy", "policy", "--policy"),
    ("policy_arg", "policy_arg", "--policy-arg"),
    ("calibration", "calibration", "--calibration"),
    ("block_size", "block_size", "--block-size"),
    ("max_num_seqs", "max_num_seqs", "--max-num-seqs"),
    ("max_num_batched_tokens", "max_num_batched_tokens", "--max-num-batched-tokens"),
    ("enable_prefix_caching", "enable_prefix_caching", "--enable-prefix-caching"),
    ("hybrid_kv_cache", "hybrid_kv_cache", "--hybrid-kv-cache"),
    ("async_scheduling", "async_scheduling", "--async-scheduling"),
    ("lut_room", "lut_room", "--lut-room"),
    ("activation_reserve", "activation_reserve", "--activation-reserve"),
    ("prefill_chunk_bytes", "prefill_chunk", "--prefill-chunk"),
    ("warmup_requests", "warmup_requests", "--warmup-requests"),
    ("time_scale", "time_scale", "--time-scale"),
    ("request_rate", "request_rate", "--request-rate"),
    ("burstiness", "burstiness", "--burstiness"),
    ("seed", "seed", "--seed"),
)
DEFAULT_ON = {"--hybrid-kv-cache"}  # the switches on unless turned off (`--no-...`)


def apply(args: argparse.Namespace, replay_dir: str) -> list[str]:
    """Set `args` from the replay at `replay_dir`; returns the settings taken, as flags."""
    from traces.io import CARD_FILE, ROUTING_FILE, read_routing
    from traces.results import kept_out_of_pool

    d = Path(replay_dir)
    try:
        config = json.loads((d / "config.json").read_text())
    except (OSError, ValueError):
        raise UserError(f"--like-replay {d}: no readable config.json; give the --out of a `pwruntime replay`") from None
    if not isinstance(config, dict) or config.get("command") != "replay":
        what = config.get("command") if isinstance(config, dict) else None
        raise UserError(f"--like-replay {d} is not a `pwruntime replay` result (its config.json is "
                        f"{what or 'another tool'}'s); give the --out of a replay")
    trace = d / "trace"
    if not (trace / ROUTING_FILE).is_file():
        raise UserError(f"--like-replay {d}: the replay recorded no routing; run it again with --record-routing, "
                        "which writes the requests it served and the routing they took")
    if config.get("gpu_memory_budget") is None:
        raise UserError(f"--like-replay {d}: the replay sized its KV pool without --gpu-memory-budget, which is what "
                        "the simulator's --budget matches; replay with --gpu-memory-budget SIZE, or give pwsim run "
                        "--trace DIR/trace --budget SIZE and the other flags yourself")
    # what a replay older than a setting ran with: offloads' LUTs took their room from the KV pool (before session 38),
    # and one KV table served every layer (before session 49)
    config = {"lut_room": "pool", "hybrid_kv_cache": False, **config}
    if config.get("serving_reserve"):  # the simulator has no graphs or buffers: their share joins the reserve
        config["activation_reserve"] = kept_out_of_pool(config)
    # not recorded (an older replay), or no calibration given: the simulator's default (or the flag) stands
    settings = [(key, attr, flag) for key, attr, flag in SETTINGS
                if key in config and not (key == "calibration" and not config[key])]
    fixed = [("trace", "--trace"), ("model", "--model")] + [(attr, flag) for _, attr, flag in settings]
    overridden = [flag for attr, flag in fixed if given(args, attr)]
    if overridden:
        raise UserError(f"--like-replay {d} takes {', '.join(overridden)} from the replay; leave "
                        f"{'them' if len(overridden) > 1 else 'it'} out (or give pwsim run --trace {trace} and every "
                        "setting yourself)")
    taken = [f"--trace {trace}"]
    args.trace = str(trace)
    # the card its routing names: a bundled one, or the one the replay wrote beside it (a model without a bundled card)
    args.model = str(trace / CARD_FILE) if (trace / CARD_FILE).is_file() else read_routing(trace / ROUTING_FILE).card
    taken.append(f"--model {args.model}")
    for key, attr, flag in settings:
        value = config[key]
        if key == "calibration" and value == SYNTHETIC:
            value = f"{SYNTHETIC}:0"  # the runtime's seed for a plain `synthetic` (pwruntime.cmd_generate)
        setattr(args, attr, value)  # None too: what the replay ran without (--request-rate), the simulation does
        if value is None:
            continue
        if isinstance(value, bool):
            taken += [flag] if value else [f"--no-{flag[2:]}"] if flag in DEFAULT_ON else []
        elif isinstance(value, list):
            taken += [f"{flag} {v}" for v in value]
        else:
            taken.append(f"{flag} {value}")
    if _instant_page_moves(d):
        args.instant_page_moves = True
        taken.append("--instant-page-moves")
    check_trace_flags(args)  # the synthetic trace's flags, which a recorded trace leaves nothing to do
    return taken


def _instant_page_moves(d: Path) -> bool:
    """Whether the replay's page moves landed at the boundary that began them (`traces.results.instant_page_moves`)."""
    from traces.results import instant_page_moves
    try:
        summary = json.loads((d / "summary.json").read_text())
    except (OSError, ValueError):
        raise UserError(f"--like-replay {d}: no readable summary.json; give the --out of a finished "
                        "`pwruntime replay`") from None
    if not isinstance(summary, dict):
        raise UserError(f"--like-replay {d}: its summary.json holds no summary; give the --out of a `pwruntime replay`")
    return bool(instant_page_moves(summary))
