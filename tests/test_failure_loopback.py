"""Upstream failures on loopback, counting what each backend received per request.

Raw asyncio backends answer the probes (`GET /health`, `/v1/models`, `/metrics`) and fail
each inference `POST` their own way: read it whole then close (`read-close`), reset every new
connection before reading a byte (`reset`), read it and never answer (`hang`), answer 400
or 500, or stream until the test lets go (`hold`, to fill the pool). A replica that refuses
connections is a port nothing listens on, marked healthy by hand (as if its last probe had
passed just before it went away). The gateway app runs under a real uvicorn server with its
real aiohttp upstream, `round_robin` routing (the first request goes to the first replica
configured, ranked before the second).

In every case each backend received the request at most once, and only the "not delivered"
case (refused) went to another replica; no failure marked a replica down. Mutations that
fail here: retrying a 4xx (or any delivered failure) on the next replica; retrying onto a
replica that went down meanwhile (`test_a_retry_never_goes_to_a_replica_down_meanwhile`).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import httpx
import pytest
import uvicorn

from gateway.proxy.app import GatewayApp, create_app
from gateway.routing.config import RoutingConfig
from gateway.settings import ReplicaSettings, ServerSettings, Settings
from gateway.usage.config import UsageConfig
from tests.recording_replica import EVENT, MODELS, SSE_HEAD, chunk, completion, response
from tests.test_fault_hang import InProcessServer, black_hole, free_port

READ_TIMEOUT_S = 0.5
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}


class Backend:
    """One replica: `received` counts the inference requests it read whole."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.received = 0
        self.armed = False  # `reset` spares connections made before (the probes' pool)
        self.release = asyncio.Event()
        self.port = 0
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        assert self._server is not None
        self.release.set()
        self._server.close()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._server.wait_closed(), 2)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.mode == "reset" and self.armed:
            sock = writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.transport.abort()  # RST, nothing read
            return
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for h in head.split(b"\r\n")[1:]:
                    if h.lower().startswith(b"content-length:"):
                        length = int(h.split(b":", 1)[1])
                body = await reader.readexactly(length) if length else b""
                if head.startswith(b"GET /v1/models"):
                    writer.write(response("200 OK", MODELS))
                    continue
                if not head.startswith(b"POST"):
                    writer.write(response("200 OK", b"{}"))
                    continue
                assert body
                self.received += 1
                if not await self._answer(reader, writer):
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """Answer one inference request; False when the connection is to end."""
        mode = self.mode
        if mode in ("ok", "reset"):
            writer.write(response("200 OK", completion("fine")))
        elif mode == "400":
            writer.write(response("400 Bad Request", b'{"error":{"message":"too long"}}'))
        elif mode == "500":
            writer.write(response("500 Internal Server Error", b'{"error":{"message":"boom"}}'))
        elif mode == "read-close":
            return False
        elif mode == "hang":
            await reader.read()  # until the gateway gives up and closes
            return False
        elif mode == "hold":
            writer.write(SSE_HEAD + chunk(EVENT))
            await writer.drain()
            await self.release.wait()
            writer.write(chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
        return True


@dataclass
class Served:
    url: str
    app: GatewayApp

    def mark(self, name: str, ok: bool) -> None:
        """A probe result set by hand (as many as it takes to flip the replica)."""
        assert self.app.services is not None
        fleet = self.app.services.fleet
        for _ in range(fleet.unhealthy_after):
            fleet.probe_result(name, ok, time.time())

    def healthy(self) -> set[str]:
        assert self.app.services is not None
        return {r.name for r in self.app.services.fleet.healthy()}


@contextlib.asynccontextmanager
async def serve(urls: dict[str, str], **server: float) -> AsyncIterator[Served]:
    settings = Settings(
        replicas=tuple(ReplicaSettings(name=n, url=u, models=("m",)) for n, u in urls.items()),
        server=ServerSettings(**{
            "read_timeout_s": READ_TIMEOUT_S, "connect_timeout_s": 0.3,
            "health_timeout_s": 0.3, "health_interval_s": 60, **server}),
        routing=RoutingConfig(policy="round_robin"),
        usage=UsageConfig(startup_probe=False, scrape_interval_s=60))
    app = create_app(settings)
    port = free_port()
    srv = InProcessServer(uvicorn.Config(app, host="127.0.0.1", port=port, loop="none",
                                         lifespan="on", log_config=None, access_log=False))
    task = asyncio.create_task(srv.serve())
    deadline = time.monotonic() + 10
    while not srv.started:
        assert not task.done() and time.monotonic() < deadline, "the server did not start"
        await asyncio.sleep(0.01)
    try:
        yield Served(f"http://127.0.0.1:{port}", app)
    finally:
        srv.should_exit = True
        await asyncio.wait_for(task, 10)


async def until(done: Callable[[], bool], timeout_s: float = 5.0) -> None:
    """Wait (bounded) for `done`: what the test waits on is another task's progress."""
    for _ in range(int(timeout_s / 0.01)):
        if done():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("timed out waiting")


@contextlib.asynccontextmanager
async def backends(*modes: str) -> AsyncIterator[list[Backend]]:
    started = [Backend(m) for m in modes]
    for b in started:
        await b.start()
    try:
        yield started
    finally:
        for b in started:
            await b.stop()


@pytest.mark.parametrize(("mode", "status", "first", "second"), [
    # mode of the first replica, status the client sees, requests each backend received
    ("read-close", 502, 1, 0),  # delivered, no answer: never sent again
    ("reset", 502, 0, 0),  # reset before reading: delivery cannot be ruled out, no retry
    ("hang", 504, 1, 0),
    ("400", 400, 1, 0),  # relayed as is
    ("500", 500, 1, 0),  # relayed as is
])
async def test_a_delivered_failure_reaches_one_engine_once(
    mode: str, status: int, first: int, second: int
) -> None:
    async with backends(mode, "ok") as (bad, good), serve(
        {"bad": f"http://127.0.0.1:{bad.port}", "good": f"http://127.0.0.1:{good.port}"}
    ) as gw, httpx.AsyncClient(timeout=10) as client:
        assert gw.healthy() == {"bad", "good"}
        bad.armed = True
        r = await client.post(gw.url + "/v1/chat/completions", json=CHAT)
        assert r.status_code == status, r.text
        assert (bad.received, good.received) == (first, second)
        assert r.headers["x-gateway-replica"] == "bad" if status < 502 else True
        if status in (400, 500):
            assert b"too long" in r.content or b"boom" in r.content  # the replica's body
        else:
            assert r.json()["error"]["type"] in ("upstream_error", "timeout")
        await asyncio.sleep(0.1)
        assert gw.healthy() == {"bad", "good"}  # one failed request is not a verdict


async def test_not_delivered_goes_to_the_next_replica_once() -> None:
    refused = free_port()  # nothing listens there
    async with backends("ok") as (good,), serve(
        {"gone": f"http://127.0.0.1:{refused}", "good": f"http://127.0.0.1:{good.port}"}
    ) as gw, httpx.AsyncClient(timeout=10) as client:
        gw.mark("gone", True)  # its last probe passed, then it went away
        r = await client.post(gw.url + "/v1/chat/completions", json=CHAT)
        assert r.status_code == 200 and r.headers["x-gateway-replica"] == "good"
        assert good.received == 1
        assert gw.app.services is not None
        assert gw.app.services.router.indexed_blocks("good") > 0  # the move was told
        # its own probes (asked for at once, up to unhealthy_after) take it out
        await until(lambda: "gone" not in gw.healthy())
        assert gw.healthy() == {"good"}


async def test_a_retry_never_goes_to_a_replica_down_meanwhile() -> None:
    async with backends("ok", "ok") as (down, good), _with_hole(down, good) as gw, \
            httpx.AsyncClient(timeout=10) as client:
        gw.mark("hole", True)

        async def goes_down() -> None:  # while the first try waits on its connect
            await asyncio.sleep(0.1)
            gw.mark("down", False)

        flip = asyncio.create_task(goes_down())
        r = await client.post(gw.url + "/v1/chat/completions", json=CHAT)
        await flip
        assert r.status_code == 200 and r.headers["x-gateway-replica"] == "good"
        assert (down.received, good.received) == (0, 1)


@contextlib.asynccontextmanager
async def _with_hole(down: Backend, good: Backend) -> AsyncIterator[Served]:
    with black_hole() as hole:
        async with serve({"hole": f"http://127.0.0.1:{hole}",
                          "down": f"http://127.0.0.1:{down.port}",
                          "good": f"http://127.0.0.1:{good.port}"}, retries=2) as gw:
            yield gw


async def test_a_full_pool_is_a_503_with_retry_after_and_sends_nothing() -> None:
    async with backends("hold", "ok") as (busy, good), serve(
        {"busy": f"http://127.0.0.1:{busy.port}", "good": f"http://127.0.0.1:{good.port}"},
        upstream_connections=1, upstream_pool_wait_s=0.3, read_timeout_s=30,
    ) as gw, httpx.AsyncClient(timeout=10) as client:
        stream = asyncio.create_task(client.post(
            gw.url + "/v1/chat/completions", json={**CHAT, "stream": True}))  # turn 0: busy
        await until(lambda: busy.received == 1)
        r = await client.post(gw.url + "/v1/chat/completions", json=CHAT)  # turn 1: good
        assert r.status_code == 200
        r = await client.post(gw.url + "/v1/chat/completions", json=CHAT)  # turn 2: busy
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "upstream_pool_busy"
        assert (busy.received, good.received) == (1, 1)  # the third went nowhere
        assert gw.healthy() == {"busy", "good"}  # congestion is the gateway's, not the replica's
        busy.release.set()
        assert (await stream).status_code == 200
        metrics = (await client.get(gw.url + "/metrics")).text
        assert 'gateway_upstream_pool_busy_total{replica="busy"} 1.0' in metrics


async def test_a_replica_busier_than_its_pool_stays_healthy_and_keeps_its_index() -> None:
    """Two streams fill the client pool to `hold`; a third waits, then gets the congestion
    answer. Probes, on their own pool, still pass: no "down", nothing forgotten."""
    async with backends("hold") as (busy,), serve(
        {"busy": f"http://127.0.0.1:{busy.port}"},
        upstream_connections=2, upstream_pool_wait_s=0.3, read_timeout_s=30,
    ) as gw, httpx.AsyncClient(timeout=10) as client:
        s = gw.app.services
        assert s is not None
        streams = [asyncio.create_task(client.post(
            gw.url + "/v1/chat/completions", json={**CHAT, "stream": True})) for _ in range(2)]
        await until(lambda: busy.received == 2)
        held = s.router.indexed_blocks("busy")
        assert held > 0
        r = await client.post(gw.url + "/v1/chat/completions", json=CHAT)
        assert r.status_code == 503 and r.json()["error"]["code"] == "upstream_pool_busy"
        for _ in range(s.fleet.unhealthy_after + 1):
            await s.monitor.probe_all()
        ready = (await client.get(gw.url + "/ready")).json()
        assert ready == {"ready": True, "healthy": ["busy"]}
        assert s.router.indexed_blocks("busy") == held
        busy.release.set()
        assert [(await t).status_code for t in streams] == [200, 200]
        assert busy.received == 2  # the congested request never reached it
