"""Data-parallel ranks indexed apart (events/kvindex.py): a replica with two engine cores
has one event stream per rank; one rank's clear, gap or removal leaves what the other rank
holds. vLLM's block hashes depend on the tokens only, so both ranks name a shared prefix
with the same engine hashes."""

from __future__ import annotations

import pytest

from gateway.events.decode import AllBlocksCleared, BlockRemoved, BlockStored, Event
from gateway.events.kvindex import KVIndex
from gateway.tokens.chain import chain_token_hashes, namespace

SHARED = (1, 2, 3, 4)  # a prompt both ranks served: engine hashes 101, 102 on both
ONLY_B = (9, 9, 8, 8)  # a prompt rank "b" alone served: 201, 202


def own(tokens: tuple[int, ...]) -> list[int]:
    return chain_token_hashes(tokens, namespace("m", None, None), 2)


def index() -> KVIndex:
    kv = KVIndex()
    kv.add_replica("r", "m", 2)
    kv.apply("r", [BlockStored((101, 102), None, SHARED, 2)], 0.0, "a")
    kv.apply("r", [BlockStored((101, 102), None, SHARED, 2),
                   BlockStored((201, 202), None, ONLY_B, 2)], 0.0, "b")
    return kv


@pytest.mark.parametrize(("rank", "events", "shared", "only_b"), [
    ("a", [AllBlocksCleared()], 2, 2),  # a's reset: b still holds both prompts
    ("b", [AllBlocksCleared()], 2, 0),  # b's reset: a still holds the shared one
    ("a", [BlockRemoved((102,))], 2, 2),  # evicted on a, still on b
    ("b", [BlockRemoved((101, 102, 201, 202))], 2, 0),
    ("a", [], 2, 2),
])
def test_one_rank_forgets_only_its_own(rank: str, events: list[Event], shared: int,
                                       only_b: int) -> None:
    kv = index()
    kv.apply("r", events, 1.0, rank)
    assert kv.matched("r", own(SHARED), 1.0) == shared
    assert kv.matched("r", own(ONLY_B), 1.0) == only_b


def test_a_gap_on_one_rank_clears_that_rank() -> None:
    kv = index()
    kv.clear("r", "b")  # what the subscriber of rank b does on a gap it cannot fill
    assert kv.matched("r", own(SHARED), 1.0) == 2
    assert kv.matched("r", own(ONLY_B), 1.0) == 0
    kv.clear("r", "a")
    assert kv.held_blocks("r") == 0


def test_a_replica_without_ranks_clears_as_before() -> None:
    kv = KVIndex()
    kv.add_replica("r", "m", 2)
    kv.apply("r", [BlockStored((101, 102), None, SHARED, 2)], 0.0)
    kv.predict("r", own(ONLY_B), 0.0)
    kv.apply("r", [AllBlocksCleared()], 0.1)
    assert kv.matched("r", own(SHARED), 0.2) == 0
    assert kv.matched("r", own(ONLY_B), 0.2) == 0  # predictions go too
