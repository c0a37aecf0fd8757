"""Memory sizes as people write them (`20GiB`, `512MiB`, `1.5e9`) and as tables show them; both CLIs read sizes here."""
from __future__ import annotations

import math
import re

from traces.clikit import UserError

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int | float, allow_zero: bool = False, flag: str = "") -> int:
    """Bytes from `20GiB`, `16 GB`, `1.5e9`, `512MiB` (binary and decimal units); positive, or 0 with `allow_zero`.
    A `flag` (the option the text came from) starts the error's message."""
    def refuse(message: str) -> UserError:
        return UserError(f"{flag}: {message}" if flag else message)

    if isinstance(text, (int, float)):
        value, unit = float(text), ""
    else:
        m = _SIZE.match(str(text))
        if not m or m.group(2).lower() not in _UNITS:
            raise refuse(f"cannot read size {text!r}; write a number with a unit such as 20GiB, 16GB or 512MiB")
        value, unit = float(m.group(1)), m.group(2).lower()
    if not math.isfinite(value * _UNITS[unit]):
        raise refuse(f"size {text!r} is not a finite number of bytes; write a number with a unit such as 20GiB or "
                     "512MiB")
    size = int(round(value * _UNITS[unit]))
    if size < 0 or (size == 0 and not allow_zero):
        raise refuse(f"size {text!r} must be {'>= 0' if allow_zero else 'positive'}")
    return size


def format_size(n: float) -> str:
    """`21474836480 -> '20.00 GiB'`."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"
