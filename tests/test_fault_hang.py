"""Replicas that hang, on loopback, with the gateway app under a real uvicorn server and its
real aiohttp upstream in the test's own event loop, so the test can count the loop's tasks.

A raw asyncio replica answers health and models, and each inference call by the mode named
in its first message: `ok`, `silent` (reads the request, never answers), `stall-stream`
(an SSE head and one event, then silence), `stall-body` (a JSON head and a few bytes of a
longer body, then silence), `cut-body` (the same, then the close), `garbage-head` (a
status line and header no HTTP parser accepts). A second replica is a black hole: a
listening socket whose accept queue is full, so a TCP connect to it never completes.

Each timeout fires (the first-byte and idle ones as `read_timeout_s`, the connect one as
`connect_timeout_s`) and ends as OpenAI's 504 (before the head) or an error event and
`[DONE]` (after it); the replica's connections are closed; no task outlives its request;
the in-flight gauges go back to zero. A cut or garbled answer is a 502, the pool still
usable after it."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import orjson
import pytest
import uvicorn

from gateway.proxy.app import GatewayApp, create_app
from gateway.settings import ReplicaSettings, ServerSettings, Settings
from gateway.usage.config import UsageConfig
from tests.recording_replica import EVENT, SSE_HEAD, chunk, completion, response

READ_TIMEOUT_S = 0.5
# the gateway, the replicas and the clients share one loop here: 30 connects at once to
# the hanging replica on a loaded 2-core machine once took longer than 0.3 s (a 502
# connect timeout where the test waits for 200 and 504), so 1 s: still well under the
# read timeouts that matter to a client, and what the black hole's probe waits at start
CONNECT_TIMEOUT_S = 1.0


class HangingReplica:
    def __init__(self) -> None:
        self.open = 0  # inference connections the replica holds open now
        self.port = 0
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        counted = False
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                path = head.split(b" ")[1]
                length = 0
                for h in head.split(b"\r\n")[1:]:
                    if h.lower().startswith(b"content-length:"):
                        length = int(h.split(b":", 1)[1])
                body = await reader.readexactly(length) if length else b""
                if path == b"/v1/models":
                    writer.write(response("200 OK", b'{"object":"list","data":[{"id":"m"}]}'))
                    continue
                if not body:  # /health, /metrics
                    writer.write(response("200 OK", b"{}"))
                    continue
                mode = orjson.loads(body)["messages"][0]["content"]
                if mode == "ok":
                    writer.write(response("200 OK", completion("fine")))
                    continue
                if mode == "cut-body":  # a shorter body than announced, then the close
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                                 b"content-length: 1000\r\n\r\n{\"id\":")
                    await writer.drain()
                    return
                if mode == "garbage-head":
                    writer.write(b"HTTP/1.1 2OO OK\r\n\x00\x01\r\n\r\n")
                    await writer.drain()
                    return
                counted = True
                self.open += 1
                if mode == "stall-stream":
                    writer.write(SSE_HEAD + chunk(EVENT))
                elif mode == "stall-body":
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                                 b"content-length: 1000\r\n\r\n{\"id\":")
                # then nothing more: wait until the gateway gives up and closes
                await reader.read()
                return
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            if counted:
                self.open -= 1
            writer.close()


@contextlib.contextmanager
def black_hole() -> Iterator[int]:
    """A port whose accept queue is full: connects to it time out (nothing answers the SYN)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = int(listener.getsockname()[1])
    fillers = []
    for _ in range(4):
        s = socket.socket()
        s.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            s.connect(("127.0.0.1", port))
        fillers.append(s)
    try:
        yield port
    finally:
        for s in fillers:
            s.close()
        listener.close()


class InProcessServer(uvicorn.Server):
    """uvicorn without its signal handlers (the test process keeps its own)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
async def served() -> AsyncIterator[tuple[str, HangingReplica, GatewayApp]]:
    replica = HangingReplica()
    await replica.start()
    with black_hole() as hole:
        settings = Settings(
            replicas=(
                ReplicaSettings(name="hang", url=f"http://127.0.0.1:{replica.port}",
                                models=("m",)),
                ReplicaSettings(name="hole", url=f"http://127.0.0.1:{hole}", models=("m",)),
            ),
            server=ServerSettings(read_timeout_s=READ_TIMEOUT_S,
                                  connect_timeout_s=CONNECT_TIMEOUT_S,
                                  health_timeout_s=CONNECT_TIMEOUT_S, health_interval_s=60,
                                  retries=0),
            usage=UsageConfig(startup_probe=False, scrape_interval_s=60))
        app = create_app(settings)
        port = free_port()
        server = InProcessServer(uvicorn.Config(
            app, host="127.0.0.1", port=port, loop="none", lifespan="on", log_config=None,
            access_log=False))
        started = time.monotonic()
        task = asyncio.create_task(server.serve())
        while not server.started:
            assert not task.done(), "the server did not start"
            await asyncio.sleep(0.01)
        # the black hole's probe timed out at the connect timeout: start-up was not held
        assert time.monotonic() - started < CONNECT_TIMEOUT_S + 3
        try:
            yield f"http://127.0.0.1:{port}", replica, app
        finally:
            server.should_exit = True
            await asyncio.wait_for(task, 10)
            await replica.stop()


def chat(mode: str, **extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": mode}], **extra}


async def settle(baseline: set[asyncio.Task[Any]], replica: HangingReplica) -> None:
    """Wait (bounded) until only the baseline tasks are left and the replica holds no
    inference connection; fail naming what is left."""
    deadline = time.monotonic() + 5
    current = asyncio.current_task()
    while time.monotonic() < deadline:
        extra = {t for t in asyncio.all_tasks() if t is not current} - baseline
        if not extra and replica.open == 0:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"left behind: {sorted(map(repr, extra))[:5]}, "
                         f"{replica.open} replica connections open")


@pytest.mark.parametrize(("mode", "stream"), [
    ("silent", False), ("silent", True), ("stall-body", False),
])
async def test_no_first_byte_is_a_504(
    served: tuple[str, HangingReplica, GatewayApp], mode: str, stream: bool
) -> None:
    url, replica, app = served
    baseline = set(asyncio.all_tasks())
    async with httpx.AsyncClient(timeout=10) as client:
        started = time.monotonic()
        r = await client.post(url + "/v1/chat/completions", json=chat(mode, stream=stream))
        took = time.monotonic() - started
        assert r.status_code == 504
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["code"] == "upstream_timeout" and "hang" in error["message"]
        assert READ_TIMEOUT_S <= took < READ_TIMEOUT_S + 3
        ok = await client.post(url + "/v1/chat/completions", json=chat("ok"))
        assert ok.status_code == 200 and ok.headers["x-gateway-replica"] == "hang"
    await settle(baseline, replica)
    assert app.services is not None
    assert all(r.in_flight == 0 for r in app.services.fleet.replicas.values())


@pytest.mark.parametrize("mode", ["cut-body", "garbage-head"])
async def test_a_cut_or_garbled_answer_is_a_502(
    served: tuple[str, HangingReplica, GatewayApp], mode: str
) -> None:
    url, replica, app = served
    baseline = set(asyncio.all_tasks())
    async with httpx.AsyncClient(timeout=10) as client:
        r = await client.post(url + "/v1/chat/completions", json=chat(mode))
        assert r.status_code == 502
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["type"] == "upstream_error" and "hang" in error["message"]
        ok = await client.post(url + "/v1/chat/completions", json=chat("ok"))
        assert ok.status_code == 200  # the pool was not poisoned
    await settle(baseline, replica)
    assert app.services is not None
    assert all(r.in_flight == 0 for r in app.services.fleet.replicas.values())


async def test_a_stream_that_goes_silent_ends_with_an_error_event(
    served: tuple[str, HangingReplica, GatewayApp]
) -> None:
    url, replica, app = served
    baseline = set(asyncio.all_tasks())
    async with httpx.AsyncClient(timeout=10) as client:
        started = time.monotonic()
        r = await client.post(url + "/v1/chat/completions",
                              json=chat("stall-stream", stream=True))
        took = time.monotonic() - started
    assert r.status_code == 200
    events = [e for e in r.text.split("\n\n") if e]
    assert events[0] == EVENT.decode().strip()
    assert events[-1] == "data: [DONE]"
    error = orjson.loads(events[-2].removeprefix("data: "))["error"]
    assert error["code"] == "upstream_timeout"
    assert READ_TIMEOUT_S <= took < READ_TIMEOUT_S + 3
    await settle(baseline, replica)
    assert app.services is not None
    assert all(r.in_flight == 0 for r in app.services.fleet.replicas.values())


async def test_a_replica_that_never_accepts_is_marked_down_at_the_connect_timeout(
    served: tuple[str, HangingReplica, GatewayApp]
) -> None:
    url, _, _ = served
    async with httpx.AsyncClient(timeout=10) as client:
        ready = (await client.get(url + "/ready")).json()
        assert ready["healthy"] == ["hang"]
        for _ in range(3):
            r = await client.post(url + "/v1/chat/completions", json=chat("ok"))
            assert r.status_code == 200 and r.headers["x-gateway-replica"] == "hang"


async def test_many_hanging_requests_at_once_leave_nothing_behind(
    served: tuple[str, HangingReplica, GatewayApp]
) -> None:
    url, replica, _ = served
    baseline = set(asyncio.all_tasks())
    async with httpx.AsyncClient(timeout=10) as client:
        modes = ["silent", "stall-stream", "stall-body"] * 10
        answers = await asyncio.gather(*(
            client.post(url + "/v1/chat/completions", json=chat(m, stream=m == "stall-stream"))
            for m in modes))
    # the bodies name the failure class when this fails (a 502 is a refused or reset
    # connection, a 504 a timeout)
    assert sorted({a.status_code for a in answers}) == [200, 504], sorted(
        {a.text[:300] for a in answers if a.status_code not in (200, 504)})[:3]
    await settle(baseline, replica)
