"""Checkpoint files: find config/tokenizer/safetensors in a HuggingFace directory and read tensors by name.

Weights are `model.safetensors`, or shards listed by `model.safetensors.index.json`, or (as a fallback)
every `*.safetensors` in the directory. Every failure is one CheckpointError naming the file or tensor
and the fix.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from pwruntime.model.config import CheckpointError, ModelConfig, parse_config

_LAYOUT_HINT = "a HuggingFace checkpoint directory needs config.json, *.safetensors and tokenizer.json"


@dataclass(frozen=True)
class CheckpointFiles:
    root: Path
    config: Path
    weights: tuple[Path, ...]
    tokenizer: Path
    tokenizer_config: Path | None
    generation_config: Path | None


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"cannot read {path}: {e}; restore the file from the original checkpoint") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} is not a JSON object; restore the file from the original checkpoint")
    return data


def find_files(path: str | Path, weights: bool = True) -> CheckpointFiles:
    """The checkpoint's files; `weights=False`: config.json and the tokenizer only (dummy weights are made, not
    read: pwruntime.model.dummy)."""
    root = Path(path).expanduser()
    if not root.is_dir():
        what = "is a file, not a directory" if root.exists() else "does not exist"
        raise CheckpointError(f"model directory {root} {what} ({_LAYOUT_HINT})")
    config = root / "config.json"
    if not config.is_file():
        raise CheckpointError(f"{root} has no config.json ({_LAYOUT_HINT})")
    index = root / "model.safetensors.index.json"
    if not weights:
        weights_found: tuple[Path, ...] = ()
    elif index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index} has no weight_map; re-download the checkpoint's index file")
        weights_found = tuple(root / name for name in sorted(set(weight_map.values())))
        missing = [w.name for w in weights_found if not w.is_file()]
        if missing:
            raise CheckpointError(f"{root} lacks shard(s) {', '.join(missing[:3])}"
                                  f"{' ...' if len(missing) > 3 else ''} listed in {index.name}; download them")
    elif (root / "model.safetensors").is_file():
        weights_found = (root / "model.safetensors",)
    else:
        weights_found = tuple(sorted(root.glob("*.safetensors")))
    if weights and not weights_found:
        bins = list(root.glob("*.bin")) + list(root.glob("*.pt"))
        hint = " (found PyTorch .bin/.pt files: convert them to safetensors)" if bins else ""
        raise CheckpointError(f"{root} has no *.safetensors weights{hint} ({_LAYOUT_HINT})")
    tokenizer = root / "tokenizer.json"
    if not tokenizer.is_file():
        raise CheckpointError(f"{root} has no tokenizer.json; save the fast tokenizer there "
                              f"(AutoTokenizer.from_pretrained(...).save_pretrained(DIR))")
    tok_cfg, gen_cfg = root / "tokenizer_config.json", root / "generation_config.json"
    return CheckpointFiles(root, config, weights_found, tokenizer,
                           tok_cfg if tok_cfg.is_file() else None, gen_cfg if gen_cfg.is_file() else None)


def read_config(files: CheckpointFiles) -> ModelConfig:
    gen = _read_json(files.generation_config) if files.generation_config else None
    return parse_config(_read_json(files.config), gen)


class TensorReader:
    """Reads named tensors from the safetensors files, checking presence and shape."""

    def __init__(self, files: CheckpointFiles, dtype: torch.dtype, device: str | torch.device):
        from safetensors import safe_open

        self.dtype, self.device, self.root = dtype, torch.device(device), files.root
        self._handles, self._where = [], {}
        for path in files.weights:
            try:
                handle = safe_open(str(path), framework="pt", device="cpu")
            except Exception as e:  # safetensors raises its own error types for corrupt files
                raise CheckpointError(f"cannot open {path}: {e}; re-download this file") from None
            self._handles.append(handle)
            for name in handle.keys():
                self._where[name] = handle

    def has(self, name: str) -> bool:
        return name in self._where

    def names(self) -> list[str]:
        return list(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(name).get_slice(name).get_shape())

    def _handle(self, name: str):
        handle = self._where.get(name)
        if handle is None:
            raise CheckpointError(f"tensor {name!r} is missing from the checkpoint in {self.root}; the weights do "
                                  f"not match config.json (use the config.json that came with these weights)")
        return handle

    def get(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """The tensor `name`, checked to have `shape`, converted to the reader's dtype and device."""
        got = self.shape(name)
        if got != tuple(shape):
            raise CheckpointError(f"tensor {name!r} has shape {list(got)} but config.json implies {list(shape)}; "
                                  f"the weights do not match config.json (use the config.json of these weights)")
        t = self._handle(name).get_tensor(name)
        return t.to(device=self.device, dtype=self.dtype).contiguous()

    def first(self, names: list[str]) -> str:
        """The first of `names` present in the checkpoint (for alternative spellings), else an error on names[0]."""
        for n in names:
            if n in self._where:
                return n
        self._handle(names[0])
        return names[0]
