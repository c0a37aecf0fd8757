"""The simulator's page mover: the PCIe link as a SimPy resource.

`LinkMover` implements `policies.loop.PageMover` for the simulated replica: a reload's bytes take
`bytes / H2D bandwidth` on a `simpy.Resource` of capacity 1 (transfers serialize) and the block is
reported as landed at the first boundary after its copy finished; an offload copies nothing and is
reported at the boundary that began it when no forward that may read its planes is still running there (as the
runtime's CudaPageMover: its mark, recorded behind the queued kernels, is done), else at the next one. The engine
says which at each boundary (`boundary(forward_in_flight=...)`): never at a synchronous boundary; with asynchronous
scheduling when the batch launched before the boundary is still on the device as the host plans. `PlanTap` passes a policy's plans
through unchanged and remembers the last one, so the engine can size the KV pool for a whole plan at once.
"""
from __future__ import annotations

from typing import Callable

import simpy

from policies.contract import Transition


class LinkMover:
    """The PCIe link as a simpy.Resource: reloads serialize on it; offloads land at once, or one boundary later when
    a forward was still running at the boundary that began them."""

    def __init__(self, env: simpy.Environment, h2d_bytes_per_s: float, on_landed_check: Callable[[], None],
                 on_begin: Callable[[Transition, int], None] | None = None) -> None:
        self.env, self.bw = env, float(h2d_bytes_per_s)
        self.offloads_wait = False  # this boundary's offloads wait for the next (a forward may still read them)
        self.link = simpy.Resource(env, capacity=1)
        self._offloads_new: list[int] = []
        self._offloads_due: list[int] = []
        self._landed: list[int] = []
        self._check = on_landed_check
        self._on_begin = on_begin
        self.transfers: list[tuple[int, float, float, int]] = []  # (block, start, end, bytes) of reloads
        self.reload_bytes = 0
        self.offload_bytes = 0
        self.in_flight_reloads = 0
        self._waiters: list[simpy.Event] = []

    def start(self, t: Transition, nbytes: int) -> None:
        if self._on_begin is not None:
            self._on_begin(t, nbytes)
        if t.is_offload:
            (self._offloads_new if self.offloads_wait else self._offloads_due).append(t.block)
            self.offload_bytes += int(nbytes)
        else:
            self.in_flight_reloads += 1
            self.env.process(self._copy(t.block, int(nbytes)))

    def _copy(self, block: int, nbytes: int):
        with self.link.request() as req:
            yield req
            start = self.env.now
            yield self.env.timeout(nbytes / self.bw)
            self.transfers.append((block, start, self.env.now, nbytes))
        self.reload_bytes += nbytes
        self.in_flight_reloads -= 1
        self._landed.append(block)
        waiters, self._waiters = self._waiters, []
        for ev in waiters:
            ev.succeed()

    def boundary(self, forward_in_flight: bool = False) -> None:
        """A boundary begins: offloads begun at the previous one may now release their planes; with
        `forward_in_flight` (a launched forward still runs) those this one begins wait for the next."""
        self._offloads_due.extend(self._offloads_new)
        self._offloads_new = []
        self.offloads_wait = forward_in_flight

    def landed(self) -> list[int]:
        self._check()  # the loop calls this after beginning the plan's transitions: memory peaks here
        out = self._offloads_due + self._landed
        self._offloads_due, self._landed = [], []
        return out

    def next_landing(self) -> simpy.Event:
        """An event that fires when the next reload lands."""
        ev = self.env.event()
        self._waiters.append(ev)
        return ev
