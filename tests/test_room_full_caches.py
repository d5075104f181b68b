"""The KV usage steers, and holds none (room.py): a full cache steers a request to a cache
with room while one has it, holds none once none has, and closes no replica to a request
whose prefix it holds; up to a step's prefill (8192 tokens) of this gateway's requests
waits to begin in an engine whose own cache is full, never in one full only by an agent
program's held context; its sequences, the prefill room and a stalled engine still hold
it; a lower class is held as before while `high` requests come, and only a `high` the
tenant may ask for counts (a tenant capped at `normal` asking for `high` turns nothing
off for the others)."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from gateway.admission.room import Binding, ReplicaLoad, bind, room_but_cache
from tests.room_builders import IN_FLIGHT_S, LIMITS, PER_TOKEN, ask, load, two_replicas
from tests.test_admission_engine import Clock, snap


def _bind(loads: list[ReplicaLoad], steers: bool, prompt: float = 2000.0) -> Binding:
    return bind(loads, LIMITS, PER_TOKEN, IN_FLIGHT_S, 0.0, 2.0, 0.0, prompt, 2.0,
                cache_steers=steers)


FULL_KV = {"kv": 0.99, "occupancy": 2.0, "seq_limit": 16}
ROOMY = {"kv": 0.5, "occupancy": 2.0, "seq_limit": 16}

# (case, loads, steers, expected why, expected replicas)
ROWS = [
    ("every cache full, held when the cache holds",
     [load("a", **FULL_KV), load("b", **FULL_KV)], False, "full", ()),
    ("every cache full, steered: both have room but for their caches",
     [load("a", **FULL_KV), load("b", **FULL_KV)], True, "room", ("a", "b")),
    ("one cache with room: steered there, not to the full one",
     [load("a", **FULL_KV), load("b", **ROOMY)], True, "room", ("b",)),
    ("every cache full and one engine's sequences full: only the other",
     [load("a", **{**FULL_KV, "occupancy": 16.0}), load("b", **FULL_KV)], True, "room",
     ("b",)),
    ("every cache full and every engine's sequences full: held",
     [load("a", **{**FULL_KV, "occupancy": 16.0}),
      load("b", **{**FULL_KV, "occupancy": 16.0})], True, "full", ()),
    ("every cache full and the prefill room full on both: held",
     [load("a", **{**FULL_KV, "queued": 40_000.0}),
      load("b", **{**FULL_KV, "queued": 40_000.0})], True, "full", ()),
    ("a follow-up, every cache full: to its own, whose cache closes it to none it holds",
     [load("a", **{**FULL_KV, "predicted": 1500.0}), load("b", **FULL_KV)], True, "room",
     ("a",)),
    ("a follow-up whose own cache is full, another with room: its own has room too (the "
     "router weighs the two as always)",
     [load("a", **{**FULL_KV, "predicted": 1500.0}), load("b", **ROOMY)], True, "room",
     ("a", "b")),
    ("the same while high comes: held for its own, or moved, by the cost model as before",
     [load("a", **{**FULL_KV, "predicted": 1500.0}), load("b", **ROOMY)], False, "own", ()),
    ("a prefix every candidate holds (a shared system prompt) is no history: steered",
     [load("a", **{**FULL_KV, "predicted": 1500.0}),
      load("b", **{**ROOMY, "predicted": 1500.0})], True, "room", ("b",)),
    ("no prefix anywhere: steered to the cache with room",
     [load("a", **FULL_KV), load("b", **ROOMY), load("c", **FULL_KV)], True, "room",
     ("b",)),
    ("a follow-up whose own engine's sequences are full, the other's cache full: "
     "holding for its own is cheaper than recomputing 1,500 tokens",
     [load("a", **{**FULL_KV, "occupancy": 16.0, "predicted": 1500.0}),
      load("b", **FULL_KV)], True, "own", ()),
    ("an unhealthy replica is never steered to",
     [load("a", **{**FULL_KV, "healthy": 0.0}), load("b", **FULL_KV)], True, "room", ("b",)),
]


@pytest.mark.parametrize(("case", "loads", "steers", "why", "names"), ROWS,
                         ids=[r[0] for r in ROWS])
def test_a_full_cache_steers_and_never_holds(case: str, loads: list[ReplicaLoad],
                                             steers: bool, why: str,
                                             names: tuple[str, ...]) -> None:
    b = _bind(loads, steers)
    assert (b.why, b.replicas) == (why, names), case


def test_a_stalled_engine_holds_even_when_every_cache_is_full() -> None:
    stuck = [ReplicaLoad(n, in_flight=2, queued_prefill_tokens=0.0, kv_usage=0.99,
                         occupancy=3.0, engine_waiting=1.0, seq_limit=16,
                         engine_stuck=True) for n in ("a", "b")]
    assert _bind(stuck, True).why == "full"


def _fill(fleet, clock: Clock, kv: float) -> None:  # type: ignore[no-untyped-def]
    """Both replicas scraped now: one request running (this gateway's), none waiting,
    their caches at `kv`."""
    for name, r in fleet.replicas.items():
        r.in_flight = 1
        fleet.set_snapshot(name, snap(clock, 1.0, kv=kv), in_flight=1)


async def _admitted_now(g, pool, a) -> bool:  # type: ignore[no-untyped-def]
    """Whether `a` goes within a few rechecks (bounded); the task is cancelled if not.
    One that went has begun (its first token) and ended: nothing of it is left queued."""
    task = asyncio.create_task(g.admit(a, pool))
    for _ in range(30):
        if task.done():
            break
        await asyncio.sleep(0.001)
    went = task.done() and task.exception() is None
    if went:
        ticket = task.result()
        ticket.plan.outcome.first_token_at = 0.0
        g.done(ticket)
    else:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    return went


def test_the_gate_steers_a_normal_request_while_no_high_comes() -> None:
    async def run() -> tuple[bool, bool, bool, bool]:
        clock = Clock()  # stands still but where moved: the scrapes stay fresh
        fleet, g = two_replicas(clock)
        pool = list(fleet.replicas.values())
        _fill(fleet, clock, 0.99)
        quiet = await _admitted_now(g, pool, ask(b"normal", "t", "a question " * 30))
        # a `high` request: held in the gateway for nothing here (it steers), and from
        # now on a lower class is held for a cache with room
        high = await _admitted_now(g, pool, ask(b"high", "t", "an urgent one " * 30))
        _fill(fleet, clock, 0.99)
        after_high = await _admitted_now(g, pool, ask(b"normal", "t", "another " * 30))
        clock.t += 11.0  # past twice the shares' half-life (5 s) since that `high`
        _fill(fleet, clock, 0.99)
        later = await _admitted_now(g, pool, ask(b"normal", "t", "and later " * 30))
        await g.aclose()
        return quiet, high, after_high, later
    quiet, high, after_high, later = asyncio.run(run())
    assert quiet, "a normal request was held with no high in sight"
    assert high, "high was held for a cache no replica has"
    assert not after_high, "a normal request went to a full cache while high comes"
    assert later, "a normal request was held long after the last high"


def test_a_tenant_that_may_not_ask_for_high_does_not_hold_the_others() -> None:
    """Two tenants, the gateway's default cap (`normal`): tenant b asks for `high` and is
    lowered to `normal`; tenant a's next request is steered as before."""
    async def run() -> tuple[bool, bool]:
        clock = Clock()
        fleet, g = two_replicas(clock, default_priority_cap="normal")
        pool = list(fleet.replicas.values())
        _fill(fleet, clock, 0.99)
        b = await _admitted_now(g, pool, ask(b"high", "b", "tenant b, loudly " * 30))
        _fill(fleet, clock, 0.99)
        a = await _admitted_now(g, pool, ask(b"normal", "a", "tenant a, quietly " * 30))
        await g.aclose()
        return b, a
    b, a = asyncio.run(run())
    assert b and a


def _held(name: str, kv: float, held: float, **kw: float) -> ReplicaLoad:
    return dataclasses.replace(load(name, **kw), kv_usage=kv, kv_held=held)


# room_but_cache: where a full cache may steer (its engine's own cache full, nothing of
# this gateway's waiting there to begin, every other limit with room)
BUT_CACHE = [
    ("the engine's own cache full, nothing unbegun there", _held("a", 0.99, 0.0), True),
    ("some prefill sent there not begun yet, below a step", _held("a", 0.99, 0.0,
                                                                   queued=8000.0), True),
    ("a step's prefill sent there not begun: the rest wait in the gateway",
     _held("a", 0.99, 0.0, queued=8192.0), False),
    ("full only by the context held for an agent program", _held("a", 1.0, 0.1), False),
    ("full by the engine's own cache and a held context", _held("a", 1.0, 0.02), True),
    ("a cache with room has room", _held("a", 0.5, 0.0), True),
    ("no KV usage known: room as ever, whatever is queued below the prefill room",
     dataclasses.replace(load("a", queued=9000.0), kv_usage=None), True),
    ("its sequences full", _held("a", 0.99, 0.0, occupancy=16.0, seq_limit=16), False),
]


@pytest.mark.parametrize(("case", "ld", "expected"), BUT_CACHE, ids=[r[0] for r in BUT_CACHE])
def test_where_a_full_cache_may_steer(case: str, ld: ReplicaLoad, expected: bool) -> None:
    assert room_but_cache(ld, LIMITS) is expected, case
