"""Several gateway instances, one routing memory: two `gateway serve` processes sharing
state through a real redis-server, in front of `gateway sim` replicas, all on loopback.

A conversation whose turns alternate between the instances keeps landing on the replica
that holds its history, with and without session ids; without Redis the same traffic
moves conversations (the control that shows the test can fail). Killing Redis fails no
request; after it returns the instances converge again."""

from __future__ import annotations

import contextlib
import random
import signal
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.filler import words
from tests.redis_server import needs_redis, redis_server
from tests.servers import free_port, gateway, sim

pytest.importorskip("redis")


def chat(client: httpx.Client, url: str, msgs: list[dict[str, Any]], session: str | None
         ) -> httpx.Response:
    headers = {"x-session-id": session} if session else {}
    r = client.post(url + "/v1/chat/completions", headers=headers,
                    json={"model": "sim", "messages": msgs, "max_tokens": 8})
    assert r.status_code == 200, r.text
    return r


@contextlib.contextmanager
def two_gateways(urls: list[str], redis_url: str | None) -> Iterator[list[str]]:
    env = {"GATEWAY_REDIS__URL": redis_url} if redis_url else {}
    with gateway(urls, ["--policy", "prefix"], env=env) as a, \
            gateway(urls, ["--policy", "prefix"], env=env) as b:
        yield [a, b]


def converse(client: httpx.Client, gws: list[str], rng: random.Random, n: int, turns: int,
             with_ids: bool, tag: str) -> tuple[list[list[str]], int, int]:
    """n conversations, turn t of each sent to gateway t % 2; (replicas per conversation,
    prompt tokens and cached tokens of the follow-up turns)."""
    convs = [[{"role": "system", "content": f"{tag} agent {i}. " + words(rng, 250)},
              {"role": "user", "content": words(rng, 20)}] for i in range(n)]
    where: list[list[str]] = [[] for _ in convs]
    prompt = cached = 0
    for t in range(turns):
        for i, msgs in enumerate(convs):
            r = chat(client, gws[(t + i) % 2], msgs, f"{tag}-{i}" if with_ids else None)
            where[i].append(r.headers["x-gateway-replica"])
            usage = r.json()["usage"]
            if t:
                prompt += usage["prompt_tokens"]
                cached += usage["prompt_tokens_details"]["cached_tokens"]
            msgs += [{"role": "assistant", "content": r.json()["choices"][0]["message"][
                "content"]}, {"role": "user", "content": words(rng, 20)}]
            time.sleep(0.05)  # the propagation bound the benchmark holds (50 ms)
    return where, prompt, cached


@needs_redis
@pytest.mark.parametrize("with_ids", [True, False], ids=["session ids", "no session ids"])
def test_alternating_instances_keep_conversations_on_their_replica(with_ids: bool) -> None:
    port = free_port()
    with (
        redis_server(port),
        sim(3, ["--model", "sim", "--speed", "50", "--seed", "3"]) as urls,
        two_gateways(urls, f"redis://127.0.0.1:{port}/0") as gws,
        httpx.Client(timeout=30) as client,
    ):
        where, prompt, cached = converse(client, gws, random.Random(7), 6, 4, with_ids, "s")
        metrics = [client.get(g + "/metrics").text for g in gws]
    assert all(len(set(w)) == 1 for w in where), where
    assert cached / prompt > 0.8
    assert len({w[0] for w in where}) >= 2  # spread over the fleet, not piled on one
    for text in metrics:
        assert "gateway_shared_state_up 1.0" in text
        assert 'gateway_shared_facts_total{direction="in",result="ok"}' in text


def test_without_shared_state_alternating_instances_move_conversations() -> None:
    """The control: the same traffic with two independent instances."""
    with (
        sim(3, ["--model", "sim", "--speed", "50", "--seed", "3"]) as urls,
        two_gateways(urls, None) as gws,
        httpx.Client(timeout=30) as client,
    ):
        where, _, _ = converse(client, gws, random.Random(7), 6, 4, False, "s")
    assert any(len(set(w)) > 1 for w in where), where


@needs_redis
def test_redis_killed_and_restored() -> None:
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    rng = random.Random(11)
    with (
        sim(3, ["--model", "sim", "--speed", "50", "--seed", "5"]) as urls,
        httpx.Client(timeout=30) as client,
        redis_server(port) as redis,
        two_gateways(urls, url) as gws,
    ):
        before, _, _ = converse(client, gws, rng, 3, 2, False, "before")
        redis.send_signal(signal.SIGKILL)
        redis.wait(timeout=10)
        # Redis gone: every request is still answered (converse asserts 200), on local
        # state, without waiting on Redis.
        t0 = time.monotonic()
        converse(client, gws, rng, 3, 3, True, "during")
        elapsed = time.monotonic() - t0
        down = [client.get(g + "/metrics").text for g in gws]
        # Redis back (empty): the instances reconnect by themselves.
        with redis_server(port):
            deadline = time.monotonic() + 15
            while not all("gateway_shared_state_up 1.0" in client.get(g + "/metrics").text
                          for g in gws):
                assert time.monotonic() < deadline, "no reconnect"
                time.sleep(0.2)
            after, prompt, cached = converse(client, gws, rng, 6, 4, False, "after")
    assert all(len(set(w)) == 1 for w in before), before
    assert all("gateway_shared_state_up 0.0" in text for text in down)
    # 9 requests plus the 50 ms pauses: no request waited on the dead Redis.
    assert elapsed < 9 * 0.05 + 5.0
    assert all(len(set(w)) == 1 for w in after), after
    assert cached / prompt > 0.8
