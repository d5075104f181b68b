"""Review 47 of issue 36's throttle: three of its rules that no test on main caught when
removed (each test here passes on main and fails under the mutation named in its
docstring).

- A scraped waiting count drains at the engine's pace as fleetview.py reads it: one of
  the largest prompts in flight there at the engine's measured prefill rate (engine.py's
  tables pass `drain_s` by hand; dropping it from `FleetView.load`, or pricing it at the
  cost model's rate or one step's tokens, failed nothing).
- The gate sizes its queued-prefill room at the cost model's rate, so an engine measured
  faster holds as many seconds of prefill (room.py's tables build `RoomLimits` by hand;
  the gate building its own without `sized_s_per_token` failed nothing).
- A waiting request the drain counts as begun is still there: it stays in the occupancy,
  counted against the sequence limit (engine.py `view`; reading the occupancy with the
  drained waiting count failed nothing)."""

from __future__ import annotations

import asyncio
import math

import pytest

from gateway.admission.config import AdmissionConfig
from gateway.admission.engine import Capacity, Scrape, view
from gateway.admission.fleetview import FleetView
from gateway.admission.gate import Ask, Gate
from gateway.admission.room import ReplicaLoad, RoomLimits, has_room
from gateway.replicas.fleet import Fleet
from gateway.routing.config import RoutingConfig
from gateway.routing.router import Router
from gateway.settings import ReplicaSettings
from gateway.usage.metrics import GatewayMetrics
from gateway.usage.snapshot import EngineSnapshot


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def snap(ts: float, running: float, waiting: float, prompt_total: float) -> EngineSnapshot:
    return EngineSnapshot(ts, 0.1, running, waiting, None, None, prompt_total, None, None,
                          None)


@pytest.mark.parametrize(("age", "waiting"), [
    (0.01, 2.0),  # not one 14k-token prefill yet (instant drain: 0)
    (0.06, 1.0),  # one (at 8192 tokens each: two; at the cost model's rate: none)
    (0.1, 0.0),  # both (at the cost model's rate: none)
    (10.0, 0.0),  # long begun (no drain: both stand until the next scrape)
])
def test_fleetview_drains_a_waiting_count_at_the_measured_rate_and_largest_prompt(
        age: float, waiting: float) -> None:
    """Mutations caught: fleetview.py passing no `drain_s` to `view` (inf), pricing it at
    the cost model's `prefill_s_per_token` instead of the measured rate, at `STEP_TOKENS`
    instead of the largest prompt in flight, or at 0 (an instant drain)."""
    router = Router(RoutingConfig())
    fleet = Fleet([ReplicaSettings(name="a", url="http://a:8000", models=("m",))])
    a = fleet.replicas["a"]
    a.healthy = True
    clock = Clock()
    fv = FleetView(fleet, router, clock, 15.0, None)
    # two scrapes with a queue both times: measured at 300k tokens/s (10x the cost model)
    fleet.set_snapshot("a", snap(clock.t, 3, 2, 0.0), clock.t, 5)
    fv.load(a, 5, 0.0, 14_000.0)
    clock.t += 5.0
    fleet.set_snapshot("a", snap(clock.t, 4, 2, 1_500_000.0), clock.t, 6)
    fv.load(a, 6, 0.0, 14_000.0)
    clock.t += age
    load = fv.load(a, 6, 0.0, 14_000.0)  # one of 14k tokens the largest in flight there
    assert load.prefill_s_per_token == pytest.approx(1 / 300_000)
    assert load.engine_waiting == waiting


def ask(text: str, ts: float) -> Ask:
    """A request sent at `ts` (the router's clock: its prefill is estimated from there)."""
    return Ask({"model": "m", "messages": [{"role": "user", "content": text}]}, "chat", "m",
               None, None, None, None, ts)


LONG = "lorem ipsum dolor sit amet " * 2200  # about 14k tokens by the router's estimate


@pytest.mark.parametrize(("prefilled", "goes"), [
    (600_000.0, True),  # 120k tokens/s in 5 s: 4x the cost model, 4x the room in tokens
    (0.0, False),  # never measured: `normal`'s 16k tokens, two 14k prompts fill it
])
def test_the_gate_gives_an_engine_measured_faster_more_prefill_room(
        prefilled: float, goes: bool) -> None:
    """Mutation caught: gate.py building its `RoomLimits` without `sized_s_per_token`
    (the room stays at the configured tokens however fast the engine is measured)."""
    async def run() -> tuple[bool, int, float]:
        routing = RoutingConfig()
        router = Router(routing)
        fleet = Fleet([ReplicaSettings(name="a", url="http://a:8000", models=("m",))])
        a = fleet.replicas["a"]
        a.healthy = True
        clock = Clock()
        g = Gate(AdmissionConfig(enabled=True), routing, router, GatewayMetrics(), clock,
                 clock, fleet=fleet, scrape_interval_s=5.0)
        fleet.set_snapshot("a", snap(clock.t, 0, 0, 0.0), clock.t, 0)
        first = await g.admit(ask("hello", clock.t), [a])  # a load read: the first scrape folded
        a.in_flight += 1
        clock.t += 5.0
        fleet.set_snapshot("a", snap(clock.t, 1, 0, prefilled), clock.t, 1)
        clock.t += 0.1
        for i in range(2):  # two long prompts queued there since that scrape
            await g.admit(ask(f"{i} {LONG}", clock.t), [a])
            a.in_flight += 1
        queued = router.queued_tokens("a")
        third = asyncio.create_task(g.admit(ask(f"third {LONG}", clock.t), [a]))
        try:
            # one step of the loop: the task runs to its first wait (the fast path has
            # none: admitted at once) or to its place in the gate's queue
            await asyncio.sleep(0)
            went = third.done() and third.exception() is None
            waiting = g.stats()["queued"]["normal"]
        finally:
            third.cancel()
            await asyncio.gather(third, return_exceptions=True)
            await g.aclose()
        assert first.replica == "a"
        return went, waiting, queued
    went, waiting, queued = asyncio.run(run())
    assert 24_000 < queued < 34_000  # two prompts of about 14k tokens each
    assert (went, waiting) == (goes, 0 if goes else 1)


@pytest.mark.parametrize(("own", "room"), [
    # 6 running + 2 waiting when scraped (4 of them this gateway's, 4 another client's),
    # the waiting long begun: 8 of its 8 sequences taken
    (4, False),
    (3, True),  # one of this gateway's finished since: one free
])
def test_a_waiting_request_the_drain_began_still_takes_a_sequence(
        own: int, room: bool) -> None:
    """Mutation caught: engine.py `view` reading the occupancy as running + the drained
    waiting count (the begun requests vanish from it, and the engine, at its learnt
    limit, is sent two more that wait in its first-come queue)."""
    learnt = Capacity(0.0, 8, 8)  # --max-num-seqs 8, confirmed
    seen = Scrape(10.0, 6, 2, 0.2, 4)
    v = view(seen, learnt, own, now=20.0, max_age_s=15.0, drain_s=0.05)
    assert v.waiting == 0.0  # both counted as begun at the engine's pace
    load = ReplicaLoad("a", own, 0.0, v.kv_usage, occupancy=v.occupancy,
                       engine_waiting=v.waiting, seq_limit=v.seq_limit)
    assert v.occupancy == float(own + 4)
    assert has_room(load, RoomLimits(math.inf, 32_768, 0.97)) is room
