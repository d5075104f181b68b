"""The token-mode index bisects a replica's confirmed run when its blocks have no holes and
records predictions in C; any sequence of stores, removals, clears and predictions leaves
the hole count exact, the predictions as made one by one, and every lookup equal to
walking the blocks one at a time."""

from __future__ import annotations

from itertools import takewhile

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.events.decode import AllBlocksCleared, BlockRemoved, BlockStored, Event
from gateway.events.kvindex import KVIndex, ReplicaBlocks
from gateway.tokens.chain import chain_token_hashes, namespace

BS = 2
CHAINS = 3
DEPTH = 6


def tokens(chain: int, block: int) -> tuple[int, ...]:
    # Chains 0 and 1 share their first two blocks (a common system prompt).
    base = 0 if block < 2 and chain < 2 else chain
    return (100 * base + 2 * block, 100 * base + 2 * block + 1)


def engine(chain: int, block: int) -> int:
    return 1000 * chain + block  # the engine names the shared blocks twice: still one block


def query(chain: int) -> list[int]:
    ids = [t for b in range(DEPTH) for t in tokens(chain, b)]
    return chain_token_hashes(ids, namespace("m", None, None), BS)


def recount(state: ReplicaBlocks) -> int:
    return sum(1 for h, p in state.parent.items() if h in state.held and p not in state.held)


ops = st.lists(st.one_of(
    st.tuples(st.just("store"), st.integers(0, CHAINS - 1), st.integers(0, DEPTH - 1),
              st.integers(1, DEPTH)),
    st.tuples(st.just("remove"), st.integers(0, CHAINS - 1), st.integers(0, DEPTH - 1),
              st.integers(1, 3)),
    st.tuples(st.just("clear"), st.just(0), st.just(0), st.just(0)),
    st.tuples(st.just("predict"), st.integers(0, CHAINS - 1), st.integers(0, DEPTH),
              st.integers(0, 3)),
), max_size=40)


def walk(state: ReplicaBlocks, hashes: list[int], now: float) -> tuple[int, int]:
    """The lookup, one block at a time: the reference."""
    confirmed = n = len(list(takewhile(state.held.__contains__, hashes)))
    for h in hashes[n:]:
        if h not in state.held:
            expiry = state.predicted.get(h)
            if expiry is None or expiry <= now:
                break
        n += 1
    return confirmed, n


@settings(max_examples=300, deadline=None)
@given(ops=ops)
def test_holes_are_counted_and_lookups_equal_the_walk(
        ops: list[tuple[str, int, int, int]]) -> None:
    index = KVIndex()
    index.add_replica("r", "m", BS)
    expected: dict[int, float] = {}  # the predictions, kept the plain way
    for op, chain, start, n in ops:
        event: Event
        state = index.state("r")
        assert state is not None
        if op == "predict":  # at time n, from block `start`
            index.predict("r", query(chain), float(n), start)
            expected.update({h: n + 2.0 for h in query(chain)[start:] if h not in state.held})
            assert state.predicted == expected
        elif op == "store":
            blocks = range(start, min(DEPTH, start + n))
            event = BlockStored(tuple(engine(chain, b) for b in blocks),
                                engine(chain, start - 1) if start else None,
                                tuple(t for b in blocks for t in tokens(chain, b)), BS)
        elif op == "remove":
            event = BlockRemoved(tuple(engine(chain, b) for b in range(start, start + n)))
        else:
            event = AllBlocksCleared()
        if op != "predict":
            index.apply("r", [event], 0.0)
            expected = dict(state.predicted)  # stores and clears drop predictions
        assert state.holes == recount(state)
        assert sum(state.children.values()) == len(state.parent)
        for c in range(CHAINS):
            q = query(c)
            for now in (0.0, 1.5, 2.5, 4.0, 6.0):
                assert index.leading("r", q, now) == walk(state, q, now)


@pytest.mark.parametrize(("removed", "holes", "leading"), [
    ((), 0, 4),
    ((3,), 0, 3),  # the deepest first, as vLLM evicts: still prefix-closed
    ((1,), 1, 1),  # a middle block: block 2 is a hole, and the walk stops at block 1
    ((1, 2), 1, 1),
    ((0, 1, 2), 1, 0),
])
def test_a_middle_block_removed_is_a_hole(removed: tuple[int, ...], holes: int,
                                          leading: int) -> None:
    index = KVIndex()
    index.add_replica("r", "m", BS)
    index.apply("r", [BlockStored(tuple(engine(2, b) for b in range(4)), None,
                                  tuple(t for b in range(4) for t in tokens(2, b)), BS)], 0.0)
    index.apply("r", [BlockRemoved(tuple(engine(2, b) for b in removed))], 0.0)
    state = index.state("r")
    assert state is not None and state.holes == holes
    assert index.leading("r", query(2), 0.0) == (leading, leading)
