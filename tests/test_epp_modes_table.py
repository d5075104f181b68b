"""The processing-mode decisions (gateway.epp.modes) as tables."""

from __future__ import annotations

import pytest

from gateway.epp import modes
from gateway.epp.modes import (
    BUFFERED,
    BUFFERED_PARTIAL,
    FULL_DUPLEX_STREAMED,
    NONE,
    STREAMED,
    Modes,
)


@pytest.mark.parametrize(("req", "resp", "waiting", "want"), [
    (None, None, False, Modes(BUFFERED, NONE)),  # not sent: the project's own file
    (FULL_DUPLEX_STREAMED, FULL_DUPLEX_STREAMED, False,
     Modes(FULL_DUPLEX_STREAMED, FULL_DUPLEX_STREAMED)),
    (STREAMED, NONE, True, Modes(STREAMED, NONE, True)),
    (99, 98, False, Modes(BUFFERED, NONE)),  # a mode from a later Envoy: the safe ones
])
def test_modes_of(req: int | None, resp: int | None, waiting: bool, want: Modes) -> None:
    assert modes.of(req, resp, waiting) == want


@pytest.mark.parametrize(("m", "headers_end", "want"), [
    (Modes(FULL_DUPLEX_STREAMED, NONE), False, "gather"),
    (Modes(FULL_DUPLEX_STREAMED, NONE), True, "headers"),  # no body: pick at once
    (Modes(BUFFERED, NONE), False, "body"),
    (Modes(BUFFERED_PARTIAL, NONE), False, "body"),
    (Modes(NONE, NONE), False, "headers"),
    (Modes(STREAMED, NONE), False, "headers"),  # Envoy routes at the headers answer
    (Modes(STREAMED, NONE, True), False, "gather"),
])
def test_request_plan(m: Modes, headers_end: bool, want: str) -> None:
    assert modes.request_plan(m, headers_end) == want


@pytest.mark.parametrize(("body", "end", "want"), [
    (b'{"a": 1}', True, True),
    (b'{"a": 1}', False, True),  # trailers follow a whole body
    (b'{"a": ', False, False),  # a first part
    (b'{"a": ', True, True),  # the whole body, bad JSON: the 400 is the parser's
])
def test_whole(body: bytes, end: bool, want: bool) -> None:
    assert modes.whole(body, end) is want


@pytest.mark.parametrize(("configured", "wants", "sse", "want"), [
    (NONE, True, False, BUFFERED_PARTIAL),
    (NONE, True, True, STREAMED),
    (NONE, False, False, None),
    (STREAMED, False, False, NONE),  # a body not read is turned off
    (STREAMED, True, True, None),
    (BUFFERED_PARTIAL, True, False, None),
    (FULL_DUPLEX_STREAMED, True, False, None),  # never overridden
    (FULL_DUPLEX_STREAMED, False, True, None),
])
def test_response_override(configured: int, wants: bool, sse: bool, want: int | None) -> None:
    assert modes.response_override(Modes(BUFFERED, configured), wants, sse) == want


@pytest.mark.parametrize(("sent", "length", "want"), [
    (None, 10, "10"), ("10", 10, None), ("9", 10, "10"), ("x", 10, "10"), (" 10 ", 10, None),
])
def test_content_length(sent: str | None, length: int, want: str | None) -> None:
    assert modes.content_length(sent, length) == want
