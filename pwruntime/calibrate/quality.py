"""The quality/bytes table: perplexity per domain at full precision and at uniform AP bitwidths.

Perplexity is `pwruntime.cmd_perplexity.sliding_window_perplexity` over each domain's text: the
full-precision model (the source checkpoint, computed in `dtype`), then the AP checkpoint through
`APExpertStore` with every block at b bits. Weight bytes: routed experts at b bits are the page
table's `M[:, b]` summed (planes + LUT_b, `policies.apformat`); everything else (attention,
embeddings, norms, routers, shared experts) is counted in fp16; the full-precision row counts the
experts in fp16 too. With a calibration (`calibration`), each AP row also gets the simulator's
expected damage per token (`domains.expected_token_damage` from E_d and the domain's routing
frequency), so (damage, perplexity) pairs can be written in pwsim's quality-fit format.
"""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from policies.calibration import Calibration, fingerprints_match
from policies.page_table import PageTable
from traces.clikit import UserError

MIB = 1 << 20


def nonexpert_fp16_bytes(ap_dir: str | Path) -> int:
    """fp16 bytes of the AP checkpoint's non-expert tensors (from the safetensors header, no data read)."""
    from pwruntime.quant.ap_checkpoint import load_ap_checkpoint, open_file

    ck = load_ap_checkpoint(ap_dir)
    name = ck.meta.get("nonexpert_file")
    if not name:
        return 0
    total = 0
    with open_file(Path(ap_dir) / name) as sf:
        for k in sf.keys():
            total += int(np.prod(sf.get_slice(k).get_shape(), dtype=np.int64)) * 2
    return total


def _domain_ids(tokenizer, files: dict[str, Path], max_tokens: int | None) -> dict[str, list[int]]:
    from pwruntime.cmd_perplexity import read_text

    out = {}
    for name, path in files.items():
        ids = tokenizer.encode(read_text(path))
        out[name] = ids[:max_tokens] if max_tokens else ids
        if len(out[name]) < 2:
            raise UserError(f"domain {name} ({path}) has fewer than 2 tokens; pass a longer file")
    return out


def quality_table(model_dir: str | Path, ap_dir: str | Path, files: dict[str, Path], *,
                  bits: tuple[int, ...] = (8, 6, 5, 4, 3), context: int | None = None, stride: int | None = None,
                  max_tokens: int | None = 32768, device: str = "cpu", dtype: str = "fp32",
                  calibration: str | Path | None = None, progress: bool = True) -> dict:
    """Rows (one per weight configuration) with bytes and perplexity per domain; see the module docstring."""
    from pwruntime.calibrate.domains import expected_token_damage
    from pwruntime.calibrate.inputs import model_fingerprint_of
    from pwruntime.cmd_perplexity import sliding_window_perplexity
    from pwruntime.model import load_model
    from pwruntime.quant.ap_checkpoint import load_ap_checkpoint
    from pwruntime.quant.store import load_ap_model

    t0 = time.perf_counter()
    ck = load_ap_checkpoint(ap_dir)
    fp = model_fingerprint_of(model_dir)
    ap_fp = str((ck.meta.get("source") or {}).get("fingerprint") or "")
    if not fingerprints_match(ap_fp, fp):
        raise UserError(f"AP checkpoint {ap_dir} was quantized from another model ({ap_fp or 'unknown'}), not "
                        f"{model_dir} ({fp}); pass the AP checkpoint made from this model")
    missing = sorted(set(bits) - set(ck.bits))
    if missing:
        raise UserError(f"bitwidths {missing} are not stored in {ap_dir} (bits {list(ck.bits)}); choose from those")
    cal = Calibration.load(calibration, expect_fingerprint=fp) if calibration else None
    model = load_model(model_dir, dtype=dtype, device=device)
    c = model.config
    ctx = context or min(512, c.max_position)
    if ctx > c.max_position or ctx < 2:
        raise UserError(f"--context {ctx} must be between 2 and the model's {c.max_position} positions")
    st = stride or max(1, ctx // 2)
    if st > ctx:
        raise UserError(f"--stride {st} exceeds the context of {ctx} tokens: use a smaller --stride")
    ids = _domain_ids(model.tokenizer, files, max_tokens)
    table = PageTable(c.num_moe_layers, c.experts, c.hidden, c.expert_intermediate, bits=ck.bits)
    rest = nonexpert_fp16_bytes(ap_dir)
    expert_fp16 = int((table.shapes[:, 0] * table.shapes[:, 1]).sum()) * 2
    rows = [{"weights": "full precision", "bits": 16, "expert_bytes": expert_fp16, "nonexpert_bytes": rest,
             "total_bytes": expert_fp16 + rest,
             "perplexity": {d: sliding_window_perplexity(model, x, ctx, st, progress=progress).perplexity
                            for d, x in ids.items()}}]
    del model
    ap_model, store = load_ap_model(ap_dir, dtype=dtype, device=device)
    prov = (cal.provenance.get("domains") or {}) if cal is not None else {}
    for b in bits:
        store.set_bits(b)
        store.clear_cache()
        eb = int(table.M[:, b].sum())
        row = {"weights": f"AP uniform {b}", "bits": b, "expert_bytes": eb, "nonexpert_bytes": rest,
               "total_bytes": eb + rest,
               "perplexity": {d: sliding_window_perplexity(ap_model, x, ctx, st, progress=progress).perplexity
                              for d, x in ids.items()}}
        if cal is not None:
            row["damage_per_token"] = {
                d: expected_token_damage(cal.domain_damage[d], np.asarray(prov[d]["routing_frequency"]),
                                         np.full(table.num_blocks, b))
                for d in ids if d in cal.domain_damage and d in prov}
        rows.append(row)
    for r in rows:
        r["vs_fp16"] = r["total_bytes"] / rows[0]["total_bytes"]
    out = {"model": str(model_dir), "ap": str(ap_dir), "domains": {d: len(x) for d, x in ids.items()},
           "context": ctx, "stride": st, "dtype": dtype, "device": device, "rows": rows,
           "quantize_seconds": ck.meta.get("quantize_seconds"),
           "calibrate_seconds": (cal.provenance.get("timings_s") or {}).get("total") if cal is not None else None,
           "seconds": round(time.perf_counter() - t0, 3)}
    out["markdown"] = markdown(out)
    if cal is not None:
        out["fit_points"] = fit_points(rows)
    return out


def fit_points(rows: list[dict]) -> list[dict]:
    """(damage, perplexity) pairs in pwsim's quality-fit format: the full-precision row at damage 0.

    Domains differ in base perplexity, so each point also carries `ppl_ratio` (to the domain's
    full-precision perplexity), the quantity a fit across domains should use."""
    pts = []
    base = rows[0]["perplexity"]
    for r in rows:
        for d, ppl in r["perplexity"].items():
            dmg = 0.0 if r["bits"] == 16 else (r.get("damage_per_token") or {}).get(d)
            if dmg is not None:
                pts.append({"damage": float(dmg), "ppl": float(ppl), "domain": d, "bits": r["bits"],
                            "ppl_ratio": float(ppl / base[d])})
    return pts


def markdown(result: dict) -> str:
    doms = list(result["domains"])
    head = ["weights", "expert MiB", "total MiB", "of fp16"] + [f"ppl {d}" for d in doms]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in result["rows"]:
        cells = [r["weights"], f"{r['expert_bytes'] / MIB:.2f}", f"{r['total_bytes'] / MIB:.2f}",
                 f"{100 * r['vs_fp16']:.0f}%"] + [f"{r['perplexity'][d]:.3f}" for d in doms]
        lines.append("| " + " | ".join(cells) + " |")
    tokens = ", ".join(f"{d} {n}" for d, n in result["domains"].items())
    lines.append("")
    lines.append(f"Sliding-window perplexity (context {result['context']}, stride {result['stride']}, "
                 f"{result['dtype']}), tokens per domain: {tokens}. Non-expert weights counted in fp16.")
    times = [f"{k} {result[k + '_seconds']:.1f} s" for k in ("quantize", "calibrate") if result.get(k + "_seconds")]
    if times:
        lines.append(f"Wall time: {'; '.join(times)}.")
    return "\n".join(lines)
