"""Which agent program a request belongs to (gateway.agents.programs), by table."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.agents.programs import ProgramId, identify
from gateway.sessions import MAX_SESSION_CHARS

LONG = "p" * (MAX_SESSION_CHARS + 1)

H = list[tuple[bytes, bytes]]


def h(**pairs: str) -> H:
    return [(k.replace("_", "-").encode(), v.encode("latin-1")) for k, v in pairs.items()]


CLAUDE = h(x_claude_code_session_id="cs1", x_claude_code_agent_id="sub2",
           x_claude_code_parent_agent_id="root")
CODEX = h(session_id="cx1", thread_id="t9")
XSESSION = h(x_session_id="s1")


@pytest.mark.parametrize(("headers", "body", "want"), [
    # the body's agentic_context first, over every header
    (CLAUDE + XSESSION, {"vllm_xargs": {"agentic_context": "prog-a"}},
     ProgramId("t", "prog-a", "agentic_context")),
    ([], {"vllm_xargs": {"agentic_context": {"program_id": "prog-b", "agent_id": "a1"}}},
     ProgramId("t", "prog-b", "agentic_context", "a1")),
    # an object without a string program_id names nothing there: the headers decide
    (XSESSION, {"vllm_xargs": {"agentic_context": {"program_id": 7}}},
     ProgramId("t", "s1", "session")),
    # garbage in the body: not a string, blank, control bytes
    (XSESSION, {"vllm_xargs": {"agentic_context": 12}}, ProgramId("t", "s1", "session")),
    (XSESSION, {"vllm_xargs": {"agentic_context": "  "}}, ProgramId("t", "s1", "session")),
    (XSESSION, {"vllm_xargs": {"agentic_context": "a\x00b"}}, ProgramId("t", "s1", "session")),
    (XSESSION, {"vllm_xargs": "agentic_context"}, ProgramId("t", "s1", "session")),
    # Claude Code: the session names the program, the agent id the sub-agent
    (CLAUDE + CODEX + XSESSION, {}, ProgramId("t", "cs1", "claude_code", "sub2")),
    (h(x_claude_code_parent_agent_id="root", x_claude_code_agent_id="k"), {},
     ProgramId("t", "root", "claude_code", "k")),
    # Codex before x-session-id
    (CODEX + XSESSION, {}, ProgramId("t", "cx1", "codex", "t9")),
    (XSESSION, {}, ProgramId("t", "s1", "session")),
    # a blank header is skipped; a non-printable one names nothing
    (h(x_claude_code_session_id=" ") + XSESSION, {}, ProgramId("t", "s1", "session")),
    (h(session_id="a\x07b"), {}, None),
    # oversize: bounded to a digest, one program still
    ([], {"vllm_xargs": {"agentic_context": LONG}}, "digest"),
    ([], {"prompt_cache_key": "k", "user": "u"}, None),
])
def test_identify(headers: H, body: dict[str, Any], want: ProgramId | str | None) -> None:
    got = identify(headers, body, "t")
    if want == "digest":
        assert got is not None and got.program.startswith("sha256:")
        assert len(got.program) <= MAX_SESSION_CHARS
        assert identify(headers, body, "t") == got
    else:
        assert got == want


def test_two_tenants_same_value_are_two_programs() -> None:
    a = identify(XSESSION, {}, "alpha")
    b = identify(XSESSION, {}, "beta")
    assert a is not None and b is not None
    assert a.program == b.program
    assert a.program_key() != b.program_key()
    assert a.thread_key() != b.thread_key()
    none = identify(XSESSION, {}, None)
    assert none is not None and none.tenant == ""


def test_sub_agents_share_the_program_not_the_thread() -> None:
    one = identify(h(session_id="p", thread_id="a"), {}, "t")
    two = identify(h(session_id="p", thread_id="b"), {}, "t")
    assert one is not None and two is not None
    assert one.program_key() == two.program_key()
    assert one.thread_key() != two.thread_key()
