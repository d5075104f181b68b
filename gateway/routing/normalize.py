"""Request body -> canonical byte stream that changes exactly when vLLM's prefill would.

The stream is rendered like the ChatML/Qwen2.5 chat template that vLLM applies, with short
control-byte role markers instead of `<|im_start|>`/`<|im_end|>` (each one token in the
engine, so one byte here keeps bytes roughly proportional to tokens):

    S system \\n <system text> [tools section] E
    S user \\n <content> E
    S assistant \\n <content> [\\n<tool_call>\\n{"name": N, "arguments": A}\\n</tool_call>]... E
    S user \\n<tool_response>\\n<result>\\n</tool_response> ... E     (tool results, grouped)
    S assistant \\n                                                  (generation prompt)

with S = "\\x1e" and E = "\\x1f\\n".

Choices, each following what the template does to the prefill tokens:
- Tools sit in the system block after the system text (Qwen2.5's order), one JSON object
  per tool serialized with insertion order kept (Jinja's `tojson` does not sort keys), so
  tool order and tool key order change the stream while JSON whitespace of the request
  body does not (the body is already parsed).
- A missing system message renders the template's default system text, so "no system"
  and "default system" are the same prefix (they are the same tokens in Qwen2.5).
- Content given as a list of parts is joined with "\\n" (vLLM's string content format),
  so `[{"type":"text","text":"a"},{"type":"text","text":"b"}]` equals `"a\\nb"`; non-text
  parts (images, audio) are kept as their JSON so different media differ.
- Whitespace inside content is content: it changes the stream.
- `tool_calls[].function.arguments`: the OpenAI API sends a JSON *string*; vLLM parses it
  (`json.loads`) before rendering and the template prints it back with `tojson`, so what
  reaches the tokens is the parsed object re-serialized with its key order kept. We do the
  same: spacing inside the argument string does not matter, key order and values do. A
  string that is not valid JSON is kept as text.
- `tool_call_id` and message `name` are not rendered by ChatML/Qwen templates: ignored.
- Sampling parameters (temperature, max_tokens, stream, n, ...) are ignored.
- The model, `cache_salt` and template switches (`chat_template`, `chat_template_kwargs`,
  `add_generation_prompt`) do not appear in the stream: they seed the hash chain
  (`chain_seed`), the same way vLLM mixes `cache_salt` into block 0 only.

Completions: a string prompt is its UTF-8 bytes; a token-id prompt is packed as 4 bytes
per id (uint32) so it hashes stably; a batch is routed by its first prompt.

Everything is built with `str.join` and one `encode`: no per-character Python loops.
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import orjson
import xxhash

START = "\x1e"
END = "\x1f\n"
DEFAULT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
TOOLS_HEAD = (
    "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
TOOLS_TAIL = (
    "\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)


class NormalizeError(ValueError):
    """The body cannot be rendered (wrong shape); the gateway answers 400."""


def content_text(content: Any) -> str:
    """Message content as the template sees it: a string, or text parts joined by newlines."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts: list[str] = []
        for part in content:
            if isinstance(part, Mapping) and part.get("type") == "text":
                texts.append(str(part.get("text", "")))
            elif isinstance(part, str):
                texts.append(part)
            else:
                texts.append(_json(part))
        return "\n".join(texts)
    raise NormalizeError("message content must be a string, a list of parts or null")


def _json(value: Any) -> str:
    try:
        return orjson.dumps(value).decode()
    except TypeError as e:  # orjson rejects non-str keys, huge ints, ...
        raise NormalizeError(f"cannot serialize {type(value).__name__}: {e}") from e


def _tool_call_text(call: Any) -> str:
    fn = call.get("function", call) if isinstance(call, Mapping) else None
    if not isinstance(fn, Mapping):
        raise NormalizeError("tool_calls entries must be objects")
    args = fn.get("arguments", "")
    if isinstance(args, str):
        try:
            args_text = _json(orjson.loads(args))
        except orjson.JSONDecodeError:
            args_text = args
    else:
        args_text = _json(args)
    name = fn.get("name", "")
    return f'\n<tool_call>\n{{"name": "{name}", "arguments": {args_text}}}\n</tool_call>'


def render_chat(body: Mapping[str, Any]) -> str:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise NormalizeError("'messages' must be a non-empty list")
    parts: list[str] = []
    first = messages[0]
    if not isinstance(first, Mapping):
        raise NormalizeError("each message must be an object")
    rest: Sequence[Any] = messages
    system = DEFAULT_SYSTEM
    if first.get("role") == "system":
        system = content_text(first.get("content"))
        rest = messages[1:]
    parts += [START, "system\n", system]
    tools = body.get("tools")
    if tools:
        if not isinstance(tools, list):
            raise NormalizeError("'tools' must be a list")
        parts.append(TOOLS_HEAD)
        for tool in tools:
            parts += ["\n", _json(tool)]
        parts.append(TOOLS_TAIL)
    parts.append(END)
    in_tool_group = False
    append = parts.append
    for msg in rest:
        if type(msg) is not dict and not isinstance(msg, Mapping):
            raise NormalizeError("each message must be an object")
        role = msg.get("role")
        content = msg.get("content")
        # Fast path (most messages): plain role + string content, one f-string each.
        if (type(content) is str and type(role) is str and role != "tool"
                and not in_tool_group and (role != "assistant" or not msg.get("tool_calls"))):
            append(f"{START}{role}\n{content}{END}")
            continue
        if not isinstance(role, str):
            raise NormalizeError("each message needs a string 'role'")
        if role == "tool":
            # Qwen2.5 groups consecutive tool results into one user turn.
            if not in_tool_group:
                parts += [START, "user"]
                in_tool_group = True
            parts += ["\n<tool_response>\n", content_text(content), "\n</tool_response>"]
            continue
        if in_tool_group:
            parts.append(END)
            in_tool_group = False
        calls = msg.get("tool_calls") if role == "assistant" else None
        if calls:
            if not isinstance(calls, list):
                raise NormalizeError("'tool_calls' must be a list")
            text = content_text(content)
            parts += [START, "assistant", "\n" + text if text else ""]
            parts += [_tool_call_text(c) for c in calls]
            parts.append(END)
        else:
            parts += [START, role, "\n", content_text(content), END]
    if in_tool_group:
        parts.append(END)
    if body.get("add_generation_prompt", True) is not False:
        parts += [START, "assistant\n"]
    return "".join(parts)


def render_completion(body: Mapping[str, Any]) -> bytes:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        prompt = prompt[0]  # a batch: route by its first prompt
    if isinstance(prompt, str):
        return prompt.encode("utf-8", "surrogatepass")
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        try:
            return array("I", prompt).tobytes()
        except OverflowError as e:
            raise NormalizeError("token ids must be non-negative 32-bit integers") from e
    raise NormalizeError("'prompt' must be a string, a list of strings or a list of token ids")


def canonical_bytes(body: Mapping[str, Any], endpoint: Literal["chat", "completions"]) -> bytes:
    """The canonical stream of a parsed request body."""
    if endpoint == "chat":
        return render_chat(body).encode("utf-8", "surrogatepass")
    return render_completion(body)


def chain_seed(
    body: Mapping[str, Any], endpoint: Literal["chat", "completions"], model: str
) -> int:
    """Seed of the block-hash chain: model, cache_salt and template switches.

    Two requests can share cached blocks only with equal seeds (vLLM mixes cache_salt into
    block 0; another model or template is another token stream altogether).
    """
    salt = body.get("cache_salt")
    key = [model, endpoint, salt if isinstance(salt, str) else ""]
    for name in ("chat_template", "chat_template_kwargs", "continue_final_message"):
        value = body.get(name)
        if value is not None:
            key.append(f"{name}={_json(value)}")
    return xxhash.xxh3_64_intdigest("\x00".join(key).encode("utf-8", "surrogatepass"))
