"""Capacity search: the highest arrival rate at which a policy still meets latency SLOs (as Vidur's capacity search).

A load point is the run's trace with its arrival times divided by a rate multiplier m (`RunConfig.time_scale` =
1 / m: the same requests and routing, m times as often). A point meets the SLO when every request completed and the
chosen percentile of TTFT and of TPOT (those the SLO names) is at most its bound; or, with `attainment` (DistServe's
goodput), when at least that share of the requests completed within both bounds (`traces.results.slo_attainment`;
the others may run late or not finish). Every point also reports that share. `search` starts at the lowest
multiplier, doubles until a point misses (or the ceiling is reached), then bisects geometrically until the last point
that met and the first that missed are within `tolerance` of each other. It assumes latency grows with load; the
points it ran are all reported, so a non-monotone curve shows. Every point is one seeded simulation: the same
inputs give the same capacity.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Callable

PERCENTILES = (50, 90, 99)  # what a run's summary holds (traces.results.stats)


@dataclass(frozen=True)
class SLO:
    """Latency bounds (None: that latency is not bounded) at one percentile, or met per request by an `attainment`
    share of them."""
    ttft_s: float | None = None
    tpot_s: float | None = None
    percentile: int = 99
    attainment: float | None = None

    def __post_init__(self) -> None:
        if self.ttft_s is None and self.tpot_s is None:
            raise ValueError("an SLO needs a TTFT or a TPOT bound (--slo-ttft / --slo-tpot)")
        for name, unit, scale in (("ttft_s", "s", 1), ("tpot_s", "ms", 1e3)):  # in the units the flags take
            v = getattr(self, name)
            if v is not None and not 0 < v < math.inf:
                raise ValueError(f"the {name[:4].upper()} bound must be a number > 0, got {v * scale:g} {unit}")
        if self.percentile not in PERCENTILES:
            raise ValueError(f"the percentile must be one of {PERCENTILES}, got {self.percentile}")
        if self.attainment is not None and not 0 < self.attainment <= 1:
            raise ValueError(f"the attainment must lie in (0, 1], got {self.attainment}")

    def check(self, summary: dict, attained: float | None = None) -> tuple[bool, str]:
        """(met, why not) for one run's summary and the share of its requests that met both bounds."""
        if self.attainment is not None:
            if attained is not None and attained >= self.attainment:
                return True, ""
            return False, f"{100 * (attained or 0):.1f}% of requests within the bounds < {100 * self.attainment:g}%"
        if summary["completed"] < summary["requests"]:
            return False, f"{summary['requests'] - summary['completed']} requests did not complete"
        key = f"p{self.percentile}"
        for name, bound in (("ttft_s", self.ttft_s), ("tpot_s", self.tpot_s)):
            value = summary[name][key]
            if bound is not None and value is not None and value > bound:
                return False, f"{name[:4].upper()} {key} {value * 1e3:.3g} ms > {bound * 1e3:.3g} ms"
        return True, ""


@dataclass(frozen=True)
class LoadPoint:
    """One simulated load: its rate multiplier, arrival rate and what the SLO reads."""
    multiplier: float
    rate_rps: float
    met: bool
    why: str
    ttft_s: float | None
    tpot_s: float | None
    throughput_tok_s: float
    completed: int
    requests: int
    attained: float | None  # the share of requests that completed within both bounds

    @classmethod
    def of(cls, multiplier: float, base_rate_rps: float, result, slo: SLO) -> "LoadPoint":
        """The point of a run's result (its summary and per-request columns)."""
        from traces.results import slo_attainment
        summary = result.summary
        attained = slo_attainment(result.requests, slo.ttft_s, slo.tpot_s)["attainment"]
        met, why = slo.check(summary, attained)
        key = f"p{slo.percentile}"
        return cls(multiplier, base_rate_rps * multiplier, met, why, summary["ttft_s"][key], summary["tpot_s"][key],
                   summary["throughput_tokens_per_s"], summary["completed"], summary["requests"], attained)


@dataclass(frozen=True)
class Capacity:
    """A search's outcome: the highest multiplier that met the SLO (None: not even the lowest did), the lowest above
    it that missed (None: none missed up to the ceiling), and every point run, by multiplier."""
    multiplier: float | None
    missed_at: float | None
    points: tuple[LoadPoint, ...]

    @property
    def at_capacity(self) -> LoadPoint | None:
        return next((p for p in self.points if p.multiplier == self.multiplier), None)

    @property
    def note(self) -> str:
        if self.multiplier is None:
            return f"misses the SLO at the lowest rate searched ({self.points[0].why})"
        if self.missed_at is None:
            return "meets the SLO up to the highest rate searched (the ceiling)"
        return ""

    def to_json(self) -> dict:
        cap = self.at_capacity
        return {"multiplier": self.multiplier, "rate_rps": None if cap is None else cap.rate_rps,
                "missed_at_multiplier": self.missed_at, "note": self.note, "points": [asdict(p) for p in self.points]}


def search(run: Callable[[float], LoadPoint], lowest: float, highest: float, tolerance: float) -> Capacity:
    """The capacity between rate multipliers `lowest` and `highest` (see the module docstring); `run(m)` simulates
    multiplier m. Stops when the bracket's ratio is at most 1 + tolerance."""
    if not 0 < lowest < highest < math.inf:
        raise ValueError(f"the multipliers must satisfy 0 < lowest < highest, got {lowest} and {highest}")
    if not 0 < tolerance <= 1:
        raise ValueError(f"the tolerance must lie in (0, 1], got {tolerance}")
    points: dict[float, LoadPoint] = {}

    def met(m: float) -> bool:
        points[m] = run(m)
        return points[m].met

    good, bad = None, None
    if met(lowest):
        good = m = lowest
        while m < highest:
            m = min(2 * m, highest)
            if not met(m):
                bad = m
                break
            good = m
        while bad is not None and bad / good > 1 + tolerance:
            mid = math.sqrt(good * bad)
            if met(mid):
                good = mid
            else:
                bad = mid
    else:
        bad = lowest
    return Capacity(good, bad, tuple(points[m] for m in sorted(points)))


def capacity_of(cfg, slo: SLO, lowest: float, highest: float, tolerance: float) -> tuple[Capacity, dict]:
    """Search one RunConfig's capacity (its `time_scale` ignored: every point sets its own); returns it and the
    summary of the run at capacity (or at the lowest multiplier when none met)."""
    from pwsim.runner import execute
    base_rate = base_rate_rps(cfg)
    summaries: dict[float, dict] = {}

    def run(m: float) -> LoadPoint:
        result = execute(replace(cfg, time_scale=1.0 / m))
        summaries[m] = result.summary
        return LoadPoint.of(m, base_rate, result, slo)

    cap = search(run, lowest, highest, tolerance)
    return cap, summaries[cap.multiplier if cap.multiplier is not None else lowest]


def base_rate_rps(cfg) -> float:
    """The run's arrival rate at multiplier 1: requests per second of its arrival span (the first to the last)."""
    from pwsim.runner import build_workload
    from traces.clikit import UserError
    arrivals = build_workload(replace(cfg, time_scale=1.0)).requests.arrival_s
    span = float(arrivals.max() - arrivals.min()) if len(arrivals) else 0.0
    if len(arrivals) < 2 or span <= 0:
        raise UserError("a capacity search needs a trace whose requests arrive over time (at least two, at "
                        f"different times); this one has {len(arrivals)} arriving over {span:g} s")
    return (len(arrivals) - 1) / span
