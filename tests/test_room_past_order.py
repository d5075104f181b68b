"""Past the room in the gate's order (dispatch.py `_release_pass`, room.py "past"): a follow-up
whose own replica is full by this gateway's queued prefill may go there past the room,
but never into the engine ahead of a request of a higher class that waits here for that
replica, nor ahead of one of its own class before it in the gate's order."""

from __future__ import annotations

import asyncio
import math

import pytest

from gateway.admission.gate import Ask, Ticket
from gateway.admission.room import ReplicaLoad, RoomLimits, has_room, passable
from tests.room_builders import LIMITS, ask, two_replicas, wait_queued
from tests.test_admission_engine import Clock, snap


def chat(priority: bytes, tenant: str, *turns: str) -> Ask:
    # sent at the clock's time (it stands still): older plans are swept from the router
    return ask(priority, tenant, *turns, at=Clock().t)


HISTORY = "the history of this conversation " * 120
BULK = "a long unrelated document, queued and not begun " * 900  # ~11k tokens each


def scenario(first: bytes | None, tenant: str = "y") -> tuple[bool, bool]:
    """Each replica holds two ~11k-token prompts this gateway sent and the engine has not
    begun (full by the queued prefill for `low`: past the room is open to the follow-up
    whose history is on one of them), so a `first` newcomer (no history) of `tenant`
    waits here, unless its class is not held for queued prefill (`high`: it waits behind
    that prefill in the engine just the same); None: none comes. Returns (the follow-up
    went, the newcomer went)."""
    async def run() -> tuple[bool, bool]:
        clock = Clock()  # stands still: the scrapes stay fresh, nothing begins
        fleet, g = two_replicas(clock)
        pool = list(fleet.replicas.values())
        t1 = await g.admit(chat(b"low", "x", HISTORY), pool)
        home = t1.replica
        assert home is not None
        other = next(n for n in fleet.replicas if n != home)
        held: list[Ticket] = [t1]
        for i in range(2):
            held.append(await g.admit(chat(b"low", "x", f"{i} " + BULK),
                                      [fleet.replicas[home]]))
        held.append(await g.admit(chat(b"low", "x", "an unrelated conversation " * 40),
                                  [fleet.replicas[other]]))
        for i in range(2):  # the other replica full by queued prefill too
            held.append(await g.admit(chat(b"low", "x", f"other {i} " + BULK),
                                      [fleet.replicas[other]]))
        for name, r in fleet.replicas.items():
            r.in_flight = 1
            fleet.set_snapshot(name, snap(clock, 64.0, waiting=3.0), in_flight=1)
        newcomer = asyncio.create_task(
            g.admit(chat(first or b"low", tenant, "a new question"), pool)
            if first is not None else asyncio.sleep(3600.0))
        if first is not None:
            await wait_queued(g, first.decode(), 1)
        low = asyncio.create_task(
            g.admit(chat(b"low", "x", HISTORY, "an answer", "and then?"), pool))
        for _ in range(100):  # a few rechecks, bounded
            if low.done():
                break
            await asyncio.sleep(0.001)
        result = low.done() and not low.cancelled(), newcomer.done()
        for t in (newcomer, low):
            t.cancel()
        await asyncio.gather(newcomer, low, return_exceptions=True)
        for ticket in held:
            g.done(ticket)
        await g.aclose()
        return result
    return asyncio.run(run())


def test_alone_the_follow_up_goes_past_the_room() -> None:
    # the control: nobody waits before it, and past the room is what sends it
    low_went, _ = scenario(None)
    assert low_went


def test_high_is_not_held_where_a_low_follow_up_goes_past_the_room() -> None:
    """What opens past the room to a lower follow-up (a replica full by the gateway's
    queued prefill) never holds `high`: it goes at once, ahead of the follow-up."""
    _, high_went = scenario(b"high")
    assert high_went, "high waited while the replicas were full by queued prefill alone"


@pytest.mark.parametrize("stuck", [False, True])
@pytest.mark.parametrize("waiting", [0.0, 3.0])
@pytest.mark.parametrize("kv", [0.3, 0.98])
@pytest.mark.parametrize("occupancy", [10.0, 63.0, 64.0])
@pytest.mark.parametrize("queued", [0.0, 20_000.0, 40_000.0])  # LIMITS: room 16,384
def test_whatever_holds_high_holds_a_lower_follow_up_too(
        stuck: bool, waiting: float, kv: float, occupancy: float, queued: float) -> None:
    """Over the limits one at a time and together: where `high` has no room, no lower
    follow-up may go past the room (the engine would serve it first)."""
    ld = ReplicaLoad("a", in_flight=2, queued_prefill_tokens=queued, kv_usage=kv,
                     occupancy=occupancy + waiting, engine_waiting=waiting, seq_limit=64,
                     engine_stuck=stuck)
    high = RoomLimits(math.inf, math.inf, LIMITS.kv_usage_limit)
    if not has_room(ld, high, 4_000.0):
        assert not passable(ld, LIMITS, 4_000.0, 2.0)


def test_nor_ahead_of_an_earlier_waiter_of_its_own_class() -> None:
    # the same tenant: its flow's first waiter is the newcomer
    low_went, earlier_went = scenario(b"low", "x")
    assert not earlier_went
    assert not low_went, "a low follow-up went past the room ahead of an earlier low"




@pytest.mark.parametrize(("queued", "waiting", "past"), [
    (0.0, 1.0, False),  # only the engine's queue: not full by the queued prefill
    (8_000.0, 5.0, False),
    (20_000.0, 0.0, True),  # full by this gateway's queued prefill
    (20_000.0, 5.0, True),  # ... whatever else waits in the engine
    (40_000.0, 0.0, False),  # beyond twice the room
])
def test_past_the_room_is_open_only_where_the_queued_prefill_fills_it(
        queued: float, waiting: float, past: bool) -> None:
    ld = ReplicaLoad("a", in_flight=2, queued_prefill_tokens=queued, kv_usage=0.3,
                     occupancy=3.0 + waiting, engine_waiting=waiting, seq_limit=64)
    assert passable(ld, LIMITS, 4_000.0, 2.0) is past
