"""Outside review of issue 36: odd engine figures and the decisions' bounds, by tables.

- `cost_past` / `wait_past` price the gateway's own queued prefill only, not the
  engine's waiting queue that `passable` lets a follow-up join;
- the projected wait an arrival is shed on is floored at the fleet's nominal prefill
  rate even when the queue was measured draining far slower (sequence-bound overload);
- one scrape whose prompt-token counter leaps makes the measured prefill rate absurd, and
  with it the shedding floor: nothing is shed for its wait;
- the work of one read of a replica's reserved context grows with every program between
  turns times the fleet's gap prior."""

from __future__ import annotations

import asyncio
import dataclasses
import math
from collections.abc import Iterable, Sequence

import pytest

from gateway.admission.config import AdmissionConfig
from gateway.admission.gate import Gate
from gateway.admission.room import (
    ReplicaLoad,
    bind,
    cost_past,
    passable,
)
from gateway.admission.shares import Flow
from gateway.agents import gaps, reserve
from gateway.agents.gaps import GapLearner
from gateway.agents.programs import ProgramId
from gateway.agents.reserve import Reservations
from gateway.replicas.fleet import Fleet
from gateway.routing.config import RoutingConfig
from gateway.routing.router import Router
from gateway.settings import ReplicaSettings
from gateway.usage.metrics import GatewayMetrics
from gateway.usage.snapshot import EngineSnapshot
from tests.room_builders import LIMITS, PER_TOKEN, full_own
from tests.test_admission_engine import Clock


def own(waiting: float) -> ReplicaLoad:
    """A follow-up's own replica, full by the gateway's queued prefill alone (20k of a
    16,384 room), its engine running 100 sequences of the 800 it has shown and holding
    `waiting` more in its queue (long prompts waiting for the token budget)."""
    return full_own(kv=0.5, occupancy=100.0 + waiting, waiting=waiting, seq_limit=800)


@pytest.mark.parametrize("waiting", [50.0, 200.0, 400.0])
def test_the_price_of_going_past_the_room_counts_the_engines_queue(waiting: float) -> None:
    # `passable` ignores the engine's waiting queue; the follow-up joins it behind
    # `waiting` requests the gateway never counted (other clients', or begun-by-estimate)
    ld = own(waiting)
    assert passable(ld, LIMITS, 14_000.0, 2.0)
    assert cost_past(ld, PER_TOKEN, 14_000.0) > cost_past(own(0.0), PER_TOKEN, 14_000.0)


@pytest.mark.parametrize(("waiting", "past"), [(0.0, True), (400.0, False)])
def test_a_follow_up_is_not_sent_past_into_a_long_engine_queue_rather_than_moved(
        waiting: float, past: bool) -> None:
    # `b` has room and holds none of it: moving costs 10k queued there + 14k recomputed
    # (24 s); its own replica: 20k queued by this gateway (22 s past the room). With 400
    # requests waiting in its engine as well (long prompts held by the token budget),
    # going past is priced the same 22 s and still chosen over moving
    b = ReplicaLoad("b", in_flight=1, queued_prefill_tokens=10_000.0, kv_usage=0.5,
                    occupancy=10.0, engine_waiting=0.0, seq_limit=800)
    binding = bind([own(waiting), b], LIMITS, PER_TOKEN, 0.004, 0.0, 2.0, 0.0, 14_000.0,
                   2.0)
    assert (binding.why == "past") is past, binding


def gate() -> Gate:
    routing = RoutingConfig()
    clock = Clock()
    return Gate(AdmissionConfig(enabled=True), routing, Router(routing), GatewayMetrics(),
                clock, clock)


def seq_bound(name: str) -> ReplicaLoad:
    # every sequence busy (long decodes); the prefill engine itself is idle
    return ReplicaLoad(name, in_flight=64, queued_prefill_tokens=0.0, kv_usage=0.5,
                       occupancy=64.0, engine_waiting=0.0, seq_limit=64)


def test_a_measured_slow_drain_is_not_overridden_by_the_fleets_prefill_rate() -> None:
    """The queue was measured draining 1,000 tokens/s for 20 s (sequences free slowly);
    60,000 tokens wait ahead of an arrival: 60 s at the measured rate, beyond normal's
    30 s limit, so it is shed at once (429 + Retry-After). The floor (4 replicas at the
    cost model's 30k tokens/s each) projects 0.5 s, and the arrival waits 30 s for a
    wait_timeout instead."""
    g = gate()
    for i in range(20):
        g._drain.add(1000.0 + i, 1000.0)
    loads = [seq_bound(f"r{i}") for i in range(4)]
    flow: Flow = ("normal", "t")
    projected = g._projected_s(flow, 1000.0, {flow: 59_000.0}, loads,
                               g._limits("normal", 1019.0), 1019.0)
    assert projected > 30.0, f"projected {projected:.2f} s against a measured ~60 s"


def snapshot(ts: float, prompt_total: float, waiting: float) -> EngineSnapshot:
    return EngineSnapshot(ts, 0.5, 4.0, waiting, None, 0.0, prompt_total, None, None, None)


def test_one_scrape_whose_counter_leaps_does_not_disable_shedding_by_wait() -> None:
    """Two scrapes 1 s apart whose prompt-token counter leaps by 1e12 (an exporter's
    glitch, a counter summed across processes): the engine is believed to prefill 1e12
    tokens/s, then the fleet floor projects any queue at ~0 s and nothing is shed for its
    wait. A rate no GPU reaches should not be believed."""
    async def run() -> float:
        routing = RoutingConfig()
        fleet = Fleet([ReplicaSettings(name="a", url="http://a:8000", models=("m",))])
        r = fleet.replicas["a"]
        r.healthy = True
        clock = Clock()
        g = Gate(AdmissionConfig(enabled=True), routing, Router(routing), GatewayMetrics(),
                 clock, clock, fleet=fleet, scrape_interval_s=1.0)
        fleet.set_snapshot("a", snapshot(clock.t, 1e6, 0.0))
        g._load(r)
        clock.t += 1.0
        fleet.set_snapshot("a", snapshot(clock.t, 1e12, 0.0))
        ld = dataclasses.replace(g._load(r), in_flight=8)
        flow: Flow = ("normal", "t")
        await g.aclose()
        return g._projected_s(flow, 1000.0, {flow: 10_000_000.0}, [ld],
                              g._limits("normal", clock.t), clock.t)
    projected = asyncio.run(run())
    # 10M tokens: more than 5 minutes at any engine's real prefill rate
    assert projected > 30.0, f"10M tokens ahead projected at {projected:.6f} s"


def test_one_read_of_a_replicas_reserved_context_is_bounded_work(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """4,096 programs (the map's bound) in a tool call on 4 replicas, none with 4 gaps of
    its own: each read of one replica's reserved tokens (every load the gate reads: each
    arrival, each dispatch pass every `recheck_s`, each release) sorted the 512-gap prior
    once per program there, ~0.5 M gap samples per read, ~2 M per pass (measured: 0.66 s
    for one pass over 4 replicas on this machine, the event loop blocked). Counted now:
    the samples sorted, and what a bisection examines per program (log2 of the gaps)."""
    examined = [0]
    real_wait, real_sorted = reserve.remaining_wait, sorted

    def counting(samples: Sequence[float], elapsed: float, q: float = 0.5) -> float | None:
        examined[0] += math.ceil(math.log2(len(samples) + 1))
        return real_wait(samples, elapsed, q)

    def counting_sort(items: Iterable[float]) -> list[float]:
        out = real_sorted(items)
        examined[0] += len(out)
        return out
    monkeypatch.setattr(reserve, "remaining_wait", counting)
    monkeypatch.setattr(gaps, "sorted", counting_sort, raising=False)
    learner = GapLearner()
    for i in range(600):  # the prior full: 512 gaps of 2 to 4 s
        learner.observe(("B", f"teacher-{i % 3}"), 2.0 + (i % 7) * 0.3, 100.0)
    res = Reservations(max_s=10.0, s_per_token=lambda _: 0.001, learner=learner)
    for i in range(4096):
        res.ended(ProgramId("B", f"run-{i}", "session"), f"r{i % 4}", 5000, 101.0 + i * 1e-4)
    assert res.reserved_tokens("r0", 102.0) > 0
    assert examined[0] <= 100_000, f"one read examined {examined[0]} gap samples"


@pytest.mark.parametrize("past_room", [math.inf, math.nan])
def test_the_past_the_room_bound_is_a_finite_number(past_room: float) -> None:
    # TOML spells both (`inf`, `nan`): inf removes the bound that keeps overload in the
    # gateway's queue (room.py), nan turns "past" off silently; both are accepted now
    with pytest.raises(ValueError, match="own_replica_past_room"):
        AdmissionConfig(enabled=True, own_replica_past_room=past_room)
