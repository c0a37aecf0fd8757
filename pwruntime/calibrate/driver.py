"""`calibrate(options)`: the whole offline calibration of a model and its AP checkpoint, written to disk.

1. Inputs: calibration text -> sequences (`inputs`), split seeded into train and held-out.
2. Global sensitivity s[i, b] (Eq. 2) from E[x_j^2] on the train split (`global_sensitivity`), scaled
   by each expert's routing frequency unless `sensitivity="routed"`.
3. Measurement (`measure`) of every calibration sequence: per-block errors at every bitwidth,
   phi, routing mass; prompt-residual heads fit on train, judged on held-out (`heads`).
4. Initial assignment: sensitivity-optimal at `initial_mean_bits` (`policies.planners.
   sensitivity_optimal_bits`; default 8 = every block at the top bitwidth: the runtime starts at the
   best quality its memory allows and the planner lowers bits only under KV pressure, reloading up
   to this assignment when pressure clears; pass a lower mean to cap the resident weights from the
   start). Then the hyperparameter search (`search`) at the byte target "free as many bytes as
   moving from the initial assignment to uniform `search_bits`".
5. Per-domain damages E_d (`domains`) on each `--domains` file.
6. The policies.Calibration directory, with the model fingerprint and provenance.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from policies.calibration import Calibration, fingerprints_match
from policies.page_table import PageTable
from policies.planners import sensitivity_optimal_bits
from pwruntime.calibrate import domains as dom
from pwruntime.calibrate.global_sensitivity import (frequency_scaled, monotone_envelope, routing_frequency,
                                                    sensitivity_table)
from pwruntime.calibrate.heads import fit_residual_heads
from pwruntime.calibrate.inputs import check_files, file_sequences, model_fingerprint_of, split_heldout
from pwruntime.calibrate.measure import MeasuringStore, SequenceStats, measure_sequences
from pwruntime.calibrate.search import SearchProblem, reference_rows, search
from traces.clikit import UserError, check_output


@dataclass(frozen=True)
class CalibrateOptions:
    model: str
    ap: str
    data: tuple[str, ...]
    out: str
    domains: tuple[tuple[str, str], ...] = ()  # (name, file)
    heldout_fraction: float = 0.25
    tokens: int = 16384
    seq_len: int = 512
    domain_tokens: int = 8192
    initial_mean_bits: float = 8.0
    search_bits: int = 5
    sensitivity: str = "frequency"  # "frequency" | "routed" (see global_sensitivity)
    seed: int = 0
    device: str = "cpu"
    overwrite: bool = False
    progress: bool = True


def _check(opts: CalibrateOptions) -> None:
    check_files(opts.data, "calibration file", "--data")
    check_files([f for _, f in opts.domains], "domain file", "--domains")
    sizes = (("--tokens", opts.tokens), ("--seq-len", opts.seq_len), ("--domain-tokens", opts.domain_tokens))
    for name, value in sizes:
        if value < 2:
            raise UserError(f"{name} must be at least 2, got {value}")
    out = check_output(opts.out)
    if out.exists() and any(out.iterdir()):
        if not opts.overwrite:
            raise UserError(f"output {out} already exists and is not empty; choose another --out or pass --overwrite")
        if not (out / "calibration.json").is_file():
            raise UserError(f"output {out} is not a calibration directory (no calibration.json); --overwrite replaces "
                            "only an earlier `pwruntime calibrate` output: choose another --out")


def _load(opts: CalibrateOptions):
    """(model, AP checkpoint, AP store, fingerprint), refusing an AP checkpoint of another model."""
    from pwruntime.model import load_model
    from pwruntime.quant.ap_checkpoint import load_ap_checkpoint
    from pwruntime.quant.store import APExpertStore

    ckpt = load_ap_checkpoint(opts.ap)
    ap_fp = str((ckpt.meta.get("source") or {}).get("fingerprint") or "")
    model_fp = model_fingerprint_of(opts.model)
    if not ap_fp or not fingerprints_match(ap_fp, model_fp):
        raise UserError(f"AP checkpoint {opts.ap} was quantized from another model ({ap_fp or 'unknown'}), not "
                        f"{opts.model} ({model_fp}); run `pwruntime quantize --model {opts.model} --out DIR` "
                        "and pass DIR to --ap")
    model = load_model(opts.model, dtype=torch.float32, device=opts.device)
    c = model.config
    if (c.experts, c.hidden, c.expert_intermediate, c.num_moe_layers) != \
            (ckpt.experts, ckpt.hidden, ckpt.intermediate, ckpt.num_moe_layers):
        raise UserError(f"AP checkpoint {opts.ap} has a different expert layout than {opts.model}; re-quantize")
    ap = APExpertStore.from_checkpoint(ckpt, device=opts.device, dtype=torch.float32, cache_bytes=0)
    return model, ckpt, ap, model_fp


def _epsilon(sens: np.ndarray, bits: tuple[int, ...]) -> float:
    down = sorted(bits, reverse=True)
    g = np.concatenate([sens[:, lo] - sens[:, hi] for hi, lo in zip(down[:-1], down[1:])])
    pos = g[np.isfinite(g) & (g > 0)]
    return float(1e-9 * np.median(pos)) if pos.size else 1e-12


def _concat(parts: list[SequenceStats]) -> SequenceStats:
    return SequenceStats(*(np.concatenate([getattr(p, f) for p in parts]) for f in SequenceStats.__dataclass_fields__))


def _domain_damages(model, ap, store, stats: SequenceStats, opts: CalibrateOptions, seq_len: int,
                    bits: tuple[int, ...], L: int, E: int) -> tuple[dict, dict]:
    """E_d per --domains file ({name: [n, 9]}) and their provenance (tokens, routing frequency, ...)."""
    measured = {}
    for name, path in opts.domains:
        d_seqs, d_info = file_sequences(model.tokenizer, [path], opts.domain_tokens, seq_len, "--domains")
        measured[name] = (measure_sequences(model, ap, d_seqs, bits, desc=f"measure {name}",
                                            progress=opts.progress, store=store), d_info[0])
    fallback, _ = dom.per_pair_damage(_concat([stats] + [s for s, _ in measured.values()]))
    damages, info = {}, {}
    n = L * E * 2
    for name, (d_stats, d_info) in measured.items():
        damages[name], freq = dom.domain_damage(d_stats, bits, L, E, fallback)
        info[name] = {**d_info, "routing_frequency": np.round(freq, 6).tolist(),
                      "uniform_damage_per_token": {str(b): dom.expected_token_damage(damages[name], freq, np.full(n, b))
                                                   for b in bits}}
    return damages, info


def calibrate(opts: CalibrateOptions) -> tuple[Calibration, dict]:
    """Run the calibration and write `opts.out`; returns (the calibration, a JSON-able summary)."""
    t_start = time.perf_counter()
    timings: dict[str, float] = {}

    def lap(name: str, since: float) -> float:
        now = time.perf_counter()
        timings[name] = round(now - since, 3)
        return now

    _check(opts)
    if opts.sensitivity not in ("frequency", "routed"):
        raise UserError(f"--sensitivity must be 'frequency' or 'routed', got {opts.sensitivity!r}")
    if opts.search_bits < 1:
        raise UserError(f"--search-bits must be a stored bitwidth, got {opts.search_bits}")
    t = time.perf_counter()
    model, ckpt, ap, fingerprint = _load(opts)
    bits, c = tuple(ckpt.bits), model.config
    if opts.search_bits not in bits:
        raise UserError(f"--search-bits {opts.search_bits} is not stored in {opts.ap} (bits {list(bits)})")
    if opts.initial_mean_bits < min(bits):
        raise UserError(f"--initial-mean-bits {opts.initial_mean_bits} is below the lowest bitwidth stored in "
                        f"{opts.ap} ({min(bits)}); pass a value in {min(bits)}..{max(bits)}")
    L, E = c.num_moe_layers, c.experts
    seq_len = min(opts.seq_len, c.max_position)
    seqs, data_info = file_sequences(model.tokenizer, opts.data, opts.tokens, seq_len)
    train_idx, held_idx = split_heldout(len(seqs), opts.heldout_fraction, opts.seed)
    t = lap("load", t)

    from pwruntime.quant.sensitivity import hessian_diagonals
    h = hessian_diagonals(model, [torch.tensor(seqs[i]) for i in train_idx], damp=0.0, progress=opts.progress)
    store = MeasuringStore(model.experts, ap, bits)
    raw = sensitivity_table(store.deltas, h, bits, opts.progress)
    per_pair, fixed = monotone_envelope(raw, bits)
    t = lap("sensitivity", t)

    stats = measure_sequences(model, ap, seqs, bits, desc="measure calibration", progress=opts.progress, store=store)
    train, held = stats.subset(train_idx), stats.subset(held_idx)
    heads = fit_residual_heads(train, held, per_pair, bits)
    freq = routing_frequency(train.weight.sum(axis=0), int(train.tokens.sum()), L, E)
    sens = frequency_scaled(per_pair, freq) if opts.sensitivity == "frequency" else per_pair
    t = lap("measure_and_heads", t)

    table = PageTable(L, E, c.hidden, c.expert_intermediate, bits=bits)
    top = max(bits)
    if opts.initial_mean_bits >= top:
        init = np.full(table.num_blocks, top, dtype=np.int64)
    else:
        init = sensitivity_optimal_bits(table, sens, target_mean_bits=float(opts.initial_mean_bits))
    rows_idx = np.arange(table.num_blocks)
    init_bytes = int(table.M[rows_idx, init].sum())
    target = init_bytes - int(table.M[:, opts.search_bits].sum())
    if target <= 0:
        raise UserError(f"the initial assignment (mean {opts.initial_mean_bits} bits) is already no larger than "
                        f"uniform {opts.search_bits} bits; pass a lower --search-bits")
    base = Calibration(fingerprint=fingerprint, layers=L, experts=E, bits=bits, sensitivity=sens, initial_bits=init,
                       residual_weights=heads.weights, residual_bias=heads.bias,
                       residual_confidence=heads.confidence, residual_clip=heads.clip, epsilon=_epsilon(sens, bits))
    problem = SearchProblem(table, init, target, held)
    best, table_rows = search(base, problem, opts.progress)
    static = sensitivity_optimal_bits(table, sens, budget_bytes=init_bytes - target)
    refs = reference_rows(problem, static, opts.search_bits)
    t = lap("search", t)

    damages, domain_info = _domain_damages(model, ap, store, stats, opts, seq_len, bits, L, E)
    t = lap("domains", t)

    mass = stats.weight[:, 0::2].sum(axis=0).reshape(L, E)
    mass = mass / np.maximum(mass.sum(axis=1, keepdims=True), 1e-300)
    provenance = {
        "generator": "pwruntime calibrate", "model": str(Path(opts.model).resolve()),
        "ap_checkpoint": str(Path(opts.ap).resolve()), "ap_weighting": ckpt.meta.get("weighting"),
        "device": str(opts.device), "dtype": "float32", "seed": opts.seed, "seq_len": seq_len,
        "heldout_fraction": opts.heldout_fraction, "data": data_info,
        "sequences": {"train": int(len(train_idx)), "heldout": int(len(held_idx))},
        "tokens": {"train": int(train.tokens.sum()), "heldout": int(held.tokens.sum())},
        "sensitivity": {"h": "E[x_j^2] of routed inputs (hessian_diagonals, damp 0, prior 16 tokens)",
                        "scale": opts.sensitivity, "monotone_fixes": fixed},
        "routing_mass": np.round(mass, 6).tolist(),
        "residual_heads": heads.report,
        "initial_assignment": {"initial_mean_bits": opts.initial_mean_bits, "mean_bits": float(init.mean()),
                               "bytes": init_bytes},
        "search": {"target_bytes": target, "search_bits": opts.search_bits, "candidates": table_rows,
                   "references": refs, "chosen": best.to_json()},
        "domains": domain_info,
    }
    cal = best.calibration(base)
    cal.domain_damage = damages
    timings["total"] = round(time.perf_counter() - t_start, 3)
    provenance["timings_s"] = timings
    cal.provenance = provenance
    cal.save(opts.out)
    chosen = next(r for r in table_rows if r["chosen"])
    summary = {"out": str(opts.out), "fingerprint": fingerprint, "blocks": table.num_blocks, "bits": list(bits),
               "sequences": provenance["sequences"], "tokens": provenance["tokens"],
               "chosen": best.to_json(), "chosen_score": chosen["score"], "references": refs,
               "candidates": len(table_rows), "target_bytes": target,
               "head_confidence": {f"{r['kind']} {r['from_bits']}->{r['to_bits']}": r["confidence"]
                                   for r in heads.report},
               "domains": sorted(damages), "monotone_fixes": fixed, "timings_s": timings,
               "wall_seconds": timings["total"]}
    return cal, summary
