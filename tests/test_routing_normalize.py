"""What must and must not change the canonical stream / hash chain of a request."""

from __future__ import annotations

import copy
from typing import Any

import orjson
import pytest

from gateway.routing.blocks import chain_hashes
from gateway.routing.normalize import (
    DEFAULT_SYSTEM,
    NormalizeError,
    canonical_bytes,
    chain_seed,
    content_text,
)

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                      "parameters": {"type": "object", "properties": {}}}},
    {"type": "function", "function": {"name": "search", "description": "Search the web",
                                      "parameters": {"type": "object", "properties": {}}}},
]

BASE: dict[str, Any] = {
    "model": "m",
    "tools": TOOLS,
    "messages": [
        {"role": "system", "content": "You are a careful agent."},
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18C, cloudy"},
        {"role": "user", "content": "And tomorrow?"},
    ],
    "temperature": 0.2,
}


def fingerprint(body: dict[str, Any], endpoint: str = "chat", model: str = "m") -> list[int]:
    data = canonical_bytes(body, endpoint)  # type: ignore[arg-type]
    seed = chain_seed(body, endpoint, model)  # type: ignore[arg-type]
    return [seed, *chain_hashes(data, seed, 8), hash(data)]


def edit(path: str, value: Any) -> dict[str, Any]:
    body = copy.deepcopy(BASE)
    target: Any = body
    keys = path.split(".")
    for k in keys[:-1]:
        target = target[int(k)] if k.isdigit() else target[k]
    last = keys[-1]
    if value is DELETE:
        del target[last]
    elif last.isdigit():
        target[int(last)] = value
    else:
        target[last] = value
    return body


DELETE = object()


def reordered(items: list[Any]) -> list[Any]:
    return list(reversed(items))


def keys_reversed(d: dict[str, Any]) -> dict[str, Any]:
    return dict(reversed(list(d.items())))


@pytest.mark.parametrize(
    ("name", "body", "changes"),
    [
        # sampling and transport parameters never touch the prefill
        ("temperature", edit("temperature", 0.9), False),
        ("max_tokens", edit("max_tokens", 10), False),
        ("stream", edit("stream", True), False),
        ("n", edit("n", 3), False),
        ("stream_options", edit("stream_options", {"include_usage": True}), False),
        ("user", edit("user", "alice"), False),
        ("top-level key order", dict(reversed(list(BASE.items()))), False),
        # parsed JSON: formatting whitespace of the body is gone already
        ("json formatting", orjson.loads(orjson.dumps(BASE, option=orjson.OPT_INDENT_2)), False),
        ("tool_call_id (not rendered)", edit("messages.3.tool_call_id", "call_9"), False),
        ("tool call id (not rendered)", edit("messages.2.tool_calls.0.id", "call_9"), False),
        ("message key order", edit("messages.1", {"content": "What is the weather in Paris?",
                                                  "role": "user"}), False),
        ("content as one text part", edit("messages.1.content",
                                          [{"type": "text",
                                            "text": "What is the weather in Paris?"}]), False),
        ("content parts joined by newline", edit("messages.1.content", [
            {"type": "text", "text": "What is the weather"},
            {"type": "text", "text": "in Paris?"}]), True),
        # what the template renders
        ("role change", edit("messages.1.role", "assistant"), True),
        ("content change", edit("messages.1.content", "What is the weather in Lyon?"), True),
        ("whitespace inside content", edit("messages.1.content",
                                           "What is the weather in  Paris?"), True),
        ("trailing newline in content", edit("messages.1.content",
                                             "What is the weather in Paris?\n"), True),
        ("system text", edit("messages.0.content", "You are a careless agent."), True),
        ("tool order", edit("tools", reordered(TOOLS)), True),
        ("tool key order", edit("tools.0", keys_reversed(TOOLS[0])), True),
        ("tool dropped", edit("tools", TOOLS[:1]), True),
        ("no tools", edit("tools", DELETE), True),
        ("tool call name", edit("messages.2.tool_calls.0.function.name", "search"), True),
        ("tool call arguments", edit("messages.2.tool_calls.0.function.arguments",
                                     '{"city": "Lyon"}'), True),
        # vLLM parses the argument string and the template re-serializes it (key order kept)
        ("tool call argument spacing", edit("messages.2.tool_calls.0.function.arguments",
                                            '{ "city" :  "Paris"}'), False),
        ("tool call arguments as object", edit("messages.2.tool_calls.0.function.arguments",
                                               {"city": "Paris"}), False),
        ("tool call argument key order",
         edit("messages.2.tool_calls.0.function.arguments", '{"unit": "C", "city": "Paris"}'),
         edit("messages.2.tool_calls.0.function.arguments", '{"city": "Paris", "unit": "C"}')),
        ("tool result", edit("messages.3.content", "19C, sunny"), True),
        ("tool role -> user", edit("messages.3.role", "user"), True),
        ("cache_salt", edit("cache_salt", "tenant-a"), True),
        ("chat_template_kwargs", edit("chat_template_kwargs", {"enable_thinking": False}), True),
        ("no generation prompt", edit("add_generation_prompt", False), True),
    ],
)
def test_what_changes_the_hash(name: str, body: dict[str, Any], changes: Any) -> None:
    if isinstance(changes, dict):  # compare two variants with each other
        assert fingerprint(body) != fingerprint(changes), name
        return
    assert (fingerprint(body) != fingerprint(BASE)) is changes, name


def test_model_seeds_the_chain() -> None:
    assert fingerprint(BASE, model="a") != fingerprint(BASE, model="b")
    assert canonical_bytes(BASE, "chat") == canonical_bytes(edit("model", "other"), "chat")


def test_salt_changes_every_block_but_not_the_stream() -> None:
    salted = edit("cache_salt", "s")
    assert canonical_bytes(salted, "chat") == canonical_bytes(BASE, "chat")
    a = chain_hashes(canonical_bytes(BASE, "chat"), chain_seed(BASE, "chat", "m"), 16)
    b = chain_hashes(canonical_bytes(salted, "chat"), chain_seed(salted, "chat", "m"), 16)
    assert not set(a) & set(b)


def test_missing_system_is_the_default_system() -> None:
    with_default = edit("messages.0.content", DEFAULT_SYSTEM)
    without = copy.deepcopy(BASE)
    del without["messages"][0]
    assert canonical_bytes(with_default, "chat") == canonical_bytes(without, "chat")


def test_shared_history_is_a_byte_prefix() -> None:
    turn1 = {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "q1"}]}
    turn2 = copy.deepcopy(turn1)
    turn2["messages"] += [{"role": "assistant", "content": "a1"},
                          {"role": "user", "content": "q2"}]
    a, b = canonical_bytes(turn1, "chat"), canonical_bytes(turn2, "chat")
    assert b.startswith(a)
    assert b.startswith(a + b"a1\x1f\n")  # the reply follows the generation prompt


def test_rendering_tracks_text_length() -> None:
    text = "word " * 1000
    data = canonical_bytes({"messages": [{"role": "user", "content": text}]}, "chat")
    assert len(text) < len(data) < len(text) + len(DEFAULT_SYSTEM) + 64


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        ("hello", b"hello"),
        (["hello", "other"], b"hello"),
        ([1, 2], b"\x01\x00\x00\x00\x02\x00\x00\x00"),
    ],
)
def test_completions(prompt: Any, expected: bytes) -> None:
    assert canonical_bytes({"prompt": prompt, "max_tokens": 5}, "completions") == expected


@pytest.mark.parametrize(
    ("body", "endpoint"),
    [
        ({"messages": "hi"}, "chat"),
        ({"messages": []}, "chat"),
        ({"messages": [{"content": "no role"}]}, "chat"),
        ({"messages": [{"role": "user", "content": 5}]}, "chat"),
        ({"messages": [{"role": "user", "content": "x"}], "tools": {"a": 1}}, "chat"),
        ({"prompt": 5}, "completions"),
        ({"prompt": [-1]}, "completions"),
    ],
)
def test_bad_bodies(body: dict[str, Any], endpoint: str) -> None:
    with pytest.raises(NormalizeError):
        canonical_bytes(body, endpoint)  # type: ignore[arg-type]


def test_content_text() -> None:
    assert content_text(None) == ""
    assert content_text([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]) == "a\nb"
    img = {"type": "image_url", "image_url": {"url": "data:1"}}
    assert content_text([img]) != content_text([{**img, "image_url": {"url": "data:2"}}])
