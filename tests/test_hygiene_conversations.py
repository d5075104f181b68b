"""Implicit conversations for drift (gateway/hygiene/conversations.py), by tables.

Each step is a request's conversation messages (head excluded) as letters; expected is "."
when it opens a conversation, else the ordinal of the one it continues."""

from __future__ import annotations

import pytest

from gateway.hygiene.conversations import MessageOwners

CASES = [
    # growth: each request repeats the earlier messages
    (["A", "B", "Aab", "Bcd", "Aabef"], ". . 0 1 0"),
    # history rewrites: a summary in place of the first turns, the oldest exchange
    # dropped, an old turn edited; each keeps some earlier message
    (["Aabc", "Sbcd"], ". 0"),
    (["Aabc", "bcd"], ". 0"),
    (["Aabc", "AXbcd"], ". 0"),
    # a new conversation shares no message
    (["Aabc", "Bx"], ". ."),
    # a templated first message two conversations sent names neither; their replies do
    (["T", "T", "Tax", "Tby", "Taxcz"], ". . . . 2"),
    # only the last message differs: the last one is never evidence (it is new)
    (["A", "B"], ". ."),
]


@pytest.mark.parametrize(("steps", "expected"), CASES)
def test_message_owners_table(steps: list[str], expected: str) -> None:
    owners = MessageOwners(capacity=100)
    ordinal: dict[int, int] = {}
    got = []
    for step in steps:
        digests = [ord(c) for c in step]
        conv = owners.find(digests[:-1])
        if conv is None:
            conv = owners.open()
            ordinal[conv] = len(ordinal)
            got.append(".")
        else:
            got.append(str(ordinal[conv]))
        owners.record(conv, digests)
    assert got == expected.split()


def test_bounded() -> None:
    owners = MessageOwners(capacity=3)
    conv = owners.open()
    owners.record(conv, [1, 2, 3, 4])
    assert len(owners) == 3
    assert owners.find([1]) is None and owners.find([4]) == conv
    with pytest.raises(ValueError):
        MessageOwners(0)


def test_a_short_common_reply_does_not_join_two_conversations() -> None:
    """Seen in the soak: conversations of one agent (one system prompt) whose replies are
    all "ok". The second conversation's follow-up repeats only that reply of the first:
    no history rewrite is reported."""
    from gateway.hygiene.analyzer import HygieneAnalyzer
    from gateway.hygiene.config import HygieneConfig

    analyzer = HygieneAnalyzer(HygieneConfig(redact=False))
    system = {"role": "system", "content": "You are the build agent. " * 20}

    def scan(*turns: str) -> list[str]:
        roles = ["user", "assistant"]
        body = {"model": "m", "messages": [system, *({"role": roles[i % 2], "content": t}
                                                     for i, t in enumerate(turns))]}
        return [f.kind for f in analyzer.scan(body, "chat", None, 0.0)]

    first = "Please compile the project and report every warning you see in the log."
    second = "Run the unit tests of the parser module and summarise the failures found."
    assert scan(first) == []
    assert scan(first, "ok", "Now fix the first warning in the compiler output.") == []
    assert scan(second) == []
    assert scan(second, "ok", "Now rerun only the failing parser tests, please.") == []
    # a real rewrite is still reported: the first turn of the first conversation edited
    edited = scan(first.replace("every warning", "each warning"), "ok",
                  "Now fix the first warning in the compiler output.", "ok",
                  "And the second warning as well, with a test for it.")
    assert "history_rewrite" in edited
