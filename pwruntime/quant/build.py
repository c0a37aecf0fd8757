"""Build an AP checkpoint from a HuggingFace checkpoint: weights, k-means per block, packing, writing."""
from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm import tqdm

from policies.page_table import block_index
from pwruntime.quant.ap_checkpoint import KINDS, APCheckpointWriter, is_expert_tensor
from pwruntime.quant.quantizer import quantize_block, stack_blocks

SAMPLE_BYTES = 1 << 20
FULL_HASH_LIMIT = 256 << 20


@dataclass(frozen=True)
class QuantizeOptions:
    bits: tuple[int, ...] = (3, 4, 5, 6, 7, 8)
    weighting: str = "none"  # none | hessian | fisher
    calib_files: tuple[str, ...] = ()
    calib_tokens: int = 16384
    calib_seq_len: int = 512
    seed: int = 0
    overwrite: bool = False


def source_digest(paths) -> str:
    """sha256 (16 hex) of the weight files: whole content up to 256 MiB per file, else its safetensors
    header, size and 1 MiB samples at 16 evenly spaced offsets (fast on 100 GB checkpoints)."""
    h = hashlib.sha256()
    for p in sorted(Path(x) for x in paths):
        size = p.stat().st_size
        h.update(f"{p.name}:{size};".encode())
        with open(p, "rb") as f:
            if size <= FULL_HASH_LIMIT:
                for chunk in iter(lambda: f.read(1 << 22), b""):
                    h.update(chunk)
                continue
            header_len = int.from_bytes(f.read(8), "little")
            h.update(f.read(min(header_len, 1 << 26)))
            for k in range(16):
                f.seek(size * k // 16)
                h.update(f.read(SAMPLE_BYTES))
    return h.hexdigest()[:16]


def source_fingerprint(hf_config: dict, digest: str) -> str:
    """traces.model_card's fingerprint of the source architecture plus the weights digest."""
    from traces.model_card import ModelSpec

    return ModelSpec.from_hf_config(hf_config).fingerprint(digest)


def _weights(model, opts: QuantizeOptions, progress: bool):
    """Per-kind k-means weights: hessian {kind: [L, E, in]}, fisher {kind: [per layer [E, out, in]]}, or None."""
    if opts.weighting == "none":
        return None
    from pwruntime.quant import sensitivity as s

    texts = s.read_calibration_text(opts.calib_files)
    seq_len = min(opts.calib_seq_len, model.config.max_position)
    seqs = s.calibration_sequences(model.tokenizer, texts, opts.calib_tokens, seq_len)
    if opts.weighting == "hessian":
        return s.hessian_diagonals(model, seqs, progress=progress)
    if opts.weighting == "fisher":
        return {k: [t.numpy() for t in v] for k, v in s.fisher_weights(model, seqs, progress=progress).items()}
    raise ValueError(f"unknown weighting {opts.weighting!r}")


def quantize_checkpoint(model_dir: str | Path, out_dir: str | Path, opts: QuantizeOptions,
                        progress: bool = True) -> dict:
    """Quantize `model_dir` into the AP checkpoint `out_dir`; returns a summary (times, sizes)."""
    import torch
    from safetensors import safe_open

    from pwruntime.model import load_model
    from pwruntime.model.checkpoint import find_files
    t0 = time.perf_counter()
    files = find_files(model_dir)
    writer = APCheckpointWriter(out_dir, overwrite=opts.overwrite)  # refuses an existing --out before work
    with writer:
        model = load_model(model_dir, dtype=torch.float32)
        c, store = model.config, model.experts
        tw = time.perf_counter()
        weights = _weights(model, opts, progress)
        t_weights = time.perf_counter() - tw
        tk = time.perf_counter()
        n_blocks = c.num_moe_layers * c.experts * 2
        bar = tqdm(total=n_blocks, desc="k-means + pack", unit="block", disable=None if progress else True)
        for layer in range(c.num_moe_layers):
            stacked = {}
            for k, kind in enumerate(KINDS):
                blocks = []
                for e in range(c.experts):
                    w = store.weight(layer, e, kind).detach().float().cpu().numpy()
                    wt = None if weights is None else weights[kind][layer][e]
                    seed = opts.seed * 1_000_003 + block_index(layer, e, k, c.experts)
                    blocks.append(quantize_block(w, wt, bits=opts.bits, seed=seed))
                    bar.update(1)
                stacked[kind] = stack_blocks(blocks, opts.bits)
            writer.write_layer(layer, stacked["gate_up"], stacked["down"])
        bar.close()
        t_kmeans = time.perf_counter() - tk
        nonexpert = {}
        for path in files.weights:
            with safe_open(str(path), framework="pt", device="cpu") as sf:
                nonexpert.update({n: sf.get_tensor(n) for n in sf.keys() if not is_expert_tensor(n)})
        writer.write_nonexpert(nonexpert)
        writer.copy_from_source(files.root)
        hf_config = json.loads(files.config.read_text(encoding="utf-8"))
        digest = source_digest(files.weights)
        quantize_seconds = time.perf_counter() - t0
        meta = {
            "experts": c.experts, "hidden": c.hidden, "intermediate": c.expert_intermediate,
            "moe_layers": list(c.moe_layers), "bits": list(opts.bits), "seed_bits": min(opts.bits),
            "weighting": {"method": opts.weighting, "calib_files": [Path(f).name for f in opts.calib_files],
                          "calib_tokens": opts.calib_tokens if opts.weighting != "none" else 0},
            "source": {"path": str(Path(model_dir).resolve()), "weights_digest": digest,
                       "fingerprint": source_fingerprint(hf_config, digest)},
            "model_config": json.loads(json.dumps(asdict(c))),
            "seed": opts.seed, "quantize_seconds": round(quantize_seconds, 3),
            "kmeans_seconds": round(t_kmeans, 3), "weighting_seconds": round(t_weights, 3),
        }
        out = writer.finish(meta)
    return {"out": str(out), "blocks": n_blocks, "bits": list(opts.bits), "weighting": opts.weighting,
            "fingerprint": meta["source"]["fingerprint"], "quantize_seconds": quantize_seconds,
            "kmeans_seconds": t_kmeans, "weighting_seconds": t_weights,
            "total_seconds": time.perf_counter() - t0}
