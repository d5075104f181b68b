"""Routing without session ids on real vLLM: 8 conversations x 4 turns, one request at a
time, no `x-session-id`/`prompt_cache_key`/`user`, 2 fresh replicas behind `--policy prefix`.
The gateway must infer the conversations from content: they split 4/4 across the replicas
and the follow-up turns are served from cache (cached/prompt tokens >= 0.9 over turns 2-4).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from tests.realvllm.gateways import fronted, records
from tests.realvllm.vllm import MODEL_NAME

pytestmark = pytest.mark.realvllm

CONVERSATIONS = 8
TURNS = 4


def _system(conv: int) -> str:
    # Distinct from the first token on, ~600 tokens: a shared prefix would blur the check.
    return f"conversation {conv}: " + " ".join(f"c{conv}w{i % 29} step" for i in range(150))


def test_conversations_without_session_ids_split_evenly_and_hit_the_cache(
    fresh_vllm: Callable[..., list[str]], tmp_path: Path
) -> None:
    urls = fresh_vllm(2)  # cold caches: nothing left from other tests
    log = tmp_path / "usage.jsonl"
    history = {c: [{"role": "system", "content": _system(c)}] for c in range(CONVERSATIONS)}
    with fronted(urls, log, "--policy", "prefix") as gw:
        for turn in range(TURNS):
            for conv in range(CONVERSATIONS):
                msgs = [*history[conv], {"role": "user", "content": f"turn {turn} of {conv} " * 8}]
                body = {"model": MODEL_NAME, "messages": msgs, "max_tokens": 8}
                r = httpx.post(gw + "/v1/chat/completions", json=body, timeout=60)
                assert r.status_code == 200, r.text
                reply = r.json()["choices"][0]["message"]["content"]
                history[conv] = [*msgs, {"role": "assistant", "content": reply}]
    recs = records(log)
    assert len(recs) == CONVERSATIONS * TURNS
    first_replica = {i % CONVERSATIONS: r["replica"] for i, r in enumerate(recs[:CONVERSATIONS])}
    split = Counter(first_replica.values())
    follow = recs[CONVERSATIONS:]
    ratio = sum(r["cached_tokens"] or 0 for r in follow) / sum(r["prompt_tokens"] for r in follow)
    print(f"split {dict(split)}, follow-up cached ratio {ratio:.3f}")
    assert sorted(split.values()) == [4, 4], split
    assert ratio >= 0.9, ratio
