"""A `/v1/messages` (Anthropic Messages) body as the chat request vLLM renders (pure).

vLLM 0.32's Anthropic endpoint converts the request into a chat completion request
(`AnthropicServingMessages`), so the rendered prompt and its prefix cache are the chat
ones. `chat_view` mirrors that conversion:

- `system` (a string or text blocks) becomes one system message, its text blocks joined
  without a separator; blocks that start with `x-anthropic-billing-header` are dropped,
  as vLLM drops them (they carry a per-request hash that would break the prefix).
- `messages[].content` as a string stays; as blocks: `text` blocks become text parts
  (one text part collapses to a string), `tool_use` blocks become tool calls whose
  arguments are the JSON of `input`, a user's `tool_result` becomes a tool message (its
  text blocks joined by newlines) placed before the rest of that user turn, `thinking`
  and `redacted_thinking` are not rendered, images are kept as their JSON.
- `tools`: `{name, description, input_schema}` become chat function tools.
- `cache_control` markers are Anthropic's explicit cache breakpoints; vLLM caches every
  full block automatically and ignores them, so they do not change the stream.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from gateway.routing.normalize import NormalizeError

BILLING_HEADER = "x-anthropic-billing-header"


def _system_text(system: Any) -> str:
    if isinstance(system, str):
        return system
    if not isinstance(system, list):
        raise NormalizeError("'system' must be a string or a list of text blocks")
    parts = []
    for block in system:
        if isinstance(block, Mapping) and block.get("type") == "text":
            text = block.get("text")
            if isinstance(text, str) and text and not text.startswith(BILLING_HEADER):
                parts.append(text)
    return "".join(parts)


def _tool_result_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(str(b.get("text", "")) for b in content
                         if isinstance(b, Mapping) and b.get("type") == "text")
    return ""


def _convert(msg: Mapping[str, Any], out: list[dict[str, Any]]) -> None:
    role = msg.get("role")
    if not isinstance(role, str):
        raise NormalizeError("each message needs a string 'role'")
    content = msg.get("content")
    if role == "system":
        text = _system_text(content)
        if text:
            out.append({"role": "system", "content": text})
        return
    if isinstance(content, str):
        out.append({"role": role, "content": content})
        return
    if not isinstance(content, list):
        raise NormalizeError("'messages[].content' must be a string or a list of blocks")
    parts: list[Any] = []
    calls: list[dict[str, Any]] = []
    for block in content:
        if not isinstance(block, Mapping):
            raise NormalizeError("content blocks must be objects")
        kind = block.get("type")
        if kind == "text":
            if block.get("text"):
                parts.append({"type": "text", "text": block["text"]})
        elif kind == "tool_use":
            try:
                args = orjson.dumps(block.get("input") or {}).decode()
            except TypeError as e:
                raise NormalizeError(f"tool_use input cannot be serialized: {e}") from None
            calls.append({"id": block.get("id"), "type": "function",
                          "function": {"name": block.get("name") or "", "arguments": args}})
        elif kind == "tool_result":
            if role == "user":
                out.append({"role": "tool", "tool_call_id": block.get("tool_use_id") or "",
                            "content": _tool_result_text(block.get("content"))})
            else:
                parts.append({"type": "text", "text": f"Tool result: {block.get('content')}"})
        elif kind in ("thinking", "redacted_thinking", "tool_reference"):
            continue
        else:
            parts.append({k: v for k, v in block.items() if k != "cache_control"})
    message: dict[str, Any] = {"role": role}
    if calls:
        message["tool_calls"] = calls
    if parts:
        only = parts[0]
        single = len(parts) == 1 and isinstance(only, dict) and only.get("type") == "text"
        message["content"] = only["text"] if single else parts
    if role == "user" and "content" not in message:
        return  # a user turn made only of tool results
    out.append(message)


def chat_view(body: Mapping[str, Any]) -> dict[str, Any]:
    """The chat request vLLM renders for this Messages body."""
    messages: list[dict[str, Any]] = []
    system = body.get("system")
    if system is not None:
        text = _system_text(system)
        if text:
            messages.append({"role": "system", "content": text})
    items = body.get("messages")
    if not isinstance(items, list) or not items:
        raise NormalizeError("'messages' must be a non-empty list")
    for msg in items:
        if not isinstance(msg, Mapping):
            raise NormalizeError("each message must be an object")
        _convert(msg, messages)
    view: dict[str, Any] = {"messages": messages}
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise NormalizeError("'tools' must be a list")
    if tools:
        view["tools"] = [
            {"type": "function", "function": {
                "name": t.get("name"), "description": t.get("description"),
                "parameters": t.get("input_schema")}}
            if isinstance(t, Mapping) and "input_schema" in t else t
            for t in tools
        ]
    if body.get("stream") is True:  # a stream: its prefill ends at its first token
        view["stream"] = True
    return view
