"""Hygiene log lines: deduplicated and capped per second, and what is held back summed up
once per interval instead of dropped without a word."""

from __future__ import annotations

import dataclasses

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
    # the same finding sent 5 times in a minute: 1 logged, 4 summed up with their tokens;
    # the saving per hour counts all 5 (500 tokens in 60 s)
    ([([F], float(t)) for t in range(0, 50, 10)], 60.0,
     (Held("timestamp", "warning", 4, 400, 30000),)),
    # the per-second cap holds back other kinds too; costliest first; 900 and 200 tokens
    # in 61 s
    ([([F, G, finding("nonce", 20, 900)], 0.0), ([F], 1.0)], 61.0,
     (Held("nonce", "warning", 1, 900, 53115), Held("timestamp", "warning", 1, 100, 11803))),
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


def test_the_summary_line_says_how_to_fix_and_what_it_saves() -> None:
    """The summed-up line carries each kind's newest remedy and its saving per hour (every
    finding of the span counted, logged or held back)."""
    old = dataclasses.replace(F, remedy="round the old one")
    new = dataclasses.replace(F, remedy="move the time from message 0 (system) into the "
                              "last user message (message 3), after the cached prefix, or "
                              "round it to the day")
    a = LogLimiter(60, 20, 100)
    for t, f in ((0.0, old), (10.0, old), (20.0, new)):
        a.admit([f], t)
    got = a.summary(120.0)
    assert got is not None
    assert got.held == (Held("timestamp", "warning", 2, 200, 9000, new.remedy),)
    assert ("timestamp (warning) x2, 200 tokens at risk, fixing it saves about 9000 tokens "
            f"an hour: {new.remedy}") in got.text()
