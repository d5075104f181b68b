"""The small rules for client-chosen values the gateway keeps or forwards (pure): which
request ids are used as sent, how long session ids are bounded, which keys are refused,
and the nesting depth check."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.coerce import SettingsError
from gateway.proxy.inbound import too_deep
from gateway.proxy.target import MAX_REQUEST_ID, client_request_id
from gateway.sessions import MAX_SESSION_CHARS, resolve_session
from gateway.settings import parse_settings


@pytest.mark.parametrize(("value", "kept"), [
    (None, None),
    (b"", None),
    (b"req-1", "req-1"),
    (b"0b1f:2c/3+4=5_6.7~", "0b1f:2c/3+4=5_6.7~"),
    (b"r" * MAX_REQUEST_ID, "r" * MAX_REQUEST_ID),
    (b"r" * (MAX_REQUEST_ID + 1), None),
    (b"caf\xe9", None),
    (b"a b", None),
    (b"a\tb", None),
    (b"a\x7fb", None),
    (b"a\x00b", None),
])
def test_client_request_ids(value: bytes | None, kept: str | None) -> None:
    assert client_request_id(value) == kept


@pytest.mark.parametrize(("length", "kept"), [
    (1, True), (128, True),  # the bound README states, in its own number
    (129, False), (4096, False), (65536, False),
])
def test_a_client_request_id_is_kept_up_to_128_characters(length: int, kept: bool) -> None:
    """A longer one would be written into every record and log line and echoed back."""
    assert (client_request_id(b"r" * length) is not None) is kept


LONG = "s" * (MAX_SESSION_CHARS + 1)


@pytest.mark.parametrize(("header", "body", "session"), [
    (b"abc", {}, "abc"),
    (b"  abc  ", {}, "abc"),
    (b"s" * MAX_SESSION_CHARS, {}, "s" * MAX_SESSION_CHARS),
    (None, {"prompt_cache_key": "k" * MAX_SESSION_CHARS}, "k" * MAX_SESSION_CHARS),
    (None, {"user": "u"}, "u"),
    (None, {"user": 5}, None),
])
def test_sessions(header: bytes | None, body: dict[str, Any], session: str | None) -> None:
    assert resolve_session(header, body) == session


@pytest.mark.parametrize(("header", "body"), [
    (LONG.encode(), {}),
    (None, {"prompt_cache_key": LONG}),
    (None, {"user": LONG + "\ud800"}),  # a lone surrogate survives JSON parsers other than orjson
])
def test_long_session_ids_are_bounded_and_stable(header: bytes | None,
                                                 body: dict[str, Any]) -> None:
    first = resolve_session(header, body)
    assert first is not None and first.startswith("sha256:") and len(first) == 7 + 64
    assert resolve_session(header, body) == first  # one session stays one session
    assert resolve_session(b"x" + LONG.encode(), {}) != first


@pytest.mark.parametrize("keys", ['{"" = "t"}', '{" " = "t"}'])
def test_empty_client_keys_are_refused(keys: str) -> None:
    with pytest.raises(SettingsError, match="must not be empty"):
        parse_settings(f"[auth]\nkeys = {keys}", {})


def nest(depth: int) -> Any:
    doc: Any = "x"
    for i in range(depth):
        doc = [doc] if i % 2 else {"k": doc}
    return doc


@pytest.mark.parametrize(("doc", "limit", "deep"), [
    ("x", 0, False),
    ({}, 1, False),
    ({}, 0, True),
    (nest(128), 128, False),
    (nest(129), 128, True),
    (nest(5000), 128, True),  # iterative: no RecursionError however deep
    ([nest(3), nest(10)], 10, True),
    ([nest(3), nest(10)], 11, False),
])
def test_depth(doc: Any, limit: int, deep: bool) -> None:
    assert too_deep(doc, limit) is deep
