"""Routing facts: the wire form round-trips and refuses anything malformed (by table and
by hypothesis), and a router that applies another router's facts routes like it."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.routing.config import RoutingConfig
from gateway.routing.decision import ReplicaState
from gateway.routing.facts import (
    Departed,
    Dropped,
    Fact,
    FactError,
    Reply,
    Response,
    Restarted,
    Sent,
    Trust,
    decode,
    encode,
)
from gateway.routing.router import Router
from tests.routing_driver import finish

FACTS: list[Fact] = [
    Sent("r1", [1, 2, 2**64 - 1], "sess-é", False),
    Sent("r1", [5], None, True),
    Sent("r2", [], None, False),
    Sent("r2", [4, 5], "s", False, "tenant-ü"),
    Reply("r1", [7, 8, 9], 2),
    Dropped("r2", [3, 4], 0),
    Trust("r1", 0.625),
    Response("resp_abc", "r2"),
    Restarted("r1"),
    Restarted("r1", 1_800_000_123.25),  # with the engine's process start time
    Departed("r2"),
]


@pytest.mark.parametrize("fact", FACTS, ids=lambda f: type(f).__name__)
def test_round_trip(fact: Fact) -> None:
    env = decode(encode(fact, "inst-1", 12.5))
    assert (env.origin, env.at) == ("inst-1", 12.5)
    got = env.fact
    if isinstance(got, (Sent, Reply, Dropped)):  # hashes come back as a list
        got = dataclasses.replace(got, hashes=tuple(got.hashes))
        assert isinstance(fact, (Sent, Reply, Dropped))
        fact = dataclasses.replace(fact, hashes=tuple(fact.hashes))
    assert got == fact


def test_dropped_carries_only_what_it_drops() -> None:
    got = decode(encode(Dropped("r1", [1, 2, 3, 4], 3), "i", 1.0)).fact
    assert isinstance(got, Dropped) and (list(got.hashes), got.keep) == ([4], 0)


@pytest.mark.parametrize("fact", [Sent("r1", [1, 2, 3, 4, 5], "s"),
                                  Reply("r1", [1, 2, 3, 4, 5], 4)])
def test_a_delta_carries_its_base_and_the_blocks_after_it(fact: Sent | Reply) -> None:
    env = decode(encode(fact, "i", 1.0, (3, 3)))
    assert env.base == (3, 3)
    assert list(env.fact.hashes) == [4, 5]  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="not a prefix"):
        encode(fact, "i", 1.0, (2, 3))


GOOD = encode(Sent("r1", [1, 2], "s"), "i", 1.0)


@pytest.mark.parametrize(("change", "reason"), [
    ({b"o": None}, "missing field o"),
    ({b"a": b"soon"}, "field a"),
    ({b"a": b"nan"}, "field a"),
    ({b"k": b"z"}, "unknown fact kind"),
    ({b"h": b"\x00" * 7}, "bad block hashes"),
    ({b"r": b"\xff\xfe"}, "not UTF-8"),
    ({b"r": b"x" * 5000}, "too long"),
    ({b"k": b"t", b"f": b"1.5"}, "out of"),
    ({b"k": b"t", b"f": b"x"}, "not a number"),
    ({b"k": b"d", b"n": b"-1"}, "not a count"),
    ({b"a": b"inf"}, "field a"),
    ({b"b": b"\x01" * 8, b"l": b"0"}, "bad base"),
    ({b"b": b"\x01" * 16, b"l": b"2"}, "bad base"),
    ({b"b": b"\x01" * 8}, "not a count"),
    ({b"k": b"t", b"f": b"0.5", b"b": b"\x01" * 8, b"l": b"2"}, "takes none"),
    ({b"b": b"\x01" * 8, b"l": b"131071"}, "bad block hashes"),
    ({b"k": b"x", b"e": b"nan"}, "field e"),
    ({b"k": b"x", b"e": b"-inf"}, "field e"),
    ({b"k": b"x", b"e": b"1e999"}, "field e"),
    ({b"k": b"x", b"e": b"yesterday"}, "field e"),
    ({b"k": b"x", b"e": b"1" * 100}, "field e"),
])
def test_malformed_entries_are_refused(change: dict[bytes, bytes | None], reason: str) -> None:
    fields = {k: v for k, v in {**GOOD, **change}.items() if v is not None}
    with pytest.raises(FactError, match=reason):
        decode(fields)


@given(st.dictionaries(st.sampled_from([b"o", b"a", b"k", b"r", b"h", b"s", b"c", b"n", b"f",
                                        b"i", b"x", b"t", b"b", b"l", b"e"]),
                       st.binary(max_size=64), max_size=10))
def test_decode_never_fails_otherwise(fields: dict[bytes, bytes]) -> None:
    with contextlib.suppress(FactError):
        decode(fields)


def body(system: str, user: str) -> dict[str, object]:
    return {"model": "m", "messages": [{"role": "system", "content": system},
                                       {"role": "user", "content": user}]}


@pytest.mark.parametrize("session", ["conv-1", None])
def test_a_router_applying_anothers_facts_follows_its_conversations(
        session: str | None) -> None:
    published: list[Fact] = []
    a = Router(RoutingConfig(seed=1), publish=published.append)
    b = Router(RoutingConfig(seed=2))
    names = ["r1", "r2", "r3"]
    for r in (a, b):
        for n in names:
            r.add_replica(n)
    cands = [ReplicaState(n, 0) for n in names]
    system = "You are a careful agent. " * 80
    first = a.decide(body(system, "first question"), "chat", "m", session, cands, 1.0)
    home = first.decision.replica
    finish(a, first, home, 600, 0, True, 1.5)
    for fact in published:
        b.apply(fact, 2.0)
    follow = {"model": "m", "messages": [
        *body(system, "first question")["messages"],  # type: ignore[misc]
        {"role": "assistant", "content": "an answer"},
        {"role": "user", "content": "and then?"}]}
    plan = b.decide(follow, "chat", "m", session, cands, 3.0)
    assert plan.decision.replica == home
    assert plan.decision.predicted_cached_tokens > 400
    assert plan.decision.reason in ("prefix", "session")


def test_facts_about_unknown_replicas_are_ignored() -> None:
    r = Router(RoutingConfig(seed=1))
    r.add_replica("r1")
    r.apply(Sent("elsewhere", [1, 2, 3], "s"), 1.0)
    r.apply(Trust("elsewhere", 0.5), 1.0)
    assert r.indexed_blocks("r1") == 0
    r.apply(Sent("r1", [1, 2, 3], "s"), 1.0)
    assert r.indexed_blocks("r1") == 3
    assert r.session_replica("s") == "r1"
    limit = r.index_limit("r1")
    r.apply(Trust("r1", 0.5), 1.0)
    assert r.index_limit("r1") == limit // 2
