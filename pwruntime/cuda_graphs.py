"""DecodeGraphs: MoEModel.forward of pure-decode batches captured in CUDA graphs, one per padded batch size.

As in vLLM's CUDA-graph runner, a decode batch of n sequences (one new token each) is padded to the
smallest captured size >= n (1, 2, 4, ..., 64, up to max_num_seqs) and replayed from static input
buffers: input_ids, positions, seq_lens (context + 1), block_tables [size, max_blocks] and
slot_mapping. Padding rows are harmless: token 0 at position 0, one token long, block table and
K/V slot in the KV cache's scratch block (KVCache(scratch=True), an id the pool never hands out).

Everything the forward does on that path is stream-ordered device work: the attention plan takes
the static tensors as they are (`AttentionMetadata.seq_lens`, the decode kernel, which must take every layer's heads:
`model.graph_attention`), the layer's small ops are
fixed-shape kernels (kernels.layer_ops), and the expert store must say it is capturable (`store.capturable`; the
fused AP kernel reads the device page table at run time, so committing new bits between replays
needs no recapture). Routing records are static outputs of the graph too, also packed into one word array inside
the graph (`pack_routing`, so a replay's routing leaves in one copy), and so are the LM head's logits of every row;
callers get views of the real rows, valid until the next replay. A batch in which some request samples (temperature,
top-k, top-p, min-p) is then sampled by a second small graph per size over those logits (`sample`): its rows' values
in one transfer, one replay for what eagerly is a dozen launches.

A graph bakes the addresses of what it touches, so graphs are dropped and captured again when
`model.experts` is another object, when the store bumps its `graph_epoch` (a store must do so whenever it
reallocates a tensor a captured forward uses, e.g. its MoE workspaces), or when the KV cache's `graph_epoch` moves.
On CUDA it does not: the attention kernels and the K/V writes reach the caches through the cache's pointer table
(`KVCache.ptrs`), which a resize rewrites, so the planner growing and shrinking the pool under pressure costs no
capture (it used to cost every resize its graphs and `settle_steps` eager decode steps, 4-5 ms each for the demo).
Graphs are captured lazily, on a size's first use (`capture_all` warms them all). After a change, new captures wait
until `settle_steps` decode calls passed without another one (they run eagerly meanwhile). If a capture fails,
graphs are disabled (logged) and the caller runs eagerly.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field, fields, replace

import numpy as np
import torch

from pwruntime.block_tables import TableRows
from pwruntime.kv_cache import KVCache
from pwruntime.model.attention_plan import DECODE_KERNEL_DTYPES, AttentionMetadata, place_block_tables
from pwruntime.model.moe_model import ForwardOutput, LayerRouting, pack_routing
from pwruntime.sampling import GREEDY_ROW, ROW_VALUES, needed_cuts, sample_rows

log = logging.getLogger(__name__)

GRAPH_SIZES = (1, 2, 4, 8, 16, 32, 64)   # 64 = the fused MoE kernel's tokens per launch


def _numpy(a: np.ndarray | torch.Tensor) -> np.ndarray:
    return a if isinstance(a, np.ndarray) else a.numpy()


def graph_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """Padded batch sizes to capture: GRAPH_SIZES up to the first that holds max_num_seqs."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    sizes = []
    for s in GRAPH_SIZES:
        sizes.append(s)
        if s >= max_num_seqs:
            break
    return tuple(sizes)


def padded_size(n: int, sizes: tuple[int, ...]) -> int | None:
    """The smallest size >= n, or None when n is larger than every size."""
    return next((s for s in sizes if s >= n), None)


def take_sampled(ids: torch.Tensor, src: torch.Tensor, sampled: torch.Tensor | None) -> torch.Tensor:
    """Token ids with each row whose `src` is >= 0 replaced by `sampled[src]`: the tokens the previous step sampled
    on the device, which an asynchronous engine feeds to this step before the host has them (device work only)."""
    if sampled is None:
        return ids
    return torch.where(src >= 0, sampled[src.clamp(min=0)], ids)


@dataclass(frozen=True)
class DecodeRows:
    """A decode batch on the host: per sequence its new token, that token's position and its block ids; with
    `token_src`, rows whose entry is >= 0 take their token from the previous step's sampled tokens instead
    (`take_sampled`; their `token_ids` entry is ignored). With hybrid KV groups `block_tables` are group 0's and
    `more_tables` those of groups 1, 2, ... (`group`). Tables are TableRows (a runner's BlockTables); lists of ids
    are taken as they are (`TableRows.of`)."""
    token_ids: list[int]
    positions: list[int]
    block_tables: TableRows
    token_src: list[int] | None = None
    more_tables: tuple[TableRows, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.block_tables, TableRows):
            object.__setattr__(self, "block_tables", TableRows.of(self.block_tables))
        if any(not isinstance(t, TableRows) for t in self.more_tables):
            object.__setattr__(self, "more_tables", tuple(t if isinstance(t, TableRows) else TableRows.of(t)
                                                          for t in self.more_tables))

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def max_blocks(self) -> int:
        return self.block_tables.max_blocks

    @property
    def num_groups(self) -> int:
        return 1 + len(self.more_tables)

    def group(self, g: int) -> "DecodeRows":
        """These rows with KV group g's block tables (and no others)."""
        return replace(self, block_tables=self.block_tables if g == 0 else self.more_tables[g - 1], more_tables=())


@dataclass(frozen=True)
class DecodeInputs:
    """The graph's inputs, rows padded to a graph size (numpy on the host, or the static device buffers).

    Made by `alloc`, the five arrays are typed views of one byte buffer (`raw`, block tables last), so a batch
    padded into a pinned host copy (`pad(..., out=host)`) reaches the device in one transfer (`fill_from`)."""
    input_ids: np.ndarray | torch.Tensor      # [size] int64
    positions: np.ndarray | torch.Tensor      # [size] int64
    seq_lens: np.ndarray | torch.Tensor       # [size] int32: context + 1
    block_tables: np.ndarray | torch.Tensor   # [size, max_blocks] int32
    slot_mapping: np.ndarray | torch.Tensor   # [size] int64
    token_src: np.ndarray | torch.Tensor      # [size] int64: the previous step's sampled row feeding it, or -1
    raw: torch.Tensor | None = field(default=None, repr=False, compare=False)  # the byte buffer under them

    ARRAYS = ("input_ids", "positions", "seq_lens", "block_tables", "slot_mapping", "token_src")

    @classmethod
    def pad(cls, rows: DecodeRows, size: int, max_blocks: int, block_size: int, scratch: int,
            out: "DecodeInputs | None" = None, window: int | None = None) -> "DecodeInputs":
        """Real rows first, then padding rows (token 0, position 0, length 1, everything on `scratch`); written
        into the first `size` rows of `out` (host buffers from `alloc`) when given, else into new arrays. With the
        tables' sliding `window` (a hybrid KV group's) a row's entries before the blocks its window reads are left
        on `scratch`: nothing reads them, and a long context's table is not read whole each step."""
        n = len(rows)
        if n > size or (n and rows.max_blocks > max_blocks):
            raise ValueError(f"{n} rows of up to {rows.max_blocks if n else 0} blocks do not fit "
                             f"{size} x {max_blocks}")
        if out is None:
            ids, pos, lens = np.zeros(size, np.int64), np.zeros(size, np.int64), np.zeros(size, np.int32)
            tables, slots, src = np.empty((size, max_blocks), np.int32), np.empty(size, np.int64), np.empty(size, np.int64)
        else:
            if out.block_tables.shape[1] != max_blocks or out.input_ids.shape[0] < size:
                raise ValueError(f"buffers of {tuple(out.block_tables.shape)} cannot take {size} x {max_blocks}")
            ids, pos, lens, tables, slots, src = (_numpy(getattr(out, a))[:size] for a in cls.ARRAYS)
            ids[n:], pos[n:] = 0, 0
        ids[:n], pos[:n] = rows.token_ids, rows.positions
        src[n:] = -1
        src[:n] = -1 if rows.token_src is None else rows.token_src
        np.add(pos, 1, out=lens, casting="unsafe")
        tables.fill(scratch)
        slots.fill(scratch * block_size)
        if n:   # every row's blocks from its window's first (place_block_tables)
            lengths = rows.block_tables.lengths
            short = np.flatnonzero(lengths * block_size <= pos[:n])
            if short.size:
                i = int(short[0])
                raise ValueError(f"row {i}: {lengths[i]} blocks of {block_size} cannot hold position {pos[i]}")
            place_block_tables(rows.block_tables, tables, block_size, window, pos[:n])
            slots[:n] = tables[np.arange(n), pos[:n] // block_size].astype(np.int64) * block_size + pos[:n] % block_size
        return out if out is not None else cls(ids, pos, lens, tables, slots, src)

    @classmethod
    def alloc(cls, size: int, max_blocks: int, device: torch.device, pin_memory: bool = False) -> "DecodeInputs":
        """Zeroed buffers of `size` rows, typed views of one byte buffer (8-byte arrays first, block tables last)."""
        layout = (("input_ids", torch.long, (size,)), ("positions", torch.long, (size,)),
                  ("slot_mapping", torch.long, (size,)), ("token_src", torch.long, (size,)), ("seq_lens", torch.int32, (size,)),
                  ("block_tables", torch.int32, (size, max_blocks)))
        nbytes = [int(np.prod(shape)) * dtype.itemsize for _, dtype, shape in layout]
        raw = torch.zeros(sum(nbytes), dtype=torch.uint8, device=device, pin_memory=pin_memory)
        views, offset = {}, 0
        for (name, dtype, shape), n in zip(layout, nbytes):
            views[name] = raw[offset:offset + n].view(dtype).view(shape)
            offset += n
        return cls(**views, raw=raw)

    @classmethod
    def alloc_host(cls, size: int, max_blocks: int, pin_memory: bool = False) -> "DecodeInputs":
        """`alloc` on the host, the arrays numpy views of the byte buffer (what `pad` writes without converting)."""
        host = cls.alloc(size, max_blocks, torch.device("cpu"), pin_memory)
        return cls(*(getattr(host, a).numpy() for a in cls.ARRAYS), raw=host.raw)

    def fill_from(self, host: "DecodeInputs", size: int | None = None) -> None:
        """Copy host arrays into the first rows of these device buffers (stream-ordered). From host buffers of
        the same `alloc` shape, one transfer of everything up to row `size` of the block tables (all rows when
        None); from arrays, one copy each (pageable sources are staged by the driver before the call returns)."""
        with torch.inference_mode():   # the buffers may be inference tensors if made under inference mode
            if self.raw is not None and host.raw is not None and host.raw.shape == self.raw.shape:
                rows = self.block_tables.shape[0] if size is None else size
                end = self.raw.numel() - self.block_tables[rows:].numel() * self.block_tables.element_size()
                self.raw[:end].copy_(host.raw[:end], non_blocking=True)
                return
            for name in self.ARRAYS:
                src = getattr(host, name)
                src = torch.from_numpy(src) if isinstance(src, np.ndarray) else src
                getattr(self, name)[:src.shape[0]].copy_(src, non_blocking=True)

    def metadata(self, size: int) -> AttentionMetadata:
        """Metadata over the first `size` rows. Its host context lengths are placeholders (0): what a replay reads is
        the device's `seq_lens`, and the plan builds nothing from them on the host (`AttentionPlan.build`)."""
        return AttentionMetadata([1] * size, [0] * size, self.block_tables[:size],
                                 self.slot_mapping[:size], self.seq_lens[:size])


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    out: ForwardOutput          # static outputs of the padded batch (with the routing packed, when recorded)
    # its logits' samplers by the cuts they run (top-k, top-p, min-p; `sampling.needed_cuts`): graph and static tokens
    samplers: dict[tuple[bool, bool, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = field(default_factory=dict)


class GraphSet:
    """What decode graphs and a mixed step's piecewise graphs (pwruntime.mixed_graphs) share: whether this model,
    store and cache can be captured, when captures go stale (see the module docstring), the settle count, and
    the warm-up-then-capture of one forward piece into the set's memory pool."""

    def __init__(self, model, kv: KVCache, settle_steps: int = 0, sampled: torch.Tensor | None = None):
        """`sampled`: the device buffer of the previous step's sampled tokens that a batch's token sources index
        (`take_sampled`; None: every token comes from the host)."""
        self.model, self.kv, self.sampled = model, kv, sampled
        self.settle_steps = int(settle_steps)
        self._calm = self.settle_steps        # calls since the last change (the first capture is at once)
        self.disabled: str | None = None     # why graphs are off (a capture failed)
        self.captures = self.replays = self.invalidations = 0
        self._graphs: dict = {}
        self._pool = None
        self._side: torch.cuda.Stream | None = None   # the warm-ups' stream (cuBLAS keeps a workspace per stream)
        self._sent: torch.cuda.Event | None = None     # recorded after the last transfer from the pinned host buffers
        self._store = None
        self._key: tuple[int, int] | None = None

    @property
    def ready(self) -> bool:
        """Whether this model, store and cache can be captured at all right now."""
        return (self.disabled is None and self.kv.scratch_block is not None and self.model.graph_attention
                and self.model.dtype in DECODE_KERNEL_DTYPES and bool(getattr(self.model.experts, "capturable", False)))

    def _drop_stale(self) -> None:
        """Invalidate when the KV tensors, the store or the store's captured tensors changed since capture."""
        store = self.model.experts
        key = (self.kv.graph_epoch, getattr(store, "graph_epoch", 0))
        if store is not self._store or key != self._key:
            if self._store is not None:
                self._calm = 0
            self.invalidate()
            self._store, self._key = store, key

    def _settled(self) -> bool:
        """Count one call; whether enough passed since the last change to capture again."""
        self._calm += 1
        return self._calm > self.settle_steps

    def invalidate(self) -> None:
        """Drop every captured graph (their memory pool goes with them)."""
        if self._graphs:
            self.invalidations += 1
        self._graphs.clear()
        self._pool = None

    def _send(self, fill) -> None:
        """Run `fill` (write the set's pinned host buffers, queue their copy to the device buffers) once the previous
        copy has read the host buffers, and mark when this one is queued."""
        if self._sent is not None:
            self._sent.synchronize()   # the previous transfer has read the host buffers (it has, in practice)
        fill()
        if self.model.device.type == "cuda":
            if self._sent is None:
                self._sent = torch.cuda.Event()
            self._sent.record()

    def capture_all(self, record: bool = False) -> None:
        """Capture every size of the set (`sizes`, each by `_capture`) now instead of on first use; nothing when
        `ready` is False."""
        self._drop_stale()
        for size in self.sizes:
            if not self.ready:
                return
            if (size, record) not in self._graphs:
                self._capture(size, record)

    def _disable(self, what: str, e: Exception) -> None:
        """A capture failed: graphs of this set stay off (logged), the caller runs eagerly."""
        self.disabled = f"capturing {what} failed: {type(e).__name__}: {e}"
        log.warning("%s; those steps run eagerly from now on", self.disabled)
        self.invalidate()

    def _warm_and_capture(self, fn, *args):
        """(graph, fn(*args) as captured): fn run once on a side stream (kernel compiles, cuBLAS handles), then
        captured into this set's shared memory pool. The side stream is made once: cuBLAS caches a workspace for
        every stream it runs on, which a new stream a capture left behind (tens of MiB each on the H200)."""
        dev = self.model.device
        with torch.cuda.device(dev):
            if self._side is None:
                self._side = torch.cuda.Stream(dev)
            side = self._side
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):
                fn(*args)
            torch.cuda.current_stream(dev).wait_stream(side)
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                out = fn(*args)
        return graph, out


class DecodeGraphs(GraphSet):
    """Captured decode forwards of one model over one KV cache (see the module docstring)."""

    def __init__(self, model, kv: KVCache, max_num_seqs: int, max_blocks: int | None = None,
                 settle_steps: int = 0, sampled: torch.Tensor | None = None):
        super().__init__(model, kv, settle_steps, sampled)
        self.sizes = graph_sizes(max_num_seqs)
        tokens = int(max_blocks) * kv.block_size if max_blocks else model.config.max_position
        self.block_sizes = [g.block_size for g in kv.layout.groups]
        self.windows = [g.window for g in kv.layout.groups]   # a hybrid group's sliding window (its tables' reads)
        self.widths = [-(-tokens // size) for size in self.block_sizes]   # each KV group's table width
        # each group's static inputs, and the pinned host buffers a batch is padded into, each sent in one transfer
        # (`_stage`); group 0's also hold the rows every group shares (tokens, positions, lengths, sources)
        self.inputs = [DecodeInputs.alloc(self.sizes[-1], w, model.device) for w in self.widths]
        self.staging = [DecodeInputs.alloc_host(self.sizes[-1], w, pin_memory=model.device.type == "cuda")
                        for w in self.widths]
        self.buffers = self.inputs[0]   # group 0's, where the rows every group shares are read
        self.sample_values = torch.zeros((self.sizes[-1], ROW_VALUES), dtype=torch.float32, device=model.device)
        self.sampler_disabled: str | None = None   # why captured sampling is off (its capture failed)
        self.sampler_replays = 0
        self._last: tuple[_Captured, int] | None = None   # the last replay and its real rows

    def supports(self, rows: DecodeRows) -> bool:
        """Whether this batch can run through a graph (else the caller runs the forward eagerly)."""
        if rows.num_groups != len(self.widths):
            raise ValueError(f"decode rows of {rows.num_groups} KV groups for a cache of {len(self.widths)}")
        return (0 < len(rows) <= self.sizes[-1] and self.ready
                and all(rows.group(g).max_blocks <= w for g, w in enumerate(self.widths)))

    # ------------------------------------------------------------ running
    def forward(self, rows: DecodeRows, record: bool = False) -> ForwardOutput | None:
        """The forward of `rows` by graph replay (views of the real rows), or None if it must run eagerly."""
        self._drop_stale()
        self._last = None
        if not self.supports(rows):
            return None
        size = padded_size(len(rows), self.sizes)
        settled = self._settled()
        captured = self._graphs.get((size, record)) or (self._capture(size, record) if settled else None)
        if captured is None:
            return None
        self._stage(rows, size)
        captured.graph.replay()
        self.replays += 1
        n, out = len(rows), captured.out
        self._last = (captured, n)
        routing = None
        if out.routing is not None:
            routing = [LayerRouting(**{f.name: getattr(r, f.name)[:n] for f in fields(r)}) for r in out.routing]
        words = None if out.routing_words is None else out.routing_words[:n]
        return ForwardOutput(out.hidden[:n], routing, words, out.logits[:n])

    def sample(self, logits: torch.Tensor, values: list[tuple[float, ...]]) -> torch.Tensor | None:
        """The tokens of the last replay's rows by its captured sampler: `sampling.sample_rows` over that replay's
        logits with each row's `values` (`sampling.row_values`; padding rows greedy) and the cuts they need (a graph
        for each set of cuts), one transfer and one replay instead of a dozen eager launches. A view of the static
        tokens, valid until the next replay (consume them in stream order before it). None when `logits` are not the
        last replay's (e.g. processed first) or the sampler cannot be captured: the caller samples eagerly, the same
        tokens."""
        last = self._last
        if last is None or self.sampler_disabled is not None:
            return None
        captured, n = last
        if len(values) != n or logits.shape[0] != n or logits.data_ptr() != captured.out.logits.data_ptr():
            return None
        size = captured.out.logits.shape[0]
        host = torch.empty((size, ROW_VALUES), dtype=torch.float32, pin_memory=logits.is_cuda)
        rows = host.numpy()
        rows[:n], rows[n:] = values, GREEDY_ROW
        with torch.inference_mode():   # as fill_from: the buffers may be inference tensors
            self.sample_values[:size].copy_(host, non_blocking=True)  # a pinned block is reused after its copy ran
            cuts = needed_cuts(values, logits.shape[-1])
            if cuts not in captured.samplers:
                try:
                    captured.samplers[cuts] = self._warm_and_capture(sample_rows, captured.out.logits,
                                                                     self.sample_values[:size], *cuts)
                except Exception as e:  # noqa: BLE001 - the forward graphs stay; sampling runs eagerly
                    self.sampler_disabled = f"capturing the sampler of {size} rows failed: {type(e).__name__}: {e}"
                    log.warning("%s; sampling runs eagerly from now on", self.sampler_disabled)
                    return None
        graph, tokens = captured.samplers[cuts]
        graph.replay()
        self.sampler_replays += 1
        return tokens[:n]

    def _stage(self, rows: DecodeRows, size: int) -> None:
        """Pad `rows` to `size` into the pinned host buffers and copy them to the static device buffers in one
        transfer. With the sampled rows taken as a view (`model_runner._rows`), this took the demo's 32-sequence
        decode step on the H200 host from 1.8-2.4 to 1.6-2.1 ms (five pageable copies and a gather before)."""
        def fill() -> None:
            for g, (host, dev) in enumerate(zip(self.staging, self.inputs)):
                DecodeInputs.pad(rows.group(g), size, self.widths[g], self.block_sizes[g], self.kv.scratch_block,
                                 out=host, window=self.windows[g])
                dev.fill_from(host, size)

        self._send(fill)

    def _capture(self, size: int, record: bool) -> _Captured | None:
        self._stage(DecodeRows([], [], [], more_tables=((),) * (len(self.inputs) - 1)), size)
        b = self.buffers
        args = (b.input_ids[:size], b.positions[:size], self.kv, tuple(inp.metadata(size) for inp in self.inputs))
        try:
            captured = _Captured(*self._warm_and_capture(self._forward, args, record))
        except Exception as e:  # noqa: BLE001 - any failure means: run this model eagerly
            self._disable(f"a decode graph of {size} rows", e)
            return None
        self.captures += 1
        self._graphs[(size, record)] = captured
        return captured

    def _forward(self, args: tuple, record: bool) -> ForwardOutput:
        """What a decode graph holds: the rows' tokens (those the previous step sampled taken on the device), the
        forward, its routing packed, the logits of every row (all sample)."""
        ids, positions, kv, meta = args
        ids = take_sampled(ids, self.buffers.token_src[:ids.shape[0]], self.sampled)
        out = self.model.forward(ids, positions, kv, meta, record=record)
        return ForwardOutput(out.hidden, out.routing, pack_routing(out.routing) if out.routing else None,
                             self.model.logits(out.hidden))
