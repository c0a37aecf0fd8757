"""Writing results: a run directory (Parquet + JSON + PNG) and JSON/CSV tables, all atomically.

A run directory holds `requests.parquet` (per request), `timeline.parquet` (per iteration
boundary), `plans.parquet` (every transition begun, refused or landed: `policies.plan_log`), `summary.json`
(metrics), `config.json` (the typed `RunConfig` that reproduces it),
`events.json` (budget violations, stalls, plans, link transfers) and `timeline.png`,
`latency.png`. It is assembled in a temporary sibling directory and renamed into place
(`traces.results`, which `pwruntime replay` writes through as well).
"""
from __future__ import annotations

import csv
import io
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from traces.clikit import UserError, check_output, writing
from traces.results import dumps, prepare_dir, write_result_dir  # noqa: F401 (prepare_dir: re-exported for cmd_run)


def write_run(result, config_json: dict, out: str | os.PathLike, plots: bool = True, force: bool = False) -> Path:
    events = {"budget_violations": result.violations, "stalls": result.stalls, "plans": result.plans,
              "link_transfers": [{"block": int(b), "start_s": s, "end_s": e, "bytes": int(n)}
                                 for b, s, e, n in result.transfers.tolist()]}

    def draw(tmp: Path) -> None:
        from pwsim import plots as P
        P.run_timeline(result, tmp / "timeline.png")
        P.run_latency(result, tmp / "latency.png")

    return write_result_dir(out, {"requests": result.requests, "timeline": result.timeline, "plans": result.plan_log},
                            {"summary": result.summary, "config": config_json, "events": events},
                            draw if plots else None, force)


def csv_text(rows: list[dict], columns: list[str]) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=columns, extrasaction="ignore")
    w.writeheader()
    for r in rows:
        w.writerow({k: ("" if r.get(k) is None else r.get(k)) for k in columns})
    return buf.getvalue()


def write_files(out: str | os.PathLike, files: dict[str, Callable[[Path], object]],
                before_move: Callable[[], object] | None = None) -> Path:
    """Write each `out/<name>` through `files[name](path)` into a temporary folder inside `out`, call `before_move()`
    (a file written elsewhere, such as a fitted profile), and only then move them all into place (other files in `out`
    stay): a failure on the way leaves `out` as it was, and removes it when this call created it. An OSError (a disk
    that fills up, a folder that cannot be written) is a UserError."""
    out = Path(out)
    created = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".staging.", dir=out))
        try:
            for name, write in files.items():
                write(tmp / name)
            if before_move is not None:
                before_move()
            for name in files:
                os.replace(tmp / name, out / name)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException as e:
        if created:
            shutil.rmtree(out, ignore_errors=True)
        if isinstance(e, OSError):
            raise UserError(f"cannot write {out} ({e.strerror or e}); nothing was written") from None
        raise
    return out


def write_report(out: str | os.PathLike, name: str, report: dict, draw: Callable[[Path], object],
                 profile=None, profile_path: str | os.PathLike | None = None) -> Path:
    """`out/<name>.png`, drawn by `draw(path)`, `out/<name>.json`, and a fitted hardware profile
    (`traces.hardware.HardwareProfile`) at `profile_path` when one is given, all or nothing (`write_files`). An `out`
    that is a file, or either path unwritable, is a UserError before anything is written."""
    out = Path(out)
    check_output(out)
    if profile is not None:
        check_output(profile_path, "--fit-profile", directory=False)

    def save_profile() -> None:
        with writing(profile_path, "--fit-profile"):
            profile.save(profile_path)

    return write_files(out, {f"{name}.png": draw, f"{name}.json": lambda path: path.write_text(dumps(report))},
                       save_profile if profile is not None else None)
