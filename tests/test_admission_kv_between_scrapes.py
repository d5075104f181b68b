"""Issue 36: the KV usage the queue reads between two scrapes moves with what this gateway
sent or finished there since (engine.py `view`, fleetview.py, the monitor's
`pinned_at_scrape`). A replica scraped at 0.98 (full for the queue) whose requests then
finish has room again at once, not only at the next scrape; one scraped at 0.5 that the
gateway has since sent prompts filling the rest of its cache has none."""

from __future__ import annotations

import asyncio
import contextlib
import socket

import httpx
import pytest

from gateway.admission.config import AdmissionConfig
from gateway.admission.engine import Capacity, Scrape, pinned_at_scrape, view
from gateway.admission.gate import Ask, Gate, Ticket
from gateway.replicas.fleet import Fleet
from gateway.routing.config import RoutingConfig
from gateway.routing.router import Router
from gateway.settings import ReplicaSettings
from gateway.usage.metrics import GatewayMetrics
from gateway.usage.snapshot import EngineSnapshot
from tests.servers import free_port, gateway
from tests.test_admission_faults import ENV, admission, ask, hold, replica_with, until

BLOCKS = 4000  # x 16 tokens: a 64,000-token KV cache
LONG = "lorem ipsum dolor sit amet " * 2200  # about 14k tokens by the router's estimate


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def snap(ts: float, kv: float, running: float, waiting: float = 0) -> EngineSnapshot:
    return EngineSnapshot(ts, kv, running, waiting, None, None, None, None, BLOCKS, 16)


def asked(text: str, ts: float) -> Ask:
    return Ask({"model": "m", "messages": [{"role": "user", "content": text}]}, "chat", "m",
               None, None, None, None, ts)


@pytest.mark.parametrize(("kv", "pinned_then", "pinned_now", "capacity", "expect"), [
    # 1,000 prompt tokens sent since a scrape at 0.5, of a 10,000-token cache: 0.6
    (0.5, 0.0, 1000.0, 10_000.0, 0.6),
    # its requests finished since a scrape at 0.98: their blocks are free, 0.58
    (0.98, 4000.0, 0.0, 10_000.0, 0.58),
    # one finished, two sent: the difference
    (0.7, 3000.0, 4000.0, 10_000.0, 0.8),
    (0.1, 5000.0, 0.0, 10_000.0, 0.0),  # never below 0 (other clients' requests ended too)
    (0.5, 0.0, 1000.0, None, 0.5),  # the cache's size unknown: as scraped
    (0.5, 0.0, 1000.0, 0.0, 0.5),
    (None, 0.0, 1000.0, 10_000.0, None),  # no usage exported: none
])
def test_kv_usage_moves_with_what_the_gateway_sent_or_finished_since_the_scrape(
        kv: float | None, pinned_then: float, pinned_now: float, capacity: float | None,
        expect: float | None) -> None:
    seen = Scrape(0.0, 2, 0, kv, 2, pinned_then)
    got = view(seen, Capacity(0.0, 4, 4), 2, 1.0, max_age_s=3.0, pinned_now=pinned_now,
               capacity_tokens=capacity).kv_usage
    assert got == (None if expect is None else pytest.approx(expect))


@pytest.mark.parametrize(("prompts", "waiting", "swept", "kv", "pinned"), [
    ([(1.0, 100.0), (2.0, 200.0), (3.0, 400.0)], 0, 0.0, 0.95, 700.0),  # all running
    # one waits in the engine beside a nearly full cache: the youngest (first come, first
    # served), waiting for blocks; it holds none, and takes those the next finish frees
    ([(3.0, 400.0), (1.0, 100.0), (2.0, 200.0)], 1, 0.0, 0.95, 300.0),
    # ... below 0.9 it waits for a step's budget or a sequence, not for blocks: counted
    ([(3.0, 400.0), (1.0, 100.0), (2.0, 200.0)], 1, 0.0, 0.89, 700.0),
    ([(3.0, 400.0), (1.0, 100.0), (2.0, 200.0)], 1, 0.0, None, 700.0),
    ([(1.0, 100.0), (2.0, 200.0)], 5, 0.0, 0.99, 0.0),  # others' wait too: none held
    ([(1.0, 100.0)], None, 0.0, 0.99, 100.0),  # no waiting count exported: all
    ([(1.0, 100.0)], float("nan"), 0.0, 0.99, 100.0),
    ([(1.0, 100.0)], 0, 50.0, 0.5, 150.0),  # the sweep's forgotten, counted as still there
    ([], 3, 0.0, 0.99, 0.0),
])
def test_what_held_kv_blocks_when_a_scrape_was_asked_for(
        prompts: list[tuple[float, float]], waiting: float | None, swept: float,
        kv: float | None, pinned: float) -> None:
    assert pinned_at_scrape(prompts, waiting, swept, kv) == pinned


def run(scraped_kv: float, finish: int, before: bool = False,
        high_lately: bool = True) -> tuple[bool, float | None]:
    """Two ~14k-token prompts sent to `a`; a scrape then shows `scraped_kv` (asked for
    with both in flight, as the monitor asks; `before`: asked for before they were sent);
    `finish` of them end; does a third go at once, and what KV usage does the queue read?
    `high_lately`: a `high` request came just before, so a full cache holds the `normal`
    third (room.py, "The KV usage steers, and holds none"); without one it only steers,
    and the third goes to the one replica's engine queue."""
    async def go() -> tuple[bool, float | None]:
        routing = RoutingConfig()
        router = Router(routing)
        fleet = Fleet([ReplicaSettings(name="a", url="http://a:8000", models=("m",))])
        a = fleet.replicas["a"]
        a.healthy = True
        clock = Clock()
        g = Gate(AdmissionConfig(enabled=True), routing, router, GatewayMetrics(), clock,
                 clock, fleet=fleet, scrape_interval_s=5.0)
        if high_lately:
            g.classes.admitted("high", clock.t)  # a `high` routed or queued (classroom.py)
        fleet.set_snapshot("a", snap(clock.t, scraped_kv if before else 0.0, 0), clock.t, 0,
                           0.0)
        tickets: list[Ticket] = []
        for i in range(2):
            tickets.append(await g.admit(asked(f"{i} {LONG}", clock.t), [a]))
            a.in_flight += 1
        clock.t += 1.0
        if not before:  # the scrape, asked for with both in flight
            fleet.set_snapshot("a", snap(clock.t, scraped_kv, 2), clock.t, a.in_flight,
                               pinned_at_scrape(router.live_prompts("a"), 0))
        router.engine_began("a", clock.t, 0, 1e-9)  # begun, prefilled at once: none queued
        clock.t += 0.1
        for t in tickets[:finish]:
            router.report(t.plan, clock.t)
            a.in_flight -= 1
            g.done(t)
        third = asyncio.create_task(g.admit(asked(f"third {LONG}", clock.t), [a]))
        try:
            await asyncio.sleep(0)
            went = third.done() and third.exception() is None
            kv = g.stats()["replicas"]["a"]["kv_usage"]
        finally:
            third.cancel()
            await asyncio.gather(third, return_exceptions=True)
            await g.aclose()
        return went, kv
    return asyncio.run(go())


def test_a_replica_whose_requests_finished_since_a_full_scrape_has_room_at_once() -> None:
    """Mutation caught: `view` reading the scraped KV usage as it is (the third waits for
    the next scrape, seconds, beside an engine with nothing running)."""
    went, kv = run(0.98, finish=2)
    assert went
    assert kv is not None and kv < 0.6  # 0.98 less two ~14k-token prompts of 64k


def test_a_replica_still_full_stays_full() -> None:
    """The same scrape with both requests still there: no room (the control)."""
    went, kv = run(0.98, finish=0)
    assert not went
    assert kv is not None and kv >= 0.97


def test_a_full_cache_with_no_high_lately_only_steers() -> None:
    """The same with no `high` request lately: the one replica's cache is full, it has
    room by every other limit and nothing sent there waits to begin, so the third goes
    to its engine's queue (room.py, "The KV usage steers, and holds none")."""
    went, kv = run(0.98, finish=0, high_lately=False)
    assert went
    assert kv is not None and kv >= 0.97


def test_prompts_sent_since_a_scrape_fill_the_cache_it_showed_half_empty() -> None:
    """Scraped at 0.55 before the two were sent: ~28k of the 64k-token cache sent since
    reads 0.99, full. Mutation caught: the scraped usage as it is (0.55: the third goes,
    and in the engine waits for blocks)."""
    went, kv = run(0.55, finish=0, before=True)
    assert not went
    assert kv is not None and kv >= 0.97


def test_the_monitor_counts_the_prompts_in_flight_at_each_scrape() -> None:
    """On loopback: a real `gateway sim` replica (a 8,192-token KV cache) and a gateway,
    queue on. Two held streams of ~1,800-token prompts; once a scrape shows them running,
    the KV usage the queue reads is the scraped one (what was in flight when the scrape
    was asked for is in it, not added again). Mutation caught: the monitor recording no
    prompt tokens at the scrape (`pinned` 0: the queue reads both prompts twice, ~0.44
    more, and a replica with room as full)."""
    with contextlib.ExitStack() as stack:
        a, _ = stack.enter_context(replica_with(free_port(), ["--kv-blocks", "512"]))
        url = stack.enter_context(gateway([a], env=ENV))
        holders: list[socket.socket] = []
        stack.callback(lambda: [s.close() for s in holders])
        holders.extend(hold(url, f"holder {i} says " * 450) for i in range(2))

        def scraped_running() -> float | None:
            (rep,) = httpx.get(url + "/stats", timeout=10).json()["replicas"].values()
            ok = rep.get("requests_running") == 2 and (rep.get("kv_cache_usage") or 0) > 0.3
            return float(rep["kv_cache_usage"]) if ok else None

        until(lambda: scraped_running() is not None)
        assert ask(url, 0)[0] == 200  # an arrival: the queue reads the replica's load
        (view,) = admission(url)["replicas"].values()
        scraped = scraped_running()
        assert scraped is not None and view["kv_usage"] is not None
        # the scrape it read may be one earlier or later than this one: a few blocks
        assert abs(view["kv_usage"] - scraped) < 0.1, (view, scraped)
