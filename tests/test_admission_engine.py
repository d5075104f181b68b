"""Room from what the engine says, by tables (engine.py, room.py, Router.began): what a
scrape teaches about what the engine runs at once, a fresh or stale scrape read with what
the gateway sent since, room with the engine's figures and health; and, in process, the
queue bound to the fleet as it is now (a replica down, up, or doubted while requests
wait), a stale scrape that stops throttling, a scrape that ends queued prefill."""

from __future__ import annotations

import asyncio
import dataclasses
import math
from typing import Any

import pytest

from gateway.admission.config import AdmissionConfig
from gateway.admission.engine import PROBE_SEQS, Capacity, EngineView, Scrape, learn, view
from gateway.admission.fleetview import FleetView
from gateway.admission.gate import Ask, Gate, Ticket
from gateway.admission.room import ReplicaLoad, RoomLimits, has_room, reserved
from gateway.replicas.fleet import Fleet
from gateway.routing.config import RoutingConfig
from gateway.routing.router import Router, began
from gateway.settings import ReplicaSettings
from gateway.usage.metrics import GatewayMetrics
from gateway.usage.snapshot import EngineSnapshot


def scrape(ts: float = 0.0, running: float | None = 0, waiting: float | None = 0,
           kv: float | None = None, own: int = 0) -> Scrape:
    return Scrape(ts, running, waiting, kv, own)


@pytest.mark.parametrize(("cap", "seen", "saturated", "most", "limit"), [
    (Capacity(), None, None, None, None),  # never scraped: nothing known
    (Capacity(), scrape(running=None, waiting=None), None, None, None),  # no such metrics
    (Capacity(), scrape(running=3), None, 3, PROBE_SEQS),  # below the probe: the probe
    (Capacity(), scrape(running=6), None, 6, 12),  # it ran 6: twice that
    # 4 running while 2 wait, once: maybe a newcomer before the next step, not yet known
    (Capacity(), scrape(running=4, waiting=2), None, 4, PROBE_SEQS),
    # ... and still SATURATION_S later: its limit
    (Capacity(1.0, None, 4, 4, 0.5), scrape(ts=2.5, running=4, waiting=1), 4, 4, 4),
    (Capacity(1.0, None, 4, 4, 0.5), scrape(ts=2.4, running=4, waiting=1),
     None, 4, PROBE_SEQS),  # not yet (a long prefill step)
    # beside a nearly full KV cache (0.9 and up) the queue may wait for blocks: no limit
    (Capacity(1.0, None, 4, 4, 0.5), scrape(ts=2.5, running=4, waiting=1, kv=0.9),
     None, 4, PROBE_SEQS),
    (Capacity(1.0, None, 4, 4, 0.5), scrape(ts=2.5, running=4, waiting=1, kv=0.89), 4, 4, 4),
    # the running count grew while requests waited (prefill budget): no limit shown
    (Capacity(1.0, None, 2, 2, 0.0), scrape(ts=9.0, running=4, waiting=1),
     None, 4, PROBE_SEQS),
    # below what it ran before: not its sequence limit
    (Capacity(1.0, None, 9, 2, 0.0), scrape(ts=9.0, running=2, waiting=1), None, 9, 18),
    # the queue emptied in between: the clock starts again
    (Capacity(1.0, None, 4, None, None), scrape(ts=9.0, running=4, waiting=1),
     None, 4, PROBE_SEQS),
    (Capacity(1.0, 4, 4), scrape(ts=2.0, running=2), 4, 4, 4),  # a quiet scrape keeps it
    # a learnt limit unconfirmed (no queue beside it) for PROBE_AFTER_S: one more offered
    (Capacity(1.0, 7, 7, confirmed_at=1.0), scrape(ts=61.0, running=7), 7, 7, 8),
    (Capacity(1.0, 7, 7, confirmed_at=1.0), scrape(ts=60.9, running=7), 7, 7, 7),
    # ... a queue beside it confirms it (the probe ends) ...
    (Capacity(1.0, 7, 7, confirmed_at=1.0, probing=True),
     scrape(ts=66.0, running=7, waiting=1), 7, 7, 7),
    # ... the engine running more refutes it: back to the guess, twice what it ran
    (Capacity(1.0, 7, 7, confirmed_at=1.0, probing=True), scrape(ts=66.0, running=8),
     None, 8, 16),
    (Capacity(1.0, 4, 5, 5, 0.0), scrape(ts=2.0, running=5, waiting=1), 5, 5, 5),  # more
    (Capacity(1.0, None, 6, 6), scrape(ts=1.0, running=50, waiting=9), None, 6, 12),  # seen
    (Capacity(), scrape(running=math.inf, waiting=math.nan), None, None, None),  # odd
    (Capacity(), scrape(running=-3, waiting=5), None, None, None),
    (Capacity(), scrape(running=0, waiting=5), None, 0, PROBE_SEQS),  # nothing runs yet
])
def test_what_the_engine_runs_at_once_is_learned_from_its_scrapes(
        cap: Capacity, seen: Scrape | None, saturated: int | None, most: int | None,
        limit: int | None) -> None:
    got = learn(cap, seen)
    assert (got.saturated, got.most_running, got.seq_limit) == (saturated, most, limit)


@pytest.mark.parametrize(("ts", "saturated"), [
    (2.5, 4),  # the queue seen at the fold before, 1.5 s ago: held SATURATION_S since 0.5
    (16.0, 4),  # 15 s after the last fold: still a pair (the bound is inclusive)
    (16.5, None),  # farther apart than a scrape stays fresh: scrapes unseen in between
])
def test_a_queue_is_one_queue_only_across_folds_at_most_max_gap_s_apart(
        ts: float, saturated: int | None) -> None:
    got = learn(Capacity(1.0, None, 4, 4, 0.5), scrape(ts=ts, running=4, waiting=1), 15.0)
    assert got.saturated == saturated
    assert got.queued_since == (0.5 if saturated else ts)  # unseen: its time starts again


SAT = Capacity(0.0, 4, 4)


@pytest.mark.parametrize(("seen", "own", "now", "expect"), [
    (None, 3, 10.0, EngineView("gateway", None, None, None, None, 4)),
    # 2 running when asked (both this gateway's), 2 sent since: 4 now
    (scrape(running=2, own=2, kv=0.5), 4, 1.0, EngineView("engine", 1.0, 4.0, 0.0, 0.5, 4)),
    # 4 running, 2 waiting when asked; one finished since: 5 there, 1 waiting
    (scrape(running=4, waiting=2, own=6), 5, 1.0, EngineView("engine", 1.0, 5.0, 1.0, None, 4)),
    # another client's 3 requests run there too
    (scrape(running=3, own=0), 1, 0.5, EngineView("engine", 0.5, 4.0, 0.0, None, 4)),
    # never below what this gateway has there now
    (scrape(running=0, own=0), 3, 0.5, EngineView("engine", 0.5, 3.0, 0.0, None, 4)),
    # the bound is inclusive; past it the scrape is not used, its KV usage neither
    (scrape(running=4, waiting=9, kv=0.98), 0, 3.0,
     EngineView("engine", 3.0, 13.0, 9.0, 0.98, 4)),
    (scrape(running=4, waiting=9, kv=0.98), 0, 3.01,
     EngineView("gateway", 3.01, None, None, None, 4)),
    # dated after now (the wall clock stepped back since): stale, not age 0 for ever
    (scrape(running=4, waiting=9, kv=0.98), 0, -0.5,
     EngineView("gateway", -0.5, None, None, None, 4)),
    (scrape(running=None, waiting=None, kv=0.98), 0, 0.0,
     EngineView("gateway", 0.0, None, None, None, 4)),
    (scrape(running=1, kv=math.nan, own=1), 1, 0.0,
     EngineView("engine", 0.0, 1.0, 0.0, None, 4)),
])
def test_a_scrape_is_read_with_what_the_gateway_sent_since_and_ages_out(
        seen: Scrape | None, own: int, now: float, expect: EngineView) -> None:
    assert view(seen, SAT, own, now, max_age_s=3.0) == expect


LIMITS = RoomLimits(math.inf, 1000, 0.9)
LOWER = reserved(LIMITS, 0.75, 0.5)


def load(in_flight: int = 1, healthy: bool = True, occupancy: float | None = None,
         waiting: float | None = None, seq: int | None = None, kv: float | None = None,
         queued: float = 0.0) -> ReplicaLoad:
    return ReplicaLoad("a", in_flight, queued, kv, 0, healthy, occupancy, waiting, seq)


@pytest.mark.parametrize(("ld", "limits", "room"), [
    (load(in_flight=0), LIMITS, True),  # idle and healthy: always
    (load(in_flight=0, healthy=False), LIMITS, False),  # down (or doubted): never
    (load(in_flight=0, occupancy=9, waiting=5, seq=4, kv=1.0), LIMITS, True),
    (load(in_flight=500), LIMITS, True),  # no cap, nothing known of the engine
    (load(occupancy=3, seq=4), LIMITS, True),  # one sequence free
    (load(occupancy=4, seq=4), LIMITS, False),  # every sequence taken
    (load(occupancy=3, seq=4), LOWER, False),  # the last one is high's
    (load(occupancy=2, seq=4), LOWER, True),
    # a request waiting in the engine closes no room by itself: what it waits for is a
    # sequence (the occupancy), KV blocks or a step's budget (the prefill room)
    (load(occupancy=2, waiting=1, seq=8), LIMITS, True),
    (load(occupancy=8, waiting=3, seq=8), LIMITS, False),  # waiting for a sequence
    (load(in_flight=4, seq=4), LIMITS, False),  # stale scrape: own count against its limit
    (load(in_flight=3, seq=4), LIMITS, True),
    (load(occupancy=2, seq=256, kv=0.95), LIMITS, False),  # fresh KV usage
    (load(in_flight=3, occupancy=3), RoomLimits(3, 1000, 0.9), False),  # the optional cap
    (load(queued=1000), LIMITS, False),
])
def test_room_from_the_engines_figures(ld: ReplicaLoad, limits: RoomLimits,
                                       room: bool) -> None:
    assert has_room(ld, limits) is room


@pytest.mark.parametrize(("sent", "waiting", "n"), [
    (5, 0, 5), (5, 2, 3), (5, 9, 0), (0, 0, 0), (3, None, 0), (3, math.nan, 0),
    (3, -1, 0), (3, math.inf, 0), (4, 1.5, 3),
])
def test_a_scrape_shows_which_requests_left_the_engines_queue(
        sent: int, waiting: float | None, n: int) -> None:
    assert began(sent, waiting) == n


# in process: a Gate with a Fleet ------------------------------------------------------------

class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def world(**cfg: Any) -> tuple[Gate, Router, Fleet, Clock, list[str]]:
    routing = RoutingConfig()
    router = Router(routing)
    fleet = Fleet([ReplicaSettings(name=n, url=f"http://{n}:8000", models=("m",))
                   for n in ("a", "b")])
    for r in fleet.replicas.values():
        r.healthy = True
    clock = Clock()
    suspected: list[str] = []
    g = Gate(AdmissionConfig(enabled=True, recheck_s=0.001, **cfg), routing, router,
             GatewayMetrics(), clock, clock, fleet=fleet, scrape_interval_s=1.0,
             suspect=lambda r: suspected.append(r.name))
    return g, router, fleet, clock, suspected


def ask(text: str) -> Ask:
    return Ask({"model": "m", "messages": [{"role": "user", "content": text}]}, "chat", "m",
               None, None, None, None, 0.0)


def snap(clock: Clock, running: float, waiting: float = 0.0,
         kv: float | None = None) -> EngineSnapshot:
    return EngineSnapshot(clock.t, kv, running, waiting, None, None, None, None, None, None)


async def busy(g: Gate, fleet: Fleet, name: str, n: int) -> list[Ticket]:
    """`n` requests admitted to replica `name` alone and started there."""
    r = fleet.replicas[name]
    out = [await g.admit(ask(f"{name} busy {i}"), [r]) for i in range(n)]
    r.in_flight += n
    return out


def test_a_waiter_goes_to_the_replica_that_came_up_not_the_one_that_went_down() -> None:
    async def run() -> list[str]:
        g, _, fleet, clock, _ = world(replica_max_in_flight=1)
        a, b = fleet.replicas["a"], fleet.replicas["b"]
        b.healthy = False  # down at the start
        held = await busy(g, fleet, "a", 1)
        waiters = [asyncio.create_task(g.admit(ask(f"w{i}"), [a])) for i in range(2)]
        await asyncio.sleep(0.01)
        assert g.stats()["queued"]["normal"] == 2
        b.healthy = True  # came up while they waited: it serves one (once waiting for
        await asyncio.sleep(0.01)  # ... a, which holds the template's blocks, is not
        clock.t += 2.5  # ... worth it: own_replica_max_wait_s)
        first = await asyncio.wait_for(asyncio.shield(waiters[0]), 5)
        a.healthy = False  # went down while the other waited; its request ends
        a.in_flight -= 1
        held[0].plan.outcome.prompt_tokens = 8
        g.done(held[0])
        await asyncio.sleep(0.02)
        assert not waiters[1].done()  # a has room (nothing in flight) but is down
        first.plan.outcome.prompt_tokens = 8  # answered: b is not doubted
        g.done(first)
        second = await asyncio.wait_for(waiters[1], 5)
        await g.aclose()
        return [first.plan.decision.replica, second.plan.decision.replica]
    assert asyncio.run(run()) == ["b", "b"]


def test_a_replica_a_request_left_unanswered_waits_for_a_good_probe() -> None:
    async def run() -> None:
        g, _, fleet, clock, suspected = world(replica_max_in_flight=1)
        a = fleet.replicas["a"]
        fleet.replicas["b"].healthy = False
        (held,) = await busy(g, fleet, "a", 1)
        waiter = asyncio.create_task(g.admit(ask("w"), [a]))
        await asyncio.sleep(0.01)
        a.in_flight -= 1  # its request ends with no answer (refused, broken)
        g.done(held)
        await asyncio.sleep(0.02)
        assert suspected == ["a"] and not waiter.done()  # probed now, nothing sent
        clock.t += 0.5
        fleet.probe_result("a", True, clock.t)  # the probe succeeds: a is fine
        ticket = await asyncio.wait_for(waiter, 5)
        assert ticket.plan.decision.replica == "a"
        await g.aclose()
    asyncio.run(run())


def test_a_stale_scrape_stops_throttling_the_gate() -> None:
    """KV usage 0.98 at the last good scrape: no room while it is fresh; once older than
    stale_after_scrapes intervals it is not used and the replica takes requests again."""
    async def run() -> tuple[int, int]:
        g, _, fleet, clock, _ = world()
        g.classes.admitted("high", clock.t)  # a `high` lately: a full cache holds `normal`
        a = fleet.replicas["a"]
        fleet.replicas["b"].healthy = False
        (held,) = await busy(g, fleet, "a", 1)
        fleet.set_snapshot("a", snap(clock, running=1, kv=0.98), clock.t, 1)
        waiters = [asyncio.create_task(g.admit(ask(f"w{i}"), [a])) for i in range(3)]
        await asyncio.sleep(0.02)
        fresh = 3 - g.stats()["queued"]["normal"]
        assert g.stats()["replicas"]["a"]["source"] == "engine"
        clock.t += 3.5  # 3 scrape intervals of 1 s, and more, without a good scrape
        g._dispatch()
        await asyncio.wait_for(asyncio.gather(*waiters), 5)
        stale = g.stats()["replicas"]["a"]
        assert stale["source"] == "gateway" and stale["snapshot_age_s"] == 3.5
        g.done(held)
        await g.aclose()
        return fresh, 3
    assert asyncio.run(run()) == (0, 3)


def test_a_scrape_with_an_empty_engine_queue_ends_a_non_streamed_requests_prefill() -> None:
    """Two requests sent, a long one then a short one; a scrape shows one waiting: the
    younger (short) one still waits, the long one has begun, and its prefill ends once it
    has had its prefill time at the engine's rate since that scrape (begun is not
    prefilled); then none waits, and the short one's ends after its own."""
    async def run() -> tuple[float, float, float, float, float]:
        g, router, fleet, clock, _ = world()
        fleet.replicas["b"].healthy = False
        a = fleet.replicas["a"]
        def now(a_: Ask) -> Ask:  # sent at the router's clock (no scrape yet: the cost
            return dataclasses.replace(a_, ts=clock.t)  # model counts from there)
        tickets = [await g.admit(now(ask("a long prompt " * 200)), [a])]
        long = router.queued_tokens("a")
        tickets.append(await g.admit(now(ask("short")), [a]))
        short = router.queued_tokens("a") - long
        a.in_flight = 2
        queued = router.queued_tokens("a")
        clock.t += 0.1
        # asked for after both were sent: one runs, one still waits in the engine
        fleet.set_snapshot("a", snap(clock, running=1, waiting=1), clock.t, 2)
        g._load(a)
        begun = router.queued_tokens("a", clock.t)  # the long one began: not prefilled
        clock.t += long * router.config.prefill_s_per_token + 1e-6  # its prefill's time
        partly = router.queued_tokens("a", clock.t)
        fleet.set_snapshot("a", snap(clock, running=2, waiting=0), clock.t, 2)
        g._load(a)
        clock.t += short * router.config.prefill_s_per_token + 1e-6
        done = router.queued_tokens("a", clock.t)
        for t in tickets:
            g.done(t)
        await g.aclose()
        return queued, short, begun, partly, done
    queued, short, begun, partly, done = asyncio.run(run())
    assert queued > 10 * short > 0 and begun == queued and partly == short and done == 0


def test_a_prompt_larger_than_the_room_waits_its_turn() -> None:
    """One long prompt queued on `a` (more than the 16k-token room `normal` sees): a
    prompt longer than what is queued there waits as a short one does, for the long one
    to be prefilled (the room is not raised to the waiting prompt's own size: a large prompt
    would overtake the smaller ones before it, which waited to their class's limit on the
    Mooncake trace, issue 36); then both go, first come first served."""
    async def run() -> None:
        g, router, fleet, clock, _ = world()
        a = fleet.replicas["a"]
        fleet.replicas["b"].healthy = False
        def at(text: str) -> Ask:  # sent now: no estimate ends its prefill yet
            return dataclasses.replace(ask(text), ts=clock.t)
        held = await g.admit(at("long " + "x" * 100_000), [a])
        a.in_flight += 1
        queued = router.queued_tokens("a")
        assert queued > 16_384  # full for the room alone
        assert router.largest_by_replica()["a"] == pytest.approx(queued)
        seen = FleetView(fleet, router, clock, 3.0, None).load(a, 1)
        assert seen.largest_prompt_tokens == pytest.approx(queued)
        assert seen.prefill_s_per_token is None  # no scrape has shown a rate yet
        short = asyncio.create_task(g.admit(at("short"), [a]))
        longer = asyncio.create_task(g.admit(at("longer " + "y" * 150_000), [a]))
        for _ in range(50):  # bounded: until both wait in the gate
            if g.stats()["queued"]["normal"] >= 2:
                break
            await asyncio.sleep(0.001)
        assert not short.done() and not longer.done()
        # a scrape shows the engine's queue empty: the long one began, and once it has
        # had its prefill time since (begun is not prefilled: ledger.py), both go
        clock.t += 0.1
        fleet.set_snapshot("a", snap(clock, running=2), clock.t, 2)
        g._dispatch()
        assert not short.done() and not longer.done()
        clock.t += queued * router.config.prefill_s_per_token + 0.01
        first = await asyncio.wait_for(short, 5)
        ticket = await asyncio.wait_for(longer, 5)
        assert first.plan.decision.replica == ticket.plan.decision.replica == "a"
        g.done(first)
        for t in (held, ticket):
            g.done(t)
        await g.aclose()
    asyncio.run(run())


def test_the_prefill_rate_is_read_from_the_engines_scrapes() -> None:
    """Two scrapes 1 s apart, requests waiting at both, 6,000 prompt tokens computed
    between them (2,000 more were cache hits): 6,000 tokens a second."""
    _, router, fleet, clock, _ = world()
    a = fleet.replicas["a"]
    view_ = FleetView(fleet, router, clock, 3.0, None)
    for prompt, hits in ((10_000.0, 1_000.0), (18_000.0, 3_000.0)):
        fleet.set_snapshot("a", EngineSnapshot(clock.t, None, 4, 2, None, hits, prompt, None,
                                               None, None), clock.t, 0)
        seen = view_.load(a, 0)
        clock.t += 1.0
    assert seen.prefill_s_per_token == pytest.approx(1 / 6_000)
    assert view_.stats()["a"]["prefill_tokens_per_s"] == 6_000
    view_.forget("a")
    assert "a" not in view_.stats()
