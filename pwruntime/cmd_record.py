"""`pwruntime record-trace`: serve prompts from text domains through the engine and record the traces.

For each domain (a `<domain>/valid.txt.gz` under --corpus, or NAME=FILE pairs with --data) it cuts
--requests-per-domain prompts of random length from random places of the text, asks for a random
number of output tokens (ignoring EOS, so the trace's output lengths are what was asked), gives the
requests Poisson arrival times at --rate, and runs them through the continuous-batching engine with
trace recording on. The result is a trace directory (requests.parquet + routing.parquet with the
per-block input-norm features) whose routing was produced by the real model, for `pwsim run`.
Deterministic given --seed.
"""
from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import numpy as np

from traces.clikit import UserError, check_counts, check_seed


def register(subparsers) -> None:
    p = subparsers.add_parser("record-trace", help="record request and routing traces of the engine on text domains",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="HuggingFace checkpoint directory (default: the bundled demo model)")
    p.add_argument("--corpus", help="folder with <domain>/valid.txt.gz (e.g. ../shared/corpus)")
    p.add_argument("--data", action="append", default=[], metavar="NAME=FILE", help="a domain's text file (repeatable)")
    p.add_argument("--out", required=True, help="trace directory to write")
    p.add_argument("--card", default=None,
                   help="model card named in the routing trace (default: the bundled card of the same architecture)")
    p.add_argument("--requests-per-domain", type=int, default=16)
    p.add_argument("--prompt-tokens", default="32,256", help="MIN,MAX prompt tokens (default 32,256)")
    p.add_argument("--output-tokens", default="16,128", help="MIN,MAX output tokens (default 16,128)")
    p.add_argument("--rate", type=float, default=4.0, help="request arrivals per second (default 4)")
    p.add_argument("--temperature", type=float, default=0.8, help="sampling temperature (default 0.8; 0 = greedy)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--force", action="store_true", help="write into a non-empty --out, overwriting a trace there")
    p.add_argument("--json", action="store_true", help="print a JSON summary")
    p.set_defaults(func=run)


def _range(flag: str, text: str) -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in text.split(","))
    except ValueError:
        raise UserError(f"{flag} takes MIN,MAX (two integers), got {text!r}") from None
    if not 1 <= lo <= hi:
        raise UserError(f"{flag} needs 1 <= MIN <= MAX, got {text!r}")
    return lo, hi


def _domains(args) -> dict[str, Path]:
    files: dict[str, Path] = {}
    if args.corpus:
        root = Path(args.corpus)
        found = sorted(p.parent.name for p in root.glob("*/valid.txt.gz"))
        if not found:
            raise UserError(f"no <domain>/valid.txt.gz under {root}; pass --corpus DIR or --data NAME=FILE")
        files.update({d: root / d / "valid.txt.gz" for d in found})
    for item in args.data:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise UserError(f"--data takes NAME=FILE, got {item!r}")
        files[name] = Path(path)
    if not files:
        raise UserError("give the text to serve: --corpus DIR or --data NAME=FILE")
    for name, path in files.items():
        if not path.is_file():
            raise UserError(f"text file for domain {name!r} {'is a directory' if path.is_dir() else 'not found'}: "
                            f"{path}; pass a UTF-8 text file (optionally .gz)")
    return files


def _prepare_out(out: Path, force: bool) -> Path | None:
    """`prepare_trace_dir`, and the topmost directory the write will create (None if --out exists), to remove if the
    write fails."""
    from traces.results import prepare_trace_dir

    prepare_trace_dir(out, force)
    missing = [d for d in (out, *out.parents) if not d.exists()]
    return missing[-1] if missing else None


def _check_card(card, model) -> None:
    """Refuse a --card whose MoE layers, experts or top-k differ from the served model's: the routing would be
    labelled with a card of another shape, which no simulation can read."""
    c = model.config
    served = (c.num_moe_layers or c.layers, c.experts, c.top_k)
    if (card.moe_layers, card.experts, card.top_k) != served:
        raise UserError(f"--card {card.name} has {card.moe_layers} MoE layers of {card.experts} experts "
                        f"(top-{card.top_k}), the model served has {served[0]} of {served[1]} (top-{served[2]}): name "
                        "a card of that shape, or drop --card for the model's own")


def run(args) -> int:
    from pwruntime.cmd_perplexity import default_model_dir, read_text
    from pwruntime.engine import EngineConfig, LLMEngine
    from pwruntime.model import load_model
    from pwruntime.sampling import SamplingParams
    from pwruntime.trace_recorder import TraceRecorder, card_for

    p_lo, p_hi = _range("--prompt-tokens", args.prompt_tokens)
    o_lo, o_hi = _range("--output-tokens", args.output_tokens)
    check_counts(("--requests-per-domain", args.requests_per_domain), ("--max-num-seqs", args.max_num_seqs))
    if args.rate <= 0:
        raise UserError(f"--rate must be > 0 (requests per second), got {args.rate}")
    if args.temperature < 0:
        raise UserError(f"--temperature must be >= 0 (0 = greedy), got {args.temperature}")
    check_seed(args.seed)
    if args.card:
        from traces.model_card import CardError, load_card
        try:
            card_spec = load_card(args.card)
        except CardError as e:
            raise UserError(f"--card: {e}") from None
    created = _prepare_out(Path(args.out), args.force)
    files = _domains(args)
    model_dir = args.model or default_model_dir()
    if model_dir is None:
        raise UserError("no model: pass --model DIR")
    model = load_model(model_dir)
    if args.card:
        _check_card(card_spec, model)
    card, card_json = (args.card, None) if args.card else card_for(model_dir)
    rng = np.random.default_rng(args.seed)
    jobs = []  # (domain, prompt ids, output tokens)
    for domain, path in files.items():
        ids = model.tokenizer.encode(read_text(path), add_special_tokens=False)
        if len(ids) < p_hi + 1:
            raise UserError(f"domain {domain!r} has only {len(ids)} tokens; it needs more than {p_hi}")
        for _ in range(args.requests_per_domain):
            n = int(rng.integers(p_lo, p_hi + 1))
            start = int(rng.integers(0, len(ids) - n))
            jobs.append((domain, ids[start:start + n], int(rng.integers(o_lo, o_hi + 1))))
    order = rng.permutation(len(jobs))
    arrivals = np.cumsum(rng.exponential(1.0 / args.rate, size=len(jobs)))
    recorder = TraceRecorder(card=card, card_json=card_json, provenance={"model": str(model_dir), "seed": args.seed,
                                                     "domains": {d: str(p) for d, p in files.items()}})
    longest = p_hi + o_hi
    engine = LLMEngine(model, EngineConfig(max_num_seqs=args.max_num_seqs, seed=args.seed,
                                           num_kv_blocks=args.max_num_seqs * (-(-longest // 16) + 1)),
                       recorder=recorder)
    t0 = time.perf_counter()
    for k, j in enumerate(order):
        domain, prompt, out_tokens = jobs[j]
        params = SamplingParams(max_tokens=out_tokens, temperature=args.temperature, ignore_eos=True,
                                seed=args.seed * 100_003 + int(j))
        engine.add_request(prompt, params, arrival_time=float(arrivals[k]), domain=domain)
    from tqdm import tqdm

    total = sum(j[2] for j in jobs)
    with tqdm(total=total, unit="tok", desc="recording", disable=args.json) as bar:
        while engine.has_unfinished():
            done = engine.step()
            bar.update(sum(len(o.token_ids) for o in done))
    try:
        out = recorder.write(args.out)
    except OSError as e:  # checked up front, but a disk can fill up: the files are each written atomically
        if created is not None:
            shutil.rmtree(created, ignore_errors=True)
        raise UserError(f"cannot write the trace to {args.out} ({e.strerror or e})") from None
    summary = {"out": str(out), "requests": len(jobs), "output_tokens": int(total), "card": card,
               "domains": sorted(files), "seconds": round(time.perf_counter() - t0, 2)}
    print(json.dumps(summary) if args.json else
          f"recorded {len(jobs)} requests ({total} output tokens, {len(files)} domains) into {out} "
          f"in {summary['seconds']} s")
    return 0
