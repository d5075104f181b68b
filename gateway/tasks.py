"""Background tasks: their error boundary and their end.

Every periodic or `while True` task of the gateway (health probes, scrapes, model refresh,
KV-event feeds, the shared state's Redis loops, usage sinks and summaries, the picker's
pool watch) runs under an error boundary: an unexpected error in one step, or in one
replica's share of it, is logged and the task goes on, so that one failure never stops the
monitoring of any replica nor routing. The boundary catches `Exception` only: cancellation
(`asyncio.CancelledError`, a `BaseException`) still ends the task.

- `FailureLog`: the rate limit of those log lines, per kind of failure (`what`, e.g.
  "scrape r1"): the first at once with its traceback, then at most one every `every_s`
  seconds with the count of those not logged since. At most `capacity` kinds are kept
  (the one logged longest ago is forgotten first): replicas come and go. `due` is the same
  rate limit for a caller that words its own line (a replica's undecodable KV events).
- `every`: run an action every `interval_s` seconds, each run inside the boundary.
- `supervised`: run a loop; when it ends with an error, log it and start it again after a
  capped backoff (from 0.5 s to 30 s; the schedule starts over once a run lasted longer
  than the cap).
- `cancel_all`: cancel tasks and wait until each has finished.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable

from gateway.backoff import Backoff, Retrier

LOG_EVERY_S = 60.0
MAX_KINDS = 256  # distinct `what`s remembered by one FailureLog
RESTART = Backoff(base_s=0.5, cap_s=30.0, jitter=0.2)


class FailureLog:
    def __init__(self, logger: logging.Logger, every_s: float = LOG_EVERY_S, *,
                 clock: Callable[[], float] = time.monotonic,
                 capacity: int = MAX_KINDS) -> None:
        self._log = logger
        self._every_s = every_s
        self._clock = clock
        self._capacity = capacity
        # what -> (when last logged, failures not logged since)
        self._seen: OrderedDict[str, tuple[float, int]] = OrderedDict()
        self.failures = 0  # all of them, logged or not

    def due(self, what: str) -> int | None:
        """Count a failure of `what`: when its line is due now, how many were not logged
        since the last one; else None (for a caller that words its own line)."""
        self.failures += 1
        now = self._clock()
        last = self._seen.get(what)
        if last is not None and now - last[0] < self._every_s:
            self._seen[what] = (last[0], last[1] + 1)
            return None
        skipped = last[1] if last is not None else 0
        self._seen.pop(what, None)
        self._seen[what] = (now, 0)
        while len(self._seen) > self._capacity:
            self._seen.popitem(last=False)
        return skipped

    def failed(self, what: str, exc: BaseException) -> bool:
        """Count a failure of `what`; True when it was logged now."""
        skipped = self.due(what)
        if skipped is None:
            return False
        self._log.error("%s failed (%s); going on (%d more not logged since the last)",
                        what, type(exc).__name__, skipped, exc_info=exc,
                        extra={"task": what, "not_logged": skipped})
        return True


async def every(interval_s: float, action: Callable[[], Awaitable[object]], what: str,
                failures: FailureLog) -> None:
    """Run `action` every `interval_s` seconds until cancelled; an error in one run is
    logged (rate-limited) and the next run comes on time."""
    while True:
        await asyncio.sleep(interval_s)
        await guarded(action, what, failures)


async def guarded(step: Callable[[], Awaitable[object]], what: str,
                  failures: FailureLog) -> None:
    """Run one step inside the boundary."""
    try:
        await step()
    except Exception as exc:  # the boundary: anything but cancellation
        failures.failed(what, exc)


async def supervised(what: str, run: Callable[[], Awaitable[None]], failures: FailureLog, *,
                     retry: Backoff = RESTART,
                     sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
                     clock: Callable[[], float] = time.monotonic) -> None:
    """Run the loop `run()` until it returns or is cancelled, starting it again after an
    error (module docstring)."""
    retrier = Retrier(retry, sleep=sleep)
    while True:
        began = clock()
        try:
            await run()
            return
        except Exception as exc:  # the boundary: anything but cancellation
            failures.failed(what, exc)
            if clock() - began > retry.cap_s:
                retrier.reset()
            await retrier.wait()


async def cancel_all(tasks: Iterable[asyncio.Task[None]]) -> None:
    """Cancel every task, then wait for each (a task that ends with an error would have
    logged it already; cancellation is the expected end)."""
    tasks = list(tasks)
    for t in tasks:
        t.cancel()
    for t in tasks:
        with contextlib.suppress(asyncio.CancelledError):
            await t
