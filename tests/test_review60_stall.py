"""Outside review of b5f509b (prefillrate.py `PrefillRate.stalled` / `flat_since`; fleetview.py
reads `engine_stuck` and the drain from `rate.stalled(per_token * largest)`: a flat prompt
counter beside a queue is a stall only once flat for longer than the largest prompt in
flight there takes to prefill).

Its three breaks (a flat spell before the queue counted into a stall, the same through
fleetview.py, and a stall window without a bound) are fixed and their tests plain; the
other plain ones pin properties of the
change no earlier test pinned, each naming the mutation it catches. The branch the
review found unreachable (`prev_ts if flat` in `learn_rate`) is reached since the fix
(a flat pair after a scrape without a queue), and tests/test_review59_room.py's table
catches its mutation to `ts`."""

from __future__ import annotations

import dataclasses
import math

import pytest

from gateway.admission.fleetview import FleetView
from gateway.admission.prefillrate import PrefillRate, learn_rate
from gateway.admission.room import ReplicaLoad, RoomLimits, has_room
from gateway.replicas.fleet import Fleet
from gateway.routing.config import RoutingConfig
from gateway.routing.router import Router
from gateway.settings import ReplicaSettings
from gateway.usage.snapshot import EngineSnapshot
from tests.room_builders import LIMITS
from tests.test_admission_engine import Clock

HIGH = RoomLimits(math.inf, math.inf, LIMITS.kv_usage_limit)  # gate.py's `high`
COST_MODEL = RoutingConfig().prefill_s_per_token  # the cost model's (~30k tokens a second)
MAX_GAP = 15.0
SIX_S = 6.0 / COST_MODEL  # a prompt of 6 s' prefill at the cost model's rate


def _fold(rate: PrefillRate, scrapes: list[tuple[float, float | None, float]]) -> PrefillRate:
    for ts, prompt, waiting in scrapes:
        rate = learn_rate(rate, ts, prompt, 0.0 if prompt is not None else None, waiting,
                          COST_MODEL, MAX_GAP)
    return rate


def _load(stuck: bool, waiting: float = 2.0, largest: float = 100_000.0) -> ReplicaLoad:
    return ReplicaLoad("a", in_flight=3, queued_prefill_tokens=4_000.0, kv_usage=0.4,
                       occupancy=3.0 + waiting, engine_waiting=waiting, seq_limit=256,
                       largest_prompt_tokens=largest, engine_stuck=stuck)


def _fleet_view() -> tuple[Fleet, FleetView, Clock]:
    fleet = Fleet([ReplicaSettings(name="a", url="http://a:8000", models=("m",))])
    fleet.replicas["a"].healthy = True
    clock = Clock()
    return fleet, FleetView(fleet, Router(RoutingConfig()), clock, MAX_GAP, None), clock


def _scrape(clock: Clock, prompt: float | None, waiting: float,
            running: float = 1.0) -> EngineSnapshot:
    return EngineSnapshot(clock.t, 0.3, running, waiting, None, None, prompt, None, None,
                          None)


# -- breaks ------------------------------------------------------------------------------

IDLE_THEN_LONG_PREFILL = (
    [(5.0 * i, 9_000.0, 0.0) for i in range(13)]  # idle (or decode only) for 60 s
    # a 100k prompt arrives at ~62 s and begins its prefill; two requests wait behind it
    + [(65.0, 9_000.0, 2.0), (70.0, 9_000.0, 2.0)])


def test_a_long_prefill_after_an_idle_spell_is_not_read_as_a_stall() -> None:
    """Break (fixed): flat_since counts the flat run from the last time the counter moved,
    however long before the queue (and the long prompt) arrived: an engine idle (or only
    decoding) for 60 s, then a 100k-token prompt prefilling at 10k tok/s (10 s) with two
    requests behind it, reads `stalled(10)` True 5 s into that prefill (70 - 0 > 10) and
    the replica closes to every class, `high` included: exactly the case b5f509b set out
    to fix, in its commonest form (a quiet replica, then a long prompt). The flat run
    that can say 'stalled' starts no earlier than the queue (or the largest prompt's
    arrival)"""
    rate = _fold(PrefillRate(tokens_per_s=10_000.0), IDLE_THEN_LONG_PREFILL)
    per_token = rate.s_per_token()
    assert per_token == pytest.approx(1e-4)
    assert rate.began_nothing
    prefill_s = 100_000.0 * per_token
    assert not rate.stalled(prefill_s), (
        f"flat since {rate.flat_since}, queue only since 65 s: a 10 s prefill read as stalled")


def test_the_fleet_view_does_not_close_a_replica_that_was_idle_before_a_long_prefill(
        ) -> None:
    """Break (fixed): the same break through fleetview.py: a replica measured prefilling
    10k tokens a second under a queue, then idle (counter flat, no queue) for 5 minutes,
    then a 100k-token prompt in flight (10 s at that rate) and two requests waiting
    behind it: the second scrape with the queue reads `engine_stuck` (flat since the
    idle spell began) and `has_room(high)` is False 5 s into the prefill"""
    fleet, fv, clock = _fleet_view()
    r = fleet.replicas["a"]
    for prompt in (0.0, 50_000.0):  # busy: 50k tokens in 5 s under a queue
        fleet.set_snapshot("a", _scrape(clock, prompt, 3.0), in_flight=3)
        fv.load(r, 3, largest=20_000.0)
        clock.t += 5.0
    for _ in range(60):  # then idle for 5 minutes, scraped every 5 s
        fleet.set_snapshot("a", _scrape(clock, 50_000.0, 0.0, running=0.0), in_flight=0)
        fv.load(r, 0, largest=0.0)
        clock.t += 5.0
    for running in (1.0, 2.0):  # the long prompt prefilling, two waiting behind it
        fleet.set_snapshot("a", _scrape(clock, 50_000.0, 2.0, running), in_flight=3)
        ld = fv.load(r, 3, largest=100_000.0)
        clock.t += 5.0
    assert ld.prefill_s_per_token == pytest.approx(1e-4)
    assert not ld.engine_stuck
    assert has_room(ld, HIGH)


def test_a_starving_engine_is_closed_within_a_minute_of_a_flat_counter() -> None:
    """Break (fixed): the stall window has no upper bound: it is the largest prompt in
    flight (a decoding one too, and counting its cached prefix) at the rate measured
    under a queue, and that rate is the prompt counter's movement, which slows exactly
    as an engine starves (waiting requests held for KV blocks: few prompts begin). An
    engine seen admitting ~220 prompt tokens/s under a queue, with a 32k prompt in
    flight (decoding), reads a window of ~145 s: a standing queue beside a counter flat
    for a minute keeps the replica open, and `high` is sent into a queue the engine does
    not move (before b5f509b: closed after two scrapes, 5 s)"""
    # under a queue, the counter moves ~1,100 tokens per 5 s: measured as its prefill rate
    rising = [(5.0 * i, 1_100.0 * i, 4.0) for i in range(6)]
    flat = [(25.0 + 5.0 * i, 5_500.0, 4.0) for i in range(1, 13)]  # then flat for 60 s
    rate = _fold(PrefillRate(), rising + flat)
    per_token = rate.s_per_token()
    assert per_token is not None and per_token > 1.0 / 300.0  # under 300 tokens a second
    prefill_s = per_token * 32_000.0
    stuck = rate.stalled(prefill_s)
    assert not has_room(_load(stuck, waiting=4.0, largest=32_000.0), HIGH), (
        f"flat 60 s beside a standing queue, window {prefill_s:.0f} s: still open to high")


# -- properties that hold, each catching a mutation ---------------------------------------

@pytest.mark.parametrize(("prefill_s", "stalled"), [
    (math.nan, True),  # unknown: as nothing large in flight
    (-3.0, True),
    (0.0, True),
    (4.99, True),
    (5.0, False),
    (math.inf, False),
])
def test_an_odd_prefill_time_reads_as_nothing_large(prefill_s: float, stalled: bool) -> None:
    """A nan or negative `prefill_s` is read as 0 (two flat scrapes suffice). Mutation
    caught: `self.last_ts - self.flat_since > prefill_s` without the `max` (nan never
    stalls), or `max(prefill_s, 0.0)` (nan first: the same)."""
    rate = _fold(PrefillRate(), [(0.0, 9_000.0, 3.0), (5.0, 9_000.0, 3.0)])
    assert rate.stalled(prefill_s) is stalled


@pytest.mark.parametrize(("prefill_s", "stalled"), [(4.0, True), (6.0, False)])
def test_a_counter_gone_backwards_starts_the_flat_run_afresh(
        prefill_s: float, stalled: bool) -> None:
    """A restart the router missed (the counter back near 0) is no flat scrape: the run
    starts at the scrape that showed it. Mutation caught: `prompt_total <=
    rate.last_prompt` for `==` in `flat` (the reset read as flat: flat since 0 s)."""
    rate = _fold(PrefillRate(), [(0.0, 9_000.0, 3.0), (5.0, 9_000.0, 3.0),
                                 (10.0, 100.0, 3.0), (15.0, 100.0, 3.0)])
    assert rate.flat_since == 10.0
    assert rate.stalled(prefill_s) is stalled


def test_a_restart_the_router_took_starts_the_flat_run_afresh() -> None:
    """fleetview.py drops the replica's rate when the router takes a restart: a flat run
    does not carry across it, even where the new engine's counter reads the same."""
    fleet, fv, clock = _fleet_view()
    r = fleet.replicas["a"]
    for _ in range(4):  # flat 15 s beside a standing queue: stalled
        fleet.set_snapshot("a", _scrape(clock, 9_000.0, 3.0), in_flight=2)
        ld = fv.load(r, 2, largest=SIX_S)
        clock.t += 5.0
    assert ld.engine_stuck
    fv.router.replica_restarted("a", clock.t)
    fleet.set_snapshot("a", _scrape(clock, 9_000.0, 3.0), in_flight=2)
    assert not fv.load(r, 2, largest=SIX_S).engine_stuck  # a new baseline
    clock.t += 5.0
    fleet.set_snapshot("a", _scrape(clock, 9_000.0, 3.0), in_flight=2)
    assert not fv.load(r, 2, largest=SIX_S).engine_stuck  # flat 5 s < 6 s


def test_the_fleet_view_prices_the_window_at_the_measured_rate() -> None:
    """The stall window is the largest prompt at the engine's measured rate (10k tokens a
    second here: 10 s for 100k), not the cost model's (100 s). Mutation caught:
    `per_token = self.router.config.prefill_s_per_token` in `FleetView.load`."""
    fleet, fv, clock = _fleet_view()
    r = fleet.replicas["a"]
    prompt = 0.0
    for i in range(6):  # t 0..25: 50k tokens per 5 s under a queue, then flat
        if i <= 1:
            prompt = 50_000.0 * i
        # the running count moves: no sequence limit is learnt (the guess binds)
        fleet.set_snapshot("a", _scrape(clock, prompt, 3.0, 1.0 + i % 2), in_flight=3)
        ld = fv.load(r, 3, largest=100_000.0)
        assert has_room(ld, HIGH) is not ld.engine_stuck
        assert ld.prefill_s_per_token in (None, pytest.approx(1e-4))
        # flat since 5 s: 10 s at 15 s is the prefill ending; past it at 20 s
        assert ld.engine_stuck is (clock.t - 1000.0 > 15.0), clock.t
        clock.t += 5.0
    assert not has_room(ld, HIGH)


def test_the_drain_of_a_flat_queue_follows_the_stall_reading() -> None:
    """While a long prefill may explain the flat counter, the scraped waiting count drains
    one per largest prefill (6 s here) as the scrape ages; only a stall holds it (drain
    inf). Mutation caught: `drain_s(per_token, largest, rate.began_nothing)` in
    `FleetView.load`."""
    fleet, fv, clock = _fleet_view()
    r = fleet.replicas["a"]
    for _ in range(2):
        fleet.set_snapshot("a", _scrape(clock, 9_000.0, 3.0), in_flight=2)
        ld = fv.load(r, 2, largest=SIX_S)
        clock.t += 5.0
    assert not ld.engine_stuck and ld.engine_waiting == 3.0
    clock.t += 7.5  # the last scrape 12.5 s old: two of its three waiting have begun
    ld = fv.load(r, 2, largest=SIX_S)
    assert not ld.engine_stuck
    assert ld.engine_waiting == 1.0


@pytest.mark.parametrize("scrapes", [
    [(0.0, 9_000.0, 3.0), (5.0, 9_000.0, 3.0)],
    [(0.0, 9_000.0, 3.0), (5.0, 9_000.0, 3.0), (10.0, 9_000.0, 3.0), (15.0, 9_000.0, 4.0)],
    [(0.0, 8_000.0, 3.0), (5.0, 9_000.0, 3.0), (10.0, 9_000.0, 3.0)],
    [(0.0, 9_000.0, 3.0), (5.0, 9_000.0, 2.0)],
    [(0.0, 9_000.0, 3.0), (30.0, 9_000.0, 3.0)],
])
@pytest.mark.parametrize("prefill_s", [0.0, 4.0, 10.0])
def test_whatever_holds_high_holds_a_lower_class(
        scrapes: list[tuple[float, float, float]], prefill_s: float) -> None:
    """Across the stall readings: a stall closes the replica to `high` and to `normal`
    alike, and `normal` never has room where `high` has none (tests/test_room_past_order.py).
    Mutation caught: a class exempt from the stuck rule in room.py `has_room`."""
    rate = _fold(PrefillRate(), scrapes)
    ld = _load(rate.stalled(prefill_s), waiting=rate.last_waiting or 1.0, largest=0.0)
    ld = dataclasses.replace(ld, queued_prefill_tokens=0.0)
    if ld.engine_stuck:
        assert not has_room(ld, HIGH) and not has_room(ld, LIMITS)
    assert has_room(ld, HIGH) or not has_room(ld, LIMITS)


def test_a_replica_that_fails_in_the_window_takes_nothing_from_the_gate() -> None:
    """A replica read open because a long prefill may explain its flat counter, then
    marked down: the gate's pool drops it and its load has no room for any class."""
    fleet, fv, clock = _fleet_view()
    r = fleet.replicas["a"]
    for running in (1.0, 2.0):  # the running count moves: no sequence limit is learnt
        fleet.set_snapshot("a", _scrape(clock, 9_000.0, 2.0, running), in_flight=3)
        ld = fv.load(r, 3, largest=2 * SIX_S)
        clock.t += 5.0
    assert not ld.engine_stuck and has_room(ld, HIGH)
    r.healthy = False
    with pytest.raises(Exception):  # noqa: B017 - the fleet's 503, whatever its class
        fv.pool("m", None, [r])
    assert fv.pool("m", "a", [r]) == []
    assert not has_room(fv.load(r, 3, largest=2 * SIX_S), HIGH)
