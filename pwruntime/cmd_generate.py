"""`pwruntime generate`: generate text for one or more prompts (continuously batched together).

Sampling is greedy unless --temperature > 0. With --seed, every prompt samples from its own
generator seeded with that value, so a prompt's output does not depend on the other prompts.
Generation stops at the end-of-sequence token (unless --ignore-eos), at a --stop string (the text
is cut before it) or after --max-tokens tokens.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

from traces.clikit import UserError


def register(subparsers) -> None:
    p = subparsers.add_parser("generate", help="generate text for one or more prompts",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="HuggingFace checkpoint directory (default: the bundled demo model, once installed)")
    p.add_argument("--prompt", action="append", required=True, help="prompt text; repeat for several prompts")
    p.add_argument("--max-tokens", type=int, default=64, help="most tokens to generate per prompt (default 64)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0 = all)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    p.add_argument("--seed", type=int, default=None, help="per-prompt sampling seed (default: derived from 0)")
    p.add_argument("--stop", action="append", default=[], help="stop string; repeat for several")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")
    p.add_argument("--dtype", default="auto", choices=["auto", "fp32", "fp16", "bf16"],
                   help="weights/activations dtype (auto: fp32 on cpu, bf16 on cuda)")
    p.add_argument("--device", default="auto", help="cpu, cuda or cuda:N (auto: cuda if available)")
    p.add_argument("--block-size", type=int, default=16, help="KV cache block size in tokens (default 16)")
    p.add_argument("--num-kv-blocks", type=int, default=None, help="KV cache blocks (default: from free memory)")
    p.add_argument("--max-num-seqs", type=int, default=32, help="most sequences per batch (default 32)")
    p.add_argument("--max-num-batched-tokens", type=int, default=512, help="token budget per step (default 512)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def _params(args):
    from pwruntime.sampling import SamplingParams

    try:
        return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                              top_p=args.top_p, seed=args.seed, stop=tuple(args.stop), ignore_eos=args.ignore_eos)
    except ValueError as e:
        raise UserError(f"bad sampling option: {e}") from None


def _engine_config(args):
    from pwruntime.engine import EngineConfig

    for flag, value in (("--block-size", args.block_size), ("--max-num-seqs", args.max_num_seqs),
                        ("--max-num-batched-tokens", args.max_num_batched_tokens)):
        if value < 1:
            raise UserError(f"{flag} must be >= 1, got {value}")
    if args.num_kv_blocks is not None and args.num_kv_blocks < 1:
        raise UserError(f"--num-kv-blocks must be >= 1, got {args.num_kv_blocks}")
    return EngineConfig(block_size=args.block_size, num_kv_blocks=args.num_kv_blocks, max_num_seqs=args.max_num_seqs,
                        max_num_batched_tokens=args.max_num_batched_tokens)


def run(args) -> int:
    import torch

    from pwruntime.cmd_perplexity import default_model_dir
    from pwruntime.engine import LLMEngine
    from pwruntime.model import load_model

    params, config = _params(args), _engine_config(args)
    model_dir = args.model or default_model_dir()
    if model_dir is None:
        raise UserError("--model DIR is required (no bundled demo model is installed): pass a HuggingFace "
                        "MoE checkpoint directory")
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = args.dtype if args.dtype != "auto" else ("fp32" if device == "cpu" else "bf16")
    model = load_model(model_dir, dtype=dtype, device=device)
    engine = LLMEngine(model, config)
    start = time.perf_counter()
    outputs = engine.generate(args.prompt, params, use_tqdm=len(args.prompt) > 1 and not args.json)
    seconds = time.perf_counter() - start
    generated = sum(len(o.token_ids) for o in outputs)
    if args.json:
        json.dump({
            "model": str(model_dir), "dtype": dtype, "device": device,
            "outputs": [{"prompt": o.prompt, "text": o.text, "token_ids": o.token_ids,
                         "prompt_tokens": len(o.prompt_token_ids), "finish_reason": o.finish_reason,
                         "num_preemptions": o.num_preemptions} for o in outputs],
            "stats": {"steps": engine.num_steps, "generated_tokens": generated, "seconds": round(seconds, 3),
                      "kv_blocks": engine.pool.capacity, "block_size": engine.pool.block_size,
                      "preemptions": engine.scheduler.num_preemptions},
        }, sys.stdout)
        sys.stdout.write("\n")
    else:
        for i, o in enumerate(outputs):
            if len(outputs) > 1:
                print(f"--- prompt {i} ({o.finish_reason}, {len(o.token_ids)} tokens)")
            print(o.text)
        print(f"{generated} tokens in {seconds:.2f}s ({engine.num_steps} steps, {dtype} on {device})", file=sys.stderr)
    return 0
