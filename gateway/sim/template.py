"""Qwen2.5's ChatML chat template, rendered in Python exactly as its Jinja source does.

The string returned here is what vLLM tokenizes (with ``add_special_tokens=False``) for a
chat request, so its blocks are the ones hashed by the prefix cache.

Rules reproduced from the Qwen2.5-Instruct ``tokenizer_config.json`` template:
- No system message first -> the default system prompt
  "You are Qwen, created by Alibaba Cloud. You are a helpful assistant." is inserted.
- With tools, the system block carries the system text, then the "# Tools" preamble and each
  tool as ``tool | tojson`` (``json.dumps`` with ``ensure_ascii=False``, keys in insertion
  order) on its own line inside ``<tools></tools>``.
- user / later system / plain assistant turns: ``<|im_start|>{role}\\n{content}<|im_end|>\\n``.
- assistant with tool_calls: optional ``\\n{content}``, then per call
  ``\\n<tool_call>\\n{"name": "...", "arguments": {json}}\\n</tool_call>``.
- consecutive tool results are grouped into one user turn of ``<tool_response>`` blocks.
- ``add_generation_prompt`` appends ``<|im_start|>assistant\\n``; ``continue_final_message``
  (vLLM) instead leaves the last message open (its trailing ``<|im_end|>\\n`` is cut).

Messages are already normalised by the protocol layer: ``content`` is a string (text parts
joined with a newline, as vLLM's "string" content format does) or ``None``; tool call
``arguments`` are parsed JSON values (vLLM parses the OpenAI argument string before
rendering).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

DEFAULT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
_TOOLS_HEAD = (
    "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
_TOOLS_TAIL = (
    "\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
)


def tojson(value: Any) -> str:
    """Jinja's ``tojson`` as transformers defines it for chat templates."""
    return json.dumps(value, ensure_ascii=False)


def render_chat(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
) -> str:
    parts: list[str] = []
    first_is_system = bool(messages) and messages[0].get("role") == "system"
    system = _text(messages[0].get("content")) if first_is_system else DEFAULT_SYSTEM
    if tools:
        parts.append("<|im_start|>system\n" + system + _TOOLS_HEAD)
        for tool in tools:
            parts.append("\n" + tojson(tool))
        parts.append(_TOOLS_TAIL)
    else:
        parts.append("<|im_start|>system\n" + system + "<|im_end|>\n")
    last = len(messages) - 1
    for i, msg in enumerate(messages):
        role = msg.get("role")
        content = msg.get("content")
        calls = msg.get("tool_calls")
        if role == "user" or (role == "system" and i > 0) or (role == "assistant" and not calls):
            parts.append(f"<|im_start|>{role}\n{_text(content)}<|im_end|>\n")
        elif role == "assistant":
            parts.append("<|im_start|>assistant")
            if content:
                parts.append("\n" + _text(content))
            for call in calls or ():
                fn = call.get("function", call)
                parts.append('\n<tool_call>\n{"name": "' + str(fn.get("name", "")) + '"')
                parts.append(', "arguments": ' + tojson(fn.get("arguments")) + "}\n</tool_call>")
            parts.append("<|im_end|>\n")
        elif role == "tool":
            if i == 0 or messages[i - 1].get("role") != "tool":
                parts.append("<|im_start|>user")
            parts.append("\n<tool_response>\n" + _text(content) + "\n</tool_response>")
            if i == last or messages[i + 1].get("role") != "tool":
                parts.append("<|im_end|>\n")
    text = "".join(parts)
    if continue_final_message:
        # vLLM renders without the generation prompt and cuts the final message's end tag.
        end = "<|im_end|>\n"
        if text.endswith(end):
            text = text[: -len(end)]
    elif add_generation_prompt:
        text += "<|im_start|>assistant\n"
    return text


def _text(content: Any) -> str:
    return "" if content is None else str(content)
