"""The Anthropic Messages API (`POST /v1/messages`) as vLLM 0.32 serves it (pure).

vLLM converts the request into a chat completion (`gateway.routing.messages_api` mirrors
the conversion), runs it, and converts the answer back:

- body: `{"id", "type": "message", "role": "assistant", "content": [{"type": "text",
  "text"}], "model", "stop_reason" ("end_turn" | "max_tokens"), "stop_sequence": null,
  "usage"}`;
- usage: `input_tokens` = prompt - cache read (only the uncached part),
  `cache_read_input_tokens` = the cached tokens (absent when the engine reports no
  details), `output_tokens`;
- stream: `event:` + `data:` per event: message_start (the message with empty content and
  the usage known so far), content_block_start, content_block_delta (text_delta)...,
  content_block_stop, message_delta (stop_reason and the final usage), message_stop;
- tools: `tools` (`name`, `description`, `input_schema`) become chat function tools and
  `tool_choice` maps as vLLM maps it: `{"type": "auto"}` -> "auto", `"any"` -> "required",
  `"none"` -> "none", `{"type": "tool", "name"}` -> that function; tools without a
  `tool_choice` mean "auto" (so, as in chat, a 400 unless the replica has a tool parser).
  A call comes back as a `tool_use` block (`id`: the chat call's id, as vLLM passes it
  through; `input`: the parsed arguments) after a text block only when the text is not
  empty, and `stop_reason` is the chat finish mapped by vLLM's table: "tool_calls" ->
  "tool_use", "stop" -> "end_turn" (so a named tool, whose chat finish is "stop", ends
  "end_turn"), "length" -> "max_tokens". Streamed: message_start, then (no text block)
  content_block_start `{"type": "tool_use", "id", "name", "input": {}}` once the name is
  known, content_block_delta `input_json_delta` fragments, content_block_stop,
  message_delta, message_stop. The next turn's `tool_use` / `tool_result` blocks are the
  chat tool calls and tool messages (`gateway.routing.messages_api`).
- P/D (`--role prefill|decode`): `kv_transfer_params` is copied onto the chat request,
  as vLLM does; the answer's own params come back in the body only (vLLM's stream
  converter drops them);
- errors: `{"type": "error", "error": {"type", "message"}}` with the status of the error,
  except request validation (a missing `max_tokens`, required as in Anthropic's API),
  which vLLM answers in its OpenAI shape with type "Bad Request" and param
  `body.max_tokens`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import orjson

from gateway.routing import messages_api
from gateway.routing.normalize import NormalizeError
from gateway.sim import protocol
from gateway.sim.api_errors import ValidationError, missing
from gateway.sim.errors import ApiError, bad_request
from gateway.sim.toolcalls import PlannedCall


def parse_messages(body: Mapping[str, Any]) -> protocol.ChatParams:
    max_tokens = body.get("max_tokens")
    if max_tokens is None:  # pydantic's validation error, in vLLM's OpenAI shape
        raise missing("max_tokens", body)
    try:
        view = messages_api.chat_view(body)
    except NormalizeError as e:
        raise bad_request(str(e), "messages") from None
    chat_body: dict[str, Any] = {
        "model": body.get("model"), "messages": view["messages"],
        "stream": body.get("stream"), "max_tokens": max_tokens,
        "temperature": body.get("temperature"), "top_p": body.get("top_p"),
        # vLLM copies it onto the chat request it runs (a P/D leg: gateway.sim.connector)
        "kv_transfer_params": body.get("kv_transfer_params"),
    }
    if "tools" in view:
        chat_body["tools"] = view["tools"]
    choice = tool_choice(body.get("tool_choice"))
    if choice is not None:
        chat_body["tool_choice"] = choice
    return protocol.parse_chat({k: v for k, v in chat_body.items() if v is not None})


_CHOICES = {"auto": "auto", "any": "required", "none": "none"}


def tool_choice(choice: Any) -> str | dict[str, Any] | None:
    """Anthropic's `tool_choice` as the chat one vLLM builds from it."""
    if choice is None:
        return None
    kind = choice.get("type") if isinstance(choice, Mapping) else None
    if kind == "tool":
        name = choice.get("name")
        if not isinstance(name, str) or not name:
            raise bad_request("tool_choice of type 'tool' needs a 'name'", "tool_choice")
        return {"type": "function", "function": {"name": name}}
    if kind not in _CHOICES:
        raise bad_request("tool_choice must be an object whose type is 'auto', 'any', "
                          "'tool' or 'none'", "tool_choice")
    return _CHOICES[str(kind)]


def error_body(err: ApiError) -> bytes:
    if isinstance(err, ValidationError):
        return err.body()
    return orjson.dumps({"type": "error", "error": {"type": err.type, "message": err.message}})


def usage(prompt: int, output: int, cached: int | None) -> dict[str, Any]:
    out: dict[str, Any] = {"input_tokens": max(0, prompt - (cached or 0)),
                           "output_tokens": output}
    if cached is not None:
        # vLLM 0.32 reports created_cache_tokens 0 here (only chat fills it)
        out["cache_creation_input_tokens"] = 0
        out["cache_read_input_tokens"] = cached
    return out


_STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}  # vLLM's map


def stop_reason(finish: str | None) -> str:
    return _STOP_REASONS.get(finish or "stop", "end_turn")


def tool_use(call: PlannedCall) -> dict[str, Any]:
    return {"type": "tool_use", "id": call.id, "name": call.name,
            "input": json.loads(call.arguments)}


def message_body(mid: str, model: str, text: str, finish: str | None,
                 use: dict[str, Any], call: PlannedCall | None = None,
                 kv_transfer: dict[str, Any] | None = None) -> bytes:
    """`call`: the whole call that came out (then `finish` is the chat one for it).
    `kv_transfer`: the answer's own params (a P/D leg), absent when None as vLLM writes
    the body (`exclude_none`)."""
    content: list[dict[str, Any]] = [{"type": "text", "text": text}]
    if call is not None:
        content = [{"type": "text", "text": call.content}] if call.content else []
        content.append(tool_use(call))
    body: dict[str, Any] = {
        "id": mid, "type": "message", "role": "assistant",
        "content": content, "model": model,
        "stop_reason": stop_reason(finish), "stop_sequence": None, "usage": use,
    }
    if kv_transfer is not None:
        body["kv_transfer_params"] = kv_transfer
    return orjson.dumps(body)


def _event(kind: str, payload: dict[str, Any]) -> bytes:
    return (b"event: " + kind.encode() + b"\ndata: "
            + orjson.dumps({"type": kind, **payload}) + b"\n\n")


def start(mid: str, model: str, use: dict[str, Any]) -> bytes:
    message: dict[str, Any] = {"id": mid, "type": "message", "role": "assistant", "content": [],
               "model": model, "stop_reason": None, "stop_sequence": None, "usage": use}
    return _event("message_start", {"message": message})


def opening(mid: str, model: str, use: dict[str, Any]) -> bytes:
    return (start(mid, model, use)
            + _event("content_block_start", {"index": 0,
                                             "content_block": {"type": "text", "text": ""}}))


def tool_start(call: PlannedCall) -> bytes:
    """The tool_use block opens once the call's name is known, its input empty."""
    block = {"type": "tool_use", "id": call.id, "name": call.name, "input": {}}
    return _event("content_block_start", {"index": 0, "content_block": block})


def input_delta(fragment: str) -> bytes:
    return _event("content_block_delta", {
        "index": 0, "delta": {"type": "input_json_delta", "partial_json": fragment}})


def delta(text: str) -> bytes:
    return _event("content_block_delta", {"index": 0,
                                          "delta": {"type": "text_delta", "text": text}})


def closing(finish: str | None, use: dict[str, Any], block: bool = True) -> bytes:
    """`block`: a content block is open (a call cut before its name opened none)."""
    return ((_event("content_block_stop", {"index": 0}) if block else b"")
            + _event("message_delta", {"delta": {"stop_reason": stop_reason(finish),
                                                 "stop_sequence": None}, "usage": use})
            + _event("message_stop", {}))


def stream_error(err: ApiError) -> bytes:
    return b"event: error\ndata: " + error_body(err) + b"\n\n"
