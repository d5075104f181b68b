"""Which agent program a request belongs to (pure).

An agent program is a long-lived run of LLM calls separated by tool calls; its next
request carries most of its last one's context. The first of these that the request
carries names it (the order of the vLLM Router's program-scheduling proposal):

1. the body's `vllm_xargs.agentic_context`: a non-empty string (the program's id), or an
   object whose `program_id` is one (and whose `agent_id`, if a string, names the
   sub-agent);
2. Claude Code: `x-claude-code-session-id` (else `x-claude-code-parent-agent-id`) names
   the program, `x-claude-code-agent-id` the sub-agent within it;
3. Codex: `session-id` names the program, `thread-id` the sub-agent;
4. the gateway's own `x-session-id`.

The header values come from the ASGI scope (names lower-case), read with the session
module's helpers (gateway.sessions: `session_header` for the earliest present,
`bounded` for the size), not a second parser. A value is refused (no program) when it
is not printable text; one longer than `MAX_SESSION_CHARS` is replaced by its digest, as
a session id is. A program is scoped by its tenant: two tenants sending the same value
are two programs. Program and agent ids are keys of bounded maps only (gaps.py,
reserve.py), never metric labels.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from gateway.sessions import bounded, session_header

Source = Literal["agentic_context", "claude_code", "codex", "session"]

CLAUDE_PROGRAM = (b"x-claude-code-session-id", b"x-claude-code-parent-agent-id")
CLAUDE_AGENT = (b"x-claude-code-agent-id",)
CODEX_PROGRAM = (b"session-id",)
CODEX_AGENT = (b"thread-id",)
SESSION = (b"x-session-id",)


@dataclass(frozen=True, slots=True)
class ProgramId:
    tenant: str  # "" when the gateway has no tenants
    program: str
    source: Source
    agent: str | None = None  # the sub-agent within the program, None: the program alone

    def program_key(self) -> tuple[str, str]:
        """Whose tool-gap distribution a request teaches (sub-agents share it)."""
        return (self.tenant, self.program)

    def thread_key(self) -> tuple[str, str, str | None]:
        """Whose context is reserved (each sub-agent has its own)."""
        return (self.tenant, self.program, self.agent)


def clean(value: object) -> str | None:
    """A client's id as a bounded key, or None when it names nothing (not a string,
    blank, or not printable: control bytes are no one's id)."""
    if not isinstance(value, str):
        return None
    text = value.strip()
    if not text or not text.isprintable():
        return None
    return bounded(text)


def _header(headers: Iterable[tuple[bytes, bytes]], names: tuple[bytes, ...]) -> str | None:
    raw = session_header(headers, names)
    return None if raw is None else clean(raw.decode("latin-1"))


def identify(headers: Iterable[tuple[bytes, bytes]], body: Mapping[str, Any],
             tenant: str | None) -> ProgramId | None:
    """The program of a request with these ASGI `headers` and parsed `body` (module
    docstring), None when it names none."""
    scope = tenant or ""
    pairs = list(headers)
    xargs = body.get("vllm_xargs")
    if isinstance(xargs, Mapping):
        ctx = xargs.get("agentic_context")
        if isinstance(ctx, Mapping):
            program = clean(ctx.get("program_id"))
            if program is not None:
                return ProgramId(scope, program, "agentic_context", clean(ctx.get("agent_id")))
        else:
            program = clean(ctx)
            if program is not None:
                return ProgramId(scope, program, "agentic_context")
    program = _header(pairs, CLAUDE_PROGRAM)
    if program is not None:
        return ProgramId(scope, program, "claude_code", _header(pairs, CLAUDE_AGENT))
    program = _header(pairs, CODEX_PROGRAM)
    if program is not None:
        return ProgramId(scope, program, "codex", _header(pairs, CODEX_AGENT))
    program = _header(pairs, SESSION)
    if program is not None:
        return ProgramId(scope, program, "session")
    return None
