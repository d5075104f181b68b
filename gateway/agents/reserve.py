"""Context held for agent programs in a tool call (pure decision, bounded state).

When a program's turn ends (its answer's last byte) on a replica, the program is in a
tool call: its context (the prompt and answer tokens of that turn) sits in that replica's
prefix cache, idle, the least recently used there and the first a newcomer evicts. It
counts as reserved on that replica (`holds`) while
- less than `max_s` has passed since (`[admission] agent_reserve_max_s`, 10 s by default
  like the vLLM Router's proposal; 0 turns the reservation off), and
- the expected remaining wait for its next request (gaps.py `remaining_wait`,
  from its own gaps or its tenant's prior) is below its miss cost: the seconds to prefill its
  context again at the replica's prefill rate.
Its next request (or `max_s`) ends the reservation, and so does its replica restarting
(its cache is empty: `epoch`, the router's restart count, differs from the one the turn
ended in) or leaving (`forget_replica`).

The context held on one replica is bounded: at most `share` (`RESERVE_SHARE`, half) of
its KV capacity in all (`reserved_tokens` where the capacity is known, and
`kv_with_reserved` on the total): held context past what the cache keeps protects
nothing, and one tenant's programs alone never read a replica (or the fleet) full to
another tenant's newcomer while its running requests leave half its cache. No
per-tenant split of that half is made: the gate reads only the total, which any
work-conserving split among the tenants holding context leaves the same; a bound
relative to the tenant asking would need a load read per tenant.

How eviction is estimated (`kv_with_reserved`): vLLM counts in
`vllm:kv_cache_usage_perc` the blocks held by running requests; a finished request's
blocks are free but still cached, evicted least recently used first when a newcomer
needs blocks. So a replica evicts a reserved program's context once its usage plus that
context passes its KV capacity (the blocks `vllm:cache_config_info` reports times their
size, `Replica.capacity_tokens`). The admission gate's view of a replica adds the
reserved tokens as a share of that capacity to its scraped usage: a replica whose
running requests leave room beyond the reserved context still takes other requests;
one that would evict it reads as full until the reservation ends (even where a cache
full by its engine's own count only steers: admission/room.py). Unknown capacity or
usage: nothing is added (the gate reads the replica as before).

Bounds: at most `max_threads` programs (sub-agents apart) between turns, least recently
ended dropped first; an entry leaves at its next request or when `ttl_s` passed (it is
kept past `max_s` only to learn the gap of a late return).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from gateway.agents.gaps import GapLearner, remaining_wait
from gateway.agents.programs import ProgramId

MAX_THREADS = 4096
DEFAULT_MAX_S = 10.0
QUANTILE = 0.5
RESERVE_SHARE = 0.5  # the most of a replica's KV capacity held for programs in all

ThreadKey = tuple[str, str, str | None]


@dataclass(frozen=True, slots=True)
class Between:
    """A program (sub-agent) between two turns."""

    program: ProgramId
    replica: str
    context_tokens: int
    since: float  # its last turn's last byte
    epoch: int = 0  # its replica's restart count then: another count, its cache is gone


def holds(elapsed: float, context_tokens: int, gaps: Sequence[float], s_per_token: float,
          max_s: float, q: float = QUANTILE) -> bool:
    """Whether a program away `elapsed` seconds still has its context reserved (module
    docstring); `gaps` sorted ascending (`GapLearner.samples`)."""
    if max_s <= 0 or elapsed < 0 or elapsed >= max_s or context_tokens <= 0:
        return False
    wait = remaining_wait(gaps, elapsed, q)
    return wait is not None and wait < context_tokens * s_per_token


def kv_with_reserved(kv_usage: float | None, reserved_tokens: int,
                     capacity_tokens: int | None, share: float = RESERVE_SHARE
                     ) -> float | None:
    """The KV usage a replica reads as once `reserved_tokens` (at most `share` of its
    capacity) are kept from eviction (module docstring); `kv_usage` unchanged when
    anything is unknown."""
    if kv_usage is None or not capacity_tokens or capacity_tokens <= 0 or reserved_tokens <= 0:
        return kv_usage
    return kv_usage + min(reserved_tokens / capacity_tokens, share)


class Reservations:
    """Programs between turns, their gaps learnt, and what is reserved on each replica."""

    def __init__(self, *, max_s: float = DEFAULT_MAX_S,
                 s_per_token: Callable[[str], float],
                 learner: GapLearner | None = None, max_threads: int = MAX_THREADS,
                 q: float = QUANTILE,
                 capacity_tokens: Callable[[str], int | None] | None = None,
                 epoch: Callable[[str], int] | None = None,
                 share: float = RESERVE_SHARE) -> None:
        if max_s < 0 or max_threads < 1 or not 0 < q <= 1 or not 0 <= share <= 1:
            raise ValueError("reservation bounds: max_s >= 0, max_threads >= 1, q in (0, 1],"
                             " share in [0, 1]")
        self.share = share
        self._capacity = capacity_tokens  # the replica's KV capacity, None: unknown
        self._epoch = epoch  # the replica's restart count (the router's)
        self.max_s = max_s
        self.q = q
        self.max_threads = max_threads
        self.learner = learner if learner is not None else GapLearner()
        self._s_per_token = s_per_token  # the replica's prefill rate, seconds per token
        self._between: OrderedDict[ThreadKey, Between] = OrderedDict()

    def began(self, program: ProgramId, now: float) -> bool:
        """A request of `program` arrived: its tool call (if any) is over; its gap is
        learnt and its reservation ends. True: it returns from a tool call (it was
        between turns, its context on a replica)."""
        return self.began_on(program, now) is not None

    def began_on(self, program: ProgramId, now: float) -> str | None:
        """`began`, naming the replica its context was on (None: it was not between
        turns)."""
        was = self._between.pop(program.thread_key(), None)
        if was is not None and now - was.since <= self.learner.ttl_s:
            self.learner.observe(program.program_key(), now - was.since, now)
        return None if was is None else was.replica

    def ended(self, program: ProgramId, replica: str, context_tokens: int, now: float
              ) -> None:
        """`program`'s turn on `replica` ended (last byte) with `context_tokens` of
        prompt and answer: it is in a tool call now."""
        key = program.thread_key()
        self._between.pop(key, None)
        self._between[key] = Between(program, replica, max(0, context_tokens), now,
                                     self._epoch_of(replica))
        self._expire(now)
        while len(self._between) > self.max_threads:
            self._between.popitem(last=False)

    def reserved_tokens(self, replica: str, now: float) -> int:
        """The context held on `replica` at `now` for programs in a tool call."""
        if self.max_s <= 0:
            return 0
        self._expire(now)
        epoch = self._epoch_of(replica)
        s = self._s_per_token(replica)
        total = 0
        stale: list[ThreadKey] = []
        for key, b in reversed(self._between.items()):  # newest first (ended in time order)
            if now - b.since >= self.max_s:
                break  # this and all older ones are past the cap
            if b.replica == replica and b.epoch != epoch:
                stale.append(key)  # the replica restarted since: its cache went with it
            elif b.replica == replica and holds(
                    now - b.since, b.context_tokens,
                    self.learner.samples(b.program.program_key(), now), s, self.max_s, self.q):
                total += b.context_tokens
        for key in stale:  # (older ones, never held again, leave at the TTL)
            del self._between[key]
        capacity = None if self._capacity is None else self._capacity(replica)
        if not capacity or capacity <= 0:  # unknown: nothing is added to its usage anyway
            return total
        return min(total, int(self.share * capacity))

    def _epoch_of(self, replica: str) -> int:
        return 0 if self._epoch is None else self._epoch(replica)

    def held(self, now: float) -> dict[str, int]:
        """Per replica, the context held there at `now` (replicas holding none left out)."""
        out = {name: self.reserved_tokens(name, now)
               for name in {b.replica for b in self._between.values()}}
        return {name: tokens for name, tokens in sorted(out.items()) if tokens > 0}

    def forget_replica(self, replica: str) -> None:
        """`replica` left: nothing is held there (its cache went with it)."""
        for key in [k for k, b in self._between.items() if b.replica == replica]:
            del self._between[key]

    def __len__(self) -> int:
        return len(self._between)

    def _expire(self, now: float) -> None:
        """Drop entries older than the learner's TTL (the map is in `since` order)."""
        ttl = self.learner.ttl_s
        while self._between:
            key, b = next(iter(self._between.items()))
            if now - b.since <= ttl and math.isfinite(b.since):
                return
            del self._between[key]
