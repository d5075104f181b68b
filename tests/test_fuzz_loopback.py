"""The gateway's HTTP surface against hostile bytes, on loopback: a real `gateway serve`
in front of a raw replica that records every byte it receives (tests/recording_replica.py),
driven with raw sockets so nothing between the test and the gateway cleans the request up.

Every case gets, within a few seconds, either an answer (2xx) or a 4xx in OpenAI's shape,
or a clean close (a connection that never sent a full head); never a 5xx, never a hang.
Covered: header abuse (huge, many, duplicate, folded, control bytes, non-ASCII), framing
(conflicting lengths, bad and endless chunks, bodies that never arrive), odd methods,
versions and request targets, protocol confusion (TLS, HTTP/2 preface, HTTP/0.9), random
bytes from hypothesis, and attempts to make the gateway talk to a host of the client's
choosing (absolute-form targets, Host and forwarding headers, URLs in the body)."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.recording_replica import Recorder
from tests.servers import free_port, running, script

BOUND_S = 6.0  # every exchange ends within this (the gateway's own timeouts are 1 s here)
ENV = {"GATEWAY_HEALTH_INTERVAL_S": "0.5", "GATEWAY_USAGE__STARTUP_PROBE": "false",
       "GATEWAY_CLIENT_BODY_TIMEOUT_S": "1", "GATEWAY_HEAD_TIMEOUT_S": "1",
       "GATEWAY_MAX_BODY_BYTES": str(1 << 20)}


@dataclass
class Setup:
    port: int
    replica: Recorder
    evil: Recorder
    pid: int


@pytest.fixture(scope="module")
def gw() -> Iterator[Setup]:
    with Recorder().serving() as replica, Recorder().serving() as evil:
        port = free_port()
        argv = [*script("gateway"), "serve", "--host", "127.0.0.1", "--port", str(port),
                "--backend", f"http://127.0.0.1:{replica.port}"]
        with running(argv, [f"http://127.0.0.1:{port}/ready"], env=ENV) as proc:
            yield Setup(port, replica, evil, proc.pid)


@dataclass
class Answer:
    status: int  # 0: no response
    head: bytes
    body: bytes
    took: float
    reset: bool


def exchange(port: int, data: bytes) -> Answer:
    """Send raw bytes, read one response (past any 100 Continue) by its length, its end
    of stream, or the connection's close; bounded by BOUND_S."""
    started = time.monotonic()
    buf = b""
    reset = False
    with socket.create_connection(("127.0.0.1", port), timeout=BOUND_S) as s:
        try:
            s.sendall(data)
            while time.monotonic() - started < BOUND_S:
                got = s.recv(65536)
                if not got:
                    break
                buf += got
                while buf.startswith(b"HTTP/1.1 100 ") and b"\r\n\r\n" in buf:
                    buf = buf.split(b"\r\n\r\n", 1)[1]
                head, sep, body = buf.partition(b"\r\n\r\n")
                if not sep:
                    continue
                length = [int(h.split(b":")[1]) for h in head.split(b"\r\n")
                          if h.lower().startswith(b"content-length:")]
                if (length and len(body) >= length[0]) or body.endswith(b"0\r\n\r\n"):
                    break
        except (ConnectionResetError, BrokenPipeError):
            reset = True
        except TimeoutError:
            pass
    took = time.monotonic() - started
    head, _, body = buf.partition(b"\r\n\r\n")
    status = int(head.split(b" ")[1]) if head.startswith(b"HTTP/1.") else 0
    return Answer(status, head, body, took, reset)


def assert_clean(a: Answer) -> None:
    assert a.took < BOUND_S, f"no end within {BOUND_S}s: {a.head[:200]!r}"
    assert a.status < 500, a.head[:300] + a.body[:300]
    if a.status >= 400:
        error = orjson.loads(a.body)["error"]
        assert set(error) == {"message", "type", "param", "code"}, a.body[:300]
    if a.status == 0:
        assert not a.head  # nothing half-written before the close


CHAT = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})


def post(extra: bytes = b"", body: bytes = CHAT, length: bool = True,
         target: bytes = b"/v1/chat/completions", method: bytes = b"POST") -> bytes:
    head = method + b" " + target + b" HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
    if length:
        head += b"content-length: " + str(len(body)).encode() + b"\r\n"
    return head + extra + b"\r\n" + body


def get(target: bytes, extra: bytes = b"") -> bytes:
    return b"GET " + target + b" HTTP/1.1\r\nhost: x\r\n" + extra + b"\r\n"


def with_length(value: bytes) -> bytes:
    return post(b"content-length: " + value + b"\r\n", length=False)


# (name, request bytes, statuses allowed; 0 = closed without an answer)
CASES: list[tuple[str, bytes, set[int]]] = [
    ("plain", post(), {200}),
    ("header of 60 KB", post(b"x-a: " + b"a" * 60_000 + b"\r\n"), {200}),
    ("header of 100 KB", post(b"x-a: " + b"a" * 100_000 + b"\r\n"), {431}),
    ("header of 10 MB", post(b"x-a: " + b"a" * 10_000_000 + b"\r\n"), {431, 0}),
    ("host of 70 KB", get(b"/v1/models").replace(b"host: x", b"host: " + b"h" * 70_000),
     {431}),
    ("2000 headers", post(b"".join(b"x-h%d: v\r\n" % i for i in range(2000))), {200}),
    ("10,000 headers", post(b"x-h: v\r\n" * 10_000), {431}),
    ("same content-length twice", post(b"content-length: %d\r\n" % len(CHAT)), {400}),
    ("two content-lengths", post(b"content-length: 5\r\n"), {400}),
    ("content-length and chunked", post(b"transfer-encoding: chunked\r\n"), {400}),
    ("negative content-length", with_length(b"-1"), {400}),
    ("content-length beyond 64 bits", with_length(b"9" * 30), {400}),
    ("content-length with a sign", with_length(b"+12"), {400}),
    ("content-length over the body limit", with_length(str(2 << 20).encode()), {413}),
    ("bad chunk size", post(b"transfer-encoding: chunked\r\n", b"zz\r\nabc\r\n0\r\n\r\n",
                            length=False), {400}),
    ("a chunk that never ends", post(b"transfer-encoding: chunked\r\n", b"ffffffffff\r\nabc",
                                     length=False), {408}),
    ("chunks past the body limit", post(b"transfer-encoding: chunked\r\n",
                                        b"100000\r\n" + b"x" * 0x100000 + b"\r\n" +
                                        b"10\r\n" + b"x" * 16 + b"\r\n0\r\n\r\n",
                                        length=False), {413}),
    ("a body that never arrives", with_length(b"100")[:-len(CHAT)] + CHAT[:10], {408}),
    ("header without colon", post(b"badheader\r\n"), {400}),
    ("space in a header name", post(b"bad name: x\r\n"), {400}),
    ("folded header", post(b"x-a: b\r\n  folded\r\n"), {400}),
    ("NUL in a header", post(b"x-a: b\x00c\r\n"), {400}),
    ("control byte in a header", post(b"user-agent: a\x01b\r\n"), {400}),
    ("latin-1 in a forwarded header", post(b"user-agent: caf\xe9\r\n"), {200}),
    ("latin-1 request id", post(b"x-request-id: caf\xe9\r\n"), {200}),
    ("request id of 60 KB", post(b"x-request-id: " + b"r" * 60_000 + b"\r\n"), {200}),
    ("session id of 60 KB", post(b"x-session-id: " + b"s" * 60_000 + b"\r\n"), {200}),
    ("binary session id", post(b"x-session-id: \xff\xfe\r\n"), {200}),
    ("binary bearer key", post(b"authorization: Bearer \xff\r\n"), {200}),
    ("two hosts", get(b"/v1/models", b"host: y\r\n"), {200}),
    ("no host", b"GET /v1/models HTTP/1.1\r\n\r\n", {200}),
    ("websocket upgrade", get(b"/v1/models", b"connection: upgrade\r\nupgrade: websocket\r\n"
                              b"sec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
                              b"sec-websocket-version: 13\r\n"), {200, 400, 404}),
    ("h2c upgrade", get(b"/v1/models", b"connection: upgrade, http2-settings\r\n"
                        b"upgrade: h2c\r\nhttp2-settings: AAMAAABkAARAAAAAAAIAAAAA\r\n"), {200}),
    ("expect 100-continue", post(b"expect: 100-continue\r\n"), {200}),
    ("odd expect", post(b"expect: fly\r\n"), {200, 417}),
    ("gzip body the gateway cannot read", post(b"content-encoding: gzip\r\n",
                                               b"\x1f\x8b\x08\x00garbage"), {400}),
    ("lower-case method", b"get /health HTTP/1.1\r\nhost: x\r\n\r\n", {400}),
    ("unknown method", b"FOO /v1/models HTTP/1.1\r\nhost: x\r\n\r\n", {400}),
    ("CONNECT", b"CONNECT 127.0.0.1:1 HTTP/1.1\r\nhost: 127.0.0.1:1\r\n\r\n", {400}),
    ("TRACE", b"TRACE /health HTTP/1.1\r\nhost: x\r\n\r\n", {404, 405}),
    ("OPTIONS *", b"OPTIONS * HTTP/1.1\r\nhost: x\r\n\r\n", {404}),
    ("GET on an inference route", get(b"/v1/chat/completions"), {200, 404, 405}),
    ("target *", get(b"*"), {404}),
    ("target with a fragment", get(b"/v1/models#x"), {200}),
    ("backslash in the target", get(b"/v1/\\x"), {400}),
    ("HTTP/1.0", b"GET /v1/models HTTP/1.0\r\n\r\n", {200}),
    ("HTTP/2.0 as text", b"GET /v1/models HTTP/2.0\r\nhost: x\r\n\r\n", {200, 400, 505}),
    ("HTTP/0.9", b"GET /\r\n", {0, 400}),
    ("HTTP/2 preface", b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", {400}),
    ("TLS client hello", b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(32), {400}),
    ("nothing at all", b"", {0}),
    ("blank lines only", b"\r\n" * 4, {0}),
    ("half a request line", b"GET /v1/mod", {0}),
    ("two requests pipelined", post() + post(), {200}),
    # bodies are not heads: a large one is no 431
    ("body of 900 KB", post(body=orjson.dumps({"model": "m", "messages": [
        {"role": "user", "content": "x" * 900_000}]})), {200}),
]


@pytest.mark.parametrize(("name", "data", "allowed"), CASES, ids=[c[0] for c in CASES])
def test_hostile_requests(gw: Setup, name: str, data: bytes, allowed: set[int]) -> None:
    answer = exchange(gw.port, data)
    assert_clean(answer)
    if answer.reset:  # the client was still sending when the gateway refused and closed
        assert 0 in allowed, name
        return
    assert answer.status in allowed, (name, answer.head[:300], answer.body[:300])


def test_large_bodies_on_one_kept_alive_connection(gw: Setup) -> None:
    """The head bound counts head bytes only, request after request."""
    big = post(body=orjson.dumps({"model": "m", "messages": [
        {"role": "user", "content": "y" * 300_000}]}))
    with socket.create_connection(("127.0.0.1", gw.port), timeout=BOUND_S) as s:
        for _ in range(4):
            s.sendall(big)
            buf = b""
            while True:
                got = s.recv(65536)
                assert got, "closed"
                buf += got
                head, sep, body = buf.partition(b"\r\n\r\n")
                length = [int(h.split(b":")[1]) for h in head.split(b"\r\n")
                          if h.lower().startswith(b"content-length:")]
                if sep and length and len(body) >= length[0]:
                    break
            assert buf.startswith(b"HTTP/1.1 200"), buf[:200]


def test_the_gateway_is_whole_after_the_abuse(gw: Setup) -> None:
    rss = rss_mib(gw.pid)
    heavy = [data for _, data, _ in CASES if len(data) > 50_000]
    for data in [data for _, data, _ in CASES] + heavy * 4:
        exchange(gw.port, data)
    assert rss_mib(gw.pid) - rss < 48, "memory grew with hostile requests"
    answer = exchange(gw.port, post())
    assert answer.status == 200 and b"echo /v1/chat/completions" in answer.body


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


token = st.binary(min_size=1, max_size=12)
header_value = st.binary(max_size=300)


@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
@given(method=st.one_of(st.sampled_from([b"GET", b"POST", b"PUT", b"DELETE", b"PATCH"]),
                        token),
       target=st.one_of(st.sampled_from([b"/v1/chat/completions", b"/v1/models", b"/health",
                                         b"/metrics", b"/stats", b"/v1/x"]),
                        st.binary(max_size=60).map(lambda b: b"/v1/" + b)),
       headers=st.lists(st.tuples(token, header_value), max_size=6),
       body=st.one_of(st.just(CHAT), st.binary(max_size=200)))
def test_random_requests(gw: Setup, method: bytes, target: bytes,
                         headers: list[tuple[bytes, bytes]], body: bytes) -> None:
    head = method + b" " + target + b" HTTP/1.1\r\nhost: x\r\n"
    for name, value in headers:
        head += name + b": " + value + b"\r\n"
    data = head + b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    assert_clean(exchange(gw.port, data))


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.binary(min_size=1, max_size=400))
def test_random_bytes(gw: Setup, data: bytes) -> None:
    assert_clean(exchange(gw.port, data))


def test_no_request_chooses_the_upstream(gw: Setup) -> None:
    """Every way a client might name a host: the gateway talks to its configured replica,
    with a path-only target, and never to the host named."""
    evil = f"127.0.0.1:{gw.evil.port}".encode()
    url = b"http://" + evil
    body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                         "base_url": url.decode(), "api_base": url.decode(),
                         "url": url.decode() + "/v1/chat/completions"})
    attempts = [
        get(url + b"/v1/models"),
        get(url + b"/v1/anything"),
        post(target=url + b"/v1/chat/completions"),
        get(b"/v1/anything").replace(b"host: x", b"host: " + evil),
        get(b"/v1/anything", b"x-forwarded-host: " + evil + b"\r\n"),
        get(b"/v1/anything", b"forwarded: host=" + evil + b"\r\n"),
        get(b"/v1/anything", b"x-original-url: " + url + b"/v1/x\r\n"),
        get(b"/v1/anything", b"x-rewrite-url: " + url + b"/v1/x\r\n"),
        get(b"//" + evil + b"/v1/anything"),
        get(b"/v1/@" + evil + b"/x"),
        get(b"/v1/%2F%2F" + evil + b"/x"),
        get(b"/v1/anything?url=" + url),
        post(body=body),
        post(body=orjson.dumps({"model": url.decode() + "/v1",
                                "messages": [{"role": "user", "content": "hi"}]})),
        post(target=b"/v1/embeddings", body=orjson.dumps({"model": "m@" + evil.decode(),
                                                          "input": "x"})),
    ]
    before = len(gw.replica.requests)
    for data in attempts:
        assert_clean(exchange(gw.port, data))
    time.sleep(0.3)
    assert gw.evil.requests == []
    for line, head in gw.replica.requests[before:]:
        target = line.split(b" ")[1]
        assert target.startswith(b"/") and not target.startswith(b"//"), line
        assert b"\r\nhost: 127.0.0.1:%d\r\n" % gw.replica.port in head.lower(), head[:300]


@pytest.mark.parametrize("first_request", [False, True])
def test_a_head_sent_a_byte_at_a_time_is_cut_at_the_head_timeout(
    gw: Setup, first_request: bool
) -> None:
    """Slowloris: the head trickles in, on a new connection or on a kept-alive one after an
    answered request; the connection is closed about head_timeout_s (1 s here) after the
    head's first byte, however steadily the bytes come."""
    with socket.create_connection(("127.0.0.1", gw.port), timeout=BOUND_S) as s:
        if first_request:
            s.sendall(get(b"/health"))
            assert s.recv(65536).startswith(b"HTTP/1.1 200")
        started = time.monotonic()
        s.sendall(b"GET /v1/models HTTP/1.1\r\nx-a: ")
        closed = False
        while time.monotonic() - started < BOUND_S:
            try:
                s.sendall(b"a")
                if s.recv(1, socket.MSG_DONTWAIT) == b"":
                    closed = True
                    break
            except BlockingIOError:
                pass
            except (ConnectionResetError, BrokenPipeError):
                closed = True
                break
            time.sleep(0.1)
        took = time.monotonic() - started
    assert closed and 0.9 < took < 3.0, took
