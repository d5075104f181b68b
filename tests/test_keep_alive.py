"""Idle kept-alive client connections: the gateway keeps one open for `keep_alive_s`
(75 s), longer than the pools of the clients that call it. At uvicorn's own 5 s, the pool
of httpx (under the official openai client, which drops idle connections after 5 s too)
reused connections the gateway was just closing, and a request failed unread."""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Iterator

from tests.servers import free_port, running, script

ENV = {"GATEWAY_USAGE__STARTUP_PROBE": "false"}
HEALTH = b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n"


@contextlib.contextmanager
def gateway(env: dict[str, str]) -> Iterator[int]:
    port, dead = free_port(), free_port()  # nothing listens on `dead`: /health needs none
    argv = [*script("gateway"), "serve", "--host", "127.0.0.1", "--port", str(port),
            "--backend", f"http://127.0.0.1:{dead}"]
    with running(argv, [f"http://127.0.0.1:{port}/health"], env={**ENV, **env}):
        yield port


def answered(s: socket.socket) -> bool:
    """Send /health on `s` and read the whole answer (by its content-length); True when a
    200 came back, False when the server had closed."""
    buf = b""
    try:
        s.sendall(HEALTH)
        while b"\r\n\r\n" not in buf:
            got = s.recv(65536)
            if not got:
                return False
            buf += got
        head, _, body = buf.partition(b"\r\n\r\n")
        length = next(int(line.split(b":")[1]) for line in head.lower().split(b"\r\n")
                      if line.startswith(b"content-length:"))
        while len(body) < length:
            got = s.recv(65536)
            if not got:
                return False
            body += got
        return head.startswith(b"HTTP/1.1 200")
    except (ConnectionResetError, BrokenPipeError):
        return False


def test_an_idle_connection_outlives_the_clients_own_pools() -> None:
    """Idle for 6 s (past httpx's and uvicorn's 5 s), a connection still serves."""
    with gateway({}) as port, socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        assert answered(s)
        time.sleep(6.0)  # the idle time is what is tested
        assert answered(s)


def test_the_idle_bound_is_the_setting() -> None:
    """With keep_alive_s = 1 the gateway closes an idle connection itself (bounded wait
    for its end of stream)."""
    with gateway({"GATEWAY_KEEP_ALIVE_S": "1"}) as port, \
            socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        assert answered(s)
        started = time.monotonic()
        assert s.recv(1) == b""  # blocks until the server closes (timeout 10 s)
        assert time.monotonic() - started < 3.0  # uvicorn's own 5 s is not it
