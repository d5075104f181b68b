"""Review 55: window gates for tips and anchors (marks.py), and why a follow-up samples
its whole prompt again.

A follow-up that sampled only its new blocks (tried, reverted) left its history's samples
as old as the turn that first sent them: under the samples' LRU pressure an active
conversation's re-rendered tail became a new conversation, and a popular agent's prompt
stopped being SHARED while its conversations went on. The first two tests hold that; the
others pin what mutations of the gates left untested (each names the mutation it kills)."""

from __future__ import annotations

from collections import Counter
from typing import Any

from gateway.routing.blocks import chain_hashes
from gateway.routing.conversations import Conversations, Found
from gateway.routing.estimate import TokenEstimator
from gateway.routing.marks import Gates

BLOCK = 4


def chain(text: bytes, seed: int = 11) -> list[int]:
    return chain_hashes(text, seed, BLOCK)


def blocks(tag: bytes, n: int) -> bytes:
    """n distinct blocks of BLOCK bytes, told apart by `tag`."""
    return b"".join((tag + i.to_bytes(2, "little")).ljust(BLOCK, b".")[:BLOCK]
                    for i in range(n))


def route(convs: Conversations, hashes: list[int], scope: int = 0) -> Found | None:
    """What the router does for a request without a session (router._route, then _sent)."""
    found = convs.find(hashes, scope)
    conv = found.conversation if found is not None and found.how == "follows" else convs.open()
    convs.advance(conv, hashes, scope)
    return found


def consistent(gates: Gates, marks: Any) -> None:
    """The gates hold exactly the marks, and each gate's count is its marks' number."""
    assert set(gates.gate_of) == set(marks)
    assert gates._count == dict(Counter(g for g in gates.gate_of.values() if g is not None))


# the samples' LRU at capacity: an active conversation renews its whole history ---------------

def idle_gap_then_re_rendered_tail() -> tuple[Found | None, int]:
    convs = Conversations(100, tips_per_conversation=2, sample_every=4, sample_capacity=16,
                 max_tail_blocks=8)
    history = blocks(b"A", 8)
    assert route(convs, chain(history)) is None  # A's first turn: samples at blocks 3, 7
    a = convs._tips[chain(history)[-1]]
    route(convs, chain(blocks(b"B", 64)))  # others' traffic while A is idle: 16 samples
    history += blocks(b"a", 1)
    assert route(convs, chain(history)) == Found(a, "follows")  # A is back
    history += blocks(b"b", 1)
    assert route(convs, chain(history)) == Found(a, "follows")
    # A's client re-renders the last two blocks of its history (behind its kept tips):
    # two blocks short of A's latest prompt, well within max_tail_blocks
    return convs.find(chain(blocks(b"A", 8) + blocks(b"z", 2))), a


def test_re_rendered_tail_after_an_idle_gap_still_follows_its_conversation() -> None:
    found, a = idle_gap_then_re_rendered_tail()
    assert found == Found(a, "forks")


def popular_agent_after_churn() -> Found | None:
    convs = Conversations(100, tips_per_conversation=2, sample_every=4, sample_capacity=16,
                 max_tail_blocks=8)
    agent = blocks(b"S", 8)  # an agent's prompt: samples at blocks 3, 7
    a, b = agent + blocks(b"a", 2), agent + blocks(b"b", 2)
    route(convs, chain(a))
    route(convs, chain(b))  # the agent's second conversation: its samples are SHARED
    route(convs, chain(blocks(b"X", 64)))  # others' traffic: 16 samples
    a += blocks(b"a2", 2)
    b += blocks(b"b2", 2)
    assert route(convs, chain(a)) is not None  # both conversations go on
    assert route(convs, chain(b)) is not None
    route(convs, chain(agent + blocks(b"d", 2)))  # a third conversation of the agent
    return convs.find(chain(agent + blocks(b"e", 2)))  # and a fourth


def test_a_popular_agents_new_conversation_is_not_a_fork_after_churn() -> None:
    assert popular_agent_after_churn() is None


# behaviour the change's tests leave open (surviving mutations) ---------------------------------

def test_a_scoped_tip_past_the_first_window_is_found() -> None:
    """Kills: Conversations.advance adding the tip's gate unscoped (the search XORs the
    gates with the tenant's scope, so every tip past block 16 of a tenant is missed); the
    chain is long enough to be searched through its gates (marks._PLAIN windows and more)."""
    convs = Conversations(8)
    history = blocks(b"T", 100)
    scope = 0x1234_5678_9ABC
    assert route(convs, chain(history), scope) is None
    conv = convs._tips[chain(history)[-1] ^ scope]
    assert route(convs, chain(history + blocks(b"t", 3)), scope) == Found(conv, "follows")
    assert convs.find(chain(history + blocks(b"u", 3))) is None  # another tenant's


def test_conversations_gates_hold_exactly_the_tips() -> None:
    """Kills: _forget_tip not removing the gate; Gates.add counting a mark twice; a gate
    whose count reaches 0 kept. Each leaves answers alone but grows Gates without bound."""
    convs = Conversations(3, tips_per_conversation=2, sample_every=0)
    # past the gates' head (64 blocks), so every tip is counted at a gate
    prompts = [chain(blocks(bytes([65 + i % 5]), 70 + 7 * (i % 4))) for i in range(40)]
    for i, p in enumerate(prompts):
        route(convs, p, scope=(i % 2) * 0x55)
        route(convs, p, scope=(i % 2) * 0x55)  # the same prompt again: its tip again
        consistent(convs._gates, convs._tips)
    for i in range(20):  # two clients sending the same first prompt, alternately
        conv = convs.open()
        convs.advance(conv, prompts[i % 3])
        consistent(convs._gates, convs._tips)
    assert len(convs._gates) == len(convs._tips) <= 3 * 2


def test_estimator_gates_hold_exactly_the_anchors() -> None:
    """Kills: set_anchor's eviction not removing the evicted anchor's gate."""
    est = TokenEstimator(4.0, 0.1, 4, BLOCK)
    for i in range(30):
        data = blocks(bytes([65 + i % 7]), 66 + i % 5) + b"xy"  # past the head
        est.set_anchor(data, chain(data), 100.0 + i, 4.0)
        consistent(est._gates, est._anchors)
    assert len(est._gates) == len(est._anchors) == 4


def test_nothing_below_block_zero() -> None:
    """Kills: `upto <= 0` relaxed to `< 0` (window -1's slice then reads the chain's end)."""
    hashes = chain(blocks(b"Z", 12))
    gates = Gates(4)
    gates.add(hashes[5], hashes, 5)  # window 1, gate block 3
    assert gates.deepest(hashes, len(hashes), {hashes[5]}) == 6
    assert gates.deepest(hashes, 0, {hashes[5]}) == 0
    assert gates.deepest(hashes, -3, {hashes[5]}) == 0
