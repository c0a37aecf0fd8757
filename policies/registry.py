"""Maps policy names to their classes: `get(name, **params)`, `available()`, `parse_policy_args`.

Names are fixed at import (no run-time registration, no global mutable state). Each name has a
frozen parameter dataclass; presets (`uniform-4`, `pagedweight-no-routing`, ...) are names whose
parameters start from other defaults. CLIs turn `--policy-arg k=v` strings into typed parameters
with `parse_policy_args(name, ["k=v", ...])`, converting each value by its dataclass field type.
"""
from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Callable, Sequence

from policies.contract import NoopPolicy, Policy
from policies.planners import (DpLlmParams, DpLlmPolicy, ExpertLruParams, ExpertLruPolicy, Fp16Params, Fp16Policy,
                               PagedWeightParams, PagedWeightPolicy, PolicyError, StaticMixedParams,
                               StaticMixedPolicy, UniformParams, UniformPolicy)


@dataclass(frozen=True)
class _NoParams:
    pass


@dataclass(frozen=True)
class _Entry:
    params: type
    build: Callable[[object, str], Policy]  # (params instance, name) -> policy
    preset: dict = field(default_factory=dict)  # defaults that differ from the dataclass's
    summary: str = ""


def _entries() -> dict[str, _Entry]:
    e = {
        "noop": _Entry(_NoParams, lambda p, n: NoopPolicy(), summary="never plans; bits stay as the table has them"),
        "pagedweight": _Entry(PagedWeightParams, lambda p, n: PagedWeightPolicy(p, name=n),
                              summary="PagedWeight planner (paper Algorithm 1)"),
        "fp16": _Entry(Fp16Params, lambda p, n: Fp16Policy(p, name=n), summary="full-precision reference"),
        "static-mixed": _Entry(StaticMixedParams, lambda p, n: StaticMixedPolicy(p, name=n),
                               summary="offline sensitivity-optimal mixed precision (MxMoE-like)"),
        "dp-llm": _Entry(DpLlmParams, lambda p, n: DpLlmPolicy(p, name=n),
                         summary="all planes resident, per-layer precision chosen at run time"),
        "expert-lru": _Entry(ExpertLruParams, lambda p, n: ExpertLruPolicy(p, name=n),
                             summary="whole experts cached on the GPU with LRU eviction"),
    }
    for flag in ("routing", "residual", "movement", "sensitivity"):
        e[f"pagedweight-no-{flag}"] = _Entry(PagedWeightParams, lambda p, n: PagedWeightPolicy(p, name=n),
                                              {f"no_{flag}": True}, f"PagedWeight without {flag} (ablation)")
    for b in range(3, 9):
        e[f"uniform-{b}"] = _Entry(UniformParams, lambda p, n: UniformPolicy(p, name=n), {"bits": b},
                                   f"every block at {b} bits (APL-style, static)")
    return e


def available() -> list[str]:
    return sorted(_entries())


def _entry(name: str) -> _Entry:
    entries = _entries()
    if name not in entries:
        raise PolicyError(f"unknown policy {name!r}; available: {', '.join(sorted(entries))}")
    return entries[name]


def params_class(name: str) -> type:
    """The frozen parameter dataclass of a policy name."""
    return _entry(name).params


def describe(name: str) -> list[tuple[str, str, object]]:
    """(parameter, type, default for this name) of every parameter of a policy."""
    entry = _entry(name)
    hints = typing.get_type_hints(entry.params)
    return [(f.name, _type_name(hints[f.name]), entry.preset.get(f.name, f.default))
            for f in dataclasses.fields(entry.params)]


def get(name: str, **params) -> Policy:
    """Build a policy by name; unknown names or parameters raise PolicyError (a ValueError) naming the fix."""
    entry = _entry(name)
    known = [f.name for f in dataclasses.fields(entry.params)]
    unknown = sorted(set(params) - set(known))
    if unknown:
        hint = f"its parameters: {', '.join(known)}" if known else "it takes no parameters"
        raise PolicyError(f"policy {name!r} has no parameter {', '.join(map(repr, unknown))}; {hint}")
    try:
        p = entry.params(**{**entry.preset, **params})
    except (TypeError, ValueError) as e:
        raise PolicyError(f"bad parameters for policy {name!r}: {e}") from None
    return entry.build(p, name)


def parse_policy_args(name: str, args: Sequence[str]) -> dict:
    """`["k=v", ...]` -> typed keyword arguments for `get(name, **kwargs)` (CLI `--policy-arg k=v`)."""
    entry = _entry(name)
    hints = typing.get_type_hints(entry.params)
    known = [f.name for f in dataclasses.fields(entry.params)]
    out: dict = {}
    for arg in args:
        key, sep, raw = arg.partition("=")
        key = key.strip()
        if not sep or not key:
            raise PolicyError(f"--policy-arg {arg!r} is not KEY=VALUE (e.g. --policy-arg alpha=0.5)")
        if key not in known:
            hint = f"its parameters: {', '.join(known)}" if known else "it takes no parameters"
            raise PolicyError(f"policy {name!r} has no parameter {key!r}; {hint}")
        if key in out:
            raise PolicyError(f"--policy-arg {key} given twice")
        try:
            out[key] = _convert(raw.strip(), hints[key])
        except ValueError:
            raise PolicyError(f"policy {name!r} parameter {key!r} expects {_type_name(hints[key])}, "
                              f"got {raw.strip()!r}") from None
    return out


_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


def _convert(raw: str, tp) -> object:
    args = typing.get_args(tp)
    if type(None) in args:  # Optional[X]
        if raw.lower() in ("none", "null", ""):
            return None
        (tp,) = [a for a in args if a is not type(None)]
    if tp is bool:
        if raw.lower() in _TRUE:
            return True
        if raw.lower() in _FALSE:
            return False
        raise ValueError(raw)
    if tp is int:
        try:
            return int(raw)
        except ValueError:
            value = float(raw)  # 8e9 is fine, 2.5 is not
            if not value.is_integer():
                raise
            return int(value)
    if tp is float:
        return float(raw)
    if tp is str:
        return raw
    raise ValueError(f"unsupported parameter type {tp}")


def _type_name(tp) -> str:
    args = typing.get_args(tp)
    if type(None) in args:
        inner = [a for a in args if a is not type(None)]
        return f"{_type_name(inner[0])} or none"
    return {bool: "true/false", int: "an integer", float: "a number", str: "a string"}.get(tp, str(tp))
