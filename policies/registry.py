"""Maps policy names to their classes: `get(name, **params)` and `available()`.

Names are fixed at import (no run-time registration, no global mutable state). A family such as
`uniform-<b>` is one entry whose factory reads the suffix.
"""
from __future__ import annotations

from typing import Callable

from policies.contract import NoopPolicy, Policy


def _factories() -> dict[str, Callable[..., Policy]]:
    return {
        "noop": NoopPolicy,
    }


def available() -> list[str]:
    return sorted(_factories())


def get(name: str, **params) -> Policy:
    """Build a policy by name; unknown names or parameters raise ValueError naming the fix."""
    factories = _factories()
    if name not in factories:
        raise ValueError(f"unknown policy {name!r}; available: {', '.join(available())}")
    try:
        return factories[name](**params)
    except TypeError as e:
        raise ValueError(f"bad parameters for policy {name!r}: {e}") from None
