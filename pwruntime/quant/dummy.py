"""Dummy AP experts (`pwruntime quantize --load-format dummy`): random codes and LUTs at a real model's shapes.

An AP checkpoint whose routed experts are random bit-planes and sorted random LUTs (scaled as a weight of that
fan-in: the dequantized block is about normal with variance 1 / in) and whose full-precision rest is the dummy
loader's (pwruntime.model.dummy): what a model of that size costs to serve, page and plan, without its weights or
a k-means pass. Its source is a folder with config.json and a tokenizer, or a bundled model card (`pwsim models`),
whose `hf_config` becomes config.json beside the demo model's tokenizer. The benches' random experts
(`random_planes`, `random_luts`, `random_layers`) are the same draws.
"""
from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import torch
from tqdm import tqdm

from policies.apformat import MAX_BITS
from pwruntime.quant.ap_checkpoint import KINDS, APCheckpointWriter, LayerBlocks
from traces.clikit import UserError

DUMMY_DIGEST = "dummy"  # the weights digest in a dummy checkpoint's source fingerprint


def random_planes(n: int, out: int, inp: int, gen: torch.Generator) -> torch.Tensor:
    """`n` blocks of random AP plane words, [n, 8, out, words] int32, on the generator's device."""
    return torch.randint(-2**31, 2**31 - 1, (n, MAX_BITS, out, -(-inp // 32)), dtype=torch.int32, device=gen.device,
                         generator=gen)


def random_luts(n: int, out: int, inp: int, gen: torch.Generator,
                bits: tuple[int, ...] = (3, 4, 5, 6, 7, 8)) -> dict[int, torch.Tensor]:
    """Per bitwidth: `n` blocks' sorted random fp16 LUTs, [n, out, 2^b] (never zeros)."""
    return {b: (torch.sort(torch.randn(n, out, 1 << b, device=gen.device, generator=gen), dim=-1)[0]
                / inp ** 0.5).half() for b in bits}


def random_layers(hidden: int, intermediate: int, experts: int, layers: int, gen: torch.Generator,
                  bits: tuple[int, ...] = (3, 4, 5, 6, 7, 8)) -> list[dict[str, LayerBlocks]]:
    """`layers` MoE layers of random AP experts on the generator's device: random plane words and sorted random LUTs."""
    return [{kind: LayerBlocks(random_planes(experts, rows, cols, gen), random_luts(experts, rows, cols, gen, bits))
             for kind, (rows, cols) in zip(KINDS, ((2 * intermediate, hidden), (hidden, intermediate)))}
            for _ in range(layers)]


def card_source(card_name: str, folder: Path) -> Path:
    """A source folder for a model card (a bundled card's name or a card file): its `hf_config` as config.json and
    the demo model's tokenizer files."""
    from pwruntime.cmd_perplexity import default_model_dir
    from traces.model_card import CardError, read_card_json

    try:
        hf_config = read_card_json(card_name).get("hf_config")
    except CardError as e:
        raise UserError(f"--model {card_name}: not a folder with config.json, nor a model card ({e}); give one of "
                        "those with --load-format dummy") from None
    if not isinstance(hf_config, dict):
        raise UserError(f"--model {card_name}: the card has no hf_config to build the model from; give a folder with "
                        "its config.json and tokenizer.json")
    demo = default_model_dir()
    if demo is None:
        raise UserError("a model card as --model needs the bundled demo model's tokenizer, which is not installed: "
                        "give a folder with config.json and tokenizer.json instead")
    (folder / "config.json").write_text(json.dumps(hf_config, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (Path(demo) / name).is_file():
            (folder / name).write_bytes((Path(demo) / name).read_bytes())
    return folder


def write_dummy_checkpoint(source: str, out_dir: str | Path, *, bits: tuple[int, ...], seed: int = 0,
                           overwrite: bool = False, progress: bool = True) -> dict:
    """The AP checkpoint of `source` (a config folder or a bundled card's name) with dummy weights; a summary."""
    if Path(source).is_dir():
        return _write(Path(source), source, out_dir, bits, seed, overwrite, progress)
    with tempfile.TemporaryDirectory(prefix="pw-dummy-") as tmp:
        return _write(card_source(source, Path(tmp)), source, out_dir, bits, seed, overwrite, progress)


def _write(folder: Path, source: str, out_dir, bits, seed, overwrite, progress) -> dict:
    from pwruntime.model import DenseExpertStore, load_model
    from pwruntime.model.checkpoint import find_files, read_config
    from pwruntime.model.dummy import DummyTensorReader
    from pwruntime.quant.build import source_fingerprint

    t0 = time.perf_counter()
    files = find_files(folder, weights=False)
    c = read_config(files)
    writer = APCheckpointWriter(out_dir, overwrite=overwrite)  # refuses an existing --out before work
    with writer:
        gen = torch.Generator().manual_seed(seed)
        for layer in tqdm(range(c.num_moe_layers), desc="random experts", unit="layer",
                          disable=None if progress else True):
            blocks = random_layers(c.hidden, c.expert_intermediate, c.experts, 1, gen, bits)[0]
            writer.write_layer(layer, blocks["gate_up"], blocks["down"])
        reader = DummyTensorReader(c, torch.bfloat16, "cpu", seed)
        load_model(folder, dtype=torch.bfloat16, experts=DenseExpertStore([], []), reader=reader)  # experts: above
        writer.write_nonexpert(reader.made)
        writer.copy_from_source(folder)
        hf_config = json.loads(files.config.read_text(encoding="utf-8"))
        meta = {
            "experts": c.experts, "hidden": c.hidden, "intermediate": c.expert_intermediate,
            "moe_layers": list(c.moe_layers), "bits": list(bits), "seed_bits": min(bits),
            "weighting": {"method": "none", "dummy": True},
            "source": {"path": source, "weights_digest": DUMMY_DIGEST,
                       "fingerprint": source_fingerprint(hf_config, DUMMY_DIGEST)},
            "load_format": "dummy", "seed": seed,
        }
        out = writer.finish(meta)
    seconds = time.perf_counter() - t0
    blocks = c.num_moe_layers * c.experts * len(KINDS)
    return {"out": str(out), "blocks": blocks, "bits": list(bits), "load_format": "dummy",
            "fingerprint": meta["source"]["fingerprint"], "total_seconds": seconds}
