"""The failure table (gateway.upstream.failure), pure: what happened on one replica -> retry
elsewhere or not, suspect the replica or not, relay its answer or answer for it; and what
the client is told."""

from __future__ import annotations

import pytest

from gateway.upstream.errors import (
    UpstreamConnectError,
    UpstreamError,
    UpstreamPoolBusy,
    UpstreamProtocolError,
    UpstreamTimeout,
)
from gateway.upstream.failure import Happened, answered, client_error, happened, verdict


@pytest.mark.parametrize(("exc", "what", "retry", "suspect", "status", "code"), [
    (UpstreamConnectError("refused"), "not_delivered", True, True, 502,
     "upstream_connect_error"),
    (UpstreamConnectError("connect timeout"), "not_delivered", True, True, 502,
     "upstream_connect_error"),
    (UpstreamPoolBusy("no free connection"), "pool_busy", False, False, 503,
     "upstream_pool_busy"),
    (UpstreamTimeout("no head"), "timeout", False, False, 504, "upstream_timeout"),
    (UpstreamProtocolError("Server disconnected"), "broken", False, False, 502,
     "upstream_protocol_error"),
    (UpstreamProtocolError("invalid response head"), "broken", False, False, 502,
     "upstream_protocol_error"),
])
def test_transport_failures(exc: UpstreamError, what: Happened, retry: bool, suspect: bool,
                            status: int, code: str) -> None:
    assert happened(exc) == what
    rule = verdict(what)
    assert (rule.retry, rule.suspect, rule.relay) == (retry, suspect, False)
    error = client_error(exc, "r1", retry_after_s=7)
    assert (error.status, error.code) == (status, code)
    assert error.headers() == ([(b"retry-after", b"7")] if status == 503 else [])
    assert set(error.payload()["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize(("status", "what"), [
    (200, None), (201, None), (204, None), (304, None),
    (400, "client_error"), (404, "client_error"), (413, "client_error"),
    (429, "client_error"),
    (500, "server_error"), (502, "server_error"), (503, "server_error"),
    (504, "server_error"),
])
def test_answers_are_relayed_and_never_retried(status: int, what: Happened | None) -> None:
    assert answered(status) == what
    if what is not None:
        rule = verdict(what)
        assert (rule.retry, rule.suspect, rule.relay) == (False, False, True)


def test_only_not_delivered_moves_a_request() -> None:
    classes: list[Happened] = ["not_delivered", "pool_busy", "timeout", "broken",
                               "client_error", "server_error"]
    assert [c for c in classes if verdict(c).retry] == ["not_delivered"]
    assert [c for c in classes if verdict(c).suspect] == ["not_delivered"]
