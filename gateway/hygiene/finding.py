"""A hygiene finding (design.md section 4): where a prompt breaks or may break the prefix."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

Severity = Literal["warning", "info"]
Evidence = Literal["pattern", "drift"]


@dataclass(frozen=True, slots=True)
class Finding:
    kind: str  # timestamp, uuid, nonce, counter, tool_order, json_key_order, history_rewrite, ...
    severity: Severity
    evidence: Evidence
    message_index: int | None  # index into messages (None: tools / completions prompt)
    role: str | None  # system/user/assistant/tool, "tools" for tool definitions, "prompt"
    char_offset: int  # within that message's content (or the serialized tools / prompt)
    span: str  # the offending text, redacted unless configured otherwise
    tokens_at_risk: int  # estimated prompt tokens behind the break
    session: str | None
    line: int | None = None  # input line number, for `gateway lint`

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "kind": self.kind,
            "severity": self.severity,
            "evidence": self.evidence,
            "message_index": self.message_index,
            "role": self.role,
            "char_offset": self.char_offset,
            "span": self.span,
            "tokens_at_risk": self.tokens_at_risk,
            "session": self.session,
        }
        if self.line is not None:
            d["line"] = self.line
        return d
