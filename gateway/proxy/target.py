"""What of a client's request may go upstream (pure): the request target and the headers.

Target: built from the bytes the client sent (`raw_path`, `query_string`), never from the
server's percent-decoded `path`: decoding `%0D%0A` and writing the result to the wire is how
a client makes a replica receive a second request it never sent. The raw target must be
RFC 3986 characters only (no space, control byte or non-ASCII byte), its percent-escapes
well formed, and once decoded it must hold no control byte or space and no `.`/`..` segment
(a replica or a proxy in front of it may resolve those to a path outside `/v1/`). Anything
else is a 400 in OpenAI's shape before a byte goes upstream; a target longer than
`MAX_TARGET` is a 414.

Headers: an allow-list. A client's headers reach a replica only if they are ones an engine
reads (content type, accept, tracing, the Anthropic version headers); hop-by-hop headers,
those a `Connection` header names, `Authorization` (replaced by the replica's own key),
`x-gateway-*` and every other header stay behind. A value holding CR, LF or NUL is a 400.

Request id: a client's `x-request-id` is kept (echoed, recorded, sent upstream as
`X-Request-Id`) only if it is 1 to `MAX_REQUEST_ID` visible ASCII characters; any other
value is replaced by one the gateway makes, rather than refusing the request.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from urllib.parse import unquote_to_bytes

from gateway.proxy.errors import GatewayError

MAX_TARGET = 4096
MAX_REQUEST_ID = 128

# RFC 3986 pchar plus "/" (path) and "?" (query), with "%" checked separately.
_PATH_OK = re.compile(rb"[A-Za-z0-9\-._~!$&'()*+,;=:@/%]*")
_QUERY_OK = re.compile(rb"[A-Za-z0-9\-._~!$&'()*+,;=:@/?%]*")
_BAD_ESCAPE = re.compile(rb"%(?![0-9A-Fa-f]{2})")
_BAD_DECODED = re.compile(rb"[\x00-\x20\x7f]")
_REQUEST_ID = re.compile(rb"[\x21-\x7e]{1,%d}" % MAX_REQUEST_ID)

FORWARDED_HEADERS = frozenset({
    b"content-type", b"accept", b"accept-language", b"user-agent",
    b"traceparent", b"tracestate", b"baggage",
    b"anthropic-version", b"anthropic-beta",
})
HOP_BY_HOP = frozenset({
    b"connection", b"keep-alive", b"proxy-connection", b"proxy-authenticate",
    b"proxy-authorization", b"te", b"trailer", b"trailers", b"transfer-encoding", b"upgrade",
})


def bad_target(message: str) -> GatewayError:
    return GatewayError(400, message, code="invalid_request_target", param="path")


def upstream_target(raw_path: bytes, query: bytes) -> str:
    """The request target to send upstream, exactly as the client wrote it, or raise."""
    if len(raw_path) + len(query) + 1 > MAX_TARGET:
        raise GatewayError(414, f"Request target longer than {MAX_TARGET} bytes.",
                           code="request_target_too_long", param="path")
    if not raw_path.startswith(b"/") or _PATH_OK.fullmatch(raw_path) is None:
        raise bad_target("The request path holds a character that is not allowed "
                         "(a space, a control character or a non-ASCII byte).")
    if query and _QUERY_OK.fullmatch(query) is None:
        raise bad_target("The query string holds a character that is not allowed.")
    for part in (raw_path, query):
        if b"%" in part:
            if _BAD_ESCAPE.search(part):
                raise bad_target("The request target holds a malformed percent-escape.")
            if _BAD_DECODED.search(unquote_to_bytes(part)):
                raise bad_target("The request target encodes a space or a control "
                                 "character.")
    segments = unquote_to_bytes(raw_path).split(b"/")
    if b"." in segments or b".." in segments:
        raise bad_target("The request path holds a '.' or '..' segment.")
    target = raw_path.decode("ascii")
    return f"{target}?{query.decode('ascii')}" if query else target


def client_request_id(value: bytes | None) -> str | None:
    """The client's request id if it may be used as is, else None."""
    if value is None or _REQUEST_ID.fullmatch(value) is None:
        return None
    return value.decode("ascii")


def forwarded_headers(client: Sequence[tuple[bytes, bytes]]) -> list[tuple[str, str]]:
    """The client's headers that go upstream (see the module docstring), or raise 400."""
    named: set[bytes] = set()
    for key, value in client:
        if key == b"connection":
            named.update(t.strip().lower() for t in value.split(b","))
    out: list[tuple[str, str]] = []
    for key, value in client:
        if key not in FORWARDED_HEADERS or key in named:
            continue
        if b"\r" in value or b"\n" in value or b"\x00" in value:
            raise GatewayError(400, f"Header {key.decode('latin-1')!r} holds CR, LF or NUL.",
                               code="invalid_header", param=key.decode("latin-1"))
        out.append((key.decode("latin-1"), value.decode("latin-1")))
    return out
