"""Review of bb0f9f7 (a streamed request's queued prefill ends at its first token, a begun
non-streamed one's at its prefill time since the scrape that showed it begun): what holds,
by tables on the router alone (time a parameter) and one in-process gate; and the two
defects it found, fixed since (Messages/Responses streams read as non-streamed; prompts
begun together each priced alone)."""

from __future__ import annotations

import asyncio
import dataclasses
import math
from collections.abc import Callable
from typing import Any

import pytest

from gateway.admission.gate import Ask
from gateway.proxy.errors import GatewayError
from gateway.proxy.inbound import chat_view, parse_inbound
from gateway.routing.config import RoutingConfig
from gateway.routing.decision import ReplicaState
from gateway.routing.plan import RoutePlan
from gateway.routing.router import Router
from tests.test_admission_engine import ask, snap, world

A = [ReplicaState(name="a", in_flight=0)]
AB = [ReplicaState(name="a", in_flight=0), ReplicaState(name="b", in_flight=0)]
RATE = 1e-4  # s per token: a 4k-token prompt prefills in 0.4 s


def body(text: str, **extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": text * 400}], **extra}


def sent(router: Router, text: str, stream: bool, now: float = 0.0,
         pin: str | None = "a") -> RoutePlan:
    extra = {"stream": True} if stream else {}
    return router.decide(body(text, **extra), "chat", "m", None, AB, now, pin=pin)


def pending(router: Router) -> int:
    return sum(len(p) for p in router._ledger.pending.values())


# what `streamed` is --------------------------------------------------------------------

@pytest.mark.parametrize(("extra", "streamed"), [
    ({"stream": True}, True), ({"stream": False}, False), ({}, False), ({"stream": None}, False),
])
def test_streamed_is_the_chat_bodys_boolean(extra: dict[str, Any], streamed: bool) -> None:
    for endpoint in ("chat", "completions"):
        b: dict[str, Any] = ({"model": "m", "prompt": "hi " * 50, **extra}
                             if endpoint == "completions" else body("hi ", **extra))
        kind, view = chat_view(endpoint, b)
        plan = Router(RoutingConfig(seed=0)).decide(view, kind, "m", None, A, 0.0)
        assert plan.streamed is streamed


@pytest.mark.parametrize("value", ["true", 1, "1", [True]])
def test_a_stream_that_is_no_boolean_is_refused_at_the_door(value: object) -> None:
    """No truthy string or number reaches the router to be read differently there."""
    raw = ('{"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": %s}'
           % (f'"{value}"' if isinstance(value, str) else str(value).lower())).encode()
    with pytest.raises(GatewayError):
        parse_inbound(raw, "chat")


@pytest.mark.parametrize(("endpoint", "b"), [
    ("messages", {"model": "m", "max_tokens": 8, "stream": True,
                  "messages": [{"role": "user", "content": "long " * 400}]}),
    ("responses", {"model": "m", "stream": True, "input": "long " * 400}),
])
def test_a_messages_or_responses_stream_is_streamed_to_the_router(
        endpoint: str, b: dict[str, Any]) -> None:
    kind, view = chat_view(endpoint, b)  # type: ignore[arg-type]
    plan = Router(RoutingConfig(seed=0)).decide(view, kind, "m", None, A, 0.0)
    assert plan.streamed


# a begun request's queued prefill ------------------------------------------------------

def test_a_begun_stream_stays_queued_until_its_first_token() -> None:
    router = Router(RoutingConfig(seed=0))
    plan = sent(router, "stream ", stream=True)
    full = router.queued_tokens("a")
    for k in range(5):  # scrapes showing it begun, the cost model's estimate, time
        router.engine_began("a", 1.0 + k, 0, RATE)
        router._ledger.estimate_began("a", 100.0 + k)
        assert router.queued_tokens("a", 100.0 + k) == full > 0
    plan.outcome.first_token_at = 200.0
    assert router.queued_tokens("a", 200.0) == 0 and not router._ledger.prefilled_by


def test_a_begun_non_streamed_request_ends_at_its_prefill_time_since_the_scrape() -> None:
    router = Router(RoutingConfig(seed=0))
    sent(router, "whole ", stream=False)
    full = router.queued_tokens("a")
    router.engine_began("a", 1.0, 0, RATE)
    end = 1.0 + full * RATE
    assert router.queued_tokens("a", end - 1e-3) == full
    assert router.queued_by_replica(end - 1e-3)["a"] == full
    router.engine_began("a", 2.0, 0, RATE)  # a later scrape does not push its end on
    assert router.queued_by_replica(end)["a"] == 0 and pending(router) == 0


def test_a_read_without_a_clock_is_settled_at_the_last_decision() -> None:
    router = Router(RoutingConfig(seed=0))
    sent(router, "whole ", stream=False, now=0.0)
    full = router.queued_tokens("a")
    router.engine_began("a", 1.0, 0, RATE)
    assert router.queued_tokens("a") == full  # last_settle 0.0: not by the clock
    assert router.queued_tokens("a", 1e6) == 0


@pytest.mark.parametrize("rate", [0.0, -1.0, math.nan, math.inf])
def test_a_corrupt_rate_is_the_cost_models(rate: float) -> None:
    """A rate no scrape could give is the cost model's: not ended at the scrape (the old
    behaviour), not queued to the answer's end (the one before it); never an error, never
    a leak."""
    router = Router(RoutingConfig(seed=0))
    plan = sent(router, "odd ", stream=False)
    router.engine_began("a", 1.0, 0, rate)
    assert router.queued_tokens("a", 1.0) > 0
    assert router.queued_tokens("a", 1.0 + plan.estimated_tokens
                                * router.config.prefill_s_per_token) == 0
    router.report(plan, 2.0)
    assert router.queued_tokens("a", 2.0) == 0 and not router._ledger.prefilled_by


def test_a_scrape_asked_for_in_the_future_or_an_older_clock_ends_nothing_early() -> None:
    router = Router(RoutingConfig(seed=0))
    sent(router, "skew ", stream=False)
    full = router.queued_tokens("a")
    router.engine_began("a", 50.0, 0, RATE)  # the request was sent before it: begun
    end = 50.0 + full * RATE
    assert router.queued_tokens("a", 10.0) == full
    assert router.queued_tokens("a", end) == 0
    assert router.queued_tokens("a", 10.0) == 0  # the clock back: nothing comes back


# prefilled_by's bounds: every way a pending entry ends ---------------------------------

def _report(r: Router, p: RoutePlan) -> None:
    r.report(p, 1.5)


def _retry(r: Router, p: RoutePlan) -> None:
    r.retried(p, "b", 1.5)


def _sweep(r: Router, p: RoutePlan) -> None:
    r.preview(body("other "), "chat", "m", None, AB, 1.5 + r.config.pending_ttl_s)


def _forget(r: Router, p: RoutePlan) -> None:
    r.remove_replica("a")


def _pd(r: Router, p: RoutePlan) -> None:
    r.prefilled_elsewhere(p)


def _estimate(r: Router, p: RoutePlan) -> None:
    r.estimate_began("a", 1e6)


@pytest.mark.parametrize("end", [_report, _retry, _sweep, _forget, _pd, _estimate])
def test_prefilled_by_goes_with_its_pending_entry(end: Callable[[Router, RoutePlan], None]
                                                  ) -> None:
    router = Router(RoutingConfig(seed=0))
    plan = sent(router, "ends ", stream=False)
    router.engine_began("a", 1.0, 0, RATE)
    assert plan in router._ledger.prefilled_by
    end(router, plan)
    assert plan not in router._ledger.prefilled_by
    assert router.queued_by_replica(1e6).get("a", 0.0) == 0


def test_a_request_moved_away_and_back_is_queued_afresh() -> None:
    """A begun-at-`a` time must not end the prefill of the same plan sent to `a` again."""
    router = Router(RoutingConfig(seed=0))
    plan = sent(router, "back ", stream=False)
    full = router.queued_tokens("a")
    router.engine_began("a", 1.0, 0, RATE)
    router.retried(plan, "b", 1.1)
    router.engine_began("b", 1.2, 0, RATE)
    router.retried(plan, "a", 1.3)
    assert router.queued_tokens("a", 1.0 + full * RATE + 1.0) == full
    assert router.queued_tokens("b", 1e6) == 0 and not router._ledger.prefilled_by


def test_a_pd_decode_leg_stays_unqueued_whatever_a_scrape_shows() -> None:
    router = Router(RoutingConfig(seed=0))
    plan = sent(router, "pd ", stream=True)
    router.prefilled_elsewhere(plan)
    router.engine_began("a", 1.0, 0, RATE)
    router.estimate_began("a", 2.0)
    assert router.queued_tokens("a", 3.0) == 0 and not router._ledger.prefilled_by


def test_a_hung_streams_prefill_is_queued_until_the_sweep() -> None:
    """A stream whose first byte never comes (a hung engine that still shows it running)
    holds its replica's queued prefill to pending_ttl_s, then the sweep ends it."""
    router = Router(RoutingConfig(seed=0))
    sent(router, "hung ", stream=True)
    full = router.queued_tokens("a")
    ttl = router.config.pending_ttl_s
    for k in range(10):
        router.engine_began("a", 1.0 + k * ttl / 10, 0, RATE)
    assert router.queued_tokens("a", ttl - 1.0) == full
    router.preview(body("other "), "chat", "m", None, AB, ttl + 1.0)  # sweeps
    assert router.queued_tokens("a") == 0 and pending(router) == 0


def test_a_thousand_in_flight_settle_in_one_pass_each() -> None:
    """settle and engine_began stay O(n) / O(n log n): a thousand begun requests, one
    scrape and one read end all whose time has come, in one pass."""
    router = Router(RoutingConfig(seed=0))
    for i in range(1000):
        sent(router, f"r{i} ", stream=bool(i % 2), pin="ab"[i % 2])
    for name in "ab":
        router.engine_began(name, 1.0, 0, 1e-9)
    assert len(router._ledger.prefilled_by) == 500
    left = router.queued_by_replica(2.0)
    assert left["a"] == 0 and left["b"] > 0 and not router._ledger.prefilled_by


# what the change's estimate misses -----------------------------------------------------

def test_non_streamed_prompts_begun_together_are_prefilled_one_after_another() -> None:
    router = Router(RoutingConfig(seed=0))
    first = sent(router, "first ", stream=False, now=0.0)
    sent(router, "second ", stream=False, now=0.1)
    sent(router, "third ", stream=False, now=0.2)
    each = first.estimated_tokens - first.predicted.get("a", 0)
    router.engine_began("a", 1.0, 0, RATE)  # all three past the engine's queue
    # the engine prefills them in turn: 1 + 3 * each * RATE before the third is done
    assert router.queued_tokens("a", 1.0 + 1.5 * each * RATE) > 0


# in process: the admission queue --------------------------------------------------------

def test_the_gate_holds_a_waiter_behind_a_begun_stream_until_its_first_token() -> None:
    """A long streamed prompt on `a` (more than the room) that a scrape shows begun keeps
    a short request waiting past its prefill time at the engine's rate: its first token,
    not the clock, lets the short one go."""
    async def run() -> None:
        g, router, fleet, clock, _ = world()
        a = fleet.replicas["a"]
        fleet.replicas["b"].healthy = False
        def at(a_: Ask, stream: bool) -> Ask:
            b = {**a_.body, "stream": True} if stream else a_.body
            return dataclasses.replace(a_, body=b, ts=clock.t)
        held = await g.admit(at(ask("long " + "x" * 100_000), True), [a])
        assert held.plan.streamed
        a.in_flight += 1
        queued = router.queued_tokens("a")
        assert queued > 16_384
        short = asyncio.create_task(g.admit(at(ask("short"), False), [a]))
        for _ in range(50):  # bounded: until it waits in the gate
            if g.stats()["queued"]["normal"] >= 1:
                break
            await asyncio.sleep(0.001)
        clock.t += 0.1
        fleet.set_snapshot("a", snap(clock, running=1), clock.t, 1)
        g._dispatch()
        clock.t += queued * router.config.prefill_s_per_token * 3 + 1.0
        g._dispatch()
        await asyncio.sleep(0)
        assert not short.done()
        held.plan.outcome.first_token_at = clock.t
        g._dispatch()
        ticket = await asyncio.wait_for(short, 5)
        assert ticket.plan.decision.replica == "a"
        for t in (held, ticket):
            g.done(t)
        await g.aclose()
    asyncio.run(run())


def test_an_arrival_after_a_begun_answers_prefill_time_goes_at_once() -> None:
    """The gate's first look (FleetView.load, no pass before it) reads queued prefill by
    the clock: a non-streamed prompt whose prefill time since the scrape has passed
    leaves room, and the next arrival is not queued."""
    async def run() -> float | None:
        g, router, fleet, clock, _ = world()
        a = fleet.replicas["a"]
        fleet.replicas["b"].healthy = False
        held = await g.admit(dataclasses.replace(ask("long " + "x" * 100_000), ts=clock.t),
                             [a])
        a.in_flight += 1
        queued = router.queued_tokens("a")
        assert queued > 16_384 and not held.plan.streamed
        clock.t += 0.1
        fleet.set_snapshot("a", snap(clock, running=1), clock.t, 1)
        g._load(a)  # the scrape read: begun
        clock.t += queued * router.config.prefill_s_per_token + 0.01
        ticket = await asyncio.wait_for(
            g.admit(dataclasses.replace(ask("short"), ts=clock.t), [a]), 5)
        for t in (held, ticket):
            g.done(t)
        await g.aclose()
        return ticket.queued_ms
    assert asyncio.run(run()) is None
