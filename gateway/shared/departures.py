"""Departures shared through Redis: facts about a replica from before it left the fleet
are void, whichever instance reads them and whenever.

Why: a replica that departs (gateway.replicas.departure) and comes back under the same
name (a StatefulSet pod rescheduled, a DNS address handed to a new pod) is another server
with an empty cache. The instance that saw it depart forgot it; but the routing stream
still holds the facts about the old server for `replay_s`, and an instance starting
within that window, or one reading a fact that arrives late (a batch held back while
Redis was away), would apply them to the new server as if its cache were warm.

How: the instance that removes a replica records the departure twice:
- in the sorted set `<prefix>:departed` (member: the replica's name, score: when it
  departed, the later time kept: `ZADD GT`), which a starting instance reads before it
  replays the stream, so that every fact it replays is checked against it. The set is
  bounded in time and count on every write: entries older than `replay_s` go (no fact
  older than that is applied anyway), past `MAX_DEPARTED` the oldest go, and the key
  itself expires `replay_s` after its last write;
- as a `Departed` fact in the routing stream (gateway/routing/facts.py), so that running
  instances learn it in order with the other facts.
Both go in the writer's batch (one pipeline): while Redis is away a departure is lost
with its batch, as any fact is, and only the instance that saw it holds it.

Every instance keeps the departures it knows in `Departures` (pure, time a parameter:
bounded by `MAX_DEPARTED`, each forgotten `replay_s` after it), and skips a fact about a
replica dated before that replica's latest departure (counted `departed`). Two instances
that see one replica depart at different moments both record theirs; the later one
stands, so a lagging instance's last facts about the old server are void too, at the
cost of facts about the new server from between the two moments (it is taken for colder
than it is, never for warmer).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Iterable
from typing import Any

from gateway.routing.facts import MAX_NAME, Departed, Fact

# Departures remembered (here and in Redis): far more replicas than leave within replay_s
# in any fleet (Membership holds at most 256 leaving at once); past it the oldest go.
MAX_DEPARTED = 4096


def departed_key(prefix: str) -> str:
    return f"{prefix}:departed"


class Departures:
    """replica -> when it last departed, within `keep_s` of now, at most `bound` of them."""

    def __init__(self, bound: int, keep_s: float) -> None:
        self.bound, self.keep_s = bound, keep_s
        self._at: dict[str, float] = {}

    def __len__(self) -> int:
        return len(self._at)

    def record(self, replica: str, at: float, now: float) -> None:
        """`replica` departed at `at` (the later of two departures stands). A time ahead
        of `now` (the writer's clock ahead of this one's) counts as `now`, as the fact
        stream's other facts do: uncapped, it would void every fresh fact about the new
        server under that name for as long as the skew. `screen` (the stream) and `load`
        (the Redis set, a starting instance) both come through here."""
        at = min(at, now)
        if at < now - self.keep_s:
            return
        self._at[replica] = max(at, self._at.get(replica, at))
        self._expire(now)
        while len(self._at) > self.bound:
            del self._at[min(self._at, key=lambda n: (self._at[n], n))]

    def void(self, replica: str, at: float, now: float) -> bool:
        """Whether a fact about `replica` dated `at` is from before its departure."""
        left = self._at.get(replica)
        if left is None:
            return False
        if left < now - self.keep_s:
            del self._at[replica]
            return False
        return at < left

    def screen(self, fact: Fact, at: float, now: float) -> bool:
        """Whether another instance's fact, dated `at`, stands: a departure is recorded;
        any other fact about a replica from before its departure does not stand."""
        if isinstance(fact, Departed):
            self.record(fact.replica, at, now)
            return True
        return not self.void(fact.replica, at, now)

    async def load(self, reader: Any, key: str, clock: Callable[[], float],
                   timeout_s: float) -> None:
        """Record the departures Redis holds (a starting instance, before it replays)."""
        for name, at in await load_departures(reader, key, clock(), self.keep_s, timeout_s):
            self.record(name, at, clock())

    def _expire(self, now: float) -> None:
        old = [n for n, t in self._at.items() if t < now - self.keep_s]
        for name in old:
            del self._at[name]


def write_departures(pipe: Any, key: str, batch: Iterable[tuple[Fact, float]], now: float,
                     keep_s: float) -> None:
    """Add to a Redis pipeline the commands that record the departures in `batch` (fact,
    when) in the sorted set `key`, bounded as the module docstring says; none when the
    batch has none."""
    departed = {f.replica: at for f, at in batch if isinstance(f, Departed)}
    if not departed:
        return
    for name, at in departed.items():
        pipe.zadd(key, {name: at}, gt=True)
    pipe.zremrangebyscore(key, "-inf", f"({now - keep_s!r}")
    pipe.zremrangebyrank(key, 0, -MAX_DEPARTED - 1)
    pipe.pexpire(key, max(1, int(keep_s * 1000)))


async def load_departures(reader: Any, key: str, now: float, keep_s: float,
                          timeout_s: float) -> list[tuple[str, float]]:
    """The departures of the last `keep_s` in the sorted set `key`, newest first, at most
    MAX_DEPARTED; what is no name or no time (another version, anyone who can write the
    key) is left out."""
    got = await asyncio.wait_for(reader.zrevrangebyscore(
        key, "+inf", repr(now - keep_s), start=0, num=MAX_DEPARTED, withscores=True),
        timeout_s)
    out: list[tuple[str, float]] = []
    for raw, score in got:
        if not isinstance(raw, bytes) or len(raw) > MAX_NAME:
            continue
        try:
            name = raw.decode("utf-8")
        except UnicodeDecodeError:
            continue
        if math.isfinite(score):
            out.append((name, float(score)))
    return out
