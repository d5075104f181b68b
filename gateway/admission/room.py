"""Room on a replica and the late-binding choice (pure).

A replica has room for another request when it is healthy and below every limit:
- **what its engine says** (engine.py, when its last scrape is fresh): nothing waits in
  the engine now and its occupancy (running + waiting, plus what this gateway sent since
  the scrape) is below what the engine has shown it runs at once (`seq_limit`); a class
  other than `high` sees `seq_share` of that (`lower_class_room`), so `high` finds a free
  sequence in the engine, not a queue it cannot pass. Its KV usage is below
  `kv_usage_limit` (a full cache preempts and recomputes).
- **the gateway's own counts** (always; the only ones when the scrape is stale or the
  replica exports none): its requests there against the learned `seq_limit` (if any) and
  the optional `replica_max_in_flight` cap, and the prefill it sent there that the engine
  has not begun (`replica_max_queued_prefill_tokens`: beyond a few of vLLM's 8192-token
  prefill steps another request only waits in the engine, where the gateway can no longer
  move it or let a higher class pass).
A healthy replica with nothing of this gateway's in flight always has room, so signals
that misjudge it cannot block the queue for ever; an unhealthy one never has.

Late binding (`bind`): a waiting request goes when some candidate has room. If the
replicas holding the longest prefix of its prompt (its "own" replica: a follow-up's
history) are full while others have room, it waits for its own only while the time it
has waited plus the estimated wait there is below what going elsewhere costs (the prefix
it would redo there plus that replica's queued prefill, at `prefill_s_per_token`, plus
`prior_s`: the router's session prior, for the history a move leaves behind as wasted
cache) and it has not waited
`own_replica_max_wait_s`; otherwise it goes to the replicas with room, where the router
chooses as always.

The wait estimate is deliberately rough: the queued prefill in front of it at the
routing cost model's rate (it waits behind all of it, in the gateway or in the engine),
plus `in_flight_s` per request over the in-flight limit.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True, slots=True)
class RoomLimits:
    max_in_flight: float  # the optional cap on this gateway's requests (inf: none)
    max_queued_prefill_tokens: float
    kv_usage_limit: float
    seq_share: float = 1.0  # of what the engine runs at once (`ReplicaLoad.seq_limit`)


@dataclass(frozen=True, slots=True)
class ReplicaLoad:
    name: str
    in_flight: int  # this gateway's requests there (admitted, not yet finished)
    queued_prefill_tokens: float  # sent there, not begun by the engine (Router.queued_tokens)
    kv_usage: float | None = None  # fresh scrape's, None when unknown or stale
    predicted_tokens: int = 0  # cached tokens this request would get there
    healthy: bool = True
    # engine.py's view: running + waiting now and waiting now (None: no fresh scrape), and
    # what the engine runs at once (None: never scraped)
    occupancy: float | None = None
    engine_waiting: float | None = None
    seq_limit: int | None = None


@dataclass(frozen=True, slots=True)
class Binding:
    go: bool
    replicas: tuple[str, ...]  # when go: the candidates the router may choose among
    # room: the best holders have room; own: waiting for the best holder; elsewhere: its
    # own is full and waiting costs more than recomputing; full: no candidate has room
    why: Literal["room", "own", "elsewhere", "full"]


def reserved(limits: RoomLimits, share: float,
             prefill_share: float | None = None) -> RoomLimits:
    """The limits a lower class sees: `share` of the sequences (the engine's, and the cap
    when set) and `prefill_share` (default `share`) of the queued prefill (at least one
    request and one token), the rest kept free for `high`, so a high request finds a free
    sequence at once and a short queue in the engine (vLLM runs already-running requests'
    prefill first, whatever the policy)."""
    prefill = share if prefill_share is None else prefill_share
    cap = limits.max_in_flight
    return RoomLimits(max(1, int(cap * share)) if math.isfinite(cap) else cap,
                      max(1.0, limits.max_queued_prefill_tokens * prefill),
                      limits.kv_usage_limit, limits.seq_share * share)


def _over(load: ReplicaLoad, limits: RoomLimits) -> float:
    """Requests there beyond the tightest sequence limit, plus one (<= 0: below it)."""
    over = load.in_flight - limits.max_in_flight + 1
    if load.seq_limit is not None:
        used = load.occupancy if load.occupancy is not None else load.in_flight
        over = max(over, used - max(1, int(load.seq_limit * limits.seq_share)) + 1)
    return over


def has_room(load: ReplicaLoad, limits: RoomLimits) -> bool:
    if not load.healthy:
        return False
    if load.in_flight <= 0:
        return True
    if _over(load, limits) > 0:
        return False
    if load.queued_prefill_tokens >= limits.max_queued_prefill_tokens:
        return False
    if load.engine_waiting:
        return False  # the engine holds requests it cannot run yet: another only queues
    return load.kv_usage is None or load.kv_usage < limits.kv_usage_limit


def wait_estimate(load: ReplicaLoad, limits: RoomLimits, prefill_s_per_token: float,
                  in_flight_s: float) -> float:
    """Seconds until `load` probably has room again (0 when it has room now)."""
    if has_room(load, limits):
        return 0.0
    if not load.healthy:
        return math.inf
    over = max(0.0, _over(load, limits)) + (load.engine_waiting or 0.0)
    return prefill_s_per_token * load.queued_prefill_tokens + in_flight_s * over


def bind(loads: Sequence[ReplicaLoad], limits: RoomLimits, prefill_s_per_token: float,
         in_flight_s: float, waited_s: float, own_max_wait_s: float,
         prior_s: float = 0.0) -> Binding:
    """Where a waiting request may go now, if anywhere (module docstring)."""
    roomy = [ld for ld in loads if has_room(ld, limits)]
    if not roomy:
        return Binding(False, (), "full")
    names = tuple(ld.name for ld in roomy)
    best = max(ld.predicted_tokens for ld in loads)
    best_roomy = max(ld.predicted_tokens for ld in roomy)
    if best_roomy >= best:
        return Binding(True, names, "room")
    wait = min(wait_estimate(ld, limits, prefill_s_per_token, in_flight_s)
               for ld in loads if ld.predicted_tokens == best)
    # elsewhere: the prefix it lacks there, behind that replica's own queued prefill
    elsewhere = prior_s + min(
        prefill_s_per_token * (best - ld.predicted_tokens + ld.queued_prefill_tokens)
        for ld in roomy)
    # the whole wait, what it already waited included, must cost less than moving: a
    # fresh estimate each pass would otherwise let it wait up to the cap however wrong
    if waited_s + wait < elsewhere and waited_s + wait <= own_max_wait_s:
        return Binding(False, (), "own")
    return Binding(True, names, "elsewhere")
