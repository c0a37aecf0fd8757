"""Fused AP MoE decode (two launches per MoE layer) and the single-block AP linear, with CPU fallbacks.

`fused_moe(table, layer, x, topk_ids, topk_weights, shape)` computes, for T <= 64 tokens,
`out[t] = sum_j w[t, j] * down_e(silu(gate_e x_t) * up_e x_t)` with every block at the bits
committed in the `DeviceWeightTable`. On CUDA (fp16/bf16 activations) it is two launches of
cuda/ap_moe.cu on torch's current stream: gate_up + silu*mul into `act[T*k, I]`, then down + the
weighted top-k sum (see the .cu header), the second a programmatic dependent launch that starts
loading its weights while the first finishes. The launch configuration depends only on the shapes, T
and dtype, never on the bits or the routing, so a decode step is capturable in a CUDA graph and
replays correctly after `table.commit_bits(...)`. Keep one `MoEWorkspace` per (T, dtype) across
layers and replays. Elsewhere (CPU, fp32) it runs `reference.fused_moe_ref` on the table's tensors.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch

from pwruntime.kernels import compile as kc
from pwruntime.kernels.device_table import DeviceWeightTable
from pwruntime.kernels.reference import ap_linear_ref, dequantize_resident, fused_moe_ref

MAX_TOKENS = 64           # tokens per launch (8 mma n-tiles of 8)
MAX_SLOTS = 1024          # T * top_k the routing prologue holds in shared memory
MAX_EXPERTS = 1024        # experts per layer the active-expert bitmap holds
CHUNK_WORDS = 16           # the widest chunk the kernel uses (q = 3, 4; others use 8 words)
XS_ROW_PAD = 128           # shared-memory pad after each token's activations (ap_moe.cu)
XS_CHUNK_BYTES = 2 * 32 * CHUNK_WORDS         # one token's 16-bit activations of one such chunk
XS_CHUNK = XS_CHUNK_BYTES + XS_ROW_PAD         # ... padded
XS_CAP = 32 * 1024        # shared memory for activations when the whole K does not fit
BLOCK_XS_CAP = 65 * 1024  # ... in a single block's 16-warp CTAs, one an SM whatever their shared memory (registers)
LUT_SLICE = 16 * 256 * 2   # the byte-path LUT of one row group (16 rows, up to 8 bits)
BLOCK_LUT_SLICE = 2 * LUT_SLICE  # ... in the 16-warp build (the single block's): twice the replicas at 7-8 bits
SMEM_LIMIT = 227 * 1024
SM_SMEM = 228 * 1024      # an SM's shared memory; each resident CTA also reserves CTA_SMEM_RESERVED of it
CTA_SMEM_RESERVED = 1024
STATIC_SMEM = 4608        # ap_moe.cu's static shared memory (the routing prologue's arrays), rounded up
OCCUPANCY_XS = True       # cap the activation stage where XS_CAP would cost a CTA an SM (occupancy_xs_cap)
CARVEOUTS_KIB = (0, 8, 16, 32, 64, 100, 132, 164, 196, 228)  # an SM's shared-memory configurations (Hopper)
LAYER_CARVEOUT = True     # both launches of a MoE layer in one configuration (layer_carveout)
SPLIT_ABOVE = 32          # MoE launches of more tokens serve an expert's tokens in two groups (CTAs of fewer n-tiles)
GROUP_TOKENS = None       # ... or, when set (tune --group-tokens), every launch in groups of this many tokens
WIDE_MIN_CHUNKS = 4       # 8-warp CTAs when every warp still streams this many 512-column chunks (below)
WIDE_MAX_NT = 2           # ... and the launch has at most this many n-tiles
WANT_CTAS_PER_SM = 2      # the k-split grows until a launch of one token expects this many CTAs an SM
WANT_CTAS_PER_SM_MANY = 1.5   # ... of more tokens (each CTA also stages their activations)
_MODE_GATE_UP, _MODE_DOWN, _MODE_LINEAR = 0, 1, 2


@dataclass(frozen=True)
class MoEShape:
    num_experts: int
    hidden: int
    intermediate: int
    top_k: int
    activation: str = "silu"   # the experts' gate activation: "silu" or "gelu_tanh" (Gemma 4)

    def block(self, layer: int, expert: int, kind: int) -> int:
        return (layer * self.num_experts + expert) * 2 + kind


@dataclass(frozen=True)
class LaunchPlan:
    """Grid and shared memory of one launch; a function of (shape, T, dtype) only."""
    nt: int
    ksplit: int
    n_tiles: int
    grid: int
    xs_budget: int
    smem: int
    token_groups: int = 1   # the most groups of 8 * nt tokens an expert's tokens take (overflow slots serve all but one)
    warps: int = 4          # warps per CTA (row groups of a CTA: warps // ksplit)
    overflow: int = 0       # expert slots past one an active expert (overflow_slots), in the grid
    gelu: bool = False      # a gate_up launch whose activation is tanh GELU (else SiLU)

    @property
    def defines(self) -> tuple[tuple[str, int], ...]:
        return ((("PW_NT", self.nt),) + ((("PW_WARPS", self.warps),) if self.warps != 4 else ())
                + ((("PW_OVERFLOW", 1),) if self.overflow else ()) + ((("PW_GELU", 1),) if self.gelu else ()))

    def variant(self, dtype: torch.dtype) -> kc.Variant:
        """The cuda/ap_moe.cu build this launch runs for activations of `dtype`."""
        return "ap_moe.cu", (("PW_BF16", int(dtype == torch.bfloat16)),) + self.defines

    def kernel(self, device: torch.device, dtype: torch.dtype):
        """The compiled `variant`."""
        name, defines = self.variant(dtype)
        return kc.get_kernel(device, name, "pw_ap_moe", defines, self.smem)

    def resplit(self, m_rows: int, rows_per_warp: int, warps: int, ksplit: int) -> "LaunchPlan":
        """The same launch with CTAs of `warps` warps splitting K `ksplit` ways: its row tiles, grid (the same CTAs
        per tile) and shared memory follow."""
        n_tiles = row_tiles(m_rows, rows_per_warp, warps, ksplit)
        return replace(self, warps=warps, ksplit=ksplit, n_tiles=n_tiles, grid=n_tiles * (self.grid // self.n_tiles),
                       smem=launch_smem(self.xs_budget, self.nt, warps, ksplit))


def n_tiles_of(tokens: int) -> int:
    return next(n for n in (1, 2, 4, 8) if 8 * n >= min(tokens, MAX_TOKENS))


def _sm_count(device: torch.device | None) -> int:
    if device is not None and device.type == "cuda":
        return _sm_count_of(device.index if device.index is not None else torch.cuda.current_device())
    return 132


@functools.lru_cache(maxsize=None)
def _sm_count_of(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def plan_launch(m_rows: int, k: int, tokens: int, rows_per_warp: int, ctas_per_tile: int, max_ctas_per_tile: int,
                sm_count: int = 132, tile_tokens: int | None = None) -> LaunchPlan:
    """Pick the k-split (warps of a CTA sharing rows) so the expected CTAs fill the GPU.

    One token wants two CTAs per SM in flight, more tokens 1.5, since each CTA also stages their
    activations (measured on the H200, cuda/NOTES.md: aiming for three at one token split the gate_up K of
    Qwen1.5-MoE and Qwen3-MoE four ways, one 512-column chunk a warp, and their layers were 8-18% slower).
    A CTA serves up to `tile_tokens` tokens of its expert (default: all of them), one token group; an expert
    that gets every token takes `token_groups` of them.
    """
    tile_tokens = tokens if tile_tokens is None else max(1, min(tile_tokens, tokens))
    nt = n_tiles_of(tile_tokens)
    groups = -(-min(tokens, MAX_TOKENS) // (8 * nt))
    tokens = min(tokens, 8 * nt)   # the most a CTA stages
    words = -(-k // 32)
    nchunks = -(-words // 8)  # 256-column chunks (the k-split rule was measured with these)
    want = int((WANT_CTAS_PER_SM if tokens == 1 else WANT_CTAS_PER_SM_MANY) * sm_count)
    ksplit = 1
    for ks in (1, 2, 4):
        ksplit = ks
        tiles = row_tiles(m_rows, rows_per_warp, 4, ks)
        if tiles * ctas_per_tile >= want or nchunks // (ks * 2) < 2:
            break
    wide = -(-words // CHUNK_WORDS)
    # From 2 tokens up to 16, the same CTAs with twice the warps where K is long: each CTA stages the same
    # activations for the same rows and its warps share a row group's K range twice as many ways. Measured on
    # the H200 (cuda/NOTES.md): 6-12% faster blocks at T = 2..16 and Mixtral layers at T = 4..16 5-24%; but
    # 5-28% slower where a warp would be left with 1-2 chunks (the K of 2048 or less of the many-expert
    # models), and slower at T = 1, where the k-split above already fills the GPU.
    warps = 4
    if tokens >= 2 and nt <= WIDE_MAX_NT and wide >= WIDE_MIN_CHUNKS * 2 * ksplit:
        warps, ksplit = 8, 2 * ksplit
    xs_budget = activation_budget(tokens, k, occupancy_xs_cap(nt, warps, ksplit))
    n_tiles = row_tiles(m_rows, rows_per_warp, warps, ksplit)
    smem = checked_smem(launch_smem(xs_budget, nt, warps, ksplit))
    return LaunchPlan(nt, ksplit, n_tiles, n_tiles * max_ctas_per_tile, xs_budget, smem, groups, warps)


def checked_smem(smem: int) -> int:
    if smem > SMEM_LIMIT:
        raise ValueError(f"launch needs {smem} bytes of shared memory (limit {SMEM_LIMIT})")
    return smem


def activation_budget(tokens: int, k: int, cap: int) -> int:
    """Shared-memory bytes for the activations of `tokens` tokens over K = k: the whole K where it fits in `cap`,
    else as many 512-column chunks as do (segments, ap_moe.cu), at least one."""
    wide = -(-k // (32 * CHUNK_WORDS))
    return max(min(tokens * (wide * XS_CHUNK_BYTES + XS_ROW_PAD), cap), tokens * XS_CHUNK)


def ctas_by_registers(nt: int, warps: int) -> int:
    """CTAs an SM the kernel build's launch bounds allow (ap_moe.cu PW_MINB)."""
    return max(1, (16 if nt <= 2 else 12 if nt == 4 else 8) // warps)


def occupancy_xs_cap(nt: int, warps: int, ksplit: int) -> int:
    """The activation stage's cap: XS_CAP, or less where XS_CAP would leave fewer CTAs an SM than the build's
    registers allow. At 5-16 tokens the small-expert models' 4-warp CTAs staged up to 32 KiB beside four 8 KiB LUT
    slices, three an SM; capped so that four fit (19 KiB), they take more segments, and on the H200 their layers got
    3.5-10% faster at 3-4 bits and 2.4-3.7% at 8 bits at T = 8-16, mixed within 1% (cuda/NOTES.md, session 20).
    The 8-warp CTAs (two an SM by registers) and the launches of more tokens already hold all they can."""
    if not OCCUPANCY_XS:
        return XS_CAP
    per_cta = SM_SMEM // ctas_by_registers(nt, warps) - STATIC_SMEM - CTA_SMEM_RESERVED
    room = per_cta - (warps // ksplit) * lut_slice_bytes(warps)
    return min(XS_CAP, room) if room >= nt * 512 * warps else XS_CAP


def cta_smem(smem: int) -> int:
    """Shared memory a resident CTA of a launch of `smem` dynamic bytes takes from its SM: static and reserved too."""
    return smem + STATIC_SMEM + CTA_SMEM_RESERVED


def ctas_per_sm(plan: LaunchPlan) -> int:
    """CTAs of `plan` an SM holds at once, by the build's registers and the launch's shared memory (the planner's
    model of the driver's occupancy calculator; a GPU test checks they agree)."""
    return min(ctas_by_registers(plan.nt, plan.warps), SM_SMEM // cta_smem(plan.smem))


def carveout_kib(plan: LaunchPlan) -> int:
    """The smallest shared-memory configuration of an SM that holds as many CTAs of `plan` as registers and shared
    memory allow (what the driver picks for the launch alone)."""
    need = ctas_per_sm(plan) * cta_smem(plan.smem)
    return next(c for c in CARVEOUTS_KIB if c * 1024 >= need)


def layer_carveout(p1: LaunchPlan, p2: LaunchPlan) -> int | None:
    """The preferred carveout (percent) of both launches of a MoE layer: the larger configuration either needs, so
    they match. An SM changes configuration only once drained, so launches in different ones cannot share an SM, and
    the second launch (programmatic, meant to start loading while the first finishes) waits for whole SMs. Left to
    the driver, Qwen3-MoE's one-token launches took 132 and 164 KiB; in one, its layers got 4-14% faster on the H200
    (3 bits 18.1 -> 16.3 us, mixed 41.4 -> 35.2), every other layer of the four models within 0.7% (cuda/NOTES.md,
    session 20)."""
    if not LAYER_CARVEOUT:
        return None
    return 100 * max(carveout_kib(p1), carveout_kib(p2)) // (SM_SMEM // 1024)  # the driver rounds up to it


def row_tiles(m_rows: int, rows_per_warp: int, warps: int, ksplit: int) -> int:
    """Row tiles (CTAs per active expert and token group): a CTA holds warps // ksplit row groups."""
    return -(-m_rows // (rows_per_warp * (warps // ksplit)))


def lut_slice_bytes(warps: int) -> int:
    """One row group's byte-path LUT slice in the kernel build of `warps`-warp CTAs (ap_decode.cuh PW_LUTWIDE)."""
    return BLOCK_LUT_SLICE if warps == 16 else LUT_SLICE


def launch_smem(xs_budget: int, nt: int, warps: int, ksplit: int) -> int:
    """Dynamic shared memory of a launch: the activation stage (or the k-split reduction's buffer, if larger),
    then one byte-path LUT slice per row group (ap_moe.cu lut_region)."""
    return max(xs_budget, nt * 512 * warps) + (warps // ksplit) * lut_slice_bytes(warps)


def moe_plans(shape: MoEShape, tokens: int, sm_count: int = 132) -> tuple[LaunchPlan, LaunchPlan]:
    max_active = min(shape.num_experts, tokens * shape.top_k)
    expect = shape.num_experts * (1 - (1 - shape.top_k / shape.num_experts) ** tokens)
    expect = max(1, min(max_active, round(expect)))
    tile = group_tokens(tokens)
    p1 = plan_launch(shape.intermediate, shape.hidden, tokens, 8, expect, max_active, sm_count, tile)
    p2 = plan_launch(shape.hidden, shape.intermediate, tokens, 16, expect, max_active, sm_count, tile)
    p1, p2 = (with_overflow(p, shape, tokens, max_active) for p in (p1, p2))
    return replace(p1, gelu=shape.activation == "gelu_tanh"), p2


def planner_knobs() -> tuple:
    """What `moe_plans` and `layer_carveout` read besides their arguments: the planner functions themselves and the
    module's tuning constants (`tune` and tests change them); part of `layer_launches`' key."""
    return (moe_plans, plan_launch, XS_CAP, BLOCK_XS_CAP, OCCUPANCY_XS, LAYER_CARVEOUT, SPLIT_ABOVE, GROUP_TOKENS,
            WIDE_MIN_CHUNKS, WIDE_MAX_NT, WANT_CTAS_PER_SM, WANT_CTAS_PER_SM_MANY)


@functools.lru_cache(maxsize=4096)
def layer_launches(shape: MoEShape, tokens: int, sm_count: int, knobs: tuple) -> tuple[LaunchPlan, LaunchPlan,
                                                                                      int | None]:
    """A MoE layer's two launch plans and their carveout, memoized: every eager forward (prefill, mixed batches)
    planned each MoE layer again, and an eager `fused_moe` call took 133-143 us of host time on the H200 host
    planning, 98-106 memoized (OLMoE and Mixtral shapes, T = 1-64). `knobs` is `planner_knobs()`, so a changed
    constant or planner plans afresh."""
    p1, p2 = moe_plans(shape, tokens, sm_count)
    return p1, p2, layer_carveout(p1, p2)


def layer_variants(shape: MoEShape, dtype: torch.dtype, device: torch.device | None = None) -> set[kc.Variant]:
    """Every ap_moe.cu build a MoE layer of `shape` launches for 1..MAX_TOKENS tokens of `dtype` activations on
    `device` (what an engine compiles before it serves, `kc.compile_variants`)."""
    sm_count, knobs = _sm_count(device), planner_knobs()
    return {p.variant(dtype) for tokens in range(1, MAX_TOKENS + 1)
            for p in layer_launches(shape, tokens, sm_count, knobs)[:2]}


def group_tokens(tokens: int) -> int:
    """Tokens of an expert one CTA of a launch of `tokens` serves (its token group): all of them up to SPLIT_ABOVE,
    above that half of them (two groups of 4 n-tiles at T = 64, which beat one of 8 on the H200: the 8-n-tile kernel
    has 254 registers), the further group served by overflow slots.

    Smaller groups (CTAs of fewer n-tiles, but an expert's planes decoded again for each further group) were measured
    in session 17 (cuda/NOTES.md): with uniform routing, groups of 8 tokens made the small-expert models' layers 2-7.5%
    faster at T = 16 and up to 5% at T = 64; with skewed routing (popularity 1 / rank) they made them up to 17% slower
    at T = 16-32, while these groups with overflow slots were never more than 2% slower than before. So groups follow
    only the token count.
    """
    if GROUP_TOKENS is not None:
        return min(GROUP_TOKENS, tokens)
    return tokens if tokens <= SPLIT_ABOVE else -(-min(tokens, MAX_TOKENS) // 2)


def overflow_slots(shape: MoEShape, tokens: int, max_active: int, plan: LaunchPlan) -> int:
    """Expert slots a launch needs beyond one an active expert: one per further group of 8 nt tokens an expert gets.

    With n_e tokens expert e needs (n_e - 1) // (8 nt) further groups, and the n_e add up to at most T top-k, so the
    slots needed are at most (T top-k - 1) // (8 nt) however the tokens are routed (cuda/ap_route.cuh assigns
    them). A slot each for every expert and group (a second grid row) would be mostly empty CTAs that still run the
    routing prologue."""
    if plan.token_groups <= 1:
        return 0
    slots = min(tokens, MAX_TOKENS) * shape.top_k
    return min(max_active * (plan.token_groups - 1), (slots - 1) // (8 * plan.nt))


def with_overflow(plan: LaunchPlan, shape: MoEShape, tokens: int, max_active: int) -> LaunchPlan:
    """The launch's grid with its overflow slots; they count tokens per expert in its dynamic shared memory."""
    extra = overflow_slots(shape, tokens, max_active, plan)
    if extra and plan.smem < 4 * shape.num_experts:
        raise ValueError(f"the routing counts of {shape.num_experts} experts need {4 * shape.num_experts} bytes of "
                         f"shared memory, the launch has {plan.smem}")
    return replace(plan, grid=plan.n_tiles * (max_active + extra), overflow=extra)


@dataclass
class MoEWorkspace:
    """Scratch of one (T, dtype, device): reuse across layers, steps and graph replays (not concurrently)."""
    tokens: int
    dtype: torch.dtype
    act: torch.Tensor        # [T * k, I] activation dtype
    partial: torch.Tensor    # [T * k, H] fp32
    counters: torch.Tensor   # [n_tiles of launch 2] int32, zero between launches

    @classmethod
    def create(cls, shape: MoEShape, tokens: int, dtype: torch.dtype, device: torch.device | str) -> "MoEWorkspace":
        device = torch.device(device)
        slots = tokens * shape.top_k
        return cls(tokens, dtype,
                   torch.empty(slots, shape.intermediate, dtype=dtype, device=device),
                   torch.empty(slots, shape.hidden, dtype=torch.float32, device=device),
                   torch.zeros(-(-shape.hidden // 16), dtype=torch.int32, device=device))  # any k-split


def _cuda_ok(x: torch.Tensor) -> bool:
    return x.is_cuda and x.dtype in (torch.float16, torch.bfloat16)


def _check_moe_args(shape: MoEShape, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> None:
    if x.dim() != 2 or x.shape[1] != shape.hidden:
        raise ValueError(f"x must be [T, {shape.hidden}], got {tuple(x.shape)}")
    if tuple(topk_ids.shape) != (x.shape[0], shape.top_k) or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_ids/topk_weights must be [T, {shape.top_k}], got {tuple(topk_ids.shape)} and "
                         f"{tuple(topk_weights.shape)}")
    if shape.num_experts > MAX_EXPERTS or shape.top_k * MAX_TOKENS > MAX_SLOTS:
        raise ValueError(f"the fused kernel supports up to {MAX_EXPERTS} experts and top-k <= "
                         f"{MAX_SLOTS // MAX_TOKENS}; got {shape.num_experts} and {shape.top_k}")


def fused_moe(table: DeviceWeightTable, layer: int, x: torch.Tensor, topk_ids: torch.Tensor,
              topk_weights: torch.Tensor, shape: MoEShape, workspace: MoEWorkspace | None = None) -> torch.Tensor:
    """Routed-expert output [T, H] of one MoE layer at the table's committed bits (see module docstring)."""
    _check_moe_args(shape, x, topk_ids, topk_weights)
    if not _cuda_ok(x):
        return _fused_moe_cpu(table, layer, x, topk_ids, topk_weights, shape)
    outs = []
    for s in range(0, x.shape[0], MAX_TOKENS):
        sl = slice(s, s + MAX_TOKENS)
        outs.append(_fused_moe_cuda(table, layer, x[sl], topk_ids[sl], topk_weights[sl], shape, workspace))
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def _fused_moe_cpu(table, layer, x, topk_ids, topk_weights, shape):
    def weight(e: int, kind: int, in_f: int) -> torch.Tensor:
        rb = table.resident(shape.block(layer, e, kind))
        if rb is None:
            raise ValueError(f"block L{layer}.E{e}.{('gate_up', 'down')[kind]} is not resident in the table")
        return dequantize_resident(rb, in_f, x.dtype)

    return fused_moe_ref(x, topk_ids, topk_weights, lambda e: weight(e, 0, shape.hidden),
                         lambda e: weight(e, 1, shape.intermediate), shape.activation)


def _fused_moe_cuda(table, layer, x, topk_ids, topk_weights, shape, workspace):
    tokens = x.shape[0]
    dev = x.device
    ws = workspace
    if ws is None or ws.tokens < tokens or ws.dtype != x.dtype:
        ws = MoEWorkspace.create(shape, tokens, x.dtype, dev)
    p1, p2, carveout = layer_launches(shape, tokens, _sm_count(dev), planner_knobs())
    if ws.counters.numel() < p2.n_tiles:
        raise ValueError("workspace was made for another shape")
    x = x.contiguous()
    ids = topk_ids.to(torch.int64).contiguous()
    wts = topk_weights.to(torch.float32).contiguous()
    out = torch.empty(tokens, shape.hidden, dtype=x.dtype, device=dev)
    base = layer * shape.num_experts * 2
    x_vec = int(x.data_ptr() % 16 == 0 and shape.hidden % 8 == 0)
    a_vec = int(ws.act.data_ptr() % 16 == 0 and shape.intermediate % 8 == 0)
    k1 = p1.kernel(dev, x.dtype)
    kc.launch(k1, dev, (p1.grid,), (32 * p1.warps,), (
        kc.i32(_MODE_GATE_UP), kc.ptr(table.table), kc.i64(base), kc.ptr(x), kc.i64(shape.hidden), kc.i32(x_vec),
        kc.ptr(ids), kc.ptr(wts), kc.i32(tokens), kc.i32(shape.top_k), kc.i32(shape.num_experts),
        kc.i32(shape.intermediate), kc.i32(shape.hidden), kc.i32(p1.ksplit), kc.i32(p1.n_tiles),
        kc.i32(p1.xs_budget), kc.ptr(ws.act), kc.i64(shape.intermediate), kc.ptr(None), kc.ptr(None)), p1.smem,
        carveout=carveout)
    k2 = p2.kernel(dev, x.dtype)
    kc.launch(k2, dev, (p2.grid,), (32 * p2.warps,), (
        kc.i32(_MODE_DOWN), kc.ptr(table.table), kc.i64(base), kc.ptr(ws.act), kc.i64(shape.intermediate),
        kc.i32(a_vec), kc.ptr(ids), kc.ptr(wts), kc.i32(tokens), kc.i32(shape.top_k), kc.i32(shape.num_experts),
        kc.i32(shape.hidden), kc.i32(shape.intermediate), kc.i32(p2.ksplit), kc.i32(p2.n_tiles),
        kc.i32(p2.xs_budget), kc.ptr(out), kc.i64(shape.hidden), kc.ptr(ws.partial), kc.ptr(ws.counters)), p2.smem,
        overlap_previous=True, carveout=carveout)  # routing, table rows, first planes and LUTs load while launch 1 finishes
    return out


def single_block_plan(out_features: int, in_features: int, tokens: int, sm_count: int = 132) -> LaunchPlan:
    """The launch of one block (`ap_linear`): the MoE planner's, except that a single block takes CTAs of twice the
    warps with the same k-split, twice the row groups a CTA, so fewer CTAs stage the activations: 16 warps where the
    planner picks 8 (2-16 tokens, long K), one CTA an SM in one wave, and 8 where it picks 4 with K split (one token).
    On the H200 the 14336x4096 block got 4-8% faster at T = 8 and 2-11% at T = 16 (T = 2: -4% to +1%; cuda/NOTES.md,
    session 14), and at T = 1 2.8-7% faster at 3, 4, 7 and 8 bits, 0.8% and 1.5% slower at 5 and 6 (session 18). MoE
    layers, many waves of CTAs, lost 2-13% with 16-warp CTAs, so they keep the planner's.

    A 16-warp CTA has its SM to itself (its registers allow no second), so its activations may take up to
    `BLOCK_XS_CAP` of shared memory: the whole K of 8 tokens at K = 4096, in one segment instead of two. On the H200
    the block at T = 8 got 4-7% faster at 5-8 bits, and at T = 16 (two segments instead of four) 7-11% (session 19).
    Their kernel build (PW_WARPS=16), which no MoE launch uses, also stages the byte-path LUT of 5-8 bits shared by
    the k-split warps (ap_moe.cu, PW_LUTSTAGE): 6-8 bits 4-6% faster at T = 2-8, 4 bits 1.5-3.5% slower; and its LUT
    slices are 16 KiB (`BLOCK_LUT_SLICE`, PW_LUTWIDE: more replicas at 7-8 bits): 7 bits 4-8%, 8 bits 8-12.5% faster.
    """
    plan = plan_launch(out_features, in_features, tokens, 16, 1, 1, sm_count)
    if plan.warps == 8:
        wide = plan.resplit(out_features, 16, 16, plan.ksplit)
        xs = activation_budget(min(tokens, 8 * plan.nt), in_features, BLOCK_XS_CAP)
        return replace(wide, xs_budget=xs, smem=checked_smem(launch_smem(xs, wide.nt, wide.warps, wide.ksplit)))
    if tokens == 1 and plan.warps == 4 and plan.ksplit >= 2:
        return plan.resplit(out_features, 16, 8, plan.ksplit)
    return plan


def linear_grid(plan: LaunchPlan, out_features: int, wave: int) -> int:
    """CTAs of a single-block launch: one full wave (`wave` CTAs fit on the GPU at once) where that is more than
    the plan's row tiles, at most one per 16-row group. The kernel gives CTA c the row groups c, c + grid, ...,
    so the row groups spread evenly over the SMs instead of whole tiles of `warps // ksplit` groups: in session 14
    the 448 4-warp tiles of the 14336-row block at T = 1 put four CTAs on 52 SMs and three on the other 80, and the
    224 8-warp tiles at T = 8 two CTAs on 92 SMs and one on 40. Measured on the H200 (cuda/NOTES.md, session 14):
    T = 8 4-9% faster at 5-8 bits, T = 1 3-4% at 5-6 bits, 3-4 bits unchanged."""
    return max(plan.grid, min(wave, -(-out_features // 16)))


def ap_linear(table: DeviceWeightTable, block: int, x: torch.Tensor, out_features: int) -> torch.Tensor:
    """y[T, out] = x[T, in] W_q^T for one block at its committed bits (fp32 accumulation).

    On CUDA a programmatic dependent launch: it reads the block's table row, first planes and LUT before it
    waits for the kernel launched just before it (x after), so that kernel must not write the table, the
    planes or the LUT (`DeviceWeightTable` and the page mover write them with copies, which are not kernels).
    """
    if x.dim() != 2:
        raise ValueError(f"x must be [T, in], got {tuple(x.shape)}")
    if not _cuda_ok(x):
        rb = table.resident(block)
        if rb is None:
            raise ValueError(f"block {block} is not resident in the table")
        return ap_linear_ref(x, dequantize_resident(rb, x.shape[1], x.dtype))
    dev = x.device
    y = torch.empty(x.shape[0], out_features, dtype=x.dtype, device=dev)
    x = x.contiguous()
    for s in range(0, x.shape[0], MAX_TOKENS):
        xs, ys = x[s:s + MAX_TOKENS], y[s:s + MAX_TOKENS]
        n = xs.shape[0]
        p = single_block_plan(out_features, x.shape[1], n, _sm_count(dev))
        k = p.kernel(dev, x.dtype)
        grid = linear_grid(p, out_features, kc.ctas_per_sm(k, 32 * p.warps, p.smem) * _sm_count(dev))
        x_vec = int(xs.data_ptr() % 16 == 0 and x.shape[1] % 8 == 0)
        kc.launch(k, dev, (grid,), (32 * p.warps,), (
            kc.i32(_MODE_LINEAR), kc.ptr(table.table), kc.i64(block), kc.ptr(xs), kc.i64(x.shape[1]), kc.i32(x_vec),
            kc.ptr(None), kc.ptr(None), kc.i32(n), kc.i32(1), kc.i32(1), kc.i32(out_features), kc.i32(x.shape[1]),
            kc.i32(p.ksplit), kc.i32(p.n_tiles), kc.i32(p.xs_budget), kc.ptr(ys), kc.i64(out_features),
            kc.ptr(None), kc.ptr(None)), p.smem,
            overlap_previous=True)  # table row, first planes and LUT load while the previous kernel finishes
    return y
