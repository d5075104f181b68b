"""The admission queue's room floor and its one cost model, by tables (room.py), and the
prefill rate an engine's scrapes show (prefillrate.py `learn_rate`)."""

from __future__ import annotations

import math

import pytest

from gateway.admission.engine import drain_s
from gateway.admission.prefillrate import RATE_ALPHA, RATE_HALF_LIFE_S, PrefillRate, learn_rate
from gateway.admission.room import (
    ReplicaLoad,
    bind,
    evicted,
    has_room,
    prefill_room,
    redo_tokens,
)
from tests.room_builders import IN_FLIGHT_S, LIMITS, PER_TOKEN, load

# LIMITS: the default room as `normal` sees it, half of 32,768 queued prefill tokens;
# PER_TOKEN: 1 ms per prefill token (tests/room_builders.py)


@pytest.mark.parametrize(("ld", "prompt", "room", "roomy"), [
    # the configured room (16,384 for `normal`), whatever is at stake
    (load("a", queued=10_000, largest=10_000), 0.0, 16_384.0, True),
    (load("a", queued=16_384, largest=8_000), 8_000.0, 16_384.0, False),
    # one 20k prompt sent and not begun: full for now ...
    (load("a", queued=20_000, largest=20_000), 14_000.0, 16_384.0, False),
    # ... and once it began, another of its size goes there
    (load("a", queued=0, largest=20_000), 20_000.0, 16_384.0, True),
    # a 40k prompt running and 12k queued behind it: room for another 40k
    (load("a", in_flight=2, queued=12_000, largest=40_000), 40_000.0, 16_384.0, True),
    # not raised to the largest prompt there: 18k queued behind a begun 40k one is full
    # (raised, a lower class queued up to a begun `high` prompt's size, issue 36's review)
    (load("a", in_flight=2, queued=18_000, largest=40_000), 4_000.0, 16_384.0, False),
    # nor to the waiting request's own prompt: a 40k prompt waits, as a smaller one does,
    # until less than the room is queued (first come, first served: raised to its own
    # size, large prompts overtook the smaller ones before them, which waited to their
    # class's limit on the Mooncake trace, issue 36)
    (load("a", in_flight=3, queued=20_000, largest=9_000), 40_000.0, 16_384.0, False),
    (load("a", in_flight=3, queued=15_000, largest=9_000), 40_000.0, 16_384.0, True),
    # a replica running nothing of this gateway's always has room
    (load("a", in_flight=0, queued=50_000), 14_000.0, 16_384.0, True),
])
def test_the_prefill_room_is_the_same_for_every_prompt(
        ld: ReplicaLoad, prompt: float, room: float, roomy: bool) -> None:
    assert prefill_room(ld, LIMITS, prompt) == room
    assert has_room(ld, LIMITS, prompt) is roomy


@pytest.mark.parametrize(("ld", "uncached", "gone", "redo"), [
    (load("a"), 5_000.0, 0.0, 0.0),  # cache room unknown: nothing priced
    (load("a", free=8_000), 5_000.0, 0.0, 0.0),  # fits in what is free
    (load("a", free=2_000), 5_000.0, 3_000.0, 3_000.0),  # pushes out 3k
    (load("a", free=0, reserved=1_000), 5_000.0, 5_000.0, 6_000.0),  # 1k of a program's
    (load("a", free=0, reserved=9_000), 5_000.0, 5_000.0, 10_000.0),  # at most what goes
    (load("a", free=9_000, reserved=9_000), 5_000.0, 0.0, 0.0),  # evicts nothing
])
def test_what_a_request_makes_others_redo(ld: ReplicaLoad, uncached: float, gone: float,
                                          redo: float) -> None:
    assert evicted(ld, uncached) == gone
    assert redo_tokens(ld, uncached) == redo


# its own replica `a` is full (24k queued of a 16k room: a 2 s wait at 1 ms a
# token from the time it waited 0.0), its history 1500 tokens; `b` has room
OWN = {"queued": 24_000.0, "predicted": 1500.0, "in_flight": 2, "largest": 8_000}
WAIT = 24.0  # s at PER_TOKEN


def own(**kw: float) -> ReplicaLoad:
    return load("a", **{**OWN, **kw})


@pytest.mark.parametrize(("loads", "prompt", "waited", "why"), [
    # the history alone: holding costs the 24 s wait, moving 1.5 s of recompute
    ([own(), load("b")], 0.0, 0.0, "elsewhere"),
    # at the measured rates: `a` prefills 20x faster (1.2 s) than the cost model says
    ([own(rate=0.00005), load("b")], 0.0, 0.0, "own"),
    # ... and `b` too: moving then costs 0.075 s
    ([own(rate=0.00005), load("b", rate=0.00005)], 0.0, 0.0, "elsewhere"),
    # moving evicts its whole history from `b`'s full cache: 2.4 + 0.4 < 1.5 + 1.5 s
    ([own(rate=0.0001), load("b", free=0)], 0.0, 0.4, "own"),
    ([own(rate=0.0001), load("b")], 0.0, 0.4, "elsewhere"),
    # ... and a program's reserved context there with it: 1.5 + 1.0 + 1.0 (2.5 without)
    ([own(rate=0.0001), load("b", free=500, reserved=5_000)], 0.0, 0.4, "own"),
    ([own(rate=0.0001), load("b", free=500)], 0.0, 0.4, "elsewhere"),
    # the rest of its prompt (4000 new tokens past a 20k history) is prefilled wherever
    # it goes: 17 + 4 s held (its own engine has a queue) against 21.5 s moved to `b`
    # (2.5k of it cached there) ...
    ([load("a", queued=17_000, predicted=20_000, in_flight=2, waiting=1),
      load("b", predicted=2_500)], 24_000.0, 0.0, "own"),
    # ... and on its own replica's full cache it evicts as much: 17 + 4 + 4 s
    ([load("a", queued=17_000, predicted=20_000, in_flight=2, free=0, waiting=1),
      load("b", predicted=2_500)], 24_000.0, 0.0, "elsewhere"),
])
def test_holding_and_moving_are_priced_alike(loads: list[ReplicaLoad], prompt: float,
                                             waited: float, why: str) -> None:
    b = bind(loads, LIMITS, PER_TOKEN, IN_FLIGHT_S, waited, 30.0, 0.0, prompt)
    assert b.why == why
    assert b.go is (why != "own")


def test_a_waiting_prompt_larger_than_the_room_waits_as_a_smaller_one_does() -> None:
    # every replica holds more queued prefill than the configured room and its largest
    # prompt: a 40k-token request is held as a 10k one is (neither overtakes the other)
    loads = [load("a", queued=30_000, largest=20_000, predicted=1_000),
             load("b", queued=45_000, largest=20_000)]
    assert bind(loads, LIMITS, PER_TOKEN, IN_FLIGHT_S, 0.0, 2.0, 0.0, 40_000).why == "full"
    assert bind(loads, LIMITS, PER_TOKEN, IN_FLIGHT_S, 0.0, 2.0, 0.0, 10_000).why == "full"
    # and where less than the room is queued, both go
    loads = [load("a", queued=15_000, largest=20_000, predicted=1_000),
             load("b", queued=45_000, largest=20_000)]
    for prompt in (40_000, 10_000):
        assert bind(loads, LIMITS, PER_TOKEN, IN_FLIGHT_S, 0.0, 2.0, 0.0,
                    prompt).replicas == ("a",)


DEFAULT = 0.001  # the cost model's 1,000 tokens a second


@pytest.mark.parametrize(("scrapes", "stuck"), [
    # the same queue at two scrapes 5 s apart, not a prompt token more: it began none
    ([(0.0, 9_000.0, 3.0), (5.0, 9_000.0, 3.0)], True),
    ([(0.0, 9_000.0, 3.0), (5.0, 9_000.0, 4.0)], True),  # a longer one, the same
    ([(0.0, 9_000.0, 3.0), (5.0, 9_001.0, 3.0)], False),  # it prefilled: it moves
    ([(0.0, 9_000.0, 3.0), (5.0, 9_000.0, 2.0)], False),  # the queue shrank
    ([(0.0, 9_000.0, 0.0), (5.0, 9_000.0, 3.0)], False),  # one scrape's queue: a moment
    ([(0.0, 9_000.0, 3.0), (15.5, 9_000.0, 3.0)], False),  # scrapes unseen between
    ([(0.0, 9_000.0, 3.0), (5.0, 9_000.0, 3.0), (10.0, 12_000.0, 3.0)], False),  # again
])
def test_an_engine_shows_it_began_nothing_only_across_two_scrapes(
        scrapes: list[tuple[float, float, float]], stuck: bool) -> None:
    rate = PrefillRate()
    for ts, prompt, waiting in scrapes:
        rate = learn_rate(rate, ts, prompt, 0.0, waiting, DEFAULT, 15.0)
    assert rate.began_nothing is stuck
    assert (drain_s(DEFAULT, 1_000.0, rate.began_nothing) == math.inf) is stuck


@pytest.mark.parametrize(("gap", "tps"), [(15.0, 500.0), (15.5, None)])
def test_no_rate_sample_spans_scrapes_farther_apart_than_max_gap_s(
        gap: float, tps: float | None) -> None:
    # a queue at both ends, 7,500 tokens: a sample only if no scrape lay unseen between
    rate = learn_rate(PrefillRate(), 0.0, 0.0, 0.0, 3.0, DEFAULT, 15.0)
    rate = learn_rate(rate, gap, 7_500.0, 0.0, 3.0, DEFAULT, 15.0)
    assert rate.tokens_per_s == (None if tps is None else pytest.approx(7_500.0 / gap))
    assert rate.last_ts == gap and rate.last_computed == 7_500.0  # the new baseline


@pytest.mark.parametrize(("scrapes", "tps"), [
    ([], None),
    # counters only: one scrape says nothing, nor a missing counter
    ([(0.0, 1e6, 0.0, 0.0)], None),
    ([(0.0, None, None, 0.0), (1.0, None, None, 0.0)], None),
    # idle-ish: 5,000 tokens computed in 1 s raises the rate above the model's 1,000 ...
    ([(0.0, 0.0, 0.0, 0.0), (1.0, 5_000.0, 0.0, 0.0)], 5_000.0),
    # ... cache hits are not prefill computed ...
    ([(0.0, 0.0, 0.0, 0.0), (1.0, 5_000.0, 3_000.0, 0.0)], 2_000.0),
    # ... too few tokens say nothing ...
    ([(0.0, 0.0, 0.0, 0.0), (1.0, 500.0, 0.0, 0.0)], None),
    # ... and a slow unqueued interval (200/s for 10 s) lowers it only by the decay of its
    # excess over the cost model's rate, never to the sample (it was not asked for more)
    ([(0.0, 0.0, 0.0, 0.0), (1.0, 5_000.0, 0.0, 0.0), (11.0, 7_000.0, 0.0, 0.0)],
     1_000.0 + 4_000.0 * 0.5 ** (10.0 / RATE_HALF_LIFE_S)),
    # one 10,000/s sample, then 300 s at 1,100/s: its excess over 1,100 halved, once
    ([(0.0, 0.0, 0.0, 0.0), (1.0, 10_000.0, 0.0, 0.0), (301.0, 340_000.0, 0.0, 0.0)],
     1_100.0 + 8_900.0 / 2),
    # a rate measured below the cost model's under a queue: no decay lifts it to the model
    ([(0.0, 0.0, 0.0, 3.0), (2.0, 1_500.0, 0.0, 3.0), (12.0, 4_000.0, 0.0, 0.0)], 750.0),
    # requests waiting at both ends: what it did is what it can do
    ([(0.0, 0.0, 0.0, 3.0), (1.0, 1_500.0, 0.0, 3.0)], 1_500.0),
    ([(0.0, 0.0, 0.0, 3.0), (1.0, 1_500.0, 0.0, 3.0), (2.0, 2_700.0, 0.0, 1.0)],
     1_500.0 + RATE_ALPHA * (1_200.0 - 1_500.0)),
    # the hit counter missing at one scrape and back at the next: no sample from either
    # pair (read as 0, computed leaps by every hit, then falls back by them)
    ([(0.0, 0.0, 0.0, 0.0), (1.0, 50_000.0, None, 0.0), (2.0, 60_000.0, 45_000.0, 0.0)],
     None),
    # a counter that went back (a restart) gives no sample
    ([(0.0, 9e6, 0.0, 3.0), (1.0, 1_500.0, 0.0, 3.0)], None),
])
def test_the_prefill_rate_an_engines_scrapes_show(
        scrapes: list[tuple[float, float | None, float | None, float]],
        tps: float | None) -> None:
    rate = PrefillRate()
    for ts, prompt, hits, waiting in scrapes:
        rate = learn_rate(rate, ts, prompt, hits, waiting, DEFAULT)
        assert learn_rate(rate, ts, prompt, hits, waiting, DEFAULT) == rate  # once each
    assert rate.tokens_per_s == (None if tps is None else pytest.approx(tps))
    assert rate.s_per_token() == (None if tps is None else pytest.approx(1.0 / tps))
