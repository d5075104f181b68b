"""Session names by table: the configured headers in their order, then the body."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.sessions import resolve_session, session_header
from gateway.settings import SESSION_HEADERS, ServerSettings

NAMES = tuple(h.encode() for h in SESSION_HEADERS)


@pytest.mark.parametrize(("headers", "body", "expected"), [
    ([], {}, None),
    ([(b"x-session-id", b"own")], {"user": "u"}, "own"),
    ([(b"x-claude-code-session-id", b"cc-1")], {}, "cc-1"),
    ([(b"x-session-affinity", b"oc-1")], {}, "oc-1"),
    ([(b"session-id", b"codex-1")], {}, "codex-1"),
    ([(b"session_id", b"codex-2")], {}, "codex-2"),
    # the earliest configured name wins, whatever the order on the wire
    ([(b"session_id", b"late"), (b"x-claude-code-session-id", b"early")], {}, "early"),
    ([(b"x-session-affinity", b"b"), (b"x-session-id", b"a")], {}, "a"),
    # a blank header names nothing: the next one, then the body decide
    ([(b"x-session-id", b"  "), (b"session-id", b"c")], {}, "c"),
    ([(b"x-claude-code-session-id", b"")], {"prompt_cache_key": "k", "user": "u"}, "k"),
    ([(b"x-other", b"x")], {"user": "u"}, "u"),
])  # fmt: skip
def test_default_order(headers: list[tuple[bytes, bytes]], body: dict[str, Any],
                       expected: str | None) -> None:
    assert resolve_session(session_header(headers, NAMES), body) == expected


def test_a_configured_list_replaces_the_default() -> None:
    headers = [(b"x-session-id", b"own"), (b"x-team-session", b"team")]
    assert session_header(headers, (b"x-team-session",)) == b"team"
    assert session_header(headers, ()) is None


@pytest.mark.parametrize("names", [
    ("x session",), ("",), ("a\r\nb",), tuple(f"h{i}" for i in range(17))])
def test_bad_header_names_are_refused(names: tuple[str, ...]) -> None:
    with pytest.raises(ValueError, match="session_headers"):
        ServerSettings(session_headers=names)
