"""Begun is not prefilled (gateway/routing/ledger.py): a request's uncached prompt counts
as queued prefill on its replica until its first token; a scrape that shows it out of the
engine's waiting queue ends a non-streamed one's (its first byte is its last) only once its
prefill has had time at the engine's rate since, and a streamed one's not at all. Before,
the scrape ended both at once: with the admission queue on, a replica that had just begun
a 114k-token prompt read as free to the queue's room and to the router's cost, which sent
short requests there to wait 10-15 s behind it (the Mooncake trace, issue 36); with the
queue off no scrape ended any, so the router saw another fleet with the queue on."""

from __future__ import annotations

import asyncio
import math

import pytest

from gateway.admission.config import AdmissionConfig
from gateway.admission.gate import Ask, Gate
from gateway.replicas.fleet import Fleet
from gateway.routing.config import RoutingConfig
from gateway.routing.decision import ReplicaState
from gateway.routing.router import Router
from gateway.settings import ReplicaSettings
from gateway.usage.metrics import GatewayMetrics
from gateway.usage.snapshot import EngineSnapshot

ONE = [ReplicaState(name="a", in_flight=0)]
TEXT = "tell me about prefix caching " * 40
RATE = 1e-3  # seconds per prefilled token: the engine's, as the fleet view passes it


def body(stream: object) -> dict[str, object]:
    b: dict[str, object] = {"messages": [{"role": "user", "content": TEXT}]}
    if stream is not None:
        b["stream"] = stream
    return b


def sent(router: Router, stream: object, at: float = 0.0) -> float:
    """One request sent to `a` at `at`; its queued prefill tokens."""
    before = router.queued_tokens("a", at)
    router.decide(body(stream), "chat", "m", None, ONE, at)
    return router.queued_tokens("a", at) - before


# stream flag, seconds after the scrape (in prefill times of the prompt), still queued
CASES = [
    (True, 0.0, True),     # streamed: only its first token ends it
    (True, 10.0, True),
    (None, 0.0, True),     # non-streamed, just begun: its prefill is under way
    (False, 0.5, True),
    (False, 1.01, False),  # its prefill's time has passed since the scrape
    (None, 10.0, False),
    ("true", 10.0, False),  # only JSON true asks for a stream (the engine's reading)
    (1, 10.0, False),
]


@pytest.mark.parametrize(("stream", "after", "queued"), CASES)
def test_a_scrape_that_shows_a_request_begun(stream: object, after: float,
                                             queued: bool) -> None:
    router = Router(RoutingConfig(seed=0))
    tokens = sent(router, stream)
    assert tokens > 0
    router.engine_began("a", 1.0, 0, RATE)  # asked at 1 s: nothing waits in the engine
    left = router.queued_tokens("a", 1.0 + after * tokens * RATE)
    assert (left == pytest.approx(tokens)) if queued else left == 0


def test_a_waiting_request_stays_queued_whatever_the_time() -> None:
    """The scrape shows one waiting: the younger of two has not begun, so no prefill time
    runs for it (first come, first served, as vLLM admits)."""
    router = Router(RoutingConfig(seed=0))
    first = sent(router, None, 0.0)
    second = sent(router, None, 0.1)
    router.engine_began("a", 1.0, 1, RATE)
    assert router.queued_tokens("a", 1e6) == pytest.approx(second)
    assert first > 0


def test_a_streamed_request_ends_at_its_first_token() -> None:
    router = Router(RoutingConfig(seed=0))
    first = sent(router, True)
    router.engine_began("a", 1.0, 0, RATE)
    second = router.decide(body(True), "chat", "m", None, ONE, 1.1)
    assert router.queued_tokens("a", 1.1) > first
    second.outcome.first_token_at = 1.2
    # the second's first token ends its own prefill, not the first's (begun, streamed)
    assert router.queued_tokens("a", 1.3) == pytest.approx(first)


@pytest.mark.parametrize(("stream", "queued"), [(True, True), (None, False)])
def test_without_engine_figures_the_estimate_ends_only_a_non_streamed_prefill(
        stream: object, queued: bool) -> None:
    """No running/waiting figures (llama.cpp): the cost model's first-come estimate ends a
    non-streamed request's prefill; it would end a streamed one's early when it waited
    behind others, so that one ends at its first token."""
    router = Router(RoutingConfig(seed=0))
    tokens = sent(router, stream)
    late = 10.0 * tokens * router.config.prefill_s_per_token
    router.estimate_began("a", late)
    left = router.queued_tokens("a", late)
    assert (left == pytest.approx(tokens)) if queued else left == 0


def test_a_later_scrape_does_not_push_the_end_back() -> None:
    router = Router(RoutingConfig(seed=0))
    tokens = sent(router, None)
    router.engine_began("a", 1.0, 0, RATE)
    router.engine_began("a", 1.0 + tokens * RATE / 2, 0, RATE)  # the next scrape
    assert router.queued_tokens("a", 1.0 + tokens * RATE * 1.01) == 0


@pytest.mark.parametrize("rate", [0.0, -1.0, math.nan, math.inf])
def test_an_odd_rate_never_keeps_a_request_queued_for_ever_nor_raises(rate: float) -> None:
    router = Router(RoutingConfig(seed=0))
    sent(router, None)
    router.engine_began("a", 1.0, 0, rate)
    # no positive finite rate: the cost model's
    assert router.queued_tokens("a", 1e6) == 0


def test_what_a_departed_replica_had_begun_is_forgotten_with_it() -> None:
    router = Router(RoutingConfig(seed=0))
    sent(router, None)
    router.engine_began("a", 1.0, 0, RATE)
    assert len(router._ledger.prefilled_by) == 1  # the bound: one per begun request
    router.remove_replica("a")
    assert not router._ledger.prefilled_by


# -- through the admission queue: the Mooncake pattern, with the queue on and off ---------

class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def chat(text: str, ts: float) -> Ask:
    return Ask({"model": "m", "stream": True, "messages": [{"role": "user", "content": text}]},
               "chat", "m", None, None, None, None, ts)


@pytest.mark.parametrize("enabled", [True, False])
def test_a_short_request_is_not_sent_behind_a_long_prefill_just_begun(enabled: bool) -> None:
    """`a` has begun a long streamed prompt (a scrape shows it running, nothing waiting);
    `b` has a short one queued. A short request arrives for either: it goes to `b`, with
    the queue on as with it off (before, the scrape ended the long prompt's queued
    prefill at once, and with the queue on `a` read as free)."""
    async def run() -> str:
        routing = RoutingConfig(seed=0)
        router = Router(routing)
        fleet = Fleet([ReplicaSettings(name=n, url=f"http://{n}:8000", models=("m",))
                       for n in ("a", "b")])
        for r in fleet.replicas.values():
            r.healthy = True
        clock = Clock()
        g = Gate(AdmissionConfig(enabled=enabled, recheck_s=0.001), routing, router,
                 GatewayMetrics(), clock, clock, fleet=fleet, scrape_interval_s=1.0)
        a, b = fleet.replicas["a"], fleet.replicas["b"]
        try:
            long = await g.admit(chat("long " + "x" * 120_000, clock.t), [a])
            a.in_flight += 1
            short = await g.admit(chat("short " + "y" * 4_000, clock.t), [b])
            b.in_flight += 1
            clock.t += 0.1
            for r, running in ((a, 1), (b, 0)):  # `b`'s still waits in its engine
                fleet.set_snapshot(r.name, EngineSnapshot(clock.t, 0.1, running, 1 - running,
                                                          None, None, None, None, None, None),
                                   clock.t, 1)
            clock.t += 0.05  # the queue's next look reads both scrapes (on only)
            ticket = await asyncio.wait_for(g.admit(chat("next " + "z" * 2_000, clock.t),
                                                    [a, b]), 5)
            for t in (long, short, ticket):
                g.done(t)
            return ticket.plan.decision.replica
        finally:
            await g.aclose()
    assert asyncio.run(run()) == "b"
