"""The async step loop of one simulated replica (the only place the engine meets time).

Loop: if the engine has no work, mark the virtual clock idle and wait on an event (no
spinning). Otherwise plan a step, let ``duration / speed`` wall seconds pass, then finish it
and hand each produced token to the waiting HTTP handler. Sleeps are paced against a running
wall-clock target so that sub-millisecond steps at high ``--speed`` are batched into real
sleeps; a loop that falls more than 50 ms behind (CPU-bound) resets its target instead of
bursting. Simulated time advances by the modelled durations, whatever the CPU does.

A periodic task logs vLLM's stats line (contract section 4) every ``log_interval`` seconds
while the engine was busy; throughputs there are per simulated second.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from gateway.sim.clock import VirtualClock
from gateway.sim.engine import Engine, StepOutput
from gateway.sim.request import SimRequest
from gateway.sim.statslog import stats_line

log = logging.getLogger("gateway.sim")

_MIN_SLEEP_S = 0.0005
_MAX_LAG_S = 0.05


@dataclass(eq=False, slots=True)
class Pending:
    """The HTTP side of one request: tokens arrive in ``queue`` (None = finished)."""

    request: SimRequest
    queue: asyncio.Queue[int | None] = field(default_factory=asyncio.Queue)
    streaming: bool = True


class Replica:
    def __init__(
        self, name: str, engine: Engine, speed: float, seed: int, log_interval: float
    ) -> None:
        self.name = name
        self.engine = engine
        self.speed = speed
        self.log_interval = log_interval
        self._rng = random.Random(seed)
        self._loop = asyncio.get_running_loop()
        self.clock = VirtualClock(speed, self._loop.time())
        self._pending: dict[SimRequest, Pending] = {}
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._busy_since_log = False
        self._last_log_sim = 0.0
        self.in_flight = 0
        # Called after every engine step (KV-event publishing, gateway/sim/kvpublish.py).
        self.after_step: Callable[[], None] | None = None

    def start(self) -> None:
        self._tasks = [
            self._loop.create_task(self._run()),
            self._loop.create_task(self._log_loop()),
        ]

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        for p in list(self._pending.values()):
            self.abort(p)

    def now(self) -> float:
        return self.clock.now(self._loop.time())

    def arrive(self) -> float:
        """Simulated arrival time of a request about to be submitted."""
        self._wake.set()
        return self.clock.wake(self._loop.time())

    def wake(self) -> None:
        """Blocks were freed outside a step (a peer released a KV lease): try again."""
        self._wake.set()

    def submit(self, req: SimRequest, streaming: bool) -> Pending:
        p = Pending(req, streaming=streaming)
        self._pending[req] = p
        self.engine.add(req)
        self._wake.set()
        return p

    def abort(self, p: Pending) -> None:
        """Client gone: drop the request from the engine and free its blocks now."""
        if self._pending.pop(p.request, None) is not None:
            self.engine.abort(p.request, self.now())
            p.queue.put_nowait(None)
            self._wake.set()

    async def _run(self) -> None:
        loop = self._loop
        engine = self.engine
        clock = self.clock
        target = loop.time()
        while True:
            if not engine.has_work():
                clock.idle(loop.time())
                self._wake.clear()
                await self._wake.wait()
                target = loop.time()
                continue
            wall = loop.time()
            plan, duration = engine.plan_step(self._rng.random(), clock.now(wall))
            if not plan.work:
                # Nothing fits (e.g. every block pinned): wait for a finish, an abort, a
                # released KV lease, or the next lease to expire.
                clock.idle(wall)
                self._wake.clear()
                await self._wait_for_room()
                target = loop.time()
                continue
            clock.begin_step(wall, duration)
            self._busy_since_log = True
            target += duration / self.speed
            delay = target - loop.time()
            if delay >= _MIN_SLEEP_S:
                await asyncio.sleep(delay)
            else:
                if delay < -_MAX_LAG_S:
                    target = loop.time()
                await asyncio.sleep(0)
            end = clock.end_step(loop.time())
            self._deliver(engine.finish_step(plan, end))
            if self.after_step is not None:
                self.after_step()

    async def _wait_for_room(self) -> None:
        expiry = self.engine.leases.next_expiry()
        if expiry is None:
            await self._wake.wait()
            return
        delay = max(0.0, expiry - self.now()) / self.speed + _MIN_SLEEP_S
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), delay)

    def _deliver(self, outputs: list[StepOutput]) -> None:
        pending = self._pending
        for out in outputs:
            req = out.request
            p = pending.get(req)
            if p is None:
                continue
            if p.streaming:
                p.queue.put_nowait(out.token)
            if req.status == "finished":
                del pending[req]
                p.queue.put_nowait(None)
                self._wake.set()

    async def _log_loop(self) -> None:
        while True:
            await asyncio.sleep(self.log_interval)
            engine = self.engine
            if not (self._busy_since_log or engine.has_work()):
                continue
            self._busy_since_log = False
            now = self.now()
            g = engine.gauges()
            log.info(
                "%s",
                stats_line(
                    self.name,
                    engine.interval_prompt_tokens,
                    engine.interval_generation_tokens,
                    now - self._last_log_sim,
                    g.running,
                    g.waiting,
                    g.kv_usage,
                    engine.hit_rate.rate(),
                ),
            )
            self._last_log_sim = now
            engine.interval_prompt_tokens = engine.interval_generation_tokens = 0
