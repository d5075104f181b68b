"""The client's request as the gateway needs it (pure): the body parsed once with orjson,
the fields the gateway reads checked for type (400 naming the field in `param`), and the one
change the gateway may make to it (asking the engine for usage in a stream).

Checked: the body is a JSON object; `model` is a string; chat `messages` is a list of
objects; completions `prompt` is a string or a list; Responses `input` is a string or a
list, `instructions` and `previous_response_id` strings; Messages `messages` is a list of
objects and `system` a string or a list; `stream` is a boolean; `stream_options`
is an object; `tools` is a list; `user` and `prompt_cache_key` are strings (`null` is
accepted wherever the field is optional). Everything else is the engine's to judge.

Depth: orjson parses up to 1024 nested levels but serializes only 254, and the gateway
re-serializes bodies (usage injection, rewrites, the scanner's and the normalizer's JSON
views), so a body nested deeper than `MAX_DEPTH` is a 400 before anything else reads it.
The walk runs only when a C-speed check cannot rule the depth out: for a small body, it
holds at most `MAX_DEPTH` brackets (a byte count); for a larger one, where counting two
bytes costs more than parsing (130 µs against 80 at 256 KiB), orjson serializes the parsed
body inside `ORJSON_DEPTH - MAX_DEPTH` more levels (7 µs at 256 KiB; the levels built once
per owner, `DepthGuard`), which it does exactly when the body is at most `MAX_DEPTH` deep.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import orjson

from gateway.proxy.errors import GatewayError, invalid_field, missing_field
from gateway.routing import messages_api, responses_api
from gateway.routing.normalize import NormalizeError

Endpoint = Literal["chat", "completions", "responses", "messages"]

# Far above any real tool schema, far enough below orjson's serialization limit (254) for
# the views the gateway builds around a body's values.
MAX_DEPTH = 128
ORJSON_DEPTH = 254  # containers orjson.dumps nests at most (255 raises "Recursion limit")
_COUNT_BELOW = 16 * 1024  # bodies under this size are checked by counting brackets


@dataclass(slots=True)
class Inbound:
    body: dict[str, Any]
    model: str
    stream: bool
    client_wants_usage: bool  # stream_options.include_usage was already true


def parse_json(raw: bytes, guard: DepthGuard | None = None) -> Any:
    """The parsed body, or a 400 (invalid JSON, nested deeper than `MAX_DEPTH`); `guard`:
    the caller's own, kept across requests (a fresh one per call without)."""
    try:
        doc = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise GatewayError(400, f"Invalid JSON body: {exc}", code="invalid_json") from None
    if len(raw) < _COUNT_BELOW:
        suspect = raw.count(b"[") + raw.count(b"{") > MAX_DEPTH
    else:
        suspect = not (guard or DepthGuard()).shallow(doc)
    if suspect and too_deep(doc, MAX_DEPTH):
        raise GatewayError(400, f"The JSON body is nested deeper than {MAX_DEPTH} levels.",
                           code="invalid_json")
    return doc


class DepthGuard:
    """The C-speed depth proof (`shallow`) with its wrapping built once: the
    `ORJSON_DEPTH - MAX_DEPTH` nested lists around the body are made at construction and
    reused, the body put in and taken out of the innermost. Built per request, they cost
    more than serializing a 64 KiB body (measured in process: 20 µs a request on average
    against 6). Not reentrant, and needs none: `shallow` runs to its end without yielding
    to the event loop, and each owner (the request flow, the endpoint picker) runs on one
    thread."""

    __slots__ = ("_inner", "_outer")

    def __init__(self) -> None:
        self._inner: list[Any] = []
        outer: list[Any] = self._inner
        for _ in range(ORJSON_DEPTH - MAX_DEPTH - 1):
            outer = [outer]
        self._outer = outer

    def shallow(self, doc: Any) -> bool:
        """True proves `doc` nests at most `MAX_DEPTH` containers: orjson (C) serializes it
        wrapped in `ORJSON_DEPTH - MAX_DEPTH` lists. False proves nothing (too deep, or a
        value orjson cannot write): `too_deep` decides."""
        inner = self._inner
        inner.append(doc)
        try:
            orjson.dumps(self._outer)
        except orjson.JSONEncodeError:
            return False
        finally:
            inner.clear()  # the body is not kept alive past its request
        return True


def shallow(doc: Any) -> bool:
    """`DepthGuard.shallow` with a guard of its own."""
    return DepthGuard().shallow(doc)


def too_deep(doc: Any, limit: int) -> bool:
    """Whether any value in doc sits more than `limit` containers deep (iterative: a deep
    document must not exhaust the interpreter's stack here either)."""
    stack: list[tuple[Any, int]] = [(doc, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict):
            value = value.values()
        elif not isinstance(value, list):
            continue
        if depth > limit:
            return True
        stack.extend((v, depth + 1) for v in value if isinstance(v, dict | list))
    return False


def _optional(body: dict[str, Any], key: str, kind: type | tuple[type, ...], expected: str) -> Any:
    value = body.get(key)
    if value is not None and not isinstance(value, kind):
        raise invalid_field(key, expected)
    return value


def parse_inbound(raw: bytes, endpoint: Endpoint, guard: DepthGuard | None = None) -> Inbound:
    body = parse_json(raw, guard)
    if not isinstance(body, dict):
        raise GatewayError(400, "The request body must be a JSON object.", code="invalid_json")
    model = body.get("model")
    if model is None:
        raise missing_field("model")
    if not isinstance(model, str):
        raise invalid_field("model", "a string")
    if endpoint in ("chat", "messages"):
        messages = body.get("messages")
        if messages is None:
            raise missing_field("messages")
        if not isinstance(messages, list):
            raise invalid_field("messages", "an array")
        for i, message in enumerate(messages):
            if not isinstance(message, dict):
                raise invalid_field(f"messages[{i}]", "an object")
    elif endpoint == "responses":
        items = body.get("input")
        if items is None:
            raise missing_field("input")
        if not isinstance(items, str | list):
            raise invalid_field("input", "a string or an array")
        _optional(body, "instructions", str, "a string")
        _optional(body, "previous_response_id", str, "a string")
    else:
        prompt = body.get("prompt")
        if prompt is None:
            raise missing_field("prompt")
        if not isinstance(prompt, str | list):
            raise invalid_field("prompt", "a string or an array")
    stream = _optional(body, "stream", bool, "a boolean") is True
    options = _optional(body, "stream_options", dict, "an object")
    _optional(body, "tools", list, "an array")
    _optional(body, "user", str, "a string")
    _optional(body, "prompt_cache_key", str, "a string")
    if endpoint == "messages":
        _optional(body, "system", (str, list), "a string or an array")
    # Responses and Messages streams always end with their usage: nothing to ask for.
    wants = endpoint in ("responses", "messages") or (
        bool(options) and options.get("include_usage") is True)
    return Inbound(body=body, model=model, stream=stream, client_wants_usage=wants)


# Fields only the gateway may set on an upstream body. `kv_transfer_params` tells a
# NixlConnector engine which blocks to load from which engine (or to lease a prefill): a
# client's own would make an engine pull another conversation's KV, whatever the fleet.
GATEWAY_ONLY = ("kv_transfer_params",)


def strip_gateway_only(body: dict[str, Any]) -> bool:
    """Drop the fields only the gateway sets from a client's body; True when any was
    there (the body then goes re-encoded)."""
    found = False
    for key in GATEWAY_ONLY:
        if key in body:
            del body[key]
            found = True
    return found


def inject_usage(body: dict[str, Any]) -> None:
    """Ask the engine for the final usage chunk the client did not request. Continuous
    per-chunk usage is switched off with it, or every chunk the client sees would change."""
    options = dict(body.get("stream_options") or {})
    options["include_usage"] = True
    if options.get("continuous_usage_stats"):
        options["continuous_usage_stats"] = False
    body["stream_options"] = options


def chat_view(endpoint: Endpoint, body: dict[str, Any]
              ) -> tuple[Literal["chat", "completions"], dict[str, Any]]:
    """What routing and hygiene read for a request: a chat or completions body as it is, a
    Responses or Messages body as the chat request vLLM renders from it (400 when it
    cannot be converted)."""
    if endpoint == "completions":
        return "completions", body
    if endpoint != "responses" and endpoint != "messages":
        return "chat", body
    convert = responses_api if endpoint == "responses" else messages_api
    try:
        return "chat", convert.chat_view(body)
    except NormalizeError as exc:
        raise GatewayError(400, str(exc), code="invalid_request") from None
