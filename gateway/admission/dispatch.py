"""The admission queue's dispatcher: the passes over the waiters (gate.py holds them in
their flows) that release every one that may go now, in fair-share order, to the replicas
its binding names (room.py), and answer at once those whose model no replica can serve
now. It owns the order in which waiters are examined, who is passed over for whom
(matching first; past the room, passing.py), and when passes run: inside the error
boundary, and on the ticker every `recheck_s` while any waits. The queue, the room
limits and a decision's accounting stay with the gate, which hands them in."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

from gateway.admission.asks import Ask, PoolKey, Pools, Ticket, Waiter
from gateway.admission.config import AdmissionConfig, Priority
from gateway.admission.fleetview import FleetView
from gateway.admission.passing import holds_history, wanted_above
from gateway.admission.room import (
    ReplicaLoad,
    RoomLimits,
    bind,
    has_room,
    passable,
    room_but_cache,
)
from gateway.admission.shares import FairShare, Flow, RecentTokens
from gateway.admission.shedding import DrainRate
from gateway.routing.router import Router
from gateway.tasks import FailureLog, supervised
from gateway.upstream.errors import GatewayError

if TYPE_CHECKING:  # annotations only: replicas reach usage, whose metrics name admission's labels
    from gateway.replicas.fleet import Replica
    from gateway.routing.plan import RoutePlan


class LoadOf(Protocol):
    """A replica's load as the gate counts it (its own in-flight count in)."""

    def __call__(self, replica: Replica, queued: float | None = None,
                 largest: float | None = None) -> ReplicaLoad: ...


class Go(Protocol):
    """The gate's decision for a waiter: routed among `allowed`, counted and accounted."""

    def __call__(self, ask: Ask, cls: Priority, flow: Flow, allowed: Sequence[Replica],
                 now: float, waited_s: float, *, queued: bool,
                 preview: RoutePlan | None = None) -> Ticket: ...


class Dispatcher:
    def __init__(self, config: AdmissionConfig, flows: Mapping[Flow, deque[Waiter]],
                 tokens: Mapping[Flow, float], waiting: Callable[[], int],
                 fleet_view: FleetView, router: Router, shares: FairShare,
                 recent: RecentTokens, drain: DrainRate, failures: FailureLog,
                 clock: Callable[[], float], timer: Callable[[], float], *,
                 load: LoadOf, limits: Callable[[Priority, float], RoomLimits],
                 cache_steers: Callable[[Priority, float], bool],
                 seen_by: Callable[[str | None, ReplicaLoad], ReplicaLoad],
                 fair_part: Callable[[Flow], float], leave: Callable[[Waiter], None],
                 go: Go, per_token: float, in_flight_s: float, prior_s: float) -> None:
        # the gate's own state, shared (never copied): the waiting flows and their tokens,
        # and how many wait (`waiting`)
        self.config = config
        self._flows = flows
        self._tokens = tokens
        self._waiting = waiting
        self._fleet_view = fleet_view
        self.router = router
        self._shares = shares
        self._recent = recent
        self._drain = drain
        self.failures = failures
        self.clock = clock
        self.timer = timer
        self._load = load
        self._limits = limits
        # (class, timer): whether a full cache only steers (room.py, "The KV usage steers")
        self._cache_steers = cache_steers
        self._seen_by = seen_by
        self._fair_part = fair_part
        self._leave = leave
        self._go = go
        # the cost model's figures `bind` weighs a waiter's own replica with (room.py)
        self._per_token = per_token
        self._in_flight_s = in_flight_s
        self._prior_s = prior_s
        self._ticker: asyncio.Task[None] | None = None

    def dispatch(self) -> None:
        """Release every waiter that may go now, in fair-share order. Each replica's load
        is read once per pass (and again after a request went there), so a pass costs
        O(waiters x candidates) cheap comparisons."""
        if self._waiting() == 0:
            return
        now = self.timer()
        cfg = self.config
        self._fleet_view.forget_left()
        pools: dict[PoolKey, list[Replica]] = {}
        gone: dict[PoolKey, GatewayError] = {}
        for q in self._flows.values():
            for w in q:
                key = w.ask.key()
                if key not in pools and key not in gone:
                    try:
                        pools[key] = self._fleet_view.pool(w.ask.model, w.ask.pin, w.pool,
                                                           w.ask.allowed)
                    except GatewayError as err:  # no replica left for it (fleetview.py)
                        gone[key] = err
        if gone:
            self._answer(gone)
        queued = self.router.queued_by_replica(self.clock())
        largest = self.router.largest_by_replica()
        replicas = {r.name: r for pool in pools.values() for r in pool}
        base = {name: self._load(r, queued.get(name, 0.0), largest.get(name, 0.0))
                for name, r in replicas.items()}
        rounds = 0
        while self._waiting() and rounds <= cfg.max_queue:
            # room per waiting class: under overload a replica often has room for `high`
            # only, and scanning every lower-class waiter each recheck for nothing made
            # the dispatcher the gateway's main CPU cost with a thousand waiting
            # (a program back from its tool call sees no reservation: a superset of room;
            # room.py's room is the same whatever a waiter's size, so none is passed)
            # (and, for a class a full cache steers, those full by their KV usage alone:
            # room.py, "The KV usage steers, and holds none")
            classes = {c for c, _ in self._flows}
            unheld = {name: self._fleet_view.without_held(ld) for name, ld in base.items()}
            roomy = {c: {name for name, ld in unheld.items()
                         if has_room(ld, self._limits(c, now))
                         or (self._cache_steers(c, now)
                             and room_but_cache(ld, self._limits(c, now)))}
                     for c in classes}
            # and those a follow-up holding its history there may go to past the room
            past = {c: {name for name, ld in unheld.items()
                        if passable(ld, self._limits(c, now),
                                    0.0, cfg.own_replica_past_room)}
                    for c in classes}
            if not any(roomy.values()) and not any(past.values()):
                return  # nobody can go anywhere: the common case under overload
            rounds += 1
            released = self._release_one(base, roomy, past, now, pools)
            if released is None:
                return
            base[released] = self._load(replicas[released])

    def _release_one(self, base: dict[str, ReplicaLoad], roomy: Mapping[Priority, set[str]],
                     past: Mapping[Priority, set[str]], now: float,
                     pools: Pools) -> str | None:
        """Release the first waiter in fair-share order that may go; the replica it went
        to, None when none may. Matching first: a `normal` or `low` waiter that would have
        to leave the replica holding its prefix is passed over, in a first round, for one
        whose own replica has room (a freed replica goes to a conversation it holds);
        `high` keeps its place in either round, and so does a tenant owed its share."""
        for matching in (True, False):
            went = self._release_pass(base, roomy, past, now, matching, pools)
            if went is not None:
                return went
        return None

    def _release_pass(self, base: dict[str, ReplicaLoad], roomy: Mapping[Priority, set[str]],
                      past: Mapping[Priority, set[str]], now: float, matching: bool,
                      pools: Pools) -> str | None:
        cfg = self.config
        # past the room puts a request in the engine ahead of whoever waits here for that
        # replica: never ahead of a higher class (`above`), nor of a waiter before it in
        # this order that stays (`held`) (room.py, "past")
        above = wanted_above(self._flows, pools)
        held: set[str] = set()
        for flow in self._shares.order(self._tokens, lambda f: self._recent.part(f, now)):
            room = roomy.get(flow[0], set())
            beyond = past.get(flow[0], set())
            if not room and not beyond:
                continue  # bind would answer "full" for each of its waiters
            keeps_place = flow[0] == "high" or (matching and self.owed(flow, now))
            for w in list(self._flows.get(flow, ())):
                pool = pools.get(w.ask.key(), ())
                if w.future.done():
                    continue  # cancelled: it leaves in its own task
                if not (any(r.name in room for r in pool)
                        or holds_history(w.preview, pool, beyond - held - above[w.cls])):
                    held.update(r.name for r in pool)
                    continue  # nowhere to go
                loads = [dataclasses.replace(self._seen_by(w.returning, base[r.name]),
                                             predicted_tokens=w.preview.predicted.get(r.name, 0))
                         for r in pool]
                b = bind(loads, self._limits(w.cls, now), self._per_token, self._in_flight_s,
                         0.0 if w.own_since is None else now - w.own_since,
                         cfg.own_replica_max_wait_s, self._prior_s, w.tokens,
                         cfg.own_replica_past_room, cache_steers=self._cache_steers(w.cls, now))
                if b.why == "own" and w.own_since is None:
                    w.own_since = now
                ahead = b.why == "past" and not (held | above[w.cls]).isdisjoint(b.replicas)
                if not b.go or ahead or (matching and b.why == "elsewhere"
                                         and not keeps_place):
                    held.update(r.name for r in pool)
                    continue
                allowed = [r for r in pool if r.name in b.replicas]
                self._leave(w)
                try:
                    ticket = self._go(w.ask, w.cls, w.flow, allowed, self.clock(),
                                      now - w.arrived, queued=True, preview=w.preview)
                except ValueError as exc:  # a body the router cannot render: 400
                    w.future.set_exception(exc)
                    return allowed[0].name
                except Exception as exc:  # a bug: this waiter is answered, the rest go on
                    self.failures.failed("admission decision", exc)
                    w.future.set_exception(GatewayError(
                        500, "The gateway failed to route this request.",
                        code="internal_error"))
                    return allowed[0].name
                w.future.set_result(ticket)
                self._drain.add(now, ticket.plan.decision.estimated_prompt_tokens)
                return ticket.plan.decision.replica
        return None

    def owed(self, flow: Flow, now: float) -> bool:
        """`flow` got clearly less than its fair part of its class's recent tokens (below
        it by the factor `over_share` by which a tenant above it is shed): its waiters
        keep their place in the matching round (a quiet tenant is not passed over by the
        flooder's requests whose replica just freed). Not merely below it: of two tenants
        at even shares one always is, and its follow-ups left their cache for it."""
        return (self._recent.part(flow, now) * self.config.over_share
                < self._fair_part(flow))

    def _answer(self, gone: Mapping[PoolKey, GatewayError]) -> None:
        """Answer the waiters for models no replica can serve now with the fleet's error
        (503 none healthy, 404 none serving it): what an arrival is told at that moment."""
        for q in list(self._flows.values()):
            for w in list(q):
                err = gone.get(w.ask.key())
                if err is None:
                    continue
                self._leave(w)
                if not w.future.done():  # one error each: a raised one gathers a traceback
                    w.future.set_exception(GatewayError(err.status, err.message, code=err.code,
                                                        param=err.param))

    def guarded(self) -> None:
        """`dispatch` inside the error boundary: a pass that fails is logged (rate-limited)
        and the next one (a `done`, an arrival, the ticker) starts afresh; every waiter
        stays in its flow, answered by a later pass or at its class's limit."""
        try:
            self.dispatch()
        except Exception as exc:  # the boundary: anything but cancellation
            self.failures.failed("admission dispatch", exc)

    def start_ticker(self) -> None:
        if self._ticker is None or self._ticker.done():
            self._ticker = asyncio.create_task(
                supervised("admission ticker", self._tick, self.failures))

    async def _tick(self) -> None:
        while self._waiting():
            await asyncio.sleep(self.config.recheck_s)
            self.guarded()

    async def aclose(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._ticker
            self._ticker = None
