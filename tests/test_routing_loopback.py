"""Prefix routing end to end: `gateway sim` replicas behind `gateway serve --policy prefix`.

- a multi-turn session sticks to one replica while its cache holds, and the engine's
  cached_tokens shows the reuse;
- cold traffic (distinct prompts, idle fleet) spreads over the replicas;
- when the session's replica is overloaded (its engine queue full of other clients'
  requests, seen through the gateway's /metrics scrape) the next turn moves.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.filler import words
from tests.servers import gateway, sim


def chat(
    client: httpx.Client,
    url: str,
    messages: list[dict[str, Any]],
    session: str | None = None,
    max_tokens: int = 24,
) -> httpx.Response:
    headers = {"x-session-id": session} if session else {}
    body = {"model": "sim", "messages": messages, "max_tokens": max_tokens}
    r = client.post(url + "/v1/chat/completions", json=body, headers=headers)
    assert r.status_code == 200, r.text
    return r


def cached(r: httpx.Response) -> int:
    details = r.json()["usage"].get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens") or 0)


@pytest.fixture(scope="module")
def fleet() -> Iterator[str]:
    with (
        sim(3, ["--model", "sim", "--speed", "20", "--seed", "3"]) as urls,
        gateway(urls, ["--policy", "prefix"]) as url,
    ):
        yield url


def test_session_sticks_while_its_cache_holds(fleet: str) -> None:
    rng = random.Random(1)
    msgs: list[dict[str, Any]] = [
        {"role": "system", "content": words(rng, 1200)},
        {"role": "user", "content": words(rng, 50)},
    ]
    replicas, routes = [], []
    with httpx.Client(timeout=30) as client:
        first = chat(client, fleet, msgs, "sticky")
        replicas.append(first.headers["x-gateway-replica"])
        prompt = first.json()["usage"]["prompt_tokens"]
        for _ in range(3):
            msgs += [
                {"role": "assistant", "content": first.json()["choices"][0]["message"]["content"]},
                {"role": "user", "content": words(rng, 60)},
            ]
            first = chat(client, fleet, msgs, "sticky")
            replicas.append(first.headers["x-gateway-replica"])
            routes.append(first.headers["x-gateway-route"])
            # the whole previous prompt (at least) came from the cache
            assert cached(first) >= prompt - 16
            prompt = first.json()["usage"]["prompt_tokens"]
    assert len(set(replicas)) == 1, replicas
    assert routes == ["prefix"] * 3


def test_cold_prompts_spread(fleet: str) -> None:
    rng = random.Random(2)
    seen: Counter[str] = Counter()
    with httpx.Client(timeout=30) as client:
        for i in range(18):
            r = chat(
                client,
                fleet,
                [
                    {"role": "system", "content": f"agent {i} " + words(rng, 40)},
                    {"role": "user", "content": words(rng, 20)},
                ],
            )
            assert r.headers["x-gateway-route"] == "cold"
            seen[r.headers["x-gateway-replica"]] += 1
    assert len(seen) == 3, seen
    assert max(seen.values()) <= 10, seen


def engine_waiting(client: httpx.Client, url: str, replica: str) -> float:
    """What the gateway last scraped of `replica`'s engine queue (its /metrics gauge)."""
    for family in text_string_to_metric_families(client.get(url + "/metrics").text):
        if family.name == "gateway_replica_requests_waiting":
            for sample in family.samples:
                if sample.labels.get("replica") == replica:
                    return sample.value
    return 0.0


def test_session_moves_off_an_overloaded_replica(monkeypatch: pytest.MonkeyPatch) -> None:
    """Waits for what the decision depends on (the gateway's scrape showing the flood
    queued on the session's replica), never for a time: on a loaded machine the flood and
    the scrapes come later, the decision is the same. Then one turn, which must move."""
    monkeypatch.setenv("GATEWAY_USAGE__SCRAPE_INTERVAL_S", "0.2")
    rng = random.Random(3)
    msgs: list[dict[str, Any]] = [
        {"role": "system", "content": words(rng, 600)},
        {"role": "user", "content": words(rng, 40)},
    ]
    stop = threading.Event()
    with (
        sim(2, ["--model", "sim", "--speed", "1", "--seed", "4", "--max-num-seqs", "2"]) as urls,
        gateway(urls, ["--policy", "prefix"]) as url,
        httpx.Client(timeout=60) as client,
    ):
        first = chat(client, url, msgs, "s")
        home = first.headers["x-gateway-replica"]
        home_url = "http://" + home  # --backend replicas are named host:port
        assert home_url in urls
        # Other clients flood the session's replica directly: 2 running, the rest waiting
        # (3000 tokens each at real-time decode: they wait for minutes, past any deadline
        # here).

        def flood(target: str) -> None:
            body = {
                "model": "sim",
                "stream": True,
                "max_tokens": 3000,
                "messages": [{"role": "user", "content": words(random.Random(), 30)}],
            }
            try:
                with (
                    httpx.Client(timeout=120) as c,
                    c.stream("POST", target + "/v1/chat/completions", json=body) as r,
                ):
                    for _ in r.iter_bytes():
                        if stop.is_set():
                            return
            except httpx.HTTPError:
                return

        threads = [threading.Thread(target=flood, args=(home_url,), daemon=True) for _ in range(8)]
        for t in threads:
            t.start()
        try:
            msgs += [
                {"role": "assistant", "content": first.json()["choices"][0]["message"]["content"]},
                {"role": "user", "content": words(rng, 30)},
            ]
            deadline = time.monotonic() + 120  # a bound for a starved machine, not a timing
            while engine_waiting(client, url, home) < 6:
                assert time.monotonic() < deadline, "the gateway never saw the flood queued"
                time.sleep(0.05)
            r = chat(client, url, msgs, "s", max_tokens=4)
            assert r.headers["x-gateway-replica"] != home, \
                "the session stayed on its overloaded replica"
            assert r.headers["x-gateway-route"] == "load"
            metrics = client.get(url + "/metrics").text
            assert 'gateway_route_moves_total{reason="load"} 1.0' in metrics
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=10)
