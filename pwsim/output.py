"""Writing results: a run directory (Parquet + JSON + PNG) and JSON/CSV tables, all atomically.

A run directory holds `requests.parquet` (per request), `timeline.parquet` (per iteration
boundary), `summary.json` (metrics), `config.json` (the typed `RunConfig` that reproduces it),
`events.json` (budget violations, stalls, plans, link transfers) and `timeline.png`,
`latency.png`. It is assembled in a temporary sibling directory and renamed into place.
"""
from __future__ import annotations

import csv
import io
import json
import math
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from traces.clikit import UserError

RESULT_MARKER = "summary.json"


def clean(obj):
    """JSON-safe copy: numpy scalars/arrays to Python, NaN/inf to None."""
    if isinstance(obj, dict):
        return {str(k): clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [clean(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return clean(obj.tolist())
    if isinstance(obj, np.generic):
        return clean(obj.item())
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


def dumps(obj) -> str:
    return json.dumps(clean(obj), indent=2, sort_keys=False)


def _columns_table(cols: dict) -> pa.Table:
    out = {}
    for k, v in cols.items():
        a = np.asarray(v)
        out[k] = pa.array(a.tolist() if a.dtype == object else a)
    return pa.table(out)


def prepare_dir(out: Path, force: bool) -> None:
    """Refuse to overwrite a directory that is not a previous result unless forced."""
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file; give a directory")
    if out.exists() and any(out.iterdir()) and not (out / RESULT_MARKER).exists() and not force:
        raise UserError(f"--out {out} is not empty and holds no previous pwsim result; choose another directory "
                        "or pass --force")


def _replace_dir(tmp: Path, out: Path) -> None:
    if out.exists():
        old = out.with_name(f".{out.name}.old")
        if old.exists():
            shutil.rmtree(old)
        out.rename(old)
        tmp.rename(out)
        shutil.rmtree(old)
    else:
        tmp.rename(out)


def write_run(result, config_json: dict, out: str | os.PathLike, plots: bool = True, force: bool = False) -> Path:
    out = Path(out)
    prepare_dir(out, force)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        pq.write_table(_columns_table(result.requests), tmp / "requests.parquet", compression="zstd")
        pq.write_table(_columns_table(result.timeline), tmp / "timeline.parquet", compression="zstd")
        (tmp / "summary.json").write_text(dumps(result.summary))
        (tmp / "config.json").write_text(dumps(config_json))
        events = {"budget_violations": result.violations, "stalls": result.stalls, "plans": result.plans,
                  "link_transfers": [{"block": int(b), "start_s": s, "end_s": e, "bytes": int(n)}
                                     for b, s, e, n in result.transfers.tolist()]}
        (tmp / "events.json").write_text(dumps(events))
        if plots:
            from pwsim import plots as P
            P.run_timeline(result, tmp / "timeline.png")
            P.run_latency(result, tmp / "latency.png")
        _replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def csv_text(rows: list[dict], columns: list[str]) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=columns, extrasaction="ignore")
    w.writeheader()
    for r in rows:
        w.writerow({k: ("" if r.get(k) is None else r.get(k)) for k in columns})
    return buf.getvalue()
