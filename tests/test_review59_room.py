"""Outside review of a6ec647 (room.py: a queue the engine moves closes no room by itself,
only `engine_stuck` does; the prefill room is no longer raised to the waiter's prompt).

The xfail(strict) test is a break found and still open; break 1 (the lower classes'
share floored at the largest prompt in flight) and break 2 (a long prefill in progress
read as a stalled engine) are fixed and their tests plain. The other
plain ones pin the stuck rule: that it needs a waiting count (mutation
`if load.engine_stuck:`, caught by no other test) and that fleetview.py hands
`began_nothing` to the room (`engine_stuck=False` there, also caught by
tests/test_review47_throttle_faults.py)."""

from __future__ import annotations

import asyncio
import dataclasses
import math

import pytest

from gateway.admission.fleetview import FleetView
from gateway.admission.prefillrate import PrefillRate, learn_rate
from gateway.admission.room import ReplicaLoad, RoomLimits, has_room, passable
from gateway.replicas.fleet import Fleet
from gateway.routing.config import RoutingConfig
from gateway.routing.router import Router
from gateway.settings import ReplicaSettings
from gateway.usage.snapshot import EngineSnapshot
from tests.room_builders import LIMITS, ask, two_replicas
from tests.test_admission_engine import Clock, snap

HIGH = RoomLimits(math.inf, math.inf, LIMITS.kv_usage_limit)  # gate.py's `high`
COST_MODEL = 1e-3  # a cost model of 1,000 tokens a second (not RoutingConfig's default)


# -- breaks ------------------------------------------------------------------------------

@pytest.mark.parametrize("queued", [20_000.0, 60_000.0, 95_000.0])
def test_a_lower_class_queues_no_more_than_its_share_where_the_engine_shows_a_queue(
        queued: float) -> None:
    """Break 1 (fixed in 4119081): behind a queue the engine moves, the lower classes'
    prefill share was floored at the largest prompt in flight there (any class, begun or
    decoding): one 100k prompt let them queue up to 100k tokens, 6x their 16k share, and
    a `high` arriving then went in behind all of it. The room is no longer raised."""
    ld = ReplicaLoad("a", in_flight=8, queued_prefill_tokens=queued, kv_usage=0.5,
                     occupancy=20.0, engine_waiting=5.0, seq_limit=256,
                     largest_prompt_tokens=100_000.0, engine_stuck=False)
    assert has_room(ld, HIGH)  # high goes: it will wait behind the queued prefill
    assert not has_room(ld, LIMITS), (
        f"normal adds to {queued:.0f} queued prefill tokens (its share: "
        f"{LIMITS.max_queued_prefill_tokens:.0f}) in an engine showing a queue")


def test_the_gate_sends_a_lower_class_no_more_than_its_share_behind_a_queue() -> None:
    """Break 1 through the gate: a ~105k-token `high` prompt begun on `a` (decoding), the
    engine showing 2 requests waiting (a queue it moves): six ~9.8k-token `normal`
    prompts all went at once (58.5k tokens queued where `normal`'s share is 16,384)."""
    async def run() -> int:
        clock = Clock()  # stands still: the scrapes stay fresh, nothing else begins
        fleet, g = two_replicas(clock)
        fleet.replicas["b"].healthy = False  # one replica: nowhere else to go
        a = fleet.replicas["a"]
        big = await g.admit(ask(b"high", "t", "a very long document " * 20_000, at=clock.t),
                            [a])
        a.in_flight = 1
        clock.t += 0.1
        fleet.set_snapshot("a", snap(clock, 20.0, waiting=0.0), in_flight=1)  # it began
        small = await g.admit(ask(b"high", "t", "hello", at=clock.t), [a])  # reads it
        a.in_flight = 2
        clock.t += 0.1
        fleet.set_snapshot("a", snap(clock, 20.0, waiting=2.0), in_flight=2)  # a queue
        tasks = [asyncio.create_task(g.admit(
            ask(b"normal", "t", f"doc {i} " + "some text here " * 2_600, at=clock.t), [a]))
            for i in range(6)]
        for _ in range(50):  # bounded: until the gate settles
            await asyncio.sleep(0.001)
        went = sum(t.done() and not t.cancelled() and t.exception() is None
                   for t in tasks)
        assert g.router.largest_by_replica()["a"] > 100_000
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for t in (big, small):
            g.done(t)
        await g.aclose()
        return went
    went = asyncio.run(run())
    assert went <= 2, f"{went} normal prompts of ~9.8k tokens went behind the queue"


def test_a_queue_behind_a_long_prefill_in_progress_is_not_read_as_stuck() -> None:
    """Break 2 (fixed): vLLM v1 adds a request's whole prompt to
    vllm:prompt_tokens_total only at its first token (IterationStats.update_from_output:
    no output for a partial chunked prefill), so two scrapes 5 s apart during one
    100k-token prefill (10 s at the 10k tok/s measured there) show the counter flat
    beside the requests waiting for the step's budget; read as a stalled engine, it
    closed the replica to every class, `high` included. A flat counter is a stall only
    once it has been flat for longer than the largest prompt there takes to prefill."""
    rate = PrefillRate(tokens_per_s=10_000.0)
    rate = learn_rate(rate, 0.0, 500_000.0, 0.0, 2.0, COST_MODEL, 15.0)
    rate = learn_rate(rate, 5.0, 500_000.0, 0.0, 2.0, COST_MODEL, 15.0)  # mid-prefill
    per_token = rate.s_per_token()
    assert per_token == pytest.approx(1e-4)
    prefill_s = 100_000.0 * per_token  # the largest prompt there takes 10 s to prefill
    assert rate.began_nothing and not rate.stalled(prefill_s)
    ld = ReplicaLoad("a", in_flight=3, queued_prefill_tokens=4_000.0, kv_usage=0.4,
                     occupancy=5.0, engine_waiting=2.0, seq_limit=256,
                     largest_prompt_tokens=100_000.0,
                     prefill_s_per_token=per_token, engine_stuck=rate.stalled(prefill_s))
    assert has_room(ld, HIGH), "a prefill in progress read as a stalled engine"
    # still flat well past that prefill: stalled, and the replica closes
    rate = learn_rate(rate, 10.0, 500_000.0, 0.0, 2.0, COST_MODEL, 15.0)
    assert not rate.stalled(prefill_s)  # 10 s flat: the prefill may just be ending
    rate = learn_rate(rate, 15.0, 500_000.0, 0.0, 2.0, COST_MODEL, 15.0)
    assert rate.stalled(prefill_s)
    assert not has_room(dataclasses.replace(ld, engine_stuck=rate.stalled(prefill_s)), HIGH)


@pytest.mark.parametrize(("scrapes", "prefill_s", "stalled"), [
    # flat 5 s beside a queue: stalled unless a prefill of 5 s or more may explain it
    ([(0.0, 9_000.0, 3.0), (5.0, 9_000.0, 3.0)], 0.0, True),
    ([(0.0, 9_000.0, 3.0), (5.0, 9_000.0, 3.0)], 4.9, True),
    ([(0.0, 9_000.0, 3.0), (5.0, 9_000.0, 3.0)], 5.0, False),
    ([(0.0, 9_000.0, 3.0), (5.0, 9_000.0, 3.0), (10.0, 9_000.0, 3.0)], 8.0, True),
    # no queue at 0 s, one from 5 s: flat since the last scrape without one (0 s), so
    # 10 s by the third (mutation caught: the run starting at the first queued scrape)
    ([(0.0, 9_000.0, 0.0), (5.0, 9_000.0, 3.0), (10.0, 9_000.0, 3.0)], 7.0, True),
    ([(0.0, 9_000.0, 0.0), (5.0, 9_000.0, 3.0), (10.0, 9_000.0, 3.0)], 10.0, False),
    # the counter moved at 5 s: flat only since then
    ([(0.0, 8_000.0, 3.0), (5.0, 9_000.0, 3.0), (10.0, 9_000.0, 3.0)], 8.0, False),
    ([(0.0, 8_000.0, 3.0), (5.0, 9_000.0, 3.0), (10.0, 9_000.0, 3.0)], 4.0, True),
    # flat, but the queue shrank at the last scrape: it began some
    ([(0.0, 9_000.0, 3.0), (5.0, 9_000.0, 3.0), (10.0, 9_000.0, 2.0)], 0.0, False),
    # scrapes farther apart than max_gap_s pair nothing: the flat run starts afresh
    ([(0.0, 9_000.0, 3.0), (15.5, 9_000.0, 3.0), (20.5, 9_000.0, 3.0)], 5.0, False),
    ([(0.0, 9_000.0, 3.0), (15.5, 9_000.0, 3.0), (20.5, 9_000.0, 3.0)], 4.0, True),
])
def test_a_flat_counter_is_a_stall_only_past_the_largest_prefill(
        scrapes: list[tuple[float, float, float]], prefill_s: float, stalled: bool) -> None:
    rate = PrefillRate()
    for ts, prompt, waiting in scrapes:
        rate = learn_rate(rate, ts, prompt, 0.0, waiting, COST_MODEL, 15.0)
    assert rate.stalled(prefill_s) is stalled


def test_no_prompt_counter_is_never_a_stall() -> None:
    rate = PrefillRate()
    for ts in (0.0, 5.0, 10.0):
        rate = learn_rate(rate, ts, None, None, 5.0, COST_MODEL, 15.0)
    assert rate.flat_since is None and not rate.stalled(0.0)


@pytest.mark.xfail(strict=True, reason=(
    "an engine whose scrapes show the waiting count but no prompt-token counter (an "
    "exporter without it, or the line dropped as unreadable) can never be `engine_stuck` "
    "(learn_rate returns began_nothing False without a counter): a queue that stands "
    "scrape after scrape no longer closes it, and `high` (prefill room unbounded) is "
    "sent into it up to the sequence guess; before a6ec647 any waiting closed it"))
def test_a_standing_queue_closes_a_replica_that_shows_no_prompt_counter() -> None:
    rate = PrefillRate()
    for ts in (0.0, 5.0, 10.0):
        rate = learn_rate(rate, ts, None, None, 5.0, COST_MODEL, 15.0)
    ld = ReplicaLoad("a", in_flight=4, queued_prefill_tokens=0.0, kv_usage=0.5,
                     occupancy=9.0, engine_waiting=5.0, seq_limit=64,
                     engine_stuck=rate.began_nothing)
    assert not has_room(ld, HIGH)


# -- mutations no test of a6ec647 caught ---------------------------------------------------

def test_a_stuck_queue_closes_only_while_requests_still_wait() -> None:
    """The stuck rule needs a waiting count: once finishes let the scraped queue in
    (engine.py: the count stands "until a request finishes"), the replica has room again.
    Mutation caught: `if load.engine_stuck:` without `load.engine_waiting`."""
    def at(waiting: float) -> ReplicaLoad:
        return ReplicaLoad("a", in_flight=2, queued_prefill_tokens=0.0, kv_usage=0.3,
                           occupancy=2.0 + waiting, engine_waiting=waiting, seq_limit=64,
                           engine_stuck=True)
    assert has_room(at(0.0), HIGH) and has_room(at(0.0), LIMITS)
    assert not has_room(at(1.0), HIGH) and not has_room(at(1.0), LIMITS)
    assert not passable(at(1.0), LIMITS, 1_000.0, 2.0)


def _fleet_view() -> tuple[Fleet, FleetView, Clock]:
    fleet = Fleet([ReplicaSettings(name="a", url="http://a:8000", models=("m",))])
    fleet.replicas["a"].healthy = True
    clock = Clock()
    return fleet, FleetView(fleet, Router(RoutingConfig()), clock, 15.0, None), clock


def _scrape(clock: Clock, running: float, prompt: float, waiting: float) -> EngineSnapshot:
    return EngineSnapshot(clock.t, 0.3, running, waiting, None, None, prompt, None, None,
                          None)


@pytest.mark.parametrize(("second", "stuck"), [
    ((9_000.0, 3.0), True),  # the same queue, not a prompt token more
    ((12_000.0, 3.0), False),  # it prefilled: a queue it moves
])
def test_the_fleet_view_hands_the_stuck_reading_to_the_room(
        second: tuple[float, float], stuck: bool) -> None:
    """fleetview.py wires `PrefillRate.began_nothing` into `ReplicaLoad.engine_stuck`
    (mutation caught: `engine_stuck=False` there), and the room follows it."""
    fleet, fv, clock = _fleet_view()
    r = fleet.replicas["a"]
    # the running count changes (no sequence limit is learnt: the guess, 8, binds)
    fleet.set_snapshot("a", _scrape(clock, 1.0, 9_000.0, 3.0), in_flight=2)
    assert not fv.load(r, 2).engine_stuck  # one scrape's queue: a moment
    clock.t += 5.0
    fleet.set_snapshot("a", _scrape(clock, 2.0, *second), in_flight=2)
    ld = fv.load(r, 2)
    assert ld.engine_stuck is stuck
    assert ld.engine_waiting == 3.0
    assert has_room(ld, HIGH) is not stuck


@pytest.mark.parametrize(("prefill_s", "stuck"), [
    (0.0, True),  # nothing large there: two flat scrapes say it began nothing
    (4.0, True),  # its largest prompt takes 4 s to prefill: flat 5 s is a stall
    (6.0, False),  # 6 s: the flat counter may be that prefill in progress
])
def test_the_fleet_view_waits_out_the_largest_prefill_before_a_stall(
        prefill_s: float, stuck: bool) -> None:
    """fleetview.py prices the largest prompt in flight there at the engine's rate (the
    cost model's here: no sample yet) before a flat counter closes the replica (mutation
    caught: `rate.began_nothing` there)."""
    fleet, fv, clock = _fleet_view()
    r = fleet.replicas["a"]
    largest = prefill_s / RoutingConfig().prefill_s_per_token
    fleet.set_snapshot("a", _scrape(clock, 1.0, 9_000.0, 3.0), in_flight=2)
    fv.load(r, 2, largest=largest)
    clock.t += 5.0
    fleet.set_snapshot("a", _scrape(clock, 2.0, 9_000.0, 3.0), in_flight=2)
    ld = fv.load(r, 2, largest=largest)
    assert ld.engine_stuck is stuck
    assert has_room(ld, HIGH) is not stuck
