"""What an operator sees in the logs: the two formats, the access line, the unreachable
replica warning and its backoff, "started" only after the bind, and --version."""

from __future__ import annotations

import dataclasses
import json
import logging
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.bench.flags import base_url
from gateway.logs import JsonFormatter, TextFormatter
from gateway.replicas.monitor import warning_due
from gateway.usage.access import access_fields
from gateway.usage.record import UsageRecord
from tests.servers import free_port, script, sim, stop


def record(name: str = "gateway.x", extra: dict[str, Any] | None = None) -> logging.LogRecord:
    rec = logging.LogRecord(name, logging.INFO, __file__, 1, "hello %s", ("world",), None)
    for k, v in (extra or {}).items():
        setattr(rec, k, v)
    return rec


@pytest.mark.parametrize(("extra", "json_has", "text_has"), [
    ({}, {"msg": "hello world", "level": "info"}, ["INFO", "gateway.x: hello world"]),
    ({"replica": "r1", "n": 3}, {"replica": "r1", "n": 3}, ["replica=r1", "n=3"]),
    ({"why": "two words", "urls": ["a", "b"]}, {"why": "two words"},
     ['why="two words"', 'urls=["a","b"]']),
    ({"color_message": "\x1b[32mhello\x1b[0m"}, {}, []),  # uvicorn's ANSI copy is dropped
    # a client's text without a space (a message's role in a hygiene finding): quoted, its
    # terminal escape escaped
    ({"role": "sys\x1b[2J"}, {"role": "sys\x1b[2J"}, ['role="sys\\u001b[2J"']),
])
def test_both_formats_carry_the_fields(extra: dict[str, Any], json_has: dict[str, Any],
                                       text_has: list[str]) -> None:
    doc = json.loads(JsonFormatter().format(record(extra=extra)))
    assert doc.items() >= json_has.items()
    assert "color_message" not in doc
    text = TextFormatter().format(record(extra=extra))
    assert all(t in text for t in text_has), text
    assert "\x1b" not in text and "\n" not in text


def test_access_fields_come_from_the_usage_record() -> None:
    rec = UsageRecord(ts=1.0, request_id="rid-1", tenant="team-a", model="m", replica="r2",
                      route="prefix", stream=True, status=200, prompt_tokens=1000,
                      cached_tokens=960, predicted_cached_tokens=960, best_available_tokens=960,
                      completion_tokens=20, ttft_ms=41.26, latency_ms=250.04, session=None,
                      endpoint="chat")
    assert access_fields(rec) == {
        "method": "POST", "path": "/v1/chat/completions", "status": 200, "model": "m",
        "replica": "r2", "route": "prefix", "stream": True, "prompt_tokens": 1000,
        "cached_tokens": 960, "predicted_cached_tokens": 960, "ttft_ms": 41.3,
        "latency_ms": 250.0, "request_id": "rid-1", "tenant": "team-a"}
    # a non-streamed answer has no first token apart from its last byte: no TTFT
    assert access_fields(dataclasses.replace(rec, stream=False))["ttft_ms"] is None


@pytest.mark.parametrize(("failures", "due"), [
    (0, False), (1, True), (2, True), (3, False), (4, True), (5, False), (8, True),
    (12, False), (64, True),
])
def test_unreachable_warnings_back_off(failures: int, due: bool) -> None:
    assert warning_due(failures) is due


@pytest.mark.parametrize(("given", "want"), [
    ("http://127.0.0.1:8080", "http://127.0.0.1:8080"),
    ("http://127.0.0.1:8080/", "http://127.0.0.1:8080"),
    ("http://127.0.0.1:8080/v1", "http://127.0.0.1:8080"),
    ("http://127.0.0.1:8080/v1/", "http://127.0.0.1:8080"),
    ("https://gw.example/proxy/v1", "https://gw.example/proxy"),
])
def test_bench_base_url_with_or_without_v1(given: str, want: str) -> None:
    assert base_url(given) == want


@pytest.mark.parametrize("bad", ["127.0.0.1:8080", "ftp://h", "http://h:99999", "http://"])
def test_bench_base_url_refuses_what_is_no_url(bad: str) -> None:
    with pytest.raises(Exception, match=r"URL|port"):
        base_url(bad)


def lines(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def test_unreachable_replica_warns_and_started_follows_the_bind() -> None:
    dead = free_port()  # nothing listens there
    port = free_port()
    proc = subprocess.Popen(
        [*script("gateway"), "serve", "--port", str(port), "--backend",
         f"http://127.0.0.1:{dead}"],
        stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
        env={"PATH": "/usr/bin:/bin", "GATEWAY_SERVER__HEALTH_INTERVAL_S": "0.2"})
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        time.sleep(1.8)  # about 9 probes: warnings at the 1st, 2nd, 4th and 8th
        stats = httpx.get(f"http://127.0.0.1:{port}/stats").json()
    finally:
        stop(proc)
    assert any(f"127.0.0.1:{dead}" in w and "unreachable" in w for w in stats["warnings"])
    assert stats["summary"]["warnings"] == len(stats["warnings"]) >= 1
    assert proc.stderr is not None
    logged = lines(proc.stderr.read())
    warnings = [r for r in logged if r["msg"] == "replica unreachable"]
    assert [w["failed_probes"] for w in warnings][:4] == [1, 2, 4, 8]
    assert all(w["level"] == "warning" and str(dead) in w["url"] and w["reason"]
               for w in warnings)
    started = [r for r in logged if r["msg"] == "gateway started"]
    assert len(started) == 1 and started[0]["listen"] == f"http://127.0.0.1:{port}"


def test_no_started_line_when_the_port_is_taken() -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        done = subprocess.run(
            [*script("gateway"), "serve", "--port", str(port), "--backend",
             "http://127.0.0.1:9"], capture_output=True, text=True, timeout=60, check=False,
            env={"PATH": "/usr/bin:/bin"})
    # one line, as every other start-up error, before logging is even configured
    assert done.returncode == 2, done.stderr
    assert "gateway started" not in done.stderr
    assert done.stderr.count("\n") == 1 and "address already in use" in done.stderr.lower()


def test_an_access_line_per_request_in_text_format(tmp_path: Path) -> None:
    port = free_port()
    with sim(1, ["--model", "sim", "--speed", "50"]) as urls:
        proc = subprocess.Popen(
            [*script("gateway"), "serve", "--port", str(port), "--backend", urls[0],
             "--log-format", "text"], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
            text=True)
        try:
            deadline = time.monotonic() + 20
            while True:
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/ready").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert time.monotonic() < deadline
                time.sleep(0.1)
            r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json={
                "model": "sim", "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 3}, headers={"x-request-id": "req-42"})
            assert r.status_code == 200
            httpx.get(f"http://127.0.0.1:{port}/v1/chat/completions")  # 405, no access line
        finally:
            stop(proc)
    assert proc.stderr is not None
    text = proc.stderr.read()
    access = [line for line in text.splitlines() if " gateway.access: " in line]
    assert len(access) == 1, text
    line = access[0]
    for part in ("POST /v1/chat/completions 200", "replica=127.0.0.1:", "route=cold",
                 "prompt_tokens=", "cached_tokens=", "ttft_ms=", "latency_ms=",
                 "request_id=req-42"):
        assert part in line, line
    assert not text.lstrip().startswith("{")  # text, not JSON


@pytest.mark.parametrize("argv", [
    ["gateway", "--version"], ["gateway", "serve", "--version"], ["gateway", "sim", "--version"],
    ["gateway", "lint", "--version"], ["gateway", "report", "--version"],
    ["gateway-bench", "--version"], ["gateway-bench", "compare", "--version"],
])
def test_version_on_every_command(argv: list[str]) -> None:
    from gateway import __version__

    done = subprocess.run([*script(argv[0]), *argv[1:]], capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0
    assert done.stdout.strip() == f"{argv[0]} {__version__}"
