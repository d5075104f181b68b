"""Feedback does not judge a shortfall whose blocks are still on their way.

A request sent to a replica is indexed there at once (vLLM registers its blocks when it
schedules it), but the engine holds them only once computed, or on a P/D decode replica
once its decode leg pulled them from the prefill replica (gateway.pd), seconds later
under load. A sibling sent meanwhile is predicted those blocks and delivered fewer: that
is not eviction, and cutting the replica's index limit for it made the index forget the
conversations it held. On a P/D decode replica nothing restored the limit (two-leg
answers do not judge its predictions), so follow-ups moved between decode replicas
about three times as often as on the aggregated fleet (bench/results/pd.md)."""

from __future__ import annotations

import random

import pytest

from gateway.routing.config import RoutingConfig
from gateway.routing.decision import ReplicaState
from gateway.routing.plan import RoutePlan
from gateway.routing.router import Router
from tests.filler import words
from tests.routing_driver import finish

STATES = [ReplicaState(name="d", in_flight=0)]


def body(seed: int, turns: int = 1) -> dict[str, object]:
    """A conversation's prompt: `turns` user messages (each extends the one before)."""
    rng = random.Random(seed)
    messages: list[dict[str, str]] = []
    for _ in range(turns):
        messages += [{"role": "user", "content": words(rng, 600)},
                     {"role": "assistant", "content": "done"}]
    return {"messages": messages[:-1]}


def decide(router: Router, seed: int, now: float, turns: int = 1) -> RoutePlan:
    return router.decide(body(seed, turns), "chat", "m", None, STATES, now)


def settle(router: Router, plan: RoutePlan, now: float, delivered: int | None = None) -> None:
    """`plan` answered on d: its prediction was right unless `delivered` says otherwise."""
    tokens = plan.decision.estimated_prompt_tokens
    cached = plan.decision.predicted_cached_tokens if delivered is None else delivered
    finish(router, plan, "d", tokens, cached, True, now)


# The sibling (prompt 1) is predicted the whole prompt and delivered nothing.
@pytest.mark.parametrize(
    ("case", "judged"),
    [
        # another request with the same prompt, sent before it, has no first token yet:
        # its blocks are being computed or pulled, the shortfall is theirs
        ("arriving", False),
        # the same, and it was answered before the sibling's report: what counts is what
        # was arriving when the sibling was sent (the engine scheduled it then)
        ("arrived_before_report", False),
        # the same, but it had its first token: the engine held the blocks, then lost them
        ("began", True),
        # it was sent after the sibling: the sibling's prediction did not count on it
        ("sent_after", True),
        # the request in flight has another prompt: it brings none of the missing blocks
        ("other_prompt", True),
        # the request in flight extends the conversation (its next turn): the blocks it
        # brings come after the history, and the sibling missed the history itself
        ("short_of_arriving", True),
        # nothing in flight: the engine evicted what it held
        ("alone", True),
    ],
)
def test_a_shortfall_is_judged_unless_its_blocks_are_arriving(case: str, judged: bool) -> None:
    router = Router(RoutingConfig(default_capacity_tokens=200_000))
    if case in ("sent_after", "other_prompt", "alone", "short_of_arriving"):
        settle(router, decide(router, 1, 0.0), 0.5)  # the prompt answered once, indexed
    for seed in range(10, 14):  # other conversations d holds
        settle(router, decide(router, seed, 0.6), 0.7)
    before = router.index_limit("d")
    if case in ("arriving", "arrived_before_report", "began", "other_prompt"):  # sent before
        first = decide(router, 2 if case == "other_prompt" else 1, 1.0)
        if case == "began":
            first.outcome.first_token_at = 1.5
    if case == "short_of_arriving":
        first = decide(router, 1, 1.0, turns=2)
    sibling = decide(router, 1, 2.0, turns=2 if case == "short_of_arriving" else 1)
    if case == "sent_after":
        decide(router, 1, 2.5)
    assert sibling.decision.predicted_cached_tokens > 500
    if case == "arrived_before_report":
        settle(router, first, 2.5)
    settle(router, sibling, 3.0, delivered=0)
    assert (router.index_limit("d") < before) is judged


def test_conversations_stay_indexed_through_a_fan_out_being_pulled() -> None:
    """The P/D pattern: a turn's first request takes two legs (its prompt indexed on D at
    once, pulled seconds later), its fan-out siblings go to D alone and find nothing yet.
    The conversations D held before stay indexed there (on main each sibling cut D's
    limit to 0.8 x what it indexed, and only judged answers restore it)."""
    router = Router(RoutingConfig(default_capacity_tokens=200_000))
    held = [decide(router, seed, 0.1 * seed) for seed in range(20, 26)]
    for plan in held:
        settle(router, plan, 1.0)
    indexed = router.indexed_blocks("d")
    for turn in range(4):
        now = 2.0 + turn
        leg = decide(router, 100 + turn, now)  # two legs: D pulls it later
        for k in range(3):
            settle(router, decide(router, 100 + turn, now + 0.1), now + 0.2 + k, delivered=0)
        leg.outcome.prompt_tokens = leg.decision.estimated_prompt_tokens
        leg.outcome.first_token_at, leg.outcome.ok = now + 0.5, True
        router.report(leg, now + 0.6)  # a decode leg: cached tokens not judged (None)
    follow = router.preview(body(20), "chat", "m", None, STATES, 10.0)
    assert router.indexed_blocks("d") >= indexed
    assert follow.predicted["d"] > 500


TWO = [ReplicaState(name="d", in_flight=0), ReplicaState(name="e", in_flight=0)]


@pytest.mark.parametrize(("two_legs", "stays"), [(True, True), (False, False)])
def test_a_prefill_leg_elsewhere_is_not_queued_on_the_decode_replica(
        two_legs: bool, stays: bool) -> None:
    """P/D: requests whose prefill runs on a prefill replica are not D's queued prefill
    (D pulls their KV). Counted as queued there, they outweighed a conversation's cached
    history on D and its follow-up left for the other decode replica ('load')."""
    router = Router(RoutingConfig(default_capacity_tokens=200_000))
    home = router.decide(body(7), "chat", "m", None, TWO[:1], 0.0)  # the conversation, on d
    settle(router, home, 0.5)
    for seed in range(30, 36):  # new conversations' first turns, sent to d, not answered yet
        cold = router.decide(body(seed), "chat", "m", None, TWO[:1], 1.0)
        if two_legs:
            router.prefilled_elsewhere(cold)
    assert (router.queued_tokens("d") == 0) is two_legs
    follow = router.decide(body(7, turns=2), "chat", "m", None, TWO, 2.0)
    assert (follow.decision.replica == "d") is stays
