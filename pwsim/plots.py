"""Figures of simulation results (matplotlib, Agg backend): one run's timelines and latencies, and the
comparison plots of `pwsim compare` (quality vs memory like the paper's Figure 5, throughput,
timelines per policy), the latency-against-rate curves of `pwsim capacity`, and the model-against-measurement plots
of `pwsim fidelity` and `pwsim prefill-fit`."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from pwsim.hardware import memory_unit
from traces.clikit import plain_log_ticks, pyplot, write_png

GiB = 2**30


def setting(model: str, hardware) -> str:
    """What a plot's results simulate, for its title: the model card and the hardware profile (a summary's
    `hardware` record, or its name)."""
    name = hardware.get("name") if isinstance(hardware, dict) else hardware
    return f"{model} on {name}"


def _title(result) -> str:
    s = result.summary
    return f"{s.get('label', '')} · {setting(s.get('model', '?'), s.get('hardware', '?'))}"


def run_timeline(result, path: Path, title: str = "") -> Path:
    """Memory stack (weights, KV pool, KV in use) against the budget, mean committed bits, free blocks."""
    plt = pyplot()
    tl = result.timeline
    fig, axes = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
    if len(tl.get("time_s", [])):
        t = tl["time_s"]
        ax = axes[0]
        div, unit = memory_unit(result.summary["memory"]["budget_bytes"])
        ax.stackplot(t, tl["weight_bytes"] / div, tl["kv_pool_bytes"] / div, labels=["weights", "KV pool"],
                     colors=["#4c72b0", "#dd8452"], alpha=0.8)
        ax.plot(t, (tl["kv_used_bytes"] + tl["weight_bytes"]) / div, color="k", lw=0.8, label="weights + KV in use")
        ax.axhline(result.summary["memory"]["budget_bytes"] / div, color="r", ls="--", lw=1, label="budget")
        ax.set_ylabel(unit)
        ax.legend(loc="lower right", fontsize=8)
        axes[1].plot(t, tl["mean_bits"], color="#55a868")
        axes[1].set_ylabel("mean committed bits")
        axes[2].plot(t, tl["free_blocks"], color="#8172b3", lw=0.8, label="free KV blocks")
        axes[2].plot(t, tl["running"], color="#c44e52", lw=0.8, label="running requests")
        axes[2].set_ylabel("blocks / requests")
        axes[2].legend(loc="upper right", fontsize=8)
    axes[-1].set_xlabel("simulated time (s)")
    axes[0].set_title(title or _title(result))
    return write_png(fig, path)


def run_latency(result, path: Path, title: str = "") -> Path:
    """CDFs of TTFT, TPOT, each request's longest gap between two tokens (its worst stall) and end-to-end latency."""
    plt = pyplot()
    panels = [("ttft_s", "TTFT", 1), ("tpot_s", "TPOT", 1e3), ("max_itl_s", "longest token gap", 1e3),
              ("e2e_s", "end to end", 1)]
    fig, axes = plt.subplots(1, 4, figsize=(14, 3.4))
    for ax, (key, name, scale) in zip(axes, panels):
        v = np.sort(np.asarray(result.requests[key], dtype=float))
        v = v[np.isfinite(v)]
        if v.size:
            ax.plot(v * scale, np.arange(1, v.size + 1) / v.size)
        ax.set_xlabel(f"{name} ({'ms' if scale == 1e3 else 's'})")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("fraction of requests")
    fig.suptitle(title or _title(result))
    return write_png(fig, path)


def _quality_axis(rows: list[dict]) -> tuple[str, str]:
    if any(r.get("predicted_ppl") is not None for r in rows):
        relative = any((r.get("quality_fit") or {}).get("relative") for r in rows)
        what = "perplexity / full precision" if relative else "perplexity"
        return "predicted_ppl", f"predicted {what}\n(fit on runtime measurements)"
    return "damage_per_token", "mean damage per generated token\n(no perplexity fit measured)"


def compare_quality_memory(rows: list[dict], path: Path, context: str = "") -> Path:
    """Quality against peak GPU memory, one series per policy across budgets (Figure 5 style)."""
    plt = pyplot()
    key, label = _quality_axis(rows)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    div, unit = memory_unit(max((r.get("used_gib") or 0.0) for r in rows) * GiB)
    scale = GiB / div  # rows hold GiB
    for pol in dict.fromkeys(r["policy"] for r in rows):
        pts = sorted((r["used_gib"] * scale, r[key]) for r in rows if r["policy"] == pol and r["status"] == "ok"
                     and r.get(key) is not None)
        if pts:
            x, y = zip(*pts)
            ax.plot(x, y, marker="o", label=pol)
    ax.set_xlabel(f"peak GPU memory in use: weights + KV blocks in use ({unit})")
    ax.set_ylabel(label)
    if key == "damage_per_token" and any((r.get(key) or 0) > 0 for r in rows):
        ax.set_yscale("symlog", linthresh=max(1e-9, min((r[key] for r in rows if r.get(key)), default=1.0)))
    ax.set_title("quality vs memory (lower is better)" + (f"\n{context}" if context else ""), fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return write_png(fig, path)


def compare_throughput(rows: list[dict], budgets: list[str], path: Path, context: str = "") -> Path:
    """Output tokens per simulated second per policy and budget (grouped bars; infeasible runs empty)."""
    plt = pyplot()
    pols = list(dict.fromkeys(r["policy"] for r in rows))
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(budgets) * max(1, len(pols)) / 3), 4))
    width, top = 0.8 / max(1, len(pols)), 0.0
    for j, pol in enumerate(pols):
        ys = []
        for b in budgets:
            r = next((r for r in rows if r["policy"] == pol and r["budget"] == b), None)
            ys.append(r["throughput_tok_s"] if r and r["status"] == "ok" else 0.0)
        ax.bar(np.arange(len(budgets)) + j * width, ys, width, label=pol)
        top = max(top, *ys)
    ax.set_xticks(np.arange(len(budgets)) + width * (len(pols) - 1) / 2)
    ax.set_xticklabels(budgets)
    ax.set_xlabel("memory budget")
    ax.set_ylabel("output tokens / simulated s")
    ax.set_title("throughput" + (f"\n{context}" if context else ""), fontsize=10)
    ax.set_ylim(0, 1.25 * top or 1.0)  # room above the bars for the legend
    ax.legend(fontsize=8, ncol=min(4, len(pols)), loc="upper center")
    ax.grid(axis="y", alpha=0.3)
    return write_png(fig, path)


def compare_timelines(results: dict[str, object], path: Path, title: str) -> Path:
    """Memory use, mean committed bits and free KV blocks over time, one line per policy."""
    plt = pyplot()
    fig, axes = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
    div, unit = memory_unit(max((r.summary["memory"]["budget_bytes"] for r in results.values()), default=GiB))
    for name, res in results.items():
        tl = res.timeline
        if not len(tl.get("time_s", [])):
            continue
        t = tl["time_s"]
        line, = axes[0].plot(t, (tl["weight_bytes"] + tl["kv_used_bytes"]) / div, lw=0.9, label=name)
        axes[0].plot(t, tl["weight_bytes"] / div, lw=0.9, ls=":", color=line.get_color())
        axes[1].plot(t, tl["mean_bits"], lw=0.9, label=name)
        axes[2].plot(t, tl["free_blocks"], lw=0.6, label=name)
    axes[0].set_ylabel(f"{unit} (solid: weights + KV in use;\ndotted: weights)")
    axes[1].set_ylabel("mean committed bits")
    axes[2].set_ylabel("free KV blocks")
    axes[2].set_xlabel("simulated time (s)")
    axes[0].set_title(title)
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=8, loc="lower right")
    return write_png(fig, path)


def capacity(searches: list[dict], budgets: list[str], curve_budget: str, slo: dict, path: Path,
             context: str = "") -> Path:
    """Left: each policy's capacity (requests/s) against the memory budget (none drawn where it missed at the lowest
    rate). Right, at `curve_budget`: the SLO's TTFT and TPOT percentile against the arrival rate at every point a
    search ran (open markers: points that missed), the bounds dashed and each capacity dotted."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    key = f"p{slo['percentile']}"
    policies = list(dict.fromkeys(s["policy"] for s in searches))
    colors = {p: f"C{i}" for i, p in enumerate(policies)}
    for pol in policies:
        caps = [next(s for s in searches if s["policy"] == pol and s["budget"] == b)["rate_rps"] for b in budgets]
        axes[0].plot(range(len(budgets)), [np.nan if c is None else c for c in caps], "o-", color=colors[pol],
                     label=pol)
    axes[0].set_xticks(range(len(budgets)))
    axes[0].set_xticklabels(budgets)
    axes[0].set_xlabel("memory budget")
    axes[0].set_ylabel("capacity (requests / s)")
    how = key if slo.get("attainment") is None else f"{100 * slo['attainment']:g}% of requests within the bounds"
    axes[0].set_title(f"the highest rate meeting the SLO ({how})", fontsize=9)
    axes[0].legend(fontsize=8)
    axes[0].grid(alpha=0.3)
    for res in (s for s in searches if s["budget"] == curve_budget):
        pts, color = res["points"], colors[res["policy"]]
        rate = np.array([p["rate_rps"] for p in pts])
        met = np.array([p["met"] for p in pts])
        for ax, field in zip(axes[1:], ("ttft_s", "tpot_s")):
            y = np.array([np.nan if p[field] is None else p[field] * 1e3 for p in pts])
            ax.plot(rate, y, lw=1.0, color=color, label=res["policy"])
            ax.scatter(rate[met], y[met], s=18, color=color)
            ax.scatter(rate[~met], y[~met], s=18, facecolors="none", edgecolors=color)
            if res["rate_rps"] is not None:
                ax.axvline(res["rate_rps"], ls=":", lw=1.0, color=color)
    for ax, field, label in zip(axes[1:], ("ttft_s", "tpot_s"), ("TTFT", "TPOT")):
        if slo[field] is not None:
            ax.axhline(slo[field] * 1e3, ls="--", color="k", lw=0.8, label="SLO")
        ax.set_xscale("log")
        ax.set_yscale("log")
        plain_log_ticks(ax)
        ax.set_xlabel("arrival rate (requests / s)")
        ax.set_ylabel(f"{label} {key} (ms)")
        ax.set_title(f"at {curve_budget}; open markers missed the SLO; dotted: each capacity", fontsize=9)
        ax.grid(alpha=0.3, which="both")
    axes[1].legend(fontsize=8)
    if context:
        fig.suptitle(context, fontsize=10)
    return write_png(fig, path)


def fidelity(paired: dict, sim_timeline: dict, runtime_timeline: dict, report: dict, path: Path) -> Path:
    """Per request, simulated against measured TTFT / TPOT / end to end (log-log, y = x dashed); iteration time
    against batch tokens for both engines with their fitted lines; and, where the timelines record them, both
    engines' KV blocks and mean bits step by step, the first step they part at marked."""
    plt = pyplot()
    steps = report.get("decisions") is not None and all(
        c in tl for tl in (sim_timeline, runtime_timeline) for c in ("step", "total_blocks", "mean_bits"))
    fig, axes = plt.subplots(1, 5 if steps else 4, figsize=(19 if steps else 15, 3.8))
    for ax, (key, name) in zip(axes, (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("e2e_s", "end to end"))):
        s, r = paired[key]
        ok = np.isfinite(s) & np.isfinite(r) & (s > 0) & (r > 0)
        if ok.any():
            ax.scatter(r[ok], s[ok], s=8, alpha=0.6)
            lo, hi = min(s[ok].min(), r[ok].min()), max(s[ok].max(), r[ok].max())
            ax.plot([lo, hi], [lo, hi], "k--", lw=0.8)
            ax.set_xscale("log")
            ax.set_yscale("log")
        m = report["metrics"][key]
        ratio = "n/a" if m["ratio_p50"] is None else f"{m['ratio_p50']:.2f}"
        ax.set_title(f"{name}: sim / runtime median {ratio}", fontsize=9)
        ax.set_xlabel("runtime (s)")
        ax.set_ylabel("simulated (s)")
        ax.grid(alpha=0.3, which="both")
    ax = axes[3]
    for tl, label, color in ((sim_timeline, "sim", "#4c72b0"), (runtime_timeline, "runtime", "#dd8452")):
        x = np.asarray(tl.get("batch_tokens", []), dtype=float)
        t = np.asarray(tl.get("iter_s", []), dtype=float)
        if x.size:
            ax.scatter(x, t * 1e3, s=4, alpha=0.3, color=color, label=label)
        fit = report["iterations"][label]
        if fit["intercept_s"] is not None and fit["per_token_s"] is not None and x.size:
            xs = np.array([max(x.min(), 1), x.max()])
            ax.plot(xs, (fit["intercept_s"] + fit["per_token_s"] * xs) * 1e3, color=color, lw=1.2)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("tokens in the iteration")
    ax.set_ylabel("iteration time (ms)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, which="both")
    if steps:
        _decisions_panel(axes[4], sim_timeline, runtime_timeline, report["decisions"])
    return write_png(fig, path)


def _decisions_panel(ax, sim_timeline: dict, runtime_timeline: dict, d: dict) -> None:
    """KV blocks (solid) and mean bits (dashed, right axis) per step on both engines; the first step apart marked."""
    bits = ax.twinx()
    for tl, label, color in ((sim_timeline, "sim", "#4c72b0"), (runtime_timeline, "runtime", "#dd8452")):
        step = np.asarray(tl["step"])
        ax.plot(step, np.asarray(tl["total_blocks"]), color=color, lw=1.0, label=f"{label} KV blocks")
        bits.plot(step, np.asarray(tl["mean_bits"]), color=color, lw=0.8, ls="--", label=f"{label} bits")
    if d["first_difference"] is not None:
        ax.axvline(d["first_difference"], color="k", lw=0.8, ls=":")
    apart = "none apart" if d["first_difference"] is None else f"first apart at {d['first_difference']}"
    ax.set_title(f"decisions: alike at {d['agreeing_steps']} of {d['steps']} steps ({apart})", fontsize=9)
    ax.set_xlabel("engine step")
    ax.set_ylabel("KV blocks")
    bits.set_ylabel("mean committed bits")
    ax.legend(fontsize=7, loc="lower left")
    ax.grid(alpha=0.3)


def prefill_fit(report: dict, path: Path) -> Path:
    """Per bench row, the modeled prefill MoE layer against the measured one, before and after the fit (y = x)."""
    plt = pyplot()
    rows = report["rows"]
    fig, ax = plt.subplots(figsize=(6, 5))
    measured = np.array([r["measured_ms"] for r in rows])
    before, after = (np.array([r[k] for r in rows]) for k in ("modeled_ms", "fitted_ms"))
    models = list(dict.fromkeys(r["model"] for r in rows))
    for j, m in enumerate(models):
        sel = np.array([r["model"] == m for r in rows])
        color = f"C{j % 10}"
        ax.scatter(measured[sel], before[sel], s=30, facecolors="none", edgecolors=color, label=f"{m} (before)")
        ax.scatter(measured[sel], after[sel], s=30, color=color, label=f"{m} (after)")
    lo, hi = min(measured.min(), before.min(), after.min()), max(measured.max(), before.max(), after.max())
    ax.plot([lo, hi], [lo, hi], "k--", lw=0.8, label="y = x")
    r, fitted = report["ratios"], report["fit"]
    ax.set_title(f"prefill MoE layer on {report['hardware']}: modeled / measured median "
                 f"{r['before']['median']:.2f} -> {r['after']['median']:.2f}\n(fitted "
                 f"{fitted['prefill_layer_overhead_us']:.0f} us a layer, "
                 f"{fitted['prefill_chunk_overhead_us']:.0f} us a chunk after its first)", fontsize=9)
    ax.set_xlabel("measured (ms, runtime wall clock)")
    ax.set_ylabel("modeled (ms, cost model)")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    return write_png(fig, path)


def fidelity_sweep(rows: list[dict], path: Path) -> Path:
    """Two concurrency sweeps level by level: both sides' throughput (left) and median TPOT (right) against the
    client's concurrency limit."""
    plt = pyplot()
    levels = [r["max_concurrency"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for side, style in (("sim", "o-"), ("runtime", "s--")):
        left.plot(levels, [r[f"{side}_tokens_per_s"] for r in rows], style, label=side)
        right.plot(levels, [float("nan") if r[f"{side}_tpot_p50_s"] is None else r[f"{side}_tpot_p50_s"] * 1e3
                            for r in rows], style, label=side)
    left.set(ylabel="output tokens/s", title="throughput")
    right.set(ylabel="ms", title="TPOT p50")
    for ax in (left, right):
        ax.set(xscale="log", xlabel="client slots (--max-concurrency)")
        ax.set_xticks(levels, [str(n) for n in levels])
        ax.minorticks_off()
        ax.legend(fontsize=8)
    return write_png(fig, path)


def plan_log(logs: dict[str, dict], summaries: list[dict], path: Path) -> Path:
    """Per run (`pwsim plan-log`): the offloads and reloads begun, cumulated over the steps (left), and the GPU bytes
    its reloads took back, those that closed round trips apart (right)."""
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [2, 1]})
    for k, (label, plans) in enumerate(logs.items()):
        started = np.asarray(plans["status"], dtype=object) == "started"
        up = np.asarray(plans["to_bits"]) > np.asarray(plans["from_bits"])
        for mask, style, what in ((started & ~up, "-", "offloads"), (started & up, "--", "reloads")):
            steps = np.sort(np.asarray(plans["step"])[mask])
            left.step(steps, np.arange(1, len(steps) + 1), style, color=f"C{k}", where="post", label=f"{label}: {what}")
    left.set(xlabel="engine step", ylabel="transitions begun (cumulative)", title="page moves")
    left.legend(fontsize=7)
    div, unit = memory_unit(max([s["taken_bytes"] for s in summaries] + [1]))
    x = np.arange(len(summaries))
    trips = np.array([s["round_trips"]["taken_bytes"] for s in summaries]) / div
    rest = np.array([s["taken_bytes"] for s in summaries]) / div - trips
    right.bar(x, trips, color="C3", label="closing a round trip")
    right.bar(x, rest, bottom=trips, color="C0", label="other reloads")
    right.set_xticks(x, list(logs), rotation=20, fontsize=7)
    right.set(ylabel=unit, title="GPU bytes the reloads took back")
    right.legend(fontsize=7)
    return write_png(fig, path)
