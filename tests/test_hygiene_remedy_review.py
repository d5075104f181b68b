"""A review of the remedies from outside (gateway.hygiene.remedy and where they are shown).

- Tenancy: a remedy that compares with the previous request (tool order, key order,
  history rewrite) compares with the key's own tenant's requests alone; another key's
  answers, `/stats` and page never show it, by session id, template or conversation.
- Client text: a message's role, a tool's name, any length or script, reaches a header,
  a log line or a terminal without a control character, bounded; an exception while
  writing a remedy never fails the request.
- Cost: remedies are written for the findings kept (at most 16), not for every hit of a
  prompt with thousands of ids and a thousand tools.
- The log summary's saving counts a request once per kind, at its costliest finding, as
  `/stats` and `gateway lint` do.
The pure decisions of remedy.py by table: tests/test_hygiene_remedy_table.py.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import pytest

from gateway.cli import main
from gateway.hygiene import remedy as rm
from gateway.hygiene.analyzer import HygieneAnalyzer
from gateway.hygiene.config import HygieneConfig
from gateway.hygiene.finding import Finding
from gateway.hygiene.lograte import LogLimiter
from gateway.proxy.app import create_app
from gateway.settings import AuthSettings
from gateway.usage.findings import FindingTally
from gateway.usage.record import UsageRecord
from tests.proxy_fakes import MODEL, Fake, settings, started

NOW = 1_717_250_602.0
RULES = "You are the payroll agent. Follow the payroll rules exactly and briefly. " * 30
HISTORY = "Here is every invoice of the last quarter with its due date and amount: " * 20


def tool(name: str, **props: Any) -> dict[str, Any]:
    schema = {"type": "object", "properties": props or {"q": {"type": "string"}}}
    return {"type": "function", "function": {"name": name, "description": "d",
                                             "parameters": schema}}


ALICE_TOOLS = [tool("alice_payroll_export"), tool("alice_vault_open"), tool("alice_wire")]
# alice's schema with its keys in another order
REKEYED = [dict(reversed(list(t.items()))) for t in ALICE_TOOLS]


def chat(tools: list[dict[str, Any]] | None, *turns: str) -> dict[str, Any]:
    msgs = [{"role": "system", "content": RULES}]
    msgs += [{"role": "user" if i % 2 == 0 else "assistant", "content": t}
             for i, t in enumerate(turns)]
    return {"model": MODEL, "messages": msgs, **({"tools": tools} if tools else {})}


# (what the second request changes, how it names what it continues, first, second)
PREVIOUS = {
    "tool_order, by session id": (
        "s-1", chat(ALICE_TOOLS, "q1"), chat(ALICE_TOOLS[::-1], "q1", "a1", "q2")),
    "tool_order, by template": (
        None, chat(ALICE_TOOLS, "q1"), chat(ALICE_TOOLS[::-1], "q9")),
    "json_key_order, by session id": (
        "s-1", chat(ALICE_TOOLS, "q1"), chat(REKEYED, "q1", "a1", "q2")),
    "history_rewrite, by conversation": (
        None, chat(None, "q1 " + HISTORY, HISTORY, "q2"),
        chat(None, "q1 " + HISTORY, "(summarised) " + HISTORY, "q2", "a2", "q3")),
}


@pytest.mark.parametrize("case", list(PREVIOUS))
@pytest.mark.parametrize(("first_key", "second_key", "compared"), [
    ("ka", "ka", True),  # the control: one tenant's requests are compared
    ("ka", "kb", False),
])
async def test_a_remedy_compares_with_its_own_tenants_previous_request(
        case: str, first_key: str, second_key: str, compared: bool) -> None:
    """bob sends alice's session id, template or conversation with the tools reordered,
    re-keyed or the history rewritten: his answer has no finding, no `fix=`, no
    x-gateway-fix (it would name alice's order or the place she wrote), and his /stats and
    page name none of her tools; alice's own second request does."""
    session, first, second = PREVIOUS[case]
    cfg = dataclasses.replace(settings(), auth=AuthSettings(
        keys={"ka": "alice", "kb": "bob", "kops": "ops"}, admin_tenants=("ops",)))
    app = create_app(cfg, upstream=Fake().upstream)
    records: list[UsageRecord] = []
    extra = {} if session is None else {"x-session-id": session}
    async for client in started(app, records):
        for key, doc in ((first_key, first), (second_key, second)):
            got = await client.post("/v1/chat/completions", json=doc, headers={
                "authorization": f"Bearer {key}", **extra})
            assert got.status_code == 200
        fix = got.headers.get("x-gateway-fix")
        kind = case.split(",")[0]
        if compared:
            assert fix is not None and f"first={kind}" in got.headers["x-gateway-cache"]
            assert "fix=" in got.headers["x-gateway-cache"]
            if kind == "tool_order":
                assert "the previous one ['alice_payroll_export', 'alice_vault_open'" in fix
            return
        assert fix is None, fix
        assert "findings=" not in got.headers["x-gateway-cache"]
        assert "fix=" not in got.headers["x-gateway-cache"]
        auth = {"authorization": f"Bearer {second_key}"}
        seen = (await client.get("/stats", headers=auth)).text
        seen += (await client.get("/stats?format=html", headers=auth)).text
        assert "alice" not in seen and "previous" not in seen
        ops = (await client.get("/stats", headers={"authorization": "Bearer kops"})).text
        assert "alice" in ops  # the control: the operator reads her rows


def sessioned(role: str, text: str) -> dict[str, Any]:
    return {"model": MODEL, "messages": [
        {"role": role, "content": text + RULES},
        {"role": "assistant", "content": HISTORY},
        {"role": "user", "content": "and now?"}]}


def clean(text: str) -> bool:
    return all(c.isprintable() for c in text)


@pytest.mark.parametrize("role", [
    "sys\x1b[2J\r\nX-Evil: 1",  # a terminal escape and a header/log line of its own
    "\u202eevil",  # a bidi override
    "r" * 100_000,
])
def test_a_clients_role_reaches_no_remedy_as_control_characters(role: str) -> None:
    """A message's role is the client's text: in a remedy (a log line, the terminal,
    /stats) it is shown printable and short."""
    a = HygieneAnalyzer(HygieneConfig(redact=True))
    a.scan(sessioned(role, "v1 "), "chat", "s", NOW)
    (f,) = a.scan(sessioned(role, "v2 "), "chat", "s", NOW + 1)
    assert "message 0 (" in f.remedy and clean(f.remedy), f.remedy
    assert len(f.remedy) <= rm.MAX_REMEDY_CHARS


def test_the_log_summary_line_is_one_line_whatever_the_role() -> None:
    a = HygieneAnalyzer(HygieneConfig(redact=True))
    role = "sys\r\n2026-01-01 00:00:00.000 ERROR gateway.auth: forged\x1b[2J"
    limiter = LogLimiter(60, 0, 100)  # everything held back: the summary carries it
    for i in range(3):
        limiter.admit(a.scan(sessioned(role, f"v{i} "), "chat", "s", NOW + i), NOW + i)
    got = limiter.summary(NOW + 120)
    assert got is not None and clean(got.text()), got.text()


def test_the_lint_report_shows_a_recorded_role_and_kind_without_control_characters(
        tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """A usage record's finding (a file anyone may hand to lint): its kind and role are
    printed on the terminal like its span, control characters as `?`."""
    finding = {"kind": "time\x1b]0;owned\x07stamp", "severity": "warning",
               "evidence": "drift", "message_index": 0, "role": "sys\x1b[2J",
               "char_offset": 3, "span": "<x>", "tokens_at_risk": 500, "session": None,
               "remedy": "r"}
    tools = {"kind": "uuid", "severity": "warning", "evidence": "pattern",
             "message_index": None, "role": "t\x1b[31mools", "char_offset": 3, "span": "<x>",
             "tokens_at_risk": 400, "session": None}
    rec = {"ts": NOW, "request_id": "r1", "latency_ms": 1.0, "hygiene": 2,
           "findings": [finding, tools]}
    body = {"body": sessioned("sys\x1b[2J", "v1 "), "session": "s", "ts": NOW}
    body2 = {"body": sessioned("sys\x1b[2J", "v2 "), "session": "s", "ts": NOW + 1}
    f = tmp_path / "log.jsonl"
    f.write_text("\n".join(json.dumps(x) for x in (rec, body, body2)) + "\n")
    assert main(["lint", str(f), "--now", str(NOW), "--text"]) == 0
    out = capfd.readouterr().out
    assert "\x1b" not in out and "\x07" not in out, out
    assert "message 0 (sys?[2J)" in out and "time?]0;owned?stamp" in out, out


def test_an_exception_while_writing_a_remedy_never_fails_the_request(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(w: rm.Where) -> str:
        raise RuntimeError("a bug in a remedy writer")

    monkeypatch.setitem(rm._WRITERS, "timestamp", broken)  # type: ignore[index]
    a = HygieneAnalyzer(HygieneConfig())
    body = {"model": MODEL, "messages": [
        {"role": "system", "content": "Current time: 2024-06-01T14:03:22Z. " + RULES},
        {"role": "user", "content": "q"}]}
    (f,) = a.scan(body, "chat", None, NOW)
    assert (f.kind, f.remedy) == ("timestamp", "")  # found, without a remedy


async def test_an_exception_while_writing_a_remedy_never_fails_a_proxied_request(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(w: rm.Where) -> str:
        raise RuntimeError("a bug in a remedy writer")

    monkeypatch.setitem(rm._WRITERS, "timestamp", broken)  # type: ignore[index]
    app = create_app(settings(), upstream=Fake().upstream)
    records: list[UsageRecord] = []
    async for client in started(app, records):
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        got = await client.post("/v1/chat/completions", json={"model": MODEL, "messages": [
            {"role": "system", "content": f"Current time: {stamp}. " + RULES},
            {"role": "user", "content": "q"}]})
        assert got.status_code == 200
        assert "first=timestamp" in got.headers["x-gateway-cache"]
        assert "x-gateway-fix" not in got.headers


WEIRD = ["a\r\nX-Evil: 1", "b\x1b[2J", "\u5de5\u5177\u00e9", "n" * 10_000, "\u202ez", ""]


async def test_a_thousand_tools_with_hostile_names_bound_every_header() -> None:
    """Tool names with CR LF, escapes, other scripts, 10 000 characters, a thousand of
    them, reordered: the answer is a 200, x-gateway-fix printable ASCII within the remedy's
    bound, no header carries CR or LF."""
    tools = [tool(n) for n in WEIRD] + [tool(f"t{i:04d}") for i in range(994)]
    app = create_app(settings(), upstream=Fake().upstream)
    records: list[UsageRecord] = []
    async for client in started(app, records):
        for order in (tools, tools[::-1]):
            got = await client.post("/v1/chat/completions", json=chat(order, "q1"),
                                    headers={"x-session-id": "s"})
            assert got.status_code == 200
        fix = got.headers["x-gateway-fix"]
        assert "first=tool_order" in got.headers["x-gateway-cache"]
        assert len(fix) <= rm.MAX_REMEDY_CHARS and fix.isascii() and fix.isprintable()
        assert "+994 more" in fix
        for name, value in got.headers.raw:
            assert b"\r" not in value and b"\n" not in value, name


def test_remedies_are_written_for_the_findings_kept_only(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Three thousand ids in a system prompt, a thousand tools: at most 16 findings are
    kept, and no more remedies are written than that (each one lists the tools)."""
    import uuid

    import gateway.hygiene.analyzer as analyzer

    calls = [0]
    real = analyzer.where

    def counted(*args: Any, **kw: Any) -> rm.Where:
        calls[0] += 1
        return real(*args, **kw)

    monkeypatch.setattr(analyzer, "where", counted)
    tools = [tool(f"t{i:04d}") for i in range(1000)]
    a = HygieneAnalyzer(HygieneConfig())
    for i in range(2):
        ids = " ".join(str(uuid.UUID(int=i * 10_000 + k)) for k in range(3000))
        body = {"model": MODEL, "tools": tools, "messages": [
            {"role": "system", "content": ids}, {"role": "user", "content": "q"}]}
        calls[0] = 0
        found = a.scan(body, "chat", None, NOW + i)
        assert len(found) == 16
        assert calls[0] <= 16


def fnd(kind: str, tokens: int, offset: int, remedy: str = "r") -> Finding:
    return Finding(kind, "warning", "pattern", 0 if offset < 100 else 1,
                   "system" if offset < 100 else "user", offset, "<x>", tokens, "s",
                   remedy=remedy)


def test_the_log_summarys_saving_counts_a_request_once_per_kind() -> None:
    """Two timestamps in one request (the system prompt and an earlier user message) lose
    the cache once, at the first: the summary's saving per hour is that request's costliest
    finding, as /stats' is."""
    request = [fnd("timestamp", 900, 5), fnd("timestamp", 300, 200)]
    limiter = LogLimiter(60, 0, 100)
    tally = FindingTally()
    for i in range(10):  # one such request a minute for ten minutes
        limiter.admit(request, NOW + 60 * i)
        tally.add(UsageRecord(
            ts=NOW + 60 * i, request_id=f"r{i}", tenant=None, model="m", replica="a",
            route="prefix", stream=False, status=200, prompt_tokens=2000, cached_tokens=0,
            predicted_cached_tokens=0, best_available_tokens=0, completion_tokens=1,
            ttft_ms=None, latency_ms=5.0, session=None, hygiene=2, findings=tuple(request)))
    got = limiter.summary(NOW + 600)
    assert got is not None
    (held,) = got.held
    (row,) = tally.figures(2000, 600.0)["by_kind"]
    assert held.saving_per_hour == row["saving_tokens_per_hour"] == 60 * 900
