"""DeviceExpertStore: the ExpertStore that serves routed experts from the device weight table and owns their GPU planes.

Memory: the 8-bit master (all planes, all LUTs of every block) stays in host memory, pinned when the
device is CUDA. On the device, block i holds planes 0..q_i-1, one tensor per plane allocated through
torch (dropping one really frees device memory), or with `arena=True` from a `pwruntime.plane_arena.PlaneArena`
that `keep_dense()` packs at every iteration boundary (its moves repoint rows; `_named` says which tensors a row
names, the ones that may move), plus `LUT_{q_i}`; its
`pwruntime.kernels.DeviceWeightTable` row names them. A block that `commit_in_place` holds (dp-llm)
keeps its leading GPU planes above q. Every row change goes through `_write_row`, which writes the
table's host mirror and returns the tensors the row stopped naming; the tensors a new row names are
allocated at once and filled from the master by a `CopyBatch` that `flush()` issues (one driver call where the
driver can) before it sends the rows written since to the device in one copy; only then does it hand what
was `retire`d to a `stream_marks.DeferredFree`,
which frees it once the compute stream has passed that point, because kernels queued earlier may still
read it. `sync()`, `moe()` and `weight()` flush; the page mover flushes at every iteration boundary.

Compute: `moe()` runs the fused AP MoE kernel (`fused_moe`) for T <= 128 tokens (`FUSED_MAX_TOKENS`), and
inside a CUDA-graph capture for any T whose prefill path would read counts back (`prefill_syncs`), a
launch set per 64 tokens, with one `MoEWorkspace` per (token bucket, dtype, top-k) reused across layers
(no host sync, no data-dependent allocation: capturable in a CUDA graph) and fills `down_in_norm` from the
workspace's activations. For T > 128 (prefill) it runs `pwruntime.prefill_layer.prefill_moe`: the experts
dequantized at their committed bits, at most `prefill_chunk_bytes` of weights at once, through torch's grouped GEMM
(or the fused AP GEMM where a layer is at 3-4 bits); never a set of launches per expert. Off CUDA, or in fp32, the
kernels' pure-torch fallbacks run; the fused fallback gives no activations, so a `down_in_norm` request takes the
prefill path there.

Following the page table: with a `policies.PageTable` attached, `sync()` brings every idle block's
row to the table's committed bits (and a held block's leading GPU planes). That is how a policy's
`initialize` and `in_place` commits reach the device; `CudaPageMover.landed()` calls it at every
iteration boundary, and `moe()`/`weight()` call it when the committed bits differ from the rows
(never during CUDA-graph capture). Blocks with a transfer in flight belong to the mover
(`pwruntime.page_mover`), which changes their rows through `lower`, `stage_planes` and `raise_bits`.
"""
from __future__ import annotations

from collections.abc import Sequence
from contextlib import contextmanager

import numpy as np
import torch

from policies.apformat import MAX_BITS
from policies.memory_budget import DEFAULT_PREFILL_CHUNK_BYTES
from pwruntime.kernels import (DeviceWeightTable, MoEShape, MoEWorkspace, ap_gemm, dequant, dequantize_blocks,
                               fused_moe)
from pwruntime.copy_batch import CopyBatch
from pwruntime.plane_arena import PlaneArena
from pwruntime.kernels.device_table import MIN_BITS, TOP_PLANES, as_int32, pack_top_planes_
from pwruntime.kernels.layer_ops import row_norms
from pwruntime.kernels.moe import MAX_TOKENS, layer_variants
from pwruntime.model.experts import block_shape, checked_block_index
from pwruntime.prefill_layer import capturing, prefill_moe, prefill_syncs
from pwruntime.quant.ap_checkpoint import KINDS, LayerBlocks
from pwruntime.stream_marks import DeferredFree, tensor_bytes

# Batches of up to this many tokens run the fused kernel, in launches of at most MAX_TOKENS (64); larger ones
# dequantize (prefill). Two launches of the fused kernel took 0.30-0.65 of the dequantize path's time at 65-128
# tokens and 3-4 bits, 0.53-1.05 at 8 bits; at 192 tokens 8 bits lose and at 256 every width (cuda/NOTES.md, s. 10).
FUSED_MAX_TOKENS = 2 * MAX_TOKENS
TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # one workspace per bucket (and dtype, top-k)
# Inside a CUDA-graph capture a MoE of more tokens whose prefill path reads counts back runs the fused kernel a launch
# per MAX_TOKENS tokens, each reading the experts it routes to again. A mixed step's pieces take such a bucket only
# while those re-reads stay under this many bytes a layer (about 80 us of the H200's bandwidth, what a layer's eager
# prefill spends on its host syncs); past it the step runs eagerly. A Gemma-4-shaped model (128 experts of 2816 x 704,
# 761 MB a layer at 8 bits) took 372 ms a mixed step (up to 2,048 tokens) from the pieces and 86 ms eagerly (H100,
# session 52), when its prefill, two chunks of experts, still read counts back; since session 64 it captures.
CAPTURE_REREAD_BYTES = 256 << 20


def _kernel_path(x: torch.Tensor) -> bool:
    """Whether fused_moe runs the CUDA kernel (and fills the workspace) for activations x."""
    return x.is_cuda and x.dtype in (torch.float16, torch.bfloat16)


def _resolve(device: str | torch.device) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _host_master(blocks: LayerBlocks, pin: bool) -> LayerBlocks:
    """One kind of one layer on the host (int32 words, fp16 LUTs), pinned if asked."""
    def host(t: torch.Tensor) -> torch.Tensor:
        t = t.detach().to("cpu").contiguous()
        return t.pin_memory() if pin and not t.is_pinned() else t

    return LayerBlocks(host(as_int32(blocks.planes)), {int(b): host(lut) for b, lut in blocks.luts.items()})


class DeviceExpertStore:
    """Routed experts in AP form on a device (see the module docstring)."""

    graph_epoch = 0  # pwruntime.cuda_graphs: would change if a tensor a captured forward uses were reallocated

    @property
    def capturable(self) -> bool:
        """Decode (T <= 64, fp16/bf16 on CUDA) is stream-ordered device work that a CUDA graph may capture."""
        return self.device.type == "cuda"

    def __init__(
        self,
        layers: Sequence[dict[str, LayerBlocks]],
        *,
        experts: int,
        hidden: int,
        intermediate: int,
        bits: Sequence[int],
        device: str | torch.device,
        dtype: torch.dtype = torch.float16,
        moe_layers: Sequence[int] | None = None,
        initial_bits: int | np.ndarray = MAX_BITS,
        table=None,
        prefill_chunk_bytes: int = DEFAULT_PREFILL_CHUNK_BYTES,
        arena: bool = False,
        activation: str = "silu",
    ) -> None:
        self.device = _resolve(device)
        self.activation = activation   # the experts' gate activation (kernels.reference.ACTIVATIONS)
        self.experts, self.hidden, self.intermediate = int(experts), int(hidden), int(intermediate)
        self.bits = tuple(sorted(int(b) for b in bits))
        self.dtype = dtype
        self.prefill_chunk_bytes = int(prefill_chunk_bytes)
        pin = self.device.type == "cuda"
        self.master = [{kind: _host_master(blocks[kind], pin) for kind in KINDS} for blocks in layers]
        self.moe_layers = tuple(moe_layers) if moe_layers is not None else tuple(range(len(self.master)))
        n = self.num_blocks
        # each block's host planes as views of the master, made once (a reload's unbind would cost as much as a copy)
        self._host_planes = [tuple(m.planes[e].unbind(0)) for m, e in map(self._master_of, range(n))]
        self.table = DeviceWeightTable(n, self.device)
        self._planes: list[tuple[torch.Tensor, ...]] = [()] * n
        self._luts: list[torch.Tensor | None] = [None] * n
        self.row_bits = np.zeros(n, dtype=np.int8)  # committed bits of each device row
        self.row_planes = np.zeros(n, dtype=np.int8)  # planes each row names
        self.row_nbytes = np.zeros(n, dtype=np.int64)  # device bytes each row names (planes + LUT)
        self.deferred = DeferredFree(self.device)
        self._retiring: list[torch.Tensor] = []  # retired, freed after the next flush
        self.arena = PlaneArena(self.device, self._arena_sizes()) if arena else None
        self._named: dict[int, int] = {}  # with an arena: address -> block of every tensor a row names
        self._uploads = self.new_batch()  # what the rows written since the last flush need, issued by it
        self._moves = CopyBatch(self.device)  # the arena's moves (keep_dense)
        self._workspaces: dict[tuple[int, torch.dtype, int], MoEWorkspace] = {}
        self._fused_gemm = True   # prefill may take the fused AP GEMM (`dequantizing` turns it off for a while)
        self._bits = np.zeros(n, dtype=np.int8)
        self.page_table = None
        if table is not None:
            self.attach_table(table)
        else:
            self.set_bits(initial_bits)

    @classmethod
    def from_ap_store(cls, ap, *, device: str | torch.device, dtype: torch.dtype | None = None, table=None,
                      **kw) -> DeviceExpertStore:
        """Build from an `APExpertStore` at its current bits (or `table`'s). The AP store's layers are
        replaced, one at a time, by the host master (pinned on CUDA) that both stores then share: host
        memory is not doubled and the AP store's device copies, if any, go."""
        pin = _resolve(device).type == "cuda"
        for layer, blocks in enumerate(ap.layers):
            ap.layers[layer] = {kind: _host_master(blocks[kind], pin) for kind in KINDS}
        ap.clear_cache()
        return cls(ap.layers, experts=ap.experts, hidden=ap.hidden, intermediate=ap.intermediate, bits=ap.bits,
                   moe_layers=ap.moe_layers, device=device, dtype=dtype or ap.dtype, initial_bits=ap.current_bits(),
                   table=table, activation=ap.activation, **kw)

    # ------------------------------------------------------------ blocks
    @property
    def num_layers(self) -> int:
        return len(self.master)

    @property
    def num_blocks(self) -> int:
        return self.num_layers * self.experts * 2

    def block_index(self, layer: int, expert: int, kind: str | int) -> int:
        return checked_block_index(layer, expert, kind, self.num_layers, self.experts)

    def shape(self, kind: str | int) -> tuple[int, int]:
        """(out, in) of a block of this kind."""
        return block_shape(kind, self.hidden, self.intermediate)

    def _master_of(self, i: int) -> tuple[LayerBlocks, int]:
        layer, expert, kind = i // (2 * self.experts), (i // 2) % self.experts, i % 2
        return self.master[layer][KINDS[kind]], expert

    def master_planes(self, i: int, lo: int, hi: int) -> list[torch.Tensor]:
        """Host planes lo..hi-1 of block i, each [out, words] int32 (slices of the pinned master)."""
        return list(self._host_planes[i][lo:hi])

    def master_lut(self, i: int, bits: int) -> torch.Tensor:
        m, e = self._master_of(i)
        if bits not in m.luts:
            raise ValueError(f"block {i}: no LUT for {bits} bits in the AP master (it has {sorted(m.luts)})")
        return m.luts[bits][e]

    def _arena_sizes(self) -> dict[int, int]:
        """The tensor sizes the store allocates and the most of each alive at once, with room to spare: every plane
        of every block twice, and four LUTs a block at each bitwidth (the row's, an offload's in flight, retired
        ones waiting for the device)."""
        sizes: dict[int, int] = {}
        for i in range(min(2, self.num_blocks)):   # a gate_up block and a down block
            count = self.num_blocks // 2
            size = self._host_planes[i][0].nbytes
            sizes[size] = sizes.get(size, 0) + 2 * MAX_BITS * count
            for b in self.bits:
                size = self.master_lut(i, b).nbytes
                sizes[size] = sizes.get(size, 0) + 4 * count
        return sizes

    def new_batch(self) -> CopyBatch:
        """A CopyBatch whose destinations come from this store's memory (the arena's, or torch's allocator)."""
        return CopyBatch(self.device, alloc=self.arena.empty if self.arena is not None else None)

    # ------------------------------------------------------------ rows
    def resident_bytes(self) -> int:
        """Device bytes the rows name (planes + LUTs); transfers in flight and deferred frees not included."""
        return int(self.row_nbytes.sum())

    def resident(self, i: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor | None]:
        """(planes, LUT) that row i names."""
        return self._planes[i], self._luts[i]

    def stage(self, i: int, lo: int, hi: int, lut_bits: int | None,
              batch: CopyBatch) -> tuple[tuple[torch.Tensor, ...], torch.Tensor | None]:
        """New device tensors for planes lo..hi-1 of block i in the table's layout (and LUT_lut_bits), filled when
        `batch` is issued. Planes 0..2 move together and are nibble-packed on the device, in place, right after the
        batch's copies (`device_table.pack_top_planes_`)."""
        if 0 < lo < TOP_PLANES or 0 == lo < hi < TOP_PLANES:
            raise ValueError(f"block {i}: planes 0..{TOP_PLANES - 1} move together, asked for {lo}..{hi - 1}")
        planes = tuple(batch.upload(p) for p in self.master_planes(i, lo, hi))
        if lo == 0 and hi > 0:
            top = planes[:TOP_PLANES]
            batch.after(lambda: pack_top_planes_(top))
        return planes, None if lut_bits is None else batch.upload(self.master_lut(i, lut_bits))

    def retire(self, tensors) -> None:
        """Free `tensors` once the current stream has passed the next `flush()`."""
        self._retiring.extend(tensors)

    def flush(self) -> None:
        """The rows written since the last flush reach the device (one stream-ordered copy), after the uploads they
        need (one batch); what was retired before is freed once the current stream has passed that copy."""
        self._uploads.issue()
        self.table.flush()
        if self._retiring:
            self.deferred.add(self._retiring)
            self._retiring = []

    def keep_dense(self) -> int:
        """With an arena, once an iteration boundary's rows are out (the page mover's last step there): the moves
        that keep each class dense (one batch, the rows naming the moved tensors in one copy after it), then the
        classes' free tails go (pwruntime.plane_arena); returns the moves (0 without an arena)."""
        if self.arena is None:
            return 0
        moves = self.arena.pack(lambda t: t.data_ptr() in self._named, self._relocate, self._moves)
        self._moves.issue()
        self.table.flush()
        self.arena.trim()
        return moves

    def _relocate(self, old: torch.Tensor, new: torch.Tensor) -> None:
        """The arena moved `old`, which a row names, to `new`: the row names `new` (on the device with keep_dense's row
        copy)."""
        i = self._named.pop(old.data_ptr())
        self._named[new.data_ptr()] = i
        self.table.repoint(i, old, new, flush=False)
        row = self.table.resident(i)   # the row's tensors, `new` in `old`'s place
        self._planes[i], self._luts[i] = row.planes, row.lut

    def _write_row(self, i: int, planes: tuple[torch.Tensor, ...], lut: torch.Tensor | None,
                   bits: int) -> list[torch.Tensor]:
        """Point row i at `planes` and `lut`, committing `bits` (on the device at the next `flush()`); returns
        what it stopped naming."""
        old = self._planes[i] + ((self._luts[i],) if self._luts[i] is not None else ())
        if bits == 0:
            self.table.clear(i, flush=False)
            planes, lut = (), None
        else:
            self.table.set_block(i, planes, lut, bits, flush=False)
        kept = planes + ((lut,) if lut is not None else ())
        self._planes[i], self._luts[i] = planes, lut
        self.row_bits[i], self.row_planes[i], self.row_nbytes[i] = bits, len(planes), tensor_bytes(kept)
        kept_ids = {id(t) for t in kept}
        dropped = [t for t in old if id(t) not in kept_ids]
        if self.arena is not None:
            for t in dropped:
                del self._named[t.data_ptr()]
            self._named.update((t.data_ptr(), i) for t in kept)
        return dropped

    def lower(self, i: int, to_bits: int) -> list[torch.Tensor]:
        """Offload commit on the current stream: LUT_to is uploaded and row i cut to planes 0..to-1 (both reach the
        device at the next `flush()`).

        Returns the surplus planes and the old LUT: queued kernels may still read them, so the caller
        frees them after a mark it records now."""
        if to_bits == 0:
            return self._write_row(i, (), None, 0)
        lut = self._uploads.upload(self.master_lut(i, to_bits))
        return self._write_row(i, self._planes[i][:to_bits], lut, to_bits)

    def stage_planes(self, i: int, to_bits: int, batch: CopyBatch) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        """Reload staging into `batch` (the caller issues it on its copy stream): new device tensors for planes
        q..to-1 and LUT_to (row i unchanged)."""
        return self.stage(i, len(self._planes[i]), to_bits, to_bits, batch)

    def raise_bits(self, i: int, planes: tuple[torch.Tensor, ...], lut: torch.Tensor,
                   to_bits: int) -> list[torch.Tensor]:
        """Reload commit: row i names its planes plus `planes` and `lut`; returns the old LUT (retire it)."""
        return self._write_row(i, self._planes[i] + tuple(planes), lut, to_bits)

    # ------------------------------------------------------------ following the bits
    def attach_table(self, table) -> None:
        """Follow `table` (a policies.PageTable in this store's block order) from now on; syncs at once."""
        if len(table.q) != self.num_blocks:
            raise ValueError(f"page table has {len(table.q)} blocks, store has {self.num_blocks}")
        self._check_bitwidths(table.bits, "page table bitwidths")
        self.page_table = table
        self.sync()

    def _check_bitwidths(self, bits, what: str) -> None:
        """Every bitwidth in `bits` (0 = not resident) has a LUT in the master and keeps planes 0..2 whole."""
        bits = set(bits) - {0}
        missing = sorted(bits - set(self.bits))
        if missing:
            raise ValueError(f"{what} {missing} are not stored in the AP master (it has {self.bits})")
        low = sorted(b for b in bits if b < MIN_BITS)
        if low:
            raise ValueError(f"{what} {low}: device blocks keep planes 0..2 together, so bitwidths must be {MIN_BITS}..8")

    def set_bits(self, bits: int | np.ndarray) -> None:
        """Serve every block (array [num_blocks]) or all at one bitwidth; detaches any page table."""
        arr = np.broadcast_to(np.asarray(bits, dtype=np.int64), (self.num_blocks,))
        self._check_bitwidths(arr.tolist(), "bitwidths")
        self._bits = arr.astype(np.int8)
        self.page_table = None
        self.sync()

    def current_bits(self) -> np.ndarray:
        return self.row_bits.copy()

    def sync(self) -> int:
        """Bring every idle block's row to its committed bits; returns the number of rows rewritten."""
        self.deferred.collect()
        pt = self.page_table
        if pt is None:
            q, keep, idle = self._bits, self._bits, np.ones(self.num_blocks, dtype=bool)
        else:
            q = pt.q
            keep = np.where(pt.held, pt.leading_gpu_planes(), q) if pt.held.any() else q  # held: dp-llm only
            idle = ~pt.busy
        stale = np.flatnonzero(idle & ((self.row_bits != q) | (self.row_planes != keep)))
        for i in stale.tolist():
            self.follow(i, int(q[i]), int(keep[i]))
        self.flush()
        return int(stale.size)

    def follow(self, i: int, q: int, keep: int) -> None:
        """Rewrite row i to `q` bits naming planes 0..keep-1 (uploading what it lacks, retiring the rest; on the
        device at the next `flush()`)."""
        if q == 0:
            self.retire(self._write_row(i, (), None, 0))
            return
        have = self._planes[i]
        new, lut = self.stage(i, len(have), max(keep, len(have)), None if self.row_bits[i] == q else q, self._uploads)
        self.retire(self._write_row(i, have[:keep] + new, self._luts[i] if lut is None else lut, q))

    def _follow_table(self) -> None:
        """Before a compute call: rows brought to the table's bits and on the device (never while capturing)."""
        if capturing(self.device):
            return
        pt = self.page_table
        if pt is not None and not np.array_equal(self.row_bits, pt.q):
            self.sync()
        else:
            self.flush()  # rows written since (nothing when none were)

    # ------------------------------------------------------------ compute
    def weight(self, layer: int, expert: int, kind: str) -> torch.Tensor:
        """The block dequantized at its committed bits (zeros at 0 bits): gate_up [2I, H] or down [H, I]."""
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        self._follow_table()
        out_f, in_f = self.shape(kind)
        return dequantize_blocks(self.table, [self.block_index(layer, expert, kind)], out_f, in_f, self.dtype)[0]

    def moe_shape(self, top_k: int) -> MoEShape:
        return MoEShape(self.experts, self.hidden, self.intermediate, int(top_k), self.activation)

    def captured_tokens_limit(self, dtype: torch.dtype, top_k: int) -> int | None:
        """The most tokens a captured `moe` should take (None: any): any where the prefill path captures (reads nothing
        back), else as many as keep the fused launches' re-reads under CAPTURE_REREAD_BYTES (FUSED_MAX_TOKENS at
        least)."""
        shape = self.moe_shape(top_k)
        if not prefill_syncs(shape, torch.empty(0, self.hidden, dtype=dtype, device=self.device)):
            return None
        experts = min(shape.num_experts, MAX_TOKENS * shape.top_k)  # that a launch may route to
        launch_bytes = experts * 3 * self.hidden * self.intermediate * MAX_BITS // 8
        return max(FUSED_MAX_TOKENS, MAX_TOKENS * (1 + CAPTURE_REREAD_BYTES // launch_bytes))

    def kernel_variants(self, top_k: int) -> set:
        """The CUDA builds `moe` launches with `top_k` experts a token: the fused kernel's at 1..64 tokens a launch and
        the prefill's dequantization and fused AP GEMM (none off CUDA or in fp32, where the fallbacks run)."""
        if self.device.type != "cuda" or self.dtype not in (torch.float16, torch.bfloat16):
            return set()
        return (layer_variants(self.moe_shape(top_k), self.dtype, self.device) | {dequant.variant(self.dtype)}
                | {ap_gemm.variant(self.dtype, rows) for rows in ap_gemm.TILE_ROWS})

    def workspace(self, tokens: int, dtype: torch.dtype, top_k: int) -> MoEWorkspace:
        """The workspace of `tokens`' bucket (created once, then reused by every layer and step)."""
        bucket = next(b for b in TOKEN_BUCKETS if b >= tokens)
        key = (bucket, dtype, int(top_k))
        ws = self._workspaces.get(key)
        if ws is None:
            ws = self._workspaces[key] = MoEWorkspace.create(self.moe_shape(top_k), bucket, dtype, self.device)
        return ws

    @contextmanager
    def dequantizing(self):
        """Within it every prefill layer dequantizes, whatever its bits: the path that holds the most memory, which
        a profiling forward must see (`activation_profile`), since a layer at 3-4 bits may later rise."""
        saved, self._fused_gemm = self._fused_gemm, False
        try:
            yield
        finally:
            self._fused_gemm = saved

    def moe(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
            down_in_norm: torch.Tensor | None = None) -> torch.Tensor:
        self._follow_table()
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"no MoE layer {layer}: the store has {self.num_layers}")
        tokens, k = topk_ids.shape
        kernel = _kernel_path(x)
        # inside a capture (a mixed step's piecewise graph) the prefill path only where it reads nothing back
        prefill = tokens > FUSED_MAX_TOKENS and not (
            kernel and capturing(self.device) and prefill_syncs(self.moe_shape(k), x))
        if prefill or (down_in_norm is not None and not kernel):
            return prefill_moe(self.table, self.moe_shape(k), layer, x, topk_ids, topk_weights,
                               self.prefill_chunk_bytes, down_in_norm, self._fused_gemm)
        if tokens <= MAX_TOKENS:
            return self._fused(layer, x, topk_ids, topk_weights, down_in_norm, kernel)
        out = torch.empty_like(x)
        for s in range(0, tokens, MAX_TOKENS):  # a launch set per 64 tokens, each in its bucket's workspace
            sl = slice(s, s + MAX_TOKENS)
            out[sl] = self._fused(layer, x[sl], topk_ids[sl], topk_weights[sl],
                                  None if down_in_norm is None else down_in_norm[sl], kernel)
        return out

    def _fused(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
               down_in_norm: torch.Tensor | None, kernel: bool) -> torch.Tensor:
        """The fused kernel (or its pure-torch fallback) on at most MAX_TOKENS tokens; down norms from its workspace."""
        tokens, k = topk_ids.shape
        ws = self.workspace(tokens, x.dtype, k) if kernel else None
        out = fused_moe(self.table, layer, x, topk_ids, topk_weights, self.moe_shape(k), ws)
        if down_in_norm is not None:
            row_norms(ws.act[:tokens * k], out=down_in_norm)
        return out
