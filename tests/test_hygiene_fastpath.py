"""The scanner's prefilter and drift's bounded text: cheaper, same answers.

`scan_text` only hands the prefilter's candidates to the judge; it must report exactly what
a full pass (every digit run matched and judged) reports. Drift keeps a prefix of the part
where its text budget runs out and must still name a break inside that prefix.
"""

from __future__ import annotations

import random

import pytest

from gateway.hygiene.drift import Snapshot, diverge
from gateway.hygiene.patterns import _CAND, _NUM, Hit, _judge, _scan, scan_text
from gateway.hygiene.prompt import parse

LONG = "You are a careful assistant. Follow the rules below. " * 30

VOCAB = [
    "turn",
    "Turn",
    "TURN",
    "step",
    "request",
    "message",
    "exchange",
    "no",
    "No.",
    "number",
    "#",
    "#3",
    "5",
    "12",
    "1234567",
    "12345678",
    "1717250602",
    "1717250602123",
    "14:03",
    "14:03:22",
    "2:03",
    "PM",
    "2024-06-01",
    "2024-06-01T14:03:22Z",
    "06/01/2024",
    "1/2",
    "June",
    "Jun",
    "1st",
    "of",
    "2024,",
    "Saturday,",
    "Sat,",
    "at",
    "req_8Fh2kL9xQ1",
    "trace-0af7651916cd43dd",
    "sess_ab12cd34ef",
    "123e4567-e89b-12d3-a456-426614174000",
    "f47ac10b-58cc-4372-a567-0e02b2c3d479",
    "nonce=",
    "nonce:",
    "Xk29aLq0Pz7",
    "aB3dE5fG7hJ9kL1mN3pQ",
    "request",
    "id:",
    "ID:",
    "sha256",
    "x86_64",
    "v1.2.3",
    "19.99",
    "3.11.7",
    "a1b2",
    "ab12cd",
    "ab1==",
    "abcd1===",
    "of",
    "20",
    "attempt",
    "retry",
    "iteration",
    "loop",
    "cycle",
    "try",
    "call",
    "query",
    "run",
    "round",
    "return",
    "version",
    "time",
    "now",
    "clock:",
    "deadbeef",
    "0xdeadbeef9",
    "base64,",
    "00:1A:2B",
    "555-123-4567",
    "(",
    ")",
    ".",
    "..",
    ",",
    ":",
    "=",
    "/",
    "+",
    "-",
    "_",
    "*",
]
SEPS = ["", " ", " ", " ", "  ", "\t", "#", ".", "\n", "-", "_"]


def full_pass(text: str, permissive: bool) -> list[Hit]:
    """The reference: every digit run matched by `_NUM` and judged, left to right."""
    return [h for m in _NUM.finditer(text) if (h := _judge(m, text, permissive)) is not None]


def random_texts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        k = rng.randint(1, 14)
        out.append("".join(rng.choice(VOCAB) + rng.choice(SEPS) for _ in range(k)))
    return out


@pytest.mark.parametrize("permissive", [False, True])
@pytest.mark.parametrize("seed", [1, 2])
def test_scan_text_reports_what_a_full_pass_reports(seed: int, permissive: bool) -> None:
    for text in random_texts(1500, seed):
        assert scan_text(text, permissive=permissive) == full_pass(text, permissive), text


@pytest.mark.parametrize("seed", [3, 4])
def test_a_window_of_ascii_text_is_scanned_as_the_text_itself(seed: int) -> None:
    """ASCII text is searched for candidates with its digits zeroed, in a copy of the window
    and a little before it (the look-behinds): it must report what the prefilter run on
    the text itself reports, for any window (classify_span scans windows)."""
    rng = random.Random(seed)
    for text in random_texts(1500, seed):
        lo = rng.randint(0, len(text))
        hi = rng.randint(lo, len(text))
        permissive = rng.random() < 0.5
        assert _scan(text, lo, hi, permissive, True) == _scan(text, lo, hi, permissive, False)
    text = "the interaction 5 and the Interaction 7 of 9"  # the longest counter word
    for lo in range(len(text)):
        assert _scan(text, lo, len(text), False, True) == _scan(text, lo, len(text), False, False)


@pytest.mark.parametrize(
    "text",
    [
        "row 17 price 19.99 eur, 42% of 3 apples",
        "see table 4 and figure 12b; x * 2 + 10",
        "the 3 cats ate 25 fish in 2 days",
    ],
)
def test_plain_numbers_are_not_candidates(text: str) -> None:
    assert _CAND.search(text) is None


@pytest.mark.parametrize(
    "text",
    [
        "turn 5",
        "Attempt No. 3",
        "request #12",
        "EXCHANGE 4",
        "number\t7",
        "at 14:03",
        "1 June",
        "June 1, 2024",
        "id ab12cd",
        "2024-06-01",
    ],
)
def test_reportable_shapes_are_candidates(text: str) -> None:
    assert _CAND.search(text) is not None


def chat(system: str) -> dict[str, object]:
    return {
        "model": "m",
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": "q"},
        ],
    }


@pytest.mark.parametrize(
    ("old", "new", "kind", "offset", "classified"),
    [
        # inside the kept prefix: located to the character and named
        ("Time 14:03:22. " + LONG, "Time 14:03:29. " + LONG, "timestamp", 5, True),
        ("Time 14:03:22. " + LONG, "Time  14:03:22. " + LONG, "whitespace", 5, True),
        ("Rules v1. " + LONG, "Rules v2. " + LONG, "counter", 7, True),
        ("Rules A. " + LONG, "Rules B. " + LONG, "volatile_span", 6, False),
        # past it: located to the part only
        ("Time 14:03:22. " + LONG, "Time 14:03:22. " + LONG + "x", "volatile_span", 0, False),
    ],
)
def test_drift_names_a_break_inside_the_kept_prefix(
    old: str, new: str, kind: str, offset: int, classified: bool
) -> None:
    snap = Snapshot.of(parse(chat(old), "chat"), frozenset(), text_budget=100)
    assert snap.parts[0].whole is False and snap.parts[0].text == old[:100]
    d = diverge(snap, parse(chat(new), "chat"), head_only=False)
    assert d is not None
    assert (d.kind, d.part, d.offset, d.classified) == (kind, 0, offset, classified)
