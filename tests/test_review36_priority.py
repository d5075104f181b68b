"""Outside review of issue 36 (admfix): the classes and "past the room".

A follow-up sent to its own replica past the gateway's queued-prefill room (room.py
`passable`, "past") reaches the engine at once. `passable` ignores the engine's waiting
queue (`has_room(..., prefill_factor > 1)`), which is the one limit that holds `high`
(its prefill room is unbounded): so while the engine shows a queue, a `high` newcomer
waits in the gateway and a `low` follow-up goes past it into the engine."""

from __future__ import annotations

import asyncio
import math

from gateway.admission.gate import Ask
from gateway.admission.room import ReplicaLoad, RoomLimits, bind, reserved
from tests.room_builders import ask, two_replicas, wait_queued
from tests.test_admission_engine import Clock, snap


def chat(priority: bytes, *turns: str) -> Ask:
    return ask(priority, "t", *turns)


HISTORY = "the history of this conversation " * 120


def test_a_low_follow_up_does_not_reach_the_engine_ahead_of_a_waiting_high() -> None:
    """Both engines show one request waiting, a queue they move (issue 36: such a queue
    no longer closes a replica by itself; what it waits for, sequences, KV blocks or the
    step's budget, does): a `high` newcomer is not held for it, so a `low` follow-up
    arriving after it cannot reach the engine before it. (A queue the engine does not
    move holds `high` and every lower follow-up alike: the table below and
    tests/test_room_past_order.py.)"""
    async def run() -> tuple[bool, int]:
        clock = Clock()  # stands still: the scrapes stay fresh, nothing begins
        fleet, g = two_replicas(clock)
        pool = list(fleet.replicas.values())
        t1 = await g.admit(chat(b"low", HISTORY), pool)  # the low conversation's turn 1
        home = t1.replica
        assert home is not None
        other = next(n for n in fleet.replicas if n != home)
        # the other replica holds the chat template's first block too (so the high
        # newcomer's prefix is on both: it has no history to go past the room for)
        t2 = await g.admit(chat(b"low", "an unrelated conversation " * 40),
                           [fleet.replicas[other]])
        for name, r in fleet.replicas.items():
            r.in_flight = 1
            fleet.set_snapshot(name, snap(clock, 1.0, waiting=1.0), in_flight=1)
        high = asyncio.create_task(g.admit(chat(b"high", "a new urgent question"), pool))
        await wait_queued(g, "high", 1, tries=50)
        low = asyncio.create_task(
            g.admit(chat(b"low", HISTORY, "an answer", "and then?"), pool))
        for _ in range(100):  # a few rechecks, bounded
            if low.done():
                break
            await asyncio.sleep(0.001)
        result = low.done() and not high.done(), g.stats()["queued"]["high"]
        for t in (high, low):
            t.cancel()
        await asyncio.gather(high, low, return_exceptions=True)
        for ticket in (t1, t2):
            g.done(ticket)
        await g.aclose()
        return result
    low_went_first, high_queued = asyncio.run(run())
    assert high_queued == 0, "high waited for a queue the engine moves"
    assert not low_went_first


# the same decision as a table (room.py alone): the gate's `high` and `low` limits
FULL = RoomLimits(math.inf, 32_768, 0.97)
HIGH = RoomLimits(math.inf, math.inf, 0.97)
LOW = reserved(reserved(FULL, 0.75, 0.5), 0.75, 1.0)


def test_whatever_holds_high_in_the_gateway_holds_a_lower_follow_up_too() -> None:
    # one request waits in an engine that does not move it; nothing else near a limit
    def at(predicted: int) -> ReplicaLoad:
        return ReplicaLoad("a", in_flight=2, queued_prefill_tokens=0.0, kv_usage=0.3,
                           occupancy=3.0, engine_waiting=1.0, seq_limit=64,
                           predicted_tokens=predicted, engine_stuck=True)
    other = ReplicaLoad("b", in_flight=2, queued_prefill_tokens=0.0, kv_usage=0.3,
                        occupancy=3.0, engine_waiting=1.0, seq_limit=64, predicted_tokens=16,
                        engine_stuck=True)
    high_new = bind([at(16), other], HIGH, 0.001, 0.01, 0.0, 2.0, 0.0, 200.0, 2.0)
    low_follow = bind([at(4000), other], LOW, 0.001, 0.01, 0.0, 2.0, 0.0, 4200.0, 2.0)
    assert high_new.why == "full"
    assert low_follow.why == "full", f"low goes {low_follow.why} while high is held"
