"""x-gateway-cache and x-gateway-hygiene by table (gateway.proxy.headers)."""

from __future__ import annotations

import dataclasses

import pytest

from gateway.hygiene.finding import Finding
from gateway.proxy.headers import response_headers


def f(kind: str, severity: str, index: int | None, offset: int, tokens: int,
      role: str = "system") -> Finding:
    return Finding(kind, severity, "pattern", index, role, offset, "<x>", tokens, None)  # type: ignore[arg-type]


TS = f("timestamp", "warning", 0, 27, 1150)
UUID = f("uuid", "warning", None, 112, 1400, role="tools")
INFO = f("nonce", "info", 2, 5, 9000)


@pytest.mark.parametrize(("route", "predicted", "findings", "cache", "hygiene"), [
    ("prefix", 1184, [], "route=prefix, predicted=1184", None),
    ("cold", None, [], "route=cold", None),
    ("load", 0, [TS], "route=load, predicted=0, findings=1, first=timestamp, "
     "severity=warning, message=0, offset=27, tokens_at_risk=1150, fix=move_or_round",
     "timestamp@0:27"),
    # the warning with the most tokens behind it comes first; info only when alone
    ("prefix", 16, [TS, INFO, UUID], "route=prefix, predicted=16, findings=3, first=uuid, "
     "severity=warning, message=tools, offset=112, tokens_at_risk=1400, fix=move_id",
     "timestamp@0:27;uuid@tools:112"),
    ("prefix", 16, [INFO], "route=prefix, predicted=16, findings=1, first=nonce, "
     "severity=info, message=2, offset=5, tokens_at_risk=9000, fix=drop_nonce", None),
    # a kind outside the vocabulary is quoted, never a separator
    ("prefix", None, [f('a, b="c"', "warning", 0, 1, 70)],
     'route=prefix, findings=1, first="a, b=c", severity=warning, message=0, offset=1, '
     'tokens_at_risk=70, fix=keep_prefix_stable', 'a, b="c"@0:1'),
])  # fmt: skip
def test_headers(route: str, predicted: int | None, findings: list[Finding], cache: str,
                 hygiene: str | None) -> None:
    got = dict(response_headers(route, predicted, findings, enabled=True))
    assert got[b"x-gateway-cache"].decode() == cache
    assert (got.get(b"x-gateway-hygiene") or b"").decode() == (hygiene or "")
    assert response_headers(route, predicted, findings, enabled=False) == []


@pytest.mark.parametrize(("remedy", "shown"), [
    ("", None),  # a finding read back from a record made before remedies: no header
    ("move the time from message 0 (system) into the last user message (message 3)",
     "move the time from message 0 (system) into the last user message (message 3)"),
    # a tool name in another script never reaches the header as bytes it cannot carry
    ("sort the tools: ['b\u00e9', '\u5de5\u5177']", "sort the tools: ['b?', '??']"),
])
def test_the_first_findings_remedy_in_its_own_header(remedy: str, shown: str | None) -> None:
    first = dataclasses.replace(UUID, remedy=remedy)
    other = dataclasses.replace(TS, remedy="not this one: fewer tokens at risk")
    got = dict(response_headers("prefix", 16, [other, first], enabled=True))
    assert got.get(b"x-gateway-fix") == (None if shown is None else shown.encode("ascii"))
    assert b"fix=move_id" in got[b"x-gateway-cache"]
