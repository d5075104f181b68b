"""The admission queue (I/O): holds requests no replica has room for, and lets each go
when one has, choosing its replica at that moment with the router's freshest state.

    admit(ask, candidates) -> Ticket        awaited by the request path, once
    moved(ticket, name)                     served elsewhere (a retry, a fallback)
    done(ticket)                            when the request is over (wakes waiters)

Off (`[admission] enabled = false`), `admit` is `Router.decide` and nothing else.

On: a request goes at once when nothing waits and every candidate has room (room.py).
Otherwise the router previews it once (which replicas hold its prefix, its size in
tokens), shedding.py decides whether it may wait (else 429 + Retry-After), and it waits
in its (class, tenant) flow. Waiters are examined in fair-share order (shares.py)
whenever a request finishes (`done`) and every `recheck_s` while any waits (a first token
frees queued prefill without a call here); each one whose binding says go (room.py) is
decided by the router among the replicas with room, charged to its flow, and released.
A follow-up sent to its own replica past the room (room.py, "past") reaches the engine
at once, so none goes there while a waiter of a higher class may go to that replica, or
one before it in this order stays waiting for it: whatever holds `high` here holds a
lower follow-up too.

Late binding to the fleet as it is now: each pass reads the healthy candidates of each
waiting model from the fleet (`Fleet.candidates`, what the request path asks on arrival),
so a replica that went down while requests waited receives none of them and one that came
up (or joined) serves them; when none is left, its waiters are answered at once with the
error an arrival gets then (503 `no_healthy_replica`), not held to their class's limit.
A replica that a request left with no whole answer (its connection refused or cut: a
replica dying is seen there seconds before the probes mark it down) is doubted: it takes
no request from the queue until a health probe, asked for at once
(`FleetMonitor.suspect`), succeeds after that. Room comes from each replica's own engine
signals (engine.py, room.py); a request's queued prefill there ends at its first token
(a non-streamed one's, whose first byte is its last, at its prefill time since a scrape
showed it begun: `Router.engine_began`; without engine figures, the cost model's
estimate: `Router.estimate_began`).

Error boundary (gateway/tasks.py): every pass (on arrival, in `done`, in the ticker) runs
inside it, so an error in one (the router, the drain rate, metrics) is logged,
rate-limited, and the next pass starts afresh: the ticker goes on, another request's
`done` never raises it, a waiter never stays queued with nobody to release it. A waiter
whose own decision fails is answered at once (a 400 for a body the router cannot render,
else an OpenAI-shaped 500 `internal_error`); the accounting after a decision (shares,
metrics) cannot undo it.

A waiter whose client disconnects is cancelled by the request path: its future is
cancelled at once, so the dispatcher never releases it, and it leaves its flow in the
same step. A waiter still queued at its class's limit is shed (`wait_timeout`).
Bounds: `max_queue` waiters; flows <= 3 classes x tenants; the per-class wait samples
kept for `/stats` are a ring of `WAIT_SAMPLES`; one learned `Capacity` per replica of the
fleet.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from gateway.admission import priority
from gateway.admission.asks import Ask, Ticket, Waiter
from gateway.admission.classroom import ClassRoom
from gateway.admission.config import CLASSES, AdmissionConfig, Priority
from gateway.admission.dispatch import Dispatcher
from gateway.admission.fleetview import FleetView
from gateway.admission.room import (
    ReplicaLoad,
    RoomLimits,
    bind,
    has_room,
    passable,
    rate,
    wait_past,
)
from gateway.admission.shares import FairShare, Flow, RecentTokens
from gateway.admission.shedding import (
    SHED_REASONS,
    Arrival,
    DrainRate,
    Shed,
    ShedReason,
    retry_after,
    verdict,
)
from gateway.agents.reserve import Reservations
from gateway.routing.config import RoutingConfig
from gateway.routing.router import Router
from gateway.tasks import FailureLog

if TYPE_CHECKING:  # annotations only: replicas reach usage, whose metrics name admission's labels
    from gateway.replicas.fleet import Fleet, Replica
    from gateway.routing.plan import RoutePlan
    from gateway.usage.metrics import GatewayMetrics

# the request path's records (asks.py), named here as before
__all__ = ["Ask", "Gate", "Ticket"]

log = logging.getLogger("gateway.admission")

WAIT_SAMPLES = 4096  # per class, for the /stats quantiles
NO_TENANT = "none"
class Gate:
    def __init__(self, config: AdmissionConfig, routing: RoutingConfig, router: Router,
                 metrics: GatewayMetrics, clock: Callable[[], float],
                 timer: Callable[[], float], *, fleet: Fleet | None = None,
                 scrape_interval_s: float = 5.0,
                 suspect: Callable[[Replica], None] | None = None,
                 scrape_soon: Callable[[Replica], bool] | None = None) -> None:
        self.config = config
        # agent programs between tool calls: the context held for them on each replica
        # (gateway.agents.reserve), read into each replica's load by the fleet view
        # (its miss cost at the replica's measured prefill rate, its holds bounded by the
        # replica's KV capacity, dropped when the router takes the replica as restarted)
        self.programs = Reservations(
            max_s=config.agent_reserve_max_s,
            s_per_token=lambda name: self._fleet_view.s_per_token(name),
            capacity_tokens=lambda name: self._fleet_view.capacity_tokens(name),
            epoch=router.restarts)
        # where waiters may go on each pass, and each replica's load (fleetview.py);
        # no fleet (tests of the queue alone): their arrival's candidates still healthy
        self._fleet_view = FleetView(fleet, router, clock,
                                     config.stale_after_scrapes * scrape_interval_s, suspect,
                                     reserved=self.programs.reserved_tokens,
                                     scrape_soon=scrape_soon)
        self.router = router
        self.metrics = metrics
        self.clock = clock
        self.timer = timer
        self._per_token = routing.prefill_s_per_token
        self._in_flight_s = routing.in_flight_s
        self._prior_s = routing.prefill_s_per_token * routing.session_prior_tokens
        # what each class may fill now, and how the lower ones yield (classroom.py)
        self.classes = ClassRoom(config, routing.prefill_s_per_token)
        self._shares = FairShare(config.class_weight, config.tenant_weight)
        self._drain = DrainRate(floor=1.0 / routing.prefill_s_per_token)
        self._recent = RecentTokens(config.share_half_life_s)
        self._flows: dict[Flow, deque[Waiter]] = {}
        self._tokens: dict[Flow, float] = {}
        self._count = 0
        self._admitted: dict[str, int] = {}
        self._priority_replicas = frozenset(config.priority_replicas)
        self._waits: dict[Priority, deque[float]] = {
            c: deque(maxlen=WAIT_SAMPLES) for c in CLASSES}
        self._shed: dict[ShedReason, int] = dict.fromkeys(SHED_REASONS, 0)
        self._admitted_tokens: dict[str, int] = {}
        self.failures = FailureLog(log)  # the dispatcher's error boundary (module docstring)
        self._dispatcher = Dispatcher(
            config, self._flows, self._tokens, lambda: self._count, self._fleet_view, router,
            self._shares, self._recent, self._drain, self.failures, clock, timer,
            load=self._load, limits=self._limits, cache_steers=self.classes.cache_steers,
            seen_by=self._seen_by,
            fair_part=self._fair_part, leave=self._leave, go=self._go,
            per_token=self._per_token, in_flight_s=self._in_flight_s, prior_s=self._prior_s)

    # the protocol -----------------------------------------------------------------------

    async def admit(self, ask: Ask, candidates: Sequence[Replica]) -> Ticket:
        """Route `ask` when a candidate has room. Raises `Shed` (429), GatewayError (400
        for a bad priority header), ValueError (a body the router cannot render)."""
        router = self.router
        if not self.config.enabled:
            plan = router.decide(ask.body, ask.kind, ask.model, ask.session,
                                 [r.state() for r in candidates], ask.ts, pin=ask.pin,
                                 tenant=ask.tenant)
            return Ticket(plan, "normal", None)
        cfg = self.config
        returning: str | None = None
        if ask.program is not None:  # its tool call is over: nothing held for it now
            returning = self.programs.began_on(ask.program, self.clock())
        cls = priority.resolve(ask.priority, ask.tenant, cfg.priority_caps,
                               cfg.default_priority_cap)
        flow: Flow = (cls, ask.tenant or NO_TENANT)
        pool = [r for r in candidates if r.name == ask.pin] or candidates
        self.classes.arrived(cls, self.timer())
        limits = self._limits(cls, self.timer())
        if self._count == 0 and all(has_room(self._seen_by(returning, self._load(r)), limits)
                                    for r in pool):
            ticket = self._go(ask, cls, flow, pool, ask.ts, 0.0, queued=False)
            self.classes.admitted(cls, self.timer())
            return ticket
        now = self.timer()
        preview = router.preview(ask.body, ask.kind, ask.model, ask.session,
                                 [r.state() for r in pool], self.clock(), tenant=ask.tenant)
        tokens = max(1.0, preview.estimated_tokens)
        waiting = dict(self._tokens)
        loads = [dataclasses.replace(self._load(r),
                                     predicted_tokens=preview.predicted.get(r.name, 0))
                 for r in pool]
        projected_s = self._projected_s(flow, tokens, waiting, loads, limits, now)
        max_wait = cfg.max_wait_s(cls)
        tenants = {t: q for (c, t), q in waiting.items() if c == cls}
        fair = self._fair_part(flow)
        queue = self._flows.get(flow)
        v = verdict(Arrival(
            queue_len=self._count, max_queue=cfg.max_queue,
            lower_waiting=any(priority.rank(c) > priority.rank(cls) for c, _ in self._flows),
            projected_s=projected_s, max_wait_s=max_wait,
            tenant_waiting=len(queue) if queue else 0,
            tenant_slots=cfg.max_queue * fair,
            others_waiting=any(t != flow[1] for t in tenants),
            recent_part=self._recent.part(flow, now), fair_part=fair,
            over_share=cfg.over_share))
        if v != "enqueue" and v != "displace":
            raise self._shedding(v, cls, projected_s)
        if v == "displace":
            self._displace(cls)
        self.classes.admitted(cls, self.timer())  # queued: not shed nor refused
        waiter = Waiter(ask, cls, flow, tokens, preview, pool, now, returning=returning)
        self._shares.activate(flow, waiting)
        self._flows.setdefault(flow, deque()).append(waiter)
        self._tokens[flow] = self._tokens.get(flow, 0.0) + tokens
        self._count += 1
        try:  # from here on, whatever happens, it leaves its flow (`_leave`, below)
            self._depth()
            self._dispatcher.guarded()
            if not waiter.future.done():
                self._dispatcher.start_ticker()
            async with asyncio.timeout(max_wait - (self.timer() - now)):
                return await waiter.future
        except TimeoutError:
            if waiter.future.done() and not waiter.future.cancelled():
                return waiter.future.result()
            raise self._shedding("wait_timeout", cls, max_wait) from None
        except asyncio.CancelledError:
            # the client went away: a ticket released in the same instant is given back
            fut = waiter.future
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self._abandon(fut.result())
            self.metrics.admission_abandoned(cls)
            raise
        finally:
            self._leave(waiter)

    def forget_replica(self, name: str) -> None:
        """`name` left the fleet: its engine figures and admitted count go with it (a
        request still in flight there gives back a count that is no longer kept)."""
        self._fleet_view.forget(name)
        self._admitted.pop(name, None)
        self.programs.forget_replica(name)

    def moved(self, ticket: Ticket, name: str) -> None:
        """The request is served on `name` instead (a retry, a data plane's fallback): its
        count there, so the replica it left has its room back at once and the one serving
        it none (as the in-flight count moves)."""
        old = ticket.replica
        if old is None or old == name:
            return
        left = self._admitted.get(old, 0) - 1
        if left > 0:
            self._admitted[old] = left
        else:
            self._admitted.pop(old, None)
        self._admitted[name] = self._admitted.get(name, 0) + 1
        ticket.replica = name
        if self._count:
            self._dispatcher.guarded()  # the room it left may take a waiter

    def done(self, ticket: Ticket, counted: bool = True) -> None:
        """The request is over: its room is free again. `counted` False: the replica it
        was admitted to departed (its count went with it, `forget_replica`), and its name
        may be another server's now, whose count and figures are not this request's."""
        name = ticket.replica
        if name is None:
            return
        if counted:
            self._fleet_view.doubt(ticket.plan.outcome)
            self._tool_call(ticket, name)
            left = self._admitted.get(name, 0) - 1
            if left > 0:
                self._admitted[name] = left
            else:
                self._admitted.pop(name, None)
        if self._count:
            self._dispatcher.guarded()  # never an error in this request's own cleanup

    async def aclose(self) -> None:
        await self._dispatcher.aclose()

    def stats(self) -> dict[str, Any]:
        """The `/stats` "admission" object."""
        queued = dict.fromkeys(CLASSES, 0)
        for (c, _), q in self._flows.items():
            queued[c] += len(q)
        return {
            "enabled": self.config.enabled,
            "queued": queued,
            "shed": dict(self._shed),
            "wait_ms": {c: _quantiles(self._waits[c]) for c in CLASSES},
            "admitted_tokens": dict(self._admitted_tokens),
            # per replica, where its room came from at the last look and how old the
            # engine's figures were (fleet-wide, like the replicas' own gauges)
            "replicas": self._fleet_view.stats(),
            # agent programs between turns, and the context held for them per replica
            "agent_programs": {"between_turns": len(self.programs),
                               "held_tokens": self.programs.held(self.clock())},
        }

    # internals --------------------------------------------------------------------------

    def _tool_call(self, ticket: Ticket, name: str) -> None:
        """An agent program's turn ended with a whole answer on `name`: its context (the
        prompt and answer tokens) may be held there while it runs its tool."""
        o = ticket.plan.outcome
        if ticket.program is None or o.prompt_tokens is None or not o.ok:
            return
        self.programs.ended(ticket.program, o.replica or name,
                            o.prompt_tokens + (o.completion_tokens or 0), self.clock())

    def _load(self, replica: Replica, queued: float | None = None,
              largest: float | None = None) -> ReplicaLoad:
        own = max(replica.in_flight, self._admitted.get(replica.name, 0))
        return self._fleet_view.load(replica, own, queued, largest)

    def _seen_by(self, returning: str | None, load: ReplicaLoad) -> ReplicaLoad:
        """`load` as a request sees it: a program back from its tool call is charged for
        no program's reservation on the replica its history is on (`returning`), and
        elsewhere as a newcomer is (fleetview.py)."""
        return self._fleet_view.without_held(load) if load.name == returning else load

    def _limits(self, cls: Priority, now: float) -> RoomLimits:
        return self.classes.limits(cls, now)

    def _projected_s(self, flow: Flow, tokens: float, waiting: Mapping[Flow, float],
                     loads: Sequence[ReplicaLoad], limits: RoomLimits, now: float) -> float:
        """The wait projected for an arrival of `tokens` in `flow` (what `wait_limit`
        sheds on): the fair-share tokens ahead of it at the rate the queue drained, never
        believed below what its healthy replicas prefill together (each one's measured
        rate, else the cost model's: one replica's rate for the fleet shed most of an
        overload the fleet serves within the limit); a follow-up that goes to its own
        replica past the room at once (room.py, "past") waits only for the prefill
        queued there."""
        fleet = sum(1.0 / rate(ld, self._per_token) for ld in loads if ld.healthy)
        projected = (self._shares.projected_tokens(flow, tokens, waiting)
                     / self._drain.rate(now, floor=fleet))
        past_room = self.config.own_replica_past_room
        if not any(passable(ld, limits, tokens, past_room) for ld in loads):
            return projected
        b = bind(loads, limits, self._per_token, self._in_flight_s, 0.0,
                 self.config.own_replica_max_wait_s, self._prior_s, tokens, past_room)
        return min(projected, wait_past(loads, b, self._per_token, tokens))

    def _fair_part(self, flow: Flow) -> float:
        """`flow`'s weighted share among the tenants waiting in its class, itself in."""
        cls, tenant = flow
        weight = self.config.tenant_weight
        others = sum(weight(t) for c, t in self._flows if c == cls and t != tenant)
        return weight(tenant) / (weight(tenant) + others)

    def _owed(self, flow: Flow, now: float) -> bool:
        return self._dispatcher.owed(flow, now)  # dispatch.py; the tests ask it directly

    def _go(self, ask: Ask, cls: Priority, flow: Flow, allowed: Sequence[Replica], now: float,
            waited_s: float, *, queued: bool, preview: RoutePlan | None = None) -> Ticket:
        plan = self.router.decide(ask.body, ask.kind, ask.model, ask.session,
                                  [r.state() for r in allowed], now, pin=ask.pin,
                                  previewed=preview, tenant=ask.tenant)
        decision = plan.decision
        name = decision.replica
        self._admitted[name] = self._admitted.get(name, 0) + 1
        # decided and counted: from here the request goes whatever the accounting does
        # (an error there would leave a ticket nobody holds, its slot taken for ever)
        try:
            self._account(cls, flow, decision.estimated_prompt_tokens, waited_s,
                          queued=queued)
        except Exception as exc:  # the boundary: the shares are wrong, the request goes
            self.failures.failed("admission accounting", exc)
        engine = None
        if cls != "normal" and self._priority_replicas.issuperset(decision.ranked):
            engine = priority.ENGINE_PRIORITY[cls]
        return Ticket(plan, cls, name, engine, waited_s * 1000.0 if queued else None,
                      ask.program)

    def _account(self, cls: Priority, flow: Flow, tokens: int, waited_s: float, *,
                 queued: bool) -> None:
        if queued:
            self._shares.charge(flow, tokens)
        self._recent.add(flow, tokens, self.timer())
        tenant = flow[1]
        self._admitted_tokens[tenant] = self._admitted_tokens.get(tenant, 0) + tokens
        self._waits[cls].append(waited_s * 1000.0)
        self.metrics.admission_admitted(cls, tenant, tokens, waited_s)

    def _dispatch(self) -> None:
        """One pass of the dispatcher (dispatch.py)."""
        self._dispatcher.dispatch()

    def _leave(self, w: Waiter) -> None:
        queue = self._flows.get(w.flow)
        if queue is None or w not in queue:
            return
        queue.remove(w)
        self._count -= 1
        left = self._tokens.get(w.flow, 0.0) - w.tokens
        if queue:
            self._tokens[w.flow] = max(0.0, left)
        else:
            del self._flows[w.flow]
            self._tokens.pop(w.flow, None)
            self._shares.forget_idle(self._tokens)
        if self._count == 0:
            self._drain.clear()  # the drain is measured while requests wait (shedding.py)
        self._depth()

    def _displace(self, cls: Priority) -> None:
        """Shed the youngest waiter of the lowest class below `cls` for a newcomer."""
        lowest = max((c for c, _ in self._flows), key=priority.rank)
        if priority.rank(lowest) <= priority.rank(cls):
            return
        victims = [q[-1] for (c, _), q in self._flows.items() if c == lowest and q]
        victim = max(victims, key=lambda w: w.arrived)
        self._leave(victim)
        if not victim.future.done():
            victim.future.set_exception(self._shedding(
                "displaced", victim.cls, self.config.max_wait_s(victim.cls)))

    def _abandon(self, ticket: Ticket) -> None:
        self.router.report(ticket.plan, self.clock())
        self.done(ticket)

    def _shedding(self, reason: ShedReason, cls: Priority, projected_s: float) -> Shed:
        self._shed[reason] += 1
        self.metrics.admission_shed(reason)
        return Shed(reason, retry_after(projected_s, self.config.max_wait_s(cls)))

    def _depth(self) -> None:
        queued = dict.fromkeys(CLASSES, 0)
        for (c, _), q in self._flows.items():
            queued[c] += len(q)
        for c, n in queued.items():
            self.metrics.admission_queued(c, n)



def _quantiles(samples: deque[float]) -> dict[str, float | None]:
    if not samples:
        return {"p50": None, "p99": None}
    ordered = sorted(samples)
    n = len(ordered)
    return {"p50": round(ordered[(n - 1) // 2], 3),
            "p99": round(ordered[min(n - 1, int(0.99 * n))], 3)}
