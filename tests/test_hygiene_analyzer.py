"""HygieneAnalyzer: the interface the proxy calls (scan, rewrite)."""

from __future__ import annotations

import copy
from typing import Any, Literal

import orjson
import pytest

from gateway.hygiene.analyzer import HygieneAnalyzer
from gateway.hygiene.config import HygieneConfig
from gateway.hygiene.prompt import validate
from gateway.proxy.inbound import parse_inbound
from tests.hygiene_corpus.common import chat as corpus_chat

NOW = 1717250602.0  # 2024-06-01T14:03:22Z
LONG = "You are a careful assistant. Follow the rules below. " * 30


def chat(system: str, *turns: str, tools: list[Any] | None = None) -> dict[str, Any]:
    return corpus_chat(system, list(turns), tools)


def tool(name: str, props: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {"name": name, "parameters": {"type": "object", "properties": props}},
    }


def test_timestamp_in_system_prompt_is_a_warning_at_its_offset() -> None:
    a = HygieneAnalyzer(HygieneConfig(redact=False))
    f = a.scan(chat("Current time: 14:03:22. " + LONG, "hi"), "chat", "s", NOW)
    assert [(x.kind, x.severity, x.evidence, x.message_index, x.char_offset) for x in f] == [
        ("timestamp", "warning", "pattern", 0, 14)
    ]
    assert f[0].span == "14:03:22"
    assert f[0].tokens_at_risk > 300


def test_span_is_redacted_by_default() -> None:
    f = HygieneAnalyzer(HygieneConfig()).scan(
        chat("Now: 2024-06-01T14:03:22Z " + LONG, "hi"), "chat", None, NOW
    )
    assert f[0].span == "<timestamp:20 chars>"


def test_volatile_content_in_last_user_message_is_not_reported() -> None:
    a = HygieneAnalyzer(HygieneConfig())
    assert a.scan(chat(LONG, "it is 14:03:22, request id: req_9f8e7d6c5b"), "chat", "s", NOW) == []


def test_drift_names_the_changed_timestamp_and_growth_is_silent() -> None:
    a = HygieneAnalyzer(HygieneConfig())
    a.scan(chat("Time 2024-06-01T14:03:22Z. " + LONG, "q1"), "chat", "s", NOW)
    grown = chat("Time 2024-06-01T14:03:22Z. " + LONG, "q1", "a1", "q2")
    assert a.scan(grown, "chat", "s", NOW + 1) == []
    moved = chat("Time 2024-06-01T14:03:29Z. " + LONG, "q1", "a1", "q2", "a2", "q3")
    f = a.scan(moved, "chat", "s", NOW + 7)
    assert [(x.kind, x.evidence, x.severity, x.message_index, x.char_offset) for x in f] == [
        ("timestamp", "drift", "warning", 0, 5)
    ]


def test_fixed_uuid_is_info_then_silent() -> None:
    a = HygieneAnalyzer(HygieneConfig())
    system = "Tenant 123e4567-e89b-12d3-a456-426614174000. " + LONG
    first = a.scan(chat(system, "q1"), "chat", "s", NOW)
    assert [x.severity for x in first] == ["info"]
    assert a.scan(chat(system, "q1", "a1", "q2"), "chat", "s", NOW + 5) == []


@pytest.mark.parametrize(
    ("old", "new", "kind"),
    [
        (
            [tool("a", {"x": {}}), tool("b", {})],
            [tool("b", {}), tool("a", {"x": {}})],
            "tool_order",
        ),
        (
            [
                {
                    "type": "function",
                    "function": {"name": "a", "parameters": {"type": "object", "properties": {}}},
                }
            ],
            [
                {
                    "type": "function",
                    "function": {"parameters": {"properties": {}, "type": "object"}, "name": "a"},
                }
            ],
            "json_key_order",
        ),
    ],
)
def test_tool_drift(old: list[Any], new: list[Any], kind: str) -> None:
    a = HygieneAnalyzer(HygieneConfig())
    a.scan(chat(LONG, "q", tools=old), "chat", "s", NOW)
    f = a.scan(chat(LONG, "q", tools=new), "chat", "s", NOW)
    assert [(x.kind, x.role, x.message_index, x.severity) for x in f] == [
        (kind, "tools", None, "warning")
    ]


def test_history_rewrite() -> None:
    a = HygieneAnalyzer(HygieneConfig())
    a.scan(chat(LONG, "first question " * 20, "long answer " * 40, "q2"), "chat", "s", NOW)
    f = a.scan(chat(LONG, "Summary of the conversation so far.", "ok", "q3"), "chat", "s", NOW)
    assert [(x.kind, x.message_index, x.char_offset) for x in f] == [("history_rewrite", 1, 0)]



@pytest.mark.parametrize(
    ("sort_tools", "sort_keys", "changed"),
    [(False, False, False), (True, False, True), (False, True, True), (True, True, True)],
)
def test_rewrite_is_opt_in_and_never_touches_messages(
    sort_tools: bool, sort_keys: bool, changed: bool
) -> None:
    body = chat(LONG, "q", tools=[tool("b", {"z": {"type": "string"}, "a": {}}), tool("a", {})])
    before = copy.deepcopy(body)
    a = HygieneAnalyzer(HygieneConfig(rewrite_sort_tools=sort_tools, rewrite_schema_keys=sort_keys))
    assert a.rewrite(body) is changed
    assert body["messages"] == before["messages"]
    names = [t["function"]["name"] for t in body["tools"]]
    assert names == (["a", "b"] if sort_tools else ["b", "a"])
    props = next(t for t in body["tools"] if t["function"]["name"] == "b")["function"][
        "parameters"
    ]["properties"]
    assert list(props) == (["a", "z"] if sort_keys else ["z", "a"])
    assert a.rewrite(body) is False


def test_disabled_and_malformed_bodies_give_nothing() -> None:
    assert (
        HygieneAnalyzer(HygieneConfig(enabled=False)).scan(
            chat("14:03:22 " + LONG, "q"), "chat", None, NOW
        )
        == []
    )
    a = HygieneAnalyzer(HygieneConfig())
    assert a.scan({"messages": "nope"}, "chat", None, NOW) == []
    assert a.scan({"prompt": 3}, "completions", None, NOW) == []


@pytest.mark.parametrize(
    ("body", "endpoint", "found"),
    [
        ({"model": "m", "messages": [{"role": "system", "content": "14:03:22 " + LONG},
                                     {"role": "user", "content": "q"}]}, "chat", True),
        ({"model": "m", "messages": [{"role": "user", "content": "q"}], "tools": None}, "chat",
         False),
        ({"model": "m", "messages": [], "tools": [tool("f", {"a": {}})]}, "chat", False),
        ({"model": "m", "prompt": "Request ID: req_77af31bc90. " + LONG}, "completions", True),
        ({"model": "m", "prompt": ["a", "b"]}, "completions", False),
        ({"model": "m", "prompt": [1, 2, 3]}, "completions", False),
    ],
)  # fmt: skip
def test_validated_skips_only_a_check_the_proxy_already_made(
    body: dict[str, Any], endpoint: Literal["chat", "completions"], found: bool
) -> None:
    # The proxy passes validated=True for what parse_inbound accepted: that must be a body
    # validate() accepts too, and skipping the check must not change the findings.
    inbound = parse_inbound(orjson.dumps(body), endpoint)
    validate(inbound.body, endpoint)
    checked = HygieneAnalyzer(HygieneConfig()).scan(body, endpoint, "s", NOW)
    trusted = HygieneAnalyzer(HygieneConfig()).scan(
        inbound.body, endpoint, "s", NOW, validated=True
    )
    assert trusted == checked
    assert bool(checked) == found


def test_completions_prompt() -> None:
    a = HygieneAnalyzer(HygieneConfig())
    f = a.scan(
        {"model": "m", "prompt": "Request ID: req_77af31bc90. " + LONG}, "completions", None, NOW
    )
    assert [(x.kind, x.role, x.message_index, x.severity) for x in f] == [
        ("request_id", "prompt", None, "warning")
    ]
