"""W3C trace context on the way upstream (pure).

A client's `traceparent` never goes to a replica as the client wrote it: with tracing on,
it is replaced by the gateway span's own context (the replica's spans are children of the
gateway's); with tracing off, it goes only when it is well formed (version 00, lowercase
hex, neither id all zeros: vLLM continues it, so a client's trace still joins the
engine's), with its `tracestate` only then and only when that is well formed and at most
`MAX_TRACESTATE` characters. Anything else is dropped: a malformed value never reaches an
engine that would parse it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

TRACE_HEADERS = frozenset({"traceparent", "tracestate"})
# The gateway's own bound on a tracestate (all its headers combined), stricter than W3C's
# 32 members of up to 256 + 256 characters each (about 16 KiB): a longer one is dropped
# whole, never parsed further nor sent to an engine. W3C asks a vendor to propagate at
# least 512 characters and lets it drop members beyond that, so 512 loses nothing W3C
# guarantees, and bounds what every replica is sent on every request.
MAX_TRACESTATE = 512
MAX_MEMBERS = 32  # W3C: at most 32 list-members (empty ones not counted)
# W3C Trace Context level 1 (section 3.3.1), the grammar the OpenTelemetry SDK checks:
# simple-key = lcalpha 0*255(lcalpha / DIGIT / "_" / "-" / "*" / "/")
# multi-tenant-key = tenant-id "@" system-id,
#   tenant-id = (lcalpha / DIGIT) 0*240(...), system-id = lcalpha 0*13(...)
# value = 0*255(chr) nblk-chr, chr = %x20 / nblk-chr, nblk-chr = %x21-2B / %x2D-3C / %x3E-7E
_KEY_CHARS = r"[a-z0-9_\-*/]"
_KEY = (rf"[a-z]{_KEY_CHARS}{{0,255}}"
        rf"|[a-z0-9]{_KEY_CHARS}{{0,240}}@[a-z]{_KEY_CHARS}{{0,13}}")
_VALUE = r"[\x20-\x2b\x2d-\x3c\x3e-\x7e]{0,255}[\x21-\x2b\x2d-\x3c\x3e-\x7e]"
_MEMBER = re.compile(rf"({_KEY})=(?:{_VALUE})")
_OWS = " \t"  # optional whitespace around a member (RFC 9110 OWS)
_TRACEPARENT = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")

Pairs = Sequence[tuple[str, str]]


def valid_traceparent(value: str | None) -> bool:
    if value is None or _TRACEPARENT.fullmatch(value) is None:
        return False
    trace_id, parent_id = value[3:35], value[36:52]
    return trace_id != "0" * 32 and parent_id != "0" * 16


def valid_tracestate(value: str | None) -> bool:
    """Whether `value` (the combined tracestate: `tracestate`) is a W3C list within
    MAX_TRACESTATE characters: every non-empty member `key=value` as the grammar above
    says, no key twice, at most MAX_MEMBERS of them."""
    if value is None or not value or len(value) > MAX_TRACESTATE:
        return False
    keys: set[str] = set()
    for raw in value.split(","):
        member = raw.strip(_OWS)
        if not member:
            continue  # W3C: an empty list-member is allowed, and is no member
        match = _MEMBER.fullmatch(member)
        if match is None or match.group(1) in keys:
            return False
        keys.add(match.group(1))
    return 0 < len(keys) <= MAX_MEMBERS


def tracestate(headers: Pairs) -> str | None:
    """The client's tracestate: every `tracestate` header combined with "," in the order
    sent (RFC 9110 field lines; W3C: several headers are one list), None without one."""
    values = [v for k, v in headers if k.lower() == "tracestate"]
    return ",".join(values) if values else None


def client_context(headers: Pairs) -> tuple[tuple[str, str], ...]:
    """The client's trace headers that may go upstream as they are (tracing off)."""
    parent = _first(headers, "traceparent")
    if not valid_traceparent(parent):
        return ()
    assert parent is not None
    state = tracestate(headers)
    return (("traceparent", parent),) + (
        (("tracestate", state),) if state is not None and valid_tracestate(state) else ())


def upstream(forwarded: Pairs, context: Pairs) -> list[tuple[str, str]]:
    """The forwarded headers less any trace header, plus `context` (the gateway's)."""
    return [*((k, v) for k, v in forwarded if k.lower() not in TRACE_HEADERS), *context]


def _first(headers: Pairs, name: str) -> str | None:
    return next((v for k, v in headers if k.lower() == name), None)


def from_raw(headers: Sequence[tuple[bytes, bytes]]) -> list[tuple[str, str]]:
    """The trace headers among an ASGI scope's (lowercase names), decoded."""
    return [(k.decode("latin-1"), v.decode("latin-1")) for k, v in headers
            if k in (b"traceparent", b"tracestate")]
