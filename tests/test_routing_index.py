"""Per-replica block index: prefix matching, LRU order, capacity, replicas leaving."""

from __future__ import annotations

import random

import pytest

from gateway.routing.config import RoutingConfig
from gateway.routing.decision import ReplicaState
from gateway.routing.index import BlockIndex
from gateway.routing.router import Router
from tests.routing_driver import finish


def chain(tag: int, n: int) -> list[int]:
    return [tag * 1_000_000 + i for i in range(n)]


@pytest.mark.parametrize(
    ("held", "query", "expected"),
    [
        (0, 10, 0),
        (10, 10, 10),
        (10, 4, 4),
        (4, 10, 4),
        (1, 10, 1),
        (10, 0, 0),
    ],
)
def test_matched_is_the_longest_leading_run(held: int, query: int, expected: int) -> None:
    idx = BlockIndex(1000)
    idx.record("a", chain(1, held), held, 0)
    assert idx.matched("a", chain(1, query)) == expected
    assert idx.matched("b", chain(1, query)) == 0  # unknown replica holds nothing


def test_divergent_chain_matches_only_the_shared_prefix() -> None:
    idx = BlockIndex(1000)
    idx.record("a", chain(1, 8), 8, 0)
    other = chain(1, 5) + chain(2, 5)
    assert idx.matched("a", other) == 5


def test_eviction_takes_chain_tails_first() -> None:
    idx = BlockIndex(10)
    idx.record("a", chain(1, 6), 6, 0)
    idx.record("a", chain(2, 6), 6, 0)  # 12 > 10: two blocks go, the deepest of chain 1
    assert idx.size("a") == 10
    assert idx.matched("a", chain(1, 6)) == 4
    assert idx.matched("a", chain(2, 6)) == 6


def test_touching_on_hit_protects_a_shared_prefix() -> None:
    idx = BlockIndex(8)
    shared = chain(1, 4)
    idx.record("a", [*shared, *chain(2, 2)], 6, 0)
    # a second conversation reuses the shared prefix: it is refreshed, not re-inserted
    idx.record("a", [*shared, *chain(3, 2)], 6, 4)
    idx.record("a", chain(4, 2), 2, 0)  # pressure: evicts the oldest tail (chain 2)
    assert idx.matched("a", shared) == 4
    assert idx.matched("a", [*shared, *chain(2, 2)]) == 4
    assert idx.matched("a", [*shared, *chain(3, 2)]) == 6


@pytest.mark.parametrize(("capacity", "kept"), [(100, 30), (20, 20), (5, 5), (0, 0)])
def test_set_capacity_evicts_down_to_it(capacity: int, kept: int) -> None:
    idx = BlockIndex(1000)
    idx.record("a", chain(1, 30), 30, 0)
    idx.set_capacity("a", capacity)
    assert idx.size("a") == kept
    assert idx.matched("a", chain(1, 30)) == kept  # shallow blocks survive


def test_replica_leaving_drops_its_entries() -> None:
    idx = BlockIndex(100)
    idx.record("a", chain(1, 5), 5, 0)
    idx.record("b", chain(1, 5), 5, 0)
    idx.remove_replica("a")
    assert idx.matched("a", chain(1, 5)) == 0 and idx.size("a") == 0
    assert idx.matched("b", chain(1, 5)) == 5
    idx.clear("b")
    assert idx.size("b") == 0


def test_drop_from_forgets_the_suffix() -> None:
    idx = BlockIndex(100)
    idx.record("a", chain(1, 10), 10, 0)
    assert idx.drop_from("a", chain(1, 10), 3) == 7
    assert idx.matched("a", chain(1, 10)) == 3


def test_stale_held_already_is_tolerated() -> None:
    """A request's blocks evicted between `sent` and `completed`: recording its reply with
    the old held_already re-adds them instead of failing."""
    idx = BlockIndex(10)
    idx.record("a", chain(1, 8), 8, 0)
    idx.record("a", chain(2, 8), 8, 0)  # evicts most of chain 1
    assert idx.matched("a", chain(1, 8)) < 8
    idx.record("a", chain(1, 10), 10, 8)
    assert idx.matched("a", chain(1, 10)) == 10 and idx.size("a") == 10


def test_router_indexes_a_reply_after_its_prompt_was_evicted() -> None:
    """The proxy's repro: small capacity, 20 distinct prompts routed and sent, then the
    first completes with its reply text."""
    router = Router(RoutingConfig(default_capacity_tokens=4096))
    states = [ReplicaState(name="a", in_flight=0)]
    rng = random.Random(0)
    plans = []
    for i in range(20):
        text = "".join(rng.choice("abcdefgh ") for _ in range(3000))
        plan = router.decide({"messages": [{"role": "user", "content": text}]}, "chat", "m",
                            None, states, float(i))
        plans.append(plan)
    finish(router, plans[0], "a", 750, 0, True, 21.0, reply_text="an answer " * 20,
                     completion_tokens=40)
    assert router.indexed_blocks("a") <= router.index_limit("a")
