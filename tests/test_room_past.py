"""A follow-up sent to its own replica past the gateway's queued-prefill room (room.py
`bind`, "past"; `passable`, `cost_past`, `wait_past`), by tables, and the wait an arrival
is shed on (the drain rate's floor: the fleet's prefill rate)."""

from __future__ import annotations

import dataclasses
import math

import pytest

from gateway.admission.room import (
    Binding,
    ReplicaLoad,
    bind,
    cost_past,
    passable,
    wait_past,
)
from gateway.admission.shedding import DrainRate
from tests.room_builders import IN_FLIGHT_S, LIMITS, PER_TOKEN, load
from tests.room_builders import full_own as own

# LIMITS: `normal`'s room, half of 32,768 queued prefill tokens (16,384); 1 ms a token
PAST = 2.0  # the default `own_replica_past_room`
# `own()`: its own replica `a` holds 12k of its 14k-token prompt and is full by queued
# prefill alone (20k queued of a 16,384-token room; 32,768 past it); `b` has room, holds
# nothing
PROMPT = 14_000.0


@pytest.mark.parametrize(("ld", "ok"), [
    (own(), True),  # full by the room, within twice it
    (own(queued=10_000), False),  # has room: not "past"
    (own(queued=32_768), False),  # at the bound (2 x 16,384)
    (own(queued=30_000, largest=20_000), True),  # the room's floor: 20k, the bound 40k
    (own(queued=40_000, largest=20_000), False),
    # requests waiting in the engine behind its step's token budget: the queue it joins
    (own(waiting=2), True),
    (own(waiting=2, queued=33_000), False),  # ... within the bound all the same
    # the engine's own limits: every sequence it runs at once taken (the lower classes'
    # three quarters of 8), its KV cache full
    (own(occupancy=6, seq_limit=8), False),
    (own(occupancy=5, seq_limit=8), True),
    (own(kv=0.99), False),  # its KV cache is full
    (own(healthy=False), False),
])
def test_passable_is_full_by_the_room_alone_and_within_the_bound(ld: ReplicaLoad,
                                                                 ok: bool) -> None:
    assert passable(ld, LIMITS, PROMPT, PAST) is ok
    assert passable(ld, LIMITS, PROMPT, 1.0) is False  # 1: never past the room


FULL_B = {"free": 0.0}  # `b`'s prefix cache is full: what a move adds there evicts as much


@pytest.mark.parametrize(("loads", "waited", "max_wait", "why", "replicas"), [
    # held in the gateway before (20 + 2 s against 14 + 14 s moved): the engine serves
    # it as soon (the same queue) without a dispatch to wait for, so it goes now
    ([own(), load("b", **FULL_B)], 0.0, 30.0, "past", ("a",)),
    # it already waited 5 s: holding (27 s) costs more than moving to `b`, which holds 2k
    # of it (24 s), so it moved before; past the room it stays (22 s)
    ([own(), load("b", predicted=2_000, **FULL_B)], 5.0, 30.0, "past", ("a",)),
    # ... and past the longest it may hold for its own (2 s) it stays all the same
    ([own(), load("b", **FULL_B)], 0.0, 2.0, "past", ("a",)),
    # moving is cheaper: `b`'s cache has room (14 s against 22 s)
    ([own(), load("b")], 0.0, 30.0, "elsewhere", ("b",)),
    # past the bound it is moved or held as before
    ([own(queued=33_000), load("b", **FULL_B)], 0.0, 60.0, "elsewhere", ("b",)),
    ([own(queued=33_000, rate=0.0005), load("b", **FULL_B)], 0.0, 60.0, "own", ()),
    # requests waiting in its engine: the same queue (22 s against holding 22.01 s)
    ([own(waiting=1), load("b", **FULL_B)], 0.0, 60.0, "past", ("a",)),
    # the engine's own limit (every sequence taken): held, as before
    ([own(occupancy=6, seq_limit=8), load("b", **FULL_B)], 0.0, 60.0, "own", ()),
    # nowhere with room: it goes to its own past the room, within the bound ...
    ([own(), load("b", queued=40_000, in_flight=3)], 0.0, 2.0, "past", ("a",)),
    # ... beyond it, it is held
    ([own(queued=33_000), load("b", queued=40_000, in_flight=3)], 0.0, 2.0, "full", ()),
    # no history to keep: a new conversation, a prefix every healthy candidate holds
    # (a shared system prompt), a single candidate
    ([own(predicted=0), load("b", queued=40_000, in_flight=3)], 0.0, 2.0, "full", ()),
    ([own(), load("b", queued=40_000, in_flight=3, predicted=12_000)], 0.0, 2.0, "full",
     ()),
    ([own()], 0.0, 2.0, "full", ()),
    ([own(), load("b", healthy=False)], 0.0, 2.0, "full", ()),
    # of two own replicas past the room, the cheaper (18 + 2 s against 20 + 2 s)
    ([own(), dataclasses.replace(own(queued=18_000), name="c"),
      load("b", queued=40_000, in_flight=3)], 0.0, 2.0, "past", ("c",)),
])
def test_a_follow_up_goes_past_the_room_when_that_costs_least(
        loads: list[ReplicaLoad], waited: float, max_wait: float, why: str,
        replicas: tuple[str, ...]) -> None:
    b = bind(loads, LIMITS, PER_TOKEN, IN_FLIGHT_S, waited, max_wait, 0.0, PROMPT, PAST)
    assert (b.why, b.replicas) == (why, replicas)
    assert b.go is (why not in ("own", "full"))
    # never past the room without the setting: what it did before
    before = bind(loads, LIMITS, PER_TOKEN, IN_FLIGHT_S, waited, max_wait, 0.0, PROMPT)
    assert before.why != "past"
    if why != "past":
        assert before == b


@pytest.mark.parametrize(("ld", "seconds"), [
    (own(), 22.0),  # 20k queued + its 2k uncached, at 1 ms
    (own(rate=0.0005), 11.0),  # at its measured rate
    (own(free=500), 23.5),  # and the 1.5k it evicts from a full cache
])
def test_cost_past(ld: ReplicaLoad, seconds: float) -> None:
    assert cost_past(ld, PER_TOKEN, PROMPT) == pytest.approx(seconds)


@pytest.mark.parametrize(("binding", "seconds"), [
    (Binding(True, ("a",), "past"), 20.0),  # the prefill queued there, at its rate
    (Binding(True, ("a", "c"), "past"), 10.0),  # the least of its replicas
    (Binding(True, ("b",), "room"), math.inf),  # not past: the gateway's queue's wait
    (Binding(False, (), "full"), math.inf),
])
def test_the_wait_past_the_room_is_the_queue_there(binding: Binding, seconds: float) -> None:
    loads = [own(), load("c", queued=20_000, rate=0.0005), load("b")]
    assert wait_past(loads, binding, PER_TOKEN) == seconds


@pytest.mark.parametrize(("floor", "rate"), [
    (None, 100.0),  # its own floor (one replica's cost-model rate)
    (400.0, 400.0),  # the fleet's prefill rate when higher
    (50.0, 100.0),  # never below its own
    (0.0, 100.0),
])
def test_the_drain_rate_is_never_believed_below_the_fleets(floor: float | None,
                                                           rate: float) -> None:
    drain = DrainRate(floor=100.0)
    assert drain.rate(0.0, floor=floor) == rate
    for i in range(8):  # a measured 1,000 tokens a second stands above both
        drain.add(i * 1.0, 1000.0)
    assert drain.rate(7.0, floor=floor) == pytest.approx(1000.0)
