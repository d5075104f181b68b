"""remedy.py's decisions, pure, by table (rows that catch each mutation), and what the
gateway's own rewrites fix (review of the remedies from outside; tenancy, client text, cost
and the log summary's saving in tests/test_hygiene_remedy_review.py)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from gateway.hygiene import remedy as rm
from gateway.hygiene.analyzer import HygieneAnalyzer
from gateway.hygiene.config import HygieneConfig
from gateway.hygiene.prompt import parse
from gateway.proxy.app import create_app
from gateway.usage.findings import FindingTally
from gateway.usage.record import UsageRecord
from tests.proxy_fakes import MODEL, Fake, settings, started
from tests.test_hygiene_remedy_review import (
    ALICE_TOOLS,
    NOW,
    REKEYED,
    chat,
    fnd,
    sessioned,
    tool,
)


def prompt(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
           endpoint: str = "chat") -> Any:
    body: dict[str, Any] = {"messages": messages} if endpoint == "chat" else {
        "prompt": "p" * 50}
    if tools:
        body["tools"] = tools
    return parse(body, endpoint)


SYS = {"role": "system", "content": "s" * 50}
USER = {"role": "user", "content": "u" * 50}
ASST = {"role": "assistant", "content": "a" * 50}


@pytest.mark.parametrize(("p", "expected"), [
    (prompt([SYS, USER, ASST, USER]), "the last user message (message 3)"),
    (prompt([SYS, ASST]), "a message after message 1"),  # no user message
    (prompt([], [tool("x")]), "the end of the messages"),  # tools alone
    (prompt([], endpoint="completions"), "the end of the prompt"),
])  # fmt: skip
def test_where_per_request_content_belongs(p: Any, expected: str) -> None:
    assert rm.target(p) == expected


def test_where_a_finding_sits() -> None:
    tools = [tool("first"), tool("second")]
    p = prompt([SYS, USER], tools)
    t0, t1 = p.tools
    assert rm.where(p, 0, t0.offset).place == "tool 'first' in the tool definitions"
    assert rm.where(p, 0, t1.offset).tool == "second"
    # the last character of the first tool, and the comma after it, are still the first's
    assert rm.where(p, 0, t0.offset + len(t0.text) - 1).tool == "first"
    assert rm.where(p, 0, t0.offset + len(t0.text)).tool == "first"
    assert rm.where(p, 0, 0).place == "the tool definitions"  # the "[" itself
    assert rm.where(p, 1, 3).place == "message 0 (system)"
    assert rm.where(prompt([], endpoint="completions"), 0, 3).place == "the prompt"


@pytest.mark.parametrize(("names", "shown"), [
    (["a" * 24], "['" + "a" * 24 + "']"),  # 24 characters: whole
    (["a" * 25], "['" + "a" * 21 + "...']"),  # 25: cut to 24 with the dots
    ([str(i) for i in range(6)], "['0', '1', '2', '3', '4', '5']"),
    ([str(i) for i in range(7)], "['0', '1', '2', '3', '4', '5', +1 more]"),
])  # fmt: skip
def test_tool_names_shown(names: list[str], shown: str) -> None:
    assert rm._names(names) == shown


def W(**kw: Any) -> rm.Where:
    base = dict(place="message 0 (system)", target="the last user message (message 3)",
                offset=40, time_of_day=True, tool="", names=(), before=())
    return rm.Where(**{**base, **kw})


@pytest.mark.parametrize(("kind", "w", "expected"), [
    ("json_key_order", W(tool=""),
     "serialize the tools with its JSON keys in one fixed order (e.g. sorted): its key "
     "order changed since the last request; or set [hygiene] rewrite_schema_keys"),
    ("volatile_span", W(),
     "keep message 0 (system) identical from request to request (it changed at character "
     "40); put what changes into the last user message (message 3)"),
    # a kind without a writer of its own
    ("something_new", W(),
     "keep message 0 (system) identical from request to request; put what changes into "
     "the last user message (message 3)"),
])  # fmt: skip
def test_the_remedies_no_corpus_family_reaches(kind: str, w: rm.Where, expected: str) -> None:
    assert rm.remedy(kind, w) == expected


def test_a_remedy_is_cut_to_its_bound() -> None:
    exact = "x" * rm.MAX_REMEDY_CHARS
    assert rm._cut(exact) == exact
    assert rm._cut(exact + "y") == "x" * (rm.MAX_REMEDY_CHARS - 3) + "..."
    assert rm.fix_code("something_new") == "keep_prefix_stable"
    assert rm.fix_code("volatile_span") == "keep_head_fixed"


@pytest.mark.parametrize(("tokens", "span", "expected"), [
    (100, 3600.0, 100),
    (100, 60.0, 6000),
    (100, 59.0, 6000),  # under a minute counts as a minute
    (100, -500.0, 6000),  # a clock that went back: never negative, never a division by 0
    (100, 0.0, 6000),
    (0, 0.0, 0),
])  # fmt: skip
def test_per_hour(tokens: int, span: float, expected: int) -> None:
    assert rm.per_hour(tokens, span) == expected


STATUS = {"role": "user", "content": "What is the status of the build today?"}
STEADY = " Follow the rules of the repository and explain every change." * 60


def dated(value: str) -> dict[str, Any]:
    return {"model": MODEL, "messages": [
        {"role": "system", "content": f"Date: {value}." + STEADY}, STATUS]}


# A bare date is moved or kept (it breaks the cache once a day), a time of day or an instant
# moved or rounded: the pattern's own verdict (warnings and `info` alike), and the drift's.
DATE = "move the date from message 0 (system) into the last user message (message 1), or keep"
TIME = "move the time from message 0 (system) into the last user message (message 1), after"


@pytest.mark.parametrize(("value", "expected"), [
    ("2024-06-01", DATE), ("1 Jun 2024", DATE),  # info: a date of today
    ("2024-06-01T14:03:22Z", TIME), ("1717250602", TIME), ("2024-06-01 14:03", TIME),
])  # fmt: skip
def test_a_timestamp_pattern_is_moved_or_rounded_by_what_it_names(value: str,
                                                                  expected: str) -> None:
    (f,) = HygieneAnalyzer(HygieneConfig()).scan(dated(value), "chat", None, NOW)
    assert f.kind == "timestamp" and f.remedy.startswith(expected), f


@pytest.mark.parametrize(("before", "after", "expected"), [
    ("2024-06-01", "2024-06-02", DATE), ("1 Jun 2024", "2 Jun 2024", DATE),
    ("2024-06-01T14:03:22Z", "2024-06-01T14:04:22Z", TIME),
    ("1717250602", "1717250662", TIME), ("14:03:22", "14:04:22", TIME),
])  # fmt: skip
@pytest.mark.parametrize("session", ["s", None])
def test_a_timestamp_drift_is_moved_or_rounded_by_what_it_names(
        before: str, after: str, expected: str, session: str | None) -> None:
    a = HygieneAnalyzer(HygieneConfig())
    a.scan(dated(before), "chat", session, NOW)
    (f,) = a.scan(dated(after), "chat", session, NOW + 60)
    assert (f.kind, f.evidence) == ("timestamp", "drift")
    assert f.remedy.startswith(expected), f


def test_a_drift_span_no_pattern_reads_is_a_time() -> None:
    """The drift's span may not parse as a timestamp of its own: rounding is the safe
    advice; other kinds do not ask."""
    from gateway.hygiene.analyzer import _time_of_day

    assert _time_of_day("timestamp", "4") is True
    assert _time_of_day("timestamp", "2024-06-02") is False
    assert _time_of_day("uuid", "2024-06-02") is True


def test_a_long_role_is_cut_like_a_tool_name() -> None:
    a = HygieneAnalyzer(HygieneConfig())
    a.scan(sessioned("r" * 1000, "va "), "chat", "s", NOW)
    (f,) = a.scan(sessioned("r" * 1000, "vb "), "chat", "s", NOW + 1)
    assert f"message 0 ({'r' * 21}...)" in f.remedy, f.remedy


def test_a_remedy_is_printable_whatever_its_writer_was_given() -> None:
    got = rm.remedy("volatile_span", W(place="message 0 (a\r\nb\x1b[2J)"))
    assert got.startswith("keep message 0 (a??b?[2J) identical"), got


@pytest.mark.parametrize(("kind", "code"), [
    ("timestamp", "move_or_round"), ("uuid", "move_id"), ("request_id", "move_id"),
    ("nonce", "drop_nonce"), ("counter", "drop_counter"), ("tool_order", "sort_tools"),
    ("json_key_order", "sort_keys"), ("history_rewrite", "append_only"),
    ("whitespace", "keep_whitespace"), ("volatile_span", "keep_head_fixed"),
    ("something_new", "keep_prefix_stable"),
])  # fmt: skip
def test_each_kind_has_its_fix_code(kind: str, code: str) -> None:
    assert rm.fix_code(kind) == code


def test_a_rows_remedy_is_its_newest_requests() -> None:
    """Within one bucket, the newest request's remedy, whatever order records arrive in."""
    def record(ts: float, remedy: str) -> UsageRecord:
        return UsageRecord(
            ts=ts, request_id=f"r{ts}", tenant="t", model="m", replica="a", route="prefix",
            stream=False, status=200, prompt_tokens=2000, cached_tokens=0,
            predicted_cached_tokens=0, best_available_tokens=0, completion_tokens=1,
            ttft_ms=None, latency_ms=5.0, session=None, hygiene=1,
            findings=(fnd("timestamp", 100, 5, remedy),))

    tally = FindingTally()
    for ts, remedy in ((NOW, "old"), (NOW + 2, "new"), (NOW + 1, "late but older")):
        tally.add(record(ts, remedy))
    figures = tally.figures(2000, 60.0)
    assert [r["remedy"] for r in figures["by_kind"]] == ["new"]
    assert [r["remedy"] for r in figures["by_tenant"]["t"]] == ["new"]


@pytest.mark.parametrize(("rewrite", "second", "kind"), [
    ("rewrite_sort_tools", ALICE_TOOLS[::-1], "tool_order"),
    ("rewrite_schema_keys", REKEYED, "json_key_order"),
])
@pytest.mark.parametrize("on", [False, True])
async def test_what_the_gateways_rewrite_fixes_is_no_finding(
        rewrite: str, second: list[dict[str, Any]], kind: str, on: bool) -> None:
    """With `[hygiene] rewrite_sort_tools` (`rewrite_schema_keys`) the engine receives the
    tools in one order (keys) whatever the client sends: a changed order is no break, so
    no finding, and no remedy telling the operator to set what is set. Off: the finding."""
    cfg = dataclasses.replace(settings(), hygiene=HygieneConfig(**{rewrite: on}))
    fake = Fake()
    app = create_app(cfg, upstream=fake.upstream)
    records: list[UsageRecord] = []
    async for client in started(app, records):
        for tools in (ALICE_TOOLS, second):
            got = await client.post("/v1/chat/completions", json=chat(tools, "q1"),
                                    headers={"x-session-id": "s"})
            assert got.status_code == 200
    sent = [json.dumps(json.loads(r.body or b"{}")["tools"])  # in the order sent
            for r in fake.inference_requests()]
    assert (sent[0] == sent[1]) is on  # what the engine saw
    assert (f"first={kind}" in got.headers["x-gateway-cache"]) is not on, got.headers
    assert ("x-gateway-fix" in got.headers) is not on


@pytest.mark.parametrize(("names", "before", "expected"), [
    # this request's order is not sorted: sort them
    (("b", "a"), ("a", "b"), "sort the tools by name ['a', 'b']: this request sent ['b', "
     "'a'], the previous one ['a', 'b']; or set [hygiene] rewrite_sort_tools"),
    # it is: the previous one was not; telling the client to sort what it sorted is no fix
    (("a", "b"), ("b", "a"), "keep the tools sorted by name as this request sent them "
     "['a', 'b']: the previous one sent ['b', 'a']; or set [hygiene] rewrite_sort_tools"),
])  # fmt: skip
def test_a_tool_order_remedy_says_whether_this_request_sorted_them(
        names: tuple[str, ...], before: tuple[str, ...], expected: str) -> None:
    assert rm.remedy("tool_order", W(names=names, before=before)) == expected
