"""Whether a replica restart the router is told about is a new one (pure).

A restart reaches a router several ways: its own monitor sees the engine's process start
time change (`process_start_time_seconds`), or its cumulative counters go backwards (the
only sign llama.cpp gives), or its KV event sequence start again, or the replica came back
after too long down; and every other gateway instance behind the same Redis publishes what
it saw as a `Restarted` fact. Each clear of the replica's index drops what was learnt since
the last one, so one restart must clear once, and every new one must clear again, even
seconds later (a crash-looping engine holds nothing its previous process cached).

A start time later than its sighting (beyond `START_SKEW_S`) is read as none.

Identity, in order:
1. Both sightings carry the engine's process start time: the same process start is the
   same restart; an older one is a restart already superseded; a later one is new, however
   soon after the last (the start time is what tells restarts apart, not the wall clock).
2. Both are this instance's own and carry no start time (counters gone backwards, KV events
   restarted, down too long): each kind of sign fires once per restart here, so a later
   sign of a kind this restart already showed is new (a crash loop, seconds apart); a sign
   of another kind is one more sign of the same restart by proximity (3.): a vLLM with no
   start time (multiprocess metrics) shows its KV events restarted at once and its
   counters gone backwards at the next scrape, and a second clear dropped what was learnt
   in between.
3. Otherwise (another instance's sighting without a start time, or one sighting with and
   one without): within `SAME_RESTART_S` of the last, the same restart seen at another
   moment; later, a new one; earlier, an old fact arriving late.
"""

from __future__ import annotations

from dataclasses import dataclass

# Sightings of one replica's restart without a process start time this close together are
# one restart (each instance sees it at its own next scrape, usage.scrape_interval_s apart
# at most; its KV events and its /metrics show it at different moments).
SAME_RESTART_S = 60.0
# A process start time later than its sighting by more than this is no start time (clocks
# of replica and gateway differ by seconds): one from a fact written with a far-future start
# (another version's bug, or anyone who can write the Redis stream) would otherwise stand as
# the latest process start, and every real restart after it would be "superseded".
START_SKEW_S = 3600.0


@dataclass(frozen=True, slots=True)
class RestartMark:
    at: float  # when it was seen (the router's time, or the fact's)
    started: float | None = None  # the engine's process start time, when shown
    local: bool = True  # seen by this instance (False: another instance's fact)
    # the kinds of this instance's own signs of this restart ("counters", "events",
    # "down"); empty when not told
    signs: frozenset[str] = frozenset()


def settle(last: RestartMark | None, seen: RestartMark) -> tuple[bool, RestartMark]:
    """Whether `seen` is a restart not yet known (module docstring), and the mark to keep.

    A new restart's mark is `seen`'s (at the later of the two times). The same restart seen
    again keeps the first sighting's time (block facts from before it stay void), any start
    time either carried, and "local" when either was (so this instance's next own sign
    without a start time is new). An older restart, superseded, leaves the mark alone."""
    if seen.started is not None and not seen.started <= seen.at + START_SKEW_S:
        seen = RestartMark(seen.at, None, seen.local, seen.signs)
    if last is None:
        return True, seen
    if last.started is not None and seen.started is not None:
        if seen.started > last.started:
            return True, _later(last, seen)
        if seen.started < last.started:
            return False, last
        return False, _same(last, seen)
    if (last.local and seen.local and last.started is None and seen.started is None
            and (not seen.signs or not last.signs or seen.signs & last.signs)):
        return (True, seen) if seen.at > last.at else (False, last)
    if seen.at >= last.at + SAME_RESTART_S:
        return True, seen
    if seen.at <= last.at - SAME_RESTART_S:
        return False, last
    return False, _same(last, seen)


def _later(last: RestartMark, seen: RestartMark) -> RestartMark:
    return RestartMark(max(last.at, seen.at), seen.started, seen.local, seen.signs)


def _same(last: RestartMark, seen: RestartMark) -> RestartMark:
    started = seen.started if last.started is None else last.started
    return RestartMark(min(last.at, seen.at), started, last.local or seen.local,
                       last.signs | seen.signs)
