"""The admission queue in process (a real Router, replicas as the fleet holds them, no
network): who goes first when room frees, displacement, the tenant share, the router's
bookkeeping of a released ticket."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
from collections import deque
from typing import Any

import pytest

from gateway.admission.config import AdmissionConfig
from gateway.admission.gate import Ask, Gate, Ticket
from gateway.admission.shedding import Shed
from gateway.replicas.fleet import Replica
from gateway.routing.config import RoutingConfig
from gateway.routing.router import Router
from gateway.settings import ReplicaSettings
from gateway.usage.metrics import GatewayMetrics


def replica(name: str) -> Replica:
    return Replica(settings=ReplicaSettings(name=name, url=f"http://{name}:8000"), healthy=True)


class Clock:
    def __init__(self) -> None:
        self.t = itertools.count()

    def __call__(self) -> float:
        return float(next(self.t)) * 0.001


def gate(**cfg: Any) -> tuple[Gate, Router]:
    routing = RoutingConfig()
    router = Router(routing)
    config = AdmissionConfig(enabled=True, replica_max_in_flight=1,
                             default_priority_cap="high", recheck_s=0.001, **cfg)
    return Gate(config, routing, router, GatewayMetrics(), Clock(), Clock()), router


def ask(text: str, cls: str = "normal", tenant: str | None = None) -> Ask:
    body = {"model": "m", "messages": [{"role": "user", "content": text}]}
    return Ask(body, "chat", "m", None, None, tenant, cls.encode(), 0.0)


async def admitted_order(g: Gate, asks: list[Ask], fleet: list[Replica],
                         hold: Ticket) -> list[str]:
    order: list[str] = []

    async def one(a: Ask) -> None:
        t = await g.admit(a, fleet)
        order.append(a.body["messages"][0]["content"])
        fleet[0].in_flight += 1
        await asyncio.sleep(0)
        fleet[0].in_flight -= 1
        g.done(t)

    tasks = [asyncio.create_task(one(a)) for a in asks]
    await asyncio.sleep(0.01)
    assert g.stats()["queued"]["high"] + g.stats()["queued"]["low"] == len(asks)
    fleet[0].in_flight -= 1
    g.done(hold)
    await asyncio.wait_for(asyncio.gather(*tasks), 5)
    return order


def test_high_goes_before_low_when_room_frees() -> None:
    async def run() -> list[str]:
        g, _ = gate()
        fleet = [replica("a")]
        hold = await g.admit(ask("holder"), fleet)
        fleet[0].in_flight += 1
        asks = [ask("low-1", "low"), ask("low-2", "low"), ask("high-1", "high")]
        order = await admitted_order(g, asks, fleet, hold)
        await g.aclose()
        return order
    order = asyncio.run(run())
    assert order[0] == "high-1"
    assert sorted(order) == ["high-1", "low-1", "low-2"]  # low is not starved


def test_a_full_queue_sheds_the_youngest_lower_class_waiter_for_a_higher_one() -> None:
    async def run() -> tuple[BaseException | Ticket, Ticket]:
        g, _ = gate(max_queue=1)
        fleet = [replica("a")]
        hold = await g.admit(ask("holder"), fleet)
        fleet[0].in_flight += 1
        low = asyncio.create_task(g.admit(ask("low", "low"), fleet))
        await asyncio.sleep(0.01)
        high = asyncio.create_task(g.admit(ask("high", "high"), fleet))
        await asyncio.sleep(0.01)
        fleet[0].in_flight -= 1
        g.done(hold)
        got = await asyncio.gather(low, return_exceptions=True)
        ticket = await asyncio.wait_for(high, 5)
        assert g.stats()["shed"]["displaced"] == 1
        await g.aclose()
        return got[0], ticket
    low, high = asyncio.run(run())
    assert isinstance(low, Shed) and low.reason == "displaced" and low.status == 429
    assert high.cls == "high" and high.queued_ms is not None


def test_a_tenant_that_took_its_class_while_another_waits_is_shed_at_once() -> None:
    """x was admitted all its class's recent tokens; while y waits, x's next request is
    answered 429 at once (not queued), and y, under its share, still waits."""
    async def run() -> None:
        g, _ = gate(max_queue=100)
        fleet = [replica("a")]
        hold = await g.admit(ask("holder", tenant="x"), fleet)
        fleet[0].in_flight += 1
        alone = asyncio.create_task(g.admit(ask("x-alone", tenant="x"), fleet))
        await asyncio.sleep(0.01)  # x alone in its class: it may wait
        y = asyncio.create_task(g.admit(ask("y", tenant="y"), fleet))
        await asyncio.sleep(0.01)
        with pytest.raises(Shed) as err:
            await g.admit(ask("x-again", tenant="x"), fleet)
        assert err.value.reason == "tenant_share" and err.value.status == 429
        assert err.value.retry_after is not None and err.value.retry_after >= 1
        y2 = asyncio.create_task(g.admit(ask("y2", tenant="y"), fleet))
        await asyncio.sleep(0.01)
        assert not y2.done() and g.stats()["queued"]["normal"] == 3
        assert g.stats()["shed"] == {"tenant_share": 1, "wait_limit": 0, "queue_full": 0,
                                     "displaced": 0, "wait_timeout": 0}
        for t in (alone, y, y2):
            t.cancel()
        await asyncio.gather(alone, y, y2, return_exceptions=True)
        g.done(hold)
        await g.aclose()
    asyncio.run(run())


def test_a_tenant_over_its_share_while_others_wait_is_shed() -> None:
    async def run() -> None:
        g, _ = gate(max_queue=4, over_share=100.0)  # the queue-slots half of the rule
        fleet = [replica("a")]
        hold = await g.admit(ask("holder", tenant="x"), fleet)
        fleet[0].in_flight += 1
        waiting = [asyncio.create_task(g.admit(ask("other", tenant="y"), fleet))]
        await asyncio.sleep(0.01)
        for i in range(2):  # x's share beside y: 4 x 1/2 = 2 waiters
            waiting.append(asyncio.create_task(g.admit(ask(f"x{i}", tenant="x"), fleet)))
            await asyncio.sleep(0.01)
        with pytest.raises(Shed) as err:
            await g.admit(ask("x-too-many", tenant="x"), fleet)
        assert err.value.reason == "tenant_share"
        assert g.stats()["shed"]["tenant_share"] == 1
        for t in waiting:
            t.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)
        assert g.stats()["queued"]["normal"] == 0  # cancelled waiters left at once
        g.done(hold)
        await g.aclose()
    asyncio.run(run())


def test_admission_off_is_a_plain_decision() -> None:
    async def run() -> Ticket:
        routing = RoutingConfig()
        g = Gate(AdmissionConfig(), routing, Router(routing), GatewayMetrics(), Clock(), Clock())
        fleet = [replica("a")]
        fleet[0].in_flight = 100  # no room, but admission is off: it goes
        return await g.admit(ask("x", "high"), fleet)
    ticket = asyncio.run(run())
    assert (ticket.replica, ticket.cls, ticket.queued_ms, ticket.engine_priority) == (
        None, "normal", None, None)
    assert ticket.plan.decision.replica == "a"


@pytest.mark.parametrize(("follow_up_class", "tenant", "first"), [
    ("normal", None, "cold"), ("high", None, "follow"),
    # the follow-up's tenant got none of its class's recent tokens, the other all of them:
    # it is owed its share and keeps its place (and wins the tie of a flow just started)
    ("normal", "quiet", "follow"),
])
def test_a_freed_replica_goes_first_to_a_waiter_that_need_not_move(
        follow_up_class: str, tenant: str | None, first: str) -> None:
    history = "the conversation so far " * 80
    flood = "flood" if tenant else None

    async def run() -> list[str]:
        g, _ = gate(own_replica_max_wait_s=0.0)  # a follow-up never waits for its own
        fleet = [replica("a"), replica("b")]
        held = await g.admit(ask(history, tenant=tenant), fleet)
        own = next(r for r in fleet if r.name == held.plan.decision.replica)
        other = next(r for r in fleet if r is not own)
        own.in_flight += 1
        if tenant:  # the flooder took far more of the class lately
            for i in range(20):
                g.done(await g.admit(ask(f"flood {i} " * 100, tenant=flood), [other]))
        busy = await g.admit(ask("something else entirely " * 40, tenant=flood), fleet)
        assert busy.plan.decision.replica == other.name
        other.in_flight += 1
        order: list[str] = []

        async def wait(name: str, a: Ask) -> None:
            t = await g.admit(a, fleet)
            order.append(name)
            assert t.plan.decision.replica == other.name

        def follow_up() -> asyncio.Task[None]:
            return asyncio.create_task(wait("follow", ask(
                history + " and one more turn", follow_up_class, tenant)))

        follow = follow_up() if not tenant else None
        await asyncio.sleep(0.005)
        cold = asyncio.create_task(wait("cold", ask("a new conversation " * 40, tenant=flood)))
        await asyncio.sleep(0.005)
        if follow is None:  # after the flooder's waiter, so only the order lets it pass
            follow = follow_up()
            await asyncio.sleep(0.005)
        other.in_flight -= 1
        g.done(busy)  # room on the replica that does not hold the follow-up's history
        await asyncio.sleep(0.01)
        for t in (follow, cold):
            t.cancel()
        await asyncio.gather(follow, cold, return_exceptions=True)
        await g.aclose()
        return order
    assert asyncio.run(run())[:1] == [first]


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


def gate_with(config: AdmissionConfig) -> tuple[Gate, Router]:
    routing = RoutingConfig()
    router = Router(routing)
    return Gate(config, routing, router, GatewayMetrics(), Clock(), Clock()), router


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
        g = Gate(AdmissionConfig(enabled=True, replica_max_queued_prefill_tokens=100,
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
