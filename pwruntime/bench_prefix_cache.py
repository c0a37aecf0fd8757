"""`pwruntime bench prefix-cache`: one batch of prompts that share a long prefix, served with prefix caching off and on.

Both engines run the same model in one process, each after a warm-up batch of unrelated prompts (CUDA graph
captures and first launches happen there), in alternating rounds. Reported per round and setting: the batch's wall
time and output tokens per second, the time to first token (median and largest), the prompt tokens taken from the
cache, and how many greedy outputs equal those of the plain engine (in fp16 and fp32 all of them; bf16 kernels are
not batch-invariant, so a cached prefix, like a change of the batch's token budget, can turn a few).
"""
from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import torch

from pwruntime.engine import EngineConfig, LLMEngine
from pwruntime.sampling import SamplingParams

SHARED_PREFIX = (
    "And God said unto Moses, I AM THAT I AM: and he said, Thus shalt thou say unto the children of Israel, I AM hath "
    "sent me unto you. And God said moreover unto Moses, Thus shalt thou say unto the children of Israel, The LORD God "
    "of your fathers, the God of Abraham, the God of Isaac, and the God of Jacob, hath sent me unto you: this is my name "
    "for ever, and this is my memorial unto all generations. Go, and gather the elders of Israel together, and say unto "
    "them, The LORD God of your fathers, the God of Abraham, of Isaac, and of Jacob, appeared unto me, saying, I have "
    "surely visited you, and seen that which is done to you in Egypt: And I have said, I will bring you up out of the "
    "affliction of Egypt unto the land of the Canaanites.")


@dataclass(frozen=True)
class RoundResult:
    caching: bool
    seconds: float
    output_tokens_per_s: float
    ttft_p50_ms: float
    ttft_max_ms: float
    hit_tokens: int
    same_outputs: int  # greedy outputs equal to the first plain round's


def prompts(n: int) -> list[str]:
    return [f"{SHARED_PREFIX} Question {i}:" for i in range(n)]


def sync_device(device: torch.device) -> None:
    """Wait for the device's queued work (nothing on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _round(model, caching: bool, texts: list[str], params: SamplingParams, blocks: int,
           reference: list[list[int]] | None) -> tuple[RoundResult, list[list[int]]]:
    engine = LLMEngine(model, EngineConfig(num_kv_blocks=blocks, prefix_caching=caching))
    engine.compile_kernels()  # every build the timed prompts may launch, not only the warm-up's
    engine.generate([f"warm-up {i}" for i in range(len(texts))], params)
    sync_device(model.device)
    t0 = time.perf_counter()
    outs = engine.generate(texts, params)
    sync_device(model.device)
    wall = time.perf_counter() - t0
    ttft = [1e3 * (o.first_token_time - o.arrival_time) for o in outs]
    tokens = [o.token_ids for o in outs]
    same = sum(a == b for a, b in zip(tokens, reference or tokens))
    res = RoundResult(caching, wall, sum(map(len, tokens)) / wall, statistics.median(ttft), max(ttft),
                      engine.scheduler.num_cached_tokens, same)
    return res, tokens


def run(model, n_prompts: int, max_tokens: int, rounds: int) -> dict:
    """Rounds of (off, on) over `n_prompts` prompts sharing SHARED_PREFIX, `max_tokens` greedy tokens each."""
    texts = prompts(n_prompts)
    lengths = [len(model.tokenizer.encode(t)) for t in texts]
    block_size = EngineConfig.block_size
    blocks = 2 * n_prompts * -(-(max(lengths) + max_tokens) // block_size) + 16
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    reference: list[list[int]] | None = None
    rows = []
    for _ in range(rounds):
        for caching in (False, True):
            res, tokens = _round(model, caching, texts, params, blocks, reference)
            reference = reference or tokens
            rows.append(asdict(res))
    return {"prompts": n_prompts, "max_tokens": max_tokens, "prefix_tokens": len(model.tokenizer.encode(SHARED_PREFIX)),
            "prompt_tokens": sum(lengths), "rounds": rows}


def print_table(res: dict) -> None:
    print(f"{res['prompts']} prompts sharing a {res['prefix_tokens']}-token prefix ({res['prompt_tokens']} prompt "
          f"tokens), {res['max_tokens']} new tokens each; {res['device']}, {res['dtype']}")
    print(f"{'caching':>8} {'seconds':>8} {'out tok/s':>10} {'TTFT p50 ms':>12} {'TTFT max ms':>12} {'hit tokens':>11} "
          f"{'same outputs':>13}")
    for r in res["rounds"]:
        print(f"{'on' if r['caching'] else 'off':>8} {r['seconds']:8.3f} {r['output_tokens_per_s']:10.0f} "
              f"{r['ttft_p50_ms']:12.1f} {r['ttft_max_ms']:12.1f} {r['hit_tokens']:11d} "
              f"{r['same_outputs']:>9}/{res['prompts']}")
