"""A client that reads slowly, on loopback: `gateway serve` between a raw socket that stops
reading and a replica that streams SSE events as fast as its socket takes them.

Backpressure must reach the replica: the gateway waits for the client's socket before it
reads more from the replica (uvicorn's flow control, aiohttp's bounded stream reader), so
the replica's writes stall once the buffers between them are full, and the gateway's
memory stays flat however long the client dawdles. When the client finally goes, the
replica's connection is closed (the engine would abort and free its KV blocks)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import orjson
import pytest

from tests.recording_replica import SSE_HEAD, chunk, response
from tests.servers import free_port, running, script

EVENT = b"data: " + orjson.dumps({"id": "c", "object": "chat.completion.chunk", "choices": [
    {"index": 0, "delta": {"content": "x" * 4000}}]}) + b"\n\n"
CAP = 1 << 30  # the firehose stops after 1 GiB whatever happens


class Firehose:
    """A replica whose every inference answer is an endless fast stream; counts the bytes
    its socket accepted and notices when the gateway closes the connection."""

    def __init__(self) -> None:
        self.port = 0
        self.sent = 0
        self.streams = 0
        self.closed = threading.Event()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for h in head.split(b"\r\n")[1:]:
                    if h.lower().startswith(b"content-length:"):
                        length = int(h.split(b":", 1)[1])
                if length:
                    await reader.readexactly(length)
                if not head.startswith(b"POST"):
                    writer.write(response("200 OK", b'{"object":"list","data":[{"id":"m"}]}'))
                    continue
                self.streams += 1
                writer.write(SSE_HEAD)
                piece = chunk(EVENT)
                while self.sent < CAP:
                    writer.write(piece)
                    await writer.drain()  # blocks while the gateway does not read
                    self.sent += len(piece)
                return
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            if self.streams:
                self.closed.set()
            writer.close()

    @contextlib.contextmanager
    def serving(self) -> Iterator[Firehose]:
        loop = asyncio.new_event_loop()
        ready = threading.Event()
        stop: asyncio.Future[None] | None = None

        async def main() -> None:
            nonlocal stop
            server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
            self.port = server.sockets[0].getsockname()[1]
            stop = loop.create_future()
            ready.set()
            async with server:
                await stop

        thread = threading.Thread(target=loop.run_until_complete, args=(main(),), daemon=True)
        thread.start()
        assert ready.wait(5)
        try:
            yield self
        finally:
            assert stop is not None
            loop.call_soon_threadsafe(stop.set_result, None)
            thread.join(10)


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


@pytest.fixture
def setup() -> Iterator[tuple[int, Firehose, int]]:
    with Firehose().serving() as hose:
        port = free_port()
        argv = [*script("gateway"), "serve", "--host", "127.0.0.1", "--port", str(port),
                "--backend", f"http://127.0.0.1:{hose.port}"]
        env = {"GATEWAY_USAGE__STARTUP_PROBE": "false", "GATEWAY_HEALTH_INTERVAL_S": "1"}
        with running(argv, [f"http://127.0.0.1:{port}/ready"], env=env) as proc:
            yield port, hose, proc.pid


def request() -> bytes:
    body = orjson.dumps({"model": "m", "stream": True,
                         "messages": [{"role": "user", "content": "firehose"}]})
    return (b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: "
            b"application/json\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n"
            + body)


def test_a_client_that_stops_reading_stalls_the_replica_not_the_gateway(
    setup: tuple[int, Firehose, int]
) -> None:
    port, hose, pid = setup
    rss_before = rss_mib(pid)
    with socket.socket() as client:
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        client.settimeout(10)
        client.connect(("127.0.0.1", port))
        client.sendall(request())
        assert client.recv(4096).startswith(b"HTTP/1.1 200")
        # stop reading: within a second the replica is stalled, and stays stalled
        time.sleep(1.5)
        stalled_at = hose.sent
        time.sleep(2.0)
        grew = hose.sent - stalled_at
        grown_mib = rss_mib(pid) - rss_before
        # the figures in bench/RESULTS.md (pytest -s shows them)
        print(f"\nslow client: replica stalled after {stalled_at / 2**20:.1f} MiB, "
              f"{grew} bytes more in 2 s, gateway RSS +{grown_mib:.1f} MiB")
        assert hose.sent < 32 << 20, f"{hose.sent >> 20} MiB left the replica"
        assert grew < 1 << 20, f"the replica kept writing: {grew} bytes in 2 s"
        assert grown_mib < 32
        # a slow read lets it go on: reading on (4 MiB at least, more while the replica
        # has sent nothing new: the ~9 MiB of socket buffers in between drain first, and
        # how much of them 4 MiB frees depends on the kernel's autotuning), bounded
        got = 0
        deadline = time.monotonic() + 10
        while ((got < 4 << 20 or hose.sent <= stalled_at) and got < 64 << 20
               and time.monotonic() < deadline):
            got += len(client.recv(65536))
        assert got >= 4 << 20
        assert hose.sent > stalled_at, f"read {got} bytes; the replica sent nothing more"
    # the client went: the replica's connection is closed at once
    assert hose.closed.wait(5)
    assert hose.sent < CAP
