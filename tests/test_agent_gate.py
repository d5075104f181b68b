"""The admission gate's wiring of agent programs (in process: a Gate with a Fleet and a
real Router, the clock given): a program's whole answer starts its tool call on the
replica that served it, the fleet view then reads that replica's KV usage with the
program's context added over its KV capacity, and the program's next request ends it."""

from __future__ import annotations

import asyncio
import dataclasses

from gateway.admission.config import AdmissionConfig
from gateway.admission.gate import Ask, Gate, Ticket
from gateway.agents.programs import ProgramId
from gateway.replicas.fleet import Fleet
from gateway.routing.config import RoutingConfig
from gateway.routing.router import Router
from gateway.settings import ReplicaSettings
from gateway.usage.metrics import GatewayMetrics
from tests.test_admission_engine import Clock, snap

CAPACITY = 10_000
P = ProgramId("t", "run-1", "session")


def world(max_s: float, own_wait_s: float = 2.0) -> tuple[Gate, Fleet, Clock]:
    # a slow engine: a 1,000-token context costs 10 s to prefill again
    routing = dataclasses.replace(RoutingConfig(), prefill_s_per_token=0.01)
    fleet = Fleet([ReplicaSettings(name=n, url=f"http://{n}:8000", models=("m",),
                                   capacity_tokens=CAPACITY) for n in ("a", "b")])
    for r in fleet.replicas.values():
        r.healthy = True
    clock = Clock()
    g = Gate(AdmissionConfig(enabled=True, agent_reserve_max_s=max_s,
                             own_replica_max_wait_s=own_wait_s), routing,
             Router(routing), GatewayMetrics(), clock, clock, fleet=fleet,
             scrape_interval_s=1.0)
    return g, fleet, clock


def turn(text: str, program: ProgramId | None) -> Ask:
    return Ask({"model": "m", "messages": [{"role": "user", "content": text}]}, "chat", "m",
               None, None, "t", None, 0.0, program=program)


def answered(g: Gate, t: Ticket, ok: bool = True) -> str:
    """The request is over, as the request path ends it: the router's report, then the
    gate's `done` (the router no longer counts its prompt in the replica's KV)."""
    o = t.plan.outcome
    o.ok, o.prompt_tokens, o.completion_tokens = ok, 900, 100
    g.router.report(t.plan, 0.0)
    g.done(t)
    assert t.replica is not None
    return t.replica


def kv(g: Gate, fleet: Fleet, clock: Clock, name: str) -> float | None:
    """The KV usage the gate reads just after a scrape showing 0.2 (asked for with what
    is in flight there now, as the monitor asks)."""
    fleet.set_snapshot(name, snap(clock, 1.0, kv=0.2), pinned=g.router.pinned_tokens(name))
    return g._fleet_view.load(fleet.replicas[name], 1).kv_usage


def test_a_program_in_its_tool_call_holds_its_context_on_its_replica() -> None:
    async def run() -> None:
        g, fleet, clock = world(10.0)
        pool = list(fleet.replicas.values())
        for i in range(3):  # three turns 2 s apart: gaps of 2 s learnt
            home = answered(g, await g.admit(turn(f"step {i}", P), pool))
            clock.t += 2.0
        other = next(n for n in fleet.replicas if n != home)
        home = answered(g, await g.admit(turn("step 3", P), pool))
        assert g.programs.reserved_tokens(home, clock.t) == 1000
        assert kv(g, fleet, clock, home) == 0.2 + 1000 / CAPACITY
        assert kv(g, fleet, clock, other) == 0.2
        clock.t += 1.0  # 1 s left of a 2 s gap: still held
        assert kv(g, fleet, clock, home) == 0.2 + 1000 / CAPACITY
        # another conversation (no program) neither ends nor takes the reservation
        answered(g, await g.admit(turn("someone else", None), pool))
        assert g.programs.reserved_tokens(home, clock.t) == 1000
        await g.admit(turn("step 4", P), pool)  # back from its tool: nothing held
        assert kv(g, fleet, clock, home) == 0.2
    asyncio.run(run())


def test_a_failed_answer_or_reservation_off_holds_nothing() -> None:
    async def run(max_s: float, ok: bool) -> int:
        g, fleet, clock = world(max_s)
        pool = list(fleet.replicas.values())
        for i in range(3):
            answered(g, await g.admit(turn(f"step {i}", P), pool))
            clock.t += 2.0
        home = answered(g, await g.admit(turn("last", P), pool), ok=ok)
        return g.programs.reserved_tokens(home, clock.t)
    assert asyncio.run(run(10.0, True)) == 1000
    assert asyncio.run(run(10.0, False)) == 0
    assert asyncio.run(run(0.0, True)) == 0


HISTORY = " ".join(f"ctx{i}" for i in range(1500))  # a program's history: the router's pin


def grown(i: int, program: ProgramId | None) -> Ask:
    """Turn `i` of a conversation with a long shared history (its replica caches it)."""
    return Ask({"model": "m", "messages": [{"role": "user", "content": HISTORY},
                                           {"role": "user", "content": f"step {i}"}]},
               "chat", "m", None, None, "t", None, 0.0, program=program)


async def taught(g: Gate, fleet: Fleet, clock: Clock) -> str:
    """Three turns of P, 2 s apart, the last just ended: its replica, context held."""
    pool = list(fleet.replicas.values())
    home = ""
    for i in range(3):
        home = answered(g, await g.admit(grown(i, P), pool))
        clock.t += 2.0
    home = answered(g, await g.admit(grown(3, P), pool))
    assert g.programs.reserved_tokens(home, clock.t) == 1000
    return home


def busy_at(fleet: Fleet, clock: Clock, kv_usage: float) -> None:
    """Each replica runs one request and its engine shows `kv_usage`."""
    for name, r in fleet.replicas.items():
        r.in_flight = 1
        fleet.set_snapshot(name, snap(clock, 1.0, kv=kv_usage))


def test_the_reservation_is_fed_once_as_kv_usage_not_again_as_reserved_tokens() -> None:
    # fleetview.py: the held context raises the replica's KV usage (room.py's room), and
    # ReplicaLoad.reserved_tokens (room.py's eviction price) stays 0: counted once
    async def run() -> None:
        g, fleet, clock = world(10.0)
        home = await taught(g, fleet, clock)
        other = next(n for n in fleet.replicas if n != home)
        for name, want in ((home, 0.2 + 1000 / CAPACITY), (other, 0.2)):
            fleet.set_snapshot(name, snap(clock, 1.0, kv=0.2))
            load = g._fleet_view.load(fleet.replicas[name], 1)
            assert (load.kv_usage, load.reserved_tokens) == (want, 0.0)
    asyncio.run(run())


def test_a_stranger_waits_for_room_a_programs_own_turn_goes_home_at_once() -> None:
    # both replicas busy at 0.9 of their KV: the held context (0.1) fills the program's
    # replica for anyone else; the program's own next turn ends its hold before the gate
    # reads a load, so it is never charged for its own context
    async def run() -> None:
        g, fleet, clock = world(10.0, own_wait_s=0.0)
        home = await taught(g, fleet, clock)
        other = next(n for n in fleet.replicas if n != home)
        busy_at(fleet, clock, 0.9)
        pool = list(fleet.replicas.values())
        waiting = asyncio.ensure_future(g.admit(turn("someone new", None), pool))
        await asyncio.sleep(0)  # it queues: P's replica reads full, and it shares the
        clock.t += 0.01  # chat template's first block with P there (room.py's "own", no wait)
        stranger = await asyncio.wait_for(waiting, 5)
        assert stranger.replica == other
        g.done(stranger)
        own = await asyncio.wait_for(g.admit(grown(4, P), pool), 5)
        assert (own.replica, own.queued_ms) == (home, None)
        await g.aclose()
    asyncio.run(run())


def test_a_program_back_from_its_tool_call_is_not_charged_for_anothers_hold() -> None:
    # P and Q both ran on the same replica and are both in a tool call; Q comes back
    # while P's context (0.1 of the KV) would make the replica read full: Q still goes to
    # its own history at once, while a newcomer would not
    q = ProgramId("t", "run-2", "session")

    async def run() -> None:
        g, fleet, clock = world(10.0)
        home = await taught(g, fleet, clock)
        pool = list(fleet.replicas.values())
        assert answered(g, await g.admit(grown(10, q), pool)) == home
        busy_at(fleet, clock, 0.9)
        back = await asyncio.wait_for(g.admit(grown(11, q), pool), 5)
        assert (back.replica, back.queued_ms) == (home, None)
        assert g.programs.reserved_tokens(home, clock.t) == 1000  # P's, still held
        await g.aclose()
    asyncio.run(run())
