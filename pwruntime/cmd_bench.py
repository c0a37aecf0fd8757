"""`pwruntime bench kernels|prefill|prefix-cache|decode|mixed|plans|kv-resize|step-inputs|serve`: time the AP kernels
against torch fp16 (and write a measured hardware profile), the prefill MoE path against one launch set per expert,
serving with prefix caching, where a decode or mixed step goes, what a plan's transitions cost, what a KV cache resize
costs, the host work of a step's inputs, or a running server from the client's side.

Measures (see pwruntime/kernels/bench.py for the method): pinned H2D/D2H and device copy bandwidth,
an fp16 GEMM, one Mixtral-sized linear-block (AP at 3..8 bits vs fp16 GEMV, T = 1 and 8), whole MoE
layers of Qwen1.5-MoE-A2.7B, Mixtral-8x7B, OLMoE and Qwen3-MoE (T = 1, 4, 16, 64; uniform 3..8 bits
and mixed) against their roofline (active planes + LUT bytes / fp16 GEMV bandwidth) and torch fp16
(per-expert loop, gathered experts + bmm), and paged-attention decode. Prints a table and the command
that reproduces it; `--json` prints the results as JSON, `--out` writes them, `--profile-out` writes
the measured coefficients in the simulator's hardware-profile format (traces/hardware.py).

`bench prefill` times one prefill MoE layer per model shape and prompt size (pwruntime/bench_prefill.py):
the fused kernel in launch sets of 64 tokens and the two dequantize paths (padded groups, torch's grouped
GEMM) against a set of launches per active expert, and the dequantize kernel alone, with a figure next to
`--out`.

`bench prefix-cache` serves one batch of prompts that share a long prefix with the bundled model (or `--model`),
prefix caching off and on, in alternating rounds (pwruntime/bench_prefix_cache.py): wall time, output tokens/s,
time to first token, prompt tokens from the cache, greedy outputs equal to the plain engine's. It runs on CUDA
when there is a GPU, else on the CPU.

`bench decode` brings a batch of sequences (`--prompts`) to steady decoding in an engine built as `generate` builds
it (`--model` or `--ap` with `--calibration` and `--policy`), and reports the step's wall time and engine phases over
`--reps` windows of `--steps` steps and, on CUDA, the kernels of 20 profiled steps (pwruntime/bench_decode.py).

`bench serve` sends a request trace to a running OpenAI-compatible server at its arrival times and times each
streamed request from the client's side, as vLLM's benchmark_serving (pwruntime/bench_serve.py); it writes a result
directory that `pwsim fidelity` reads.

`bench mixed` times a mixed step's forward (`--prompts` decode rows beside one prompt of each `--tokens` size) run
eagerly and from the piecewise graphs, in the same kind of engine (pwruntime/bench_mixed.py).

`bench plans` plays plans that take every block of `--layers` random MoE layers per model shape down to `--bits` and
back through the runtime's plan loop, page mover and expert store, and reports the host time a transition costs at
each boundary and the reloads' copy rate (pwruntime/bench_plans.py). It runs on CUDA when there is a GPU, else on the
CPU.

`bench kv-resize` walks each `--models` card's KV cache through the same seeded sizes in memory it maps itself and as
torch tensors, in alternating rounds (`--reps`, default 2), and reports a resize's host and wall time and the memory
held (pwruntime/bench_kv_resize.py).

`bench step-inputs` times the host work of a seeded step's inputs for each `--models` card, with one KV table and with
hybrid KV groups: a decode step's staging into graph inputs, a mixed step's metadata and its attention plans
(pwruntime/bench_step_inputs.py). It runs on CUDA when there is a GPU, else on the CPU.
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from pwruntime import bench_serve
from traces.clikit import UserError, check_counts, check_output, check_seed, report_bench
from traces.sizes import parse_size

def register(subparsers) -> None:
    p = subparsers.add_parser("bench", help="benchmark kernels on the GPU (writes JSON and a hardware profile)",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("target", choices=["kernels", "prefill", "prefix-cache", "decode", "mixed", "plans", "kv-resize",
                                       "step-inputs", "serve"],
                   help="kernels: the AP kernels and a hardware profile; prefill: the prefill MoE path; prefix-cache: "
                        "a batch sharing a prefix served with prefix caching off and on; decode: a decode step's "
                        "time, phases and kernels; mixed: a mixed step's forward, eager and from piecewise graphs; "
                        "plans: the host time of a plan's offloads and reloads, a transition at a time; "
                        "kv-resize: a KV cache's resizes in mapped memory and as torch tensors; step-inputs: the "
                        "host work of a step's inputs with one KV table and with hybrid groups; "
                        "serve: a request trace sent to a running server, timed by the client")
    p.add_argument("--models", default=None,
                   help="comma-separated model shapes (default: all of qwen1.5-moe-a2.7b, mixtral-8x7b, "
                        "olmoe-1b-7b, qwen3-moe-30b-a3b; also demo and gemma-4-26b-a4b, which plans takes by "
                        "default too; kv-resize: model "
                        "cards, `pwsim models`, default olmoe-1b-7b-0924; step-inputs: cards, default "
                        "Gemma-4-26B-A4B)")
    p.add_argument("--tokens", default=None,
                   help="tokens per step, comma-separated (kernels: decode batches, default 1,4,16,64; prefill: "
                        "prompt tokens above 64, default 128,256,512; mixed: the prompt beside the decode rows, "
                        "default 20,150,488)")
    p.add_argument("--bits", type=int, default=None,
                   help="prefill: every expert block's committed bits; plans: the bits its offloads lower every "
                        "block to (3..7 there), default 4")
    p.add_argument("--layers", type=int, default=None, help="plans: MoE layers of each model shape (default 1)")
    p.add_argument("--prefill-chunk", default=None, metavar="SIZE",
                   help="prefill: the dequantized expert weights a layer holds at once, as the runtime's "
                        "--prefill-chunk (default 1GiB)")
    p.add_argument("--plane-arena", action=argparse.BooleanOptionalAction, default=None,
                   help="plans: the store's planes and LUTs in a plane arena, as the runtime serves AP experts on "
                        "CUDA (default there; --no-plane-arena: torch's allocator, the only choice on the CPU)")
    p.add_argument("--plan-log", default=None, metavar="DIR",
                   help="plans: play the plans a `pwsim run` or `pwruntime replay` made (DIR/plans.parquet) instead "
                        "of round trips, those of its first --layers layers, on the one shape --models names")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default=None,
                   help="activation dtype (kernels: default fp16, also used by the dense torch baselines; prefill: "
                        "activation and dequantized-weight dtype, default bf16, what the runtime serves on CUDA; "
                        "prefix-cache: the model's dtype, default bf16 on CUDA and fp32 on the CPU; fp32 only there)")
    p.add_argument("--reps", type=int, default=None,
                   help="timed graph replays per measurement, median reported (default 30); prefix-cache: rounds "
                        "of (off, on) (default 2); plans: rounds of offloads and reloads (default 5); kv-resize: "
                        "rounds of both backings (default 2); step-inputs: calls a round (default 20)")
    p.add_argument("--prompts", type=int, default=None,
                   help="prefix-cache: prompts in the batch; decode: sequences decoding together (default 32); "
                        "mixed: decode rows beside the prompt (default 24)")
    p.add_argument("--max-tokens", type=int, default=16, help="prefix-cache: greedy tokens per prompt (default 16)")
    p.add_argument("--model", default=None,
                   help="prefix-cache, decode: model directory (default: the bundled demo model)")
    d = p.add_argument_group("decode and mixed (the engine as `pwruntime generate` builds it)")
    d.add_argument("--steps", type=int, default=None, help="decode: engine steps a timed window (default 100)")
    d.add_argument("--prompt-tokens", type=int, default=None, help="decode: tokens a prompt (default 40)")
    d.add_argument("--ap", default=None, metavar="DIR", help="decode: serve the experts from this AP checkpoint")
    d.add_argument("--calibration", default=None, metavar="DIR", help="decode: the AP model's calibration")
    d.add_argument("--policy", default=None, help="decode: the planner (default noop)")
    d.add_argument("--num-kv-blocks", type=int, default=None,
                   help="decode: KV cache blocks (default: what the sequences need, twice over)")
    d.add_argument("--no-cuda-graphs", action="store_true", help="decode: run the decode steps eagerly")
    d.add_argument("--async-scheduling", action="store_true",
                   help="decode: an engine that launches the next step before settling the last (default off)")
    d.add_argument("--temperature", type=float, default=None,
                   help="decode: the sequences sample at this temperature (default 0: greedy)")
    d.add_argument("--top-p", type=float, default=None, help="decode: ... and this nucleus (default 1: none)")
    p.add_argument("--routing", default=None, metavar="uniform|zipf:ALPHA",
                   help="kernels: the MoE layers' routing, uniform (default) or each token's experts drawn with "
                        "popularity 1 / rank^ALPHA (hot experts)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print the results as JSON instead of a table")
    p.add_argument("--out", type=Path, default=None,
                   help="write the results JSON here (serve: the result directory, default runs/bench-serve)")
    p.add_argument("--profile-out", type=Path, default=None,
                   help="write a measured hardware profile here (default: hardware-profile-<device>.json "
                        "next to --out, or in the current directory)")
    p.add_argument("--profile-name", default=None, help="name field of the written profile")
    p.add_argument("--plot-from", type=Path, default=None, metavar="JSON",
                   help="draw the figure of an earlier --out result (no GPU needed) and exit")
    bench_serve.add_args(p)
    p.set_defaults(func=run)


def _replot(src: Path) -> int:
    from pwruntime.kernels.plots import plot_bench
    try:
        res = json.loads(src.read_text())
        if not isinstance(res, dict) or not isinstance(res.get("single_block"), list) \
                or not isinstance(res.get("moe"), list):
            raise ValueError("no single_block and moe rows")  # drawing it would overwrite its PNG with empty axes
        png = plot_bench(res, src.with_suffix(".png"))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"--plot-from {src}: not a `pwruntime bench kernels --out` result ({e})") from None
    print(f"figure: {png}")
    return 0


def _command(fallback: str) -> str:
    """The command that reproduces this run: the arguments as given when run as `pwruntime bench ...`, else
    `fallback` (called from Python)."""
    return "pwruntime " + " ".join(shlex.quote(a) for a in sys.argv[1:]) if sys.argv[1:2] == ["bench"] else fallback


def _with_arena(command: str, arena: str) -> str:
    """`command` with the plane-arena flag it ran with (`arena`) unless it names one: the flags as given may leave the
    choice to the device, and `_command`'s fallbacks leave it to this."""
    return command if arena.split()[0] in command.split() else command + arena


def _int_list(flag: str, text: str) -> tuple[int, ...]:
    try:
        return tuple(int(t) for t in text.split(","))
    except ValueError:
        raise UserError(f"{flag} must be comma-separated integers, got {text!r}") from None


def _refuse(args, names: tuple[str, ...], target: str, takes: str = "") -> None:
    """One clear error for the first option in `names` that was given but does not apply to `bench target`."""
    for name in names:
        if getattr(args, name) is not None:
            raise UserError(f"--{name.replace('_', '-')} does not apply to `pwruntime bench {target}`" + takes)


def _config(args, lo: int, hi: int, default_tokens: str):
    """(BenchConfig, the command that reproduces the run) from the shared options, checked: --models among
    MODEL_SHAPES, by default the four of ARCHS."""
    import torch

    from pwruntime.kernels import bench as kb
    models = tuple(m.strip() for m in args.models.split(",")) if args.models else tuple(kb.ARCHS)
    unknown = [m for m in models if m not in kb.MODEL_SHAPES]
    if unknown:
        raise UserError(f"unknown model shape(s) {unknown}; choose from {', '.join(kb.MODEL_SHAPES)}")
    text = args.tokens or default_tokens
    tokens = _int_list("--tokens", text)
    if any(not lo <= t <= hi for t in tokens):
        raise UserError(f"--tokens must lie in {lo}..{hi} for bench {args.target}, got {text}")
    check_counts(("--reps", args.reps))
    if not torch.cuda.is_available():
        raise UserError(f"pwruntime bench {args.target} needs a CUDA GPU (and CuPy); none is visible here")
    command = _command(f"pwruntime bench {args.target} --models {','.join(models)} --tokens {text} --reps {args.reps}")
    dtype = args.dtype or ("fp16" if args.target == "kernels" else "bf16")
    return kb.BenchConfig(models=models, tokens=tokens, reps=args.reps, seed=args.seed, dtype=dtype,
                          routing=args.routing or "uniform"), command


def _run_prefill(args) -> int:
    bits = 4 if args.bits is None else args.bits
    if not 3 <= bits <= 8:
        raise UserError(f"--bits must lie in 3..8 (the device kernels' range), got {bits}")
    if args.profile_out is not None or args.plot_from is not None:
        raise UserError("--profile-out and --plot-from belong to `pwruntime bench kernels`")
    from pwruntime.device_store import DEFAULT_PREFILL_CHUNK_BYTES
    chunk = parse_size(args.prefill_chunk or DEFAULT_PREFILL_CHUNK_BYTES, flag="--prefill-chunk")
    cfg, command = _config(args, 65, 8192, "128,256,512")
    for flag, value in (("--bits", bits), ("--dtype", args.dtype or "bf16"), ("--prefill-chunk", args.prefill_chunk)):
        if value is not None and flag not in command.split():   # what it ran with, each flag once
            command += f" {flag} {value}"
    import torch
    from tqdm import tqdm

    from pwruntime import bench_prefill as bp
    dtype = cfg.act_dtype
    res: dict = {"device": torch.cuda.get_device_name(), "command": command, "torch": torch.__version__,
                 "bits": bits, "dtype": str(dtype).removeprefix("torch."), "prefill_chunk_bytes": chunk,
                 "reps": args.reps, "rows": []}
    for m in tqdm(cfg.models, desc="bench prefill", file=sys.stderr):
        res["rows"] += bp.prefill_layers(cfg, m, bits, dtype, chunk)
        torch.cuda.empty_cache()
    return report_bench(res, command, args.out, args.json, bp.print_table, bp.plot)


def _run_prefix_cache(args) -> int:
    import torch

    from pwruntime import bench_prefix_cache as bpc
    from pwruntime.cmd_perplexity import default_model_dir
    from pwruntime.model.loader import load_model
    _refuse(args, ("models", "tokens", "profile_out", "plot_from", "routing"), "prefix-cache",
            " (it takes --prompts, --max-tokens, --reps, --dtype, --model, --out, --json)")
    rounds = 2 if args.reps is None else args.reps
    args.prompts = 32 if args.prompts is None else args.prompts
    check_counts(("--prompts", args.prompts), ("--max-tokens", args.max_tokens), ("--reps", rounds))
    cuda = torch.cuda.is_available()
    dtype = args.dtype or ("bf16" if cuda else "fp32")
    model = load_model(args.model or default_model_dir(), dtype=dtype, device="cuda" if cuda else "cpu")
    command = _command(f"pwruntime bench prefix-cache --prompts {args.prompts} --max-tokens {args.max_tokens} "
                       f"--reps {rounds}")
    torch.manual_seed(args.seed)
    res = {"device": torch.cuda.get_device_name() if cuda else "cpu", "command": command, "torch": torch.__version__,
           "dtype": dtype, **bpc.run(model, args.prompts, args.max_tokens, rounds)}
    return report_bench(res, command, args.out, args.json, bpc.print_table)


_DECODE_ONLY = ("steps", "prompt_tokens", "ap", "calibration", "policy", "num_kv_blocks", "temperature", "top_p")


def _bench_engine(args, blocks: int, max_num_seqs: int, policy: str, max_num_batched_tokens: int | None = None):
    """(engine, model dir, dtype, device) as `pwruntime generate` builds them from the bench's engine options."""
    from pwruntime.cmd_generate import add_engine_args, build_engine
    argv = ["--num-kv-blocks", str(blocks), "--max-num-seqs", str(max_num_seqs), "--policy", policy,
            *(["--max-num-batched-tokens", str(max_num_batched_tokens)] if max_num_batched_tokens else []),
            *(["--model", args.model] if args.model else []), *(["--ap", args.ap] if args.ap else []),
            *(["--calibration", args.calibration] if args.calibration else []),
            *(["--dtype", args.dtype] if args.dtype else []), *(["--no-cuda-graphs"] if args.no_cuda_graphs else []),
            *(["--async-scheduling"] if args.async_scheduling else [])]
    engine_parser = argparse.ArgumentParser(prog=f"pwruntime bench {args.target}")
    add_engine_args(engine_parser)
    return build_engine(engine_parser.parse_args(argv))


def _engine_header(command: str, model_dir, dtype: str, device: str, blocks: int) -> dict:
    """What an engine bench's result starts with: the device, the reproducing command, torch, the model, the pool."""
    import torch
    return {"device": torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu", "command": command,
            "torch": torch.__version__, "model": str(model_dir), "dtype": dtype, "kv_blocks": blocks}


def _run_mixed(args) -> int:
    from pwruntime import bench_mixed as bm
    from pwruntime.engine import EngineConfig
    _refuse(args, ("models", "profile_out", "plot_from", "routing", "steps", "prompt_tokens", "temperature", "top_p"),
            "mixed")
    if args.async_scheduling:
        raise UserError("--async-scheduling belongs to `pwruntime bench decode`; bench mixed times one forward")
    if args.max_tokens != 16:
        raise UserError("--max-tokens belongs to `pwruntime bench prefix-cache`; bench mixed takes --tokens")
    rows, reps, text = (24 if args.prompts is None else args.prompts), (30 if args.reps is None else args.reps), \
        args.tokens or "20,150,488"
    sizes = _int_list("--tokens", text)
    check_counts(("--prompts", rows), *(("--tokens", t) for t in sizes), ("--reps", reps),
                 ("--num-kv-blocks", args.num_kv_blocks))
    need = max(bm.blocks_needed(rows, p, EngineConfig.block_size) for p in sizes)
    blocks = args.num_kv_blocks or need
    if blocks < need:
        raise UserError(f"--num-kv-blocks {blocks} cannot hold {rows} decode rows and a {max(sizes)}-token prompt "
                        f"({need} blocks of {EngineConfig.block_size})")
    engine, model_dir, dtype, device = _bench_engine(args, blocks, rows + 1, args.policy or "noop",
                                                     rows + max(sizes))
    command = _command(f"pwruntime bench mixed --prompts {rows} --tokens {text} --reps {reps}")
    res = {**_engine_header(command, model_dir, dtype, device, blocks), **bm.run(engine, rows, sizes, reps, args.seed)}
    return report_bench(res, command, args.out, args.json, bm.print_table)


def _run_decode(args) -> int:
    from pwruntime import bench_decode as bd
    from pwruntime.sampling import SamplingParams
    _refuse(args, ("models", "tokens", "profile_out", "plot_from", "routing"), "decode")
    if args.max_tokens != 16:
        raise UserError("--max-tokens belongs to `pwruntime bench prefix-cache`; bench decode takes --steps")
    steps, reps = (100 if args.steps is None else args.steps), (3 if args.reps is None else args.reps)
    args.prompts = 32 if args.prompts is None else args.prompts
    prompt_tokens, policy = (40 if args.prompt_tokens is None else args.prompt_tokens), args.policy or "noop"
    check_counts(("--prompts", args.prompts), ("--prompt-tokens", prompt_tokens), ("--steps", steps), ("--reps", reps),
                 ("--num-kv-blocks", args.num_kv_blocks))
    temperature, top_p = (args.temperature or 0.0), (1.0 if args.top_p is None else args.top_p)
    try:
        SamplingParams(temperature=temperature, top_p=top_p)
    except ValueError as e:
        raise UserError(f"--temperature / --top-p: {e}") from None
    blocks = args.num_kv_blocks or bd.default_kv_blocks(args.prompts, prompt_tokens, steps, reps)
    engine, model_dir, dtype, device = _bench_engine(args, blocks, args.prompts, policy)
    command = _command(f"pwruntime bench decode --prompts {args.prompts} --steps {steps} --reps {reps}"
                       + (" --async-scheduling" if args.async_scheduling else "")
                       + (f" --temperature {temperature} --top-p {top_p}" if temperature else ""))
    try:
        res = bd.run(engine, args.prompts, prompt_tokens, steps, reps, args.seed, temperature, top_p)
    except RuntimeError as e:
        raise UserError(f"{e} (--num-kv-blocks {blocks})") from None
    res = {**_engine_header(command, model_dir, dtype, device, blocks), "policy": policy,
           "async_scheduling": engine.config.async_scheduling, "temperature": temperature, "top_p": top_p, **res}
    return report_bench(res, command, args.out, args.json, bd.print_table)


def _run_plans(args) -> int:
    import torch
    from tqdm import tqdm

    from pwruntime import bench_plans as bpl
    _refuse(args, ("tokens", "dtype", "routing", "profile_out", "plot_from"), "plans",
            " (it takes --models, --layers, --bits, --reps, --plane-arena, --plan-log, --seed, --out, --json)")
    models = tuple(m.strip() for m in args.models.split(",")) if args.models else tuple(bpl.SHAPES)
    unknown = [m for m in models if m not in bpl.SHAPES]
    if unknown:
        raise UserError(f"unknown model shape(s) {unknown}; choose from {', '.join(bpl.SHAPES)}")
    layers, reps = (1 if args.layers is None else args.layers), (5 if args.reps is None else args.reps)
    check_counts(("--layers", layers), ("--reps", reps))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.plane_arena and device.type != "cuda":
        raise UserError("--plane-arena needs a CUDA GPU (the arena maps device memory): leave it out on the CPU")
    plane_arena = device.type == "cuda" if args.plane_arena is None else args.plane_arena
    arena = " --plane-arena" if plane_arena else " --no-plane-arena"
    if args.plan_log is not None:
        return _run_plan_log(args, models, layers, device, plane_arena, arena)
    bits = 4 if args.bits is None else args.bits
    if not 3 <= bits < 8:
        raise UserError(f"--bits must lie in 3..7 for bench plans (offloads from 8 bits), got {bits}")
    command = _with_arena(_command(f"pwruntime bench plans --models {','.join(models)} --layers {layers} "
                                   f"--bits {bits} --reps {reps}"), arena)
    cfg = bpl.PlansConfig(models, layers, bits, reps, args.seed, plane_arena)
    with tqdm(total=len(models) * (reps + 1), desc="bench plans", file=sys.stderr) as bar:
        def progress(text: str) -> None:
            bar.set_postfix_str(text)
            if "round" in text:
                bar.update()
        res = bpl.run(cfg, device, progress)
    res = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "command": command,
           "torch": torch.__version__, **res}
    return report_bench(res, command, args.out, args.json, bpl.print_table, bpl.plot)


def _run_plan_log(args, models: tuple[str, ...], layers: int, device, plane_arena: bool, arena: str) -> int:
    """`bench plans --plan-log DIR`: the plans of a run played on one model shape (pwruntime.bench_plan_log)."""
    import torch
    from tqdm import tqdm

    from pwruntime import bench_plan_log as bpg
    _refuse(args, ("bits", "reps"), "plans --plan-log", " (it plays the log's plans: it takes --models, --layers, "
            "--plane-arena, --seed, --out, --json)")
    if len(models) != 1:
        raise UserError(f"--plan-log plays one run's plans on one model shape: give --models the shape it served "
                        f"(one of {', '.join(models)})")
    cfg = bpg.PlanLogConfig(args.plan_log, models[0], layers, plane_arena, args.seed)
    command = _with_arena(_command(f"pwruntime bench plans --plan-log {args.plan_log} --models {models[0]} "
                                   f"--layers {layers}"), arena)
    plans = bpg.log_plans(cfg)   # a log it cannot play is refused before the progress line
    with tqdm(desc="bench plans --plan-log", file=sys.stderr, bar_format="{desc}{postfix}") as bar:
        res = bpg.measure(cfg, device, plans, progress=bar.set_postfix_str)
    res = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "command": command,
           "torch": torch.__version__, **res}
    return report_bench(res, command, args.out, args.json, bpg.print_table, bpg.plot)


def _cards_and_reps(args, target: str, models: tuple[str, ...], reps: int) -> tuple[tuple[str, ...], int]:
    """(--models as model cards, --reps) of a bench that takes only those, --seed, --out and --json, checked; the
    given defaults where absent."""
    from traces.model_card import CardError, load_card
    _refuse(args, ("tokens", "dtype", "routing", "profile_out", "plot_from"), target,
            " (it takes --models, --reps, --seed, --out, --json)")
    models = tuple(m.strip() for m in args.models.split(",")) if args.models else models
    for m in models:
        try:
            load_card(m)
        except CardError as e:
            raise UserError(f"--models: {e}") from None
    reps = reps if args.reps is None else args.reps
    check_counts(("--reps", reps))
    return models, reps


def _run_kv_resize(args) -> int:
    import torch
    from tqdm import tqdm

    from pwruntime import bench_kv_resize as bkv
    models, reps = _cards_and_reps(args, "kv-resize", bkv.KvResizeConfig.models, 2)
    if not torch.cuda.is_available():
        raise UserError("pwruntime bench kv-resize needs a CUDA GPU; none is visible here")
    cfg = bkv.KvResizeConfig(models=models, rounds=reps, seed=args.seed)
    command = _command(f"pwruntime bench kv-resize --models {','.join(models)} --reps {reps}")
    with tqdm(total=len(models) * reps * len(bkv.BACKINGS), desc="bench kv-resize", file=sys.stderr) as bar:
        def progress(text: str) -> None:
            bar.set_postfix_str(text)
            bar.update()
        res = bkv.run(cfg, progress)
    res = {"device": torch.cuda.get_device_name(), "command": command, "torch": torch.__version__, **res}
    return report_bench(res, command, args.out, args.json, bkv.print_table, bkv.plot)


def _run_step_inputs(args) -> int:
    import torch
    from tqdm import tqdm

    from pwruntime import bench_step_inputs as bsi
    models, reps = _cards_and_reps(args, "step-inputs", bsi.StepInputsConfig.models, bsi.StepInputsConfig.reps)
    cfg = bsi.StepInputsConfig(models=models, reps=reps, seed=args.seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    command = _command(f"pwruntime bench step-inputs --models {','.join(models)} --reps {reps} --seed {args.seed}")
    with tqdm(desc="bench step-inputs", file=sys.stderr, bar_format="{desc}{postfix}") as bar:
        res = bsi.measure(cfg, device, progress=bar.set_postfix_str)
    res = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "command": command,
           "torch": torch.__version__, **res}
    return report_bench(res, command, args.out, args.json, bsi.print_table, bsi.plot)


def run(args) -> int:
    check_seed(args.seed)
    if args.layers is not None and args.target != "plans":
        raise UserError("--layers belongs to `pwruntime bench plans`")
    if args.plane_arena is not None and args.target != "plans":
        raise UserError("--plane-arena and --no-plane-arena belong to `pwruntime bench plans`")
    if args.plan_log is not None and args.target != "plans":
        raise UserError("--plan-log belongs to `pwruntime bench plans`")
    if args.bits is not None and args.target not in ("prefill", "plans"):
        raise UserError("--bits belongs to `pwruntime bench prefill` and `bench plans`")
    if args.prefill_chunk is not None and args.target != "prefill":
        raise UserError("--prefill-chunk belongs to `pwruntime bench prefill` (a server takes its own: "
                        "`pwruntime serve --prefill-chunk`)")
    if args.target == "serve":
        return bench_serve.run_cli(args, _command(f"pwruntime bench serve --url {args.url}"))
    for name in bench_serve.SERVE_FLAGS:
        if getattr(args, name) is not None:
            raise UserError(f"--{name.replace('_', '-')} belongs to `pwruntime bench serve`")
    if args.force:
        raise UserError("--force belongs to `pwruntime bench serve`")
    for flag, path in (("--out", args.out), ("--profile-out", args.profile_out)):
        if path is not None:  # before the benchmark runs: its results are written at the end
            check_output(path, flag, directory=False)
    if args.target == "decode":
        return _run_decode(args)
    if args.target == "mixed":
        return _run_mixed(args)
    if any(getattr(args, n) is not None for n in _DECODE_ONLY) or args.no_cuda_graphs or args.async_scheduling:
        raise UserError("--steps, --prompt-tokens, --ap, --calibration, --policy, --num-kv-blocks, "
                        "--no-cuda-graphs, --async-scheduling, --temperature and --top-p belong to `pwruntime bench "
                        "decode` (--ap, --calibration, --policy, --num-kv-blocks and --no-cuda-graphs also to `bench "
                        "mixed`)")
    if args.target == "prefix-cache":
        return _run_prefix_cache(args)
    if args.prompts is not None or args.max_tokens != 16 or args.model is not None:
        raise UserError("--prompts, --max-tokens and --model belong to `pwruntime bench prefix-cache` (--prompts and "
                        "--model also to `bench decode` and `bench mixed`)")
    if args.target == "plans":
        return _run_plans(args)
    if args.target == "kv-resize":
        return _run_kv_resize(args)
    if args.target == "step-inputs":
        return _run_step_inputs(args)
    if args.dtype == "fp32":
        raise UserError(f"--dtype fp32 is for `pwruntime bench prefix-cache`; bench {args.target} takes fp16 or bf16")
    if args.routing is not None:
        from pwruntime.kernels.bench import parse_routing
        if args.target != "kernels":
            raise UserError("--routing belongs to `pwruntime bench kernels`")
        try:
            parse_routing(args.routing)
        except ValueError as e:
            raise UserError(f"--routing: {e}") from None
    args.reps = 30 if args.reps is None else args.reps
    if args.target == "prefill":
        return _run_prefill(args)
    if args.plot_from is not None:
        return _replot(args.plot_from)
    return _run_kernels(args)


def _run_kernels(args) -> int:
    """`bench kernels`: copy bandwidth, fp16 GEMM, the single AP block, paged attention and each model's MoE layers;
    writes the results and a measured hardware profile from them."""
    import torch
    from tqdm import tqdm

    from pwruntime.kernels import bench as kb
    from pwruntime.kernels import bench_report as report
    cfg, command = _config(args, 1, 64, "1,4,16,64")
    models = cfg.models

    steps = 4 + len(models)
    bar = tqdm(total=steps, desc="bench kernels", file=sys.stderr)
    res: dict = {"device": torch.cuda.get_device_name(), "command": command, "torch": torch.__version__,
                 "dtype": cfg.dtype, "routing": cfg.routing,
                 "gpu_memory_bytes": int(torch.cuda.get_device_properties(0).total_memory)}
    res["copy"] = kb.copy_bandwidth()
    bar.update()
    res["fp16_gemm_tflops"] = kb.gemm_tflops()
    bar.update()
    res["single_block"] = kb.single_block(cfg)
    bar.update()
    res["paged_attention"] = kb.attention(cfg)
    res["paged_attention_long"] = kb.attention(cfg, seqs=1, context=32768)   # the context-split path
    bar.update()
    res["moe"] = []
    for m in models:
        res["moe"] += kb.moe_layers(cfg, m, progress=lambda s: bar.set_postfix_str(s))
        torch.cuda.empty_cache()
        bar.update()
    bar.close()
    report.add_rooflines(res)

    from pwruntime.kernels.plots import plot_bench
    profile_path = args.profile_out or report.default_profile_path(res, args.out)
    profile = report.measured_profile(res, args.profile_name or f"{report.slug(res['device'])}-measured")
    profile.save(profile_path)
    report_bench(res, command, args.out, args.json, report.print_tables, plot_bench)
    print(f"hardware profile: {profile_path}", file=sys.stderr if args.json else sys.stdout)
    return 0
