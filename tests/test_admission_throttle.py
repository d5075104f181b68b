"""Issue 36's throttle, by tables (engine.py): the gateway's guess of what an engine runs
at once binds always (a burst between two scrapes sends at most twice what the engine has
shown it takes in), and grows as fast as the engine shows more (what this gateway had in
flight at a scrape showing nothing waiting was all taken in); a waiting count seen on one
scrape is a fact about that moment, drained at the engine's prefill pace."""

from __future__ import annotations

import math

import pytest

from gateway.admission.engine import (
    PROBE_SEQS,
    STEP_TOKENS,
    Capacity,
    Scrape,
    drain_s,
    learn,
    view,
    waiting_since,
)
from gateway.admission.room import ReplicaLoad, RoomLimits, has_room, prefill_room, reserved

GUESS = Capacity(0.0, None, 3)  # seen running 3 at most, nothing learnt: the guess, 8
SAT = Capacity(0.0, 4, 4)  # seen 4 running beside a queue for SATURATION_S: its limit
# seen 6 running beside a queue, once: maybe its limit, not yet confirmed
PENDING = Capacity(0.0, None, 6, 6, 0.0)
# seen 6 running, then 2 running beside a queue: the step's token budget, no sequence limit
BUDGET = Capacity(0.0, None, 6, 2, 0.0)


@pytest.mark.parametrize(("cap", "seen", "saturated", "most", "taken", "limit"), [
    # none waiting: the 10 this gateway had there were all taken in (2 of them not yet
    # running when asked: on their way, in its front end), so it is held to 2 x 10
    (Capacity(), Scrape(1.0, 8, 0, None, 10), None, 8, 10, 20),
    (Capacity(), Scrape(1.0, 3, 0, None, 2), None, 3, 3, PROBE_SEQS),  # others' count
    # requests waiting: what this gateway had there was not all taken in
    (Capacity(), Scrape(1.0, 8, 1, None, 10), None, 8, 8, 16),
    (Capacity(), Scrape(1.0, 8, None, None, 10), None, 8, 8, 16),  # waiting not exported
    (Capacity(), Scrape(1.0, None, 0, None, 10), None, None, None, None),  # nor running
    # it never goes down: a quiet scrape after a busy one
    (Capacity(0.0, None, 8, most_taken=10), Scrape(1.0, 1, 0, None, 1), None, 8, 10, 20),
    # the saturation test compares with what ran, not with what was taken in: 4 running
    # beside a queue for SATURATION_S is the limit though 5 were once in flight there
    (Capacity(1.0, None, 4, 4, 0.5, 5), Scrape(2.5, 4, 1, None, 6), 4, 4, 5, 4),
    (Capacity(), Scrape(1.0, 2, 0, None, 1 << 40), None, 2, 1 << 16, 1 << 17),  # bounded
])
def test_what_the_engine_took_in_counts_as_shown(
        cap: Capacity, seen: Scrape, saturated: int | None, most: int | None,
        taken: int | None, limit: int | None) -> None:
    got = learn(cap, seen)
    assert (got.saturated, got.most_running, got.most_taken, got.seq_limit) == (
        saturated, most, taken, limit)


@pytest.mark.parametrize(("waiting", "delta", "age", "drain", "now"), [
    (4, 0, 0.0, 0.5, 4.0),  # at the scrape: what it showed
    (4, 0, 0.49, 0.5, 4.0),  # not one begun yet
    (4, 0, 0.5, 0.5, 3.0),  # one prefill later: one began
    (4, 0, 1.9, 0.5, 1.0),
    (4, 0, 2.0, 0.5, 0.0),  # all begun
    (4, 0, 60.0, 0.5, 0.0),  # never below nothing
    (4, -1, 0.0, 0.5, 3.0),  # one of this gateway's finished: one let in
    (4, 3, 0.5, 0.5, 3.0),  # sent since: they are counted as occupancy, not here
    (4, 0, 60.0, math.inf, 4.0),  # the pace unknown: it stands (until a finish, a scrape)
    (4, 0, 0.0, 0.0, 0.0),  # an engine that begins at once
    (0, 0, 1.0, 0.5, 0.0),
])
def test_a_waiting_count_drains_at_the_engines_pace(
        waiting: int, delta: int, age: float, drain: float, now: float) -> None:
    assert waiting_since(waiting, delta, age, drain) == now


@pytest.mark.parametrize(("per_token", "largest", "seconds"), [
    (1e-4, 14_000.0, 1.4),  # one of the largest prompts there, at its rate
    (1e-4, 0.0, 1e-4 * STEP_TOKENS),  # none of this gateway's there: one step's budget
    (2e-5, 500.0, 0.01),
    (-1.0, 500.0, 0.0),
])
def test_one_waiting_request_is_priced_as_a_prefill_at_the_engines_rate(
        per_token: float, largest: float, seconds: float) -> None:
    assert drain_s(per_token, largest) == pytest.approx(seconds)


def scrape(ts: float, running: float, waiting: float, own: int = 0) -> Scrape:
    return Scrape(ts, running, waiting, None, own)


NORMAL = reserved(RoomLimits(math.inf, 16_000, 0.97), 0.75, 0.5)


def load_of(cap: Capacity, seen: Scrape, own: int, now: float,
            drain: float = math.inf) -> ReplicaLoad:
    v = view(seen, cap, own, now, 15.0, drain)
    return ReplicaLoad("a", own, 0.0, v.kv_usage, occupancy=v.occupancy,
                       engine_waiting=v.waiting, seq_limit=v.seq_limit)


@pytest.mark.parametrize(("cap", "seen", "own", "now", "drain", "room"), [
    # the scrape showed 3 running, none waiting; this gateway sent 3 since: the guess of
    # 8 (`normal` 6) holds the next one
    (GUESS, scrape(0.0, 3, 0, own=3), 6, 1.0, math.inf, False),
    (GUESS, scrape(0.0, 3, 0, own=3), 5, 1.0, math.inf, True),
    # a learnt limit holds as before: 4 running, sent 1 since
    (SAT, scrape(0.0, 2, 0, own=2), 3, 1.0, math.inf, False),  # 3 of 3 for `normal`
    (SAT, scrape(0.0, 1, 0, own=1), 2, 1.0, math.inf, True),
    # one scrape showed 2 waiting beside fewer running than it ran (a long prefill):
    # those waiting close no room by themselves (room.py): they wait for the step's
    # budget, which the gateway's queued-prefill room holds (none of its own here)
    (BUDGET, scrape(0.0, 2, 2, own=4), 4, 0.5, 0.4, True),
    (BUDGET, scrape(0.0, 2, 2, own=4), 4, 0.8, 0.4, True),
    (BUDGET, scrape(0.0, 2, 2, own=4), 4, 4.0, math.inf, True),
    # waiting beside the most it ran: the guess (12, `normal` 9) binds on the occupancy
    # (6 running + 3 waiting), however long ago the waiting began (a finish lets one in)
    (PENDING, scrape(0.0, 6, 3, own=9), 9, 4.0, 0.1, False),
    (PENDING, scrape(0.0, 6, 2, own=8), 8, 4.0, 0.1, True),
])
def test_room_on_an_engine_read_through_its_scrape(
        cap: Capacity, seen: Scrape, own: int, now: float, drain: float,
        room: bool) -> None:
    assert has_room(load_of(learn(cap, seen), seen, own, now, drain), NORMAL) is room


FULL = RoomLimits(math.inf, 16_000, 0.97)


def burst(cap: Capacity, seen: Scrape, limits: RoomLimits, n: int = 40) -> int:
    """What the engine holds (running and waiting, this gateway's and others') once `n`
    requests arrive together, a moment after a fresh scrape `seen`: each goes while
    the replica has room."""
    cap = learn(cap, seen)
    own = seen.own_at_scrape
    for _ in range(n):
        if has_room(load_of(cap, seen, own, seen.ts + 0.1), limits):
            own += 1
    v = view(seen, cap, own, seen.ts + 0.1, 15.0)
    assert v.occupancy is not None
    return int(v.occupancy)


@pytest.mark.parametrize(("cap", "seen", "limits", "held"), [
    # an idle engine, never seen running more than 3: the guess, 8 (`normal` 6)
    (Capacity(), scrape(0.0, 0, 0), FULL, PROBE_SEQS),
    (Capacity(), scrape(0.0, 0, 0), NORMAL, 6),
    (GUESS, scrape(0.0, 2, 0, own=2), FULL, PROBE_SEQS),
    # it took in 6 of this gateway's at once before: twice that
    (Capacity(), scrape(0.0, 6, 0, own=6), FULL, 12),
    (Capacity(0.0, None, 6), scrape(1.0, 0, 0), NORMAL, 9),
    # 5 of another client's run there: they count against the guess
    (Capacity(), scrape(0.0, 5, 0), FULL, 10),
    (SAT, scrape(1.0, 0, 0), FULL, 4),  # learnt: as before
])
def test_a_burst_after_a_scrape_showing_nothing_waiting_sends_at_most_the_guess(
        cap: Capacity, seen: Scrape, limits: RoomLimits, held: int) -> None:
    """A scrape with nothing waiting says only that the engine took what it had then: a
    burst of 40 arriving before the next scrape finds its room unknown, and what goes
    past it waits in the engine's own queue (first come, first served: the classes above
    would wait behind it). At most twice what the engine has shown goes (issue 36's
    regression: all 40 went)."""
    assert burst(cap, seen, limits) == held


def scrapes_to_serve(clients: int, shown: float, limits: RoomLimits,
                     engine_seqs: int = 256, most: int = 40) -> int | None:
    """Sustained load, `clients` requests at a time, held until answered: how many
    scrapes until the gateway sends them all to an engine running `engine_seqs`, whose
    scrapes show `shown` of what it took in running (the rest on its way, in its front
    end) and none waiting while it has a free sequence; None: not within `most`."""
    cap, own = Capacity(), 0
    for k in range(most):
        taken = min(own, engine_seqs)
        seen = scrape(float(k), math.floor(taken * shown), own - taken, own=own)
        cap = learn(cap, seen)
        while own < clients and has_room(load_of(cap, seen, own, k + 0.1), limits):
            own += 1
        if own == clients:
            return k
    return None


@pytest.mark.parametrize(("clients", "shown", "limits", "engine_seqs", "scrapes"), [
    # `normal` (0.75 of the limit): 6, 9, 13, 19, then all 24
    (24, 1.0, NORMAL, 256, 4),
    (24, 1.0, FULL, 256, 2),  # 8, 16, 24
    # the running gauge shows half of what it took: it still grows, from what it took
    (24, 0.5, NORMAL, 256, 4),
    (200, 1.0, NORMAL, 256, 9),  # geometric: 6, 9, 13, ... 141, 200
    # an engine running 4: what waits there is not counted, the guess stays 8
    (24, 1.0, NORMAL, 4, None),
])
def test_under_sustained_load_the_guess_grows_each_scrape(
        clients: int, shown: float, limits: RoomLimits, engine_seqs: int,
        scrapes: int | None) -> None:
    assert scrapes_to_serve(clients, shown, limits, engine_seqs) == scrapes


SIZED = RoomLimits(math.inf, 16_000, 0.97, sized_s_per_token=33e-6)


@pytest.mark.parametrize(("measured", "largest", "prompt", "room"), [
    (None, 0.0, 0.0, 16_000),  # never measured: the room as configured
    (33e-6, 0.0, 0.0, 16_000),  # measured at the rate it was sized at
    (8.25e-6, 0.0, 0.0, 64_000),  # 4x faster: the same seconds of prefill, 4x the tokens
    (8.25e-6, 0.0, 90_000.0, 64_000),  # not raised to the waiting prompt's own size
    (66e-6, 0.0, 0.0, 16_000),  # slower: never fewer tokens than configured
    (66e-6, 20_000.0, 0.0, 16_000),  # nor raised to the largest prompt it serves
    (0.0, 0.0, 0.0, 16_000),  # no figure
])
def test_the_prefill_room_is_a_wait_at_the_engines_measured_rate(
        measured: float | None, largest: float, prompt: float, room: float) -> None:
    load = ReplicaLoad("a", 1, 0.0, largest_prompt_tokens=largest,
                       prefill_s_per_token=measured)
    assert prefill_room(load, SIZED, prompt) == pytest.approx(room)
    # as configured without the rate it was sized at
    assert prefill_room(load, RoomLimits(math.inf, 16_000, 0.97), prompt) == 16_000


@pytest.mark.parametrize(("measured", "queued", "room"), [
    # two of the trace's 14k prompts queued: full at the cost model's rate, room on an
    # engine measured 4x faster (`normal`: half of the 32k room, as many seconds)
    (None, 28_000.0, False),
    (8.25e-6, 28_000.0, True),
    (8.25e-6, 66_000.0, False),  # its room in seconds (4 x 16,384 tokens) is full too
])
def test_a_faster_engine_takes_more_prefill_for_the_same_wait(
        measured: float | None, queued: float, room: bool) -> None:
    limits = reserved(RoomLimits(math.inf, 32_768, 0.97, sized_s_per_token=33e-6), 0.75,
                      0.5)
    load = ReplicaLoad("a", 2, queued, largest_prompt_tokens=14_000.0,
                       prefill_s_per_token=measured)
    assert has_room(load, limits, 14_000.0) is room
