"""Responses and Messages bodies as the chat request vLLM renders (tables), the response
affinity map and its placement decision."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.routing import messages_api, responses_api
from gateway.routing.affinity import Lost, Pinned, ResponseAffinity, place
from gateway.routing.normalize import NormalizeError, canonical_bytes

SYS = "You are terse."
TOOL_CHAT = {"type": "function", "function": {"name": "ls", "description": "list",
                                              "parameters": {"type": "object"}}}


def chat(*messages: dict[str, Any], tools: list[Any] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"messages": list(messages)}
    if tools:
        out["tools"] = tools
    return out


RESPONSES = [
    ("string input", {"input": "hi"}, chat({"role": "user", "content": "hi"})),
    ("instructions", {"instructions": SYS, "input": "hi"},
     chat({"role": "system", "content": SYS}, {"role": "user", "content": "hi"})),
    ("input_text parts",
     {"input": [{"role": "user", "content": [{"type": "input_text", "text": "a"},
                                             {"type": "input_text", "text": "b"}]}]},
     chat({"role": "user", "content": [{"type": "text", "text": "a"},
                                       {"type": "text", "text": "b"}]})),
    ("function call merged into the assistant turn, then its output",
     {"input": [{"role": "user", "content": "go"},
                {"type": "message", "role": "assistant",
                 "content": [{"type": "output_text", "text": "ok"}]},
                {"type": "function_call", "call_id": "c1", "name": "ls", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "a.txt"}]},
     chat({"role": "user", "content": "go"},
          {"role": "assistant", "content": [{"type": "text", "text": "ok"}],
           "tool_calls": [{"id": "c1", "type": "function",
                           "function": {"name": "ls", "arguments": "{}"}}]},
          {"role": "tool", "tool_call_id": "c1", "content": "a.txt"})),
    ("a call without a preceding assistant message opens one",
     {"input": [{"type": "function_call", "call_id": "c", "name": "ls", "arguments": "{}"}]},
     chat({"role": "assistant", "content": None, "tool_calls": [
         {"id": "c", "type": "function", "function": {"name": "ls", "arguments": "{}"}}]})),
    ("reasoning items are not rendered",
     {"input": [{"type": "reasoning", "summary": []}, {"role": "user", "content": "x"}]},
     chat({"role": "user", "content": "x"})),
    ("flat function tools become chat tools",
     {"input": "hi", "tools": [{"type": "function", "name": "ls", "description": "list",
                                "parameters": {"type": "object"}}]},
     chat({"role": "user", "content": "hi"}, tools=[TOOL_CHAT])),
]


@pytest.mark.parametrize(("body", "expected"), [r[1:] for r in RESPONSES],
                         ids=[r[0] for r in RESPONSES])
def test_responses_chat_view(body: dict[str, Any], expected: dict[str, Any]) -> None:
    assert responses_api.chat_view(body) == expected


MESSAGES = [
    ("string system and content",
     {"system": SYS, "messages": [{"role": "user", "content": "hi"}]},
     chat({"role": "system", "content": SYS}, {"role": "user", "content": "hi"})),
    ("system blocks joined, billing header dropped, cache_control ignored",
     {"system": [{"type": "text", "text": "x-anthropic-billing-header: cch=1f2e;"},
                 {"type": "text", "text": "A. "},
                 {"type": "text", "text": "B.", "cache_control": {"type": "ephemeral"}}],
      "messages": [{"role": "user", "content": [
          {"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}]}]},
     chat({"role": "system", "content": "A. B."}, {"role": "user", "content": "hi"})),
    ("tool use and result",
     {"messages": [
         {"role": "user", "content": "go"},
         {"role": "assistant", "content": [
             {"type": "text", "text": "Listing."},
             {"type": "tool_use", "id": "t1", "name": "ls", "input": {"path": "."}}]},
         {"role": "user", "content": [
             {"type": "tool_result", "tool_use_id": "t1",
              "content": [{"type": "text", "text": "a.txt"}]}]}]},
     chat({"role": "user", "content": "go"},
          {"role": "assistant", "content": "Listing.", "tool_calls": [
              {"id": "t1", "type": "function",
               "function": {"name": "ls", "arguments": '{"path":"."}'}}]},
          {"role": "tool", "tool_call_id": "t1", "content": "a.txt"})),
    ("thinking is not rendered",
     {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": [
         {"type": "thinking", "thinking": "hmm"}, {"type": "text", "text": "a"}]}]},
     chat({"role": "user", "content": "q"}, {"role": "assistant", "content": "a"})),
    ("tools with input_schema",
     {"messages": [{"role": "user", "content": "hi"}],
      "tools": [{"name": "ls", "description": "list", "input_schema": {"type": "object"},
                 "cache_control": {"type": "ephemeral"}}]},
     chat({"role": "user", "content": "hi"}, tools=[TOOL_CHAT])),
]


@pytest.mark.parametrize(("body", "expected"), [r[1:] for r in MESSAGES],
                         ids=[r[0] for r in MESSAGES])
def test_messages_chat_view(body: dict[str, Any], expected: dict[str, Any]) -> None:
    assert messages_api.chat_view(body) == expected


def test_the_three_apis_render_one_stream() -> None:
    """What vLLM's prefix cache shares across the APIs, the router's stream shares too."""
    as_chat = canonical_bytes(chat({"role": "system", "content": SYS},
                                   {"role": "user", "content": "hi"}, tools=[TOOL_CHAT]),
                              "chat")
    tool = {"type": "function", "name": "ls", "description": "list",
            "parameters": {"type": "object"}}
    as_responses = canonical_bytes(responses_api.chat_view(
        {"instructions": SYS, "input": "hi", "tools": [tool]}), "chat")
    as_messages = canonical_bytes(messages_api.chat_view(
        {"system": SYS, "messages": [{"role": "user", "content": "hi"}],
         "tools": [{"name": "ls", "description": "list",
                    "input_schema": {"type": "object"}}]}), "chat")
    assert as_chat == as_responses == as_messages


BAD = [
    (responses_api, {"input": 3}),
    (responses_api, {"input": []}),
    (responses_api, {"input": ["x"]}),
    (responses_api, {"input": [{"type": "web_search_call"}]}),
    (responses_api, {"input": "x", "instructions": 1}),
    (responses_api, {"input": "x", "tools": {}}),
    (messages_api, {"messages": []}),
    (messages_api, {"messages": [{"role": "user", "content": "x"}], "tools": {}}),
    (messages_api, {"messages": ["x"]}),
    (messages_api, {"messages": [{"role": "user", "content": 3}]}),
    (messages_api, {"messages": [{"content": "x"}]}),
    (messages_api, {"system": 3, "messages": [{"role": "user", "content": "x"}]}),
]


@pytest.mark.parametrize(("module", "body"), BAD)
def test_bad_shapes_are_normalize_errors(module: Any, body: dict[str, Any]) -> None:
    with pytest.raises(NormalizeError):
        module.chat_view(body)


def test_affinity_is_a_bounded_lru() -> None:
    a = ResponseAffinity(capacity=2)
    a.remember("r1", "a")
    a.remember("r2", "b")
    assert a.lookup("r1") == "a"  # r1 used: r2 is now the oldest
    a.remember("r3", "a")
    assert (a.lookup("r1"), a.lookup("r2"), a.lookup("r3")) == ("a", None, "a")
    a.remember("x" * 300, "b")  # not an id vLLM makes: not remembered
    assert len(a) == 2
    a.forget_replica("a")
    assert len(a) == 0
    with pytest.raises(ValueError):
        ResponseAffinity(capacity=0)


@pytest.mark.parametrize(("owner", "healthy", "expected"), [
    (None, {"a": True}, None),
    ("a", {"a": True, "b": True}, Pinned("a")),
    ("a", {"a": False, "b": True}, Lost("a", "unhealthy")),
    ("c", {"a": True}, Lost("c", "removed")),
])
def test_place(owner: str | None, healthy: dict[str, bool],
               expected: Pinned | Lost | None) -> None:
    assert place(owner, healthy) == expected
