"""Dedup and rate limit for hygiene log lines, so an agent in a hot loop that sends the
same broken prompt every second logs it once a minute, not every second, and what was held
back is summed up instead of lost.

A finding is keyed by (session, kind, role, message_index): the same problem at the same
place of the same session. A key is let through at most once per `interval_s`; on top, at
most `max_per_s` findings pass per one-second window whatever their keys. Remembered keys
are an LRU capped at `max_keys`.

Every finding held back is counted per (kind, severity) with the prompt tokens it put at
risk (at most one row per kind and severity: bounded). `summary(now)` hands those counts
over, and starts new ones, once at least `interval_s` has passed since the last summary
and something was held back; the caller logs it as one line. Each row carries the remedy
of its kind's newest finding and what it would save per hour: the tokens at risk of every
request with a finding of that kind and severity in the span, logged or held back, each
request counted once at its costliest finding of the kind (a request loses the cache once,
as gateway.usage.findings sums it), scaled to an hour (gateway.hygiene.remedy.per_hour).
`admit` is called once per request, with that request's findings. Pure: time is the `now`
argument.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from gateway.hygiene.finding import Finding
from gateway.hygiene.remedy import per_hour

Key = tuple[str | None, str, str | None, int | None]


@dataclass(frozen=True, slots=True)
class Held:
    """Findings of one kind and severity held back since the last summary."""

    kind: str
    severity: str
    findings: int
    tokens_at_risk: int  # summed: what these findings put at risk, request by request
    saving_per_hour: int = 0  # the span's requests with the kind, as a rate per hour
    remedy: str = ""  # the newest finding's


@dataclass(frozen=True, slots=True)
class Summary:
    since: float  # the start of the span summed up
    until: float
    held: tuple[Held, ...]  # costliest first

    @property
    def findings(self) -> int:
        return sum(h.findings for h in self.held)

    def text(self) -> str:
        kinds = "; ".join(f"{h.kind} ({h.severity}) x{h.findings}, {h.tokens_at_risk} "
                          f"tokens at risk, fixing it saves about {h.saving_per_hour} tokens "
                          f"an hour: {h.remedy or 'keep the prompt prefix stable'}"
                          for h in self.held)
        return (f"{self.findings} more hygiene finding(s) in the last "
                f"{self.until - self.since:.0f} s, not logged one by one: {kinds}")


class LogLimiter:
    def __init__(self, interval_s: float, max_per_s: int, max_keys: int) -> None:
        self._interval = interval_s
        self._max_per_s = max_per_s
        self._max_keys = max_keys
        self._last: OrderedDict[Key, float] = OrderedDict()
        self._window = 0.0
        self._count = 0
        self._held: dict[tuple[str, str], list[int]] = {}  # (kind, severity) -> [n, tokens]
        # (kind, severity) -> (tokens at risk of the span's requests, each once per kind at
        # its costliest finding; the newest remedy)
        self._seen: dict[tuple[str, str], tuple[int, str]] = {}
        self._summary_at: float | None = None  # start of the span being summed up

    @property
    def interval_s(self) -> float:
        return self._interval

    def admit(self, findings: Sequence[Finding], now: float) -> list[Finding]:
        out: list[Finding] = []
        if self._summary_at is None:
            self._summary_at = now
        if now - self._window >= 1.0:
            self._window = now
            self._count = 0
        # the request loses the cache once per kind, at its costliest finding (as
        # gateway.usage.findings counts it): two timestamps in one prompt are one break
        costliest: dict[tuple[str, str], Finding] = {}
        for f in findings:
            top = costliest.get((f.kind, f.severity))
            if top is None or f.tokens_at_risk > top.tokens_at_risk:
                costliest[(f.kind, f.severity)] = f
        for kind, f in costliest.items():
            seen = self._seen.get(kind, (0, ""))
            self._seen[kind] = (seen[0] + f.tokens_at_risk, f.remedy or seen[1])
        for f in findings:
            key: Key = (f.session, f.kind, f.role, f.message_index)
            last = self._last.get(key)
            if (last is not None and now - last < self._interval) \
                    or self._count >= self._max_per_s:
                self._hold(f)
                continue
            self._count += 1
            self._last[key] = now
            self._last.move_to_end(key)
            if len(self._last) > self._max_keys:
                self._last.popitem(last=False)
            out.append(f)
        return out

    def _hold(self, f: Finding) -> None:
        row = self._held.get((f.kind, f.severity))
        if row is None:
            row = self._held[(f.kind, f.severity)] = [0, 0]
        row[0] += 1
        row[1] += f.tokens_at_risk

    def summary(self, now: float, *, due: bool = False) -> Summary | None:
        """What was held back, once per interval (None: not due, or nothing held);
        `due=True` hands it over whatever the time (at shutdown)."""
        since = self._summary_at
        if since is None or not self._held or (now - since < self._interval and not due):
            return None
        span = now - since
        held = sorted((Held(k, s, n, t, per_hour(self._seen.get((k, s), (t, ""))[0], span),
                            self._seen.get((k, s), (0, ""))[1])
                       for (k, s), (n, t) in self._held.items()),
                      key=lambda h: (-h.tokens_at_risk, h.kind, h.severity))
        self._held = {}
        self._seen = {}
        self._summary_at = now
        return Summary(since, now, tuple(held))
