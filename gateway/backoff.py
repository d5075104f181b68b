"""Retry delays: capped exponential backoff with jitter, and the sleep that waits them out.

`Backoff` is the schedule, a pure value: the delay before retry `n` (0-based) is
`min(cap_s, base_s * factor**n)`, less a random share of it (`jitter`: 0 keeps it exact,
0.5 draws it from [delay/2, delay]; "equal jitter" in AWS's naming), so that many loops
that failed together (gateways behind one Redis, feeds of one restarted replica) do not
retry in step. The random draw is a parameter: tests pass fixed draws.

`Retrier` is one retrying loop's state: `await retrier.wait()` after a failure sleeps the
next delay (or `failed()` decides it, for a log line, and `sleep(delay)` waits it out),
`reset()` after a success starts the schedule over. Its random source and
its sleep are collaborators (defaults: `random.random`, `asyncio.sleep`).

Loops that use it: the KV-event subscriber restart (`events/feeds.py`), the usage sink
pump (`usage/sinks.py`) and the shared state's Redis reader and writer
(`shared/redis_state.py`). The upstream client retries nothing (a request reaches each
engine at most once; gateway.upstream.failure).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True, slots=True)
class Backoff:
    base_s: float
    cap_s: float
    factor: float = 2.0
    jitter: float = 0.0  # the share of each delay drawn at random, 0..1

    def __post_init__(self) -> None:
        if self.base_s < 0 or self.cap_s < self.base_s:
            raise ValueError(f"backoff needs 0 <= base_s <= cap_s, got {self.base_s}, "
                             f"{self.cap_s}")  # fmt: skip
        if self.factor < 1 or not 0 <= self.jitter <= 1:
            raise ValueError(f"backoff needs factor >= 1 and jitter in [0, 1], got "
                             f"{self.factor}, {self.jitter}")  # fmt: skip

    def delay(self, attempt: int, draw: float) -> float:
        """Seconds before retry `attempt` (0-based); `draw` is uniform in [0, 1)."""
        # Past the cap the power only grows: stop computing it (no float overflow).
        exact = self.cap_s
        if self.base_s * self.factor ** min(attempt, 64) < self.cap_s:
            exact = self.base_s * self.factor**attempt
        return exact * (1.0 - self.jitter * draw)


class Retrier:
    def __init__(self, backoff: Backoff, *, rand: Callable[[], float] = random.random,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:
        self.backoff = backoff
        self._rand = rand
        self._sleep = sleep
        self.failures = 0  # since the last reset

    def failed(self) -> float:
        """Count a failure; the delay to wait before the next attempt."""
        delay = self.backoff.delay(self.failures, self._rand())
        self.failures += 1
        return delay

    async def sleep(self, delay: float) -> None:
        await self._sleep(delay)

    async def wait(self) -> float:
        """After a failure: sleep out the next delay, and return it."""
        delay = self.failed()
        await self._sleep(delay)
        return delay

    def reset(self) -> None:
        self.failures = 0
