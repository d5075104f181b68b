"""Pick a replica: estimated time to first token, session load when placing a session.

`prefix` (default) scores every healthy candidate with an estimated TTFT in seconds:

    cost = prefill_s_per_token x (prompt tokens not cached there + prefill tokens the
                                  gateway already queued there)
         + in_flight_s x requests in flight there
         + engine_waiting_s x waiting requests the engine reports beyond the gateway's own
         + hot_spot_s x requests in flight above hot_spot_ratio x mean + hot_spot_slack
           (not for a follow-up staying with its history: guards place, they never pull)
         - session prior (session_prior_tokens x prefill_s_per_token) on the session's replica

so a cached prefix wins only while its saved prefill outweighs the queue in front of it.

Placing a session. The request that decides where a session lives (a new session id, or a
session whose replica holds nothing of it that another candidate lacks: its history was
evicted, the feedback collapsed that replica's index, or it never got past the shared
agent prompt) also pays for the session's future: its later turns follow it, so

         + session_s x sessions bound to the replica (decayed count, sessions.py, not
                       counting this session itself; a session that moved away still
                       counts, fading, where it was)
         + fill_s x share of the replica's index capacity in use (cold spread: of two
                       equally loaded replicas the emptier cache takes the newcomer)

and a replica that would exceed session_cap_factor x mean sessions with it (not rounded
up: at 12 sessions per replica ceil(1.25 x 12) = 15 let one replica carry 25% more
requests) ranks after every other (bounded-load consistent hashing), when it holds more
of the prompt than the least of the candidates (the cap is there to stop a cache from
drawing conversations; where nothing draws, the estimate and the session term decide).

A popular agent prompt therefore fills its first replica only to the cap; the next
sessions re-prefill it elsewhere, after which several replicas hold it, it saves the same
everywhere, and session load decides. Cold sessions arriving one at a time (nothing in
flight, all costs tied) spread by session load instead of at random. A follow-up whose
history is on its replica is not placing: its cached history decides and it stays,
whatever the cap says. Requests without a session id belong to an implicit conversation
(conversations.py) and are placed and counted the same way; only a request too short to
fill one block has no conversation, and the cost model alone decides for it.

Costs within `tie_tolerance_s` of the best are a tie, broken by the seeded RNG.

Reasons (x-gateway-route): `prefix` when the chosen replica holds the longest prefix and it
is longer than on some other candidate, else `session` when the session's replica won
(also when nothing matched anywhere), `cold` when nothing matched anywhere and no
session's replica won, `load` or `balance` otherwise.

The simple policies: `least_loaded` (fewest in flight + queued, then fewest queued prefill
tokens, ties at random), `round_robin`, `random`, `session` (rendezvous hash of the session
id: consistent, moves only the sessions of a replica that leaves; no session -> least
loaded). Their reason is the policy name.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import xxhash

from gateway.routing.config import PolicyName, RoutingConfig
from gateway.routing.sessions import SessionKey

# Added to a replica already at the session cap: it ranks after every replica under it
# (still ranked, as a retry target), whatever its cache holds.
OVER_CAP_S = 1e6


class Candidate(NamedTuple):  # a tuple: built per replica per request, cheaply
    name: str
    predicted_tokens: int  # cached tokens this replica should deliver
    queued_tokens: float  # prefill the gateway sent there that has no first token yet
    queued_requests: int
    in_flight: int
    engine_waiting: float = 0.0
    engine_running: float = 0.0
    sessions: float = 0.0  # session load bound here, not counting the routed session
    fill: float = 0.0  # share of the replica's index capacity in use (0..1)


@dataclass(frozen=True, slots=True)
class Choice:
    ranked: tuple[int, ...]  # candidate positions, best first
    reason: str


def placing(candidates: Sequence[Candidate], session: SessionKey | None,
            session_replica: str | None) -> bool:
    """True when this request decides where a session lives: a new session, or one whose
    replica holds nothing of it that another candidate lacks (its history was evicted, the
    feedback collapsed, or it never got past the shared prompt)."""
    if session is None:
        return False
    if session_replica is None:
        return True
    own = -1
    others = 0
    for c in candidates:
        if c.name == session_replica:
            own = c.predicted_tokens
        elif c.predicted_tokens > others:
            others = c.predicted_tokens
    return own <= others


def session_cap(candidates: Sequence[Candidate], factor: float) -> float:
    """Bounded-load cap: no replica may carry more than factor x mean session load once
    the new one is placed (consistent hashing with bounded loads, Mirrokni et al.), and
    never less than one session, so an empty replica always fits. Not rounded up: at 12
    sessions per replica, ceil(1.25 x 12) = 15 let one replica take 25% more requests."""
    total = sum(c.sessions for c in candidates) + 1.0
    return max(1.0, factor * total / len(candidates))


def costs(
    candidates: Sequence[Candidate],
    prompt_tokens: float,
    session_replica: str | None,
    config: RoutingConfig,
    place: bool = False,
) -> list[float]:
    """Estimated seconds to first token on each candidate (see the module docstring)."""
    per_token = config.prefill_s_per_token
    mean = sum(c.in_flight for c in candidates) / len(candidates)
    hot_limit = config.hot_spot_ratio * mean + config.hot_spot_slack
    cap = session_cap(candidates, config.session_cap_factor) if place else 0.0
    # The cap stops a cached prefix from drawing every new conversation to one replica;
    # a replica holding no more of this prompt than the least of them draws nothing, so
    # the cap leaves it to the estimate (one-shot traffic of very unequal sizes, where
    # counting conversations would fight the queues, Mooncake replay in RESULTS.md).
    floor = min(c.predicted_tokens for c in candidates) if place else 0
    # Over the cap only counts while some replica is under it (else it ranks nothing).
    capped = place and any(c.sessions + 1.0 <= cap + 1e-9 for c in candidates)
    # A follow-up that stays with its history is never pushed off it by a guard: only
    # the estimate (its queue there against re-prefilling the history elsewhere) decides.
    guard = place or session_replica is None
    out: list[float] = []
    for c in candidates:
        uncached = max(0.0, prompt_tokens - c.predicted_tokens)
        cost = per_token * (uncached + c.queued_tokens) + config.in_flight_s * c.in_flight
        cost += config.engine_waiting_s * max(0.0, c.engine_waiting - c.queued_requests)
        if guard and c.in_flight > hot_limit:
            cost += config.hot_spot_s * (c.in_flight - hot_limit)
        if c.name == session_replica:
            cost -= per_token * config.session_prior_tokens
        if place:
            cost += config.session_s * c.sessions + config.fill_s * c.fill
            if capped and c.sessions + 1.0 > cap + 1e-9 and c.predicted_tokens > floor:
                cost += OVER_CAP_S
        out.append(cost)
    return out


def rank(values: Sequence[float], tolerance: float, rng: random.Random) -> tuple[int, ...]:
    """Positions by ascending value; those within `tolerance` of the best in random order."""
    order = sorted(range(len(values)), key=values.__getitem__)
    best = values[order[0]]
    tied = [i for i in order if values[i] <= best + tolerance]
    if len(tied) > 1:
        tied.sort()  # the draw depends on which tie, not on differences inside the tolerance
        rng.shuffle(tied)
    return (*tied, *order[len(tied) :])


def prefix_choice(
    candidates: Sequence[Candidate],
    prompt_tokens: float,
    session: SessionKey | None,
    session_replica: str | None,
    config: RoutingConfig,
    rng: random.Random,
) -> Choice:
    place = placing(candidates, session, session_replica)
    ranked = rank(costs(candidates, prompt_tokens, session_replica, config, place),
                  config.tie_tolerance_s, rng)
    chosen = candidates[ranked[0]]
    predicted = [c.predicted_tokens for c in candidates]
    best = max(predicted)
    if best <= 0:
        # Nothing cached anywhere (a prefix-breaking change at the top, e.g. a timestamp):
        # a session still following its replica went there for the session, not cold.
        reason = "session" if chosen.name == session_replica else "cold"
    elif chosen.predicted_tokens == best and best > min(predicted):
        reason = "prefix"
    elif chosen.name == session_replica:
        reason = "session"
    else:
        reason = off_cache_reason(candidates, chosen, best, config)
    return Choice(ranked, reason)


def off_cache_reason(candidates: Sequence[Candidate], chosen: Candidate, best: int,
                     config: RoutingConfig) -> str:
    """Why a request went where no more of its prompt is cached than elsewhere: `load`
    when every replica holding as much or more is busier (the load terms of the estimate:
    requests in flight, prefill queued, the engine's own waiting queue), else `balance`:
    the conversation-spreading terms (the session cap, fill) placed it, as on an idle
    fleet."""
    def busy(c: Candidate) -> float:
        return (config.prefill_s_per_token * c.queued_tokens + config.in_flight_s * c.in_flight
                + config.engine_waiting_s * max(0.0, c.engine_waiting - c.queued_requests))

    mine = chosen.predicted_tokens
    holders = [c for c in candidates if c is not chosen and (
        c.predicted_tokens > mine or c.predicted_tokens == mine > 0)]
    if holders and all(busy(c) > busy(chosen) for c in holders):
        return "load"
    return "balance"


def least_loaded(candidates: Sequence[Candidate], rng: random.Random) -> tuple[int, ...]:
    # Requests first, then queued prefill as a fraction, so equal counts prefer less work.
    loads = [c.in_flight + c.queued_tokens / (1.0 + c.queued_tokens) for c in candidates]
    return rank(loads, 0.0, rng)


def session_order(candidates: Sequence[Candidate], session: SessionKey) -> tuple[int, ...]:
    """Rendezvous (highest random weight) hashing: consistent as replicas come and go."""
    key = str(session).encode("utf-8", "surrogatepass")
    scores = [xxhash.xxh3_64_intdigest(c.name.encode(), xxhash.xxh3_64_intdigest(key))
              for c in candidates]
    return tuple(sorted(range(len(candidates)), key=scores.__getitem__, reverse=True))


def choose(
    policy: PolicyName,
    candidates: Sequence[Candidate],
    prompt_tokens: float,
    session: SessionKey | None,
    session_replica: str | None,
    config: RoutingConfig,
    rng: random.Random,
    turn: int,
) -> Choice:
    """The ranking of `candidates` under `policy`; `turn` drives round robin."""
    if not candidates:
        raise ValueError("no candidate replica")
    n = len(candidates)
    if policy == "prefix":
        return prefix_choice(candidates, prompt_tokens, session, session_replica, config, rng)
    if policy == "round_robin":
        start = turn % n
        return Choice(tuple((start + i) % n for i in range(n)), "round_robin")
    if policy == "random":
        order = list(range(n))
        rng.shuffle(order)
        return Choice(tuple(order), "random")
    if policy == "session" and session is not None:
        return Choice(session_order(candidates, session), "session")
    return Choice(least_loaded(candidates, rng), policy)


def cache_fill(size: int, capacity: int) -> float:
    """How full a replica's index is, 0..1 (a replica without capacity counts as full)."""
    return min(1.0, size / capacity) if capacity > 0 else 1.0


def move_reason(bound: str, chosen: str, views: Sequence[Candidate]) -> str | None:
    """Why a session bound to `bound` goes to `chosen` (None: it stays)."""
    if chosen == bound:
        return None
    own = next((c for c in views if c.name == bound), None)
    if own is None:
        return "unavailable"
    others = max((c.predicted_tokens for c in views if c.name != bound), default=0)
    return "evicted" if own.predicted_tokens <= others else "load"
