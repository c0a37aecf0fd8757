"""Byte-level BPE tokenizer for the demo model, trained with `tokenizers` on the training text.

Lossless (no normalizer; ByteLevel pre-tokenizer and decoder). One special token, <|endoftext|> (id 0):
the end-of-document token, also used as BOS and padding. The post-processor prepends it when special
tokens are added, so `encode(prompt)` starts exactly as every training document does.
Writes tokenizer.json and tokenizer_config.json (eos/bos/pad and a plain-text chat template).
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Iterable, Sequence

from traces.clikit import write_text_atomic

EOS = "<|endoftext|>"
# A base model: the template writes BOS, then each message's text on its own line; the model continues.
CHAT_TEMPLATE = "{{ bos_token }}{% for message in messages %}{{ message['content'] }}\n{% endfor %}"


def train_tokenizer(texts: Iterable[str], vocab_size: int):
    """Train a byte-level BPE tokenizer (deterministic for the same texts and vocab_size)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    eos_id = tok.token_to_id(EOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{EOS} $A", pair=f"{EOS} $A {EOS} $B", special_tokens=[(EOS, eos_id)])
    return tok


def tokenizer_config(model_max_length: int) -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOS, "eos_token": EOS, "pad_token": EOS, "unk_token": None,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }


def save_tokenizer(tok, out_dir: str | Path, model_max_length: int) -> str:
    """Write tokenizer.json + tokenizer_config.json into out_dir; returns the sha256 of tokenizer.json."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    text = tok.to_str(pretty=True)
    write_text_atomic(out / "tokenizer_config.json", json.dumps(tokenizer_config(model_max_length), indent=2) + "\n")
    write_text_atomic(out / "tokenizer.json", text)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def load_tokenizer(path: str | Path):
    """Load tokenizer.json (a file, or a directory holding it)."""
    from tokenizers import Tokenizer

    p = Path(path)
    return Tokenizer.from_file(str(p / "tokenizer.json" if p.is_dir() else p))


def ensure_tokenizer(corpus: str | Path, domains: Sequence[str], out_dir: str | Path, vocab_size: int,
                     chars_per_domain: int, model_max_length: int):
    """Train (or reuse) the tokenizer in out_dir. Returns (tokenizer, sha256 of tokenizer.json).

    Training text: the first `chars_per_domain` characters of each domain's train.txt.gz, so the small
    domains weigh as much as the large one in the merges. Reused when meta.json records the same inputs.
    """
    from .data import file_sha256, read_documents

    out = Path(out_dir)
    record = {"vocab_size": vocab_size, "chars_per_domain": chars_per_domain, "domains": list(domains),
              "sources": {d: file_sha256(Path(corpus) / d / "train.txt.gz") for d in domains}}
    meta_path = out / "meta.json"
    if meta_path.is_file() and (out / "tokenizer.json").is_file():
        meta = json.loads(meta_path.read_text())
        if meta.get("inputs") == record:
            return load_tokenizer(out), meta["sha256"]
    docs = [doc for d in domains for doc in read_documents(Path(corpus) / d / "train.txt.gz", chars_per_domain)]
    tok = train_tokenizer(docs, vocab_size)
    sha = save_tokenizer(tok, out, model_max_length)
    write_text_atomic(meta_path, json.dumps({"inputs": record, "sha256": sha}, indent=1) + "\n")
    return tok, sha
