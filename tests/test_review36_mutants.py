"""Outside review of issue 36: tests for the decisions whose mutation the branches' own
tests let through (each passes on the branches and fails under the mutation named).

room.py `bind`: going past the room when holding for another of its own replicas is
cheaper (with and without a replica with room); gate.py `_projected_s`: the fleet floor
counts healthy replicas only, and a follow-up that goes past at once is projected at the
queue there; agents: an entry forgotten after its TTL, no negative gap, no gap longer
than the TTL learnt, the context held where the turn was served."""

from __future__ import annotations

import asyncio
import math

import pytest

from gateway.admission.config import AdmissionConfig
from gateway.admission.gate import Gate
from gateway.admission.room import ReplicaLoad, RoomLimits, bind, reserved
from gateway.admission.shares import Flow
from gateway.agents.gaps import GapLearner
from gateway.agents.programs import ProgramId
from gateway.agents.reserve import Reservations
from gateway.routing.config import RoutingConfig
from gateway.routing.router import Router
from gateway.usage.metrics import GatewayMetrics
from tests.test_admission_engine import Clock
from tests.test_agent_gate import turn, world

LIMITS = reserved(RoomLimits(math.inf, 32_768, 0.97), 0.75, 0.5)  # `normal`'s: 16,384
PER_TOKEN = 0.001
IN_FLIGHT_S = 0.004

# two replicas hold its 12k-token history: `a` full by queued prefill alone (30k queued,
# passable: under 2 x 16,384), `a2` full by its sequences with nothing queued (room in
# a few milliseconds: its wait is `in_flight_s` per sequence over)
A = ReplicaLoad("a", in_flight=2, queued_prefill_tokens=30_000.0, kv_usage=0.5,
                predicted_tokens=12_000, largest_prompt_tokens=14_000.0)
A2 = ReplicaLoad("a2", in_flight=8, queued_prefill_tokens=0.0, kv_usage=0.5,
                 predicted_tokens=12_000, occupancy=8.0, engine_waiting=0.0, seq_limit=8)


@pytest.mark.parametrize(("other", "prior_s", "why"), [
    # no replica with room: holding for a2 (~2 s) beats 30k queued on a (32 s)
    (ReplicaLoad("b", in_flight=8, queued_prefill_tokens=0.0, occupancy=8.0,
                 engine_waiting=0.0, seq_limit=8), 0.0, "full"),
    # b has room but moving costs 35 s (16k queued + 14k recomputed + a 5 s prior):
    # past (32 s) is cheaper than moving, holding for a2 cheaper still
    (ReplicaLoad("b", in_flight=1, queued_prefill_tokens=16_000.0, kv_usage=0.5),
     5.0, "own"),
])
def test_a_follow_up_holds_for_its_other_own_replica_when_that_is_cheaper_than_past(
        other: ReplicaLoad, prior_s: float, why: str) -> None:
    b = bind([A, A2, other], LIMITS, PER_TOKEN, IN_FLIGHT_S, 0.0, 2.0, prior_s, 14_000.0,
             2.0)
    assert b.why == why, b


def gate() -> Gate:
    routing = RoutingConfig()
    clock = Clock()
    return Gate(AdmissionConfig(enabled=True), routing, Router(routing), GatewayMetrics(),
                clock, clock)


FLOW: Flow = ("normal", "t")


def test_the_fleet_floor_counts_healthy_replicas_only() -> None:
    # no drain measured yet: 60k tokens ahead, one healthy replica of four at the cost
    # model's rate (33 us a token): about 2 s, not a quarter of it
    g = gate()
    loads = [ReplicaLoad(f"r{i}", in_flight=64, queued_prefill_tokens=0.0, occupancy=64.0,
                         engine_waiting=0.0, seq_limit=64, healthy=i == 0)
             for i in range(4)]
    projected = g._projected_s(FLOW, 1000.0, {FLOW: 59_000.0}, loads, LIMITS, 1000.0)
    assert projected == pytest.approx(60_000 * g._per_token, rel=0.01)


def test_a_follow_up_that_goes_past_at_once_is_projected_at_the_queue_there() -> None:
    # 10M tokens wait in the gateway, but its own replica (full by the gateway's queued
    # prefill alone) takes it past the room now: it waits for the 18k tokens queued
    # there (0.59 s), not for the gateway's queue (with no replica with room, holding
    # costs the same queue: room.py goes past on the tie)
    g = gate()
    own = ReplicaLoad("a", in_flight=2, queued_prefill_tokens=18_000.0, kv_usage=0.5,
                      predicted_tokens=12_000, largest_prompt_tokens=14_000.0)
    other = ReplicaLoad("b", in_flight=8, queued_prefill_tokens=0.0, occupancy=8.0,
                        engine_waiting=0.0, seq_limit=8)
    projected = g._projected_s(FLOW, 14_000.0, {FLOW: 10_000_000.0}, [own, other], LIMITS,
                               1000.0)
    assert projected == pytest.approx(18_000 * g._per_token)


P = ProgramId("t", "run-1", "session")


def test_a_program_between_turns_is_forgotten_after_the_ttl() -> None:
    res = Reservations(max_s=10.0, s_per_token=lambda _: 0.01)
    res.ended(P, "r", 1000, 100.0)
    assert len(res) == 1
    res.reserved_tokens("r", 100.0 + res.learner.ttl_s + 1.0)
    assert len(res) == 0


def test_no_negative_gap_is_learnt() -> None:
    # a wall clock stepped back between a turn's end and the next request
    learner = GapLearner()
    learner.observe(("t", "run-1"), -5.0, 100.0)
    assert (len(learner), tuple(learner.samples(("t", "run-1"), 100.0))) == (0, ())


def test_a_return_later_than_the_ttl_teaches_no_gap() -> None:
    res = Reservations(max_s=10.0, s_per_token=lambda _: 0.01)
    res.ended(P, "r", 1000, 100.0)
    late = 100.0 + res.learner.ttl_s + 100.0
    assert res.began(P, late)  # still between turns (nothing expired it meanwhile)
    assert tuple(res.learner.samples(P.program_key(), late)) == ()


def test_the_context_is_held_where_the_turn_was_served() -> None:
    # the turn's outcome names the replica that served it (a retry moved it there)
    async def run() -> tuple[int, int]:
        g, fleet, clock = world(10.0)
        pool = list(fleet.replicas.values())
        for i in range(3):  # gaps of 2 s learnt
            t = await g.admit(turn(f"step {i}", P), pool)
            t.plan.outcome.ok, t.plan.outcome.prompt_tokens = True, 900
            g.done(t)
            clock.t += 2.0
        t = await g.admit(turn("last", P), pool)
        assert t.replica is not None
        served = next(n for n in fleet.replicas if n != t.replica)
        o = t.plan.outcome
        o.ok, o.prompt_tokens, o.completion_tokens, o.replica = True, 900, 100, served
        g.done(t)
        await g.aclose()
        return (g.programs.reserved_tokens(served, clock.t),
                g.programs.reserved_tokens(t.replica, clock.t))
    assert asyncio.run(run()) == (1000, 0)
