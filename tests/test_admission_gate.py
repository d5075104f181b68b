"""The admission queue in process (a real Router, replicas as the fleet holds them, no
network): who goes first when room frees, displacement, the tenant share, the router's
bookkeeping of a released ticket. (A follow-up's wait for its own replica, the queued
prefill and the projected wait: test_admission_gate_waits.py.)"""

from __future__ import annotations

import asyncio

import pytest

from gateway.admission.config import AdmissionConfig
from gateway.admission.gate import Ask, Gate, Ticket
from gateway.admission.shedding import Shed
from gateway.replicas.fleet import Replica
from gateway.routing.config import RoutingConfig
from gateway.routing.router import Router
from gateway.usage.metrics import GatewayMetrics
from tests.gate_builders import Clock, ask, gate, replica


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
        g = Gate(AdmissionConfig(enabled=False), routing, Router(routing), GatewayMetrics(),
                 Clock(), Clock())
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
