"""The router's bookkeeping around retries and cut requests (pure, time as a parameter): a
retry the request path reports moves the request's blocks and queued work; a request that
failed before its first token drops only the blocks it alone added; once a first token
came its blocks stay (vLLM keeps an aborted request's blocks cached)."""

from __future__ import annotations

from gateway.routing.config import RoutingConfig
from gateway.routing.decision import ReplicaState
from gateway.routing.router import Router, shared_prefix

STATES = [ReplicaState(name="a", in_flight=0), ReplicaState(name="b", in_flight=0)]
SYSTEM = "You are a careful assistant for the contract team. " * 30


def body(question: str) -> dict[str, object]:
    return {"messages": [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": question * 20}]}


def test_a_retry_moves_blocks_and_queue_to_the_replica_that_serves_it() -> None:
    router = Router(RoutingConfig(seed=0))
    plan = router.decide(body("first "), "chat", "m", None, STATES, 0.0)
    first = plan.decision.replica
    other = "b" if first == "a" else "a"
    router.retried(plan, other, 0.1)  # the first choice refused the connection
    assert router.indexed_blocks(first) == 0 and router.queued_tokens(first) == 0
    assert router.indexed_blocks(other) == len(plan.hashes) and router.queued_tokens(other) > 0
    plan.outcome.first_token_at, plan.outcome.ok, plan.outcome.prompt_tokens = 0.3, True, 400
    router.report(plan, 0.5)
    assert router.indexed_blocks(other) >= len(plan.hashes)  # the server keeps its blocks


def test_a_failed_request_leaves_a_siblings_shared_prefix_alone() -> None:
    router = Router(RoutingConfig(seed=0))
    one = router.decide(body("one "), "chat", "m", None, STATES, 0.0, pin="a")
    two = router.decide(body("two "), "chat", "m", None, STATES, 0.0, pin="a")
    shared = shared_prefix(one.hashes, two.hashes)
    assert 0 < shared < len(one.hashes)
    two.outcome.first_token_at = 0.1  # the sibling is being served from a
    router.report(one, 0.2)  # one failed before its first token: never scheduled
    assert router.indexed_blocks("a") == len(two.hashes)  # the shared system prompt stays
    router.report(two, 0.3)


def test_a_failed_request_alone_drops_what_it_added() -> None:
    router = Router(RoutingConfig(seed=0))
    plan = router.decide(body("alone "), "chat", "m", None, STATES, 0.0, pin="a")
    router.report(plan, 0.1)
    assert router.indexed_blocks("a") == 0


def test_a_stream_cut_after_its_first_token_keeps_its_blocks() -> None:
    router = Router(RoutingConfig(seed=0))
    plan = router.decide(body("cut "), "chat", "m", None, STATES, 0.0, pin="a")
    plan.outcome.first_token_at = 0.1
    router.report(plan, 0.2)  # failed (no usage), but scheduled: vLLM holds its blocks
    assert router.indexed_blocks("a") == len(plan.hashes)


def test_shared_prefix() -> None:
    assert shared_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert shared_prefix([1, 2, 3], [1, 2, 3, 4]) == 3
    assert shared_prefix([], [1]) == 0
    assert shared_prefix([5], [6]) == 0
