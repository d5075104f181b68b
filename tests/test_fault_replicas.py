"""Replicas that die or come back empty, on loopback: `gateway serve` in front of separate
`gateway sim` processes, one of which the test kills (SIGKILL, as an OOM kill or a lost
node would) or restarts.

- Killed mid-stream: the client's stream ends with an OpenAI error event and `[DONE]` (a
  well-formed end, not a cut connection), the replica is marked down within one health
  interval, and every new request, even those sent before the health check noticed, is
  answered by the survivor without an error (a refused connection is retried elsewhere).
- Restarted with an empty cache: the gateway still believes the replica holds the
  conversation's prefix; within a few requests its predictions fall to what the replica
  delivers (the scraped counters went backwards, the delivered cache fell short)."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson

from tests.servers import free_port, running, script

MODEL = "Qwen/Qwen2.5-7B-Instruct"
HEALTH_INTERVAL_S = 0.5
HEALTH_TIMEOUT_S = 0.5
ENV = {"GATEWAY_HEALTH_INTERVAL_S": str(HEALTH_INTERVAL_S),
       "GATEWAY_HEALTH_TIMEOUT_S": str(HEALTH_TIMEOUT_S),
       "GATEWAY_USAGE__SCRAPE_INTERVAL_S": "0.2", "GATEWAY_USAGE__STARTUP_PROBE": "false"}


@contextlib.contextmanager
def one_sim(port: int, speed: str) -> Iterator[subprocess.Popen[bytes]]:
    argv = [*script("gateway"), "sim", "--replicas", "1", "--port", str(port),
            "--speed", speed]
    with running(argv, [f"http://127.0.0.1:{port}/health"]) as proc:
        yield proc


@contextlib.contextmanager
def gateway(backends: list[str], env: dict[str, str]) -> Iterator[str]:
    port = free_port()
    argv = [*script("gateway"), "serve", "--host", "127.0.0.1", "--port", str(port)]
    for b in backends:
        argv += ["--backend", b]
    url = f"http://127.0.0.1:{port}"
    with running(argv, [url + "/ready"], env={**ENV, **env}):
        yield url


def healthy(url: str) -> list[str]:
    return sorted(httpx.get(url + "/ready", timeout=5).json()["healthy"])


def chat(prompt: str, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": 4, **extra}


def test_a_replica_killed_mid_stream() -> None:
    ports = [free_port(), free_port()]
    names = [f"127.0.0.1:{p}" for p in ports]
    # 0.5x real time: a 2000-token stream lasts about 30 s, far longer than the test
    with one_sim(ports[0], "0.5") as sim_a, one_sim(ports[1], "0.5") as sim_b, gateway(
        [f"http://{n}" for n in names], {}
    ) as url, httpx.Client(timeout=30) as client:
        procs = dict(zip(names, (sim_a, sim_b), strict=True))
        with client.stream("POST", url + "/v1/chat/completions",
                           json=chat("a long story", max_tokens=2000, stream=True)) as r:
            assert r.status_code == 200
            victim = r.headers["x-gateway-replica"]
            survivor = next(n for n in names if n != victim)
            lines = r.iter_lines()
            events = [next(lines) for _ in range(3)]  # the stream is flowing
            procs[victim].send_signal(signal.SIGKILL)
            killed = time.monotonic()
            events += [line for line in lines if line]
        assert events[-1] == "data: [DONE]"
        error = orjson.loads(events[-2].removeprefix("data: "))["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["type"] == "upstream_error" and victim in error["message"]

        # new requests at once, before any health check ran: retried on the survivor. Once
        # the victim is reaped its sockets are closed (refused, or seen closed in the pool);
        # before that a request written to a socket the dying process still held would be
        # "delivered, no answer", a 502 that is never sent again (gateway.upstream.failure).
        procs[victim].wait(timeout=10)
        for i in range(4):
            r2 = client.post(url + "/v1/chat/completions", json=chat(f"right after {i}"))
            assert r2.status_code == 200, r2.text
            assert r2.headers["x-gateway-replica"] == survivor

        deadline = killed + HEALTH_INTERVAL_S + HEALTH_TIMEOUT_S + 1.0
        while victim in healthy(url) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert healthy(url) == [survivor], "not marked down within a health interval"
        print(f"\nkilled mid-stream: marked down {time.monotonic() - killed:.2f} s after the "
              "kill (4 requests retried on the survivor meanwhile)")
        for i in range(4):
            r3 = client.post(url + "/v1/chat/completions",
                             json=chat(f"later {i}", stream=i % 2 == 0))
            assert r3.status_code == 200 and r3.headers["x-gateway-replica"] == survivor
            assert b'"error"' not in r3.content


def records(path: Path, count: int, timeout: float = 10.0) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    found: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        if path.exists():
            found = [orjson.loads(line) for line in path.read_bytes().splitlines() if line]
            if len(found) >= count:
                return found
        time.sleep(0.05)
    raise AssertionError(f"{len(found)} usage records after {timeout}s, expected {count}")


def test_a_replica_restarted_with_an_empty_cache(tmp_path: Path) -> None:
    """Six documents are warmed on the replica; it restarts; then one new question about
    each. Each question repeats its document, so a gateway that kept its belief would
    promise the whole document every time and get nothing."""
    log = tmp_path / "usage.jsonl"
    port = free_port()
    documents = [f"Document {d}: " + f"clause {d} of the contract applies. " * 60
                 for d in range(6)]

    def ask(client: httpx.Client, d: int, question: str) -> None:
        r = client.post(url + "/v1/chat/completions", json={
            "model": MODEL, "max_tokens": 4, "messages": [
                {"role": "system", "content": documents[d]},
                {"role": "user", "content": question}]})
        assert r.status_code == 200, r.text

    with one_sim(port, "100") as first, gateway(
        [f"http://127.0.0.1:{port}"], {"GATEWAY_USAGE__LOG_PATH": str(log)}
    ) as url, httpx.Client(timeout=30) as client:
        for d in range(6):
            ask(client, d, "Summarise it.")
            ask(client, d, "Who signs it?")
        warm = records(log, 12)
        # warm: the gateway predicted each document and the replica delivered it
        assert all(r["predicted_cached_tokens"] == r["cached_tokens"] > 300
                   for r in warm[1::2]), warm

        first.send_signal(signal.SIGKILL)
        first.wait(10)
        with one_sim(port, "100"):
            deadline = time.monotonic() + 10
            while not healthy(url) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert healthy(url)
            for d in range(6):
                ask(client, d, "When does it end?")
            after = records(log, 18)[12:]
    # Every question met an empty cache. At most the first two were promised their
    # document (none when a scrape saw the counters go back before the first one); from
    # then on the gateway promises no more than the template's head the documents share
    # (two blocks: text mode estimates where token blocks end).
    seen = [(r["predicted_cached_tokens"], r["cached_tokens"]) for r in after]
    assert all(cached == 0 for _, cached in seen), seen
    assert all(predicted <= 32 for predicted, _ in seen[2:]), seen
