"""Calibration inputs: text files -> token sequences, the seeded train/held-out split, model fingerprints.

Sequences are taken at evenly spaced places across each file (not only from its beginning), so a
file of many documents is covered; each starts at a line boundary and is tokenized with the
tokenizer's special tokens (a BOS where the model has one), like a prompt.
"""
from __future__ import annotations

import gzip
import json
import math
from pathlib import Path
from typing import Sequence

import numpy as np

from traces.clikit import UserError

MAX_CHARS_PER_FILE = 64 << 20
CHARS_PER_TOKEN_GUESS = 6


def check_files(paths: Sequence[str | Path], what: str, flag: str) -> None:
    for p in paths:
        if not Path(p).is_file():
            state = "is a directory" if Path(p).is_dir() else "does not exist"
            raise UserError(f"{what} {p} {state}; pass UTF-8 text files (optionally .gz) to {flag}")


def read_text(path: str | Path, flag: str = "--data") -> str:
    """A UTF-8 text file (or .gz), at most MAX_CHARS_PER_FILE characters of it."""
    p = Path(path)
    try:
        opener = gzip.open if p.suffix == ".gz" else open
        with opener(p, "rt", encoding="utf-8") as fh:
            return fh.read(MAX_CHARS_PER_FILE)
    except (OSError, EOFError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read {p} given to {flag}: {e}; pass UTF-8 text (optionally .gz)") from None


def parse_domains(specs: Sequence[str], flag: str = "--domains") -> dict[str, Path]:
    """`["name=FILE", ...]` (the values of `flag`) -> {name: Path}; names are unique identifiers."""
    out: dict[str, Path] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        name = name.strip()
        if not sep or not name or not path:
            raise UserError(f"{flag} entry {spec!r} is not NAME=FILE (e.g. scripture=valid.txt.gz)")
        if not name.replace("_", "").replace("-", "").isalnum():
            raise UserError(f"domain name {name!r} must be letters, digits, '-' or '_'")
        if name in out:
            raise UserError(f"domain {name!r} is given twice in {flag}")
        out[name] = Path(path)
    check_files(list(out.values()), "domain file", flag)
    return out


def text_sequences(tokenizer, text: str, n_tokens: int, seq_len: int) -> list[list[int]]:
    """About `n_tokens` tokens as non-overlapping sequences of `seq_len` (the last may be shorter).

    A short text is tokenized whole and cut in order; a long one gives one sequence from each of
    `ceil(n_tokens / seq_len)` equal slices of the text (from the first line start in the slice).
    """
    if len(text) <= 2 * n_tokens * CHARS_PER_TOKEN_GUESS:
        ids = tokenizer.encode(text)[:n_tokens]
        return [ids[i:i + seq_len] for i in range(0, len(ids), seq_len) if len(ids[i:i + seq_len]) >= 2]
    n_seq = max(1, math.ceil(n_tokens / seq_len))
    lens = [seq_len] * (n_seq - 1) + [n_tokens - seq_len * (n_seq - 1)]
    out: list[list[int]] = []
    for k, want in enumerate(lens):
        start, end = k * len(text) // n_seq, (k + 1) * len(text) // n_seq
        if start > 0:
            nl = text.find("\n", start, end)
            start = nl + 1 if nl >= 0 else start
        chars = max(64, want * CHARS_PER_TOKEN_GUESS)
        while True:
            ids = tokenizer.encode(text[start:min(start + chars, end)])
            if len(ids) >= want or start + chars >= end:
                break
            chars *= 2
        if len(ids) >= 2:
            out.append(ids[:want])
    return out


def file_sequences(tokenizer, paths: Sequence[str | Path], n_tokens: int, seq_len: int,
                   flag: str = "--data") -> tuple[list[list[int]], list[dict]]:
    """Sequences from several files, `n_tokens` shared evenly between them; plus per-file provenance."""
    seqs: list[list[int]] = []
    info = []
    share = max(2, n_tokens // max(1, len(paths)))
    for p in paths:
        got = text_sequences(tokenizer, read_text(p, flag), share, seq_len)
        if not got:
            raise UserError(f"{p} given to {flag} has fewer than 2 tokens of text; pass a longer file")
        seqs += got
        info.append({"file": str(p), "sequences": len(got), "tokens": sum(len(s) for s in got)})
    return seqs, info


def split_heldout(n: int, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Seeded split of n sequences: (train indices, held-out indices), both sorted and non-empty."""
    if not 0.0 < fraction < 1.0:
        raise UserError(f"--heldout-fraction must be between 0 and 1 (exclusive), got {fraction}")
    if n < 2:
        raise UserError(f"calibration text gives {n} sequence(s); the held-out split needs at least 2: "
                        "pass more text (--data, --tokens) or a smaller --seq-len")
    perm = np.random.default_rng(seed).permutation(n)
    n_held = min(n - 1, max(1, int(round(fraction * n))))
    return np.sort(perm[n_held:]), np.sort(perm[:n_held])


def model_fingerprint_of(path: str | Path) -> str:
    """The fingerprint a calibration of this model carries: for a HuggingFace checkpoint, the
    architecture of its config.json plus the digest of its weight files
    (`pwruntime.quant.build.source_fingerprint`); for an AP checkpoint, the fingerprint of the model
    it was quantized from (recorded by `pwruntime quantize`). Both agree for the same model."""
    from pwruntime.model.checkpoint import find_files
    from pwruntime.quant.ap_checkpoint import is_ap_checkpoint, load_ap_checkpoint
    from pwruntime.quant.build import source_digest, source_fingerprint

    if is_ap_checkpoint(path):
        fp = (load_ap_checkpoint(path).meta.get("source") or {}).get("fingerprint")
        if not fp:
            raise UserError(f"AP checkpoint {path} records no source fingerprint; re-run pwruntime quantize")
        return str(fp)
    files = find_files(path)
    hf_config = json.loads(files.config.read_text(encoding="utf-8"))
    return source_fingerprint(hf_config, source_digest(files.weights))
