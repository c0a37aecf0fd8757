"""Figure of a `pwruntime bench kernels` result (matplotlib, Agg backend): one block and MoE layers.

Left: the Mixtral-sized linear-block, AP time per bitwidth at each T against torch fp16 (dashed), torch's
dense GEMV over the same bytes as the planes (dotted, runs since session 21) and the issue's 8 us target at 3 bits.
Right: whole MoE layers at 3 bits, measured time over the roofline per model and T, with the
issue's 1.5x target as a line, and (black ticks, runs since session 21) torch's two dense GEMVs over the same bytes
over the roofline: the floor torch itself reaches at that size.
"""
from __future__ import annotations

from pathlib import Path

from traces.clikit import pyplot, write_png

MODEL_LABELS = {"demo": "demo", "qwen1.5-moe-a2.7b": "Qwen1.5-MoE", "mixtral-8x7b": "Mixtral",
                "olmoe-1b-7b": "OLMoE", "qwen3-moe-30b-a3b": "Qwen3-MoE", "gemma-4-26b-a4b": "Gemma 4"}


def plot_bench(res: dict, path: Path, moe_bits: int = 3) -> Path:
    """Write the figure of `res` (the JSON `pwruntime bench kernels --out` writes) to `path`."""
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    blocks = res.get("single_block", [])
    for i, t in enumerate(sorted({r["tokens"] for r in blocks})):
        rows = sorted((r for r in blocks if r["tokens"] == t), key=lambda r: r["bits"])
        color = f"C{i}"
        left.plot([r["bits"] for r in rows], [r["ap_us"] for r in rows], "o-", color=color, label=f"AP, T={t}")
        left.axhline(rows[0]["fp16_us"], color=color, ls="--", lw=1, label=f"torch fp16, T={t}")
        if all(r.get("fp16_same_bytes_us") for r in rows):
            left.plot([r["bits"] for r in rows], [r["fp16_same_bytes_us"] for r in rows], ":", color=color,
                      label=f"torch fp16 over the same bytes, T={t}")
    if blocks:
        left.set_title(f"one {blocks[0]['out']}x{blocks[0]['in']} block")
        left.plot([3], [8.0], "rx", ms=9, label="target at 3 bits, T=1")
    left.set_xlabel("committed bits")
    left.set_ylabel("us")
    left.legend(fontsize=8)

    moe = [r for r in res.get("moe", []) if r["bits"] == moe_bits]
    models = list(dict.fromkeys(r["model"] for r in moe))   # in the run's order
    tokens = sorted({r["tokens"] for r in moe})
    width = 0.8 / max(1, len(tokens))
    for j, t in enumerate(tokens):
        rows = [next((r for r in moe if r["model"] == m and r["tokens"] == t), None) for m in models]
        xs = [i + j * width for i in range(len(models))]
        right.bar(xs, [r["vs_roofline"] if r else 0.0 for r in rows], width, label=f"T={t}")
        floor = [(x, r["fp16_same_bytes_us"] / r["roofline_us"]) for x, r in zip(xs, rows)
                 if r and r.get("fp16_same_bytes_us") and r.get("roofline_us")]
        if floor:
            right.plot(*zip(*floor), "_", color="k", ms=14, mew=2,
                       label="torch fp16 over the same bytes" if j == 0 else None)
    right.axhline(1.5, color="r", ls="--", lw=1, label="target 1.5x")
    right.set_xticks([i + width * (len(tokens) - 1) / 2 for i in range(len(models))])
    right.set_xticklabels([MODEL_LABELS.get(m, m) for m in models])
    right.set_ylabel("measured / roofline")
    right.set_title(f"one MoE layer at {moe_bits} bits")
    right.set_ylim(0, right.get_ylim()[1] * 1.3)   # room for the legend above the bars
    right.legend(fontsize=8, ncol=3, loc="upper center")

    fig.suptitle(f"{res.get('device', '')}: fused AP kernels", fontsize=11)
    return write_png(fig, path)
