"""Writing results: a run directory (Parquet + JSON + PNG) and JSON/CSV tables, all atomically.

A run directory holds `requests.parquet` (per request), `timeline.parquet` (per iteration
boundary), `summary.json` (metrics), `config.json` (the typed `RunConfig` that reproduces it),
`events.json` (budget violations, stalls, plans, link transfers) and `timeline.png`,
`latency.png`. It is assembled in a temporary sibling directory and renamed into place
(`traces.results`, which `pwruntime replay` writes through as well).
"""
from __future__ import annotations

import csv
import io
import os
from collections.abc import Callable
from pathlib import Path

from traces.clikit import UserError, write_text_atomic
from traces.results import dumps, prepare_dir, write_result_dir  # noqa: F401 (prepare_dir: re-exported for cmd_run)


def write_run(result, config_json: dict, out: str | os.PathLike, plots: bool = True, force: bool = False) -> Path:
    events = {"budget_violations": result.violations, "stalls": result.stalls, "plans": result.plans,
              "link_transfers": [{"block": int(b), "start_s": s, "end_s": e, "bytes": int(n)}
                                 for b, s, e, n in result.transfers.tolist()]}

    def draw(tmp: Path) -> None:
        from pwsim import plots as P
        P.run_timeline(result, tmp / "timeline.png")
        P.run_latency(result, tmp / "latency.png")

    return write_result_dir(out, {"requests": result.requests, "timeline": result.timeline},
                            {"summary": result.summary, "config": config_json, "events": events},
                            draw if plots else None, force)


def csv_text(rows: list[dict], columns: list[str]) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=columns, extrasaction="ignore")
    w.writeheader()
    for r in rows:
        w.writerow({k: ("" if r.get(k) is None else r.get(k)) for k in columns})
    return buf.getvalue()


def write_report(out: str | os.PathLike, name: str, report: dict, draw: Callable[[Path], object],
                 profile=None, profile_path: str | os.PathLike | None = None) -> Path:
    """`out/<name>.png`, drawn by `draw(path)` under a temporary name and renamed, `out/<name>.json`, and a fitted
    hardware profile (`traces.hardware.HardwareProfile`) at `profile_path` when one is given. An `out` that is a
    file is a UserError, before anything is written."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file; give a directory")
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".{name}.png.tmp.png"
    draw(tmp)
    tmp.replace(out / f"{name}.png")
    write_text_atomic(out / f"{name}.json", dumps(report))
    if profile is not None:
        profile.save(profile_path)
    return out
