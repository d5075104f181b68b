"""Prefix-affinity routing measured by the engine: the same multi-session workload through
the gateway with `policy = "prefix"` and `policy = "round_robin"`, each on fresh llama.cpp
replicas, compared by the cached-token ratio llama.cpp itself reports.

Setup that makes affinity matter: 2 replicas x 3 slots, host prompt cache off
(`cache_ram_mib = 0`), 6 sessions x 4 turns with ~1k-token per-session prefixes. With
affinity each replica keeps its 3 sessions in its 3 slots; round-robin shows every session
to every replica, so 6 sessions compete for 3 slots. The gateway learns capacity from the
TOML `[[replicas]] capacity_tokens` (llama.cpp reports none), applied when a replica comes
up, whether or not its `/metrics` is on. At start-up the gateway also sends each replica
two 1-token completions (the `cached_tokens` probe, `[usage] startup_probe`); they leave
one short prompt in a slot, which the sessions evict.

Measured here (6 runs each): prefix 0.738 every time (= the ceiling: the first turn of each
session is cold under any policy; warm turns 0.966), round_robin 0.13-0.17 at the time;
later (after session placement changed, 2 runs each with and without the start-up probe)
prefix 0.738 every time, round_robin 0.21-0.33 either way. The asserted margins
(prefix >= 0.55 and >= 1.5x round_robin) leave room for a session placed badly.

Known gap (reported, not asserted here): with strictly sequential traffic there is no load
to spread cold sessions, the tie is broken at random and the session prior then pins them;
seed 0 put 5 of 6 sessions on one 3-slot replica and the engine-reported ratio fell to 0.26.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from tests.realengine.engine import EngineOptions
from tests.realengine.fleet import fronted
from tests.realengine.workload import SessionPlan, Summary, describe, run_sessions

pytestmark = pytest.mark.realengine

# All sessions in flight together (agents run in parallel), so the gateway's load term
# spreads the cold first turns 3/3; see the module docstring for the sequential case.
PLAN = SessionPlan(sessions=6, turns=4, prefix_words=1000, max_tokens=4, seed=11, concurrency=6)


def _measure(start: Callable[..., list[str]], options: EngineOptions, policy: str) -> Summary:
    urls = start(2)
    with fronted(urls, policy=policy, capacity_tokens=options.capacity_tokens) as gw:
        summary = asyncio.run(run_sessions(gw + "/v1", PLAN))
    print(policy, describe(summary))
    return summary


def test_prefix_policy_captures_far_more_engine_cache_than_round_robin(
    fresh_llamas: Callable[..., list[str]], llama_options: EngineOptions
) -> None:
    prefix = _measure(fresh_llamas, llama_options, "prefix")
    rr = _measure(fresh_llamas, llama_options, "round_robin")
    # Affinity: (almost) every session stays on one replica; round-robin spreads them.
    per_prefix = prefix.replicas_per_session()
    assert sum(len(v) == 1 for v in per_prefix.values()) >= PLAN.sessions - 1
    assert sum(len(v) == 2 for v in rr.replicas_per_session().values()) >= PLAN.sessions // 2
    assert prefix.cached_ratio >= 0.55
    assert prefix.warm_ratio() >= 0.75
    assert prefix.cached_ratio >= 1.5 * rr.cached_ratio
