"""The hygiene analyzer's scan as it was before it followed what is new in a request: every
request walks every part (parse, the pattern-hit lookups of every scanned part, the common
prefix, drift from the first part, a snapshot built from scratch, every conversation
message recorded). Kept verbatim as the reference the incremental scan must equal
(tests/test_property_hygiene_incremental.py), and the parse as it was, one call per message
(`whole_parse`); the findings, remedies and template keys
come from the analyzer's own methods, which the incremental path does not change."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import Any, Literal

import xxhash

from gateway.hygiene.analyzer import HygieneAnalyzer
from gateway.hygiene.drift import Snapshot, diverge
from gateway.hygiene.finding import Finding
from gateway.hygiene.prompt import (
    TEMPLATE_OVERHEAD,
    Part,
    Prompt,
    _content,
    _part,
    _tools,
    parse,
    validate,
)

_SCANNED_ROLES = frozenset({"system", "developer", "user", "tools", "prompt"})
_HEAD_PARTS = frozenset({"system", "developer", "tools", "prompt"})
_MIN_IDENTIFYING_CHARS = 24
_MAX_VALUES = 512
_MAX_FINDINGS = 16


class WholeAnalyzer(HygieneAnalyzer):
    def scan(
        self,
        body: Mapping[str, Any],
        endpoint: Literal["chat", "completions"],
        session: str | None,
        now: float,
        *,
        validated: bool = False,
        tenant: str | None = None,
    ) -> list[Finding]:
        if not self.config.enabled:
            return []
        if not validated:
            try:
                validate(body, endpoint)
            except ValueError:
                return []
        p = parse(body, endpoint)
        if not p.parts:
            return []
        scanned = [
            k
            for k, part in enumerate(p.parts)
            if part.role in _SCANNED_ROLES and (k < p.last_user or endpoint == "completions")
        ]
        hits = {k: self._hits_of(p, k) for k in scanned}
        state: OrderedDict[Any, Snapshot]
        key: Any
        conv: int | None = None
        messages: list[int] = []
        talk = [part for part in p.parts if part.role not in _HEAD_PARTS]
        if session is None:
            least = _MIN_IDENTIFYING_CHARS + TEMPLATE_OVERHEAD
            messages = [_scoped(tenant, part.digest) for part in talk if part.size >= least]
            earlier = messages[:-1] if talk and talk[-1].size >= least else messages
            conv = self._owners.find(earlier)
            if conv is not None and conv not in self._conversations:
                conv = None
        head_only = session is None and conv is None
        if session is not None:
            state, key, cap = self._sessions, (tenant, session), self.config.max_sessions
        elif conv is not None:
            state, key, cap = self._conversations, conv, self.config.max_sessions
        else:
            state, key, cap = (
                self._templates,
                (tenant, self._template_key(body, p)),
                self.config.max_templates,
            )
        old = state.get(key)
        findings: list[Finding] = []
        same = 0
        seen: frozenset[str] = frozenset()
        if old is not None:
            same = _same_prefix(old, p)
            seen = old.values
            d = diverge(old, p, head_only=head_only, known=hits)
            if d is not None:
                findings.append(self._drift_finding(p, d, session, head_only=head_only,
                                                    before=old.tool_names))
        findings.extend(self._pattern_findings(p, hits, same, seen, findings, session, now,
                                               _MAX_FINDINGS - len(findings)))
        values = (
            frozenset(p.parts[k].text[h.start : h.end] for k in scanned for h in hits[k])
            if hits
            else frozenset()
        )
        if len(values) > _MAX_VALUES:
            values = frozenset(sorted(values)[:_MAX_VALUES])
        snapshot = Snapshot.of(p, values, self.config.drift_text_chars)
        _remember(state, key, snapshot, cap)
        if session is None and talk:
            if conv is None:
                conv = self._owners.open()
            else:
                template = (tenant, self._template_key(body, p))
                _remember(self._templates, template, snapshot, self.config.max_templates)
            _remember(self._conversations, conv, snapshot, self.config.max_sessions)
            self._owners.record(conv, messages)
        return findings[:_MAX_FINDINGS]


def _scoped(tenant: str | None, digest: int) -> int:
    if tenant is None:
        return digest
    return xxhash.xxh3_64_intdigest(tenant.encode("utf-8", "surrogatepass"), seed=digest)


def _same_prefix(old: Snapshot, p: Prompt) -> int:
    n = 0
    for o, part in zip(old.parts, p.parts, strict=False):
        if o.digest != part.digest or o.role != part.role:
            break
        n += 1
    return n


def _remember(state: OrderedDict[Any, Snapshot], key: Any, snapshot: Snapshot,
              cap: int) -> None:
    state[key] = snapshot
    state.move_to_end(key)
    if len(state) > cap:
        state.popitem(last=False)


def whole_parse(body: Mapping[str, Any]) -> Prompt:
    """`prompt.parse` of a chat body as it was: one `_part` call per message and the
    suffix sums in a Python loop."""
    parts: list[Part] = []
    tools: tuple[Any, ...] = ()
    last_user = -1
    raw_tools = body.get("tools")
    if isinstance(raw_tools, list) and raw_tools:
        tools, tools_text = _tools(raw_tools)
        parts.append(_part(None, "tools", tools_text, ""))
    msgs = body.get("messages")
    for i, m in enumerate(msgs if isinstance(msgs, list) else ()):
        if type(m) is not dict and not isinstance(m, Mapping):
            continue
        role = str(m.get("role", ""))
        content = m.get("content")
        if type(content) is str and len(m) == 2 and "role" in m:
            text, extra = content, ""
        else:
            text, extra = _content(m)
        if role == "user":
            last_user = len(parts)
        parts.append(_part(i, role, text, extra))
    suffix = [0] * (len(parts) + 1)
    acc = 0
    for k in range(len(parts) - 1, -1, -1):
        acc += parts[k].size
        suffix[k] = acc
    return Prompt(endpoint="chat", parts=tuple(parts), tools=tools,
                  last_user=last_user if last_user >= 0 else len(parts), suffix=tuple(suffix))
