"""The volatile-content scanner and drift's first-divergence classifier, as tables."""

from __future__ import annotations

import pytest

from gateway.hygiene.drift import common_prefix, common_suffix
from gateway.hygiene.patterns import DRIFT, STRONG, WEAK, classify_span, scan_text

NOW = 1717250602.0  # 2024-06-01T14:03:22Z
WINDOW = 2 * 86400.0


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Current time: 14:03:22", [("timestamp", "14:03:22", STRONG)]),
        ("Now: 2024-06-01T14:03:22Z ok", [("timestamp", "2024-06-01T14:03:22Z", STRONG)]),
        (
            "at 2024-06-01 16:03:22.123+02:00.",
            [("timestamp", "2024-06-01 16:03:22.123+02:00", STRONG)],
        ),
        (
            "Date: Sat, 01 Jun 2024 14:03:22 +0000",
            [("timestamp", "Sat, 01 Jun 2024 14:03:22 +0000", STRONG)],
        ),
        ("Today is June 1, 2024 at 2:03 PM", [("timestamp", "June 1, 2024 at 2:03 PM", STRONG)]),
        (
            "As of Saturday, 1 June 2024, 14:03",
            [("timestamp", "Saturday, 1 June 2024, 14:03", STRONG)],
        ),
        ("local 06/01/2024 14:03:22", [("timestamp", "06/01/2024 14:03:22", STRONG)]),
        ("Today is 2024-06-01.", [("timestamp", "2024-06-01", WEAK)]),
        ("The time is 14:03", [("timestamp", "14:03", STRONG)]),
        (
            "ts=1717250602 ms=1717250602123.",
            [("timestamp", "1717250602", STRONG), ("timestamp", "1717250602123", STRONG)],
        ),
        (
            "Apollo landed on July 20, 1969 at 20:17 UTC",
            [("timestamp", "July 20, 1969 at 20:17 UTC", DRIFT)],
        ),
        ("Policy updated 2023-03-14T09:00:00Z", [("timestamp", "2023-03-14T09:00:00Z", DRIFT)]),
        ("request id: 3f2a9c1b7d", [("request_id", "3f2a9c1b7d", STRONG)]),
        (
            "**Request ID**: 630ce2b27c8af6666259bbc4",
            [("request_id", "630ce2b27c8af6666259bbc4", STRONG)],
        ),
        (
            "req_8Fh2kL9xQ1 and trace-0af7651916cd43dd",
            [
                ("request_id", "req_8Fh2kL9xQ1", STRONG),
                ("request_id", "trace-0af7651916cd43dd", STRONG),
            ],
        ),
        ("Session ID: sess_ab12cd34ef", [("request_id", "sess_ab12cd34ef", WEAK)]),
        (
            "tenant 123e4567-e89b-12d3-a456-426614174000",
            [("uuid", "123e4567-e89b-12d3-a456-426614174000", WEAK)],
        ),
        (
            "trace 123e4567-e89b-12d3-a456-426614174000",
            [("uuid", "123e4567-e89b-12d3-a456-426614174000", STRONG)],
        ),
        ("nonce=Xk29aLq0Pz7", [("nonce", "Xk29aLq0Pz7", STRONG)]),
        ("key aB3dE5fG7hJ9kL1mN3pQ", [("nonce", "aB3dE5fG7hJ9kL1mN3pQ", WEAK)]),
        ("This is turn 5 of 20.", [("counter", "turn 5 of 20", STRONG)]),
        ("Attempt No. 3 of 5", [("counter", "Attempt No. 3 of 5", STRONG)]),
        ("request #123", [("counter", "request #123", STRONG)]),
        ("(message 17)", [("counter", "message 17", STRONG)]),
        ("Step 2 of 5", [("counter", "Step 2 of 5", WEAK)]),
        # negatives
        ("Step 1: install", []),
        ("return 5", []),
        ("commit 9fceb02d0ae598e95dc970b74767f19372d61af8", []),
        ("version 1.2.3, Python 3.11.7, numpy==1.26.4", []),
        ("call 555-123-4567 or +1 (555) 010-2030", []),
        ("price $19.99, VAT 20%", []),
        ("Office hours 09:00-17:30", []),
        ("MAC 00:1A:2B:3C:4D:5E", []),
        (
            "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNkYPhfDwAChwGA60e6kgAAAABJRU5ErkJggg==",
            [],
        ),
        ("getUserById2 parseHTTPResponse404Handler my_function_name2_here", []),
        ("/usr/lib/python3.11/site-packages/a1b2c3d4e5f6a7b8", []),
    ],
)
def test_scan_text(text: str, expected: list[tuple[str, str, int]]) -> None:
    got = [(h.kind, text[h.start : h.end], h.strength(NOW, WINDOW)) for h in scan_text(text)]
    assert [g for g in got if g[2] >= WEAK or any(e[2] == DRIFT for e in expected)] == expected


@pytest.mark.parametrize(
    ("old", "new", "kind"),
    [
        ("Time 14:03:22 ok", "Time 14:03:29 ok", "timestamp"),
        ("at 2024-06-01T14:03:22Z", "at 2024-06-02T09:00:00Z", "timestamp"),
        (
            "id 123e4567-e89b-12d3-a456-426614174000",
            "id 9b2c4567-e89b-12d3-a456-426614174000",
            "uuid",
        ),
        ("run run_0a1b2c3d4e5f", "run run_9f8e7d6c5b4a", "request_id"),
        ("instance 4f9a0c1d2e3b4a5f6e7d", "instance 8e1b2c3d4f5a6b7c8d9e", "request_id"),
        ("token Xk29aLq0Pz7Wm3Rt5Yu8", "token Bq71mZp4Lk2Nx9Vc6Hs3", "nonce"),
        ("This is turn 5 of 20", "This is turn 6 of 20", "counter"),
        ("You have 3 unread", "You have 4 unread", None),
    ],
)
def test_classify_first_difference(old: str, new: str, kind: str | None) -> None:
    start = common_prefix(old, new)
    hit = classify_span(new, start)
    assert (hit.kind if hit else None) == kind


@pytest.mark.parametrize(
    ("a", "b", "prefix", "suffix"),
    [
        ("", "", 0, 0),
        ("abc", "abc", 3, 3),
        ("abcX", "abcY", 3, 0),
        ("Xabc", "Yabc", 0, 3),
        ("ab", "abcd", 2, 0),
    ],
)
def test_common_prefix_and_suffix(a: str, b: str, prefix: int, suffix: int) -> None:
    assert common_prefix(a, b) == prefix
    assert common_suffix(a, b) == suffix
