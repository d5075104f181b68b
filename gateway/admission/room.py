"""Room on a replica and the late-binding choice (pure).

A replica has room for another request when it is healthy and below every limit:
- **what its engine says** (engine.py, when its last scrape is fresh): its occupancy
  (running + waiting, plus what this gateway sent since the scrape) is below what the
  engine has shown it runs at once (`seq_limit`), and no queue waits there that the
  engine does not move (`engine_stuck`, below); a class
  other than `high` sees `seq_share` of that (`lower_class_room`), so `high` finds a free
  sequence in the engine, not a queue it cannot pass. Its KV usage is below
  `kv_usage_limit` (a full cache preempts and recomputes), except where that only steers
  ("The KV usage steers, and holds none", below).
- **the gateway's own counts** (always; the only ones when the scrape is stale or the
  replica exports none): its requests there against `seq_limit` (learnt, or engine.py's
  guess; none if the engine never showed a running count) and
  the optional `replica_max_in_flight` cap, and the prefill it sent there that the engine
  has not begun (`replica_max_queued_prefill_tokens`: beyond a few of vLLM's 8192-token
  prefill steps another request only waits in the engine, where the gateway can no longer
  move it or let a higher class pass).
A healthy replica with nothing of this gateway's in flight always has room, so signals
that misjudge it cannot block the queue for ever; an unhealthy one never has.

**Waiting in the engine.** Requests the engine shows waiting close no room by
themselves: they wait for a sequence (counted in the occupancy), for KV blocks (the KV
usage) or for a step's token budget behind long prefills (the queued-prefill room). Read
as "full" whenever one waited, a replica serving the Mooncake trace's long prompts was
full most of the time (vLLM's chunked prefill keeps requests waiting while a long prompt
takes the step's budget): its KV cache at 0.3-0.5 and its sequences free while 85
requests waited in the gateway, which answered 7-31% of the trace's requests at 4x with
a 429 where the engines' own queues served every one (issue 36,
bench/results/admission.md). Only a queue the engine shows it does not move (two
scrapes, the same waiting count or more and not a prompt token prefilled between them:
a stalled engine, or requests held for KV blocks while the running ones only decode;
`engine_stuck`), for longer than the prefill of the largest prompt there (vLLM counts a
prompt's tokens only at its first token: prefillrate.py, "Stalled") closes the
replica, for every class and past the room too.
**The prefill room is the same for every waiter** (`prefill_room`): the configured
room at the engine's measured rate, whatever the size of the waiting prompt or of those
in flight there. A replica has room while less than the room is queued, so any prompt,
however large, goes there then (a 14k-token prompt does not find "full" a replica
holding 10k of queued prefill; a 40k prompt goes where less than the room is queued,
and another once the first has begun). It was raised to the waiting request's own
prompt and to the largest prompt in flight there: raised to the first, a large prompt
found room where the smaller ones before it did not and overtook them (they waited to
their class's limit on the Mooncake trace); raised to the second, a lower class queued
as much prefill as the largest prompt there, a begun `high` one included, far past its
share (a review found six `normal` prompts, 58k tokens, sent behind a 105k-token `high`
prompt against a share of 16k, and the next `high` waiting behind them).
**The room is a wait, priced by the cost model**: what a request admitted now waits
behind in the engine is the queued prefill at that engine's rate, so the configured room
(tokens, sized at the cost model's `prefill_s_per_token`: `RoomLimits.sized_s_per_token`)
holds as many seconds of prefill on an engine measured faster (prefillrate.py `PrefillRate`):
the same wait, more tokens; never fewer tokens than configured. (At the configured 32k
tokens, `normal`'s half held about one of the Mooncake trace's 14k-token prompts beside
the one being prefilled on a simulated engine that prefills several times the cost
model's rate: the queue throttled a fleet with room, issue 36.)

Late binding (`bind`): a waiting request goes when some candidate has room. If the
replicas holding the longest prefix of its prompt (its "own" replica: a follow-up's
history) are full while others have room, it waits for its own only while holding costs
less than moving, both priced by one cost model in seconds (`cost_own`,
`cost_elsewhere`), and it has not waited `own_replica_max_wait_s`; otherwise it goes to
the replicas with room, where the router chooses as always. Each side is the request's
own time to first token plus the prefill it makes others redo, at each replica's prefill
rate (`ReplicaLoad.prefill_s_per_token`: measured from the engine's scraped prompt-token
counter when it has shown one, prefillrate.py `PrefillRate`; else the routing cost model's
`prefill_s_per_token`):
- **hold**: what it waited already + the wait for its own replica (`wait_estimate`) + the
  prefill of the part of its prompt its own replica lacks + what that part evicts there;
- **move to r** (the cheapest replica with room): r's queued prefill + the part of its
  prompt r lacks (the history it would recompute) + what that part evicts there +
  `prior_s` (the router's session prior: the history a move leaves behind as wasted
  cache).
What a request evicts (`evicted`): the uncached tokens it adds beyond the room left in
the replica's prefix cache as the router's index counts it (`cache_free_tokens`: the
index's capacity, from the engine's reported KV blocks, less what it believes is
cached); unknown, nothing. Each evicted token is priced once as prefill someone may redo;
`reserved_tokens` (the context of agent programs in a tool call there, 0 until those are
tracked) is priced again up to what is evicted: idle during its tool call, a program's
context is the least recently used and goes first, and that program is known to return.

**Past the room** (`past_room` > 1, `[admission] own_replica_past_room`): the room is
the gateway's own count, not the engine's: a follow-up whose own replica is full by the
queued prefill (this gateway's count: whatever else waits in the engine besides) while
every other limit still has room (its sequences, learned or capped, and KV usage:
`passable`), may be sent there anyway, and the engine queues it behind what is queued.
Whatever holds `high` (whose prefill room is unbounded) holds a lower follow-up too: its
sequences, the KV usage, a queue the engine does not move, at any factor; the
gate also sends none past the room while a request of a higher class, or one before it
in the gate's order, waits for that replica (gate.py).
Priced by the same model (`cost_past`): what waits there (`queue_ahead`: the prefill
queued there, or the requests waiting in its engine each priced like this one, the
larger) + its uncached part + what that evicts, at that replica's rate. It goes there
when that is no dearer than moving (`cost_elsewhere`, the cheapest replica with room)
and than holding (`cost_own`); with no replica with room, holding is its only other
choice, and it holds when the engine's queue makes going dearer than that. The bound
keeps overload at the gateway: never while the prefill queued there is `past_room`
times its room (`prefill_room`) or more, nor past the engine's own limits (sequences,
KV usage); beyond that it holds or moves as above. Only a follow-up goes past the room,
and only where leaving costs it history: a new conversation (no replica holds any of its
prompt), a single candidate, or a prefix every healthy candidate holds (a shared system
prompt) gains nothing from it but a place ahead of the gateway's queue.

**The KV usage steers, and holds none** (`cache_steers`, `room_but_cache`; always for
`high`, for a lower class while no `high` came lately, below). A replica whose engine
reads its own cache full (its KV usage without the context held for agent programs,
`kv_held`, at the limit) but has room by every other limit, and where less than a
step's prefill of this gateway's requests (`FULL_CACHE_QUEUE_TOKENS`) waits for the
engine to begin it, is not closed by its KV usage:
- to a request holding the longest cached prefix of its prompt there where another
  candidate holds less (a follow-up's history; not a prefix every candidate holds, a
  shared system prompt: moving that costs nothing, review 62): what it needs beyond
  the prefix is its new turn's blocks, which the engine gives it as soon as it gives
  anyone blocks, while moving it recomputes the prefix in another cache;
- to any waiter none of whose candidates has room: it goes to those, where the router
  chooses as always.
So the KV usage steers a request with no prefix there to a cache with room while one
has it, and keeps none waiting once none has: held in the gateway for a block to free, a
request went to the same engine's queue, first come first served, where it would have
waited anyway, with the gate's pass and the scrape's lag added (the agent preset at 4x:
79% of the gateway's waits were this hold, and the queue's p99 time to first token
1.04-1.23x off's; with this rule about off's (median 1.02x), the cached ratio above
off's: bench/results/admission.md). Up to a step's prefill waits in such an engine this way,
the blocks of about one large prompt: the rest wait in the gateway, whose order
(classes, tenants' shares) picks who goes next as the engine begins what it has; sent
whole, a tenant's burst filled the engines' queues and a quiet tenant's request waited
behind all of it (review 61); one at a time, the next waited for the first one's first
token, and the p99 stayed 1.1x off's. A replica full only by context held for a
program in a tool call stays closed (its engine has the blocks a newcomer would take
from that program); one its engine reads full by itself does not: vLLM's usage counts
the blocks running requests hold, a program's finished turn sits in the free pool, so
there that context is in the last free blocks and goes with the next block anyone
takes, sent now or held and sent later (review 62).
While `high` requests come (one routed or queued within twice the shares' half-life, as
`low` yields to the classes above it: gate.py; one shed takes no block and counts for
nothing) the lower classes are held on the KV usage as before, and `high` takes the
next block that frees. The first `high` after a quiet spell may meet up to a step's
prefill of lower-class requests per replica waiting in its engine for blocks. The
time is the gateway's, not a model's: a `high` for one model holds the lower classes of
every model on a full cache (the old hold: the safe side).

The wait estimate is deliberately rough: the queued prefill in front of it at the
replica's rate (it waits behind all of it, in the gateway or in the engine), plus
`in_flight_s` per request over the in-flight limit.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

# the prefill this gateway may have waiting to begin in an engine whose cache is full
# (room_but_cache): one step of vLLM's default token budget (max_num_batched_tokens
# 8192), the blocks of about one large prompt; what more waits, waits in the gateway,
# whose order (classes, tenants' shares) picks who goes next (module docstring)
FULL_CACHE_QUEUE_TOKENS = 8192.0


@dataclass(frozen=True, slots=True)
class RoomLimits:
    max_in_flight: float  # the optional cap on this gateway's requests (inf: none)
    max_queued_prefill_tokens: float
    kv_usage_limit: float
    seq_share: float = 1.0  # of what the engine runs at once (`ReplicaLoad.seq_limit`)
    # the prefill rate (s/token) `max_queued_prefill_tokens` is sized at: a replica whose
    # engine is measured faster holds as many seconds of prefill (`prefill_room`); None:
    # tokens as configured
    sized_s_per_token: float | None = None


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
    # the largest prompt (estimated tokens) of this gateway's requests in flight there
    # (no rule here reads it since the room stopped being floored at it; fleetview.py
    # prices a waiting count's drain and a stall's window with it)
    largest_prompt_tokens: float = 0.0
    # seconds per prefilled token there (prefillrate.py `PrefillRate`; None: the cost model's)
    prefill_s_per_token: float | None = None
    # room left in its prefix cache before it evicts, by the router's index (None: unknown)
    cache_free_tokens: float | None = None
    # context held for agent programs in a tool call there (priced when evicted; 0: none)
    reserved_tokens: float = 0.0
    # the part of `kv_usage` that is context held for agent programs in a tool call there
    # (fleetview.py; 0: none): the rest is its engine's own
    kv_held: float = 0.0
    # its scrapes show a queue it does not move for longer than the largest prompt there
    # takes to prefill (prefillrate.py `PrefillRate.stalled`: a stalled engine, or
    # waiting requests held for KV blocks)
    engine_stuck: bool = False


@dataclass(frozen=True, slots=True)
class Binding:
    go: bool
    replicas: tuple[str, ...]  # when go: the candidates the router may choose among
    # room: the best holders have room; own: waiting for the best holder; elsewhere: its
    # own is full and waiting costs more than recomputing; past: to its own past the
    # gateway's queued-prefill room (cheapest); full: no candidate has room
    why: Literal["room", "own", "elsewhere", "past", "full"]


def reserved(limits: RoomLimits, share: float,
             prefill_share: float | None = None) -> RoomLimits:
    """The limits a lower class sees: `share` of the sequences (the engine's, and the cap
    when set) and `prefill_share` (default `share`) of the queued prefill (at least one
    request and one token), the rest kept free for `high`, so a high request finds a free
    sequence at once and a short queue in the engine (vLLM runs already-running requests'
    prefill first, whatever the policy)."""
    prefill = share if prefill_share is None else prefill_share
    cap = limits.max_in_flight
    return dataclasses.replace(
        limits, max_in_flight=max(1, int(cap * share)) if math.isfinite(cap) else cap,
        max_queued_prefill_tokens=max(1.0, limits.max_queued_prefill_tokens * prefill),
        seq_share=limits.seq_share * share)


def _over(load: ReplicaLoad, limits: RoomLimits) -> float:
    """Requests there beyond the tightest sequence limit, plus one (<= 0: below it)."""
    over = load.in_flight - limits.max_in_flight + 1
    if load.seq_limit is not None:
        used = load.occupancy if load.occupancy is not None else load.in_flight
        over = max(over, used - max(1, int(load.seq_limit * limits.seq_share)) + 1)
    return over


def prefill_room(load: ReplicaLoad, limits: RoomLimits, prompt_tokens: float = 0.0) -> float:
    """The queued prefill `load` may hold: the configured room, as many seconds of prefill
    at its engine's measured rate when that is faster than the rate the room was sized
    at; the same for every waiter and every prompt in flight (module docstring)."""
    room = limits.max_queued_prefill_tokens
    sized, measured = limits.sized_s_per_token, load.prefill_s_per_token
    if sized is not None and measured is not None and 0 < measured < sized:
        room *= sized / measured
    del prompt_tokens  # no floor of its own: module docstring, "The prefill room is the
    # same for every waiter"
    return room


def has_room(load: ReplicaLoad, limits: RoomLimits, prompt_tokens: float = 0.0,
             prefill_factor: float = 1.0) -> bool:
    """Room for a request of `prompt_tokens` (0: unknown yet) on `load`; `prefill_factor`
    > 1: room past the queued-prefill room up to that multiple of it (`bind`'s bound for
    a follow-up sent to its own replica past the room: it joins that queue), every
    other limit the same."""
    if not load.healthy:
        return False
    if load.in_flight <= 0:
        return True
    if _over(load, limits) > 0:
        return False
    if load.queued_prefill_tokens >= prefill_factor * prefill_room(load, limits, prompt_tokens):
        return False
    if load.engine_waiting and load.engine_stuck:
        return False  # a queue the engine does not move: another request only joins it
    # a queue it moves closes no room by itself (module docstring, "Waiting in the
    # engine"): what it waits for is a sequence (the occupancy above), KV blocks (below)
    # or a step's token budget (the prefill room above)
    return load.kv_usage is None or load.kv_usage < limits.kv_usage_limit


def wait_estimate(load: ReplicaLoad, limits: RoomLimits, prefill_s_per_token: float,
                  in_flight_s: float, prompt_tokens: float = 0.0) -> float:
    """Seconds until `load` probably has room again (0 when it has room now);
    `prefill_s_per_token`: the rate when the replica has shown none of its own."""
    if has_room(load, limits, prompt_tokens):
        return 0.0
    if not load.healthy:
        return math.inf
    over = max(0.0, _over(load, limits)) + (load.engine_waiting or 0.0)
    return rate(load, prefill_s_per_token) * load.queued_prefill_tokens + in_flight_s * over


def rate(load: ReplicaLoad, default_s_per_token: float) -> float:
    """Seconds per prefilled token on `load`: its engine's measured rate, else the default."""
    measured = load.prefill_s_per_token
    return default_s_per_token if measured is None or measured <= 0 else measured


def evicted(load: ReplicaLoad, uncached: float) -> float:
    """Cached tokens that adding `uncached` new ones to `load`'s prefix cache pushes out."""
    free = load.cache_free_tokens
    return 0.0 if free is None else max(0.0, uncached - max(0.0, free))


def redo_tokens(load: ReplicaLoad, uncached: float) -> float:
    """The prefill others may redo when `uncached` new tokens land on `load`: each evicted
    token once, and a reserved program's evicted context again (module docstring)."""
    gone = evicted(load, uncached)
    return gone + min(gone, max(0.0, load.reserved_tokens))


def cost_own(load: ReplicaLoad, wait_s: float, prefill_s_per_token: float, waited_s: float,
             prompt_tokens: float) -> float:
    """Seconds that holding for `load` (its own replica, room in `wait_s`) costs: waited +
    wait + its uncached prefill there + what that evicts (module docstring)."""
    s = rate(load, prefill_s_per_token)
    uncached = max(0.0, prompt_tokens - load.predicted_tokens)
    return waited_s + wait_s + s * (uncached + redo_tokens(load, uncached))


def cost_elsewhere(load: ReplicaLoad, prefill_s_per_token: float, prompt_tokens: float,
                   prior_s: float) -> float:
    """Seconds that going to `load` (with room, not its own) costs: the queued prefill
    there + the part of its prompt `load` lacks + what that evicts + the session prior."""
    s = rate(load, prefill_s_per_token)
    uncached = max(0.0, prompt_tokens - load.predicted_tokens)
    return prior_s + s * (load.queued_prefill_tokens + uncached
                          + redo_tokens(load, uncached))


def queue_ahead(load: ReplicaLoad, prompt_tokens: float) -> float:
    """Prefill tokens a request sent to `load` now waits behind in its engine: the prefill
    this gateway queued there, or, when more, the requests waiting in the engine (other
    clients', or begun by the estimate but still waiting) each priced like this one (the
    gateway knows no other size for them); the larger, as the two may be the same
    requests."""
    waiting = load.engine_waiting or 0.0
    return max(load.queued_prefill_tokens, waiting * max(0.0, prompt_tokens))


def cost_past(load: ReplicaLoad, prefill_s_per_token: float, prompt_tokens: float) -> float:
    """Seconds that sending the request to `load` (its own replica) now, past the gateway's
    room, costs: the engine queues it behind what waits there (`queue_ahead`), then its
    uncached part + what that evicts, all at `load`'s rate (module docstring)."""
    s = rate(load, prefill_s_per_token)
    uncached = max(0.0, prompt_tokens - load.predicted_tokens)
    return s * (queue_ahead(load, prompt_tokens) + uncached + redo_tokens(load, uncached))


def wait_past(loads: Sequence[ReplicaLoad], binding: Binding,
              prefill_s_per_token: float, prompt_tokens: float = 0.0) -> float:
    """Seconds a request of `prompt_tokens` that `binding` sends past the room ("past")
    waits in the engine there: what waits there (`queue_ahead`) at its rate (the least
    among its replicas); inf for any other binding (its wait is the gateway's queue's)."""
    if binding.why != "past":
        return math.inf
    return min((rate(ld, prefill_s_per_token) * queue_ahead(ld, prompt_tokens)
                for ld in loads if ld.name in binding.replicas), default=math.inf)


def passable(load: ReplicaLoad, limits: RoomLimits, prompt_tokens: float,
             past_room: float) -> bool:
    """`load` is full by its queued-prefill room and within `past_room` times it: a
    follow-up whose history it holds may be sent there past the room (module docstring).
    Never where `high` has no room: whatever holds it (sequences, KV usage, a queue the
    engine does not move) holds this too, so a lower class never reaches the engine
    ahead of a `high` held for it."""
    return (past_room > 1.0 and not has_room(load, limits, prompt_tokens)
            and load.queued_prefill_tokens >= prefill_room(load, limits, prompt_tokens)
            and has_room(load, limits, prompt_tokens, past_room))


def room_but_cache(load: ReplicaLoad, limits: RoomLimits, prompt_tokens: float = 0.0) -> bool:
    """`load` has room by every limit but a KV cache its engine itself reads full, and
    less than `FULL_CACHE_QUEUE_TOKENS` of prefill this gateway sent there waits for the
    engine to begin it (module docstring, "The KV usage steers, and holds none")."""
    if load.kv_usage is None or load.kv_usage - load.kv_held < limits.kv_usage_limit:
        return has_room(load, limits, prompt_tokens)  # full, if at all, by held context
    return (load.queued_prefill_tokens < FULL_CACHE_QUEUE_TOKENS
            and has_room(dataclasses.replace(load, kv_usage=None), limits, prompt_tokens))


def bind(loads: Sequence[ReplicaLoad], limits: RoomLimits, prefill_s_per_token: float,
         in_flight_s: float, waited_s: float, own_max_wait_s: float,
         prior_s: float = 0.0, prompt_tokens: float = 0.0, past_room: float = 1.0,
         *, cache_steers: bool = False) -> Binding:
    """Where a waiting request of `prompt_tokens` (0: unknown, then its longest cached
    prefix stands for it) may go now, if anywhere (module docstring); `past_room` > 1: a
    follow-up may go to its own replica past the queued-prefill room up to that multiple
    of it, when that costs least; `cache_steers`: the KV usage closes no replica holding
    a follow-up's history, and when no candidate has room, those with room by every
    limit but their KV usage have room (no `high` came lately: the caller's to say;
    module docstring, "The KV usage steers, and holds none")."""
    best = max((ld.predicted_tokens for ld in loads), default=0)
    prompt = max(prompt_tokens, float(best))
    # leaving its own replicas costs it history: another healthy candidate holds less
    history = best > 0 and any(ld.healthy and ld.predicted_tokens < best for ld in loads)
    if cache_steers and history:  # its own replicas: their caches close none to it
        loads = [dataclasses.replace(ld, kv_usage=None)
                 if ld.predicted_tokens == best and room_but_cache(ld, limits, prompt_tokens)
                 else ld for ld in loads]
    owns = [ld for ld in loads if ld.predicted_tokens == best]
    # a follow-up's own replicas that only the gateway's queued-prefill count calls full
    past = ([ld for ld in owns if passable(ld, limits, prompt_tokens, past_room)]
            if history else [])
    past_s = min((cost_past(ld, prefill_s_per_token, prompt) for ld in past),
                 default=math.inf)
    past_names = tuple(ld.name for ld in past if
                       cost_past(ld, prefill_s_per_token, prompt) == past_s)
    roomy = [ld for ld in loads if has_room(ld, limits, prompt_tokens)]
    if not roomy and cache_steers:
        roomy = [ld for ld in loads if room_but_cache(ld, limits, prompt_tokens)]
    if not roomy:
        # nowhere to move to: the engine there serves it no later than holding would (the
        # same queue, ahead of the dispatch), so within the bound it goes
        if past and past_s <= _hold(owns, limits, prefill_s_per_token, in_flight_s,
                                    waited_s, prompt, prompt_tokens)[0]:
            return Binding(True, past_names, "past")
        return Binding(False, (), "full")
    names = tuple(ld.name for ld in roomy)
    best_roomy = max(ld.predicted_tokens for ld in roomy)
    if best_roomy >= best:
        return Binding(True, names, "room")
    # the whole wait, what it already waited included, must cost less than moving: a
    # fresh estimate each pass would otherwise let it wait up to the cap however wrong
    hold, wait = _hold(owns, limits, prefill_s_per_token, in_flight_s, waited_s, prompt,
                       prompt_tokens)
    move = min(cost_elsewhere(ld, prefill_s_per_token, prompt, prior_s) for ld in roomy)
    if past and past_s <= move and past_s <= hold:
        return Binding(True, past_names, "past")
    if hold < move and waited_s + wait <= own_max_wait_s:
        return Binding(False, (), "own")
    return Binding(True, names, "elsewhere")


def _hold(owns: Sequence[ReplicaLoad], limits: RoomLimits, prefill_s_per_token: float,
          in_flight_s: float, waited_s: float, prompt: float,
          prompt_tokens: float) -> tuple[float, float]:
    """Holding for the own replicas: its cost (`cost_own`, the cheapest) and the shortest
    wait for one of them."""
    waits = [wait_estimate(ld, limits, prefill_s_per_token, in_flight_s, prompt_tokens)
             for ld in owns]
    hold = min(cost_own(ld, w, prefill_s_per_token, waited_s, prompt)
               for ld, w in zip(owns, waits, strict=True))
    return hold, min(waits)
