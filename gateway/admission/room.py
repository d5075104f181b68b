"""Room on a replica and the late-binding choice (pure).

A replica has room for another request when the gateway's view of it is below every
limit: requests in flight (`replica_max_in_flight`, the part of vLLM's `max_num_seqs` this
gateway wants running, not waiting), prefill the gateway sent there that has no first
token yet (`replica_max_queued_prefill_tokens`: beyond a few of vLLM's 8192-token prefill
steps, another request only waits in the engine, where the gateway can no longer move it
or let a higher class pass; fewer than that starves the engine's chunked prefill), and
the last scraped KV usage (`kv_usage_limit`: a full cache preempts and recomputes). A
replica with nothing in flight always has room, so a replica the limits misjudge cannot
block the queue for ever.

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

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True, slots=True)
class RoomLimits:
    max_in_flight: int
    max_queued_prefill_tokens: float
    kv_usage_limit: float


@dataclass(frozen=True, slots=True)
class ReplicaLoad:
    name: str
    in_flight: int  # this gateway's requests there (admitted, not yet finished)
    queued_prefill_tokens: float  # sent there, no first token yet (Router.queued_tokens)
    kv_usage: float | None = None  # last scrape, None when unknown
    predicted_tokens: int = 0  # cached tokens this request would get there


@dataclass(frozen=True, slots=True)
class Binding:
    go: bool
    replicas: tuple[str, ...]  # when go: the candidates the router may choose among
    # room: the best holders have room; own: waiting for the best holder; elsewhere: its
    # own is full and waiting costs more than recomputing; full: no candidate has room
    why: Literal["room", "own", "elsewhere", "full"]


def reserved(limits: RoomLimits, share: float,
             prefill_share: float | None = None) -> RoomLimits:
    """The limits a lower class sees: `share` of the in-flight room and `prefill_share`
    (default `share`) of the queued prefill (at least one request and one token), the
    rest kept free for `high`, so a high request finds room at once and a short queue in
    the engine (vLLM runs already-running requests' prefill first, whatever the policy)."""
    prefill = share if prefill_share is None else prefill_share
    return RoomLimits(max(1, int(limits.max_in_flight * share)),
                      max(1.0, limits.max_queued_prefill_tokens * prefill),
                      limits.kv_usage_limit)


def has_room(load: ReplicaLoad, limits: RoomLimits) -> bool:
    if load.in_flight <= 0:
        return True
    if load.in_flight >= limits.max_in_flight:
        return False
    if load.queued_prefill_tokens >= limits.max_queued_prefill_tokens:
        return False
    return load.kv_usage is None or load.kv_usage < limits.kv_usage_limit


def wait_estimate(load: ReplicaLoad, limits: RoomLimits, prefill_s_per_token: float,
                  in_flight_s: float) -> float:
    """Seconds until `load` probably has room again (0 when it has room now)."""
    if has_room(load, limits):
        return 0.0
    over = max(0, load.in_flight - limits.max_in_flight + 1)
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
