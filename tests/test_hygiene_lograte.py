"""Hygiene log lines: deduplicated and capped per second, and what is held back summed up
once per interval instead of dropped without a word."""

from __future__ import annotations

import pytest

from gateway.hygiene.finding import Finding
from gateway.hygiene.lograte import Held, LogLimiter


def finding(kind: str, offset: int = 3, tokens: int = 100, severity: str = "warning"
            ) -> Finding:
    return Finding(kind, severity, "pattern", 0, "system", offset, "<x>", tokens, "s")  # type: ignore[arg-type]


F, G, H = finding("timestamp"), finding("uuid", 9), finding("nonce", 20)


def test_dedups_per_place_and_caps_per_second() -> None:
    a = LogLimiter(60, 2, 100)
    assert a.admit([F], 0.0) == [F]
    assert a.admit([F], 30.0) == []
    assert a.admit([F, G, H], 61.0) == [F, G]
    assert a.admit([H], 61.5) == []
    assert a.admit([H], 62.5) == [H]


@pytest.mark.parametrize(("calls", "at", "expected"), [
    # nothing held back: no summary, however long it has been
    ([([F], 0.0)], 500.0, None),
    # held back, but the interval is not over yet
    ([([F], 0.0), ([F], 1.0)], 59.0, None),
    # the same finding sent 5 times in a minute: 1 logged, 4 summed up with their tokens
    ([([F], float(t)) for t in range(0, 50, 10)], 60.0,
     (Held("timestamp", "warning", 4, 400),)),
    # the per-second cap holds back other kinds too; costliest first
    ([([F, G, finding("nonce", 20, 900)], 0.0), ([F], 1.0)], 61.0,
     (Held("nonce", "warning", 1, 900), Held("timestamp", "warning", 1, 100))),
])  # fmt: skip
def test_summary_of_what_was_held_back(
    calls: list[tuple[list[Finding], float]], at: float, expected: tuple[Held, ...] | None,
) -> None:
    a = LogLimiter(60, 2, 100)
    for findings, now in calls:
        a.admit(findings, now)
    got = a.summary(at)
    assert (None if got is None else got.held) == expected
    if got is not None:
        assert a.summary(at + 1000) is None  # handed over once, counts start again
        assert f"{got.findings} more hygiene finding(s)" in got.text()
