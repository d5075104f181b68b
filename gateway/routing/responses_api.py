"""A `/v1/responses` body as the chat request vLLM renders from it (pure).

vLLM 0.32 turns a Responses request into chat messages before applying the chat template
(`construct_input_messages`), so the prefill tokens, and the prefix cache, are those of the
equivalent chat request. `chat_view` builds that request so the router, the hygiene scan
and the canonical stream treat both APIs alike:

- `instructions` becomes the system message (it does not carry over a
  `previous_response_id`, as in vLLM).
- `input` as a string is one user message; as a list of items:
  messages (`role` + string or parts; `input_text` / `output_text` parts are text),
  `function_call` (merged into the preceding assistant message as a tool call, like
  vLLM), `function_call_output` (a tool message), `reasoning` items are skipped (not
  rendered by the template the router models).
- `tools`: flat `{"type": "function", "name", "description", "parameters"}` entries become
  chat tools `{"type": "function", "function": {...}}` in their order; non-function tools
  (web search, MCP, ...) are kept as their JSON so changing them changes the stream.
- `cache_salt` is carried over (it seeds the hash chain).

A continuation (`previous_response_id`) renders only its new items here: the history
lives in the replica's response store, which is why the gateway pins it there
(gateway.routing.affinity) instead of routing it by prefix.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gateway.routing.normalize import NormalizeError

_TEXT_PARTS = frozenset({"input_text", "output_text", "text"})


def _content(content: Any) -> Any:
    """Responses content parts -> chat parts (text parts as `text`)."""
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise NormalizeError("'input[].content' must be a string or a list of parts")
    out: list[Any] = []
    for part in content:
        if isinstance(part, Mapping) and part.get("type") in _TEXT_PARTS:
            out.append({"type": "text", "text": part.get("text", "")})
        else:
            out.append(part)
    return out


def _tool(tool: Any) -> Any:
    if isinstance(tool, Mapping) and tool.get("type") == "function":
        return {"type": "function",
                "function": {k: v for k, v in tool.items() if k != "type"}}
    return tool


def _messages(items: list[Any]) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        if not isinstance(item, Mapping):
            raise NormalizeError(f"'input[{i}]' must be an object")
        kind = item.get("type")
        last = messages[-1] if messages and messages[-1].get("role") == "assistant" else None
        if kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function", "function": {
                "name": item.get("name", ""), "arguments": item.get("arguments", "")}}
            if last is not None:
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind in ("function_call_output", "custom_tool_call_output"):
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                             "content": _content(output)})
        elif kind == "reasoning":
            continue
        elif isinstance(item.get("role"), str):
            content = _content(item.get("content"))
            if item["role"] == "assistant" and last is not None and last.get("content") is None:
                last["content"] = content
            else:
                messages.append({"role": item["role"], "content": content})
        else:
            raise NormalizeError(f"unsupported input item type {str(kind)[:40]!r}")
    return messages


def chat_view(body: Mapping[str, Any]) -> dict[str, Any]:
    """The chat request vLLM renders for this Responses body."""
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise NormalizeError("'instructions' must be a string")
        if instructions:
            messages.append({"role": "system", "content": instructions})
    items = body.get("input")
    if isinstance(items, str):
        messages.append({"role": "user", "content": items})
    elif isinstance(items, list):
        messages += _messages(items)
    else:
        raise NormalizeError("'input' must be a string or a list of items")
    if not messages:
        raise NormalizeError("'input' must not be empty")
    view: dict[str, Any] = {"messages": messages}
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise NormalizeError("'tools' must be a list")
    if tools:
        view["tools"] = [_tool(t) for t in tools]
    if isinstance(body.get("cache_salt"), str):
        view["cache_salt"] = body["cache_salt"]
    if body.get("stream") is True:  # a stream: its prefill ends at its first token
        view["stream"] = True
    return view
