"""`pwruntime demo`: train the bundled demo MoE model (`demo train`) and measure it (`demo stats`)."""
from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
import time
from pathlib import Path

from traces.clikit import UserError, check_output, check_seed, write_json_atomic


def register(subparsers) -> None:
    p = subparsers.add_parser("demo", help="train and evaluate the bundled demo MoE model",
                              description="Train and evaluate the bundled demo MoE model (Qwen2-MoE, ~10M parameters).")
    p.set_defaults(func=lambda args: _usage(p))
    sub = p.add_subparsers(dest="demo_command", metavar="ACTION", parser_class=type(p))
    _register_train(sub)
    _register_stats(sub)


def _usage(p: argparse.ArgumentParser) -> int:
    p.print_help(sys.stderr)
    return 2


def _positive_int(s: str) -> int:
    v = int(s)
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {s}")
    return v


def _register_train(sub) -> None:
    from pwruntime.demo.model import ModelSpec
    from pwruntime.demo.train import TrainConfig

    d, m = TrainConfig(), ModelSpec()
    t = sub.add_parser("train", help="train (or resume) the demo model; writes OUT/model/ in HuggingFace format",
                       description="Train the demo MoE model on CORPUS/<domain>/train.txt.gz. Resumable: each call "
                                   "continues from OUT/checkpoint.pt; --max-minutes stops cleanly at a checkpoint.")
    t.add_argument("--corpus", required=True, help="folder with <domain>/{train,valid}.txt.gz")
    t.add_argument("--out", required=True, help="run folder (tokenizer, token cache, log, checkpoint, model/)")
    t.add_argument("--steps", type=_positive_int, default=d.steps, help="total optimizer steps (default %(default)s)")
    t.add_argument("--batch-size", type=_positive_int, default=d.batch_size,
                   help="sequences per step (default %(default)s)")
    t.add_argument("--seq-len", type=_positive_int, default=d.seq_len,
                   help="tokens per sequence (default %(default)s)")
    t.add_argument("--lr", type=float, default=d.lr, help="peak learning rate (default %(default)s)")
    t.add_argument("--warmup-steps", type=int, default=d.warmup_steps, help="default %(default)s")
    t.add_argument("--weight-decay", type=float, default=d.weight_decay, help="default %(default)s")
    t.add_argument("--seed", type=int, default=d.seed, help="default %(default)s")
    t.add_argument("--domains", help="comma-separated domains (default: every domain in the corpus)")
    t.add_argument("--domain-mix", choices=["equal", "sqrt", "proportional"], default=d.domain_mix,
                   help="rows per batch per domain, by training tokens (default %(default)s)")
    t.add_argument("--domain-weights", help="comma-separated batch shares per domain (overrides --domain-mix)")
    t.add_argument("--log-every", type=_positive_int, default=d.log_every, help="default %(default)s")
    t.add_argument("--eval-every", type=_positive_int, default=d.eval_every, help="default %(default)s")
    t.add_argument("--ckpt-every", type=_positive_int, default=d.ckpt_every, help="default %(default)s")
    t.add_argument("--save-dtype", choices=["float16", "bfloat16", "float32"], default=d.save_dtype,
                   help="dtype of the exported safetensors (default %(default)s)")
    g = t.add_argument_group("model")
    g.add_argument("--vocab-size", type=_positive_int, default=m.vocab_size, help="default %(default)s")
    g.add_argument("--hidden-size", type=_positive_int, default=m.hidden_size, help="default %(default)s")
    g.add_argument("--layers", type=_positive_int, default=m.num_hidden_layers, help="default %(default)s")
    g.add_argument("--heads", type=_positive_int, default=m.num_attention_heads, help="default %(default)s")
    g.add_argument("--kv-heads", type=_positive_int, default=m.num_key_value_heads, help="default %(default)s")
    g.add_argument("--experts", type=_positive_int, default=m.num_experts, help="default %(default)s")
    g.add_argument("--top-k", type=_positive_int, default=m.num_experts_per_tok, help="default %(default)s")
    g.add_argument("--moe-intermediate", type=_positive_int, default=m.moe_intermediate_size,
                   help="default %(default)s")
    g.add_argument("--shared-intermediate", type=_positive_int, default=m.shared_expert_intermediate_size,
                   help="default %(default)s")
    g.add_argument("--aux-loss-coef", type=float, default=m.router_aux_loss_coef,
                   help="load-balancing loss weight (default %(default)s)")
    r = t.add_argument_group("this invocation")
    r.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda, cuda:N")
    r.add_argument("--amp", choices=["auto", "bf16", "fp16", "none"], default="auto",
                   help="autocast dtype (auto: bf16 on CUDA, none on CPU)")
    r.add_argument("--resume", action=argparse.BooleanOptionalAction, default=True,
                   help="continue from OUT/checkpoint.pt if present (default); --no-resume starts over")
    r.add_argument("--max-minutes", type=float, help="stop cleanly with a checkpoint before this much wall time")
    r.add_argument("--stop-at", type=_positive_int, help="stop with a checkpoint after this many total steps")
    r.add_argument("--experts-impl", choices=["grouped_mm", "batched_mm", "eager"],
                   help="transformers' routed-experts implementation (default: eager on CPU, which is "
                        "bitwise reproducible; transformers' default, grouped_mm, on CUDA)")
    r.add_argument("--compile", action="store_true", help="torch.compile the model (experimental)")
    r.add_argument("--deterministic", action="store_true", help="deterministic CUDA kernels (slower)")
    r.add_argument("--no-progress", action="store_true", help="no progress bar")
    r.add_argument("--json", action="store_true", help="print the result as JSON")
    t.set_defaults(func=run_train)


def _csv(s: str | None, conv=str):
    if not s:
        return None
    try:
        return tuple(conv(x.strip()) for x in s.split(",") if x.strip())
    except ValueError:
        raise UserError(f"cannot parse the list {s!r}") from None


def run_train(args) -> int:
    t0 = time.monotonic()
    from pwruntime.demo.model import ModelSpec
    from pwruntime.demo.train import RunOptions, TrainConfig, train

    spec = ModelSpec(vocab_size=args.vocab_size, hidden_size=args.hidden_size, num_hidden_layers=args.layers,
                     num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, num_experts=args.experts,
                     num_experts_per_tok=args.top_k, moe_intermediate_size=args.moe_intermediate,
                     shared_expert_intermediate_size=args.shared_intermediate,
                     router_aux_loss_coef=args.aux_loss_coef)
    if spec.num_experts_per_tok > spec.num_experts or spec.num_attention_heads % spec.num_key_value_heads \
            or spec.hidden_size % spec.num_attention_heads:
        raise UserError("need top-k <= experts, heads divisible by kv-heads and hidden-size divisible by heads")
    for flag, value in (("--lr", args.lr), ("--max-minutes", args.max_minutes)):
        if value is not None and value <= 0:
            raise UserError(f"{flag} must be positive, got {value}")
    for flag, value in (("--warmup-steps", args.warmup_steps), ("--weight-decay", args.weight_decay),
                        ("--aux-loss-coef", args.aux_loss_coef)):
        if value < 0:
            raise UserError(f"{flag} must be >= 0, got {value}")
    check_seed(args.seed)
    out = check_output(args.out)
    fresh = not out.exists()
    cfg = TrainConfig(model=spec, domains=_csv(args.domains), domain_mix=args.domain_mix,
                      domain_weights=_csv(args.domain_weights, float),
                      seed=args.seed, steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len,
                      lr=args.lr, warmup_steps=args.warmup_steps, weight_decay=args.weight_decay,
                      log_every=args.log_every, eval_every=args.eval_every, ckpt_every=args.ckpt_every,
                      save_dtype=args.save_dtype)
    opts = RunOptions(device=args.device, amp=args.amp, resume=args.resume, max_minutes=args.max_minutes,
                      stop_at=args.stop_at, progress=not args.no_progress, experts_impl=args.experts_impl,
                      compile=args.compile, deterministic=args.deterministic, start_time=t0)
    echo = (lambda s: print(s, file=sys.stderr)) if args.json else print
    try:
        res = train(args.corpus, out, cfg, opts, echo=echo)
    except UserError:
        if fresh and not (out / "checkpoint.pt").exists():  # refused before training: no half-made run folder
            shutil.rmtree(out, ignore_errors=True)
        raise
    if args.json:
        print(json.dumps(dataclasses.asdict(res), indent=2))
    return 0


def _register_stats(sub) -> None:
    s = sub.add_parser("stats", help="validation perplexity vs unigram baseline, routing statistics and plots",
                       description="Evaluate a demo-format model on CORPUS/<domain>/valid.txt.gz: perplexity per "
                                   "domain next to unigram baselines, routing mass per layer and domain "
                                   "(stats.json, PNGs).")
    s.add_argument("--model", required=True, help="HuggingFace model folder (e.g. RUN/model)")
    s.add_argument("--corpus", required=True, help="folder with <domain>/{train,valid}.txt.gz")
    s.add_argument("--out", required=True, help="folder for stats.json and the PNG plots")
    s.add_argument("--seq-len", type=_positive_int, default=512, help="evaluation window (default 512)")
    s.add_argument("--max-eval-tokens", type=_positive_int, help="cap on validation tokens per domain")
    s.add_argument("--routing-tokens", type=_positive_int, default=8192,
                   help="validation tokens per domain for routing statistics (default 8192)")
    s.add_argument("--layer", type=int, help="layer of the single-layer plot (default: most domain-dependent)")
    s.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:N")
    s.add_argument("--batch-size", type=_positive_int, default=16, help="windows per forward (default 16)")
    s.add_argument("--no-progress", action="store_true", help="no progress bar")
    s.add_argument("--json", action="store_true", help="print stats.json to stdout")
    s.set_defaults(func=run_stats)


def run_stats(args) -> int:
    from pwruntime.demo.stats import evaluate_model, load_hf, plot_grid, plot_layer
    from pwruntime.demo.tokenizer_train import EOS, load_tokenizer
    from pwruntime.demo.train import resolve_device

    mdir = Path(args.model)
    if not (mdir / "config.json").is_file() or not (mdir / "tokenizer.json").is_file():
        raise UserError(f"{mdir} is not a model folder (needs config.json, tokenizer.json and safetensors)")
    if (mdir / "ap_config.json").is_file():
        raise UserError(f"{mdir} is an AP checkpoint (`pwruntime quantize` output); demo stats needs the "
                        "full-precision model folder (e.g. RUN/model of `pwruntime demo train`)")
    try:
        eos = load_tokenizer(mdir).token_to_id(EOS)
    except Exception as e:  # tokenizers raises its own error types for a malformed file
        raise UserError(f"cannot load {mdir / 'tokenizer.json'}: {e}; restore it from the model folder") from None
    if eos is None:
        raise UserError(f"{mdir} is not a demo-format model (its tokenizer has no {EOS} token); demo stats evaluates "
                        "models written by `pwruntime demo train`")
    device = resolve_device(args.device)
    out = check_output(args.out)
    model, tok = load_hf(mdir, device)
    stats = evaluate_model(model, tok, args.corpus, seq_len=args.seq_len, max_eval_tokens=args.max_eval_tokens,
                           routing_tokens=args.routing_tokens, device=device, batch_size=args.batch_size,
                           progress=not args.no_progress)
    n_layers = len(stats["routing"]["layers"])
    layer = stats["most_domain_dependent_layer"] if args.layer is None else args.layer
    if not 0 <= layer < n_layers:
        raise UserError(f"--layer {layer} is out of range: the model has {n_layers} MoE layers")
    out.mkdir(parents=True, exist_ok=True)
    stats["plot_layer"] = layer
    stats["model"] = str(mdir)
    stats["command"] = " ".join(["pwruntime", "demo", "stats", "--model", str(mdir), "--corpus", str(args.corpus),
                                 "--out", str(out), "--seq-len", str(args.seq_len),
                                 "--routing-tokens", str(args.routing_tokens)]
                                + (["--max-eval-tokens", str(args.max_eval_tokens)] if args.max_eval_tokens else []))
    plot_layer(stats, layer, out / f"routing_layer{layer}.png")
    plot_grid(stats, out / "routing_all_layers.png")
    write_json_atomic(out / "stats.json", stats)
    if args.json:
        print(json.dumps(stats, indent=2))
        return 0
    print(f"{'domain':<12}{'model ppl':>12}{'unigram':>12}{'unigram(pooled)':>18}{'tokens':>10}")
    for d, p in stats["perplexity"].items():
        print(f"{d:<12}{p['model']:>12.2f}{p['unigram']:>12.2f}{p['unigram_pooled']:>18.2f}{p['tokens']:>10}")
    print("layer  max/min(all)  entropy(all)  mean JSD between domains")
    for rec in stats["routing"]["layers"]:
        im = rec["imbalance"]["all"]
        r = "inf" if im["max_min_ratio"] is None else f"{im['max_min_ratio']:.2f}"
        print(f"{rec['layer']:>5}  {r:>12}  {im['normalized_entropy']:>12.3f}  {rec['mean_jsd']:.4f}")
    print(f"wrote {out / 'stats.json'}, {out / f'routing_layer{layer}.png'}, {out / 'routing_all_layers.png'}")
    return 0
