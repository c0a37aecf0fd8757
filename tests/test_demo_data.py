"""Demo-model data: document splitting, batch composition, deterministic windows, token cache, tokenizer."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from demo_fixtures import write_corpus  # noqa: E402

from pwruntime.demo.data import (BatchSampler, CorpusError, corpus_domains, domain_counts,  # noqa: E402
                                 eval_windows, split_documents)
from pwruntime.demo.train import lr_at, mix_weights  # noqa: E402
from pwruntime.demo.train import TrainConfig  # noqa: E402


def test_split_documents_on_blank_lines_keeps_indentation():
    text = "a b\nc\n\n\n    indented\n  \t\nlast one\n\n"
    assert split_documents(text) == ["a b\nc", "    indented", "last one"]
    assert split_documents("\n\n\n") == []


def test_domain_counts_fill_the_batch_by_weight():
    assert domain_counts(6, [1, 1, 1]) == [2, 2, 2]
    assert domain_counts(48, mix_weights("sqrt", [819_947, 2_753_539, 1_067_639])) == [12, 22, 14]
    assert domain_counts(10, [1000, 1, 1]) == [8, 1, 1]          # every domain keeps a row
    assert sum(domain_counts(97, [0.3, 0.5, 0.2])) == 97
    with pytest.raises(Exception):
        domain_counts(2, [1, 1, 1])


def test_mix_weights():
    assert mix_weights("equal", [4, 100]) == (1.0, 1.0)
    assert mix_weights("sqrt", [4, 100]) == (2.0, 10.0)
    assert mix_weights("proportional", [4, 100]) == (4.0, 100.0)


def test_batches_are_a_function_of_seed_and_step_with_rows_grouped_by_domain():
    streams = (np.arange(0, 500, dtype=np.uint16), np.arange(1000, 1300, dtype=np.uint16))
    s = BatchSampler(streams, (3, 2), seq_len=16, seed=7)
    b = s.batch(5)
    assert b.shape == (5, 17) and b.dtype == np.int64
    assert np.array_equal(b, BatchSampler(streams, (3, 2), 16, 7).batch(5))
    assert not np.array_equal(b, s.batch(6)) and not np.array_equal(b, BatchSampler(streams, (3, 2), 16, 8).batch(5))
    assert (b[:3] < 500).all() and (b[3:] >= 1000).all()
    assert (np.diff(b, axis=1) == 1).all()                       # contiguous windows of the stream
    assert s.domain_ids.tolist() == [0, 0, 0, 1, 1]
    with pytest.raises(CorpusError):
        BatchSampler((np.arange(10, dtype=np.uint16),), (1,), seq_len=16, seed=0)


def test_eval_windows_predict_every_token_once():
    stream = np.arange(103, dtype=np.uint16)
    wins = eval_windows(stream, 10)
    assert np.array_equal(np.concatenate([w[1:] for w in wins]), stream[1:])
    assert len(eval_windows(stream, 10, max_windows=3)) == 3


def test_lr_schedule_warms_up_then_decays_to_the_floor():
    cfg = TrainConfig(steps=100, warmup_steps=10, lr=1.0, min_lr_ratio=0.1)
    assert lr_at(0, cfg) == pytest.approx(0.1) and lr_at(9, cfg) == pytest.approx(1.0)
    assert lr_at(10, cfg) == pytest.approx(1.0) and lr_at(100, cfg) == pytest.approx(0.1)
    assert all(lr_at(i, cfg) >= lr_at(i + 1, cfg) for i in range(10, 100))


def test_corpus_domains_and_errors(tmp_path):
    root = write_corpus(tmp_path / "c", train_docs=3, valid_docs=2)
    assert corpus_domains(root) == ["fortunes", "pydocs", "scripture"]
    assert corpus_domains(root, ["pydocs"]) == ["pydocs"]
    with pytest.raises(CorpusError, match="nope"):
        corpus_domains(root, ["nope"])
    with pytest.raises(CorpusError, match="does not exist"):
        corpus_domains(tmp_path / "missing")


def test_tokenizer_training_is_deterministic_and_token_cache_is_reused(tmp_path, monkeypatch):
    pytest.importorskip("tokenizers")
    from pwruntime.demo import data
    from pwruntime.demo.tokenizer_train import EOS, ensure_tokenizer, train_tokenizer

    root = write_corpus(tmp_path / "c", train_docs=30, valid_docs=5)
    docs = [d for dom in corpus_domains(root) for d in data.read_documents(root / dom / "train.txt.gz")]
    assert train_tokenizer(docs, 290).to_str() == train_tokenizer(docs, 290).to_str()
    doms = corpus_domains(root)
    tok, sha = ensure_tokenizer(root, doms, tmp_path / "tok", 290, 10_000, 128)
    tok2, sha2 = ensure_tokenizer(root, doms, tmp_path / "tok", 290, 10_000, 128)   # reused, not retrained
    assert sha == sha2 and tok.get_vocab_size() <= 290
    eos = tok.token_to_id(EOS)
    first = data.load_token_cache(root, doms, tok, sha, tmp_path / "cache", eos)
    stream = first["train"]["pydocs"]
    assert stream.dtype == np.uint16 and stream[0] == eos and stream[-1] == eos
    n_docs = len(data.read_documents(root / "pydocs" / "train.txt.gz"))
    assert int((stream == eos).sum()) == n_docs + 1

    def boom(*a, **k):
        raise AssertionError("re-tokenized although the cache is valid")
    monkeypatch.setattr(data, "tokenize_documents", boom)
    again = data.load_token_cache(root, doms, tok, sha, tmp_path / "cache", eos)
    assert np.array_equal(again["valid"]["scripture"], first["valid"]["scripture"])
    with pytest.raises(AssertionError, match="re-tokenized"):                   # other tokenizer: rebuilt
        data.load_token_cache(root, doms, tok, "other-sha", tmp_path / "cache", eos)
