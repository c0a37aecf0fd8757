"""`pwsim run`: simulate one policy at one memory budget; write Parquet, JSON and PNG results (with several
`--max-concurrency` levels, a sweep: a run per level, traces.sweep)."""
from __future__ import annotations

import argparse
import time
from pathlib import Path

from policies.memory_budget import DEFAULT_PREFILL_CHUNK_BYTES, LUT_ROOMS
from policies.plan_log import refusal_line
from pwsim.defaults import DEFAULT_WORKLOAD, DEFAULTS, SYNTHETIC
from pwsim.hardware import format_size, parse_size
from pwsim.cmd_traces import add_prefix_flags, check_prefix_flags
from pwsim.runner import RunConfig, SyntheticWorkload, make_config
from traces.clikit import UserError, check_counts, check_seed
from traces.results import add_slo_flags, slo_attainment, slo_bounds, slo_line


def add_common(p: argparse.ArgumentParser) -> None:
    """Arguments shared by `run` and `compare`: what to simulate (all but policy and budget)."""
    g = p.add_argument_group("what to simulate (defaults: the bundled default setup)")
    g.add_argument("--trace", default=DEFAULTS.trace,
                   help="trace directory (requests.parquet [+ routing.parquet]) or 'synthetic' (default: the bundled demo "
                        "trace)")
    g.add_argument("--model", default=DEFAULTS.model, help=f"model card name or JSON path (default {DEFAULTS.model})")
    g.add_argument("--calibration", default=DEFAULTS.calibration,
                   help="calibration directory, or 'synthetic[:SEED]' (policies.synthetic; default: the bundled demo "
                        "calibration)")
    g.add_argument("--hardware", default=DEFAULTS.hardware,
                   help=f"hardware profile JSON or bundled name (default {DEFAULTS.hardware})")
    g.add_argument("--quality-fit", default=DEFAULTS.quality_fit, metavar="JSON",
                   help="runtime (damage, perplexity) points ('none': predict no perplexity; default: the demo model's)")
    g.add_argument("--seed", type=int, default=DEFAULTS.seed, help="seed of synthetic traces and calibration")
    s = p.add_argument_group("synthetic trace (with --trace synthetic)")
    s.add_argument("--requests", type=int, default=DEFAULT_WORKLOAD.requests)
    s.add_argument("--rate", type=float, default=DEFAULT_WORKLOAD.rate, help="requests per second")
    s.add_argument("--burstiness", type=float, default=None, metavar="CV",
                   help=f"coefficient of variation of the gaps between arrivals (synthetic: default "
                        f"{DEFAULT_WORKLOAD.burstiness}; with --request-rate: default 1, Poisson)")
    s.add_argument("--prompt-dist", default=str(DEFAULT_WORKLOAD.prompt), help="e.g. lognormal:384,0.6")
    s.add_argument("--output-dist", default=str(DEFAULT_WORKLOAD.output), help="e.g. fixed:512")
    s.add_argument("--domains", default=",".join(DEFAULT_WORKLOAD.domains),
                   help="comma-separated domain names (match the calibration's per-domain damages)")
    s.add_argument("--token-ids-vocab", type=int, default=0, metavar="V",
                   help="also draw prompt token ids below V (what --enable-prefix-caching matches; default 0 = none)")
    add_prefix_flags(s)
    e = p.add_argument_group("engine")
    e.add_argument("--block-size", type=int, default=16, help="tokens a KV block holds (default 16)")
    e.add_argument("--max-num-seqs", type=int, default=256,
                   help="sequences an iteration may run (default 256; the runtime's default is 32: give the same "
                        "limits to compare the two engines)")
    e.add_argument("--max-num-batched-tokens", "--max-batched-tokens", type=int, default=2048,
                   help="tokens an iteration may compute, prompt chunks and decodes together (vLLM's and `pwruntime`'s "
                        "name; default 2048)")
    e.add_argument("--timeline-stride", type=int, default=1, help="record every n-th iteration boundary")
    e.add_argument("--enable-prefix-caching", action="store_true",
                   help="share the cached KV blocks of common prompt prefixes between requests, as the runtime's "
                        "--enable-prefix-caching (needs prompt token ids: a trace with them, or --token-ids-vocab); "
                        "the summary reports prefix_cache_hit_tokens")
    e.add_argument("--hybrid-kv-cache", action=argparse.BooleanOptionalAction, default=True,
                   help="a model with sliding-window layers (Gemma 4) keeps their KV in block tables of their own that "
                        "hand back what leaves the window, as vLLM's hybrid KV cache manager (policies/kv_groups.py); "
                        "the runtime's --hybrid-kv-cache (default on; --no-hybrid-kv-cache: one table)")
    e.add_argument("--async-scheduling", action="store_true",
                   help="schedule the next batch before the last one's tokens settle, as the runtime's "
                        "--async-scheduling: its decisions, and iterations that take the longer of the device's and "
                        "the host's work")
    e.add_argument("--instant-page-moves", action="store_true",
                   help="land every page move at the iteration boundary that began it, the link taking no time, as "
                        "the CPU runtime does (no copy stream); `--like-replay` of a CPU replay sets it")
    e.add_argument("--lut-room", choices=LUT_ROOMS, default="slack",
                   help="where an offload's lower-bitwidth LUT finds room while the offload is in flight, as the "
                        "runtime's --lut-room: the budget's allocator slack (default), or the KV pool, shrunk over free "
                        "blocks for it (every run before session 38; `--like-replay` of such a replay sets it)")
    e.add_argument("--prefill-chunk", default=None, metavar="SIZE",
                   help="the dequantized expert weights a prefill MoE layer holds at once, as the runtime's "
                        "--prefill-chunk: a layer takes its experts in ceil(experts / those SIZE holds) chunks, each "
                        "after the first costing the profile's prefill_chunk_overhead_us (default 1GiB, the "
                        "runtime's; `--like-replay` takes a replay's)")
    e.add_argument("--activation-reserve", default="0B", metavar="SIZE",
                   help="budget memory a step's activations take, kept out of the KV pool as the runtime's "
                        "--activation-reserve (which measures it by a profiling forward; a replay's config.json "
                        "records it, and `--like-replay` takes it); default 0B")
    g.add_argument("--time-scale", type=float, default=1.0, metavar="S",
                   help="multiply the arrival times by S, as `pwruntime replay --time-scale` (0.5: the same requests "
                        "at twice the rate, 0: all at once; default 1)")
    g.add_argument("--request-rate", type=float, default=None, metavar="R",
                   help="send a trace's requests at R per second instead of their recorded times (gaps of CV "
                        "--burstiness, 1: Poisson; seeded by --seed), as `pwruntime bench serve --request-rate`")
    g.add_argument("--max-concurrency", default=None, metavar="N[,N...]",
                   help="at most N requests in flight, as `pwruntime bench serve --max-concurrency N` (N users): one "
                        "whose arrival finds N in flight is sent when one ends, its latencies counted from then "
                        "(default: no limit); `run` takes several levels (1,4,16,64): a sweep, one run each, a result "
                        "directory each under --out, summary.json and sweep.png, as bench serve's")
    e.add_argument("--warmup-requests", type=int, default=0, metavar="N",
                   help="as `pwruntime replay --warmup-requests N`: serve the trace's first N prompts at once (16 "
                        "tokens each) before the clock starts and outside every metric; what their pressure planned "
                        "(bits, KV pool) and the routing statistics stay (default 0)")


def config_from_args(args: argparse.Namespace, policy: str, policy_params: dict, budget: str,
                     max_concurrency: int | None = None) -> RunConfig:
    """The RunConfig the flags describe; `max_concurrency`: one level of `pwsim run`'s sweep (else the flag's one
    level)."""
    from traces.generators import LengthDist
    from traces.sweep import parse_levels
    levels = parse_levels(args.max_concurrency)
    if max_concurrency is None and len(levels) > 1:
        raise UserError("--max-concurrency: several levels make a sweep, which `pwsim run` runs; give this command "
                        "one level")
    for flag, spec in (("--prompt-dist", args.prompt_dist), ("--output-dist", args.output_dist)):
        try:
            LengthDist.parse(spec)
        except UserError as err:
            raise UserError(f"{flag}: {err}") from None
    if args.trace != SYNTHETIC and not Path(args.trace).is_dir():
        raise UserError(f"--trace {args.trace}: not a trace directory (make one with `pwsim gen-trace`) "
                        "and not 'synthetic'")
    if args.trace != SYNTHETIC:
        check_trace_flags(args)
    domains = tuple(d.strip() for d in args.domains.split(",") if d.strip())
    if not domains:
        raise UserError("--domains needs at least one name")
    check_counts(("--requests", args.requests), ("--block-size", args.block_size),
                 ("--max-num-seqs", args.max_num_seqs), ("--max-num-batched-tokens", args.max_num_batched_tokens),
                 ("--timeline-stride", args.timeline_stride))
    check_seed(args.seed)
    if args.warmup_requests < 0:
        raise UserError(f"--warmup-requests must be >= 0, got {args.warmup_requests}")
    reserve = parse_size(args.activation_reserve, allow_zero=True, flag="--activation-reserve")
    chunk = (DEFAULT_PREFILL_CHUNK_BYTES if args.prefill_chunk is None
             else parse_size(args.prefill_chunk, flag="--prefill-chunk"))
    check_prefix_flags(args)
    if args.enable_prefix_caching and args.trace == SYNTHETIC and args.token_ids_vocab == 0:
        raise UserError("--enable-prefix-caching needs prompt token ids: with --trace synthetic add --token-ids-vocab V "
                        "(and --shared-prefix-tokens N for prompts that share a prefix)")
    wl = SyntheticWorkload(requests=args.requests, rate=args.rate,
                           burstiness=DEFAULT_WORKLOAD.burstiness if args.burstiness is None else args.burstiness,
                           prompt=args.prompt_dist, output=args.output_dist, domains=domains,
                           token_ids_vocab=args.token_ids_vocab, shared_prefix_tokens=args.shared_prefix_tokens,
                           prefix_groups=args.prefix_groups)
    return make_config(budget, policy=policy, policy_params=policy_params, model=args.model,
                       calibration=args.calibration, hardware=args.hardware, trace=args.trace, workload=wl,
                       quality_fit=args.quality_fit, seed=args.seed, block_size=args.block_size,
                       max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                       timeline_stride=args.timeline_stride, prefix_caching=args.enable_prefix_caching,
                       hybrid_kv=args.hybrid_kv_cache, async_scheduling=args.async_scheduling,
                       instant_page_moves=args.instant_page_moves,
                       lut_room=args.lut_room, activation_reserve_bytes=reserve, prefill_chunk_bytes=chunk,
                       warmup_requests=args.warmup_requests,
                       time_scale=args.time_scale, request_rate=args.request_rate,
                       request_burstiness=1.0 if args.burstiness is None else args.burstiness,
                       max_concurrency=levels[0] if max_concurrency is None else max_concurrency)


SYNTHETIC_ONLY = ("requests", "rate", "prompt_dist", "output_dist", "domains", "token_ids_vocab",
                  "shared_prefix_tokens", "prefix_groups")  # the flags that shape a synthetic trace


def remember_defaults(parser: argparse.ArgumentParser) -> None:
    """Keep the parser's defaults in `args._defaults`, for `given`, and its options in `args._options`, for
    `command_line`."""
    parser.set_defaults(_defaults={a.dest: a.default for a in parser._actions},
                        _options=[(a.dest, _long_option(a), type(a).__name__) for a in parser._actions
                                  if a.option_strings and a.dest not in NOT_IN_COMMAND])


def _long_option(action: argparse.Action) -> str:
    """An option's long spelling (a BooleanOptionalAction's positive one)."""
    if isinstance(action, argparse.BooleanOptionalAction):
        return action.option_strings[0]
    return max(action.option_strings, key=len)


NOT_IN_COMMAND = ("help", "force", "json", "no_progress", "jobs")  # flags that change how a result is shown, not it


def command_line(prog: str, args: argparse.Namespace, always: tuple[str, ...] = ()) -> str:
    """The command that reproduces a result: `prog` and every option that differs from its default (and the `always`
    ones), as a shell takes them (the reproduce lines, a result's `command`)."""
    import shlex
    parts = [prog]
    for dest, option, kind in args._options:
        value = getattr(args, dest)
        if value == args._defaults[dest] and dest not in always:
            continue
        if kind == "BooleanOptionalAction":
            parts.append(option if value else option.replace("--", "--no-", 1))
        elif kind in ("_StoreTrueAction", "_StoreFalseAction"):
            parts.append(option)
        elif kind == "_AppendAction":
            parts += [f"{option} {shlex.quote(str(v))}" for v in value]
        elif value is not None:
            parts.append(f"{option} {shlex.quote(str(value))}")
    return " ".join(parts)


def given(args: argparse.Namespace, *dests: str) -> list[str]:
    """Of the arguments `dests`, those the command line set, as flags: those whose value is not the default (a flag
    given its default value is not told apart, and changes nothing)."""
    return [f"--{d.replace('_', '-')}" for d in dests if getattr(args, d) != args._defaults[d]]


def check_trace_flags(args: argparse.Namespace) -> None:
    """Refuse the synthetic trace's flags with a trace directory, whose requests are recorded, and --burstiness
    without --request-rate, whose gaps it shapes."""
    flags = given(args, *SYNTHETIC_ONLY)
    if flags:
        raise UserError(f"{', '.join(flags)}: only a synthetic trace (--trace synthetic) takes "
                        f"{'them' if len(flags) > 1 else 'it'}, and --trace {args.trace} is a trace directory, whose "
                        f"requests are recorded; leave {'them' if len(flags) > 1 else 'it'} out or give --trace "
                        "synthetic")
    if args.burstiness is not None and args.request_rate is None:
        raise UserError("--burstiness shapes the gaps of --request-rate's arrivals (or of a synthetic trace's); give "
                        "--request-rate R too, or leave --burstiness out")


def validate_config(cfg) -> None:
    """Fail fast (in this process, with a clear message) on a bad card, profile, calibration or trace."""
    from pwsim import runner
    from pwsim.hardware import load_profile
    runner._card(cfg.model)
    load_profile(cfg.hardware)
    runner._calibration(cfg.calibration, cfg.model, cfg.seed)
    if cfg.uses_quality_fit:
        from pwsim.quality import load_fit_points
        load_fit_points(cfg.quality_fit)
    if cfg.trace != "synthetic":
        runner.build_workload(cfg)
    else:  # the requests alone (cheap): a bad --rate or --burstiness is refused here, not in every worker
        from traces.generators import generate_requests
        generate_requests(cfg.workload.specs()[0], cfg.seed)


def policies_and_budgets(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """`--policies` and `--budgets` as lists (each entry checked), for the commands that run every pair."""
    policy_names = [p.strip() for p in args.policies.split(",") if p.strip()]
    budgets = [b.strip() for b in args.budgets.split(",") if b.strip()]
    if not policy_names or not budgets:
        raise UserError("--policies and --budgets need at least one entry each")
    check_distinct("--policies", args.policies, policy_names)
    check_distinct("--budgets", args.budgets, [parse_size(b) for b in budgets])
    if args.policy_arg and len(policy_names) > 1:
        raise UserError("--policy-arg applies to a single policy; give one policy at a time, or use presets such as "
                        "pagedweight-no-routing")
    return policy_names, budgets


def middle_budget(budgets: list[str]) -> str:
    """The budget a command plots by default: the middle one by size, in whatever order --budgets names them."""
    return sorted(budgets, key=parse_size)[len(budgets) // 2]


def check_distinct(flag: str, text: str, keys: list) -> None:
    """Refuse a list flag (`text` as given) that names an entry twice (`keys`: what makes two entries the same)."""
    if len(set(keys)) < len(keys):
        raise UserError(f"{flag}: a value is given twice ({text}); give each once")


def add_sweep_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sweep", action="append", default=[], metavar="K=V1,V2,...",
                        help="run each policy that has parameter K once per value (repeatable: every combination); "
                             "the others once, e.g. --policies pagedweight,uniform-4 --sweep min_plan_blocks=1,4,16")


def policy_variants(args: argparse.Namespace, policy_names: list[str]) -> list[tuple[str, dict]]:
    """(policy, parameters) of every planner to run: each policy with its `--policy-arg`, once per combination of
    the `--sweep` values of the parameters it has (once if it has none of them)."""
    import itertools

    from policies.registry import PolicyError, describe
    sweeps: dict[str, list[str]] = {}
    for spec in args.sweep:
        key, sep, raw = spec.partition("=")
        values = [v.strip() for v in raw.split(",") if v.strip()]
        if not sep or not key.strip() or not values:
            raise UserError(f"--sweep {spec!r} is not K=V1,V2,... (e.g. --sweep min_plan_blocks=1,4,16)")
        key = key.strip()
        if key in sweeps:
            raise UserError(f"--sweep {key} given twice; give its values in one list")
        check_distinct(f"--sweep {key}", raw, values)
        if any(a.partition("=")[0].strip() == key for a in args.policy_arg):
            raise UserError(f"--sweep {key} and --policy-arg {key}=... both set {key}; give one")
        sweeps[key] = values
    taken: set[str] = set()
    out = []
    for name in policy_names:
        try:
            known = {p for p, _, _ in describe(name)}
        except PolicyError as e:
            raise UserError(str(e)) from None
        keys = [k for k in sweeps if k in known]
        taken.update(keys)
        for combo in itertools.product(*(sweeps[k] for k in keys)):
            out.append((name, parse_policy(name, [*args.policy_arg, *(f"{k}={v}" for k, v in zip(keys, combo))])))
    unused = [k for k in sweeps if k not in taken]
    if unused:
        raise UserError(f"--sweep {unused[0]}: no policy of --policies {','.join(policy_names)} has that parameter "
                        "(`pwsim policies NAME` lists a policy's)")
    return out


def parse_policy(name: str, args_list: list[str]) -> dict:
    import policies
    try:
        kw = policies.parse_policy_args(name, args_list)
        policies.get(name, **kw)
    except policies.PolicyError as e:
        raise UserError(str(e)) from None
    return kw


def describe(summary: dict) -> str:
    m, q = summary["memory"], summary["quality"]
    lines = [
        f"{summary['label']}: {summary['completed']}/{summary['requests']} requests completed "
        f"({summary['finish_reasons']}) in {summary['makespan_s']:.2f} simulated s, {summary['iterations']} iterations",
        f"  throughput {summary['throughput_tokens_per_s']:.0f} output tok/s ({summary['total_tokens_per_s']:.0f} "
        f"with prompts, {summary['requests_per_s']:.3g} requests/s); TTFT p50 {_ms(summary['ttft_s']['p50'])}, "
        f"p99 {_ms(summary['ttft_s']['p99'])}; TPOT p50 {_ms(summary['tpot_s']['p50'])}, "
        f"p99 {_ms(summary['tpot_s']['p99'])}; ITL p99 {_ms(summary['itl_s']['p99'])}, max "
        f"{_ms(summary['itl_s']['max'])}; e2e p50 {summary['e2e_s']['p50'] or 0:.2f} s",
        f"  memory: peak {format_size(m['peak_bytes'])} of {format_size(m['budget_bytes'])} "
        f"(weights {format_size(m['peak_weight_bytes'])}, KV pool {format_size(m['peak_kv_pool_bytes'])}); "
        f"budget violations {m['budget_violations']}",
        f"  mean committed bits {summary['mean_committed_bits']:.2f}; page traffic "
        f"{format_size(summary['page_traffic']['reload_bytes'])} reloaded in {summary['page_traffic']['reloads']} "
        f"transfers; plans {summary['plans']['plans']} ({summary['plans']['round_trips']['count']} round trips); "
        f"preemptions {summary['preemptions']}; stalls "
        f"{ {k: v['count'] for k, v in summary['stalls'].items()} or 'none'}",
    ]
    if (summary.get("config") or {}).get("prefix_caching"):
        lines.append(f"  prefix caching: {summary['prefix_cache_hit_tokens']:,} prompt tokens reused from cached blocks")
    if q["available"]:
        ppl = f"; {q['predicted_ppl_label']}: {q['predicted_ppl']:.3f}" if q.get("predicted_ppl") is not None else ""
        lines.append(f"  quality: mean damage per token {q['mean_damage_per_token']:.4g}{ppl}")
    lines.append(f"  quality note: {q['note']}")
    if summary.get("slo"):
        lines.append("  SLO " + slo_line(summary["slo"]))
    lines.append(f"  simulated {summary['computed_tokens']:,} tokens in {summary['wall_s']:.1f} wall s "
                 f"({summary['sim_tokens_per_wall_s']:,.0f} tokens per wall s)")
    return "\n".join(lines)


def _ms(v) -> str:
    return "-" if v is None else f"{v * 1e3:.3g} ms"


def run(args: argparse.Namespace) -> int:
    from pwsim import output, runner
    from traces.sweep import parse_levels
    command = command_line("pwsim run", args)  # as given: --like-replay fills in the replay's settings below
    if args.like_replay:
        from pwsim import like_replay
        taken = like_replay.apply(args, args.like_replay)
        if not args.json:
            print(f"as the replay {args.like_replay}: {' '.join(taken)}")
    params = parse_policy(args.policy, args.policy_arg)
    levels = parse_levels(args.max_concurrency)
    if len(levels) > 1:
        return run_sweep(args, params, levels, command)
    cfg = config_from_args(args, args.policy, params, args.budget)
    slo = slo_bounds(args)
    out = output.prepare_dir(f"runs/run-{cfg.policy}-{args.budget}" if args.out is None else args.out, args.force)
    t0 = time.perf_counter()
    result = runner.execute(cfg, progress=not (args.json or args.no_progress))
    if slo is not None:
        result.summary["slo"] = slo_attainment(result.requests, *slo)
    result.summary["command"] = command
    path = output.write_run(result, cfg.to_json(), out, plots=not args.no_plots, force=args.force)
    if args.json:
        print(output.dumps(result.summary))
    else:
        print(describe(result.summary))
        refused = refusal_line(result.plan_log, str(path))
        if refused:
            print(f"  {refused}")
        print(f"wrote {path}/ (requests.parquet, timeline.parquet, plans.parquet, summary.json, config.json, "
              f"events.json{', timeline.png, latency.png' if not args.no_plots else ''}) in "
              f"{time.perf_counter() - t0:.1f} s")
        print(f"reproduce: {result.summary['command']}")
    return 0


def run_sweep(args: argparse.Namespace, params: dict, levels: list[int], command: str) -> int:
    """One run per --max-concurrency level into `--out/c<N>`, their rows in `--out/summary.json`, a table and
    `sweep.png` (traces.sweep), as `pwruntime bench serve` writes its sweep."""
    import json

    from pwsim import output, runner
    from traces import sweep
    from traces.results import write_result_dir
    configs = [config_from_args(args, args.policy, params, args.budget, level) for level in levels]
    slo = slo_bounds(args)
    out = output.prepare_dir(f"runs/run-{configs[0].policy}-{args.budget}-sweep" if args.out is None else args.out,
                             args.force)
    results = []
    for cfg in configs:
        result = runner.execute(cfg, progress=not (args.json or args.no_progress))
        if slo is not None:
            result.summary["slo"] = slo_attainment(result.requests, *slo)
        results.append(result)
    rows = [sweep.sweep_row(cfg.max_concurrency, r.summary) for cfg, r in zip(configs, results)]

    def write_levels(tmp: Path) -> None:
        for cfg, result in zip(configs, results):
            output.write_run(result, cfg.to_json(), tmp / f"c{cfg.max_concurrency}", plots=not args.no_plots)
        if not args.no_plots:
            sweep.plot_sweep(rows, tmp / "sweep.png", f"pwsim run {configs[0].label} ({configs[0].hardware})")

    config = {**configs[0].to_json(), "max_concurrency": levels}  # each level's own config is in its directory
    write_result_dir(out, {}, {"summary": {"sweep": rows, "command": command}, "config": config}, extra=write_levels,
                     force=args.force)
    print(json.dumps(rows) if args.json else sweep.table(rows) + f"\nwrote {out}/ (c{levels[0]}/ ... c{levels[-1]}/, "
          f"summary.json{', sweep.png' if not args.no_plots else ''})\nreproduce: {command}")
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("run", help="simulate one policy at one memory budget",
                              description="Simulate one serving replica running one policy under a GPU memory "
                                          "budget; writes per-request and timeline Parquet, a JSON summary, the "
                                          "config that reproduces it, and plots.")
    p.add_argument("--policy", default="pagedweight",
                   help="policy name (`pwsim policies` lists them and their parameters), or a planner of your own as "
                        "MODULE:CLASS or FILE.py:CLASS (default pagedweight)")
    p.add_argument("--policy-arg", action="append", default=[], metavar="K=V", help="policy parameter (repeatable)")
    p.add_argument("--budget", default=DEFAULTS.budgets[1], help=f"GPU memory budget (default {DEFAULTS.budgets[1]})")
    p.add_argument("--out", default=None, help="result directory (default runs/run-POLICY-BUDGET)")
    p.add_argument("--like-replay", default=None, metavar="DIR",
                   help="simulate what a `pwruntime replay --record-routing` served: its trace and routing (DIR/trace) "
                        "and its settings (budget, policy, calibration, scheduler limits, warm-up, arrivals), over "
                        "the flags here; the hardware profile and the output stay as given (pwsim/like_replay.py)")
    p.add_argument("--force", action="store_true", help="overwrite a non-empty --out that is not a pwsim result")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (shown only on a terminal)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    add_slo_flags(p)
    add_common(p)
    p.set_defaults(func=run)
    remember_defaults(p)
