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
- errors: `{"type": "error", "error": {"type", "message"}}` with the status of the error,
  except request validation (a missing `max_tokens`, required as in Anthropic's API),
  which vLLM answers in its OpenAI shape with type "Bad Request" and param
  `body.max_tokens`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from gateway.routing import messages_api
from gateway.routing.normalize import NormalizeError
from gateway.sim import protocol
from gateway.sim.api_errors import ValidationError, missing
from gateway.sim.errors import ApiError, bad_request


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
    }
    if "tools" in view:
        chat_body["tools"] = view["tools"]
    return protocol.parse_chat({k: v for k, v in chat_body.items() if v is not None})


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


def stop_reason(finish: str | None) -> str:
    return "max_tokens" if finish == "length" else "end_turn"


def message_body(mid: str, model: str, text: str, finish: str | None,
                 use: dict[str, Any]) -> bytes:
    return orjson.dumps({
        "id": mid, "type": "message", "role": "assistant",
        "content": [{"type": "text", "text": text}], "model": model,
        "stop_reason": stop_reason(finish), "stop_sequence": None, "usage": use,
    })


def _event(kind: str, payload: dict[str, Any]) -> bytes:
    return (b"event: " + kind.encode() + b"\ndata: "
            + orjson.dumps({"type": kind, **payload}) + b"\n\n")


def opening(mid: str, model: str, use: dict[str, Any]) -> bytes:
    message: dict[str, Any] = {"id": mid, "type": "message", "role": "assistant", "content": [],
               "model": model, "stop_reason": None, "stop_sequence": None, "usage": use}
    return (_event("message_start", {"message": message})
            + _event("content_block_start", {"index": 0,
                                             "content_block": {"type": "text", "text": ""}}))


def delta(text: str) -> bytes:
    return _event("content_block_delta", {"index": 0,
                                          "delta": {"type": "text_delta", "text": text}})


def closing(finish: str | None, use: dict[str, Any]) -> bytes:
    return (_event("content_block_stop", {"index": 0})
            + _event("message_delta", {"delta": {"stop_reason": stop_reason(finish),
                                                 "stop_sequence": None}, "usage": use})
            + _event("message_stop", {}))


def stream_error(err: ApiError) -> bytes:
    return b"event: error\ndata: " + error_body(err) + b"\n\n"
