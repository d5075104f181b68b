"""Every finding says how to fix it and what fixing it saves (gateway.hygiene.remedy).

By table over the hygiene corpus (tests/hygiene_corpus, the cases the precision and recall
tests use): for each family, every warning found where the case expects it carries a
remedy written for that finding (its place, where the value belongs in that very request,
the tools in the order this and the previous request sent them, the tool whose keys
moved, the character where the history or the whitespace changed), read back from the
request body here rather than from the analyzer, and a saving: tokens at risk per request,
and per hour at the traffic the stats windows saw. Then the tenancy of that saving: a key
reads the saving of its own tenant's requests alone.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any, Literal

import pytest

from gateway.hygiene.analyzer import HygieneAnalyzer
from gateway.hygiene.config import HygieneConfig
from gateway.hygiene.finding import Finding
from gateway.usage.config import UsageConfig
from gateway.usage.exposure import stats_view
from gateway.usage.metrics import GatewayMetrics
from gateway.usage.record import UsageRecord
from gateway.usage.recorder import UsageRecorder
from gateway.usage.stats import UsageWindows
from tests.hygiene_corpus.cases import FAMILIES, Case, Req, generate

CASES = generate()
START = 1_700_000_000.0


def found(case: Case) -> list[tuple[Req, Req | None, Finding]]:
    """(request, the one before it, finding) for each warning of the expected kind at the
    expected place."""
    a = HygieneAnalyzer(HygieneConfig(redact=False))  # the span names the tool it sits in
    out = []
    before: Req | None = None
    for r in case.requests:
        endpoint: Literal["chat", "completions"] = "chat" if r.endpoint == "chat" else "completions"
        for f in a.scan(r.body, endpoint, r.session, r.now):
            if (f.severity == "warning" and f.kind == case.expect
                    and (f.message_index, f.role) == case.where):
                out.append((r, before, f))
        before = r
    return out


def place(f: Finding, r: Req) -> str:
    if f.message_index is not None:
        return f"message {f.message_index} ({f.role})"
    if f.role == "tools":
        tool = next(t for t in r.body["tools"] if f.span in json.dumps(t))
        return f"tool {tool['function']['name']!r} in the tool definitions"
    return "the prompt"


def target(r: Req) -> str:
    """Where per-request content belongs in this request, read from its body."""
    if r.endpoint != "chat":
        return "the end of the prompt"
    users = [i for i, m in enumerate(r.body["messages"]) if m.get("role") == "user"]
    return f"the last user message (message {users[-1]})"


def names(r: Req | None) -> list[str]:
    assert r is not None
    return [t["function"]["name"] for t in r.body.get("tools") or ()]


def listed(ns: list[str]) -> str:
    """A list of tool names as a remedy shows it: the first six, then how many more."""
    more = [f"+{len(ns) - 6} more"] if len(ns) > 6 else []
    return "[" + ", ".join([repr(n) for n in ns[:6]] + more) + "]"


def moved_keys(r: Req, before: Req | None) -> str:
    """The first tool whose keys changed order between the two requests."""
    assert before is not None
    return next(t["function"]["name"] for t, o in zip(r.body["tools"], before.body["tools"],
                                                      strict=True) if _keys(t) != _keys(o))


def _keys(x: Any) -> Any:
    if isinstance(x, Mapping):
        return [(k, _keys(v)) for k, v in x.items()]
    if isinstance(x, list):
        return [_keys(v) for v in x]
    return x


Expect = Callable[[Req, Req | None, Finding], str]
# The remedy each family must carry, written from the request as this test reads it.
REMEDIES: dict[str, Expect] = {
    "timestamp": lambda r, _, f: (
        f"move the time from {place(f, r)} into {target(r)}, after the cached prefix, or round "
        "it to the day" if ":" in f.span or f.span.isdigit()  # a clock time, epoch seconds
        else f"move the date from {place(f, r)} into {target(r)}, or keep it: it breaks the "
        "cache once a day"),
    "uuid": lambda r, _, f: (
        f"take the per-request id out of {place(f, r)}: send it as a header or in `metadata`, "
        f"keep it the same for the whole session, or move it into {target(r)}"),
    "request_id": lambda r, _, f: (
        f"take the per-request id out of {place(f, r)}: send it as a header or in `metadata`, "
        f"keep it the same for the whole session, or move it into {target(r)}"),
    "nonce": lambda r, _, f: (
        f"drop the random value from {place(f, r)} or draw it once per session; if the model "
        f"needs it, move it into {target(r)}"),
    "counter": lambda r, _, f: (
        f"drop the turn counter from {place(f, r)} (the messages already show the turns) or "
        f"move it into {target(r)}"),
    "tool_order": lambda r, b, _: (
        f"keep the tools sorted by name as this request sent them {listed(names(r))}: the "
        f"previous one sent {listed(names(b))}; or set [hygiene] rewrite_sort_tools"
        if names(r) == sorted(names(r))
        else f"sort the tools by name {listed(sorted(names(r)))}: this request sent "
        f"{listed(names(r))}, the previous one {listed(names(b))}; or set [hygiene] "
        "rewrite_sort_tools"),
    "json_key_order": lambda r, b, _: (
        f"serialize tool {moved_keys(r, b)!r} with its JSON keys in one fixed order (e.g. "
        "sorted): its key order changed since the last request; or set [hygiene] "
        "rewrite_schema_keys"),
    "history_rewrite": lambda r, _, f: (
        f"append to the conversation instead of rewriting it: {place(f, r)} changed at "
        f"character {f.char_offset} since the last request; send earlier messages "
        "byte-identical"),
    "whitespace": lambda r, _, f: (
        f"send {place(f, r)} with the whitespace it had (a strip or re-wrap changed it at "
        f"character {f.char_offset}); keep earlier text byte-identical"),
}


def rec(ts: float, tenant: str | None, findings: tuple[Finding, ...]) -> UsageRecord:
    return UsageRecord(ts=ts, request_id=f"r{ts}", tenant=tenant, model="m", replica="a",
                       route="prefix", stream=False, status=200, prompt_tokens=2000,
                       cached_tokens=0, predicted_cached_tokens=0, best_available_tokens=0,
                       completion_tokens=1, ttft_ms=None, latency_ms=5.0, session=None,
                       hygiene=len(findings), findings=findings)


def test_the_table_covers_every_family_of_the_corpus() -> None:
    assert set(REMEDIES) == set(FAMILIES)


@pytest.mark.parametrize("family", FAMILIES)
def test_each_finding_carries_its_own_remedy_and_a_saving(family: str) -> None:
    rows = [row for c in CASES if c.expect == family for row in found(c)]
    assert len(rows) >= 27, family  # the corpus's recall (>= 0.9 of 30 cases) at least
    for r, before, f in rows:
        assert f.remedy == REMEDIES[family](r, before, f), (f, r.body)
        assert f.tokens_at_risk > 0
    # per hour: the finding once a minute for ten minutes is sixty times its cost an hour
    f = rows[0][2]
    w = UsageWindows(bucket_s=10.0)
    for i in range(10):
        w.add(rec(START + 60 * i, None, (f,)))
    h = w.summary(START + 600, 3600.0, since=START)["hygiene"]
    (row,) = [x for x in h["by_kind"] if x["kind"] == family]
    assert row["saving_tokens_per_hour"] == 60 * f.tokens_at_risk > 0
    assert row["remedy"] == f.remedy


def finding(kind: str, tokens: int, remedy: str) -> Finding:
    return Finding(kind, "warning", "drift", 0, "system", 3, "<x>", tokens, None,
                   remedy=remedy)


def test_a_key_reads_the_saving_of_its_own_tenants_traffic() -> None:
    """Two tenants, the same kind of finding at different rates: each key's `/stats` shows
    the saving per hour and the remedy of its own requests, never the other's nor the sum;
    the operator reads both and the fleet's total."""
    alice = finding("timestamp", 300, "move the time from message 0 (system) into the last "
                    "user message (message 1), after the cached prefix, or round it to the day")
    bob = finding("timestamp", 1000, "move the time from message 0 (system) into the last "
                  "user message (message 5), after the cached prefix, or round it to the day")
    r = UsageRecorder(UsageConfig(), GatewayMetrics(), started_at=START)
    for i in range(20):  # alice: one request every 30 s for 10 minutes
        r.record(rec(START + 30 * i, "alice", (alice,)))
    for i in range(2):  # bob: two requests in the same 10 minutes
        r.record(rec(START + 300 * i, "bob", (bob,)))
    stats = r.stats(START + 600, {})
    # 20 x 300 and 2 x 1000 tokens in 600 s
    expect = {"alice": (120 * 300, alice.remedy), "bob": (12 * 1000, bob.remedy)}
    for tenant, other in (("alice", "bob"), ("bob", "alice")):
        seen = stats_view(stats, "tenant", tenant)["hygiene"]
        assert set(seen["by_tenant"]) == {tenant}, seen
        (row,) = seen["by_tenant"][tenant]
        assert (row["saving_tokens_per_hour"], row["remedy"]) == expect[tenant]
        assert "by_kind" not in seen and "tokens_at_risk" not in seen
        assert {x["remedy"] for x in seen["latest"]} == {expect[tenant][1]}
        assert other not in str(seen)
    (fleet,) = stats_view(stats, "operator")["hygiene"]["by_kind"]
    assert fleet["saving_tokens_per_hour"] == 120 * 300 + 12 * 1000


@pytest.mark.parametrize(("covered", "tokens", "per_hour"), [
    (3600.0, 5000, 5000),
    (600.0, 5000, 30000),
    # the first seconds after a start count as a minute: two requests in 2 s are not
    # 3600 requests an hour
    (2.0, 5000, 300000),
    (None, 5000, None),
])
def test_the_rate_over_the_span_the_window_covers(covered: float | None, tokens: int,
                                                  per_hour: int | None) -> None:
    from gateway.usage.findings import FindingTally

    t = FindingTally()
    t.add(rec(START, "x", (finding("nonce", tokens, "r"),)))
    (row,) = t.figures(10_000, covered)["by_kind"]
    assert row["saving_tokens_per_hour"] == per_hour
