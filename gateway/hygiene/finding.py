"""A hygiene finding (design.md section 4): where a prompt breaks or may break the prefix."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final, Literal

from gateway.hygiene.remedy import MAX_REMEDY_CHARS

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
    # What to do about it, written for this finding (gateway.hygiene.remedy); what it saves
    # per request is `tokens_at_risk`.
    remedy: str = ""

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
            "remedy": self.remedy,
        }
        if self.line is not None:
            d["line"] = self.line
        return d


_INTS: Final = ("char_offset", "tokens_at_risk")


def findings_from_json(value: Any) -> tuple[Finding, ...]:
    """The findings of a usage record's `findings` list (None: none); ValueError names
    what is wrong."""
    if value is None:
        return ()
    if not isinstance(value, list):
        raise ValueError("field 'findings' must be a list")
    out: list[Finding] = []
    for f in value:
        if not isinstance(f, dict) or not isinstance(f.get("kind"), str) \
                or f.get("severity") not in ("warning", "info") \
                or f.get("evidence") not in ("pattern", "drift"):
            raise ValueError(f"a finding must name kind, severity and evidence: {f!r:.200}")
        for key in _INTS:
            v = f.get(key)
            if isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(f"finding field {key!r} must be an integer")
        index = f.get("message_index")
        out.append(Finding(
            kind=f["kind"], severity=f["severity"], evidence=f["evidence"],
            message_index=index if isinstance(index, int) and not isinstance(index, bool)
            else None,
            role=f["role"] if isinstance(f.get("role"), str) else None,
            char_offset=f["char_offset"], span=str(f.get("span", "")),
            tokens_at_risk=f["tokens_at_risk"],
            session=f["session"] if isinstance(f.get("session"), str) else None,
            # records written before remedies existed have none
            remedy=str(f.get("remedy") or "")[:MAX_REMEDY_CHARS]))
    return tuple(out)
