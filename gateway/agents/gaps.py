"""How long each agent program's tool calls last, learnt from its own request times.

A gap is the time from the last byte of a program's turn to its next request (the tool
call in between, plus the agent's own think time). Each program keeps its `window` most
recent gaps (the decay: older gaps fall out), and every gap also feeds its tenant's
prior of the `prior_window` most recent gaps of that tenant's programs, which stands for
a program of that tenant with fewer than `min_samples` gaps of its own. The prior is
scoped by tenant: one tenant's programs (quick or idle) never decide whether another
tenant's context is held.

The estimate is robust to the heavy tail tool calls have: not a mean but a quantile of
what is left, given how long the program has been away (`remaining_wait`): among the
gaps longer than the time already elapsed, the `q`-quantile of what remained of them. A
program away longer than any gap it ever took has no estimate (None): it is not
expected back soon, and nothing is held for it.

Bounds: at most `max_programs` programs (least recently seen dropped first), each
forgotten `ttl_s` after its last gap; `window` gaps per program; at most `max_tenants`
priors (least recently taught dropped first) of `prior_window` gaps each. Program keys
are (tenant, program id): never metric labels.
"""

from __future__ import annotations

import bisect
import math
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass

ProgramKey = tuple[str, str]

MAX_PROGRAMS = 4096
TTL_S = 900.0
WINDOW = 32
PRIOR_WINDOW = 512
MIN_SAMPLES = 4
MAX_TENANTS = 1024


def remaining_wait(gaps: Sequence[float], elapsed: float, q: float = 0.5) -> float | None:
    """The `q`-quantile of `g - elapsed` over the gaps `g` longer than `elapsed` (module
    docstring), None when there is none; `gaps` sorted ascending (what
    `GapLearner.samples` gives), by bisection: O(log n) per program, where the
    reservation reads every program between turns on each load the gate reads."""
    start = bisect.bisect_right(gaps, elapsed)
    left = len(gaps) - start
    if left <= 0:
        return None
    rank = max(0, min(left - 1, math.ceil(q * left) - 1))
    return gaps[start + rank] - elapsed


@dataclass(slots=True)
class _Program:
    gaps: deque[float]
    seen: float


class GapLearner:
    def __init__(self, *, max_programs: int = MAX_PROGRAMS, ttl_s: float = TTL_S,
                 window: int = WINDOW, prior_window: int = PRIOR_WINDOW,
                 min_samples: int = MIN_SAMPLES, max_tenants: int = MAX_TENANTS) -> None:
        if min(max_programs, window, prior_window, min_samples, max_tenants) < 1 \
                or ttl_s <= 0:
            raise ValueError("gap learner bounds must be positive")
        self.max_programs = max_programs
        self.ttl_s = ttl_s
        self.window = window
        self.min_samples = min_samples
        self._programs: OrderedDict[ProgramKey, _Program] = OrderedDict()
        self.prior_window = prior_window
        self.max_tenants = max_tenants
        # tenant -> its programs' most recent gaps, least recently taught first
        self._priors: OrderedDict[str, deque[float]] = OrderedDict()
        # tenant -> its prior sorted, made on the first read after a change (a prior of
        # `prior_window` gaps is read for each of up to `max_programs` programs per pass)
        self._sorted: dict[str, tuple[float, ...]] = {}

    def observe(self, key: ProgramKey, gap_s: float, now: float) -> None:
        """`key`'s next request came `gap_s` after its last turn's last byte."""
        if not math.isfinite(gap_s) or gap_s < 0:
            return
        self._expire(now)
        entry = self._programs.get(key)
        if entry is None:
            entry = self._programs[key] = _Program(deque(maxlen=self.window), now)
            while len(self._programs) > self.max_programs:
                self._programs.popitem(last=False)
        else:
            self._programs.move_to_end(key)
            entry.seen = now
        entry.gaps.append(gap_s)
        tenant = key[0]
        prior = self._priors.get(tenant)
        if prior is None:
            prior = self._priors[tenant] = deque(maxlen=self.prior_window)
            while len(self._priors) > self.max_tenants:
                self._sorted.pop(self._priors.popitem(last=False)[0], None)
        else:
            self._priors.move_to_end(tenant)
        prior.append(gap_s)
        self._sorted.pop(tenant, None)

    def samples(self, key: ProgramKey, now: float) -> Sequence[float]:
        """The gaps that stand for `key`'s next one, sorted ascending: its own once it has
        `min_samples`, else its tenant's prior (empty at first: another tenant's gaps never
        stand for it)."""
        entry = self._programs.get(key)
        if entry is not None and now - entry.seen <= self.ttl_s \
                and len(entry.gaps) >= self.min_samples:
            return tuple(sorted(entry.gaps))
        tenant = key[0]
        cached = self._sorted.get(tenant)
        if cached is None:
            cached = tuple(sorted(self._priors.get(tenant, ())))
            if tenant in self._priors:
                self._sorted[tenant] = cached
        return cached

    def __len__(self) -> int:
        return len(self._programs)

    def _expire(self, now: float) -> None:
        """Drop programs not seen for `ttl_s` (the oldest first: the map is in seen order)."""
        while self._programs:
            key, entry = next(iter(self._programs.items()))
            if now - entry.seen <= self.ttl_s:
                return
            del self._programs[key]
