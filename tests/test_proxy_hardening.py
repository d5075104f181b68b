"""The request path against hostile input and hostile replicas, on loopback: a real gateway
process in front of a raw replica that records every byte it receives (tests/
recording_replica.py), driven with raw sockets so nothing between the test and the gateway
cleans the request up.

In every case the replica receives exactly the request the client sent or nothing, the
client gets an OpenAI-shaped 4xx or 502 (or, mid-stream, a clean error event), memory stays
bounded, and the pool is not poisoned: the next request gets its own answer."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import orjson
import pytest

from tests.recording_replica import Recorder
from tests.servers import free_port, running, script

ENV = {"GATEWAY_HEALTH_INTERVAL_S": "0.2", "GATEWAY_USAGE__STARTUP_PROBE": "false",
       "GATEWAY_MAX_RESPONSE_BYTES": str(8 * 1024 * 1024), "GATEWAY_READ_TIMEOUT_S": "5"}


@pytest.fixture(scope="module")
def setup() -> Iterator[tuple[int, Recorder, int]]:
    with Recorder().serving() as rec:
        port = free_port()
        argv = [*script("gateway"), "serve", "--host", "127.0.0.1", "--port", str(port),
                "--backend", f"http://127.0.0.1:{rec.port}"]
        with running(argv, [f"http://127.0.0.1:{port}/ready"], env=ENV) as proc:
            yield port, rec, proc.pid


def exchange(port: int, data: bytes, timeout: float = 10.0) -> tuple[int, bytes, bytes]:
    """Send raw bytes, read one response (by content-length, or to close)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        buf = b""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                got = s.recv(65536)
            except TimeoutError:
                break
            if not got:
                break
            buf += got
            head, sep, body = buf.partition(b"\r\n\r\n")
            if sep:
                length = [int(h.split(b":")[1]) for h in head.split(b"\r\n")
                          if h.lower().startswith(b"content-length:")]
                if length and len(body) >= length[0]:
                    break
                if b"data: [DONE]" in body:
                    break
    head, _, body = buf.partition(b"\r\n\r\n")
    status = int(head.split(b" ")[1]) if head.startswith(b"HTTP/1.1 ") else 0
    return status, head, body


def get(target: bytes) -> bytes:
    return b"GET " + target + b" HTTP/1.1\r\nhost: x\r\n\r\n"


def post_chat(mode: str, stream: bool = False, extra_headers: bytes = b"") -> bytes:
    body = orjson.dumps({"model": "m", "stream": stream,
                         "messages": [{"role": "user", "content": mode}]})
    return (b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json"
            b"\r\ncontent-length: " + str(len(body)).encode() + b"\r\n" + extra_headers +
            b"\r\n" + body)


def openai_error(body: bytes) -> dict[str, object]:
    doc = orjson.loads(body)
    assert set(doc["error"]) == {"message", "type", "param", "code"}
    return doc["error"]  # type: ignore[no-any-return]


def assert_pool_clean(port: int, rec: Recorder) -> None:
    status, _, body = exchange(port, get(b"/v1/echo-check"))
    assert status == 200 and b"echo /v1/echo-check" in body


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


@pytest.mark.parametrize(("target", "status"), [
    (b"/v1/models%20HTTP/1.1%0D%0AHost:%20x%0D%0A%0D%0AGET%20/v1/anything", 400),
    (b"/v1/x%0d%0aInjected:%20yes", 400),
    (b"/v1/x%00y", 400),
    (b"/v1/x%20y", 400),
    (b"/v1/x%7Fy", 400),
    (b"/v1/x%zz", 400),
    (b"/v1/../reset_prefix_cache", 400),
    (b"/v1/%2e%2e/reset_prefix_cache", 400),
    (b"/v1/x?q=%0d%0aInjected:%20yes", 400),
    (b"/v1/" + b"a" * 5000, 414),
    (b"/v1/x\"y", 400),
])
def test_bad_targets_are_refused_before_anything_goes_upstream(
    setup: tuple[int, Recorder, int], target: bytes, status: int
) -> None:
    port, rec, _ = setup
    before = len(rec.inference())
    got, _, body = exchange(port, get(target))
    assert got == status
    assert openai_error(body)["param"] == "path"
    assert len(rec.inference()) == before  # nothing reached the replica
    assert_pool_clean(port, rec)


@pytest.mark.parametrize("target", [
    b"/v1/files/%E2%82%AC", b"/v1/files/a%2Fb", b"/v1/x?a=1&b=%C3%A9", b"/v1/x;y=1:@!$'()*+,",
])
def test_odd_but_valid_targets_reach_the_replica_exactly_as_sent(
    setup: tuple[int, Recorder, int], target: bytes
) -> None:
    port, rec, _ = setup
    got, _, _ = exchange(port, get(target))
    assert got == 200
    assert rec.inference()[-1] == b"GET " + target + b" HTTP/1.1"


@pytest.mark.parametrize("raw", [
    b"GET /v1/a b HTTP/1.1\r\nhost: x\r\n\r\n",  # a raw space: the server's parser refuses
    b"GET /v1/a\x00b HTTP/1.1\r\nhost: x\r\n\r\n",
    b"GET /v1/\xe2\x82\xac HTTP/1.1\r\nhost: x\r\n\r\n",
])
def test_raw_bytes_in_the_target_never_reach_the_replica(
    setup: tuple[int, Recorder, int], raw: bytes
) -> None:
    port, rec, _ = setup
    before = len(rec.inference())
    got, _, _ = exchange(port, raw)
    assert got in (0, 400)  # refused by the HTTP parser, or the connection closed
    assert len(rec.inference()) == before
    assert_pool_clean(port, rec)


def test_only_allow_listed_headers_go_upstream(setup: tuple[int, Recorder, int]) -> None:
    port, rec, _ = setup
    extra = (b"x-gateway-replica: evil\r\nx-gateway-trusted: 1\r\nx-forwarded-for: 1.2.3.4\r\n"
             b"connection: keep-alive, traceparent\r\n"
             b"traceparent: 00-aa-bb-01\r\nanthropic-version: 2023-06-01\r\n"
             b"authorization: Bearer client-key\r\nx-data-parallel-rank: 3\r\n")
    got, _, _ = exchange(port, post_chat("hello", extra_headers=extra))
    assert got == 200
    # the last chat request (a health probe may have come after it)
    head = [h for line, h in rec.requests if line.startswith(b"POST ")][-1].lower()
    for banned in (b"x-gateway-", b"x-forwarded-for", b"client-key", b"x-data-parallel-rank",
                   b"traceparent"):  # traceparent is named by Connection: hop-by-hop
        assert banned not in head
    assert b"anthropic-version: 2023-06-01" in head


def test_a_header_value_with_cr_lf_is_refused(setup: tuple[int, Recorder, int]) -> None:
    port, rec, _ = setup
    before = len(rec.inference())
    # uvicorn's parser refuses a raw CR/LF inside a value; an obs-fold is the nearest a
    # client gets, and it must not become a second header upstream either.
    got, _, _ = exchange(port, post_chat("hello", extra_headers=b"accept: a\r\n b: c\r\n"))
    assert got in (0, 400)
    assert all(b"\r\nb: c" not in head for _, head in rec.requests[before:])


@pytest.mark.parametrize(("mode", "stream", "status"), [
    ("endless-head", False, 502),
    ("huge", False, 502),
    ("upgrade", False, 502),
    ("garbage", False, 502),
    ("truncated", True, 200),
    ("close-mid", True, 200),
])
def test_hostile_replica_answers_end_cleanly(
    setup: tuple[int, Recorder, int], mode: str, stream: bool, status: int
) -> None:
    port, rec, pid = setup
    rss = rss_mib(pid)
    got, _, body = exchange(port, post_chat(mode, stream=stream), timeout=20)
    assert got == status
    if status == 200:  # the stream was cut after its head: an error event, then [DONE]
        assert b'"error"' in body and b"data: [DONE]" in body.split(b'"error"')[-1]
    else:
        assert openai_error(body)["type"] == "upstream_error"
    assert rss_mib(pid) - rss < 64  # the endless head / huge body were not buffered
    assert_pool_clean(port, rec)


def test_the_injection_from_the_report_sends_one_request_and_answers_it(
    setup: tuple[int, Recorder, int]
) -> None:
    """The review's case: a target that decodes to a second request with a slow answer.
    Refused, and the next client gets its own answer, not the injected one's."""
    port, rec, _ = setup
    before = len(rec.inference())
    got, _, _ = exchange(port, get(b"/v1/models%20HTTP/1.1%0D%0AHost:%20x%0D%0A%0D%0A"
                                   b"GET%20/v1/slow-injected"))
    assert got == 400
    time.sleep(0.6)
    assert len(rec.inference()) == before
    assert_pool_clean(port, rec)


def _series(port: int) -> int:
    status, _, body = exchange(port, get(b"/metrics"), timeout=10)
    assert status == 200
    return sum(1 for line in body.decode().splitlines()
               if line.startswith("gateway_") and not line.startswith("#"))


def test_made_up_model_names_do_not_grow_the_metric_series(
    setup: tuple[int, Recorder, int]
) -> None:
    port, _, _ = setup

    def made_up(i: int) -> bytes:
        body = orjson.dumps({"model": f"made-up-{i}-{'x' * (i % 50)}",
                             "messages": [{"role": "user", "content": "hi"}]})
        return (b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: "
                b"application/json\r\ncontent-length: " + str(len(body)).encode() +
                b"\r\n\r\n" + body)

    for i in range(5):  # the "unknown" label's series exist from here on
        assert exchange(port, made_up(i))[0] == 404
    before = _series(port)
    for i in range(5, 505):
        assert exchange(port, made_up(i))[0] == 404
    assert _series(port) == before
