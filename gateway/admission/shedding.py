"""What happens to a request the queue is asked to hold (pure): enqueue it, displace a
lower-class waiter for it, or shed it with a reason.

Rules, in order:
1. `tenant_share`: other tenants wait in its class and this tenant is over its fair
   share: it took more than `over_share` times its weighted share (`w_t / sum of w over
   the tenants waiting in the class, itself included`) of the prompt tokens its class
   was admitted lately, or it already holds that share of the queue there (`max_queue x`
   the same fraction). A flooder is answered at once with Retry-After rather than queued
   to its wait limit: its waiting would only lengthen the queue the others wait behind.
2. `wait_limit`: the wait projected for it (fair-share tokens ahead of it, itself
   included, at the measured drain rate) is longer than its class's limit: it would
   only time out; answered at once instead.
3. `queue_full`: `max_queue` requests wait and none is of a lower class; when one is, the
   youngest waiter of the lowest class is shed instead (`displaced`).
A waiter still queued at its class's limit is shed as `wait_timeout`.

Every shed request is answered 429 in OpenAI's shape with `Retry-After` (whole seconds:
the projected wait, at least 1, at most the class's limit) and counted by reason.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from gateway.upstream.errors import GatewayError

ShedReason = Literal["tenant_share", "wait_limit", "queue_full", "displaced", "wait_timeout"]
SHED_REASONS: tuple[ShedReason, ...] = (
    "tenant_share", "wait_limit", "queue_full", "displaced", "wait_timeout")
Verdict = Literal["enqueue", "displace"] | ShedReason


@dataclass(frozen=True, slots=True)
class Arrival:
    queue_len: int  # requests waiting, all classes
    max_queue: int
    lower_waiting: bool  # some waiter is of a lower class than this request
    projected_s: float  # estimated wait for this request
    max_wait_s: float  # its class's limit
    tenant_waiting: int  # this tenant's waiters in this class
    tenant_slots: float  # its weighted share of max_queue among the class's tenants
    others_waiting: bool  # other tenants wait in this class
    recent_part: float = 0.0  # its part of the class's recently admitted prompt tokens
    fair_part: float = 1.0  # its weighted share among the tenants waiting in the class
    over_share: float = 1.25  # how far above `fair_part` it may run


def verdict(a: Arrival) -> Verdict:
    if a.others_waiting and (a.tenant_waiting >= a.tenant_slots
                             or a.recent_part > a.fair_part * a.over_share):
        return "tenant_share"
    if a.projected_s > a.max_wait_s:
        return "wait_limit"
    if a.queue_len >= a.max_queue:
        return "displace" if a.lower_waiting else "queue_full"
    return "enqueue"


def retry_after(projected_s: float, max_wait_s: float) -> int:
    """Whole seconds for `Retry-After`: the projected wait, within [1, max_wait_s]."""
    cap = max(1, math.ceil(max_wait_s))
    if not math.isfinite(projected_s):
        return cap
    return min(cap, max(1, math.ceil(projected_s)))


_MESSAGES: dict[ShedReason, str] = {
    "tenant_share": "This API key is over its share of the gateway while other keys "
                    "wait.",
    "wait_limit": "The gateway is overloaded: the expected wait exceeds this priority "
                  "class's limit.",
    "queue_full": "The gateway's queue is full.",
    "displaced": "The gateway's queue is full and a higher-priority request took this "
                 "request's place.",
    "wait_timeout": "The request waited in the gateway's queue for its priority class's "
                    "limit without a replica having room.",
}


class Shed(GatewayError):
    """A 429 the queue answers: OpenAI's shape (type `rate_limit_exceeded`, code
    `overloaded_<reason>`), with `Retry-After`."""

    def __init__(self, reason: ShedReason, retry_after_s: int) -> None:
        super().__init__(429, _MESSAGES[reason] + f" Retry after {retry_after_s} s.",
                         code=f"overloaded_{reason}", retry_after=retry_after_s)
        self.reason = reason


@dataclass(slots=True)
class DrainRate:
    """Prompt tokens per second the queue released while requests waited: the fleet's
    measured throughput in the units the queue counts. A bounded ring of (time, tokens);
    below `floor` (the cost model's prefill rate) it is not believed from a few samples
    or a short span, so a few slow samples cannot shed everything; a drain measured over
    `trusted_span_s` or more stands even below the floors (replicas bound by their
    sequences release the queue far slower than they could prefill, and a projection at
    the prefill rate would hold each arrival to its `wait_timeout` instead of answering
    it at once). The gate clears it when its queue empties (`clear`), so the time nobody
    waited is never counted as a slow drain."""

    floor: float
    capacity: int = 256
    window_s: float = 30.0
    trusted_span_s: float = 10.0
    _samples: list[tuple[float, float]] | None = None

    def add(self, now: float, tokens: float) -> None:
        if self._samples is None:
            self._samples = []
        self._samples.append((now, tokens))
        if len(self._samples) > self.capacity:
            del self._samples[: len(self._samples) - self.capacity]

    def rate(self, now: float, floor: float | None = None) -> float:
        """Tokens per second, not below `floor` (None: `self.floor`: the caller's
        better-informed floor, the fleet's own prefill rate, gate.py `_projected_s`)
        unless measured over `trusted_span_s`."""
        least = self.floor if floor is None or floor <= 0 else max(self.floor, floor)
        s = [x for x in (self._samples or []) if x[0] >= now - self.window_s]
        if len(s) < 8:
            return least
        span = max(s[-1][0] - s[0][0], 1e-3)
        measured = sum(t for _, t in s[1:]) / span
        return measured if span >= self.trusted_span_s else max(least, measured)

    def clear(self) -> None:
        """Forget the samples: nobody waits, so the next wait measures afresh."""
        self._samples = None
