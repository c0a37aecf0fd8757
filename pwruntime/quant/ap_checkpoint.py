"""The AP checkpoint directory: bit-planes and LUTs of every routed expert, plus the full-precision rest.

Directory layout (format_version 1, layout v1 of policies.apformat):

    ap_config.json                 metadata (below); its presence marks an AP checkpoint
    experts-L000.safetensors       one file per MoE layer (ordinal, not model layer index), tensors
                                     gate_up.planes  U32 [E, 8, 2I, ceil(H/32)]
                                     gate_up.lut{b}  F16 [E, 2I, 2**b]      for every b in `bits`
                                     down.planes     U32 [E, 8, H, ceil(I/32)]
                                     down.lut{b}     F16 [E, H, 2**b]
    model.safetensors              every source tensor that is not a routed-expert weight, under its
                                   source (HuggingFace) name, in its source dtype: attention, norms,
                                   embeddings, router gates, shared experts; with config.json and the
                                   tokenizer this makes the directory loadable by
                                   `pwruntime.model.load_model(dir, experts=APExpertStore(...))`
    config.json, tokenizer*.json, generation_config.json, ...   copied from the source

`planes[e, :b]` is the contiguous slab of expert e's top b planes, so a block at b bits occupies
exactly `policies.apformat.ap_block_bytes(out, in, b)` bytes (planes + LUT_b). gate_up rows are the
gate rows then the up rows, as in the ExpertStore interface.

ap_config.json keys: format ("pagedweight-ap"), format_version, layout_version, bits, seed_bits,
experts, hidden, intermediate, moe_layers (model layer index of each MoE layer ordinal),
expert_files, nonexpert_file, weighting ({method, ...}), source ({path, fingerprint}),
model_config, plus whatever else the writer's caller adds (quantize_seconds, seed, ...).
The writer builds everything in a temporary sibling directory and renames it into place.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from policies.apformat import LAYOUT_VERSION, MAX_BITS
from pwruntime.model.experts import KINDS, block_shape
from traces.clikit import UserError, default_mode

FORMAT = "pagedweight-ap"
FORMAT_VERSION = 1
CONFIG_NAME = "ap_config.json"
NONEXPERT_FILE = "model.safetensors"  # so pwruntime.model.load_model finds it
# routed-expert weights in HF checkpoints: `...experts.N.w1` (Mixtral), `...experts.N.gate_proj`,
# fused `...experts.gate_up_proj`; shared experts (`shared_expert.`) do not match
EXPERT_TENSOR = re.compile(r"\.experts\.")
COPY_THROUGH = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "chat_template.jinja", "special_tokens_map.json", "tokenizer.model", "vocab.json", "merges.txt")

T = TypeVar("T", np.ndarray, torch.Tensor)


class APCheckpointError(UserError):
    """An AP checkpoint directory is missing, malformed, or of an unsupported version."""


def is_expert_tensor(name: str) -> bool:
    return EXPERT_TENSOR.search(name) is not None


def expert_file_name(moe_layer: int) -> str:
    return f"experts-L{moe_layer:03d}.safetensors"


@dataclass
class LayerBlocks(Generic[T]):
    """One kind of linear-block for all experts of one MoE layer."""

    planes: T  # uint32 [E, 8, out, words]
    luts: dict[int, T]  # b -> float16 [E, out, 2**b]

    def check(self, experts: int, out_features: int, words: int, bits: tuple[int, ...]) -> None:
        want = (experts, MAX_BITS, out_features, words)
        if tuple(self.planes.shape) != want:
            raise APCheckpointError(f"planes have shape {tuple(self.planes.shape)}, expected {want}")
        for b in bits:
            if b not in self.luts or tuple(self.luts[b].shape) != (experts, out_features, 1 << b):
                got = tuple(self.luts[b].shape) if b in self.luts else None
                raise APCheckpointError(f"LUT for {b} bits has shape {got}, expected {(experts, out_features, 1 << b)}")


def _to_torch(a) -> torch.Tensor:
    return a if isinstance(a, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(a))


class APCheckpointWriter:
    """Writes an AP checkpoint into a temporary directory; `finish` renames it to `out_dir`."""

    def __init__(self, out_dir: str | Path, *, overwrite: bool = False) -> None:
        self.out_dir = Path(out_dir)
        if self.out_dir.exists() and not overwrite and (not self.out_dir.is_dir() or any(self.out_dir.iterdir())):
            raise APCheckpointError(f"output {self.out_dir} already exists and is not empty; "
                                    "choose another --out or pass --overwrite")
        self.out_dir.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = Path(tempfile.mkdtemp(prefix=f".{self.out_dir.name}.tmp-", dir=self.out_dir.parent))
        self.overwrite = overwrite
        self.expert_files: dict[int, str] = {}
        self.has_nonexpert = False

    def __enter__(self) -> "APCheckpointWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()

    def abort(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)

    def write_layer(self, moe_layer: int, gate_up: LayerBlocks, down: LayerBlocks) -> None:
        tensors: dict[str, torch.Tensor] = {}
        for kind, blocks in (("gate_up", gate_up), ("down", down)):
            planes = _to_torch(blocks.planes)
            if planes.dtype == torch.int32:
                planes = planes.view(torch.uint32)
            if planes.dtype != torch.uint32 or planes.ndim != 4 or planes.shape[1] != MAX_BITS:
                raise ValueError(f"{kind} planes must be uint32 [E, 8, out, words], got {planes.dtype} "
                                 f"{tuple(planes.shape)}")
            tensors[f"{kind}.planes"] = planes.contiguous()
            for b, lut in sorted(blocks.luts.items()):
                tensors[f"{kind}.lut{b}"] = _to_torch(lut).to(torch.float16).contiguous()
        name = expert_file_name(moe_layer)
        # one metadata key: safetensors writes a dict's keys in a random order, and two runs' files would differ
        save_file(tensors, str(self.tmp / name), metadata={"format": f"{FORMAT} layout {LAYOUT_VERSION}"})
        self.expert_files[moe_layer] = name

    def write_nonexpert(self, tensors: dict[str, torch.Tensor]) -> None:
        bad = [k for k in tensors if is_expert_tensor(k)]
        if bad:
            raise ValueError(f"routed-expert tensors do not belong in {NONEXPERT_FILE}: {bad[:3]}")
        state = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
        save_file(state, str(self.tmp / NONEXPERT_FILE), metadata={"format": "pt"})
        self.has_nonexpert = True

    def copy_from_source(self, source_dir: str | Path, names: tuple[str, ...] = COPY_THROUGH) -> list[str]:
        copied = []
        for n in names:
            src = Path(source_dir) / n
            if src.is_file():
                shutil.copy2(src, self.tmp / n)
                copied.append(n)
        return copied

    def finish(self, meta: dict) -> Path:
        """Write ap_config.json (meta + format fields) and move the directory into place."""
        need = ("experts", "hidden", "intermediate", "moe_layers", "bits")
        missing = [k for k in need if k not in meta]
        if missing:
            raise ValueError(f"AP checkpoint metadata lacks {missing}")
        n_layers = len(meta["moe_layers"])
        if sorted(self.expert_files) != list(range(n_layers)):
            raise ValueError(f"wrote expert files for MoE layers {sorted(self.expert_files)}, "
                             f"metadata lists {n_layers} MoE layers")
        full = {**meta, "format": FORMAT, "format_version": FORMAT_VERSION, "layout_version": LAYOUT_VERSION,
                "bits": sorted(int(b) for b in meta["bits"]),
                "expert_files": [self.expert_files[i] for i in range(n_layers)],
                "nonexpert_file": NONEXPERT_FILE if self.has_nonexpert else None}
        (self.tmp / CONFIG_NAME).write_text(json.dumps(full, indent=2, sort_keys=True))
        default_mode(self.tmp)  # mkdtemp made it private; files too (safetensors writes 0600)
        for f in self.tmp.iterdir():
            default_mode(f)
        if self.out_dir.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{self.out_dir.name}.old-", dir=self.out_dir.parent))
            os.rename(self.out_dir, old / "x")
            os.rename(self.tmp, self.out_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(self.tmp, self.out_dir)
        return self.out_dir


def is_ap_checkpoint(path: str | Path) -> bool:
    return (Path(path) / CONFIG_NAME).is_file()


class APCheckpoint:
    """A loaded AP checkpoint's metadata; tensors are read on demand."""

    def __init__(self, path: Path, meta: dict) -> None:
        self.path, self.meta = path, meta
        self.experts = int(meta["experts"])
        self.hidden = int(meta["hidden"])
        self.intermediate = int(meta["intermediate"])
        self.moe_layers = [int(x) for x in meta["moe_layers"]]
        self.bits = tuple(int(b) for b in meta["bits"])

    @property
    def num_moe_layers(self) -> int:
        return len(self.moe_layers)

    def shape(self, kind: str) -> tuple[int, int]:
        return block_shape(kind, self.hidden, self.intermediate)

    def read_layer(self, moe_layer: int, device: str | torch.device = "cpu") -> dict[str, LayerBlocks]:
        """{"gate_up": LayerBlocks, "down": LayerBlocks} of torch tensors (planes torch.uint32)."""
        if not 0 <= moe_layer < self.num_moe_layers:
            raise APCheckpointError(f"MoE layer {moe_layer} out of range 0..{self.num_moe_layers - 1}")
        f = self.path / self.meta["expert_files"][moe_layer]
        if not f.is_file():
            raise APCheckpointError(f"AP checkpoint {self.path} lacks {f.name}; re-run pwruntime quantize")
        out: dict[str, LayerBlocks] = {}
        with open_file(f, device) as sf:
            names = set(sf.keys())
            for kind in KINDS:
                try:
                    blocks = LayerBlocks(planes=sf.get_tensor(f"{kind}.planes"),
                                         luts={b: sf.get_tensor(f"{kind}.lut{b}") for b in self.bits})
                except Exception as e:  # a missing tensor name
                    raise APCheckpointError(f"{f} is missing tensors for {kind} ({e}); have {sorted(names)[:6]}...")
                o, i = self.shape(kind)
                try:
                    blocks.check(self.experts, o, -(-i // 32), self.bits)
                except APCheckpointError as e:
                    raise APCheckpointError(f"{f.name} {kind}: {e}") from None
                out[kind] = blocks
        return out

    def nonexpert_state(self, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
        name = self.meta.get("nonexpert_file")
        if not name:
            return {}
        with open_file(self.path / name, device) as sf:
            return {k: sf.get_tensor(k) for k in sf.keys()}


def open_file(path: Path, device: str | torch.device = "cpu"):
    """`safe_open` of one of an AP checkpoint's files; a corrupt one (a header that does not parse, a truncated file)
    is an APCheckpointError naming it."""
    try:
        return safe_open(str(path), framework="pt", device=str(device))
    except Exception as e:  # safetensors raises its own error types for corrupt files
        raise APCheckpointError(f"cannot open {path}: {e}; re-run `pwruntime quantize` to write the AP checkpoint "
                                "again") from None


def load_ap_checkpoint(path: str | Path) -> APCheckpoint:
    """Open an AP checkpoint directory; refuses unknown formats and layout versions."""
    path = Path(path)
    cfg = path / CONFIG_NAME
    if not cfg.is_file():
        raise APCheckpointError(f"{path} is not an AP checkpoint (no {CONFIG_NAME}); create one with "
                                "`pwruntime quantize --model SRC --out DIR`")
    try:
        meta = json.loads(cfg.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise APCheckpointError(f"cannot read {cfg}: {e}") from None
    if meta.get("format") != FORMAT:
        raise APCheckpointError(f"{cfg} has format {meta.get('format')!r}, expected {FORMAT!r}")
    if meta.get("format_version") != FORMAT_VERSION or meta.get("layout_version") != LAYOUT_VERSION:
        raise APCheckpointError(
            f"{cfg} is format_version {meta.get('format_version')} / layout_version {meta.get('layout_version')}; "
            f"this build reads {FORMAT_VERSION} / {LAYOUT_VERSION}: re-quantize with this version")
    missing = [k for k in ("experts", "hidden", "intermediate", "moe_layers", "bits", "expert_files") if k not in meta]
    if missing:
        raise APCheckpointError(f"{cfg} lacks {missing}; re-run pwruntime quantize")
    if len(meta["expert_files"]) != len(meta["moe_layers"]):
        raise APCheckpointError(f"{cfg}: {len(meta['expert_files'])} expert files for "
                                f"{len(meta['moe_layers'])} MoE layers; re-run pwruntime quantize")
    return APCheckpoint(path, meta)
