"""Loopback: `gateway serve` in front of `gateway sim`. A session whose system prompt carries
the time to the second gets a hygiene warning naming message 0 and the offset (header
`x-gateway-hygiene`, enabled by env), and its usage records show the cache loss that
follows, next to the same session without the timestamp."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from tests.servers import free_port, running, script, sim

MODEL = "m"
RULES = " ".join(
    f"Rule {i}: answer the customer politely, cite the article, keep answers short and precise."
    for i in range(40)
)


@contextlib.contextmanager
def gateway_with(backends: list[str], env: dict[str, str]) -> Iterator[str]:
    port = free_port()
    argv = [*script("gateway"), "serve", "--host", "127.0.0.1", "--port", str(port)]
    for b in backends:
        argv += ["--backend", b]
    url = f"http://127.0.0.1:{port}"
    with running(argv, [url + "/ready"], env=env):
        yield url


def converse(client: httpx.Client, url: str, session: str, clock: bool) -> list[str | None]:
    """Four turns of one session; returns the x-gateway-hygiene header of each answer."""
    msgs: list[dict[str, Any]] = []
    headers_seen: list[str | None] = []
    for turn in range(4):
        system = RULES
        if clock:
            system = f"Current time: 14:03:{10 + 7 * turn:02d}. " + RULES
        history = [{"role": "system", "content": system}, *msgs]
        history.append({"role": "user", "content": f"Question {turn}: where is my parcel?"})
        r = client.post(
            url + "/v1/chat/completions",
            json={"model": MODEL, "messages": history, "max_tokens": 8},
            headers={"x-session-id": session},
        )
        assert r.status_code == 200, r.text
        headers_seen.append(r.headers.get("x-gateway-hygiene"))
        answer = r.json()["choices"][0]["message"]["content"]
        msgs = [*history[1:], {"role": "assistant", "content": answer}]
    return headers_seen


def read_records(path: Path, want: int, timeout: float = 10.0) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            lines = [x for x in path.read_text().splitlines() if x.strip()]
            if len(lines) >= want:
                return [json.loads(x) for x in lines]
        time.sleep(0.05)
    raise AssertionError(f"usage log {path} has fewer than {want} records after {timeout}s")


def test_timestamp_in_system_prompt_is_named_and_costs_the_cache(tmp_path: Path) -> None:
    log = tmp_path / "usage.jsonl"
    env = {"GATEWAY_USAGE__LOG_PATH": str(log), "GATEWAY_HYGIENE__HEADER": "true"}
    with (
        sim(1, ["--model", MODEL, "--speed", "1000"]) as urls,
        gateway_with(urls, env) as url,
        httpx.Client(timeout=30) as client,
    ):
        stamped = converse(client, url, "with-clock", clock=True)
        clean = converse(client, url, "no-clock", clock=False)
        records = read_records(log, 8)

    # every request after the first sees the clock move in message 0 at offset 14
    assert stamped[0] == "timestamp@0:14"  # pattern evidence: a clock time to the second
    assert all(h is not None and h.startswith("timestamp@0:14") for h in stamped[1:]), stamped
    assert clean == [None] * 4

    by_session: dict[str, list[dict[str, Any]]] = {}
    for rec in records:
        by_session.setdefault(rec["session"], []).append(rec)
    with_clock, without = by_session["with-clock"], by_session["no-clock"]
    assert [r["hygiene"] > 0 for r in with_clock] == [True] * 4
    assert [r["hygiene"] for r in without] == [0] * 4
    # later turns: the clean session reuses almost its whole prompt, the stamped one nothing
    # past the few tokens in front of the clock
    for a, b in zip(with_clock[1:], without[1:], strict=True):
        assert a["cached_tokens"] is not None and b["cached_tokens"] is not None
        assert a["cached_tokens"] <= 16, a
        assert b["cached_tokens"] >= 0.8 * b["prompt_tokens"], b
