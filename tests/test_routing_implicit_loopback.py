"""No session ids, end to end: `gateway sim` replicas behind `gateway serve`.

8 cold conversations with distinct system prompts, sent one request at a time without any
session id, split evenly over the replicas (4/4 on two, 3/3/2 on three) and each keeps its
replica for all its turns, with the engine reporting the history cached.
"""

from __future__ import annotations

import random
import re
from collections import Counter
from typing import Any

import httpx
import pytest

from tests.filler import words
from tests.servers import gateway, sim


def chat(client: httpx.Client, url: str, messages: list[dict[str, Any]]) -> httpx.Response:
    body = {"model": "sim", "messages": messages, "max_tokens": 24}
    r = client.post(url + "/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r


@pytest.mark.parametrize(("replicas", "split"), [(2, [4, 4]), (3, [2, 3, 3])])
def test_cold_conversations_without_ids_split_and_stick(replicas: int,
                                                        split: list[int]) -> None:
    rng = random.Random(replicas)
    convs: list[list[dict[str, Any]]] = [
        [{"role": "system", "content": "You are a careful coding agent. " + words(rng, 400)},
         {"role": "user", "content": words(rng, 40)}] for _ in range(8)]
    where: list[list[str]] = [[] for _ in convs]
    prompt = cached = 0
    with (
        sim(replicas, ["--model", "sim", "--speed", "50", "--seed", "1"]) as urls,
        gateway(urls, ["--policy", "prefix"]) as url,
        httpx.Client(timeout=30) as client,
    ):
        for t in range(4):
            for i, msgs in enumerate(convs):
                r = chat(client, url, msgs)
                where[i].append(r.headers["x-gateway-replica"])
                usage = r.json()["usage"]
                if t:
                    prompt += usage["prompt_tokens"]
                    cached += (usage.get("prompt_tokens_details") or {}).get(
                        "cached_tokens") or 0
                msgs += [{"role": "assistant",
                          "content": r.json()["choices"][0]["message"]["content"]},
                         {"role": "user", "content": words(rng, 40)}]
        metrics = client.get(url + "/metrics").text
    assert sorted(Counter(w[0] for w in where).values()) == split, where
    assert all(len(set(w)) == 1 for w in where), where
    assert cached / prompt >= 0.85
    moves = re.findall(r'^gateway_route_moves_total\{reason="(\w+)"\} (\S+)$', metrics, re.M)
    assert sorted(r for r, _ in moves) == ["evicted", "load", "unavailable"]
    assert all(float(v) == 0.0 for _, v in moves)
