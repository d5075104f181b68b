"""The admission queue's order among waiters, through `Gate.admit` / `Gate.done` only (a
real Router, replicas as the fleet holds them, no network): a newcomer never overtakes
its class's waiters, displacement takes the youngest lowest-class waiter, `high` keeps
its place when it must leave its prefix's replica, and a client that leaves in the
instant its ticket is released gives the room back."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from gateway.admission.config import AdmissionConfig
from gateway.admission.gate import Gate, Ticket
from gateway.admission.shedding import Shed
from tests.gate_builders import ask, gate, gate_with, replica

HISTORY = "the conversation so far " * 80


async def until(cond: Callable[[], bool], what: str, deadline_s: float = 10.0) -> None:
    """Yield to the loop until `cond` holds (bounded: a broken gate fails, never hangs)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + deadline_s
    while not cond():
        assert loop.time() < end, f"not within {deadline_s} s: {what}"
        await asyncio.sleep(0.001)


def unrechecked() -> Gate:
    """One slot per replica and no periodic recheck: only an arrival or `done` looks."""
    return gate_with(AdmissionConfig(enabled=True, replica_max_in_flight=1,
                                     default_priority_cap="high", recheck_s=3600.0))[0]


def queued(g: Gate) -> int:
    return sum(g.stats()["queued"].values())


async def settle(tasks: list[asyncio.Task[Ticket]], g: Gate) -> None:
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await g.aclose()


def test_a_newcomer_does_not_overtake_its_class_when_room_frees_between_rechecks() -> None:
    """Room appears with no `done` (another client's request left the replica) while a
    `normal` request waits; the next `normal` arrival finds room but queues behind it, and
    the waiter gets that room."""
    async def run() -> tuple[bool, bool]:
        g = unrechecked()
        fleet = [replica("a")]
        fleet[0].in_flight = 1  # someone else's request: no room
        first = asyncio.create_task(g.admit(ask("first"), fleet))
        await until(lambda: queued(g) == 1, "the first request waits")
        fleet[0].in_flight = 0  # it left: room for one
        second = asyncio.create_task(g.admit(ask("second"), fleet))
        await until(lambda: first.done() or second.done(), "one of them goes")
        await asyncio.sleep(0)
        got = (first.done(), second.done())
        await settle([first, second], g)
        return got
    assert asyncio.run(run()) == (True, False)


@pytest.mark.parametrize(("old_tenant", "young_tenant"), [
    (None, None),  # one flow: its newest waiter
    ("x", "y"),  # two flows of the class: the newest of their newest
])
def test_a_full_queue_displaces_its_youngest_lowest_class_waiter(
        old_tenant: str | None, young_tenant: str | None) -> None:
    async def run() -> tuple[bool, BaseException | None]:
        g, _ = gate(max_queue=2)
        fleet = [replica("a")]
        fleet[0].in_flight = 1
        old = asyncio.create_task(g.admit(ask("old low", "low", old_tenant), fleet))
        await until(lambda: queued(g) == 1, "the old low request waits")
        young = asyncio.create_task(g.admit(ask("young low", "low", young_tenant), fleet))
        await until(lambda: queued(g) == 2, "the young low request waits")
        high = asyncio.create_task(g.admit(ask("high", "high"), fleet))
        await until(lambda: young.done() or old.done(), "a low request is displaced")
        await asyncio.sleep(0)
        got = (old.done(), young.exception() if young.done() else None)
        await settle([old, young, high], g)
        return got
    old_done, young_error = asyncio.run(run())
    assert not old_done
    assert isinstance(young_error, Shed) and young_error.reason == "displaced"


def test_high_keeps_its_place_when_it_must_leave_its_prefixs_replica() -> None:
    """A `high` follow-up whose replica is full and a `normal` request whose prefix is on
    the other replica both wait; when the other frees, `high` goes there first (in the
    matching round only a waiter that need not move, or one that keeps its place, goes).
    Neither flow is owed its share (each took all of its class lately), so only the
    class keeps the follow-up's place."""
    busy_text = "something else entirely " * 40

    async def run() -> tuple[str, bool]:
        g, _ = gate(own_replica_max_wait_s=0.0)
        fleet = [replica("a"), replica("b")]
        held = await g.admit(ask(HISTORY), fleet)
        own = next(r for r in fleet if r.name == held.plan.decision.replica)
        other = next(r for r in fleet if r is not own)
        own.in_flight += 1
        for i in range(3):  # the high flow took its class's recent tokens: not owed
            g.done(await g.admit(ask(f"earlier high {i} " * 30, "high"), [other]))
        busy = await g.admit(ask(busy_text), [other])
        other.in_flight += 1
        follow = asyncio.create_task(g.admit(ask(HISTORY + " and one more turn", "high"),
                                             fleet))
        cold = asyncio.create_task(g.admit(ask(busy_text + " and a question"), fleet))
        await until(lambda: queued(g) == 2, "both wait")
        other.in_flight -= 1
        g.done(busy)
        await until(lambda: follow.done() or cold.done(), "one of them goes")
        await asyncio.sleep(0)
        first = "follow" if follow.done() else "cold"
        went = follow.result().plan.decision.replica == other.name if follow.done() else False
        await settle([follow, cold], g)
        return first, went
    assert asyncio.run(run()) == ("follow", True)


@pytest.mark.parametrize("leaves", [True, False])
def test_a_client_that_leaves_as_its_ticket_is_released_gives_the_room_back(
        leaves: bool) -> None:
    """The waiter is released (`done` frees the one slot) and its client goes away in the
    same instant: the slot it was given is free again, so the next request goes at once.
    (Control: a client that stays holds the slot, and the next request waits.)"""
    async def run() -> bool:
        g = unrechecked()
        fleet = [replica("a")]
        hold = await g.admit(ask("holder"), fleet)
        waiter = asyncio.create_task(g.admit(ask("waiter"), fleet))
        await until(lambda: queued(g) == 1, "the waiter waits")
        g.done(hold)  # releases the waiter's ticket at once
        if leaves:
            waiter.cancel()  # before its task runs again: the ticket was already given
        await asyncio.gather(waiter, return_exceptions=True)
        nxt = asyncio.create_task(g.admit(ask("next"), fleet))
        await asyncio.sleep(0)  # one step: the fast path needs no more
        went = nxt.done()
        await settle([nxt], g)
        return went
    assert asyncio.run(run()) is leaves
