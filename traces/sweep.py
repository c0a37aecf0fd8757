"""A concurrency sweep (`--max-concurrency 1,4,16,64` of `pwruntime bench serve` and of `pwsim run`): its levels,
a row per level, its table and its figure.

Each level is one run of the trace with that many client slots (pwruntime.bench_serve.run_trace against a server;
pwsim.runner with `RunConfig.max_concurrency` in the simulator). The sweep's directory holds a result directory per
level (`c1`, `c4`, ...: each one as a single run writes it, for `pwsim fidelity` or `pwsim chrome-trace`),
`summary.json` (`{"sweep": rows}`, one row per level: throughput, TTFT and TPOT medians and 99th percentiles,
requests not completed) and `sweep.png` (throughput against the level; the latencies against the level).
`pwsim fidelity` pairs two sweeps level by level (`level_dirs`).
"""
from __future__ import annotations

from pathlib import Path

from traces.clikit import UserError, millis, plain_log_ticks, pyplot, write_png


def parse_levels(text: str | None) -> list[int | None]:
    """`--max-concurrency`: one level ("8"), a list ("1,4,16,64"), or none (no limit: [None])."""
    if text is None:
        return [None]
    try:
        levels = [int(part) for part in str(text).split(",")]
    except ValueError:
        levels = []
    if not levels or any(n < 1 for n in levels) or len(set(levels)) != len(levels):
        raise UserError(f"--max-concurrency must be an integer >= 1 or a list of distinct ones (1,4,16,64), got "
                        f"{text!r}")
    return levels


def sweep_row(level: int, summary: dict) -> dict:
    """What the sweep's table shows of one level's run (latencies in seconds, None where no request finished;
    `failed`: the requests not completed, as the client counted them where it did)."""
    slo = summary.get("slo") or {}
    return {"max_concurrency": level, "requests": summary["requests"], "completed": summary["completed"],
            "failed": summary.get("failed", summary["requests"] - summary["completed"]),
            "throughput_tokens_per_s": summary["throughput_tokens_per_s"],
            "ttft_p50_s": summary["ttft_s"]["p50"], "ttft_p99_s": summary["ttft_s"]["p99"],
            "tpot_p50_s": summary["tpot_s"]["p50"], "tpot_p99_s": summary["tpot_s"]["p99"],
            "itl_p99_s": (summary.get("itl_s") or {}).get("p99"),  # None in runs before session 57
            **({"slo_attainment": slo["attainment"], "goodput_rps": slo["goodput_rps"]} if slo else {})}


def table(rows: list[dict]) -> str:
    """The rows as a terminal table (with the SLO's attainment and goodput when the rows have them)."""
    slo = all("goodput_rps" in r for r in rows)
    lines = [f"{'N':>5} {'out tok/s':>10} {'TTFT p50 ms':>12} {'p99 ms':>8} {'TPOT p50 ms':>12} {'p99 ms':>8} "
             f"{'ITL p99 ms':>11} {'failed':>7}" + (f" {'in SLO %':>9} {'goodput req/s':>14}" if slo else "")]
    for r in rows:
        line = (f"{r['max_concurrency']:>5} {r['throughput_tokens_per_s']:>10.0f} {millis(r['ttft_p50_s']):>12} "
                f"{millis(r['ttft_p99_s']):>8} {millis(r['tpot_p50_s']):>12} {millis(r['tpot_p99_s']):>8} "
                f"{millis(r.get('itl_p99_s')):>11} {r['failed']:>7}")
        if slo:
            line += f" {100 * (r['slo_attainment'] or 0):>9.1f} {r['goodput_rps']:>14.3g}"
        lines.append(line)
    return "\n".join(lines)


def level_dirs(sweep_dir: Path, summary: dict) -> dict[int, Path]:
    """A sweep directory's result directory per level (its summary's rows), by level."""
    return {int(row["max_concurrency"]): Path(sweep_dir) / f"c{row['max_concurrency']}" for row in summary["sweep"]}


def plot_sweep(rows: list[dict], path: Path, title: str) -> Path:
    """Throughput against the level (left); TTFT and TPOT, median and 99th percentile, against it (right); the levels
    in order, whatever order the sweep ran them in."""
    plt = pyplot()
    rows = sorted(rows, key=lambda r: r["max_concurrency"])
    levels = [r["max_concurrency"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.plot(levels, [r["throughput_tokens_per_s"] for r in rows], "o-")
    left.set(xscale="log", xlabel="client slots (--max-concurrency)", ylabel="output tokens/s", title="throughput")
    for key, label, color in (("ttft", "TTFT", "C0"), ("tpot", "TPOT", "C1")):
        for pct, style in (("p50", "o-"), ("p99", "x--")):
            values = [r[f"{key}_{pct}_s"] for r in rows]
            right.plot(levels, [float("nan") if v is None else v * 1e3 for v in values], style, color=color,
                       label=f"{label} {pct}")
    right.set(xscale="log", yscale="log", xlabel="client slots (--max-concurrency)", ylabel="ms", title="latency")
    right.legend(fontsize=8)
    plain_log_ticks(right)
    for ax in (left, right):
        ax.set_xticks(levels, [str(n) for n in levels])
        ax.minorticks_off()
    fig.suptitle(title, fontsize=9)
    return write_png(fig, path)
