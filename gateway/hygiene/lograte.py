"""Dedup and rate limit for hygiene log lines, so an agent in a hot loop that sends the
same broken prompt every second logs it once a minute, not every second.

A finding is keyed by (session, kind, role, message_index): the same problem at the same
place of the same session. A key is let through at most once per `interval_s`; on top, at
most `max_per_s` findings pass per one-second window whatever their keys. Remembered keys
are an LRU capped at `max_keys`. Pure: time is the `now` argument.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from gateway.hygiene.finding import Finding

Key = tuple[str | None, str, str | None, int | None]


class LogLimiter:
    def __init__(self, interval_s: float, max_per_s: int, max_keys: int) -> None:
        self._interval = interval_s
        self._max_per_s = max_per_s
        self._max_keys = max_keys
        self._last: OrderedDict[Key, float] = OrderedDict()
        self._window = 0.0
        self._count = 0

    def admit(self, findings: Sequence[Finding], now: float) -> list[Finding]:
        out: list[Finding] = []
        if now - self._window >= 1.0:
            self._window = now
            self._count = 0
        for f in findings:
            key: Key = (f.session, f.kind, f.role, f.message_index)
            last = self._last.get(key)
            if last is not None and now - last < self._interval:
                continue
            if self._count >= self._max_per_s:
                break
            self._count += 1
            self._last[key] = now
            self._last.move_to_end(key)
            if len(self._last) > self._max_keys:
                self._last.popitem(last=False)
            out.append(f)
        return out
