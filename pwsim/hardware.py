"""The simulator's view of hardware profiles and memory sizes.

The profile format itself lives in `traces.hardware` (pwruntime's benchmark writes it, and pwruntime
may not import pwsim), sizes in `traces.sizes` (`--budget 20GiB`); this module re-exports both for the simulator
and adds the unit its tables and plots show memory in.
"""
from __future__ import annotations

from traces.hardware import (AP_BITS, OP_CLASSES, HardwareProfile, HardwareProfileError, bundled_profiles,
                             from_json, load_profile)
from traces.sizes import format_size, parse_size

__all__ = ["AP_BITS", "OP_CLASSES", "HardwareProfile", "HardwareProfileError", "bundled_profiles", "from_json",
           "load_profile", "parse_size", "format_size", "memory_unit"]


def memory_unit(max_bytes: float) -> tuple[int, str]:
    """(bytes per unit, unit) for tables and plots: GiB for real models, MiB for small ones (the demo)."""
    return (2**30, "GiB") if max_bytes >= 2**30 else (2**20, "MiB")
