"""The Responses API (`POST /v1/responses`) as vLLM 0.32 serves it: request parsing, the
response store and the wire shapes of bodies and stream events (pure).

Parsing: the body becomes the chat request vLLM renders (`gateway.routing.responses_api`
mirrors vLLM's `construct_input_messages`), validated like a chat request; the output
limit is `max_output_tokens`.

Store (`VLLM_ENABLE_RESPONSES_API_STORE=1` in vLLM, `--responses-store` here; off by
default): after a response completes with `store` true (the API default), its prompt
messages and its output are kept in memory on this replica. A request naming
`previous_response_id` continues that conversation: the stored messages (system ones
dropped: instructions do not carry over) and the previous output come before the new
input. An id this replica does not hold, or any id while the store is off, is a 404
"Response with id '...' not found." with param `response_id`, as vLLM answers. vLLM's
store is unbounded; the simulator's keeps the newest `capacity` responses.

Streams: `event: <type>` + `data: <json>` per event, each with a `sequence_number`:
response.created, response.in_progress, response.output_item.added,
response.content_part.added, response.output_text.delta..., response.output_text.done,
response.content_part.done, response.output_item.done, response.completed (carrying the
whole response with its usage). No `data: [DONE]`.

P/D (`--role prefill|decode`): `kv_transfer_params` is the leg's, as on chat (vLLM
passes it to the sampler's extra_args); the response object carries the answer's own
(`kv_transfer_params`, in the body and in the stream's `response.completed`).

Tool calls: `tools` (`{"type": "function", "name", "parameters"}`) and `tool_choice`
("auto" (the default with tools), "required", "none", or `{"type": "function", "name"}`)
become the chat ones; the answer is drawn as on chat (gateway.sim.toolcalls). As vLLM's
Responses path, a named or "required" choice is guided without a tool parser, and "auto"
without one answers text (no 400, unlike chat). A whole call is the output item
`{"arguments", "call_id": "call_...", "name", "type": "function_call", "id": "fc_...",
"status": "completed"}` (no message item beside it: its text is empty); a call cut by
`max_output_tokens` does not parse and comes back as text, as on chat. Streamed:
response.created, response.in_progress, then, once the name is known,
response.output_item.added (the call, arguments "", status "in_progress"),
response.function_call_arguments.delta..., response.function_call_arguments.done,
response.output_item.done, response.completed. The next turn's `function_call` and
`function_call_output` items are the chat tool call and tool message
(`gateway.routing.responses_api`); a stored response continues with the call.
"""

from __future__ import annotations

import uuid
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from gateway.routing import responses_api
from gateway.routing.normalize import NormalizeError
from gateway.sim import protocol
from gateway.sim.api_errors import TypedError, missing
from gateway.sim.errors import ApiError, bad_request


@dataclass(frozen=True, kw_only=True)
class ResponsesParams:
    chat: protocol.ChatParams
    history: list[dict[str, Any]]  # the prompt's non-system messages, kept by the store
    store: bool
    previous_response_id: str | None
    instructions: str | None
    echo: dict[str, Any]  # request fields the response object repeats


class ResponseStore:
    """The newest `capacity` stored responses: the conversation each continues, and the
    response object `GET /v1/responses/{id}` returns."""

    def __init__(self, capacity: int = 10_000) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, list[dict[str, Any]]] = OrderedDict()
        self._objects: dict[str, dict[str, Any]] = {}

    def get(self, response_id: str) -> list[dict[str, Any]] | None:
        return self._items.get(response_id)

    def response(self, response_id: str) -> dict[str, Any] | None:
        return self._objects.get(response_id)

    def put(self, response_id: str, messages: list[dict[str, Any]],
            response: dict[str, Any] | None = None) -> None:
        self._items[response_id] = messages
        if response is not None:
            self._objects[response_id] = response
        while len(self._items) > self.capacity:
            old, _ = self._items.popitem(last=False)
            self._objects.pop(old, None)


def cannot_cancel() -> ApiError:
    """vLLM's answer to cancelling a response that is not running in the background."""
    return TypedError(400, "Cannot cancel a synchronous response.", "response_id",
                      "invalid_request_error")


def not_found(response_id: str) -> ApiError:
    return TypedError(404, f"Response with id '{response_id}' not found.", "response_id",
                      "invalid_request_error")


def new_id(prefix: str) -> str:
    """vLLM 0.32's ids: a prefix and 16 hex digits."""
    return prefix + uuid.uuid4().hex[:16]


def parse_responses(body: Mapping[str, Any], store: ResponseStore | None) -> ResponsesParams:
    if body.get("input") is None:
        raise missing("input", body)
    previous = body.get("previous_response_id")
    if previous is not None and not isinstance(previous, str):
        raise bad_request("previous_response_id must be a string", "previous_response_id")
    try:
        view = responses_api.chat_view(body)
    except NormalizeError as e:
        raise bad_request(str(e), "input") from None
    messages = view["messages"]
    if previous is not None:
        prior = store.get(previous) if store is not None else None
        if prior is None:
            raise not_found(previous)
        system = messages[:1] if messages[0].get("role") == "system" else []
        messages = system + prior + messages[len(system):]
    max_output = body.get("max_output_tokens")
    chat_body: dict[str, Any] = {
        "model": body.get("model"), "messages": messages, "stream": body.get("stream"),
        "max_tokens": max_output, "temperature": body.get("temperature"),
        "top_p": body.get("top_p"), "cache_salt": body.get("cache_salt"),
        # vLLM passes it to the sampler (a P/D leg: gateway.sim.connector)
        "kv_transfer_params": body.get("kv_transfer_params"),
    }
    if "tools" in view:
        chat_body["tools"] = view["tools"]
    if body.get("tool_choice") is not None:
        chat_body["tool_choice"] = tool_choice(body["tool_choice"])
    chat = protocol.parse_chat({k: v for k, v in chat_body.items() if v is not None})
    instructions = body.get("instructions")
    echo = {
        "instructions": instructions, "max_output_tokens": max_output,
        "previous_response_id": previous, "temperature": body.get("temperature", 1.0),
        "top_p": body.get("top_p", 1.0), "tools": body.get("tools") or [],
        "tool_choice": body.get("tool_choice", "auto" if body.get("tools") else "none"),
        "metadata": body.get("metadata"), "user": body.get("user"),
    }
    return ResponsesParams(
        chat=chat, history=[m for m in chat.messages if m.get("role") != "system"],
        store=body.get("store", True) is not False, previous_response_id=previous,
        instructions=instructions if isinstance(instructions, str) else None, echo=echo,
    )


def tool_choice(choice: Any) -> Any:
    """The Responses `tool_choice` as the chat one: a named function is flat here."""
    if isinstance(choice, Mapping) and choice.get("type") == "function":
        if not isinstance(choice.get("name"), str):
            raise bad_request("a function tool_choice needs a 'name'", "tool_choice")
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def function_call_item(item_id: str, call_id: str, name: str, arguments: str,
                       status: str) -> dict[str, Any]:
    return {"arguments": arguments, "call_id": call_id, "name": name,
            "type": "function_call", "id": item_id, "status": status}


def usage(prompt: int, output: int, cached: int) -> dict[str, Any]:
    return {
        "input_tokens": prompt,
        # vLLM fills cache_write_tokens from a KV connector's count; without one it is 0
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0,
                                 "input_tokens_per_turn": [], "cached_tokens_per_turn": []},
        "output_tokens": output,
        "output_tokens_details": {"reasoning_tokens": 0, "tool_output_tokens": 0,
                                  "output_tokens_per_turn": [],
                                  "tool_output_tokens_per_turn": []},
        "total_tokens": prompt + output,
    }


def message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {
        "id": item_id, "content": [{"annotations": [], "text": text, "type": "output_text",
                                    "logprobs": None}],
        "role": "assistant", "status": status, "type": "message", "phase": None,
    }


def response_object(
    rid: str, created: int, model: str, params: ResponsesParams, output: list[dict[str, Any]],
    status: str, use: dict[str, Any] | None, incomplete: str | None = None,
    kv_transfer: dict[str, Any] | None = None,
) -> dict[str, Any]:
    return {
        "id": rid, "created_at": created,
        "incomplete_details": None if incomplete is None else {"reason": incomplete},
        "model": model, "object": "response", "output": output,
        "parallel_tool_calls": True, "background": False, "max_tool_calls": None,
        "prompt": None, "reasoning": None, "service_tier": "auto", "status": status,
        "text": None, "top_logprobs": None, "truncation": "disabled", "usage": use,
        **params.echo, "presence_penalty": 0.0, "frequency_penalty": 0.0,
        "kv_transfer_params": kv_transfer, "ec_transfer_params": None, "input_messages": None,
        "output_messages": None,
    }


class ResponsesEvents:
    """Serializes one response's stream events, numbering them."""

    def __init__(self) -> None:
        self._seq = 0

    def event(self, kind: str, payload: dict[str, Any]) -> bytes:
        data = orjson.dumps({**payload, "type": kind, "sequence_number": self._seq})
        self._seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n"

    def started(self, response: dict[str, Any]) -> bytes:
        return (self.event("response.created", {"response": response})
                + self.event("response.in_progress", {"response": response}))

    def call_added(self, item: dict[str, Any]) -> bytes:
        """The call's item once its name is known (`item`: arguments "", in progress)."""
        return self.event("response.output_item.added", {"item": item, "output_index": 0})

    def call_delta(self, item_id: str, fragment: str) -> bytes:
        return self.event("response.function_call_arguments.delta", {
            "delta": fragment, "item_id": item_id, "output_index": 0})

    def call_closing(self, response: dict[str, Any], item: dict[str, Any] | None) -> bytes:
        """`item`: the call as streamed (None when cut before its name)."""
        done = b"" if item is None else (
            self.event("response.function_call_arguments.done", {
                "arguments": item["arguments"], "item_id": item["id"], "name": item["name"],
                "output_index": 0})
            + self.event("response.output_item.done", {"item": item, "output_index": 0}))
        return done + self.event("response.completed", {"response": response})

    def opening(self, response: dict[str, Any], item_id: str) -> bytes:
        part = {"annotations": [], "text": "", "type": "output_text", "logprobs": []}
        return (
            self.started(response)
            + self.event("response.output_item.added", {
                "item": message_item(item_id, "", "in_progress") | {"content": []},
                "output_index": 0})
            + self.event("response.content_part.added", {
                "content_index": 0, "item_id": item_id, "output_index": 0, "part": part})
        )

    def delta(self, item_id: str, text: str) -> bytes:
        return self.event("response.output_text.delta", {
            "content_index": 0, "delta": text, "item_id": item_id, "output_index": 0,
            "logprobs": []})

    def closing(self, response: dict[str, Any], item_id: str, text: str) -> bytes:
        item = message_item(item_id, text, "completed")
        return (
            self.event("response.output_text.done", {
                "content_index": 0, "item_id": item_id, "output_index": 0, "text": text,
                "logprobs": []})
            + self.event("response.content_part.done", {
                "content_index": 0, "item_id": item_id, "output_index": 0,
                "part": item["content"][0]})
            + self.event("response.output_item.done", {"item": item, "output_index": 0})
            + self.event("response.completed", {"response": response})
        )
