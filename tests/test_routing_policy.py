"""The policy's choices under given matches and loads."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from gateway.routing.config import RoutingConfig
from gateway.routing.policy import Candidate, choose, costs, session_order

CFG = RoutingConfig()


def cand(name: str, predicted: int = 0, queued: float = 0.0, in_flight: int = 0,
         waiting: float = 0.0) -> Candidate:
    return Candidate(name=name, predicted_tokens=predicted, queued_tokens=queued,
                     queued_requests=1 if queued else 0, in_flight=in_flight,
                     engine_waiting=waiting)


@pytest.mark.parametrize(
    ("case", "cands", "prompt", "session_replica", "winner", "reason"),
    [
        ("longest prefix wins on equal load",
         [cand("a", 0), cand("b", 4000), cand("c", 1000)], 5000, None, "b", "prefix"),
        ("small load does not beat a big prefix",
         [cand("a", 0), cand("b", 4000, in_flight=3, queued=500)], 5000, None, "b", "prefix"),
        ("a long queue beats a small prefix gain",
         [cand("a", 0), cand("b", 256, queued=20_000, in_flight=4)], 1000, None, "a", "load"),
        # shared system prompt cached everywhere: no replica saves more, load decides
        ("equal matches: least queued prefill",
         [cand("a", 2000, queued=3000, in_flight=1), cand("b", 2000)], 2500, None, "b", "load"),
        ("hot spot guard overrides a prefix",
         [cand("a", 800, in_flight=12), cand("b", 0, in_flight=1), cand("c", 0, in_flight=1)],
         1000, None, "b|c", "load"),
        ("engine waiting queue counts",
         [cand("a", 500, waiting=10), cand("b", 0)], 1000, None, "b", "load"),
        ("session prior on equal evidence",
         [cand("a", 2000), cand("b", 2000), cand("c", 2000)], 2500, "c", "c", "session"),
        # a timestamp at the top changed every block: the session's replica still won
        ("session prior when nothing is cached",
         [cand("a"), cand("b"), cand("c")], 2500, "b", "b", "session"),
        ("nothing cached, the session's replica too busy to win",
         [cand("a"), cand("b", in_flight=40, queued=30_000)], 2500, "b", "a", "cold"),
        ("prefix evidence overrides the session prior",
         [cand("a", 3000), cand("b", 1000)], 3500, "b", "a", "prefix"),
        ("nothing cached anywhere",
         [cand("a", in_flight=2), cand("b", in_flight=0)], 800, None, "b", "cold"),
    ],
)
def test_prefix_policy(case: str, cands: list[Candidate], prompt: float,
                       session_replica: str | None, winner: str, reason: str) -> None:
    choice = choose("prefix", cands, prompt, "s", session_replica, CFG, random.Random(1), 0)
    assert cands[choice.ranked[0]].name in winner.split("|"), case
    assert choice.reason == reason, case
    assert sorted(choice.ranked) == list(range(len(cands)))


def test_cost_is_estimated_ttft() -> None:
    [a, b] = costs([cand("a", 1000), cand("b", 0, queued=100, in_flight=1)], 2000, None, CFG)
    assert a == pytest.approx(1000 * CFG.prefill_s_per_token)
    assert b == pytest.approx(2100 * CFG.prefill_s_per_token + CFG.in_flight_s)


def test_cold_traffic_spreads_at_random() -> None:
    rng = random.Random(7)
    cands = [cand(n) for n in "abcd"]
    counts = Counter(
        cands[choose("prefix", cands, 1000, None, None, CFG, rng, i).ranked[0]].name
        for i in range(400)
    )
    assert set(counts) == set("abcd")
    assert max(counts.values()) < 2 * min(counts.values())


def test_popular_prefix_spills_over_as_its_queue_grows() -> None:
    """One agent's shared prompt: requests pile on its replica only until the queue there
    costs more than re-prefilling elsewhere."""
    rng = random.Random(3)
    prompt, shared = 3000, 2400
    queued = {"a": 0.0, "b": 0.0, "c": 0.0}
    cached = {"a": shared, "b": 0, "c": 0}
    picks: list[str] = []
    for i in range(12):  # a burst: nothing finishes prefill meanwhile
        cands = [cand(n, cached[n], queued[n], in_flight=picks.count(n)) for n in queued]
        name = cands[choose("prefix", cands, prompt, None, None, CFG, rng, i).ranked[0]].name
        queued[name] += prompt - cached[name]
        cached[name] = shared  # once sent there, that replica caches the prefix too
        picks.append(name)
    counts = Counter(picks)
    assert picks[:3] == ["a", "a", "a"] and len(counts) == 3
    # queued work ends balanced to within one request's prefill
    assert max(queued.values()) - min(queued.values()) <= prompt


@pytest.mark.parametrize(
    ("policy", "reason"),
    [("round_robin", "round_robin"), ("random", "random"), ("least_loaded", "least_loaded"),
     ("session", "session")],
)
def test_simple_policies_name_themselves(policy: str, reason: str) -> None:
    cands = [cand("a", 5000), cand("b"), cand("c")]
    choice = choose(policy, cands, 6000, "sess", None, CFG, random.Random(0), 4)  # type: ignore[arg-type]
    assert choice.reason == reason


def test_round_robin_cycles() -> None:
    cands = [cand(n) for n in "abc"]
    got = [cands[choose("round_robin", cands, 10, None, None, CFG, random.Random(0), t)
                 .ranked[0]].name for t in range(6)]
    assert got == list("abcabc")


def test_least_loaded_prefers_fewer_requests_then_less_work() -> None:
    cands = [cand("a", in_flight=2), cand("b", in_flight=1, queued=5000),
             cand("c", in_flight=1, queued=10)]
    assert choose("least_loaded", cands, 10, None, None, CFG, random.Random(0), 0).ranked[:2] \
        == (2, 1)


def test_session_hash_is_consistent() -> None:
    full = [cand(n) for n in "abcd"]
    moved = 0
    for i in range(200):
        s = f"session-{i}"
        before = full[session_order(full, s)[0]].name
        rev = list(reversed(full))
        assert before == rev[session_order(rev, s)[0]].name  # independent of list order
        without_d = [c for c in full if c.name != "d"]
        after = without_d[session_order(without_d, s)[0]].name
        moved += before != after
        if before != "d":
            assert after == before  # only the leaving replica's sessions move
    assert 20 < moved < 90
