"""The simulator's page mover: the PCIe link, one transfer at a time, and the host work of beginning a plan's moves.

`LinkMover` implements `policies.loop.PageMover` for the simulated replica. A boundary happens at one instant of
simulated time, but beginning a plan's transitions is host work (`plan_transition_us` each, the profile's, charged to
the next iteration by the engine): the k-th transition a boundary begins is queued k - 1 of those costs after the
boundary (its copy goes out as its host work begins), and the plan's moves end n of them after it for n
transitions. A reload's bytes take `bytes / H2D bandwidth` on the
link, one transfer after another, from when it is queued; it lands at this boundary when its copy ends before the
plan's moves do (the runtime's `landed()` comes after the plan: a plan of a hundred transitions takes long enough for
its small copies to finish), else at the first boundary after its copy ends. An offload copies nothing and is
reported at the boundary that began it when no forward that may read its planes is still running there (as the
runtime's CudaPageMover: its mark, recorded behind the queued kernels, is done), else at the next one. The engine
says which at each boundary (`boundary(forward_in_flight=...)`): never at a synchronous boundary; with asynchronous
scheduling when the batch launched before the boundary is still on the device as the host plans. With `instant`
every transfer lands at the boundary that began it, as the CPU runtime's moves (no copy stream: a reload's planes
are copied before its transition returns), and the link takes no time.
"""
from __future__ import annotations

from typing import Callable

import simpy

from policies.contract import Transition


class LinkMover:
    """The PCIe link as a queue of copies: reloads serialize on it and land once copied; offloads land at once, or
    one boundary later when a forward was still running at the boundary that began them."""

    def __init__(self, env: simpy.Environment, h2d_bytes_per_s: float, after_plan_begun: Callable[[], None],
                 on_begin: Callable[[Transition, int], None] | None = None, transition_s: float = 0.0,
                 instant: bool = False) -> None:
        self.env, self.bw, self.instant = env, float(h2d_bytes_per_s), instant
        self.transition_s = float(transition_s)  # host time to begin one transition (the profile's)
        self.offloads_wait = False  # this boundary's offloads wait for the next (a forward may still read them)
        self._link_free_at = 0.0  # when the link finishes the copies queued so far
        self._begun = 0  # transitions begun at this boundary
        self._offloads_new: list[int] = []
        self._offloads_due: list[int] = []
        self._copies: list[tuple[float, int]] = []  # (end, block) of reloads not landed yet
        self._check = after_plan_begun  # checks memory once the plan's transitions began (before any lands)
        self._on_begin = on_begin
        self.transfers: list[tuple[int, float, float, int]] = []  # (block, start, end, bytes) of reloads
        self.offload_bytes = 0

    @property
    def reload_bytes(self) -> int:
        return sum(nbytes for _, _, _, nbytes in self.transfers)

    @property
    def in_flight_reloads(self) -> int:
        """Reloads still copying."""
        return sum(end > self.env.now for end, _ in self._copies)

    def start(self, t: Transition, nbytes: int) -> None:
        if self._on_begin is not None:
            self._on_begin(t, nbytes)
        self._begun += 1
        if t.is_offload:
            (self._offloads_new if self.offloads_wait else self._offloads_due).append(t.block)
            self.offload_bytes += int(nbytes)
            return
        if self.instant:
            start = end = self.env.now
        else:
            queued = self.env.now + (self._begun - 1) * self.transition_s  # its copy goes out as its host work begins
            start = max(queued, self._link_free_at)
            end = start + int(nbytes) / self.bw
        self._link_free_at = end
        self._copies.append((end, t.block))
        self.transfers.append((t.block, start, end, int(nbytes)))

    def boundary(self, forward_in_flight: bool = False) -> None:
        """A boundary begins: offloads begun at the previous one may now release their planes; with
        `forward_in_flight` (a launched forward still runs) those this one begins wait for the next."""
        self._offloads_due.extend(self._offloads_new)
        self._offloads_new = []
        self.offloads_wait = forward_in_flight and not self.instant
        self._begun = 0

    def landed(self) -> list[int]:
        """The offloads due and the reloads copied by the time the plan's moves end (the boundary's instant plus the
        host time of the transitions it began)."""
        self._check()  # the loop calls this after beginning the plan's transitions: memory peaks here
        by = self.env.now + self._begun * self.transition_s
        done = [block for end, block in self._copies if end <= by]
        self._copies = [(end, block) for end, block in self._copies if end > by]
        out = self._offloads_due + done
        self._offloads_due = []
        return out

    def next_landing(self) -> simpy.Event:
        """An event that fires when the next reload still copying is copied."""
        first = min((end for end, _ in self._copies if end > self.env.now), default=self.env.now)
        return self.env.timeout(first - self.env.now)
