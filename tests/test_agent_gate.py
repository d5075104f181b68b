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


def world(max_s: float) -> tuple[Gate, Fleet, Clock]:
    # a slow engine: a 1,000-token context costs 10 s to prefill again
    routing = dataclasses.replace(RoutingConfig(), prefill_s_per_token=0.01)
    fleet = Fleet([ReplicaSettings(name=n, url=f"http://{n}:8000", models=("m",),
                                   capacity_tokens=CAPACITY) for n in ("a", "b")])
    for r in fleet.replicas.values():
        r.healthy = True
    clock = Clock()
    g = Gate(AdmissionConfig(enabled=True, agent_reserve_max_s=max_s), routing,
             Router(routing), GatewayMetrics(), clock, clock, fleet=fleet,
             scrape_interval_s=1.0)
    return g, fleet, clock


def turn(text: str, program: ProgramId | None) -> Ask:
    return Ask({"model": "m", "messages": [{"role": "user", "content": text}]}, "chat", "m",
               None, None, "t", None, 0.0, program=program)


def answered(g: Gate, t: Ticket, ok: bool = True) -> str:
    o = t.plan.outcome
    o.ok, o.prompt_tokens, o.completion_tokens = ok, 900, 100
    g.done(t)
    assert t.replica is not None
    return t.replica


def kv(g: Gate, fleet: Fleet, clock: Clock, name: str) -> float | None:
    fleet.set_snapshot(name, snap(clock, 1.0, kv=0.2))
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
