"""Second outside review of issue 37: the departure record (gateway/shared/departures.py)
when one instance's clock is ahead of the others'. The fact stream's other facts are
applied at `min(at, now)` (redis_state.py: "a clock ahead of this one: now"); a departure
dated in the future voids every fresh fact about the returned replica until the skewed
time comes, on every instance, and a starting instance loads it from Redis too."""

from __future__ import annotations

import pytest

from gateway.routing.facts import Departed, Sent, Trust
from gateway.shared.departures import MAX_DEPARTED, Departures

KEEP_S = 600.0
T0 = 1_000.0  # the receiving instance's clock when the departure arrives


@pytest.mark.parametrize("skew_s", [0.0, 30.0, 300.0])
@pytest.mark.parametrize("fact", [Sent("r1", [1]), Trust("r1", 0.5)])
def test_a_departure_from_a_clock_ahead_voids_no_fact_dated_after_it_arrived(
        skew_s: float, fact: Sent | Trust) -> None:
    """Instance B (clock `skew_s` ahead) saw r1 depart and published Departed(r1) dated
    T0 + skew_s; it reached this instance at T0. r1 came back (a new server) and a third
    instance's fact about it, dated T0 + 5 on a right clock, arrives at T0 + 5: it is
    about the new server and must stand. Found: gateway/shared/departures.py:79-84
    `screen` records a Departed at its writer's `at` as is (record keeps the later,
    :62-66, nothing caps it at `now`), and :68-77 `void` compares against it: every fact
    about r1 is skipped (counted `departed`) for `skew_s` after it came back (the whole of
    replay_s and beyond with a clock hours ahead: bounded by nothing but the skew). The
    Redis record (write_departures, ZADD GT, trimmed below now - keep_s only) keeps the
    future score for starting instances as well."""
    d = Departures(MAX_DEPARTED, KEEP_S)
    assert d.screen(Departed("r1"), T0 + skew_s, T0)
    assert d.screen(fact, T0 + 5, T0 + 5), f"fresh fact about r1 skipped (skew {skew_s} s)"
