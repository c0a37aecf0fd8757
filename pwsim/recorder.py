"""What a simulation records and what it reports: per-request metrics, timelines, memory checks, stalls.

`Recorder` collects during the run (cheap appends); `SimResult` holds the finished columns
(numpy arrays) and the JSON summary that `pwsim run` writes and `pwsim compare` tabulates.
"""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from policies.plan_log import PlanLog, reason_kind
from pwsim.plan_stats import summarize

from traces.results import TokenGaps, request_columns, request_summary

if TYPE_CHECKING:  # pragma: no cover
    from pwsim.engine import Simulation

TIMELINE_COLUMNS = ("time_s", "step", "weight_bytes", "kv_pool_bytes", "kv_used_bytes", "memory_bytes",
                    "free_blocks", "total_blocks", "mean_bits", "running", "waiting", "inflight_bytes",
                    "iter_s", "batch_tokens", "decode_tokens", "batch_seqs", "plan_s", "plan_transitions")
_ITER = TIMELINE_COLUMNS.index("iter_s")  # iter_s, batch_tokens, decode_tokens, batch_seqs, plan_s: one forward's
_EMPTY_ITER = (0.0, 0, 0, 0, 0.0)


def cost_breakdown(cost, charged_s: float, planning_s: float, iteration_s: float) -> dict:
    """Simulated seconds of work by kind over the run: the cost model's operators (attention, moe, dense, lm_head,
    the host's per-step overhead), the planning host work and the KV copies charged besides them, their `total`, and
    `iterations_s`, the time the forwards took (below the total with asynchronous scheduling, where the host's work
    overlaps the device's)."""
    return {**cost.to_json(), "planning": planning_s, "kv_copies": charged_s - planning_s,
            "total": cost.total + charged_s, "iterations_s": iteration_s}


@dataclass
class SimResult:
    requests: dict[str, np.ndarray]  # per-request columns
    timeline: dict[str, np.ndarray]  # per-boundary columns (every `timeline_stride`-th)
    summary: dict
    transfers: np.ndarray  # [n, 4] (block, start_s, end_s, bytes) of every reload on the link
    violations: list[dict] = field(default_factory=list)
    stalls: list[dict] = field(default_factory=list)
    plans: list[dict] = field(default_factory=list)  # (step, time, transitions started/rejected/committed)
    plan_log: dict[str, np.ndarray] = field(default_factory=dict)  # policies.plan_log columns: a row a transition


class Recorder:
    def __init__(self, n_requests: int, arrival_s: np.ndarray, timeline_stride: int = 1, kv_block_bytes: int = 0) -> None:
        self.n = n_requests
        self.kv_block_bytes = kv_block_bytes
        self.peak_used = 0  # weights + KV blocks in use (not the whole pool), at iteration boundaries
        self.arrival = np.array(arrival_s, dtype=np.float64)  # a copy: a request held for a client slot moves it
        self.first = np.full(n_requests, np.nan)
        self.finish_s = np.full(n_requests, np.nan)
        self.scheduled_s = np.full(n_requests, np.nan)  # when a batch first held each request
        self.token_gaps = TokenGaps(n_requests)
        self.out_tokens = np.zeros(n_requests, dtype=np.int64)
        self.preemptions = np.zeros(n_requests, dtype=np.int64)
        self.reason = np.full(n_requests, "", dtype=object)
        self.damage_sum = np.zeros(n_requests)
        self.damage_tokens = np.zeros(n_requests, dtype=np.int64)
        self.stride = timeline_stride
        self._tl: list[tuple] = []
        self._boundaries = 0
        self._pending_iter = _EMPTY_ITER
        self._plan_transitions = 0  # transitions the current boundary's plan started
        self.iterations = 0
        self.iteration_s = 0.0  # simulated seconds the forwards took
        self.decode_tokens = 0
        self.computed_tokens = 0
        self.counters: Counter = Counter()
        self.stall_list: list[dict] = []
        self.stall_time: Counter = Counter()
        self.stall_count: Counter = Counter()
        self.violations: list[dict] = []
        self.peak = {"memory_bytes": 0, "weight_bytes": 0, "kv_pool_bytes": 0}
        self.plan_list: list[dict] = []
        self.plan_log = PlanLog()
        self.started = Counter()
        self.rejected = Counter()
        self.committed = 0
        self.bits_time = 0.0  # integral of mean committed bits over simulated time, from t = 0
        self._last_t = 0.0
        self._last_bits: float | None = None  # set by `start`
        self.wall_start = time.perf_counter()

    # ------------------------------------------------------------ events
    def start(self, bits: float) -> None:
        """The committed bits at simulated time 0."""
        self._last_t, self._last_bits = 0.0, bits

    def iteration(self, now: float, dt: float, tokens: int, decode_tokens: int, seqs: int, plan_s: float = 0.0,
                  launched_before_last_boundary: bool = False) -> None:
        """A forward ran: its time (`plan_s` of it the planning host work charged to it) and size go to the next
        boundary's row, or with `launched_before_last_boundary` (asynchronous scheduling: the boundary came between
        its launch and its run) to that boundary's row, so a row holds the batch its step scheduled, as the runtime's
        timeline does."""
        self.iterations += 1
        self.iteration_s += dt
        self.computed_tokens += tokens
        self.decode_tokens += decode_tokens
        row = (dt, tokens, decode_tokens, seqs, plan_s)
        if not launched_before_last_boundary:
            self._pending_iter = row
        elif self._boundaries and not (self._boundaries - 1) % self.stride:  # the last boundary's row was kept
            self._tl[-1] = self._tl[-1][:_ITER] + row + self._tl[-1][_ITER + len(row):]

    def tokens(self, reqs: np.ndarray, now: float, first: np.ndarray) -> None:
        self.out_tokens[reqs] += 1
        self.token_gaps.settled(reqs, now)
        f = reqs[first]
        self.first[f] = np.where(np.isnan(self.first[f]), now, self.first[f])

    def damage(self, reqs: np.ndarray, dmg: np.ndarray) -> None:
        np.add.at(self.damage_sum, reqs, dmg)
        np.add.at(self.damage_tokens, reqs, 1)

    def finish(self, r: int, now: float, n_out: int, reason: str | None, preemptions: int,
               first_scheduled: float | None = None) -> None:
        self.finish_s[r] = now
        self.scheduled_s[r] = np.nan if first_scheduled is None else first_scheduled
        self.out_tokens[r] = n_out
        self.reason[r] = reason or ""
        self.preemptions[r] = preemptions

    def stall(self, start: float, duration: float, kind: str) -> None:
        self.stall_count[kind] += 1
        self.stall_time[kind] += duration
        if len(self.stall_list) < 10_000:
            self.stall_list.append({"time_s": start, "duration_s": duration, "kind": kind})

    def count(self, key: str, n: int = 1) -> None:
        self.counters[key] += n

    def memory(self, now: float, step: int, weights: int, kv: int, budget: int, where: str) -> None:
        total = weights + kv
        if total > self.peak["memory_bytes"]:
            self.peak = {"memory_bytes": total, "weight_bytes": weights, "kv_pool_bytes": kv}
        if total > budget:
            self.counters["budget_violations"] += 1
            if len(self.violations) < 10_000:
                self.violations.append({"time_s": now, "step": step, "where": where, "memory_bytes": total,
                                        "budget_bytes": budget, "excess_bytes": total - budget,
                                        "weight_bytes": weights, "kv_pool_bytes": kv})

    def keep_memory_checks(self, other: "Recorder") -> None:
        """Take the peak memory and the budget violations `other` recorded (a warm-up's recorder)."""
        if other.peak["memory_bytes"] > self.peak["memory_bytes"]:
            self.peak = dict(other.peak)
        self.counters["budget_violations"] += other.counters["budget_violations"]
        self.violations.extend(other.violations[:10_000 - len(self.violations)])

    def plan(self, now: float, step: int, res, table) -> None:
        self._plan_transitions = len(res.started)  # the boundary's timeline row carries it
        self.plan_log.add(step, now, res, table)
        if res.plan is None and not res.committed:
            return
        for t in res.started:
            self.started["in_place" if t.in_place else "offload" if t.is_offload else "reload"] += 1
        for _, why in res.rejected:
            self.rejected[reason_kind(why)] += 1
        self.committed += len(res.committed)
        if len(self.plan_list) < 100_000:
            self.plan_list.append({"time_s": now, "step": step, "started": len(res.started),
                                   "rejected": len(res.rejected), "committed": len(res.committed),
                                   "released_bytes": int(res.released_bytes), "reserved_bytes": int(res.reserved_bytes),
                                   "reason": "" if res.plan is None else res.plan.reason})

    def timeline(self, now: float, step: int, weights: int, kv: int, pool, table, sched, inflight: int,
                 mean_bits: float) -> None:
        if self._last_bits is not None:
            self.bits_time += self._last_bits * (now - self._last_t)
        self._last_t, self._last_bits = now, mean_bits
        row, self._pending_iter = self._pending_iter, _EMPTY_ITER
        transitions, self._plan_transitions = self._plan_transitions, 0
        self.peak_used = max(self.peak_used, weights + pool.num_used * self.kv_block_bytes)
        self._boundaries += 1
        if (self._boundaries - 1) % self.stride:
            return
        self._tl.append((now, step, weights, kv, pool.num_used, weights + kv,
                         pool.num_free, pool.capacity, mean_bits, len(sched.running), len(sched.waiting), inflight,
                         *row, transitions))

    # ------------------------------------------------------------ result
    def result(self, sim: "Simulation") -> SimResult:
        B = sim.kv_block_bytes
        tl = {c: np.array([row[k] for row in self._tl]) for k, c in enumerate(TIMELINE_COLUMNS)}
        if len(self._tl):
            tl["kv_used_bytes"] = tl["kv_used_bytes"].astype(np.int64) * B  # recorded as blocks
        wl = sim.workload
        with np.errstate(invalid="ignore", divide="ignore"):
            dpt = np.where(self.damage_tokens > 0, self.damage_sum / np.maximum(self.damage_tokens, 1), np.nan)
        requests = request_columns(
            wl.requests.request_id, wl.requests.domain, self.arrival, wl.requests.prompt_tokens, self.out_tokens,
            self.first, self.finish_s, self.preemptions, self.reason,
            first_scheduled_s=self.scheduled_s, max_itl_s=self.token_gaps.max_s)
        requests["damage_per_token"] = dpt
        about = request_summary(requests, self.token_gaps.all())
        end = float(np.nanmax(self.finish_s)) if self.n and np.isfinite(self.finish_s).any() else 0.0
        if self._last_bits is not None and end > self._last_t:
            self.bits_time += self._last_bits * (end - self._last_t)
        span = max(end, self._last_t)   # what the bits were integrated over: a stall may follow the last finish
        wall = time.perf_counter() - self.wall_start
        out_total = about["output_tokens"]
        transfers = np.array(sim.mover.transfers, dtype=np.float64).reshape(-1, 4)
        transfers[:, 1:3] -= sim.t0  # on the trace's clock (a warm-up's transfers before 0)
        cost = sim.total_cost
        log = self.plan_log.columns()
        summary = {
            **about, "iterations": self.iterations, "boundaries": self._boundaries,
            "computed_tokens": self.computed_tokens,
            "preemptions": int(sim.sched.num_preemptions),
            "prefix_cache_hit_tokens": int(sim.sched.num_cached_tokens),  # prompt tokens skipped (prefix caching)
            "memory": {"budget_bytes": sim.cfg.budget_bytes, "peak_bytes": self.peak["memory_bytes"],
                       "peak_used_bytes": self.peak_used,
                       "peak_weight_bytes": self.peak["weight_bytes"], "peak_kv_pool_bytes": self.peak["kv_pool_bytes"],
                       "nonexpert_weight_bytes": sim.nonexpert_bytes, "kv_block_bytes": B,
                       "budget_violations": int(self.counters["budget_violations"]),
                       "max_excess_bytes": max((v["excess_bytes"] for v in self.violations), default=0)},
            "mean_committed_bits": self.bits_time / span if span > 0 else self._last_bits,
            "page_traffic": {"reload_bytes": int(sim.mover.reload_bytes),
                             "offload_bytes_released": int(sim.mover.offload_bytes), "reloads": int(len(transfers)),
                             "link_busy_s": float((transfers[:, 2] - transfers[:, 1]).sum())},
            "plans": {"plans": int(sim.loop.num_plans), "transitions_started": dict(self.started),
                      "transitions_rejected": dict(self.rejected), "commits": int(self.committed),
                      "round_trips": summarize(log)["round_trips"]},  # blocks lowered, then raised (`pwsim plan-log`)
            "stalls": {k: {"count": int(self.stall_count[k]), "time_s": float(self.stall_time[k])} for k in
                       sorted(self.stall_count)},
            "counters": {k: int(v) for k, v in sorted(self.counters.items()) if k != "budget_violations"},
            "cost_breakdown_s": cost_breakdown(cost, *sim.charged_s, self.iteration_s),
            "quality": sim.quality.summary().to_json(),
            "wall_s": wall, "sim_tokens_per_wall_s": (self.computed_tokens / wall) if wall > 0 else None,
            "output_tokens_per_wall_s": out_total / wall if wall > 0 else None,
        }
        return SimResult(requests, tl, summary, transfers, self.violations, self.stall_list, self.plan_list, log)
