"""Cheaper computations on the request path give exactly what the plain ones give: the
depth guard's C-speed proof (`inbound.shallow`) against the exact walk (`too_deep`); the
block index's tip stamps against the LRU list it replaced; the estimator's remembered
search for the deepest anchor against a scan; the hygiene scanner's candidates found
through a digit mask against the regex engine's own scan; the deepest conversation sample
searched from the end in C against the loop it replaced; hygiene's reading of plain
messages against the general one; a prompt's samples renewed in one pass against the loop.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict, deque
from itertools import repeat
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.hygiene.patterns import _scan, scan_text
from gateway.hygiene.prompt import Part, _content, _part, parse
from gateway.proxy.errors import GatewayError
from gateway.proxy.inbound import MAX_DEPTH, DepthGuard, parse_json, shallow, too_deep
from gateway.routing.blocks import held_prefix
from gateway.routing.conversations import SHARED, Conversations, Found
from gateway.routing.estimate import TokenEstimator
from gateway.routing.index import BlockIndex
from tests.props import json_value, message


def nest(depth: int, leaf: Any = "x", wide: int = 0) -> Any:
    """`depth` containers around `leaf`, alternating lists and objects, with `wide`
    shallow siblings at each level."""
    doc = leaf
    for i in range(depth):
        doc = [doc, *range(wide)] if i % 2 else {"k": doc, **{f"s{j}": j for j in range(wide)}}
    return doc


@given(depth=st.integers(0, 300), wide=st.integers(0, 3), leaf=json_value)
@settings(max_examples=300, deadline=None)
def test_shallow_proves_exactly_what_the_walk_finds(depth: int, wide: int, leaf: Any) -> None:
    doc = nest(depth, leaf, wide)
    try:
        orjson.dumps(leaf)
    except orjson.JSONEncodeError:
        return  # a value orjson cannot write proves nothing; the walk decides
    assert shallow(doc) is (not too_deep(doc, MAX_DEPTH))


@given(docs=st.lists(st.tuples(st.integers(0, 300), st.integers(0, 2)), min_size=1,
                     max_size=12))
@settings(max_examples=100, deadline=None)
def test_one_guard_across_bodies_proves_what_a_fresh_one_does(
    docs: list[tuple[int, int]]
) -> None:
    """The request flow's guard, reused body after body (too deep ones among them), answers
    as a fresh guard does each time, and holds no body once it has answered."""
    guard = DepthGuard()
    for depth, wide in docs:
        doc = nest(depth, "x", wide)
        assert guard.shallow(doc) is shallow(doc) is (not too_deep(doc, MAX_DEPTH))
        assert guard._inner == []


@pytest.mark.parametrize(("depth", "pad", "ok"), [
    (MAX_DEPTH, 0, True),
    (MAX_DEPTH + 1, 0, False),
    (MAX_DEPTH, 64 * 1024, True),  # large bodies take the serializer's proof
    (MAX_DEPTH + 1, 64 * 1024, False),
    (3, 64 * 1024, True),
])
def test_parse_json_refuses_bodies_past_the_depth_limit(depth: int, pad: int, ok: bool) -> None:
    raw = orjson.dumps({"pad": "p" * pad, "doc": nest(depth - 1)})
    if ok:
        assert parse_json(raw)["pad"] == "p" * pad
    else:
        with pytest.raises(GatewayError) as err:
            parse_json(raw)
        assert err.value.status == 400


# the block index: recency stamped at a chain's tip, against an LRU list moved whole ----------

class LruIndex:
    """The index as it was: an LRU list (OrderedDict) into which a request's chain is
    appended and moved, deepest block first, on every use."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.held: OrderedDict[int, None] = OrderedDict()

    def matched(self, hashes: list[int]) -> int:
        return held_prefix(self.held, hashes) if self.held else 0

    def record(self, hashes: list[int], upto: int, held_already: int) -> None:
        held = self.held
        upto = min(upto, len(hashes))
        held_already = max(0, min(held_already, upto))
        refresh = held_already
        if upto > held_already:
            before = len(held)
            held.update(zip(reversed(hashes[held_already:upto]), repeat(None)))
            if len(held) - before != upto - held_already:
                refresh = upto
        try:
            deque(map(held.move_to_end, reversed(hashes[:refresh])), maxlen=0)
        except KeyError:
            held.update(zip(reversed(hashes[:upto]), repeat(None)))
            deque(map(held.move_to_end, reversed(hashes[:upto])), maxlen=0)
        self.shrink()

    def shrink(self) -> None:
        while len(self.held) > max(0, self.capacity):
            self.held.popitem(last=False)


op = st.tuples(st.sampled_from(["fork", "reply", "reuse", "capacity", "underclaim"]),
               st.integers(0, 10**6), st.integers(1, 12), st.integers(0, 60))


@given(ops=st.lists(op, min_size=1, max_size=60), capacity=st.integers(0, 40))
@settings(max_examples=400, deadline=None)
def test_index_evicts_as_an_lru_list_moved_whole(
    ops: list[tuple[str, int, int, int]], capacity: int
) -> None:
    ref, idx = LruIndex(capacity), BlockIndex(capacity)
    chains: list[list[int]] = [[]]
    fresh = itertools.count(1)
    for kind, pick, k, n in ops:
        base = chains[pick % len(chains)]
        if kind == "capacity":
            ref.capacity = n
            ref.shrink()
            idx.set_capacity("r", n)
        else:
            if kind in ("fork", "underclaim"):
                chain = base[: pick % (len(base) + 1)] + [next(fresh) for _ in range(k)]
            elif kind == "reply":  # the answer's blocks after a prompt (a stale claim too)
                chain = base + [next(fresh) for _ in range(k)]
            else:  # the same prompt again, or a prefix of it
                chain = base if pick % 2 else base[: max(1, pick % (len(base) + 1))]
            claim = ref.matched(chain)
            if kind == "reply":
                claim = len(base)
            elif kind == "underclaim":
                claim = min(claim, n % (claim + 1))
            ref.record(chain, len(chain), claim)
            idx.record("r", chain, len(chain), claim)
            chains.append(chain)
        assert idx.size("r") == len(ref.held)
        held = idx._held.get("r")
        assert set(held.parent if held else ()) == set(ref.held)  # the same blocks evicted
        for c in chains:
            assert idx.matched("r", c) == ref.matched(c)


# the estimator's deepest anchor: one scan per chain and anchors version -----------------------

def plain_deepest(anchors: dict[int, object], hashes: list[int], upto: int) -> int:
    return max((j for j in range(1, upto + 1) if hashes[j - 1] in anchors), default=0)


# chains past the gates' head (64 blocks, marks.py): searched through the gates too
estimator_op = st.tuples(st.booleans(), st.integers(0, 5), st.integers(0, 100))


@given(ops=st.lists(estimator_op, min_size=1, max_size=80))
@settings(max_examples=300, deadline=None)
def test_deepest_anchor_remembered_per_chain_equals_a_scan(
    ops: list[tuple[bool, int, int]]
) -> None:
    est = TokenEstimator(4.0, 0.1, 8, 4)
    # chains sharing prefixes, so an anchor set through one is found through another
    chains = [[(c % 3) * 100 + i if i < 70 else c * 1000 + i for i in range(100)]
              for c in range(6)]
    for anchor, c, n in ops:
        hashes = chains[c]
        if anchor and n:
            est.set_anchor(b"x" * (4 * n + 2), hashes[:n], 10.0 * n, 4.0)
        else:
            j, found = est.deepest(hashes, n)
            assert j == plain_deepest(est._anchors, hashes, n)
            assert found is (est._anchors[hashes[j - 1]] if j else None)


# the scanner's candidates found through a digit mask, against the regex engine's scan -----------

_PIECES = ["turn ", "Turn  ", "step #", "No. ", "line ", "2024-05-01T10:00:00Z", "12:30:45",
           "req_", "a1b2c3d4e5", "1700000000", " of ", "x", "9", "07/04/2024", "-", " ",
           "\t", "\n", "June 3, 2024", "id: ", "nonce=", "..", "v1.2.3", "#"]
ascii_prose = st.lists(st.sampled_from(_PIECES) | st.text(
    alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=6), max_size=40
).map("".join)


@given(text=ascii_prose, cut=st.tuples(st.integers(0, 400), st.integers(0, 400)),
       permissive=st.booleans())
@settings(max_examples=500, deadline=None)
def test_masked_candidates_find_what_the_regex_scan_finds(
    text: str, cut: tuple[int, int], permissive: bool
) -> None:
    lo, hi = min(cut[0], len(text)), min(max(cut), len(text))
    assert _scan(text, lo, hi, permissive, True) == _scan(text, lo, hi, permissive, False)
    assert scan_text(text, lo, hi, permissive) == _scan(text, lo, hi, permissive, False)


@pytest.mark.parametrize("text", [
    "a 1 12:30:45 done",  # a plain number right before a clock
    "x7 at 12:30:45",
    "9 turn 3 of 5",
    "12345 req_abc123def",
])
def test_masked_candidates_after_a_plain_number(text: str) -> None:
    assert _scan(text, 0, len(text), False, True) == _scan(text, 0, len(text), False, False)
    assert scan_text(text)  # each holds a finding right after a number that is none


def find_by_loop(convs: Conversations, hashes: list[int]) -> Found | None:
    """`Conversations.find` as a loop over the samples, deepest first (as it was)."""
    tips = convs._tips
    hit = next(filter(tips.__contains__, reversed(hashes)), None)
    if hit is not None:
        return Found(tips[hit], "follows")
    every = convs._every
    for i in range(len(hashes) // every * every - 1, -1, -every):
        owner = convs._samples.get(hashes[i])
        if owner is not None:
            if owner == SHARED or owner not in convs._conversations:
                return None
            if convs._length[owner] - (i + 1) > convs._max_tail:
                return None
            return Found(owner, "forks")
    return None


@given(sends=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 5), st.integers(0, 100)),
                      min_size=1, max_size=40),
       every=st.integers(1, 5), tail=st.integers(0, 12))
@settings(max_examples=300, deadline=None)
def test_find_scans_samples_as_the_loop_did(
    sends: list[tuple[int, int, int]], every: int, tail: int
) -> None:
    convs = Conversations(3, 1, every, 64, tail)
    base = [[(c % 2) * 1000 + i if i < 70 else c * 1000 + i for i in range(100)]
            for c in range(6)]
    for conv, which, n in sends:
        for other in base:
            for m in (n, max(0, n - 3), len(other)):
                assert convs.find(other[:m]) == find_by_loop(convs, other[:m])
        convs.advance(conv + 1, base[which][:n])


# hygiene's parts: the usual message's fast path, against the general reading ------------------

@given(messages=st.lists(message, max_size=6))
@settings(max_examples=300, deadline=None)
def test_parts_of_plain_messages_as_the_general_reading(messages: list[Any]) -> None:
    parts = [p for p in parse({"messages": messages}, "chat").parts]
    expected = [(i, str(m.get("role", "")), *_content(m)) for i, m in enumerate(messages)
                if isinstance(m, dict)]
    assert [(p.message_index, p.role, p.text, p.extra) for p in parts] == expected
    assert all(type(p) is Part and p.digest == _part(None, "", p.text, p.extra).digest
               for p in parts)


# a prompt's samples renewed in one pass over a C slice: the LRU the per-block loop kept -------

class SampledByLoop(Conversations):
    """`Conversations._sample` as the loop it was."""

    def _sample(self, conv: int, hashes: Any, scope: int) -> None:
        samples = self._samples
        for i in range(self._every - 1, len(hashes), self._every):
            h = hashes[i] ^ scope
            was = samples.get(h)
            samples[h] = conv if was is None or was == conv else SHARED
            samples.move_to_end(h)
        while len(samples) > self._sample_capacity:
            samples.popitem(last=False)


@given(sends=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 5), st.integers(0, 60),
                                st.sampled_from([0, 0x77])), min_size=1, max_size=40),
       every=st.integers(1, 5), capacity=st.integers(1, 40))
@settings(max_examples=300, deadline=None)
def test_samples_renewed_in_one_pass_as_the_loop_kept_them(
    sends: list[tuple[int, int, int, int]], every: int, capacity: int
) -> None:
    new, old = Conversations(4, 2, every, capacity), SampledByLoop(4, 2, every, capacity)
    base = [[(c % 2) * 1000 + i if i < 8 else c * 1000 + i for i in range(60)]
            for c in range(6)]
    for conv, which, n, scope in sends:
        new.advance(conv + 1, base[which][:n], scope)
        old.advance(conv + 1, base[which][:n], scope)
        assert list(new._samples.items()) == list(old._samples.items())
