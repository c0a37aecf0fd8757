"""The offline calibration (the paper's Omega_off) and its directory format.

A calibration directory holds `calibration.json` (scalars, tuples, provenance, the model
fingerprint) and `arrays.npz` (every numpy field; per-domain damages as `domain_damage.<name>`).
Loading checks the format version and, when asked, the model fingerprint.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import zipfile
from dataclasses import dataclass, field, fields
from pathlib import Path

import numpy as np

from policies.apformat import MAX_BITS

FORMAT_VERSION = 1
NB = MAX_BITS + 1  # arrays indexed by bits 0..8


class CalibrationError(ValueError):
    """A calibration directory is missing, malformed, or for another model."""


_REMAKE = "re-run `pwruntime calibrate` to make the calibration again"


def _read_arrays(path: Path) -> dict[str, np.ndarray]:
    """The arrays of a calibration's `arrays.npz`; anything else (random bytes, a truncated archive, an object array,
    which numpy would unpickle) is a CalibrationError naming the file."""
    if not zipfile.is_zipfile(path):
        raise CalibrationError(f"{path} is corrupt or incomplete (not a .npz archive); {_REMAKE}")
    try:
        with np.load(path, allow_pickle=False) as npz:
            return {k: npz[k] for k in npz.files}
    except ValueError:  # an object array (pickled Python objects), or a malformed array header
        raise CalibrationError(f"{path} is corrupt or incomplete (an entry is not a plain numeric array); "
                               f"{_REMAKE}") from None
    except (OSError, EOFError, zipfile.BadZipFile) as e:  # a truncated or damaged entry
        raise CalibrationError(f"{path} is corrupt or incomplete ({type(e).__name__}: {e}); {_REMAKE}") from None


def model_fingerprint(architecture: dict, weights_digest: str | None = None) -> str:
    """`arch:<sha12>[+w:<digest>]` from the architecture numbers (and optionally the weights)."""
    canon = json.dumps(architecture, sort_keys=True, separators=(",", ":"))
    arch = hashlib.sha256(canon.encode()).hexdigest()[:12]
    return f"arch:{arch}" + (f"+w:{weights_digest}" if weights_digest else "")


def fingerprints_match(a: str, b: str) -> bool:
    """Architectures must agree; weight digests must agree when both sides carry one."""
    arch_a, _, w_a = a.partition("+")
    arch_b, _, w_b = b.partition("+")
    return arch_a == arch_b and (not w_a or not w_b or w_a == w_b)


@dataclass
class Calibration:
    fingerprint: str
    layers: int
    experts: int
    bits: tuple[int, ...]
    sensitivity: np.ndarray  # [n_blocks, 9]: s[i, b], Eq. 2 (NaN where b unsupported)
    initial_bits: np.ndarray  # [n_blocks]
    residual_weights: np.ndarray = field(default_factory=lambda: np.zeros((2, NB, NB, 3)))  # w_u^{b->b'}
    residual_bias: np.ndarray = field(default_factory=lambda: np.zeros((2, NB, NB)))  # a_u^{b->b'}
    residual_confidence: np.ndarray = field(default_factory=lambda: np.zeros((2, NB, NB)))  # c_u
    residual_clip: np.ndarray = field(default_factory=lambda: np.zeros((2, NB, NB, 2)))  # rho_min, rho_max
    bucket_bounds: tuple[float, ...] = (0.25, 0.5, 1.0)  # cumulative expert fraction per bucket, hottest first
    bucket_multipliers: tuple[float, ...] = (4.0, 2.0, 1.0)
    floor_stages: tuple[tuple[int, ...], ...] = ((5, 4, 3), (4, 3, 3), (3, 3, 3))  # floor bits per bucket
    depth_caps: tuple[int, ...] = (1, 2, 5)  # per stage: most bits a block may drop below its start
    alpha: float = 1.0
    epsilon: float = 1e-12
    free_block_threshold: int = 8
    reload_threshold: int = 32
    domain_damage: dict[str, np.ndarray] = field(default_factory=dict)  # E_d[i, b]
    provenance: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        n = self.layers * self.experts * 2
        self.bits = tuple(int(b) for b in self.bits)
        self.floor_stages = tuple(tuple(int(x) for x in s) for s in self.floor_stages)
        checks = {"sensitivity": (n, NB), "initial_bits": (n,), "residual_weights": (2, NB, NB, 3),
                  "residual_bias": (2, NB, NB), "residual_confidence": (2, NB, NB), "residual_clip": (2, NB, NB, 2)}
        for name, shape in checks.items():
            arr = np.asarray(getattr(self, name))
            if arr.shape != shape:
                raise CalibrationError(f"calibration field {name} has shape {arr.shape}, expected {shape}")
        for dom, arr in self.domain_damage.items():
            if np.asarray(arr).shape != (n, NB):
                raise CalibrationError(f"domain_damage[{dom!r}] has shape {np.shape(arr)}, expected {(n, NB)}")
        if not (len(self.bucket_bounds) == len(self.bucket_multipliers) == len(self.floor_stages[0])):
            raise CalibrationError("bucket_bounds, bucket_multipliers and each floor stage must have one entry per bucket")
        if len(self.depth_caps) != len(self.floor_stages):
            raise CalibrationError("depth_caps needs one entry per floor stage")

    @property
    def num_blocks(self) -> int:
        return self.layers * self.experts * 2

    def check_fingerprint(self, model_fingerprint_: str, model_name: str = "the model") -> None:
        if not fingerprints_match(self.fingerprint, model_fingerprint_):
            raise CalibrationError(
                f"calibration was made for model {self.fingerprint}, but {model_name} is {model_fingerprint_}; "
                "run `pwruntime calibrate` on this model (or pass the calibration made for it)"
            )

    # --------------------------------------------------------------- files
    def save(self, directory: str | os.PathLike) -> Path:
        """Write atomically: a temporary sibling directory is renamed into place."""
        out = Path(directory)
        out.parent.mkdir(parents=True, exist_ok=True)
        scalars, arrays = {"format_version": FORMAT_VERSION}, {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "domain_damage":
                scalars["domains"] = sorted(value)
                arrays.update({f"domain_damage.{k}": np.asarray(v) for k, v in value.items()})
            elif isinstance(value, np.ndarray):
                arrays[f.name] = value
            else:
                scalars[f.name] = value
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
        umask = os.umask(0)  # mkdtemp made the folder private; give it the mode a plain mkdir would
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)
        (tmp / "calibration.json").write_text(json.dumps(scalars, indent=2, sort_keys=True))
        np.savez_compressed(tmp / "arrays.npz", **arrays)
        if out.exists():
            backup = out.with_name(f".{out.name}.old")
            out.rename(backup)
            tmp.rename(out)
            shutil.rmtree(backup)  # the previous calibration, whatever it held
        else:
            tmp.rename(out)
        return out

    @classmethod
    def load(cls, directory: str | os.PathLike, expect_fingerprint: str | None = None) -> "Calibration":
        d = Path(directory)
        meta_path, arr_path = d / "calibration.json", d / "arrays.npz"
        for p in (meta_path, arr_path):
            if not p.is_file():
                raise CalibrationError(f"{p} is missing; a calibration directory holds calibration.json and "
                                       "arrays.npz (make one with `pwruntime calibrate`)")
        try:
            scalars = json.loads(meta_path.read_text())
        except json.JSONDecodeError as e:
            raise CalibrationError(f"{meta_path} is not valid JSON ({e})") from None
        if not isinstance(scalars, dict):
            raise CalibrationError(f"{meta_path} is corrupt or incomplete (not a JSON object); {_REMAKE}")
        if scalars.get("format_version") != FORMAT_VERSION:
            raise CalibrationError(f"{meta_path}: format_version {scalars.get('format_version')!r}, "
                                   f"this PagedWeight reads {FORMAT_VERSION}; re-run `pwruntime calibrate`")
        arrays = _read_arrays(arr_path)
        missing = [f"domain_damage.{k}" for k in scalars.get("domains", []) if f"domain_damage.{k}" not in arrays]
        if missing:
            raise CalibrationError(f"{arr_path} is corrupt or incomplete (no {', '.join(missing)}); {_REMAKE}")
        kwargs = {}
        for f in fields(cls):
            if f.name == "domain_damage":
                kwargs[f.name] = {k: arrays[f"domain_damage.{k}"] for k in scalars.get("domains", [])}
            elif f.name in arrays:
                kwargs[f.name] = arrays[f.name]
            elif f.name in scalars:
                v = scalars[f.name]
                kwargs[f.name] = tuple(v) if isinstance(v, list) else v
        try:
            cal = cls(**kwargs)
        except TypeError as e:
            raise CalibrationError(f"{d}: incomplete calibration ({e})") from None
        if expect_fingerprint is not None:
            cal.check_fingerprint(expect_fingerprint)
        return cal


def free_block_threshold(calibration: Calibration | None, override: int | None = None) -> int:
    """The free KV blocks both engines tell a planner to keep (T_blk of Eq. 7): `override` when given, else the
    calibration's, else the calibration's default (8)."""
    if override is not None:
        return int(override)
    return int((calibration or Calibration).free_block_threshold)
