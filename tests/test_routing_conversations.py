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
# a conversation, "fN" when it opens one that forks from conversation N, else the ordinal
# N of the conversation it follows (0: the first opened). Every block is sampled
# (sample_every=1) unless the case says otherwise.
CASES = [
    # a follow-up extends its previous prompt; distinct first messages open conversations
    (["SA", "SB", "SAaC", "SBbD", "SAaCcE"], ". f0 0 1 0", 1),
    (["SA", "SB", "SAaC", "SBbD", "SAaCcE"], ". . 0 1 0", 4),  # nothing sampled
    # fan-out: siblings share the history; the next turn extends the main request
    (["SA", "SAaM", "SAaN", "SAaNnQ", "SAaMmR"], ". 0 0 0 0", 1),
    # the same prompt again (a retry) stays in its conversation
    (["SA", "SA", "SAaB"], ". 0 0", 1),
    # shorter than one block: nothing to match, each opens its own
    (["", ""], ". .", 1),
    # a common agent prompt: the second conversation forks from the first (nothing yet
    # says the prompt is shared), after which it is SHARED and identifies nobody
    (["SSSA", "SSSB", "SSSC", "SSSAaX", "SSSDdY"], ". f0 . 0 .", 1),
    # a follow-up that repeats all of the previous prompt but its re-rendered tail
    # (Mooncake's partial last block) forks from it, and its own follow-ups follow it
    (["SABCx", "SABCDEy", "SABCDEyZ"], ". f0 1", 1),
    # forks off (sample_every=0): only whole prompts are followed
    (["SABCx", "SABCDEy", "SSSA", "SSSB"], ". . . .", 0),
    # sampled every 2nd block: the deepest sample decides
    (["SABCx", "SABCDy", "SAz"], ". f0 .", 2),
    # a prompt that extends nothing recent and shares only SHARED content opens one
    (["SA", "SB", "SAaB", "SC"], ". f0 0 .", 1),
]


@pytest.mark.parametrize(("steps", "expected", "every"), CASES)
def test_conversations_table(steps: list[str], expected: str, every: int) -> None:
    convs = Conversations(capacity=100, tips_per_conversation=4, sample_every=every)
    ordinal: dict[int, int] = {}  # conversation id -> how many were opened before it
    got = []
    for prompt in steps:
        hashes = chain(prompt)
        found = convs.find(hashes)
        if found is not None and found.how == "follows":
            conv = found.conversation
            got.append(str(ordinal[conv]))
        else:
            conv = convs.open()
            got.append("." if found is None else f"f{ordinal[found.conversation]}")
            ordinal[conv] = len(ordinal)
        convs.advance(conv, hashes)
    assert got == expected.split()


def test_memory_is_bounded_and_oldest_forgotten() -> None:
    convs = Conversations(capacity=3, tips_per_conversation=2, sample_every=100)
    ids = []
    for letter in "ABCD":
        conv = convs.open()
        convs.advance(conv, chain("S" + letter))
        ids.append(conv)
    assert len(convs) == 3
    assert convs.find(chain("SAaX")) is None  # A was the least recently active
    assert convs.find(chain("SDdX")) == (ids[3], "follows")
    # tips per conversation are bounded too
    conv = ids[3]
    for step in ("SDd", "SDdE", "SDdEe"):
        convs.advance(conv, chain(step))
    assert convs.find(chain("SDx")) is None
    assert convs.find(chain("SDdEeZ")) == (conv, "follows")


def test_identical_prompt_from_another_conversation_moves_the_tip() -> None:
    convs = Conversations(capacity=10, sample_every=100)
    a, b = convs.open(), convs.open()
    convs.advance(a, chain("SA"))
    convs.advance(a, chain("SAaB"))
    convs.advance(b, chain("SAaB"))
    assert convs.find(chain("SAaBbC")) == (b, "follows")
    assert convs.find(chain("SAx")) == (a, "follows")  # a keeps its other tips


@pytest.mark.parametrize(("capacity", "tips", "every", "samples"),
                         [(0, 1, 1, 1), (1, 0, 1, 1), (1, 1, -1, 1), (1, 1, 1, 0)])
def test_bad_sizes(capacity: int, tips: int, every: int, samples: int) -> None:
    with pytest.raises(ValueError):
        Conversations(capacity, tips, every, samples)


def test_samples_are_bounded() -> None:
    convs = Conversations(capacity=10, sample_every=1, sample_capacity=4)
    conv = convs.open()
    convs.advance(conv, chain("ABCDEFGH"))
    assert convs.find(chain("ABx")) is None  # A, B forgotten (least recent)
    assert convs.find(chain("ABCDEFx")) == (conv, "forks")


def test_a_fork_leaves_only_a_short_tail_behind() -> None:
    convs = Conversations(capacity=10, sample_every=1, max_tail_blocks=1)
    conv = convs.open()
    convs.advance(conv, chain("SABCD"))
    assert convs.find(chain("SABCx")) == (conv, "forks")  # one block of it left behind
    assert convs.find(chain("SABx")) is None  # two: another conversation of that prompt
