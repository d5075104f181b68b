"""What of a client's request may go upstream (gateway/proxy/target.py), by tables."""

from __future__ import annotations

import pytest

from gateway.proxy.errors import GatewayError
from gateway.proxy.target import MAX_TARGET, forwarded_headers, upstream_target


@pytest.mark.parametrize(("raw", "query", "expected"), [
    (b"/v1/models", b"", "/v1/models"),
    (b"/v1/models/%E2%82%AC", b"", "/v1/models/%E2%82%AC"),  # kept encoded, byte for byte
    (b"/v1/files/a%2Fb", b"", "/v1/files/a%2Fb"),
    (b"/v1/x", b"a=1&b=%C3%A9", "/v1/x?a=1&b=%C3%A9"),
    (b"/v1/x;y=1:@!$'()*+,", b"", "/v1/x;y=1:@!$'()*+,"),
    (b"/v1/.well-known", b"", "/v1/.well-known"),  # a dot inside a segment is fine
])
def test_targets_that_go_upstream_as_written(raw: bytes, query: bytes, expected: str) -> None:
    assert upstream_target(raw, query) == expected


@pytest.mark.parametrize(("raw", "query", "status"), [
    (b"/v1/models%20HTTP/1.1%0D%0AHost:%20x", b"", 400),
    (b"/v1/x%0a", b"", 400),
    (b"/v1/x%00", b"", 400),
    (b"/v1/x%09", b"", 400),
    (b"/v1/x%7f", b"", 400),
    (b"/v1/x%2", b"", 400),
    (b"/v1/x%G1", b"", 400),
    (b"/v1/a b", b"", 400),
    (b"/v1/\xe2\x82\xac", b"", 400),
    (b"/v1/a\"b", b"", 400),
    (b"/v1/a#b", b"", 400),
    (b"v1/models", b"", 400),
    (b"/v1/../admin", b"", 400),
    (b"/v1/%2E%2E/admin", b"", 400),
    (b"/v1/./models", b"", 400),
    (b"/v1/x", b"q=%0d%0a", 400),
    (b"/v1/x", b"q=a b", 400),
    (b"/v1/" + b"a" * MAX_TARGET, b"", 414),
])
def test_targets_refused(raw: bytes, query: bytes, status: int) -> None:
    with pytest.raises(GatewayError) as err:
        upstream_target(raw, query)
    assert err.value.status == status and err.value.param == "path"


@pytest.mark.parametrize(("client", "expected"), [
    ([(b"content-type", b"application/json"), (b"accept", b"*/*")],
     [("content-type", "application/json"), ("accept", "*/*")]),
    ([(b"authorization", b"Bearer k"), (b"x-gateway-route", b"x"), (b"host", b"h"),
      (b"x-forwarded-for", b"1.2.3.4"), (b"transfer-encoding", b"chunked"),
      (b"x-data-parallel-rank", b"1")], []),
    ([(b"connection", b"close, traceparent"), (b"traceparent", b"00-a-b-01"),
      (b"tracestate", b"k=v")], [("tracestate", "k=v")]),
    ([(b"anthropic-version", b"2023-06-01")], [("anthropic-version", "2023-06-01")]),
])
def test_header_allow_list(client: list[tuple[bytes, bytes]],
                           expected: list[tuple[str, str]]) -> None:
    assert forwarded_headers(client) == expected


@pytest.mark.parametrize("value", [b"a\r\nx-injected: 1", b"a\nb", b"a\x00b"])
def test_a_forwarded_header_with_cr_lf_or_nul_is_refused(value: bytes) -> None:
    with pytest.raises(GatewayError) as err:
        forwarded_headers([(b"accept", value)])
    assert err.value.status == 400 and err.value.param == "accept"
    assert forwarded_headers([(b"x-other", value)]) == []  # not forwarded anyway
