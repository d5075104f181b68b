"""The admission queue on a real gateway server on loopback, in front of a backend that
holds requests until the test lets them go: a queued client that disconnects leaves the
queue at once and never reaches the backend; shed requests get 429 in OpenAI's shape with
Retry-After, counted by reason; a waiter goes when its replica frees room; the class
reaches a replica configured for vLLM's priority scheduling as `priority`."""

from __future__ import annotations

import asyncio
import contextlib
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import orjson
from aiohttp import web

from tests.servers import free_port, gateway

MODEL = "m"
FAST = {"GATEWAY_HEALTH_INTERVAL_S": "0.2", "GATEWAY_HEALTH_TIMEOUT_S": "0.5",
        "GATEWAY_USAGE__SCRAPE_INTERVAL_S": "0.2"}


class HoldingBackend:
    """An OpenAI-shaped backend: answers at once, except requests whose first message says
    `hold`, which wait until `release()`. Records every inference body it receives."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.bodies: list[dict[str, Any]] = []
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._runner: web.AppRunner | None = None
        self._gate: asyncio.Event | None = None

    def labels(self) -> list[str]:
        return [b["messages"][0]["content"] for b in list(self.bodies)]

    def release(self) -> None:
        assert self._gate is not None
        self._loop.call_soon_threadsafe(self._gate.set)

    async def _infer(self, request: web.Request) -> web.Response:
        body = orjson.loads(await request.read())
        self.bodies.append(body)
        if body["messages"][0]["content"].startswith("hold"):
            assert self._gate is not None
            await asyncio.wait_for(self._gate.wait(), 30)
        return web.json_response({
            "id": "c", "object": "chat.completion", "model": MODEL,
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": "ok"}}],
            "usage": {"prompt_tokens": 8, "completion_tokens": 1, "total_tokens": 9,
                      "prompt_tokens_details": {"cached_tokens": 0}}})

    async def _start(self) -> None:
        self._gate = asyncio.Event()

        async def ok(request: web.Request) -> web.Response:
            return web.Response()

        async def models(request: web.Request) -> web.Response:
            return web.json_response({"object": "list", "data": [{"id": MODEL}]})

        app = web.Application()
        app.router.add_get("/health", ok)
        app.router.add_get("/metrics", ok)
        app.router.add_get("/v1/models", models)
        app.router.add_post("/v1/chat/completions", self._infer)
        self._runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=0.2)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    def __enter__(self) -> HoldingBackend:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
        assert self._runner is not None
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


@contextlib.contextmanager
def admission_gateway(backend: HoldingBackend, **env: str) -> Iterator[str]:
    conf = {**FAST, "GATEWAY_ADMISSION__ENABLED": "true",
            "GATEWAY_ADMISSION__REPLICA_MAX_IN_FLIGHT": "1", **env}
    with gateway([backend.url], env=conf) as url:
        yield url


def chat(text: str) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 1}


def raw_request(url: str, text: str, headers: dict[str, str] | None = None) -> socket.socket:
    """Send one chat request on a raw socket and leave it open (no answer read)."""
    port = int(url.rsplit(":", 1)[1])
    body = orjson.dumps(chat(text))
    extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall((f"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
                  f"content-type: application/json\r\ncontent-length: {len(body)}\r\n"
                  f"{extra}\r\n").encode() + body)
    return sock


def admission(url: str) -> dict[str, Any]:
    stats: dict[str, Any] = httpx.get(url + "/stats", timeout=5).json()["admission"]
    return stats


def until(check: Callable[[], bool], timeout: float = 10.0) -> float:
    """Poll `check` until true (bounded); the seconds it took."""
    start = time.monotonic()
    while not check():
        assert time.monotonic() - start < timeout, "condition not met in time"
        time.sleep(0.01)
    return time.monotonic() - start


def metric(url: str, name: str, labels: str) -> float:
    text = httpx.get(url + "/metrics", timeout=5).text
    m = re.search(rf"^{re.escape(name)}\{{{re.escape(labels)}\}} ([0-9.e+]+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def test_queued_client_that_disconnects_leaves_the_queue_at_once() -> None:
    with HoldingBackend() as backend, admission_gateway(backend) as url:
        holder = raw_request(url, "hold the replica")
        until(lambda: backend.labels() == ["hold the replica"])
        waiter = raw_request(url, "queued then gone")
        until(lambda: admission(url)["queued"]["normal"] == 1)
        waiter.close()
        took = until(lambda: admission(url)["queued"]["normal"] == 0)
        assert took < 2.0  # far below normal's 30 s wait limit: it left at once
        assert metric(url, "gateway_admission_abandoned_total", 'class="normal"') == 1.0
        backend.release()
        holder.recv(1)  # the held request's answer starts
        holder.close()
        # the room it freed is not given to the departed client: the backend saw one call
        with httpx.Client(timeout=10) as c:
            assert c.post(url + "/v1/chat/completions", json=chat("after")).status_code == 200
        assert backend.labels() == ["hold the replica", "after"]


def test_shed_requests_get_429_with_retry_after_counted_by_reason() -> None:
    with HoldingBackend() as backend, admission_gateway(
            backend, GATEWAY_ADMISSION__MAX_QUEUE="1",
            GATEWAY_ADMISSION__NORMAL_MAX_WAIT_S="20") as url, \
            httpx.Client(timeout=30) as c:
        holder = raw_request(url, "hold the replica")
        until(lambda: len(backend.labels()) == 1)
        waiter = raw_request(url, "queued")
        until(lambda: admission(url)["queued"]["normal"] == 1)
        r = c.post(url + "/v1/chat/completions", json=chat("one too many"))
        assert r.status_code == 429
        assert r.headers["retry-after"].isdigit() and 1 <= int(r.headers["retry-after"]) <= 20
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert (err["type"], err["code"]) == ("rate_limit_exceeded", "overloaded_queue_full")
        bad = c.post(url + "/v1/chat/completions", json=chat("x"),
                     headers={"x-gateway-priority": "urgent"})
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_priority"
        stats = admission(url)
        assert stats["enabled"] is True
        assert stats["shed"]["queue_full"] == 1
        assert metric(url, "gateway_admission_shed_total", 'reason="queue_full"') == 1.0
        # nothing shed reached the backend; the waiter goes when the holder finishes
        assert backend.labels() == ["hold the replica"]
        backend.release()
        for sock in (holder, waiter):
            assert sock.recv(12).startswith(b"HTTP/1.1 200")
            sock.close()
        assert backend.labels() == ["hold the replica", "queued"]
        stats = admission(url)
        assert stats["queued"] == {"high": 0, "normal": 0, "low": 0}
        assert stats["wait_ms"]["normal"]["p99"] > 0
        assert stats["admitted_tokens"]["none"] > 0


def test_a_waiter_past_its_class_limit_is_shed_and_counted() -> None:
    with HoldingBackend() as backend, admission_gateway(
            backend, GATEWAY_ADMISSION__NORMAL_MAX_WAIT_S="0.5") as url, \
            httpx.Client(timeout=30) as c:
        holder = raw_request(url, "hold the replica")
        until(lambda: len(backend.labels()) == 1)
        r = c.post(url + "/v1/chat/completions", json=chat("waits too long"))
        assert r.status_code == 429
        assert r.json()["error"]["code"] == "overloaded_wait_timeout"
        assert r.headers["retry-after"] == "1"
        assert admission(url)["shed"]["wait_timeout"] == 1
        assert backend.labels() == ["hold the replica"]
        backend.release()
        holder.close()


def test_priority_reaches_a_replica_with_priority_scheduling() -> None:
    with HoldingBackend() as backend, gateway([backend.url], env={
            **FAST, "GATEWAY_ADMISSION__ENABLED": "1",
            "GATEWAY_ADMISSION__DEFAULT_PRIORITY_CAP": "high",
            "GATEWAY_ADMISSION__PRIORITY_REPLICAS": f"127.0.0.1:{backend.port}"}) as url, \
            httpx.Client(timeout=10) as c:
        for cls in ("high", "normal", "low"):
            r = c.post(url + "/v1/chat/completions", json=chat(cls),
                       headers={"x-gateway-priority": cls})
            assert r.status_code == 200
        assert [b.get("priority") for b in backend.bodies] == [-1, None, 1]


def test_admission_off_is_todays_path() -> None:
    with HoldingBackend() as backend, gateway([backend.url], env={
            **FAST, "GATEWAY_ADMISSION__ENABLED": "false",
            "GATEWAY_ADMISSION__REPLICA_MAX_IN_FLIGHT": "1"}) as url, \
            httpx.Client(timeout=10) as c:
        holder = raw_request(url, "hold the replica")
        until(lambda: len(backend.labels()) == 1)
        # off: no queue; the request goes to the busy replica at once, priority ignored
        r = c.post(url + "/v1/chat/completions", json=chat("not queued"),
                   headers={"x-gateway-priority": "high"})
        assert r.status_code == 200
        assert backend.labels() == ["hold the replica", "not queued"]
        assert "priority" not in backend.bodies[1]
        assert admission(url)["enabled"] is False
        backend.release()
        holder.close()
