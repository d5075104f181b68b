"""Usage as the engine reported it, read from a non-streaming JSON body or from the
`usage` object of a stream chunk (pure), and the answer's text from a non-streaming body.

vLLM puts `prompt_tokens`, `completion_tokens` and, with `--enable-prompt-tokens-details`,
`prompt_tokens_details.cached_tokens` in `usage`. `cached_tokens` stays `None` whenever the
engine did not report it (details absent or `null`, as vLLM <= 0.23 does for a cold request);
a reported 0 stays 0. Counts that are not non-negative integers are treated as not reported.

The Responses API reports `input_tokens`, `input_tokens_details.cached_tokens` and
`output_tokens`; the Messages API `input_tokens` (the uncached part only),
`cache_read_input_tokens`, `cache_creation_input_tokens` and `output_tokens`. Both are
normalized to the chat fields: for Messages, prompt tokens = input + cache read + cache
creation, cached = cache read (None when the engine did not report it).

`answer_from_body` parses a complete body once for both the usage and the generated text
(`choices[0].message.content` for chat, `choices[0].text` for completions), which the router
indexes so the next turn of the conversation, which repeats it, is predicted as cached.
The text is None unless there is exactly one choice with string content (n > 1: the next
turn repeats only one of them; tool calls: no plain text to index).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int | None
    completion_tokens: int | None
    cached_tokens: int | None


def _count(value: Any) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    return None


def usage_from_mapping(usage: Any) -> Usage | None:
    """The `usage` object of a body or chunk; None when it is absent or not an object."""
    if not isinstance(usage, dict):
        return None
    if "input_tokens" in usage and "prompt_tokens" not in usage:
        return _api_usage(usage)
    details = usage.get("prompt_tokens_details")
    cached = _count(details.get("cached_tokens")) if isinstance(details, dict) else None
    return Usage(
        prompt_tokens=_count(usage.get("prompt_tokens")),
        completion_tokens=_count(usage.get("completion_tokens")),
        cached_tokens=cached,
    )


def _api_usage(usage: dict[str, Any]) -> Usage:
    """Responses or Messages usage, normalized."""
    uncached = _count(usage.get("input_tokens"))
    completion = _count(usage.get("output_tokens"))
    details = usage.get("input_tokens_details")
    if isinstance(details, dict):  # Responses: input_tokens is the whole prompt
        return Usage(uncached, completion, _count(details.get("cached_tokens")))
    read = _count(usage.get("cache_read_input_tokens"))
    created = _count(usage.get("cache_creation_input_tokens"))
    prompt = None if uncached is None else uncached + (read or 0) + (created or 0)
    return Usage(prompt, completion, read)


def response_id(doc: Any) -> str | None:
    """The id of a Responses API response object (None for any other document)."""
    if isinstance(doc, dict) and doc.get("object") == "response":
        rid = doc.get("id")
        if isinstance(rid, str):
            return rid
    return None


def usage_from_body(body: bytes) -> Usage | None:
    """Usage of a complete JSON response body; None for bodies without one."""
    return answer_from_body(body)[0]


# vLLM's reasoning parsers put a reasoning model's thinking beside the content (the field
# is named either way across versions); a P/D decoder's KV holds it, while the next turn
# sends the content alone (gateway.pd.answer)
REASONING = ("reasoning_content", "reasoning")


def carries_reasoning(part: Any) -> bool:
    """Whether a chat message or a stream's delta carries reasoning text."""
    return isinstance(part, dict) and any(
        isinstance(part.get(k), str) and part[k] for k in REASONING)


def reply_text(doc: dict[str, Any]) -> str | None:
    """The generated text of a parsed non-streaming chat/completions answer."""
    choices = doc.get("choices")
    if choices is None:
        return _api_text(doc)
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        return None
    choice = choices[0]
    message = choice.get("message")
    text = message.get("content") if isinstance(message, dict) else choice.get("text")
    return text if isinstance(text, str) else None


def _api_text(doc: dict[str, Any]) -> str | None:
    """The text of a Responses answer (`output[]` messages) or a Messages answer
    (`content[]` text blocks); None when it called tools (nothing plain to index)."""
    if doc.get("object") == "response":
        output = doc.get("output")
        if not isinstance(output, list) or len(output) != 1:
            return None
        item = output[0]
        blocks = item.get("content") if isinstance(item, dict) else None
        kind = "output_text"
    elif doc.get("type") == "message":
        blocks = doc.get("content")
        kind = "text"
    else:
        return None
    if not isinstance(blocks, list) or len(blocks) != 1 or not isinstance(blocks[0], dict):
        return None
    block = blocks[0]
    text = block.get("text")
    return text if block.get("type") == kind and isinstance(text, str) else None


@dataclass(frozen=True, slots=True)
class Answer:
    usage: Usage | None
    text: str | None
    response_id: str | None  # Responses API: the id a continuation will name
    # P/D: the decoder's own kv_transfer_params (vLLM's bidirectional_kv_xfer), gateway.pd
    kv_transfer_params: dict[str, Any] | None = None
    # choice 0's message carried reasoning beside its content (gateway.pd.answer)
    reasoning: bool = False
    # the parsed body, for what else is read from it once (P/D token ids: gateway.pd.tokenids)
    doc: dict[str, Any] | None = field(default=None, repr=False, compare=False)


def parse_answer(body: bytes) -> Answer:
    """Usage, generated text and Responses id of a complete JSON body, parsed once."""
    if b'"usage"' not in body:  # error bodies and most non-chat answers: skip the parse
        return Answer(None, None, None)
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        return Answer(None, None, None)
    if not isinstance(doc, dict):
        return Answer(None, None, None)
    params = doc.get("kv_transfer_params")
    choices = doc.get("choices")
    first = choices[0] if isinstance(choices, list) and choices else None
    return Answer(usage_from_mapping(doc.get("usage")), reply_text(doc), response_id(doc),
                  params if isinstance(params, dict) and params else None,
                  isinstance(first, dict) and carries_reasoning(first.get("message")), doc)


def answer_from_body(body: bytes) -> tuple[Usage | None, str | None]:
    """(usage, generated text) of a complete JSON response body, parsed once."""
    answer = parse_answer(body)
    return answer.usage, answer.text
