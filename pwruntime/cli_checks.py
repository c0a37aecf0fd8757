"""Checks of command-line values that several `pwruntime` commands share, each one `UserError` naming the flag."""
from __future__ import annotations

from traces.clikit import UserError


def check_seed(seed: int | None, flag: str = "--seed") -> None:
    """Refuse a negative seed (numpy's generators take none) before any work; None (no seed given) passes."""
    if seed is not None and seed < 0:
        raise UserError(f"{flag} must be >= 0, got {seed}")
