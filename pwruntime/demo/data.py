"""Demo corpus data: documents from gzip text, the uint16 token cache, deterministic training batches.

Corpus layout: CORPUS/<domain>/{train,valid}.txt.gz (UTF-8; documents separated by one or more blank
lines). A domain's token stream is EOS doc0 EOS doc1 EOS ... so every document is preceded by EOS, as
a prompt is when the tokenizer adds its BOS (= EOS) token. Training batches are a pure function of
(seed, step): the data cursor is the step number, which makes resumption exact.
"""
from __future__ import annotations

import gzip
import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from traces.clikit import UserError, write_atomic, write_text_atomic

_DOC_SPLIT = re.compile(r"\n(?:[ \t]*\n)+")
SPLITS = ("train", "valid")


class CorpusError(UserError):
    """The corpus directory is missing or malformed."""


def split_documents(text: str) -> list[str]:
    """Documents of a corpus file: blocks separated by blank (or whitespace-only) lines."""
    docs = (d.strip("\n") for d in _DOC_SPLIT.split(text.replace("\r\n", "\n")))
    return [d for d in docs if d.strip()]


def read_documents(path: str | Path, max_chars: int | None = None) -> list[str]:
    """Read a gzip text file and split it into documents; `max_chars` keeps only a leading slice."""
    path = Path(path)
    try:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            text = f.read() if max_chars is None else f.read(max_chars)
    except (OSError, EOFError, UnicodeDecodeError) as e:
        raise CorpusError(f"cannot read {path}: {e}; expected a gzip UTF-8 text file") from None
    return split_documents(text)


def corpus_domains(corpus: str | Path, domains: Sequence[str] | None = None) -> list[str]:
    """Domains of a corpus (sorted sub-folders holding train.txt.gz and valid.txt.gz), or check `domains`."""
    root = Path(corpus)
    if not root.is_dir():
        raise CorpusError(f"corpus directory {root} does not exist; pass --corpus DIR holding "
                          "<domain>/train.txt.gz and <domain>/valid.txt.gz")
    found = sorted(p.name for p in root.iterdir()
                   if p.is_dir() and all((p / f"{s}.txt.gz").is_file() for s in SPLITS))
    if domains:
        missing = [d for d in domains if d not in found]
        if missing:
            raise CorpusError(f"domain(s) {', '.join(missing)} not found in {root} "
                              f"(found: {', '.join(found) or 'none'})")
        return list(domains)
    if not found:
        raise CorpusError(f"no domain in {root}: expected <domain>/train.txt.gz and <domain>/valid.txt.gz")
    return found


def file_sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def tokenize_documents(tokenizer, docs: Sequence[str], eos_id: int) -> np.ndarray:
    """EOS doc0 EOS doc1 ... as uint16 (the tokenizer's own BOS is not added here)."""
    if tokenizer.get_vocab_size() > 65535:
        raise ValueError("the uint16 token cache needs a vocabulary of at most 65535 tokens")
    parts = [np.array([eos_id], dtype=np.uint16)]
    for enc in tokenizer.encode_batch(list(docs), add_special_tokens=False):
        parts.append(np.asarray(enc.ids, dtype=np.uint16))
        parts.append(np.array([eos_id], dtype=np.uint16))
    return np.concatenate(parts)


def load_token_cache(corpus: str | Path, domains: Sequence[str], tokenizer, tokenizer_sha: str,
                     cache_dir: str | Path, eos_id: int) -> dict[str, dict[str, np.ndarray]]:
    """Token streams {split: {domain: uint16 array}}, cached in cache_dir and rebuilt when stale.

    A cache entry is valid when the corpus file's sha256 and the tokenizer's sha256 match its record.
    """
    cache = Path(cache_dir)
    cache.mkdir(parents=True, exist_ok=True)
    meta_path = cache / "meta.json"
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
    out: dict[str, dict[str, np.ndarray]] = {s: {} for s in SPLITS}
    changed = False
    for split in SPLITS:
        for dom in domains:
            src = Path(corpus) / dom / f"{split}.txt.gz"
            key = f"{dom}.{split}"
            record = {"source_sha256": file_sha256(src), "tokenizer_sha256": tokenizer_sha}
            npy = cache / f"{key}.u16.npy"
            if meta.get(key) == record and npy.is_file():
                out[split][dom] = np.load(npy)
                continue
            arr = tokenize_documents(tokenizer, read_documents(src), eos_id)
            write_atomic(npy, lambda f: np.save(f, arr))
            meta[key] = record
            changed = True
            out[split][dom] = arr
    if changed:
        write_text_atomic(meta_path, json.dumps(meta, indent=1, sort_keys=True))
    return out


def domain_counts(batch_size: int, weights: Sequence[float]) -> list[int]:
    """Rows per domain in every batch: largest-remainder rounding of batch_size * weights."""
    w = np.asarray(weights, dtype=np.float64)
    if batch_size < len(w) or np.any(w <= 0):
        raise UserError(f"batch size {batch_size} must be at least the number of domains ({len(w)}), "
                        "and every domain weight must be positive")
    ideal = batch_size * w / w.sum()
    counts = np.floor(ideal).astype(int)
    order = np.argsort(-(ideal - counts), kind="stable")
    counts[order[: batch_size - counts.sum()]] += 1
    counts = np.maximum(counts, 1)
    while counts.sum() > batch_size:          # only when max(...,1) lifted a tiny weight
        counts[int(np.argmax(counts))] -= 1
    return counts.tolist()


@dataclass(frozen=True)
class BatchSampler:
    """Random contiguous windows of seq_len+1 tokens; rows grouped by domain in fixed counts per batch."""

    streams: tuple[np.ndarray, ...]
    counts: tuple[int, ...]
    seq_len: int
    seed: int

    def __post_init__(self) -> None:
        for s in self.streams:
            if len(s) < self.seq_len + 2:
                raise CorpusError(f"a domain has only {len(s)} tokens, fewer than a window of "
                                  f"{self.seq_len + 1}; use a smaller --seq-len or more text")

    @property
    def domain_ids(self) -> np.ndarray:
        return np.repeat(np.arange(len(self.counts)), self.counts)

    def batch(self, step: int) -> np.ndarray:
        """The batch of a training step: int64 [batch, seq_len+1], the same for the same (seed, step)."""
        rng = np.random.default_rng([self.seed, step])
        rows = []
        for stream, n in zip(self.streams, self.counts):
            starts = rng.integers(0, len(stream) - self.seq_len, size=n)
            rows.append(np.stack([stream[s: s + self.seq_len + 1] for s in starts]))
        return np.concatenate(rows).astype(np.int64)


def eval_windows(stream: np.ndarray, seq_len: int, max_windows: int | None = None) -> list[np.ndarray]:
    """Windows of up to seq_len+1 tokens with stride seq_len: every token after the first is a target once."""
    wins = []
    for start in range(0, max(len(stream) - 1, 0), seq_len):
        w = stream[start: start + seq_len + 1]
        if len(w) >= 2:
            wins.append(w.astype(np.int64))
        if max_windows is not None and len(wins) >= max_windows:
            break
    return wins
