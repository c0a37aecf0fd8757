"""Maps policy names to their classes: `get(name, **params)`, `available()`, `parse_policy_args`, `describe`.

Names are fixed at import (no run-time registration, no global mutable state). Each name has a
frozen parameter dataclass; presets (`uniform-4`, `pagedweight-no-routing`, ...) are names whose
parameters start from other defaults. CLIs turn `--policy-arg k=v` strings into typed parameters
with `parse_policy_args(name, ["k=v", ...])`, converting each value by its dataclass field type.

A planner of one's own needs no entry here: a name `MODULE:CLASS` (an importable module) or `FILE.py:CLASS` names
a dataclass that implements `policies.Policy` (`name`, `reset`, `plan_step`); its fields are its parameters, so
`--policy-arg` sets them as it sets a built-in's. Every engine resolves the name the same way (the simulator's
workers and the server's engine process included), so a planner tried in `pwsim` runs unchanged in `pwruntime`.
"""
from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import re
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path
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


def summary(name: str) -> str:
    """One line on what a policy does (a planner of one's own: its docstring's first line)."""
    return _entry(name).summary


def _entry(name: str) -> _Entry:
    if ":" in name:
        return _user_entry(name)
    entries = _entries()
    if name.endswith(".py"):
        raise PolicyError(f"policy {name!r}: name the planner's class too, as {name}:CLASS")
    if name not in entries:
        raise PolicyError(f"unknown policy {name!r}; available: {', '.join(sorted(entries))}, or MODULE:CLASS / "
                          "FILE.py:CLASS for a planner of your own")
    return entries[name]


def _user_entry(spec: str) -> _Entry:
    """The entry of a planner of one's own, `MODULE:CLASS` or `FILE.py:CLASS` (see the module docstring)."""
    where, _, cls_name = spec.rpartition(":")
    module = _import(where, spec)
    cls = getattr(module, cls_name, None)
    if not isinstance(cls, type):
        raise PolicyError(f"policy {spec!r}: {where} has no class {cls_name!r}")
    if not dataclasses.is_dataclass(cls):
        raise PolicyError(f"policy {spec!r}: {cls_name} must be a dataclass (its fields are its --policy-arg "
                          "parameters); decorate it with @dataclasses.dataclass")
    missing = [m for m in ("name", "reset", "plan_step") if not hasattr(cls, m)]
    if missing:
        raise PolicyError(f"policy {spec!r}: {cls_name} does not implement policies.Policy, it lacks "
                          f"{', '.join(missing)} (a name, reset(table, calibration), plan_step(table, observation))")
    for method in ("reset", "plan_step"):
        _check_two_arguments(spec, cls_name, method, inspect.getattr_static(cls, method))
    doc = (cls.__doc__ or "").strip().splitlines()
    return _Entry(cls, lambda p, n: p, summary=doc[0] if doc and not doc[0].startswith(cls_name + "(") else "")


def _check_two_arguments(spec: str, cls_name: str, method: str, fn) -> None:
    """A planner's `reset(table, calibration)` and `plan_step(table, observation)` must take their two arguments."""
    want = "(table, calibration)" if method == "reset" else "(table, observation)"
    try:
        if isinstance(fn, staticmethod):
            inspect.signature(fn.__func__).bind(None, None)
        else:
            inspect.signature(fn).bind(None, None, None)   # self and the two arguments
    except TypeError:
        raise PolicyError(f"policy {spec!r}: {cls_name}.{method} must be a method taking {want}") from None
    except ValueError:   # no signature to read (a builtin): called as it is
        pass


def _import(where: str, spec: str):
    """The module `where` names: a dotted module path, or a .py file (loaded once, as `pw_policy_<its path>`)."""
    try:
        if not where.endswith(".py"):
            return importlib.import_module(where)
        path = Path(where).resolve()
        if str(path.parent) not in sys.path:   # its own helpers beside it import as they would run as a script
            sys.path.append(str(path.parent))
        key = "pw_policy_" + re.sub(r"\W", "_", str(path))
        if key not in sys.modules:
            if not path.is_file():
                raise FileNotFoundError(f"no file {where}")
            loader_spec = importlib.util.spec_from_file_location(key, path)
            module = importlib.util.module_from_spec(loader_spec)
            sys.modules[key] = module  # before running it, as an import does (dataclasses look the module up)
            try:
                loader_spec.loader.exec_module(module)
            except BaseException:
                del sys.modules[key]
                raise
        return sys.modules[key]
    except Exception as e:  # the planner's own code failed to import: say which and why
        raise PolicyError(f"policy {spec!r}: cannot import {where} ({type(e).__name__}: {e})") from None


def params_class(name: str) -> type:
    """The frozen parameter dataclass of a policy name."""
    return _entry(name).params


def describe(name: str) -> list[tuple[str, str, object]]:
    """(parameter, type, default for this name) of every parameter of a policy."""
    entry = _entry(name)
    hints = typing.get_type_hints(entry.params)
    return [(f.name, _type_name(hints[f.name]), entry.preset.get(f.name, _default(f)))
            for f in dataclasses.fields(entry.params)]


REQUIRED = "required"  # `describe`'s default of a parameter that has none: --policy-arg must give it


def _default(f: dataclasses.Field) -> object:
    """A field's default: its value, what its factory makes, or REQUIRED."""
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else REQUIRED


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
    policy = entry.build(p, name)
    if not isinstance(getattr(policy, "name", None), str):
        raise PolicyError(f"policy {name!r}: its name must be a string, got {getattr(policy, 'name', None)!r}")
    return policy


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
    return {bool: "true/false", int: "an integer", float: "a number", str: "a string"}.get(
        tp, f"{getattr(tp, '__name__', tp)} (not settable by --policy-arg)")
