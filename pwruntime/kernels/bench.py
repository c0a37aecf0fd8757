"""Kernel measurements behind `pwruntime bench kernels`: AP kernels vs torch fp16, copies, attention.

Every GPU time is the median of many replays of a captured CUDA graph, timed with CUDA events after
warm-up (launch gaps are hidden as far as a graph hides them). Weights are random bit-planes and
sorted random LUTs (never zeros); data sets are sized or rotated (several layers or matrices per
replay) so repeated replays do not run out of the 60 MB L2. "Bytes" are the bytes a kernel must
read: the active experts' planes 0..q-1 plus LUT_q at their committed bits (fp16: the weights).
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from policies.apformat import ap_block_bytes, fp16_bytes
from pwruntime.kernels.attention import paged_attention_decode
from pwruntime.kernels.device_table import DeviceWeightTable, device_layout
from pwruntime.kernels.moe import MoEShape, MoEWorkspace, ap_linear, fused_moe
from pwruntime.kernels.reference import gated
from pwruntime.quant.dummy import random_luts, random_planes

ARCHS: dict[str, tuple[int, int, int, int]] = {  # hidden, intermediate, experts, top-k
    "qwen1.5-moe-a2.7b": (2048, 1408, 60, 4),
    "mixtral-8x7b": (4096, 14336, 8, 2),
    "olmoe-1b-7b": (2048, 1024, 64, 8),
    "qwen3-moe-30b-a3b": (2048, 768, 128, 8),
}
# every shape a bench of whole layers takes (plans, prefill): ARCHS, the demo model's and Gemma 4's
MODEL_SHAPES: dict[str, tuple[int, int, int, int]] = {
    "demo": (256, 128, 16, 4), **ARCHS, "gemma-4-26b-a4b": (2816, 704, 128, 8)}
GATE_ACTIVATIONS = {"gemma-4-26b-a4b": "gelu_tanh"}  # the experts' gate activation where it is not SiLU
BITS = (3, 4, 5, 6, 7, 8)
FP16_GATHER_LIMIT = 8 << 30  # skip the gathered-bmm baseline when its gathered copy exceeds this


def model_shape(name: str) -> MoEShape:
    """The MoE layer of bench shape `name` (MODEL_SHAPES), with its experts' gate activation."""
    h, i, e, k = MODEL_SHAPES[name]
    return MoEShape(e, h, i, k, GATE_ACTIVATIONS.get(name, "silu"))


@dataclass(frozen=True)
class BenchConfig:
    models: tuple[str, ...] = tuple(ARCHS)
    tokens: tuple[int, ...] = (1, 4, 16, 64)
    reps: int = 30
    warmup: int = 5
    seed: int = 0
    dtype: str = "fp16"   # activations (and the dense baselines, whose result keys keep the name fp16_*): fp16 | bf16
    routing: str = "uniform"   # MoE layers' routing: uniform, or zipf:ALPHA (`parse_routing`)

    @property
    def act_dtype(self) -> torch.dtype:
        return {"fp16": torch.float16, "bf16": torch.bfloat16}[self.dtype]


def events_ms(run: Callable[[], object], reps: int, warmup: int) -> float:
    """The median GPU ms of run's launches: CUDA events around each of `reps` calls, after `warmup` calls."""
    for _ in range(warmup):
        run()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for s, e in zip(starts, ends):
        s.record()
        run()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def capture(fn: Callable[[], object]) -> torch.cuda.CUDAGraph:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # compile / load / allocate outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def graph_ms(graph: torch.cuda.CUDAGraph, cfg: BenchConfig) -> float:
    return events_ms(graph.replay, cfg.reps, cfg.warmup)


# ------------------------------------------------------------------ platform numbers
def copy_bandwidth(size: int = 256 << 20, reps: int = 10) -> dict:
    host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    host.random_(0, 255)
    dev = torch.empty(size, dtype=torch.uint8, device="cuda")
    h2d = events_ms(lambda: dev.copy_(host, non_blocking=True), reps, 2)
    d2h = events_ms(lambda: host.copy_(dev, non_blocking=True), reps, 2)
    big = torch.empty(1 << 30, dtype=torch.uint8, device="cuda").random_(0, 255)
    other = torch.empty_like(big)
    d2d = events_ms(lambda: other.copy_(big), reps, 2)
    return {"bytes": size, "h2d_pinned_gbps": size / h2d / 1e6, "d2h_pinned_gbps": size / d2h / 1e6,
            "d2d_copy_gbps": 2 * big.numel() / d2d / 1e6}


def gemm_tflops(n: int = 8192, reps: int = 10) -> float:
    a = torch.randn(n, n, device="cuda", dtype=torch.float16)
    b = torch.randn(n, n, device="cuda", dtype=torch.float16)
    ms = events_ms(lambda: a @ b, reps, 3)
    return 2 * n ** 3 / ms / 1e9


# ------------------------------------------------------------------ one linear-block
def _random_table(copies: int, out: int, inp: int, gen: torch.Generator):
    """(table of `copies` random [out, inp] blocks, all 8 planes resident at 8 bits; their LUTs per bitwidth)."""
    planes = random_planes(copies, out, inp, gen)
    luts = random_luts(copies, out, inp, gen)
    table = DeviceWeightTable(copies, gen.device)
    for c in range(copies):
        table.set_block(c, device_layout(planes[c]), luts[8][c], 8)
    return table, luts


def single_block(cfg: BenchConfig, out: int = 14336, inp: int = 4096, copies: int = 8,
                 tokens: tuple[int, ...] = (1, 8), bits: tuple[int, ...] = BITS) -> list[dict]:
    """Mixtral-expert-sized block: AP at each bitwidth vs torch fp16 GEMV (F.linear), `copies` rotated. Each row also
    times the dense GEMV of a block of the AP planes' bytes (`fp16_same_bytes_us`: [out, in * bits / 16]), what
    torch's own kernel takes to stream that many bytes at this size."""
    gen = torch.Generator(device="cuda").manual_seed(cfg.seed)
    table, luts = _random_table(copies, out, inp, gen)
    n_dense = max(2, copies // 2)

    def dense_weights(k: int) -> list[torch.Tensor]:
        return [(torch.randn(out, k, device="cuda", generator=gen, dtype=torch.float16) / k ** 0.5).to(cfg.act_dtype)
                for _ in range(n_dense)]

    def dense_us(x: torch.Tensor, weights: list[torch.Tensor]) -> float:
        return graph_ms(capture(lambda: [F.linear(x, w) for w in weights]), cfg) * 1000 / len(weights)

    dense = dense_weights(inp)
    same_bytes = {b: dense_weights(inp * b // 16) for b in bits}
    rows = []
    for t in tokens:
        x = torch.randn(t, inp, device="cuda", generator=gen, dtype=torch.float16).to(cfg.act_dtype)
        g_ap = capture(lambda: [ap_linear(table, c, x, out) for c in range(copies)])
        fp_us = dense_us(x, dense)
        for b in bits:
            for c in range(copies):
                table.commit_bits(c, b, luts[b][c])
            us = graph_ms(g_ap, cfg) * 1000 / copies
            nbytes = ap_block_bytes(out, inp, b)
            same_us = dense_us(x[:, :inp * b // 16], same_bytes[b])
            rows.append({"out": out, "in": inp, "tokens": t, "bits": b, "dtype": cfg.dtype, "ap_us": us, "ap_bytes": nbytes,
                         "ap_gbps": nbytes / us / 1e3, "fp16_us": fp_us,
                         "fp16_gbps": fp16_bytes(out, inp) / fp_us / 1e3, "speedup_vs_fp16": fp_us / us,
                         "fp16_same_bytes_us": same_us})
    return rows


def single_block_once(bits: tuple[int, ...], tokens: tuple[int, ...], out: int = 14336, inp: int = 4096) -> None:
    """Each (bits, T) case launched once on fresh data (for a profiler such as ncu)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    table, luts = _random_table(1, out, inp, gen)
    for t in tokens:
        x = torch.randn(t, inp, device="cuda", generator=gen, dtype=torch.float16)
        for b in bits:
            table.commit_bits(0, b, luts[b][0])
            ap_linear(table, 0, x, out)


# ------------------------------------------------------------------ MoE layers
class APLayers:
    """`layers` MoE layers of random AP experts (all 8 planes resident, LUTs for 3..8 bits)."""

    def __init__(self, shape: MoEShape, layers: int, gen: torch.Generator):
        self.shape, self.layers = shape, layers
        self.table = DeviceWeightTable(layers * shape.num_experts * 2, "cuda")
        h, i, e = shape.hidden, shape.intermediate, shape.num_experts
        self.dims = [(2 * i, h), (h, i)]
        self.data = []
        for layer in range(layers):
            per_kind = []
            for kind, (o, inp) in enumerate(self.dims):
                planes, luts = random_planes(e, o, inp, gen), random_luts(e, o, inp, gen)
                for ex in range(e):
                    self.table.set_block(shape.block(layer, ex, kind), device_layout(planes[ex]), luts[8][ex], 8)
                per_kind.append((planes, luts))
            self.data.append(per_kind)

    def set_bits(self, bits_of: Callable[[int, int, int], int]) -> None:
        for layer, per_kind in enumerate(self.data):
            for kind, (_, luts) in enumerate(per_kind):
                for ex in range(self.shape.num_experts):
                    b = bits_of(layer, ex, kind)
                    self.table.commit_bits(self.shape.block(layer, ex, kind), b, luts[b][ex])

    def bytes_per_layer(self, active: list[int], kinds: tuple[int, ...] = (0, 1)) -> float:
        """Mean bytes a layer's launches read for the `active` experts' blocks of `kinds` (0 gate_up, 1 down)."""
        total = sum(self.table.nbytes_read(self.shape.block(layer, ex, kind))
                    for layer in range(self.layers) for ex in active for kind in kinds)
        return total / self.layers


def parse_routing(text: str) -> float | None:
    """`uniform` -> None; `zipf:ALPHA` -> ALPHA (> 0). Raises ValueError naming the accepted forms."""
    if text == "uniform":
        return None
    name, _, value = text.partition(":")
    try:
        alpha = float(value) if name == "zipf" else float("nan")
    except ValueError:
        alpha = float("nan")
    if not alpha > 0 or alpha == float("inf"):
        raise ValueError(f"routing {text!r}: use uniform or zipf:ALPHA with ALPHA > 0 (e.g. zipf:1.0)")
    return alpha


def random_routing(shape: MoEShape, tokens: int, gen: torch.Generator, zipf: float | None = None):
    """Each token's top-k distinct experts: uniformly, or drawn without replacement with popularity 1 / rank^zipf over
    a random order of the experts (a few hot experts, as real routers often have); softmax weights. On gen's device."""
    dev = gen.device
    if zipf is None:
        ids = torch.stack([torch.randperm(shape.num_experts, device=dev, generator=gen)[:shape.top_k]
                           for _ in range(tokens)])
    else:
        e = shape.num_experts
        popularity = torch.empty(e, device=dev)
        popularity[torch.randperm(e, device=dev, generator=gen)] = \
            1.0 / torch.arange(1, e + 1, device=dev, dtype=torch.float32) ** zipf
        ids = torch.stack([torch.multinomial(popularity, shape.top_k, replacement=False, generator=gen)
                           for _ in range(tokens)])
    w = torch.softmax(torch.randn(tokens, shape.top_k, device=dev, generator=gen), dim=-1)
    return ids, w


def _layers_for(shape: MoEShape) -> int:
    """Enough layers that one replay's 3-bit bytes at T=1 exceed the L2 several times (at most 8)."""
    per_layer = shape.top_k * sum(ap_block_bytes(o, i, 3) for o, i in
                                  [(2 * shape.intermediate, shape.hidden), (shape.hidden, shape.intermediate)])
    return max(2, min(8, -(-240_000_000 // per_layer)))


def _fp16_paths(shape: MoEShape, x, ids, w, wgu, wd):
    """torch fp16: gathered experts + bmm, and a per-active-expert loop (indices prepared on the host)."""
    inter = shape.intermediate
    tokens, k = ids.shape
    flat = ids.reshape(-1)

    def gathered():
        xg = x.repeat_interleave(k, dim=0).unsqueeze(-1)
        a = gated(torch.bmm(wgu[flat], xg).squeeze(-1), shape.activation).unsqueeze(-1)
        y = torch.bmm(wd[flat], a).squeeze(-1).view(tokens, k, -1)
        return (y.float() * w.unsqueeze(-1)).sum(1).to(x.dtype)

    groups = []
    for e in torch.unique(flat).tolist():
        tok, slot = torch.nonzero(ids == e, as_tuple=True)
        groups.append((e, tok, w[tok, slot].unsqueeze(-1)))

    def loop():
        out = torch.zeros(tokens, shape.hidden, device=x.device, dtype=torch.float32)
        for e, tok, wt in groups:
            y = gated(x[tok] @ wgu[e].T, shape.activation) @ wd[e].T
            out.index_add_(0, tok, y.float() * wt)
        return out.to(x.dtype)

    gather_bytes = flat.numel() * (fp16_bytes(2 * inter, shape.hidden) + fp16_bytes(shape.hidden, inter))
    return (gathered if gather_bytes <= FP16_GATHER_LIMIT else None), loop


def same_bytes_dense_us(cfg: BenchConfig, tokens: int, launches: list[tuple[int, float]], copies: int,
                        gen: torch.Generator) -> float:
    """torch's dense GEMVs over as many bytes as a MoE layer's two AP launches read, back to back in stream order as
    those launches run: launch j as `F.linear` of `tokens` rows over a dense [rows_j, bytes_j / (2 rows_j)] block
    (`launches` = [(rows_j, bytes_j)]), `copies` of each rotated so the L2 holds none. What torch's own kernels take
    to stream a layer's bytes in two launches at this size."""
    blocks = []
    for _ in range(copies):
        pair = []
        for rows, nbytes in launches:
            cols = max(16, round(nbytes / (2 * rows) / 16) * 16)
            pair.append(torch.randn(rows, cols, device="cuda", generator=gen, dtype=torch.float16).to(cfg.act_dtype))
        blocks.append(pair)
    xs = [torch.randn(tokens, w.shape[1], device="cuda", generator=gen, dtype=torch.float16).to(cfg.act_dtype)
          for w in blocks[0]]
    graph = capture(lambda: [F.linear(x, w) for pair in blocks for x, w in zip(xs, pair)])
    return graph_ms(graph, cfg) * 1000 / copies


def moe_layers(cfg: BenchConfig, name: str, progress: Callable[[str], None] = lambda s: None,
               bits: tuple[int, ...] = BITS, baselines: bool = True) -> list[dict]:
    shape = model_shape(name)
    h, i, e = shape.hidden, shape.intermediate, shape.num_experts
    gen = torch.Generator(device="cuda").manual_seed(cfg.seed)
    layers = _layers_for(shape)
    ap = APLayers(shape, layers, gen)
    wgu = (torch.randn(e, 2 * i, h, device="cuda", generator=gen, dtype=torch.float16) / h ** 0.5).to(cfg.act_dtype)
    wd = (torch.randn(e, h, i, device="cuda", generator=gen, dtype=torch.float16) / i ** 0.5).to(cfg.act_dtype)
    cases = {}
    for t in cfg.tokens:
        ids, w = random_routing(shape, t, gen, parse_routing(cfg.routing))
        x = torch.randn(t, h, device="cuda", generator=gen, dtype=torch.float16).to(cfg.act_dtype)
        ws = MoEWorkspace.create(shape, t, cfg.act_dtype, "cuda")
        graph = capture(lambda: [fused_moe(ap.table, layer, x, ids, w, shape, ws) for layer in range(layers)])
        gathered, loop = _fp16_paths(shape, x, ids, w, wgu, wd)
        active = sorted(set(ids.reshape(-1).tolist()))
        fp16_active = len(active) * (fp16_bytes(2 * i, h) + fp16_bytes(h, i))
        # the graph holds raw pointers: keep its inputs and scratch alive as long as it is replayed
        cases[t] = dict(graph=graph, active=active, fp16_bytes=fp16_active, keep=(ids, w, x, ws),
                        fp16_loop_us=graph_ms(capture(loop), cfg) * 1000 if baselines else None,
                        fp16_gathered_us=graph_ms(capture(gathered), cfg) * 1000 if gathered and baselines
                        else None)
        progress(f"{name} T={t}: fp16 loop {cases[t]['fp16_loop_us']} us")
    rows = []
    mixed_gen = torch.Generator().manual_seed(cfg.seed + 1)
    mixed = torch.randint(3, 9, (layers, e, 2), generator=mixed_gen)
    for bits in (*bits, "mixed"):
        ap.set_bits((lambda l, x_, kd: bits) if bits != "mixed" else (lambda l, x_, kd: int(mixed[l, x_, kd])))
        for t, c in cases.items():
            us = graph_ms(c["graph"], cfg) * 1000 / layers
            nbytes = ap.bytes_per_layer(c["active"])
            launches = [(len(c["active"]) * 2 * i, ap.bytes_per_layer(c["active"], (0,))),
                        (h, ap.bytes_per_layer(c["active"], (1,)))]
            same_us = same_bytes_dense_us(cfg, t, launches, layers, gen) if baselines else None
            rows.append({"model": name, "tokens": t, "bits": bits, "dtype": cfg.dtype, "active_experts": len(c["active"]),
                         "layers_rotated": layers, "ap_us": us, "ap_bytes": nbytes, "ap_gbps": nbytes / us / 1e3,
                         "fp16_bytes": c["fp16_bytes"], "fp16_loop_us": c["fp16_loop_us"],
                         "fp16_gathered_bmm_us": c["fp16_gathered_us"], "fp16_same_bytes_us": same_us})
        progress(f"{name} bits={bits} done")
    return rows  # the caller empties torch's cache once these locals are gone


# ------------------------------------------------------------------ paged attention
def attention(cfg: BenchConfig, seqs: int = 32, context: int = 2048, heads: int = 32, kv_heads: int = 8,
              dim: int = 128, block_size: int = 16, generic: bool = False, window: int | None = None) -> dict:
    """Paged-attention decode over random fp16 caches with scattered blocks (`generic`: the generic kernel; `window`: a
    sliding-window layer's, whose query reads the last `window` tokens: `kv_bytes` counts what is read)."""
    gen = torch.Generator(device="cuda").manual_seed(cfg.seed)
    nb = seqs * context // block_size
    kc = torch.randn(nb, block_size, kv_heads, dim, device="cuda", generator=gen, dtype=torch.float16)
    vc = torch.randn_like(kc)
    tables = torch.randperm(nb, device="cuda", generator=gen).int().view(seqs, -1)
    lens = torch.full((seqs,), context, dtype=torch.int32, device="cuda")
    q = torch.randn(seqs, heads, dim, device="cuda", generator=gen, dtype=torch.float16)
    us = graph_ms(capture(lambda: paged_attention_decode(q, kc, vc, tables, lens, generic=generic, window=window)),
                  cfg) * 1000
    kv_bytes = 2 * kc.numel() * kc.element_size() * min(context, window or context) // context
    return {"seqs": seqs, "context": context, "heads": heads, "kv_heads": kv_heads, "head_dim": dim, "window": window,
            "us": us, "kv_bytes": kv_bytes, "gbps": kv_bytes / us / 1e3}
