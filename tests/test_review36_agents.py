"""Outside review of issue 36 (agentfin): the other tenant, and faults while a program's
context is held on its replica (gateway/agents/reserve.py, through the gate's fleet view).

- the context reserved on a replica is summed without bound: one tenant's programs may
  reserve more than the replica's whole KV cache, which then reads full to every other
  tenant's newcomer (and to no program of that tenant coming back: returning programs see
  no reservation at all);
- a replica that restarted (its cache empty) is still believed to hold the context."""

from __future__ import annotations

import asyncio

from gateway.admission.config import AdmissionConfig
from gateway.admission.gate import Ask, Gate
from gateway.agents.gaps import GapLearner
from gateway.agents.programs import ProgramId
from gateway.agents.reserve import Reservations, kv_with_reserved
from gateway.replicas.fleet import Fleet
from gateway.routing.config import RoutingConfig
from gateway.routing.router import Router
from gateway.settings import ReplicaSettings
from gateway.usage.metrics import GatewayMetrics
from gateway.usage.snapshot import EngineSnapshot
from tests.test_admission_engine import Clock, snap
from tests.test_agent_gate import CAPACITY, answered, world


def said(text: str, tenant: str, program: ProgramId | None) -> Ask:
    return Ask({"model": "m", "messages": [{"role": "user", "content": text}]}, "chat", "m",
               None, None, tenant, None, 0.0, program=program)


def test_one_tenants_programs_do_not_fill_every_replica_for_another_tenant() -> None:
    """Tenant B runs 24 programs (1,000-token contexts, 24,000 tokens in all: more than
    the two replicas' caches hold together, 2 x 10,000) and each is in a tool call. Both
    replicas run a request at 0.2 of their KV. Tenant A's new conversation should not be
    held in the queue for B's reservations: held context beyond what the cache can keep
    protects nothing, and B's programs alone should not close the fleet to A."""
    async def run() -> tuple[float | None, list[float | None]]:
        g, fleet, clock = world(10.0, own_wait_s=0.0)
        pool = list(fleet.replicas.values())
        # one of B's programs teaches the prior: its tool calls take 2 s
        teacher = ProgramId("B", "teacher", "session")
        for i in range(3):
            answered(g, await g.admit(said(f"teacher step {i}", "B", teacher), pool))
            clock.t += 2.0
        for i in range(24):  # half on each replica
            p = ProgramId("B", f"run-{i}", "session")
            answered(g, await g.admit(said(f"program {i} turn 1", "B", p), [pool[i % 2]]))
        for name, r in fleet.replicas.items():
            r.in_flight = 1
            fleet.set_snapshot(name, snap(clock, 1.0, kv=0.2), in_flight=1)
        kvs = [g._fleet_view.load(r, 1).kv_usage for r in pool]
        newcomer = asyncio.create_task(g.admit(said("tenant A's question", "A", None), pool))
        for _ in range(100):  # a few rechecks, bounded
            if newcomer.done():
                break
            await asyncio.sleep(0.001)
        queued_ms = newcomer.result().queued_ms if newcomer.done() else -1.0
        newcomer.cancel()
        await asyncio.gather(newcomer, return_exceptions=True)
        await g.aclose()
        return queued_ms, kvs
    queued_ms, kvs = asyncio.run(run())
    # on the branches both replicas read a KV usage of 1.4 (0.2 + 12 x 1,000 / 10,000)
    assert queued_ms is None, f"A's newcomer held by B's reservations (kv {kvs})"


def test_the_context_reserved_on_a_replica_is_at_most_its_kv_capacity() -> None:
    # the same, as the pure figures: 30 programs of 1,000 tokens on a 10,000-token cache
    learner = GapLearner()
    for i in range(8):
        learner.observe(("B", "teacher"), 2.0, 100.0 + i)
    res = Reservations(max_s=10.0, s_per_token=lambda _: 0.01, learner=learner)
    for i in range(30):
        res.ended(ProgramId("B", f"run-{i}", "session"), "a", 1000, 110.0)
    held = res.reserved_tokens("a", 110.5)
    usage = kv_with_reserved(0.2, held, CAPACITY)
    assert usage is not None
    assert usage <= 1.0, f"{held} tokens held on a {CAPACITY}-token cache: usage {usage}"


def test_a_replica_that_restarted_holds_no_programs_context() -> None:
    """A program's turn ended on its replica; the engine restarts (the router takes it
    as new: its prefix index cleared). Its cache is empty: nothing is held there, and
    the replica should not read KV usage for a context it no longer has."""
    async def run() -> tuple[int, float | None]:
        g, fleet, clock = world(10.0)
        pool = list(fleet.replicas.values())
        p = ProgramId("t", "run-1", "session")
        home = ""
        for i in range(4):  # three gaps of 2 s, the last turn just ended
            home = answered(g, await g.admit(said(f"step {i}", "t", p), pool))
            if i < 3:
                clock.t += 2.0
        assert g.programs.reserved_tokens(home, clock.t) == 1000
        g.router.replica_restarted(home, clock.t)
        fleet.set_snapshot(home, snap(clock, 1.0, kv=0.2), in_flight=1)
        kv = g._fleet_view.load(fleet.replicas[home], 1).kv_usage
        await g.aclose()
        return g.programs.reserved_tokens(home, clock.t), kv
    held, kv = asyncio.run(run())
    assert (held, kv) == (0, 0.2), f"{held} tokens still held after a restart (kv {kv})"


def test_one_tenants_gaps_do_not_decide_anothers_reservation() -> None:
    """The prior (the fleet's recent gaps) stands for a program with fewer than 4 gaps
    of its own, whatever its tenant: tenant B's gaps decide whether tenant A's new
    program holds a replica. B returning at once after long idle spells (gaps of 800 s)
    turns A's holds off; B's 1 s gaps turn them on."""
    def a_holds(b_gap: float) -> bool:
        learner = GapLearner()
        for i in range(64):
            learner.observe(("B", f"b{i}"), b_gap, 100.0)
        res = Reservations(max_s=10.0, s_per_token=lambda _: 0.01, learner=learner)
        res.ended(ProgramId("A", "a-run", "session"), "r", 1000, 100.0)
        return res.reserved_tokens("r", 100.5) > 0
    assert a_holds(1.0) == a_holds(800.0), "tenant B's gaps decide tenant A's hold"


def test_the_miss_cost_is_priced_at_the_replicas_measured_prefill_rate() -> None:
    """reserve.py: a program holds while its expected wait is below "the seconds to
    prefill its context again at the replica's prefill rate"; the gate prices it at the
    routing cost model's rate (33 us a token) whatever the engine was measured doing. An
    engine measured prefilling 200 tokens/s (5 ms a token: a 1,000-token context costs 5 s
    again) and a program whose tool calls take 2 s: its context should be held."""
    async def run() -> int:
        routing = RoutingConfig()  # the cost model's default rate
        fleet = Fleet([ReplicaSettings(name=n, url=f"http://{n}:8000", models=("m",),
                                       capacity_tokens=CAPACITY) for n in ("a", "b")])
        for r in fleet.replicas.values():
            r.healthy = True
        clock = Clock()
        g = Gate(AdmissionConfig(enabled=True), routing, Router(routing), GatewayMetrics(),
                 clock, clock, fleet=fleet, scrape_interval_s=5.0)
        # two busy scrapes 10 s apart (two scrape intervals: folds farther apart than a
        # scrape stays fresh pair nothing, engine.py): 2,000 prompt tokens computed (200
        # tokens/s), then an idle one with nothing more computed (it keeps the rate)
        for ts, total, waiting in ((0.0, 10_000.0, 2.0), (10.0, 12_000.0, 2.0),
                                   (11.0, 12_000.0, 0.0)):
            clock.t = 1000.0 + ts
            for name, r in fleet.replicas.items():
                fleet.set_snapshot(name, EngineSnapshot(clock.t, 0.2, 1.0, waiting, None, 0.0,
                                                        total, None, None, None))
                g._load(r)
        assert all(g._load(r).prefill_s_per_token == 0.005 for r in fleet.replicas.values())
        pool = list(fleet.replicas.values())
        p = ProgramId("t", "run-1", "session")
        home = ""
        for i in range(4):  # gaps of 2 s, the last turn just ended
            home = answered(g, await g.admit(said(f"step {i}", "t", p), pool))
            if i < 3:
                clock.t += 2.0
        await g.aclose()
        return g.programs.reserved_tokens(home, clock.t)
    assert asyncio.run(run()) == 1000


def test_a_returning_program_is_exempt_only_where_its_history_is() -> None:
    """fleetview.py exempts a program back from its tool call from every reservation
    ("its history there"), on every replica: program Q, whose history is on the other
    replica (full now), moves onto P's replica, which reads full to anyone else because
    of P's held context, and evicts it, charged for nothing. On a replica that is not its
    own it should see P's reservation as a newcomer does (and wait, here)."""
    async def run() -> tuple[str, str | None, float | None]:
        g, fleet, clock = world(10.0, own_wait_s=0.0)
        pool = list(fleet.replicas.values())
        p = ProgramId("t", "run-P", "session")
        home = ""
        for i in range(4):  # P's gaps of 2 s learnt; its last turn just ended on `home`
            home = answered(g, await g.admit(said(f"P step {i}", "t", p), pool))
            if i < 3:
                clock.t += 2.0
        assert g.programs.reserved_tokens(home, clock.t) == 1000
        other = next(n for n in fleet.replicas if n != home)
        q = ProgramId("t", "run-Q", "session")
        answered(g, await g.admit(said("Q step 0", "t", q), [fleet.replicas[other]]))
        for name, kv in ((home, 0.9), (other, 0.99)):  # P's hold fills home (0.9 + 0.1)
            fleet.replicas[name].in_flight = 1
            fleet.set_snapshot(name, snap(clock, 1.0, kv=kv), in_flight=1)
        back = asyncio.create_task(g.admit(said("Q step 1", "t", q), pool))
        for _ in range(50):  # a few rechecks, bounded
            if back.done():
                break
            await asyncio.sleep(0.001)
        went = back.result().replica if back.done() else None
        queued_ms = back.result().queued_ms if back.done() else -1.0
        back.cancel()
        await asyncio.gather(back, return_exceptions=True)
        await g.aclose()
        return home, went, queued_ms
    home, went, queued_ms = asyncio.run(run())
    assert went != home, f"Q went onto P's held replica ({queued_ms} ms queued)"
