"""Gates (gateway/routing/marks.py): the deepest marked block of a chain, found through its
windows' gates, is the block-by-block scan's answer, whatever the marks added and removed,
the scope and the stride."""

from __future__ import annotations

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.routing.marks import Gates


def chain(blocks: list[int], seed: int = 7) -> list[int]:
    """Chained hashes of small blocks (a hash names its whole prefix, as blocks.py's do)."""
    out, h = [], seed
    for b in blocks:
        h = xxhash.xxh3_64_intdigest(b.to_bytes(2, "little"), h)
        out.append(h)
    return out


def scanned(hashes: list[int], upto: int, marks: set[int], scope: int) -> int:
    """The block-by-block answer: j for the deepest of hashes[:upto] (scoped) in marks."""
    return max((j for j in range(1, min(upto, len(hashes)) + 1)
                if hashes[j - 1] ^ scope in marks), default=0)


# chains over a 2-letter alphabet share prefixes of every length with one another
# most chains longer than the gates' head (4 windows: 4 to 36 blocks at strides 1 to 9)
chains = st.lists(st.lists(st.integers(0, 1), min_size=0, max_size=100) | st.lists(
    st.integers(0, 1), min_size=40, max_size=100), min_size=1,
                  max_size=5)
op = st.tuples(st.sampled_from(["add", "remove", "find"]), st.integers(0, 4),
               st.integers(0, 105), st.sampled_from([0, 0, 0x5A5A]))


@given(blocks=chains, ops=st.lists(op, min_size=1, max_size=80), stride=st.integers(1, 9))
@settings(max_examples=400, deadline=None)
def test_deepest_through_gates_is_the_scan(
    blocks: list[list[int]], ops: list[tuple[str, int, int, int]], stride: int
) -> None:
    hashed = [chain(b) for b in blocks]
    gates, marks = Gates(stride), set()
    past_head: set[int] = set()  # the marks the gates count (the head's are scanned)
    for kind, c, at, scope in ops:
        hashes = hashed[c % len(hashed)]
        if kind == "find":
            assert gates.deepest(hashes, at, marks, scope) == scanned(hashes, at, marks, scope)
        elif hashes and kind == "add":
            i = at % len(hashes)
            mark = hashes[i] ^ scope
            marks.add(mark)
            if i >= gates.head:
                past_head.add(mark)
            gates.add(mark, hashes, i, scope)
        elif hashes and marks:  # remove one of the marks (or one never added)
            mark = sorted(marks)[at % len(marks)] if at % 3 else hashes[at % len(hashes)]
            marks.discard(mark)
            past_head.discard(mark)
            gates.remove(mark)
        assert set(gates.gate_of) == past_head
    for hashes in hashed:
        for scope in (0, 0x5A5A):
            n = len(hashes)
            assert gates.deepest(hashes, n, marks, scope) == scanned(hashes, n, marks, scope)


def test_a_mark_in_a_window_whose_gate_another_chain_shares() -> None:
    """Two chains with one prefix up to a window's gate, then apart: a mark on one is not
    found on the other (its window is looked at, nothing there), and an earlier mark is."""
    a = chain([0] * 80 + [1] * 20)
    b = chain([0] * 80 + [0] * 20)
    gates, marks = Gates(16), {a[95], a[5]}
    gates.add(a[95], a, 95)  # window 5, past the head: counted at block 79
    gates.add(a[5], a, 5)  # in the head: scanned, not counted
    assert len(gates) == 1
    assert gates.deepest(a, len(a), marks) == 96
    assert gates.deepest(b, len(b), marks) == 6
    assert gates.deepest(a, 90, marks) == 6  # upto cuts below the deeper mark


@pytest.mark.parametrize("stride", [0, -3])
def test_stride_must_be_positive(stride: int) -> None:
    with pytest.raises(ValueError):
        Gates(stride)
