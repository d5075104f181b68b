"""The router's protocol with the request path: decide once (counted as sent to the first
choice), the outcome filled in meanwhile, report once."""

from __future__ import annotations

from gateway.routing.config import RoutingConfig
from gateway.routing.decision import ReplicaState
from gateway.routing.router import Router

STATES = [ReplicaState(name="a", in_flight=0), ReplicaState(name="b", in_flight=0)]
BODY = {"messages": [{"role": "user", "content": "tell me about prefix caching " * 40}]}


def test_a_decision_counts_as_sent_until_the_first_token() -> None:
    router = Router(RoutingConfig(seed=0))
    plan = router.decide(BODY, "chat", "m", None, STATES, 0.0)
    chosen = plan.decision.replica
    assert router.queued_tokens(chosen) > 0 and router.indexed_blocks(chosen) > 0
    plan.outcome.first_token_at = 0.2  # the request path saw the first byte
    assert router.queued_tokens(chosen) == 0  # settled at the next read, no extra call
    plan.outcome.ok, plan.outcome.prompt_tokens, plan.outcome.cached_tokens = True, 300, 0
    router.report(plan, 0.5)
    again = router.decide(BODY, "chat", "m", None, STATES, 1.0)
    assert again.decision.replica == chosen and again.decision.reason == "prefix"


def test_a_retry_moves_the_request_to_the_replica_that_served_it() -> None:
    router = Router(RoutingConfig(seed=0))
    plan = router.decide(BODY, "chat", "m", None, STATES, 0.0)
    first = plan.decision.replica
    other = "b" if first == "a" else "a"
    router.retried(plan, other, 0.1)  # the first choice refused the connection
    assert router.indexed_blocks(first) == 0 and router.queued_tokens(first) == 0
    assert router.indexed_blocks(other) > 0 and router.queued_tokens(other) > 0
    o = plan.outcome
    o.first_token_at, o.ok, o.prompt_tokens, o.cached_tokens = 0.3, True, 300, 0
    router.report(plan, 0.5)
    again = router.decide(BODY, "chat", "m", None, STATES, 1.0)
    assert again.decision.replica == other


def test_a_request_that_never_ran_leaves_nothing_behind() -> None:
    router = Router(RoutingConfig(seed=0))
    plan = router.decide(BODY, "chat", "m", None, STATES, 0.0)
    chosen = plan.decision.replica
    router.report(plan, 0.1)  # failed before any usage: never scheduled
    assert router.indexed_blocks(chosen) == 0 and router.queued_tokens(chosen) == 0
