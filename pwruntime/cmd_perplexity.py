"""`pwruntime perplexity`: sliding-window perplexity of a model over a text file (.txt or .txt.gz).

Windows follow the usual HuggingFace recipe: the whole file is tokenized once (with the tokenizer's
special tokens, e.g. one BOS at the start); windows of `--context` tokens start every `--stride` tokens;
each window scores only the tokens that no earlier window scored (so overlapping windows give later
tokens up to context - stride tokens of left context), and a window's first token, which has no
context inside the window, is never scored. perplexity = exp(sum of NLL / number of scored tokens).
Each window runs as one prefill through model.forward with a trivial block table.
"""
from __future__ import annotations

import argparse
import gzip
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from traces.clikit import UserError, check_counts


@dataclass(frozen=True)
class PerplexityResult:
    perplexity: float
    nll: float              # mean negative log-likelihood per scored token (nats)
    tokens: int             # scored tokens
    windows: int
    text_tokens: int        # tokens of the (possibly truncated) text
    context: int
    stride: int


def default_model_dir() -> Path | None:
    """The bundled demo model (pwruntime/demo_model), used when --model is omitted."""
    path = Path(__file__).resolve().parent / "demo_model"
    return path if (path / "config.json").is_file() else None


def read_text(path: str | Path) -> str:
    p = Path(path)
    if not p.is_file():
        what = "is a directory" if p.is_dir() else "does not exist"
        raise UserError(f"data file {p} {what}: pass a UTF-8 text file (.txt or .txt.gz) with --data")
    try:
        if p.suffix == ".gz":
            with gzip.open(p, "rt", encoding="utf-8") as f:
                return f.read()
        return p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError, EOFError) as e:
        raise UserError(f"cannot read {p} as UTF-8 text{' (gzip)' if p.suffix == '.gz' else ''}: {e}") from None


def window_targets(n: int, context: int, stride: int) -> list[tuple[int, int, int]]:
    """(begin, end, first_scored) per window over n tokens: the window is ids[begin:end] and it scores
    absolute positions first_scored .. end-1 (each predicted from the tokens before it in the window)."""
    out, prev_end = [], 0
    for begin in range(0, n, stride):
        end = min(begin + context, n)
        first = max(prev_end, begin + 1)
        if first < end:
            out.append((begin, end, first))
        prev_end = end
        if end == n:
            break
    return out


def sliding_window_perplexity(model, ids: list[int], context: int, stride: int, block_size: int = 16,
                              progress: bool = True) -> PerplexityResult:
    import torch
    from tqdm import tqdm

    from pwruntime.model.attention_plan import prefill_metadata

    windows = window_targets(len(ids), context, stride)
    if not windows:
        raise UserError(f"the text has {len(ids)} token(s); perplexity needs at least 2: pass a longer text")
    kv = model.new_kv_cache(-(-context // block_size), block_size)
    all_ids = torch.tensor(ids, dtype=torch.int64)
    nll_sum, count = 0.0, 0
    for begin, end, first in tqdm(windows, desc="perplexity", unit="window", disable=None if progress else True):
        window = all_ids[begin:end]
        meta = prefill_metadata(end - begin, block_size, model.device)
        hidden = model.forward(window, torch.arange(end - begin), kv, meta).hidden
        rows = hidden[first - 1 - begin:end - 1 - begin]           # position t-1 predicts token t
        targets = all_ids[first:end].to(hidden.device)
        for s in range(0, rows.shape[0], 512):                        # bound the [rows, vocab] logits
            logp = torch.log_softmax(model.logits(rows[s:s + 512]), dim=-1)
            nll_sum -= float(logp.gather(1, targets[s:s + 512, None]).double().sum())
        count += end - first
    mean = nll_sum / count
    return PerplexityResult(math.exp(mean), mean, count, len(windows), len(ids), context, stride)


def register(subparsers) -> None:
    p = subparsers.add_parser("perplexity", help="sliding-window perplexity of a model over a text file",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="HuggingFace checkpoint directory (config.json, *.safetensors, tokenizer.json; "
                                   "default: the bundled demo model)")
    p.add_argument("--data", required=True, help="UTF-8 text file, optionally gzip-compressed (.gz)")
    p.add_argument("--context", type=int, default=None,
                   help="window length in tokens (default: 2048, or the model's max positions if smaller)")
    p.add_argument("--stride", type=int, default=None, help="tokens between window starts (default context/2)")
    p.add_argument("--max-tokens", type=int, default=None, help="use only the first N tokens of the text")
    p.add_argument("--dtype", default="auto", choices=["auto", "fp32", "fp16", "bf16"],
                   help="weights/activations dtype (auto: fp32 on cpu, bf16 on cuda)")
    p.add_argument("--device", default="auto", help="cpu, cuda or cuda:N (auto: cuda if available)")
    p.add_argument("--block-size", type=int, default=16, help="KV cache block size (default 16)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def _resolve(args) -> tuple[Path, str, str]:
    import torch

    model = args.model or default_model_dir()
    if model is None:
        raise UserError("--model DIR is required (there is no bundled demo model yet)")
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = args.dtype if args.dtype != "auto" else ("fp32" if device == "cpu" else "bf16")
    if args.context is not None and args.context < 2:
        raise UserError(f"--context must be at least 2, got {args.context}")
    if args.context is not None and args.stride is not None and not 1 <= args.stride <= args.context:
        raise UserError(f"--stride must be between 1 and --context ({args.context}), got {args.stride}")
    if args.stride is not None and args.stride < 1:
        raise UserError(f"--stride must be at least 1, got {args.stride}")
    if args.max_tokens is not None and args.max_tokens < 2:
        raise UserError(f"--max-tokens must be at least 2, got {args.max_tokens}")
    check_counts(("--block-size", args.block_size))
    return Path(model), device, dtype


def run(args) -> int:
    from pwruntime.model import load_model

    model_dir, device, dtype = _resolve(args)
    text = read_text(args.data)
    if not text.strip():
        raise UserError(f"data file {args.data} holds no text: pass a text file with at least two tokens to --data")
    model = load_model(model_dir, dtype=dtype, device=device)
    context = args.context if args.context is not None else min(2048, model.config.max_position)
    if context > model.config.max_position:
        raise UserError(f"--context {context} exceeds the model's max_position_embeddings "
                        f"{model.config.max_position}: use a smaller --context")
    if args.stride is not None and args.stride > context:
        raise UserError(f"--stride {args.stride} exceeds the context of {context} tokens: use a smaller --stride")
    stride = args.stride if args.stride is not None else max(1, context // 2)
    ids = model.tokenizer.encode(text)
    if args.max_tokens is not None:
        ids = ids[:args.max_tokens]
    start = time.perf_counter()
    result = sliding_window_perplexity(model, ids, context, stride, args.block_size)
    seconds = time.perf_counter() - start
    if args.json:
        out = {**asdict(result), "model": str(model_dir), "data": str(args.data), "dtype": dtype,
               "device": device, "seconds": round(seconds, 3)}
        json.dump(out, sys.stdout)
        sys.stdout.write("\n")
    else:
        print(f"perplexity {result.perplexity:.4f} (nll {result.nll:.4f}) over {result.tokens} tokens in "
              f"{result.windows} windows of {result.context} (stride {result.stride}), {dtype} on {device}, "
              f"{seconds:.1f}s")
    return 0
