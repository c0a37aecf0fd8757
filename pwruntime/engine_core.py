"""EngineCore: the loop that owns an LLMEngine while it serves: requests in through an inbox, one batch of events
out per step.

The inbox takes ("add", key, requests, stream): one engine request per (prompt, SamplingParams[, the text that token
ids were encoded from]), added all or none; ("abort", key): the client left; ("stats", key): the counters, gauges
and histograms /metrics shows; and None: stop. `key` names one client request (an HTTP request:
pwruntime.engine_client holds them). After each turn of the loop (the inbox drained, then one engine step) it hands
`emit` the turn's events as one list of (key, event): ("delta", (choice index, token ids, their log-probability
records, the engine's PromptOutput on a choice's first delta, else None)) for a streaming request's new tokens,
("done", (choice index, RequestOutput)) for each finished choice, one ("error", (status, message)) after which none
of the request's choices runs any more, or ("stats", dict). One list per step, not one message per event: the client
side wakes once per step whatever the batch size.

The loop steps the engine while any request is unfinished and sleeps on the inbox otherwise; a step that fails
fails the requests in flight and the loop goes on. With a StatsLog it writes the periodic stats line
(pwruntime.stats_log) while it has work; with a PlanLog it logs every transition each step's plan loop began,
refused or landed (policies.plan_log; `pwruntime serve --record-trace`). It runs in a thread beside the HTTP server
(pwruntime.engine_client.EngineWorker) or in a process of its own (pwruntime.engine_process), unchanged.
"""
from __future__ import annotations

import queue
import sys
import traceback
from dataclasses import dataclass
from typing import Callable

from policies.plan_log import PlanLog
from pwruntime.cuda_memory import memory_gauges
from pwruntime.metrics import RequestMetrics
from pwruntime.stats_log import StatsLog, serves_ap_experts


@dataclass
class _Choice:
    """One engine request: choice `index` of the client request `key`."""
    key: object
    index: int
    stream: bool
    sent_tokens: int = 0


class EngineCore:
    def __init__(self, engine, emit: Callable[[list], None], stats_log: StatsLog | None = None,
                 plan_log: PlanLog | None = None) -> None:
        """`engine`: a pwruntime.engine.LLMEngine; `emit(events)` is called from the loop's thread."""
        self.engine, self.emit, self.stats_log, self.plan_log = engine, emit, stats_log, plan_log
        self.inbox: queue.Queue = queue.Queue()
        # prompt_tokens_total: the prefill tokens computed (a preempted request's recompute too; what the prefix
        # cache served is not)
        # kv_capacity_cuts_total: requests the scheduler ended because the KV pool could not hold them (their answer
        # is cut short: finish_reason "length")
        self.counters = {"requests_total": 0, "prompt_tokens_total": 0, "generated_tokens_total": 0,
                         "request_errors_total": 0, "aborted_total": 0, "kv_capacity_cuts_total": 0}
        self.request_metrics = RequestMetrics(engine.max_model_len)
        self.ap_experts = serves_ap_experts(engine)  # the page table describes the experts (their bits are gauges)
        self._live: dict[int, _Choice] = {}  # engine request id -> its choice
        self._out: list = []  # this turn's events
        self._stopped = False

    def run(self) -> None:
        """Serve until None arrives in the inbox."""
        eng, log = self.engine, self.stats_log
        while not self._stopped:
            if eng.has_unfinished():
                idle_s = 0  # step now
            else:  # sleep until a request comes, or until the stats line after the work is due
                idle_s = log.wait_s(self.counters) if log else None
            try:
                item = self.inbox.get(timeout=idle_s)
            except queue.Empty:
                item = ()
            if log and idle_s is None:
                log.resume()
            while item:
                self._handle(item)
                item = self._next()
            if item is None:
                self._stopped = True
            elif eng.has_unfinished():
                try:
                    self._step()
                except Exception as e:  # a bug: fail the requests in flight, keep serving the next ones
                    traceback.print_exc(file=sys.stderr)
                    self._fail_all(f"the engine failed while generating ({type(e).__name__}: {e})")
            if self._out:
                out, self._out = self._out, []
                self.emit(out)
            if log:
                log.tick(self.counters, self._gauges)

    def _next(self):
        try:
            return self.inbox.get_nowait()
        except queue.Empty:
            return ()

    def _handle(self, item: tuple) -> None:
        kind, key = item[0], item[1]
        if kind == "add":
            self._add(key, *item[2:])
        elif kind == "abort":
            self._abort(key)
        elif kind == "stats":
            self._out.append((key, ("stats", self.stats())))
        else:
            raise ValueError(f"unknown inbox item {kind!r}")

    def _add(self, key, requests: list, stream: bool) -> None:
        eng, rids = self.engine, []
        try:
            for prompt, params, *text in requests:  # text: what the server encoded `prompt` from
                rids.append(eng.add_request(prompt, params, text=text[0] if text else None))
        except Exception as e:  # a prompt the engine refuses (too long, empty ...)
            for rid in rids:
                eng.abort(rid)
            self.counters["request_errors_total"] += len(requests)
            self._out.append((key, ("error", (400, str(e)))))
            return
        self._live.update({rid: _Choice(key, i, stream) for i, rid in enumerate(rids)})
        self.counters["requests_total"] += len(rids)

    def _abort(self, key) -> None:
        rids = [rid for rid, choice in self._live.items() if choice.key == key]
        for rid in rids:
            del self._live[rid]
            self.engine.abort(rid)
        self.counters["aborted_total"] += len(rids)

    def _fail_all(self, message: str) -> None:
        for key in dict.fromkeys(choice.key for choice in self._live.values()):
            self._out.append((key, ("error", (500, message))))
        for rid in self._live:
            try:
                self.engine.abort(rid)
            except Exception:  # the engine may be in any state here; the next step will show it
                traceback.print_exc(file=sys.stderr)
        self.counters["request_errors_total"] += len(self._live)
        self._live.clear()

    def _step(self) -> None:
        eng, out = self.engine, self._out
        results = eng.step()
        if self.plan_log is not None and eng.last_loop is not None:
            self.plan_log.add(eng.num_steps - 1, eng.clock() - eng.t0, eng.last_loop, eng.table)
        batch = eng.last_batch
        if batch is not None:
            self.counters["prompt_tokens_total"] += batch.num_prefill_tokens
        self.counters["generated_tokens_total"] = eng.num_generated_tokens  # as the tokens come, not as requests end
        self.request_metrics.tokens(eng.last_tokens)
        for result in results:
            choice = self._live.pop(result.request_id, None)
            self.request_metrics.observe(result)
            if result.finish_reason == "kv_capacity":
                self.counters["kv_capacity_cuts_total"] += 1
                print(f"engine: request {result.request_id} cut short after {len(result.token_ids)} tokens: the KV "
                      f"pool ({eng.pool.capacity} blocks) cannot hold it with the others (finish_reason length); "
                      "lower --max-model-len or raise the KV cache", file=sys.stderr, flush=True)
            if choice is not None:
                out.append((choice.key, ("done", (choice.index, result))))
        for rid, choice in self._live.items():
            if choice.stream:
                start = choice.sent_tokens
                toks = eng.tokens_so_far(rid, start)
                if toks:
                    head = eng.prompt_of(rid) if start == 0 else None
                    out.append((choice.key, ("delta", (choice.index, toks, eng.logprobs_so_far(rid, start), head))))
                    choice.sent_tokens += len(toks)

    def stats(self) -> dict:
        """What /metrics shows: {"counters": ..., "gauges": ..., "histograms": exposition lines}."""
        return {"counters": dict(self.counters), "gauges": self._gauges(),
                "histograms": self.request_metrics.render()}

    def _gauges(self) -> dict:
        eng = self.engine
        gauges = {"running_requests": len(eng.scheduler.running), "waiting_requests": len(eng.scheduler.waiting),
                  "kv_blocks_free": eng.pool.num_free, "kv_blocks_total": eng.pool.capacity,
                  "plans_total": eng.loop.num_plans, "steps_total": eng.num_steps,
                  "preemptions_total": eng.scheduler.num_preemptions,
                  "prefix_cache_hit_tokens_total": eng.scheduler.num_cached_tokens}
        if self.ap_experts:  # full-precision experts have no bits to show
            gauges.update(mean_committed_bits=eng.table.mean_bits(), expert_resident_bytes=eng.table.resident_bytes())
        if hasattr(eng.loop.mover, "metrics"):  # page moves: transfers, bytes, copy times
            gauges.update(eng.loop.mover.metrics())
        gauges.update(memory_gauges(eng.kv.device, eng.capacity.mapped_memory()))  # on CUDA: the device memory the process holds
        return gauges
