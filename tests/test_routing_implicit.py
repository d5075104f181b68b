"""Requests without a session id: implicit conversations placed like sessions, follow-ups
that stay unless moving pays, guards that place and never pull, moves and their reasons."""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

import pytest

from gateway.routing.config import RoutingConfig
from gateway.routing.decision import MOVE_REASONS, ReplicaState
from gateway.routing.policy import Candidate, costs, move_reason
from gateway.routing.router import Router
from tests.filler import words
from tests.routing_driver import finish


def states(names: list[str], in_flight: dict[str, int] | None = None) -> list[ReplicaState]:
    return [ReplicaState(name=n, in_flight=(in_flight or {}).get(n, 0)) for n in names]


def turn(router: Router, msgs: list[dict[str, Any]], replicas: list[str], now: float,
         in_flight: dict[str, int] | None = None) -> tuple[str, str | None]:
    plan = router.decide({"messages": msgs}, "chat", "m", None, states(replicas, in_flight),
                         now)
    name = plan.decision.replica
    finish(router, plan, name, round(plan.estimated_tokens),
           plan.decision.predicted_cached_tokens, True, now + 0.5)
    return name, plan.decision.move


@pytest.mark.parametrize(("replicas", "split"), [
    (2, [4, 4]), (3, [2, 3, 3]), (4, [2, 2, 2, 2]),
])
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_sequential_cold_conversations_split_evenly(replicas: int, split: list[int],
                                                    seed: int) -> None:
    """8 conversations with distinct system prompts that begin alike (the template and a
    common opening), one request at a time, no session id: they split evenly and every
    follow-up stays."""
    rng = random.Random(seed)
    names = [f"r{i}" for i in range(replicas)]
    router = Router(RoutingConfig(seed=seed))
    convs = [[{"role": "system", "content": "You are a helpful assistant. " + words(rng, 300)},
              {"role": "user", "content": words(rng, 40)}] for _ in range(8)]
    where: list[list[str]] = [[] for _ in convs]
    now = 0.0
    for _ in range(4):
        for i, msgs in enumerate(convs):
            now += 1.0
            name, move = turn(router, msgs, names, now)
            where[i].append(name)
            assert move is None
            msgs += [{"role": "assistant", "content": words(rng, 30)},
                     {"role": "user", "content": words(rng, 30)}]
    assert sorted(Counter(w[0] for w in where).values()) == split
    assert all(len(set(w)) == 1 for w in where), where
    assert router.conversations() == 8


def test_follow_up_stays_under_hot_spot_and_moves_only_when_it_pays() -> None:
    rng = random.Random(5)
    router = Router(RoutingConfig(seed=0))
    msgs: list[dict[str, Any]] = [{"role": "system", "content": words(rng, 2000)},
                                  {"role": "user", "content": words(rng, 50)}]
    home, _ = turn(router, msgs, ["a", "b"], 1.0)
    other = "b" if home == "a" else "a"
    msgs += [{"role": "assistant", "content": words(rng, 20)},
             {"role": "user", "content": words(rng, 20)}]
    # a hot spot on its replica (many requests in flight there, few elsewhere): the guard
    # would add cost there, but a follow-up is never pulled off its history by a guard
    name, move = turn(router, msgs, ["a", "b"], 2.0, {home: 8, other: 0})
    assert (name, move) == (home, None)
    msgs += [{"role": "assistant", "content": words(rng, 20)},
             {"role": "user", "content": words(rng, 20)}]
    # a queue there worth far more than re-prefilling its history elsewhere: it moves
    name, move = turn(router, msgs, ["a", "b"], 3.0, {home: 400, other: 0})
    assert (name, move) == (other, "load")
    msgs += [{"role": "assistant", "content": words(rng, 20)},
             {"role": "user", "content": words(rng, 20)}]
    # its replica left the candidates
    name, move = turn(router, msgs, [home], 4.0)
    assert (name, move) == (home, "unavailable")


def cand(name: str, predicted: int, in_flight: int = 0) -> Candidate:
    return Candidate(name=name, predicted_tokens=predicted, queued_tokens=0.0,
                     queued_requests=0, in_flight=in_flight)


@pytest.mark.parametrize(("bound", "chosen", "views", "reason"), [
    ("a", "a", [cand("a", 900), cand("b", 0)], None),
    ("a", "b", [cand("a", 900), cand("b", 0)], "load"),
    ("a", "b", [cand("a", 64), cand("b", 64)], "evicted"),
    ("a", "b", [cand("a", 0), cand("b", 640)], "evicted"),
    ("a", "b", [cand("b", 0), cand("c", 0)], "unavailable"),
])
def test_move_reason(bound: str, chosen: str, views: list[Candidate],
                     reason: str | None) -> None:
    assert move_reason(bound, chosen, views) == reason
    assert reason is None or reason in MOVE_REASONS


@pytest.mark.parametrize(("place", "bound", "extra"), [
    (False, "a", 0.0),  # a follow-up staying: no guard
    (True, "a", 0.05 * 3),  # placing: the guard counts
    (False, None, 0.05 * 3),  # no conversation (too short): the guard counts
])
def test_hot_spot_guard_places_never_pulls(place: bool, bound: str | None,
                                           extra: float) -> None:
    cfg = RoutingConfig()
    views = [cand("a", 0, in_flight=10), cand("b", 0), cand("c", 0)]
    # mean 3.33: the hot limit is 1.5 x mean + 2 = 7, a is 3 above it
    base = cfg.prefill_s_per_token * 100 + cfg.in_flight_s * 10
    cost = costs(views, 100.0, bound, cfg, place)[0]
    prior = cfg.prefill_s_per_token * cfg.session_prior_tokens if bound == "a" else 0.0
    assert cost == pytest.approx(base + extra - prior)


@pytest.mark.parametrize(("views", "blocked"), [
    # a holds the prompt, b does not: over the cap, a ranks after b
    ([Candidate("a", 2400, 0.0, 0, 0, sessions=5), Candidate("b", 0, 0.0, 0, 0, sessions=1)],
     True),
    # equal cache everywhere (one-shot traffic past a shared prompt): nothing draws
    # conversations to a, so the cap leaves a to the estimate and the session term
    ([Candidate("a", 512, 0.0, 0, 0, sessions=5), Candidate("b", 512, 0.0, 0, 0, sessions=1)],
     False),
    # everyone over the cap: it ranks nothing
    ([Candidate("a", 2400, 0.0, 0, 0, sessions=5), Candidate("b", 0, 0.0, 0, 0, sessions=5)],
     False),
])
def test_cap_blocks_only_a_cache_that_draws(views: list[Candidate], blocked: bool) -> None:
    cfg = RoutingConfig()
    a, b = costs(views, 3000.0, None, cfg, place=True)
    plain_a, plain_b = costs(views, 3000.0, None, cfg, place=False)
    session_diff = cfg.session_s * (views[0].sessions - views[1].sessions)
    assert (a - b) - (plain_a - plain_b) == pytest.approx(
        session_diff + (1e6 if blocked else 0.0), rel=1e-9)
