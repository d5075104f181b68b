"""Implicit conversations (gateway/routing/conversations.py), by tables of prompts.

Prompts are lists of chained block hashes written as strings of block letters: "SAx" is
the chain S, SA, SAx (each block hash names its whole prefix, as in blocks.py).
"""

from __future__ import annotations

import pytest

from gateway.routing.conversations import Conversations


def chain(blocks: str) -> list[int]:
    return [hash(blocks[: i + 1]) for i in range(len(blocks))]


# (steps, expected): each step is a prompt sent in order; expected[i] is "." when it opens
# a conversation, else the ordinal of the conversation it joins (0: the first opened).
CASES = [
    # a follow-up extends its previous prompt; distinct first messages open conversations
    (["SA", "SB", "SAaC", "SBbD", "SAaCcE"], ". . 0 1 0"),
    # a common agent prompt shared by all holds no tip: every new user message is new
    (["SSSA", "SSSB", "SSSC", "SSSAaX"], ". . . 0"),
    # fan-out: siblings share the history; the next turn extends the main request
    (["SA", "SAaM", "SAaN", "SAaNnQ", "SAaMmR"], ". 0 0 0 0"),
    # the same prompt again (a retry) stays in its conversation
    (["SA", "SA", "SAaB"], ". 0 0"),
    # a prompt that extends nothing recent (a history rewrite, a fork off an old turn
    # beyond the tips kept) opens a conversation
    (["SA", "SAaB", "SAaBbC", "SAaBbCcD", "SAaBbCcDdE", "SAaBbCcDdEeF", "SAa"],
     ". 0 0 0 0 0 ."),
    # shorter than one block: nothing to match, each opens its own
    (["", ""], ". ."),
]


@pytest.mark.parametrize(("steps", "expected"), CASES)
def test_conversations_table(steps: list[str], expected: str) -> None:
    convs = Conversations(capacity=100, tips_per_conversation=4)
    opened: list[int] = []  # conversation id per step
    for prompt in steps:
        hashes = chain(prompt)
        found = convs.find(hashes)
        conv = convs.open() if found is None else found
        convs.advance(conv, hashes)
        opened.append(conv)
    ordinal: dict[int, int] = {}  # conversation id -> how many were opened before it
    got = []
    for conv in opened:
        if conv in ordinal:
            got.append(str(ordinal[conv]))
        else:
            ordinal[conv] = len(ordinal)
            got.append(".")
    assert got == expected.split()


def test_memory_is_bounded_and_oldest_forgotten() -> None:
    convs = Conversations(capacity=3, tips_per_conversation=2)
    ids = []
    for letter in "ABCD":
        conv = convs.open()
        convs.advance(conv, chain("S" + letter))
        ids.append(conv)
    assert len(convs) == 3
    assert convs.find(chain("SAaX")) is None  # A was the least recently active
    assert convs.find(chain("SDdX")) == ids[3]
    # tips per conversation are bounded too
    conv = ids[3]
    for step in ("SDd", "SDdE", "SDdEe"):
        convs.advance(conv, chain(step))
    assert convs.find(chain("SDx")) is None
    assert convs.find(chain("SDdEeZ")) == conv


def test_identical_prompt_from_another_conversation_moves_the_tip() -> None:
    convs = Conversations(capacity=10)
    a, b = convs.open(), convs.open()
    convs.advance(a, chain("SA"))
    convs.advance(a, chain("SAaB"))
    convs.advance(b, chain("SAaB"))
    assert convs.find(chain("SAaBbC")) == b
    assert convs.find(chain("SAx")) == a  # a keeps its other tips


@pytest.mark.parametrize(("capacity", "tips"), [(0, 1), (1, 0)])
def test_bad_sizes(capacity: int, tips: int) -> None:
    with pytest.raises(ValueError):
        Conversations(capacity, tips)
