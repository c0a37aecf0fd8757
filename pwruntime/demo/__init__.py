"""The bundled demo MoE model: tokenizer, data, training, HF-format export and statistics.

Modules: `data` (corpus reading, token cache, deterministic batches), `tokenizer_train` (byte-level BPE),
`model` (the Qwen2-MoE configuration and build), `export` (HuggingFace directory, per-expert layout),
`train` (the resumable training loop), `stats` (perplexity, unigram baseline, routing statistics, plots).
Everything here imports torch/transformers lazily from the CLI, so `pwruntime --help` stays fast.
"""
