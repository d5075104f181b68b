"""`gateway lint`'s report for a person (pure: findings and times in, lines of text out).

Per finding, three lines: the finding and its place, the tokens at risk (what fixing it
saves per request), the remedy. At the end, per kind and severity: the requests that had
it, the tokens at risk summed (each request once per kind, at its costliest finding, as
`/stats` sums them) and the saving per hour at the input's own rate: those tokens over the
span between the earliest and the latest `ts` of the input (gateway.hygiene.remedy
.per_hour). Input without times (bare bodies, no `ts`) has no rate, and says so.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway.hygiene.finding import Finding
from gateway.hygiene.remedy import per_hour


def _place(f: Finding) -> str:
    if f.message_index is not None:
        return f"message {f.message_index} ({_shown(f.role or '')})"
    return "the tool definitions" if f.role == "tools" else "the prompt"


def _shown(text: str) -> str:
    """Text from a prompt or a client (an unredacted span, a tool name, a session id, a
    message's role; a usage record's kind, as any file handed to lint may carry anything)
    on a terminal: control characters (a newline, an escape sequence) shown as `?`."""
    return "".join(c if c.isprintable() else "?" for c in text)


def finding_text(f: Finding) -> str:
    """A finding as three lines (no trailing newline)."""
    session = f", session {_shown(f.session)}" if f.session else ""
    fix = _shown(f.remedy) or "keep the prompt prefix identical from request to request"
    line = f"line {f.line}: " if f.line is not None else ""
    return (f"{line}{_shown(f.kind)} ({f.severity}, found by {f.evidence}) in {_place(f)} at "
            f"character {f.char_offset}{session}: {_shown(f.span)}\n"
            f"  {f.tokens_at_risk} prompt tokens at risk: fixing it saves "
            f"{f.tokens_at_risk} tokens a request\n"
            f"  fix: {fix}")


@dataclass(slots=True)
class _Kind:
    requests: int = 0
    findings: int = 0
    tokens: int = 0


@dataclass
class Tally:
    """What the closing summary needs; bounded by the kinds and severities the analyzer
    names, not by the input's length."""

    kinds: dict[tuple[str, str], _Kind] = field(default_factory=dict)
    first_ts: float | None = None
    last_ts: float | None = None
    _line: int | None = None
    _costliest: dict[tuple[str, str], int] = field(default_factory=dict)

    def time(self, ts: float) -> None:
        """A line's own arrival time (`ts`), for the rate."""
        self.first_ts = ts if self.first_ts is None else min(self.first_ts, ts)
        self.last_ts = ts if self.last_ts is None else max(self.last_ts, ts)

    def add(self, f: Finding) -> None:
        if f.line != self._line:  # findings arrive grouped by line
            self._close()
            self._line = f.line
        key = (f.kind, f.severity)
        k = self.kinds.setdefault(key, _Kind())
        k.findings += 1
        self._costliest[key] = max(self._costliest.get(key, 0), f.tokens_at_risk)

    def _close(self) -> None:
        for key, tokens in self._costliest.items():
            self.kinds[key].requests += 1
            self.kinds[key].tokens += tokens
        self._costliest = {}

    def summary(self, lines: int, skipped: int) -> str:
        self._close()
        if not self.kinds:
            return f"No findings in {lines} line(s)."
        span = None
        if self.first_ts is not None and self.last_ts is not None:
            span = self.last_ts - self.first_ts
        out = [f"Summary of {lines} line(s)" + (f", {skipped} unreadable" if skipped else "")
               + (f", spanning {span:.0f} s:" if span is not None else ":")]
        for (kind, severity), k in sorted(self.kinds.items(),
                                          key=lambda kv: (-kv[1].tokens, kv[0])):
            rate = ("no rate: the input has no ts" if span is None
                    else f"fixing it saves about {per_hour(k.tokens, span)} tokens an hour "
                    "at this input's rate")
            out.append(f"  {_shown(kind)} ({severity}): {k.findings} finding(s) in {k.requests} "
                       f"request(s), {k.tokens} tokens at risk; {rate}")
        return "\n".join(out)
