"""Conversations without session ids on real engines: 8 conversations x 4 turns, one
request at a time, no `x-session-id`, through `gateway serve --policy prefix` to 2 fresh
llama.cpp replicas of 4 slots each (host prompt cache off).

Sequential cold traffic gives the load terms nothing to spread by; before implicit
conversations the cold placements tied and the cached prefixes of earlier conversations
(the template's first block) drew 7 of 8 onto one replica, whose 4 slots then lost a third
of the follow-up hits. Now each new conversation is placed by conversation load: 4/4, each
conversation keeps its replica, and the follow-ups are served from the slots.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable

import pytest

from tests.realengine.engine import EngineOptions
from tests.realengine.fleet import fronted
from tests.realengine.workload import SessionPlan, describe, run_sessions

pytestmark = pytest.mark.realengine

PLAN = SessionPlan(sessions=8, turns=4, prefix_words=600, max_tokens=4, seed=5,
                   concurrency=1, session_ids=False)


def test_sequential_conversations_without_ids_split_and_stick(
    fresh_llamas: Callable[..., list[str]], llama_options: EngineOptions
) -> None:
    urls = fresh_llamas(2, slots=4)
    capacity = 4 * llama_options.ctx_per_slot
    with fronted(urls, policy="prefix", capacity_tokens=capacity) as gw:
        summary = asyncio.run(run_sessions(gw + "/v1", PLAN))
    print(describe(summary))
    first = Counter(r.replica for r in summary.results if r.turn == 0)
    assert sorted(first.values()) == [4, 4], first
    per = summary.replicas_per_session()
    assert all(len(v) == 1 for v in per.values()), per
    assert summary.warm_ratio() >= 0.85
