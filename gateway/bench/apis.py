"""The benchmark's chat requests in the other inference APIs (pure): `--api responses`
sends each turn to `/v1/responses`, `--api messages` to `/v1/messages`.

Each turn carries its whole history (stateless: no `previous_response_id`), so the
request's prompt is the same chat prompt vLLM renders for the chat request, and routing
by prefix has the same reuse to find. The chat body stays the benchmark's record of the
request (bounds and analysis tokenize it).

- responses: system -> `instructions`; user/assistant messages -> input items; tools ->
  flat function tools; `max_tokens` -> `max_output_tokens`; `stream` kept.
- messages: system -> `system`; messages kept; tools -> `{name, description,
  input_schema}`; `max_tokens` kept; `stream` kept.
"""

from __future__ import annotations

from typing import Any, Literal

Api = Literal["chat", "responses", "messages"]
APIS: tuple[Api, ...] = ("chat", "responses", "messages")
PATHS: dict[Api, str] = {
    "chat": "/v1/chat/completions", "responses": "/v1/responses", "messages": "/v1/messages",
}


def _split(messages: list[dict[str, Any]]) -> tuple[str | None, list[dict[str, Any]]]:
    if messages and messages[0].get("role") == "system":
        return str(messages[0].get("content") or ""), messages[1:]
    return None, messages


def to_api(body: dict[str, Any], api: Api) -> dict[str, Any]:
    """The body to send for `api`, from the benchmark's chat body."""
    if api == "chat":
        return body
    system, rest = _split(list(body.get("messages") or []))
    functions = [t.get("function", {}) for t in body.get("tools") or ()]
    out: dict[str, Any] = {"model": body.get("model"), "stream": bool(body.get("stream"))}
    if "temperature" in body:
        out["temperature"] = body["temperature"]
    turns = [{"role": m["role"], "content": m.get("content") or ""} for m in rest]
    if api == "responses":
        if system is not None:
            out["instructions"] = system
        out["input"] = turns
        if functions:
            out["tools"] = [{"type": "function", **f} for f in functions]
        if body.get("max_tokens") is not None:
            out["max_output_tokens"] = body["max_tokens"]
        return out
    if system is not None:
        out["system"] = system
    out["messages"] = turns
    if functions:
        out["tools"] = [{"name": f.get("name"), "description": f.get("description"),
                         "input_schema": f.get("parameters")} for f in functions]
    out["max_tokens"] = body.get("max_tokens") or 256
    return out
