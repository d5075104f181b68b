"""The admission queue in process (a real Router, no network), what a wait is worth: a
follow-up's wait for its own replica against moving, `high` beside the queued prefill
that holds `normal`, waiters of a class with no room anywhere, a tenant's share, the
projected wait at the fleet's prefill rate, a follow-up past the room."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
from collections import deque
from typing import Any

import pytest

from gateway.admission.config import AdmissionConfig
from gateway.admission.gate import Ask, Gate
from gateway.routing.config import RoutingConfig
from gateway.routing.router import Router
from gateway.usage.metrics import GatewayMetrics
from tests.gate_builders import Clock, ask, gate, gate_with, replica


class Manual:
    """A timer the test moves."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_time_waited_with_no_room_anywhere_does_not_push_a_follow_up_off_its_replica() -> None:
    """A follow-up that waited 5 s while every replica was full still waits for its own
    (a short wait there, cheaper than re-prefilling its history) when another frees."""
    history = "the conversation so far " * 80

    async def run() -> str:
        routing = RoutingConfig()
        router = Router(routing)
        timer = Manual()
        g = Gate(AdmissionConfig(enabled=True, replica_max_in_flight=1, recheck_s=0.001),
                 routing, router, GatewayMetrics(), Clock(), timer)
        fleet = [replica("a"), replica("b")]
        held = await g.admit(ask(history), fleet)
        own = next(r for r in fleet if r.name == held.plan.decision.replica)
        other = next(r for r in fleet if r is not own)
        own.in_flight += 1
        busy = await g.admit(ask("something else entirely " * 40), [other])
        other.in_flight += 1
        follow = asyncio.create_task(g.admit(ask(history + " and one more turn"), fleet))
        await asyncio.sleep(0.01)
        timer.t += 5.0  # nobody had room all that time
        other.in_flight -= 1
        g.done(busy)
        await asyncio.sleep(0.02)
        assert not follow.done()  # waits for its own, though the other has room
        own.in_flight -= 1
        g.done(held)
        ticket = await asyncio.wait_for(follow, 5)
        await g.aclose()
        return "own" if ticket.plan.decision.replica == own.name else "moved"
    assert asyncio.run(run()) == "own"


def test_high_is_not_held_for_queued_prefill_that_holds_normal() -> None:
    async def run() -> tuple[bool, bool]:
        routing = RoutingConfig()
        g = Gate(AdmissionConfig(enabled=True, replica_max_in_flight=4,
                                 replica_max_queued_prefill_tokens=10,
                                 default_priority_cap="high", recheck_s=0.001),
                 # the wall clock stands still: no figure from an engine, so the cost
                 # model would end the held prompt's prefill as time passed
                 routing, Router(routing), GatewayMetrics(), lambda: 0.0, Clock())
        fleet = [replica("a")]
        held = await g.admit(ask("a long prompt with no first token yet " * 60), fleet)
        fleet[0].in_flight += 1  # 1 of 4 sequences, ~400 prefill tokens queued (> 10)
        normal = asyncio.create_task(g.admit(ask("normal " * 20), fleet))
        high = asyncio.create_task(g.admit(ask("high " * 20, "high"), fleet))
        await asyncio.sleep(0.02)
        got = (high.done() and not high.exception(), normal.done())
        normal.cancel()
        await asyncio.gather(normal, return_exceptions=True)
        g.done(held)
        await g.aclose()
        return got
    assert asyncio.run(run()) == (True, False)


def test_waiters_of_a_class_with_no_room_anywhere_are_not_examined(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A replica with room for `high` only (in flight between the lower classes' share and
    the limit) does not make the dispatcher weigh every `normal` waiter each recheck: with
    a thousand waiters that scan was the gateway's main CPU cost under overload."""
    from gateway.admission.room import bind as real_bind

    calls = 0

    def counting_bind(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        return real_bind(*args, **kwargs)

    monkeypatch.setattr("gateway.admission.gate.bind", counting_bind)
    monkeypatch.setattr("gateway.admission.dispatch.bind", counting_bind)  # the dispatcher's

    async def run() -> None:
        g, _ = gate_with(AdmissionConfig(enabled=True, replica_max_in_flight=4,
                                         lower_class_room=0.5, default_priority_cap="high",
                                         recheck_s=0.001, max_queue=100))
        fleet = [replica("a")]
        fleet[0].in_flight = 3  # room for high (4), none for normal (2)

        async def one(i: int) -> None:
            g.done(await g.admit(ask(f"n{i}"), fleet))

        waiting = [asyncio.create_task(one(i)) for i in range(20)]
        await asyncio.sleep(0.05)  # dozens of rechecks
        assert g.stats()["queued"]["normal"] == 20
        assert calls == 0
        fleet[0].in_flight = 0
        g._dispatch()  # room again: the next recheck would do the same
        await asyncio.wait_for(asyncio.gather(*waiting), 5)
        await g.aclose()
    asyncio.run(run())


@pytest.mark.parametrize(("mine", "theirs", "owed"), [
    (0, 100, True), (10, 90, True), (35, 65, True),
    # near an even split one of two tenants is always a little below: not owed, or its
    # follow-ups would keep their place and leave their cache in every matching round
    (45, 55, False), (50, 50, False), (70, 30, False),
])
def test_a_tenant_is_owed_its_share_only_clearly_below_it(
        mine: float, theirs: float, owed: bool) -> None:
    g, _ = gate()  # over_share 1.25: owed below 0.5 / 1.25 = 0.4 of the class's tokens
    g._flows[("normal", "y")] = deque()  # y waits beside x: x's fair part is half
    g._recent.add(("normal", "x"), mine, 0.0)
    g._recent.add(("normal", "y"), theirs, 0.0)
    assert g._owed(("normal", "x"), 0.0) is owed


@pytest.mark.parametrize(("replicas", "shed"), [
    # six ~9k-token prompts waiting: ~55k tokens ahead of the last, 1.8 s at one
    # replica's cost-model rate (30k tokens/s) but 0.45 s at four's: a 1 s limit sheds
    # from the fourth on one replica only
    (1, 3),
    (4, 0),
])
def test_the_projected_wait_is_at_the_fleets_prefill_rate(replicas: int, shed: int) -> None:
    async def run() -> tuple[int, int]:
        g, _ = gate(normal_max_wait_s=1.0, max_queue=100)
        fleet = [replica(f"r{i}") for i in range(replicas)]
        for r in fleet:
            r.in_flight = 1  # no room anywhere: every arrival waits
        tasks = [asyncio.create_task(g.admit(ask(f"{i} " + "alpha beta " * 3300), fleet))
                 for i in range(6)]
        await asyncio.sleep(0)
        for _ in range(100):  # each arrival's verdict is taken in its first step
            if sum(t.done() for t in tasks) + g.stats()["queued"]["normal"] == 6:
                break
            await asyncio.sleep(0.001)
        result = g.stats()["shed"]["wait_limit"], g.stats()["queued"]["normal"]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await g.aclose()
        return result
    assert asyncio.run(run()) == (shed, 6 - shed)


def chat(*turns: str) -> Ask:
    roles = itertools.cycle(("user", "assistant"))
    body = {"model": "m", "messages": [{"role": r, "content": t}
                                       for r, t in zip(roles, turns, strict=False)]}
    return Ask(body, "chat", "m", None, None, None, b"normal", 0.0)


@pytest.mark.parametrize(("past_room", "goes"), [(2.0, True), (1.0, False)])
def test_a_follow_up_goes_to_its_own_replica_past_the_room(past_room: float,
                                                          goes: bool) -> None:
    """Its own replica is full by queued prefill alone (its turn 1 and another prompt
    not begun), the other is full with a long prompt that holds none of its history:
    it goes to its own at once (the engine queues it as long as the gateway would hold
    it) within `own_replica_past_room` times the room; at 1 it waits in the gateway."""
    async def run() -> tuple[bool, str | None, int]:
        routing = RoutingConfig()
        router = Router(routing)
        # the wall clock stands still: no engine figures and no estimate ends a prefill
        g = Gate(AdmissionConfig(enabled=True, replica_max_queued_prefill_tokens=2400,
                                 recheck_s=0.001, own_replica_past_room=past_room),
                 routing, router, GatewayMetrics(), lambda: 0.0, Clock())
        fleet = [replica("a"), replica("b")]
        by_name = {r.name: r for r in fleet}
        first = "the history of this conversation " * 120
        t1 = await g.admit(chat(first), fleet)
        own = t1.replica
        assert own is not None
        other = next(n for n in by_name if n != own)
        by_name[own].in_flight += 1
        # another prompt queued on its own replica, larger than its follow-up will be
        filler = dataclasses.replace(chat("unrelated filler text " * 200), pin=own)
        t2 = await g.admit(filler, [by_name[own]])
        by_name[own].in_flight += 1
        # and the other replica full with a longer prompt still
        t3 = await g.admit(chat("a long document about something else " * 400),
                           [by_name[other]])
        by_name[other].in_flight += 1
        follow = asyncio.create_task(g.admit(chat(first, "an answer", "and then?"), fleet))
        for _ in range(200):  # a few rechecks; bounded
            if follow.done():
                break
            await asyncio.sleep(0.001)
        went = follow.done()
        name = follow.result().replica if went else None
        queued = g.stats()["queued"]["normal"]
        follow.cancel()
        await asyncio.gather(follow, return_exceptions=True)
        for t in (t1, t2, t3):
            g.done(t)
        if went:
            g.done(follow.result())
        await g.aclose()
        return went, None if name is None else ("own" if name == own else "other"), queued
    went, where, queued = asyncio.run(run())
    assert (went, where, queued) == ((True, "own", 0) if goes else (False, None, 1))
