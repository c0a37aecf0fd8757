"""Shared fixtures for the demo-model tests: a tiny synthetic three-domain corpus, a tiny config, the demo trace's
first prompts as a load."""
from __future__ import annotations

import gzip
import random
from pathlib import Path

_WORDS = {
    "scripture": "and the lord said unto them behold thy servant went forth into land of israel "
                 "hath made heaven earth thou shalt not unto moses people children king".split(),
    "pydocs": "the function returns a list of str objects if the argument is None raise ValueError "
              "module class method self import def return dict int tuple example".split(),
    "fortunes": "you will meet a tall dark stranger life is what happens when luck never "
                "wise man says today tomorrow money love cat coffee computer".split(),
}


def write_corpus(root: Path, train_docs: int = 60, valid_docs: int = 12, seed: int = 0) -> Path:
    """CORPUS/<domain>/{train,valid}.txt.gz with blank-line separated documents of domain-specific words."""
    rng = random.Random(seed)
    for dom, words in _WORDS.items():
        (root / dom).mkdir(parents=True, exist_ok=True)
        for split, n in (("train", train_docs), ("valid", valid_docs)):
            docs = []
            for _ in range(n):
                lines = [" ".join(rng.choice(words) for _ in range(rng.randint(4, 12)))
                         for _ in range(rng.randint(1, 4))]
                if dom == "pydocs":
                    lines.append("    >>> " + rng.choice(words) + "(" + str(rng.randint(0, 99)) + ")")
                docs.append("\n".join(lines))
            with gzip.open(root / dom / f"{split}.txt.gz", "wt", encoding="utf-8") as f:
                f.write("\n\n".join(docs) + "\n")
    return root


def tiny_config(**overrides):
    from pwruntime.demo.model import ModelSpec
    from pwruntime.demo.train import TrainConfig

    spec = ModelSpec(vocab_size=300, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=16,
                     shared_expert_intermediate_size=64, max_position_embeddings=128)
    base = dict(model=spec, steps=20, batch_size=6, seq_len=32, lr=3e-3, warmup_steps=4, log_every=5,
                eval_every=10, eval_windows=4, ckpt_every=100, tokenizer_chars_per_domain=20_000,
                save_dtype="float32")
    base.update(overrides)
    return TrainConfig(**base)


def run_tiny(corpus: Path, out: Path, cfg=None, **opts):
    from pwruntime.demo.train import RunOptions, train

    return train(corpus, out, cfg or tiny_config(), RunOptions(progress=False, **opts), echo=lambda s: None)


def first_prompts(path: Path, max_tokens: int = 16, first_id: int = 100) -> Path:
    """The demo trace's first 32 prompts at once, at most `max_tokens` output tokens each (16: the replay warm-up's
    load), ids from first_id."""
    import numpy as np

    from traces.io import read_requests, write_requests
    from traces.schema import RequestTrace

    full = read_requests(Path(__file__).resolve().parents[1] / "traces" / "bundled" / "demo-trace" / "requests.parquet")
    k = 32
    trace = RequestTrace.from_columns(np.arange(first_id, first_id + k), np.zeros(k), full.prompt_tokens[:k],
                                      np.minimum(max_tokens, full.output_tokens[:k]), full.domain[:k],
                                      prompt_token_ids=[full.prompt_ids(i) for i in range(k)])
    path.mkdir()
    write_requests(path / "requests.parquet", trace)
    return path
