"""`pwruntime generate`: generate text for one or more prompts (continuously batched together).

Sampling is greedy unless --temperature > 0. With --seed, every prompt draws its random numbers from that seed
(pwruntime.sampling.RequestDraws), so a prompt's random draws do not depend on the other prompts (its logits may,
in their last bits: pwruntime.sampling).
Generation stops at the end-of-sequence token (unless --ignore-eos), at a --stop string (the text
is cut before it) or after --max-tokens tokens. With --logprobs N, the JSON output carries each token's
log-probability and the N most likely tokens (of the model's raw distribution, before temperature, top-k, top-p).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

from policies.memory_budget import LUT_ROOMS
from traces.clikit import UserError, check_counts, check_seed


def register(subparsers) -> None:
    p = subparsers.add_parser("generate", help="generate text for one or more prompts",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt", action="append", required=True, help="prompt text; repeat for several prompts")
    p.add_argument("--max-tokens", type=int, default=64, help="most tokens to generate per prompt (default 64)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0 = all)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    p.add_argument("--min-p", type=float, default=0.0,
                   help="keep tokens at least this share as likely as the most likely one (0 = off)")
    p.add_argument("--seed", type=int, default=None, help="per-prompt sampling seed (default: derived from 0)")
    p.add_argument("--stop", action="append", default=[], help="stop string; repeat for several")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")
    p.add_argument("--logprobs", type=int, default=None, metavar="N",
                   help="with --json: each token's log-probability and those of the N most likely tokens")
    add_engine_args(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def add_engine_args(p) -> None:
    """The model, engine and planner options `generate`, `serve` and `replay` share."""
    p.add_argument("--model", help="HuggingFace checkpoint directory (default: the bundled demo model)")
    p.add_argument("--dtype", default="auto", choices=["auto", "fp32", "fp16", "bf16"],
                   help="weights/activations dtype (auto: fp32 on cpu, bf16 on cuda)")
    p.add_argument("--device", default="auto", help="cpu, cuda or cuda:N (auto: cuda if available)")
    p.add_argument("--block-size", type=int, default=16, help="KV cache block size in tokens (default 16)")
    p.add_argument("--num-kv-blocks", type=int, default=None, help="KV cache blocks (default: from free memory)")
    p.add_argument("--max-num-seqs", type=int, default=32, help="most sequences per batch (default 32)")
    p.add_argument("--max-num-batched-tokens", type=int, default=512, help="token budget per step (default 512)")
    p.add_argument("--max-model-len", type=int, default=None, metavar="N",
                   help="positions a request may use, prompt and output (default: the model's); longer prompts are "
                        "refused, outputs stop there")
    p.add_argument("--enable-prefix-caching", action="store_true",
                   help="share the cached KV blocks of a common prompt prefix between requests (default off)")
    p.add_argument("--hybrid-kv-cache", action=argparse.BooleanOptionalAction, default=True,
                   help="give a model's sliding-window and global layers KV block tables of their own, so sliding "
                        "layers hand back what leaves their window (Gemma 4; vLLM's hybrid KV cache manager; with "
                        "--enable-prefix-caching a prefix hit needs only a sliding window's blocks); a model without "
                        "sliding layers keeps one table either way (default on; --no-hybrid-kv-cache: one table)")
    p.add_argument("--no-cuda-graphs", action="store_true",
                   help="run every step eagerly on CUDA (default: replay captured graphs when the experts allow)")
    p.add_argument("--no-mixed-graphs", action="store_true",
                   help="run steps that are not pure decode eagerly (default: piecewise graphs per token bucket)")
    p.add_argument("--async-scheduling", action="store_true",
                   help="schedule and launch the next step before the last one's tokens reach the host, so host "
                        "work overlaps the GPU's; tokens show a step later (default off)")
    p.add_argument("--lut-room", choices=LUT_ROOMS, default="slack",
                   help="where an offload's lower-bitwidth LUT finds room while the planes it replaces are still on "
                        "the GPU: the --gpu-memory-budget's allocator slack (default), or the KV pool, shrunk over free "
                        "blocks for it and grown again when the offload lands (before session 38)")
    w = p.add_argument_group("any-precision experts and a planner (CUDA: AP kernels, planes paged on a copy "
                             "stream; CPU: the pure-torch AP store)")
    w.add_argument("--ap", default=None, metavar="DIR",
                   help="serve the routed experts from this AP checkpoint (`pwruntime quantize`) instead of --model")
    w.add_argument("--policy", default="noop",
                   help="planner that moves expert bits under KV pressure (`pwsim policies` lists them), or one of "
                        "your own as MODULE:CLASS or FILE.py:CLASS (default noop)")
    w.add_argument("--policy-arg", action="append", default=[], metavar="K=V", help="planner parameter (repeatable)")
    w.add_argument("--calibration", default=None, metavar="DIR",
                   help="the model's `pwruntime calibrate` output (checked against the model's fingerprint), or "
                        "synthetic[:S]: a synthetic calibration of the model's shape, seed S (default 0), as `pwsim "
                        "run --calibration synthetic:S` makes it (for a dummy checkpoint, `quantize --load-format "
                        "dummy`)")
    w.add_argument("--plane-arena", action=argparse.BooleanOptionalAction, default=None,
                   help="keep the expert planes and LUTs in memory the store maps itself and keeps dense, so that what "
                        "offloads free goes back to the device for the KV cache (pwruntime.plane_arena) and the "
                        "process holds its budget; --no-plane-arena leaves them to torch's caching allocator, which "
                        "keeps what offloads free (less host time moving pages, more memory held: the README's "
                        "results). Default: on for AP experts on CUDA")
    w.add_argument("--prefill-chunk", default=None, metavar="SIZE",
                   help="dequantized expert weights a prefill's MoE layer holds at once on CUDA (default 1GiB): a "
                        "layer whose experts take more runs them in several chunks, a larger SIZE in fewer (Gemma-4-"
                        "26B-A4B's 128 experts take 1.52 GB in bf16; 2GiB runs each of its layers in one), at the "
                        "price of that much more activation memory, which the activation reserve measures")
    w.add_argument("--gpu-memory-budget", default=None, metavar="SIZE",
                   help="memory for the model's weights and the KV cache together, as `pwsim run --budget` (e.g. "
                        "48MiB, 20GiB): the KV pool starts with what the weights (the routed experts at the policy's "
                        "starting bits) and the allocator's slack leave, and grows as the planner offloads planes "
                        "(instead of --num-kv-blocks)")
    w.add_argument("--activation-reserve", default="auto", metavar="auto|SIZE",
                   help="memory a KV pool sized from device memory (--gpu-memory-budget, else the GPU's free memory) "
                        "leaves a step's activations: auto (default) measures it by a profiling forward of the largest "
                        "step, as vLLM does (0 off CUDA); a SIZE sets it (as `pwsim run --activation-reserve`)")


def _load(args, dtype: str, device: str):
    """(model, page table or None, policy, calibration or None, page mover or None) for full-precision or AP
    experts. On CUDA, AP experts are served by a DeviceExpertStore (the kernels) paging from a pinned host
    master through a CudaPageMover; elsewhere by the pure-torch APExpertStore."""
    import torch

    import policies
    from pwruntime.model import load_model

    try:
        policy = policies.get(args.policy, **policies.parse_policy_args(args.policy, args.policy_arg))
    except ValueError as e:
        raise UserError(str(e)) from None
    if args.ap is not None and args.model:
        raise UserError("give --model or --ap, not both: --ap DIR serves that AP checkpoint, which carries its own "
                        "non-expert weights and tokenizer")
    if args.ap is None:
        if args.plane_arena is True:
            raise UserError("--plane-arena keeps AP expert planes: it needs --ap DIR")
        if args.prefill_chunk is not None:
            raise UserError("--prefill-chunk sizes the dequantized AP experts of a prefill: it needs --ap DIR")
        if args.lut_room == "pool":
            raise UserError("--lut-room pool places the LUTs of AP expert offloads, which --model's full-precision "
                            "experts never make: it needs --ap DIR")
        if args.calibration:
            raise UserError("--calibration needs --ap (the planner moves the bits of AP expert weights)")
        if args.policy != "noop":
            raise UserError(f"--policy {args.policy} needs --ap DIR (the planner moves the bits of AP expert weights; "
                            "--model's experts are full precision): make one with `pwruntime quantize`")
        return load_model(engine_model_dir(args), dtype=dtype, device=device), None, policy, None, None
    from pwruntime.kernels.device_table import MIN_BITS
    from pwruntime.quant.store import load_ap_model

    cuda = torch.device(device).type == "cuda"
    if args.plane_arena is True and not cuda:
        raise UserError("--plane-arena needs a CUDA device (elsewhere the pure-torch AP store serves the experts): "
                        "drop it or add --device cuda")
    chunk = _prefill_chunk(args.prefill_chunk, cuda)
    model, store = load_ap_model(args.ap, dtype=dtype, device=device, expert_device="cpu" if cuda else None)
    c = model.config
    # the GPU kernels keep planes 0..2 of a block together (nibble-packed), so on CUDA blocks stay at >= 3 bits
    bits = tuple(b for b in store.bits if b >= MIN_BITS) if cuda else store.bits
    if not bits:
        raise UserError(f"{args.ap} stores only {store.bits}-bit LUTs; the GPU kernels need 3..8 bits "
                        "(quantize again with --bits 3..8)")
    table = policies.PageTable(c.num_moe_layers or c.layers, c.experts, c.hidden, c.expert_intermediate, bits=bits)
    mover = None
    if cuda:
        from pwruntime.device_store import DeviceExpertStore
        from pwruntime.page_mover import CudaPageMover

        model.experts = DeviceExpertStore.from_ap_store(store, device=model.device, dtype=model.dtype, table=table,
                                                        arena=args.plane_arena is not False, **chunk)
        mover = CudaPageMover(model.experts)
    else:
        store.attach_table(table)  # the store reads the committed bits q on every call
    return model, table, policy, _calibration(args.calibration, table, args.ap), mover


def _prefill_chunk(size: str | None, cuda: bool) -> dict[str, int]:
    """The DeviceExpertStore's `prefill_chunk_bytes` from `--prefill-chunk` ({} when not given)."""
    from traces.sizes import parse_size

    if size is None:
        return {}
    chunk_bytes = parse_size(size, flag="--prefill-chunk")
    if not cuda:
        raise UserError("--prefill-chunk sizes the CUDA kernels' dequantized experts (elsewhere the pure-torch AP "
                        "store serves them): drop it or add --device cuda")
    return {"prefill_chunk_bytes": chunk_bytes}


def _calibration(source: str | None, table, ap_dir: str):
    """The planner's calibration: `--calibration DIR` (checked against the model), `synthetic[:S]`
    (policies.synthetic, seed S or 0, as `pwsim run --calibration synthetic:S` makes it for the same model), or
    none."""
    from policies.calibration import Calibration
    from policies.synthetic import synthetic_calibration, synthetic_seed
    from pwruntime.calibrate.inputs import model_fingerprint_of

    if not source:
        return None
    try:
        seed = synthetic_seed(source, default=0)
    except ValueError as e:
        raise UserError(f"--calibration: {e}") from None
    if seed is not None:
        return synthetic_calibration(table, seed=seed)
    return Calibration.load(source, expect_fingerprint=model_fingerprint_of(ap_dir))


def _params(args):
    from pwruntime.sampling import SamplingParams

    try:
        return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                              top_p=args.top_p, min_p=args.min_p, seed=args.seed, stop=tuple(args.stop),
                              ignore_eos=args.ignore_eos,
                              logprobs=args.logprobs)
    except ValueError as e:
        raise UserError(f"bad sampling option: {e}") from None


def _engine_config(args):
    from pwruntime.engine import EngineConfig
    from traces.sizes import parse_size

    check_counts(("--block-size", args.block_size), ("--max-num-seqs", args.max_num_seqs),
                 ("--max-num-batched-tokens", args.max_num_batched_tokens), ("--num-kv-blocks", args.num_kv_blocks))
    budget = None
    if args.gpu_memory_budget is not None:
        if args.num_kv_blocks is not None:
            raise UserError("give --gpu-memory-budget or --num-kv-blocks, not both: the budget sizes the KV pool")
        if args.ap is None:
            raise UserError("--gpu-memory-budget needs --ap DIR (the budget counts the AP experts at the planner's "
                            "bits); for --model's full-precision experts set --num-kv-blocks")
        budget = parse_size(args.gpu_memory_budget, flag="--gpu-memory-budget")
    reserve = None
    if args.activation_reserve != "auto":
        if args.num_kv_blocks is not None:
            raise UserError("--activation-reserve is what a pool sized from memory leaves activations; "
                            "--num-kv-blocks sizes it in blocks: give one of them")
        try:
            reserve = parse_size(args.activation_reserve, allow_zero=True)
        except UserError as e:
            raise UserError(f"--activation-reserve: {e} (or auto)") from None
    return EngineConfig(block_size=args.block_size, num_kv_blocks=args.num_kv_blocks, gpu_memory_budget=budget,
                        max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                        max_num_batched_tokens=args.max_num_batched_tokens, cuda_graphs=not args.no_cuda_graphs,
                        mixed_cuda_graphs=not args.no_mixed_graphs, prefix_caching=args.enable_prefix_caching,
                        hybrid_kv_cache=args.hybrid_kv_cache,
                        async_scheduling=args.async_scheduling, lut_room=args.lut_room, activation_reserve=reserve)


def engine_model_dir(args) -> Path:
    """The folder the shared options (add_engine_args) serve: --ap, else --model, else the bundled demo model."""
    from pwruntime.cmd_perplexity import default_model_dir

    model_dir = args.ap or args.model or default_model_dir()
    if model_dir is None:
        raise UserError("--model DIR is required (no bundled demo model is installed): pass a HuggingFace "
                        "MoE checkpoint directory")
    return Path(model_dir)


def build_engine(args, recorder=None):
    """(engine, model path, dtype, device) from the shared options (add_engine_args); `recorder`: a TraceRecorder
    the engine feeds."""
    import torch

    from pwruntime.cuda_memory import use_expandable_segments
    from pwruntime.engine import LLMEngine

    config = _engine_config(args)
    model_dir = engine_model_dir(args)
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda"):
        use_expandable_segments()  # before the weights and the KV cache take their memory (pwruntime.cuda_memory)
    dtype = args.dtype if args.dtype != "auto" else ("fp32" if device == "cpu" else "bf16")
    model, table, policy, cal, mover = _load(args, dtype, device)
    engine = LLMEngine(model, config, policy=policy, table=table, calibration=cal, mover=mover, recorder=recorder)
    builds, seconds = engine.compile_kernels()
    if seconds > 1.0:
        print(f"compiled {builds} CUDA kernel builds in {seconds:.1f} s (CuPy keeps them on disk for the next start)",
              file=sys.stderr)
    if mover is not None:
        engine.apply_starting_bits(mover.store)  # the policy's initial bits reach the device before the first request
    return engine, model_dir, dtype, device


def run(args) -> int:
    check_seed(args.seed)
    if args.logprobs is not None and not args.json:
        raise UserError("--logprobs N is reported in the JSON output: add --json")
    params = _params(args)
    engine, model_dir, dtype, device = build_engine(args)
    table, policy = (engine.table if args.ap else None), engine.policy
    start_bits = engine.table.mean_bits()
    start = time.perf_counter()
    outputs = engine.generate(args.prompt, params, use_tqdm=len(args.prompt) > 1 and not args.json)
    seconds = time.perf_counter() - start
    generated = sum(len(o.token_ids) for o in outputs)
    if args.json:
        json.dump({
            "model": str(model_dir), "dtype": dtype, "device": device,
            "outputs": [{"prompt": o.prompt, "text": o.text, "token_ids": o.token_ids,
                         "prompt_tokens": len(o.prompt_token_ids), "finish_reason": o.finish_reason,
                         "num_preemptions": o.num_preemptions,
                         **({"logprobs": [asdict(r) for r in o.logprobs]} if args.logprobs is not None else {})}
                        for o in outputs],
            "stats": {"steps": engine.num_steps, "generated_tokens": generated, "seconds": round(seconds, 3),
                      "kv_blocks": engine.pool.capacity, "block_size": engine.pool.block_size,
                      "hybrid_kv_cache": engine.kv_layout.hybrid, "activation_reserve": engine.activation_reserve,
                      "preemptions": engine.scheduler.num_preemptions, "policy": policy.name,
                      "prefix_cache_hit_tokens": engine.scheduler.num_cached_tokens,
                      "tokens_per_s": round(generated / seconds, 1) if seconds > 0 else None,
                      "cuda_graph_replays": engine.runner.graphs.replays if engine.runner.graphs else 0,
                      "mixed_graph_replays": engine.runner.mixed_graphs.replays if engine.runner.mixed_graphs else 0,
                      "plans": engine.loop.num_plans, "mean_bits_start": round(start_bits, 4),
                      "mean_bits_end": round(engine.table.mean_bits(), 4),
                      "expert_bytes_end": engine.table.resident_bytes() if table is not None else None,
                      "page_moves": engine.loop.mover.metrics() if hasattr(engine.loop.mover, "metrics") else None},
        }, sys.stdout)
        sys.stdout.write("\n")
    else:
        for i, o in enumerate(outputs):
            if len(outputs) > 1:
                print(f"--- prompt {i} ({o.finish_reason}, {len(o.token_ids)} tokens)")
            print(o.text)
        print(f"{generated} tokens in {seconds:.2f}s ({engine.num_steps} steps, {dtype} on {device})", file=sys.stderr)
    return 0
