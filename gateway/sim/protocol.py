"""Validation of request bodies into the few values the simulator needs (pure).

Mirrors the parts of vLLM's pydantic request models that change behaviour: types of the
common fields, ``messages`` shape and content parts (text only; parts are joined with a
newline like vLLM's "string" content format), tool-call arguments parsed from their JSON
string before templating, ``stream_options``, ``n`` (only 1 is simulated), ``cache_salt``
(non-empty, at most 128 chars, no ``@ / \\`` or NUL, as 0.33's validator) and
``max_tokens`` / ``max_completion_tokens``. Every violation raises a 400 ``ApiError`` naming
the field, never a crash.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from gateway.sim.errors import ApiError, bad_request
from gateway.sim.transfer import KvTransfer, parse_kv_transfer

_ROLES = ("system", "user", "assistant", "tool", "developer")
_NUMBERS = (
    "temperature",
    "top_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_p",
)


@dataclass(frozen=True, kw_only=True)
class GenerationParams:
    model: str | None
    stream: bool
    include_usage: bool
    continuous_usage: bool
    max_tokens: int | None
    cache_salt: str | None
    priority: int = 0  # vLLM's scheduling priority (lower first); needs the priority policy
    kv_transfer: KvTransfer | None = None  # kv_transfer_params (a P/D leg)
    # vLLM's `return_token_ids`: the prompt's and the generated token ids in the answer
    return_token_ids: bool = False


@dataclass(frozen=True, kw_only=True)
class ChatParams:
    gen: GenerationParams
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    add_generation_prompt: bool
    continue_final_message: bool
    # As vLLM resolves it: "auto" when tools come without a choice; None without tools.
    tool_choice: str | dict[str, Any] | None = None


@dataclass(frozen=True, kw_only=True)
class CompletionParams:
    gen: GenerationParams
    prompt: str | list[int]


def parse_json(raw: bytes) -> dict[str, Any]:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        # FastAPI's json_invalid error: loc ("body", position), which vLLM joins into param.
        raise bad_request(f"Invalid JSON body: {e}", f"body.{e.pos}") from None
    if not isinstance(body, dict):
        raise bad_request("Request body must be a JSON object")
    return body


def parse_generation(body: Mapping[str, Any], name: str) -> GenerationParams:
    model = _opt(body, "model", str, "a string")
    stream = _opt(body, "stream", bool, "a boolean") or False
    options = _opt(body, "stream_options", dict, "an object")
    include = continuous = False
    if options is not None:
        include = bool(_opt(options, "include_usage", bool, "a boolean", "stream_options."))
        continuous = bool(
            _opt(options, "continuous_usage_stats", bool, "a boolean", "stream_options.")
        )
        if not stream:
            raise bad_request(
                "Stream options can only be defined when `stream=True`.", "stream_options"
            )
    n = _opt(body, "n", int, "an integer")
    if n is not None and n != 1:
        raise bad_request("n > 1 is not supported by the simulator", "n")
    for key in _NUMBERS:
        _opt(body, key, (int, float), "a number")
    stop = body.get("stop")
    if stop is not None and not isinstance(stop, str | list):
        raise bad_request(_type_msg(name, "stop", "a string or a list of strings"), "stop")
    max_tokens = _opt(body, "max_tokens", int, "an integer")
    if max_tokens is None:
        max_tokens = _opt(body, "max_completion_tokens", int, "an integer")
    if max_tokens is not None and max_tokens < 1:
        raise bad_request(f"max_tokens must be at least 1, got {max_tokens}.", "max_tokens")
    raw_kv = _opt(body, "kv_transfer_params", dict, "an object")
    kv_transfer = None if raw_kv is None else parse_kv_transfer(raw_kv)
    if isinstance(kv_transfer, str):
        raise bad_request(kv_transfer, "kv_transfer_params")
    return GenerationParams(
        kv_transfer=kv_transfer,
        model=model,
        stream=stream,
        include_usage=include,
        continuous_usage=continuous,
        max_tokens=max_tokens,
        cache_salt=_cache_salt(body),
        priority=_opt(body, "priority", int, "an integer") or 0,
        return_token_ids=bool(_opt(body, "return_token_ids", bool, "a boolean")),
    )


def parse_chat(body: Mapping[str, Any]) -> ChatParams:
    gen = parse_generation(body, "ChatCompletionRequest")
    raw_messages = body.get("messages")
    if raw_messages is None:
        raise bad_request(_missing("ChatCompletionRequest", "messages"), "messages")
    if not isinstance(raw_messages, list):
        raise bad_request(_type_msg("ChatCompletionRequest", "messages", "a list"), "messages")
    messages = [_message(m, i) for i, m in enumerate(raw_messages)]
    tools = _opt(body, "tools", list, "a list")
    if tools == []:
        raise bad_request(
            "`tools` must not be an empty array. "
            "Either provide at least one tool or omit the field entirely.",
            "tools",
        )
    parsed_tools = None if tools is None else [_tool(t, i) for i, t in enumerate(tools)]
    tool_choice = _tool_choice(body.get("tool_choice"), parsed_tools is not None)
    if isinstance(tool_choice, dict):
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if not any(t["function"]["name"] == name for t in parsed_tools or ()):
            # vLLM's check (the named function must be one of the tools)
            raise bad_request(f"Tool '{name}' has not been passed in `tools`.", "tool_choice")
    add_gen = _opt(body, "add_generation_prompt", bool, "a boolean")
    cont = bool(_opt(body, "continue_final_message", bool, "a boolean"))
    if cont and add_gen:
        raise bad_request(
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
        )
    return ChatParams(
        gen=gen,
        messages=messages,
        tools=parsed_tools,
        add_generation_prompt=True if add_gen is None else add_gen,
        continue_final_message=cont,
        tool_choice=tool_choice,
    )


def _tool_choice(choice: Any, has_tools: bool) -> str | dict[str, Any] | None:
    if choice is None:
        return "auto" if has_tools else None
    if choice == "none":
        return "none"
    if not has_tools:
        raise bad_request("When using `tool_choice`, `tools` must be set.", "tool_choice")
    if isinstance(choice, dict):
        return choice
    if choice in ("auto", "required"):
        return str(choice)
    raise bad_request(
        f"Invalid value for `tool_choice`: {choice}! "
        'Only named tools, "none", "auto" or "required" are supported.',
        "tool_choice",
    )


def parse_completion(body: Mapping[str, Any]) -> CompletionParams:
    gen = parse_generation(body, "CompletionRequest")
    prompt = body.get("prompt")
    if prompt is None:
        raise bad_request(_missing("CompletionRequest", "prompt"), "prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, list):
        if not prompt or not all(isinstance(t, int) and t >= 0 for t in prompt):
            raise bad_request(
                "prompt must be a string or a list of token ids "
                "(batches are not supported by the simulator)",
                "prompt",
            )
    elif not isinstance(prompt, str):
        raise bad_request(_type_msg("CompletionRequest", "prompt", "a string"), "prompt")
    if prompt == "":
        raise bad_request("Prompt cannot be empty.", "prompt")
    return CompletionParams(gen=gen, prompt=prompt)


def _message(m: Any, i: int) -> dict[str, Any]:
    if not isinstance(m, dict):
        raise bad_request(f"messages[{i}] must be an object", "messages")
    role = m.get("role")
    if role not in _ROLES:
        raise bad_request(f"messages[{i}].role must be one of {', '.join(_ROLES)}", "messages")
    out = dict(m)
    out["content"] = _content(m.get("content"), i)
    calls = m.get("tool_calls")
    if calls is not None:
        if not isinstance(calls, list):
            raise bad_request(f"messages[{i}].tool_calls must be a list", "messages")
        out["tool_calls"] = [_tool_call(c, i) for c in calls]
    return out


def _content(content: Any, i: int) -> str | None:
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        texts: list[str] = []
        for part in content:
            if isinstance(part, str):
                texts.append(part)
            elif (
                isinstance(part, dict)
                and part.get("type", "text") == "text"
                and isinstance(part.get("text"), str)
            ):
                texts.append(part["text"])
            else:
                raise bad_request(
                    f"messages[{i}].content: only text parts are supported by the simulator",
                    "messages",
                )
        return "\n".join(texts)
    raise bad_request(f"messages[{i}].content must be a string or a list of parts", "messages")


def _tool_call(call: Any, i: int) -> dict[str, Any]:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise bad_request(f"messages[{i}].tool_calls entries need function.name", "messages")
    args = fn.get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = orjson.loads(args) if args else {}
        except orjson.JSONDecodeError:
            raise bad_request(
                f"messages[{i}].tool_calls arguments are not valid JSON", "messages"
            ) from None
    return {**call, "function": {**fn, "arguments": args}}


def _tool(tool: Any, i: int) -> dict[str, Any]:
    fn = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise bad_request(
            f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}", "tools"
        )
    # vLLM renders `tool.model_dump()`: declared fields in model order, unset ones as null.
    return {
        "type": tool.get("type", "function"),
        "function": {
            "name": fn["name"],
            "description": fn.get("description"),
            "parameters": fn.get("parameters"),
        },
    }


def _cache_salt(body: Mapping[str, Any]) -> str | None:
    salt = body.get("cache_salt")
    if salt is None:
        return None
    if not isinstance(salt, str) or not salt:
        raise bad_request(
            "Parameter 'cache_salt' must be a non-empty string if provided.", "cache_salt"
        )
    if len(salt) > 128 or any(c in salt for c in "@/\\\x00"):
        raise bad_request(
            "Parameter 'cache_salt' must be at most 128 characters and must "
            "not contain '@', '/', '\\' or NUL.",
            "cache_salt",
        )
    return salt


def _opt(
    body: Mapping[str, Any], key: str, kind: type | tuple[type, ...], what: str, prefix: str = ""
) -> Any:
    value = body.get(key)
    if value is None:
        return None
    wrong_bool = (
        isinstance(value, bool)
        and kind is not bool
        and bool not in (kind if isinstance(kind, tuple) else (kind,))
    )
    if not isinstance(value, kind) or wrong_bool:
        raise ApiError(400, _type_msg("Request", prefix + key, what), prefix + key)
    return value


def _type_msg(model: str, field: str, what: str) -> str:
    return f"1 validation error for {model}\n{field}\n  Input should be {what}"


def _missing(model: str, field: str) -> str:
    return f"1 validation error for {model}\n{field}\n  Field required"
