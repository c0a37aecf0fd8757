"""`pwsim gen-trace` (write a synthetic trace directory), `pwsim import-trace` (a production log's CSV as a trace
directory) and `pwsim trace-info` (validate and summarise)."""
from __future__ import annotations

import argparse
import json
import time

from traces.clikit import UserError, check_seed, writing
from traces.generators import (MAX_REQUESTS, LengthDist, RoutingSpec, WorkloadSpec, check_token_id_options,
                               generate_requests, generate_routing, parse_domains)
from traces.io import REQUESTS_FILE, ROUTING_FILE, Trace, read_trace, write_trace_dir
from traces.model_card import ModelSpec, load_card
from traces.results import prepare_trace_dir
from traces.schema import RequestTrace, RoutingTrace


def _progress(total: int, enabled: bool):
    if not enabled:
        return None, None
    from tqdm import tqdm
    bar = tqdm(total=total, desc="routing", unit="row", unit_scale=True, leave=False)
    return bar, bar.update


def run_gen(args: argparse.Namespace) -> int:
    out = prepare_trace_dir(args.out, args.force)
    if not 1 <= args.requests <= MAX_REQUESTS:
        raise UserError(f"--requests must be at least 1 and at most {MAX_REQUESTS:,} (a trace is drawn in memory), "
                        f"got {args.requests}")
    if args.routing_tokens < 0:
        raise UserError(f"--routing-tokens must be >= 0, got {args.routing_tokens}")
    check_seed(args.seed)
    check_prefix_flags(args)
    names, weights = parse_domains(args.domains)
    workload = WorkloadSpec(requests=args.requests, rate=args.rate, burstiness=args.burstiness,
                            prompt=LengthDist.parse(args.prompt_dist), output=LengthDist.parse(args.output_dist),
                            domains=names, domain_weights=weights, token_ids_vocab=args.token_ids_vocab,
                            shared_prefix_tokens=args.shared_prefix_tokens, prefix_groups=args.prefix_groups)
    spec = load_card(args.card) if args.routing else None
    rspec = RoutingSpec(skew=args.skew, domain_shift=args.domain_shift, drift=args.drift, features=args.features,
                        tokens_per_request=args.routing_tokens) if args.routing else None
    t0 = time.perf_counter()
    try:
        requests = generate_requests(workload, args.seed)
        routing = None if spec is None else _routing(args, requests, spec, rspec)
    except MemoryError:
        routing_too = " and their routing" if args.routing else ""
        raise UserError(f"not enough memory to draw {args.requests:,} requests{routing_too}; give fewer --requests"
                        f"{', --routing-tokens N or --no-routing' if args.routing else ''}") from None
    with writing(out):
        write_trace_dir(out, Trace(requests, routing))
    summary = {"out": str(out), "seconds": round(time.perf_counter() - t0, 3), "requests": requests.summary(),
               "routing": routing.summary() if routing is not None else None}
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        r = summary["requests"]
        print(f"wrote {out}/{REQUESTS_FILE}: {r['requests']} requests over {r['duration_s']:.1f} s "
              f"({r['total_tokens']:,} tokens; domains {r['domains']})")
        if routing is not None:
            print(f"wrote {out}/{ROUTING_FILE}: {len(routing):,} rows for {routing.card} "
                  f"({routing.layers} MoE layers, {routing.experts} experts, top-{routing.top_k})")
    return 0


def _routing(args: argparse.Namespace, requests: RequestTrace, spec: ModelSpec, rspec: RoutingSpec) -> RoutingTrace:
    """The routing trace of `requests` on the card `spec` (a progress bar unless --json)."""
    tokens = (requests.prompt_tokens.astype("int64") + requests.output_tokens)
    if args.routing_tokens > 0:
        tokens = tokens.clip(max=args.routing_tokens)
    bar, update = _progress(int(tokens.sum()) * spec.moe_layers, not args.json)
    try:
        return generate_routing(requests, spec, rspec, args.seed, progress=update)
    finally:
        if bar is not None:
            bar.close()


def run_import(args: argparse.Namespace) -> int:
    from traces.csv_import import FORMATS, CsvColumns, read_csv_trace

    named = (args.time_column, args.prompt_column, args.output_column)
    if args.format == "columns":
        if None in named:
            raise UserError("--format columns needs --time-column, --prompt-column and --output-column")
        columns = CsvColumns(*named, domain=args.domain_column)
    else:
        if any(c is not None for c in (*named, args.domain_column)):
            raise UserError(f"--format {args.format} names its columns itself; give --format columns to name them")
        columns = FORMATS[args.format]
    out = prepare_trace_dir(args.out, args.force)
    imported = read_csv_trace(args.csv, columns, domain=args.domain, start_s=args.start_s,
                              max_requests=args.max_requests)
    with writing(out):
        write_trace_dir(out, Trace(imported.trace, None))
    summary = {"out": str(out), "rows": imported.rows, "dropped": imported.dropped,
               "requests": imported.trace.summary()}
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        r = summary["requests"]
        print(f"wrote {out}/{REQUESTS_FILE}: {r['requests']} requests over {r['duration_s']:.1f} s "
              f"({r['rate_per_s']:.2f}/s, {r['total_tokens']:,} tokens; domains {r['domains']}) from "
              f"{imported.rows} rows ({imported.dropped} without a prompt or an output token dropped)")
    return 0


def check_prefix_flags(args: argparse.Namespace) -> None:
    """The synthetic token-id flags (`gen-trace`, and `run`/`compare` with `--trace synthetic`), one error each;
    --prefix-groups without the shared prefixes it groups too."""
    check_token_id_options(args.token_ids_vocab, args.shared_prefix_tokens, args.prefix_groups)
    if args.prefix_groups > 1 and args.shared_prefix_tokens == 0:
        raise UserError(f"--prefix-groups {args.prefix_groups} groups shared prefixes: give their length too "
                        "(--shared-prefix-tokens N), or leave --prefix-groups out")


def add_prefix_flags(g) -> None:
    """`--shared-prefix-tokens` and `--prefix-groups` on a parser or argument group."""
    g.add_argument("--shared-prefix-tokens", type=int, default=0, metavar="N",
                   help="prompts start with a shared prefix of N token ids (all but the last token of a shorter "
                        "prompt), one per prefix group; needs --token-ids-vocab (default 0 = none)")
    g.add_argument("--prefix-groups", type=int, default=1, metavar="G",
                   help="distinct shared prefixes; each request takes one uniformly at random (default 1)")


def _shared_prefix_note(trace: Trace) -> str:
    """", shared prefixes of N tokens (G groups)" when the generator that wrote the trace made them."""
    w = (trace.requests.provenance.get("workload") or {}) if trace.requests is not None else {}
    n = w.get("shared_prefix_tokens") if isinstance(w, dict) else None
    if not isinstance(n, int) or n <= 0:
        return ""
    g = w.get("prefix_groups", 1)
    return f", shared prefixes of {n} tokens ({g} group{'' if g == 1 else 's'})"


def _format_info(path: str, trace: Trace) -> str:
    lines = [f"{path}: valid trace"]
    if trace.requests is not None:
        s = trace.requests.summary()
        p, o = s["prompt_tokens"], s["output_tokens"]
        lines += [f"  requests      {s['requests']} over {s['duration_s']:.1f} s ({s['rate_per_s']:.2f}/s)",
                  f"  prompt tokens mean {p['mean']:.0f}, p50 {p['p50']:.0f}, p99 {p['p99']:.0f}, max {p['max']}",
                  f"  output tokens mean {o['mean']:.0f}, p50 {o['p50']:.0f}, p99 {o['p99']:.0f}, max {o['max']}",
                  "  domains       " + ", ".join(f"{d} {c}" for d, c in s["domains"].items()),
                  f"  token ids     {'yes' if s['prompt_token_ids'] else 'no'}{_shared_prefix_note(trace)}"]
    if trace.routing is not None:
        s = trace.routing.summary()
        again = f" ({s['recomputed_rows']:,} of them recomputes after preemption)" if s.get("recomputed_rows") else ""
        lines += [f"  routing       {s['rows']:,} rows{again}, {s['requests']} requests, model card {s['card']}",
                  f"  shape         {s['layers']} MoE layers x {s['experts']} experts, top-{s['top_k']}, "
                  f"features {'yes' if s['features'] else 'no'}",
                  f"  skew          hottest 10% of experts take {100 * s['hottest_10pct_mass']:.1f}% of routing mass"]
    if trace.warmup_routing is not None:
        s = trace.warmup_routing.summary()
        n = s["requests"]
        lines += [f"  warm-up       {s['rows']:,} rows: a recorded warm-up's routing of the first {n} "
                  f"request{'s' if n != 1 else ''} (for --warmup-requests)"]
    return "\n".join(lines)


def run_info(args: argparse.Namespace) -> int:
    model = load_card(args.card) if args.card else None
    trace = read_trace(args.path, model)
    if args.json:
        print(json.dumps({"path": args.path, "valid": True,
                          "requests": trace.requests.summary() if trace.requests is not None else None,
                          "routing": trace.routing.summary() if trace.routing is not None else None,
                          "warmup_routing": None if trace.warmup_routing is None else trace.warmup_routing.summary()},
                         indent=2))
    else:
        print(_format_info(args.path, trace))
    return 0


def register(subparsers) -> None:
    g = subparsers.add_parser("gen-trace", help="write a synthetic trace directory",
                              description="Generate a synthetic request trace (and routing trace) reproducibly by "
                                          "seed and write it as a trace directory (requests.parquet, routing.parquet).")
    g.add_argument("--out", required=True, help="trace directory to write")
    g.add_argument("--requests", type=int, default=100, help="number of requests (default 100)")
    g.add_argument("--rate", type=float, default=2.0, help="mean arrival rate, requests/s (default 2)")
    g.add_argument("--burstiness", type=float, default=1.0,
                   help="coefficient of variation of inter-arrival gaps: 1 = Poisson, >1 bursty gamma (default 1)")
    g.add_argument("--prompt-dist", default="lognormal:512,1.0,16,4096",
                   help="prompt lengths: fixed:N | uniform:MIN,MAX | lognormal:MEDIAN,SIGMA[,MIN,MAX] | "
                        "zipf:ALPHA[,MIN,MAX] (default lognormal:512,1.0,16,4096)")
    g.add_argument("--output-dist", default="lognormal:128,0.8,8,1024", help="output lengths, same forms")
    g.add_argument("--domains", default="chat,code,math", help="domain mix: a,b,c or a:0.5,b:0.3,c:0.2")
    g.add_argument("--token-ids-vocab", type=int, default=0, help="also draw prompt token ids below this vocab size")
    add_prefix_flags(g)
    g.add_argument("--card", default="Qwen1.5-MoE-A2.7B", help="model card for the routing trace (see `pwsim models`)")
    g.add_argument("--routing", action=argparse.BooleanOptionalAction, default=True,
                   help="also write routing.parquet (default yes)")
    g.add_argument("--routing-tokens", type=int, default=0,
                   help="route only the first N positions of each request (default 0 = all)")
    g.add_argument("--skew", type=float, default=1.0, help="Zipf exponent of expert popularity (default 1.0)")
    g.add_argument("--domain-shift", type=float, default=0.5,
                   help="fraction of each layer's expert ranking a domain reshuffles, 0..1 (default 0.5)")
    g.add_argument("--drift", type=float, default=0.05, help="popularity drift, logit std per sqrt(s) (default 0.05)")
    g.add_argument("--features", action="store_true", help="also draw synthetic input-norm features")
    g.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    g.add_argument("--force", action="store_true", help="overwrite an existing trace in --out")
    g.add_argument("--json", action="store_true", help="machine-readable summary")
    g.set_defaults(func=run_gen)

    m = subparsers.add_parser("import-trace", help="a production log (CSV) as a trace directory",
                              description="Read a CSV log of requests (arrival time, prompt and output tokens) and "
                                          "write it as a trace directory (requests.parquet; the simulator draws the "
                                          "routing). --format azure: the Azure LLM inference traces (TIMESTAMP, "
                                          "ContextTokens, GeneratedTokens); burstgpt: BurstGPT (Timestamp, Request "
                                          "tokens, Response tokens, Model as the domain); columns: name them.")
    m.add_argument("csv", help="the CSV file")
    m.add_argument("--out", required=True, help="trace directory to write")
    m.add_argument("--format", choices=("azure", "burstgpt", "columns"), default="azure",
                   help="the log's layout (default azure)")
    m.add_argument("--time-column", help="arrival times: seconds, or dates and times (--format columns)")
    m.add_argument("--prompt-column", help="prompt tokens (--format columns)")
    m.add_argument("--output-column", help="output tokens (--format columns)")
    m.add_argument("--domain-column", help="a column whose values become the domains (--format columns; optional)")
    m.add_argument("--domain", default="imported",
                   help="the domain of requests without a domain column (default 'imported'; a calibration's domain "
                        "name makes the quality model use its damages, else their mean)")
    m.add_argument("--start-s", type=float, default=0.0, metavar="S",
                   help="keep the requests from S seconds after the first on (default 0)")
    m.add_argument("--max-requests", type=int, default=None, metavar="N", help="keep at most N requests")
    m.add_argument("--force", action="store_true", help="overwrite an existing trace in --out")
    m.add_argument("--json", action="store_true", help="machine-readable summary")
    m.set_defaults(func=run_import)

    i = subparsers.add_parser("trace-info", help="validate a trace file or directory and summarise it",
                              description="Validate a trace (a directory, requests.parquet or routing.parquet) "
                                          "and print a summary; a malformed trace gives one error line, exit 2.")
    i.add_argument("path", help="trace directory or .parquet file")
    i.add_argument("--card", help="also check the routing trace belongs to this model card")
    i.add_argument("--json", action="store_true", help="machine-readable summary")
    i.set_defaults(func=run_info)
