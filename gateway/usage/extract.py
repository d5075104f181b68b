"""Usage as the engine reported it, read from a non-streaming JSON body or from the
`usage` object of a stream chunk (pure), and the answer's text from a non-streaming body.

vLLM puts `prompt_tokens`, `completion_tokens` and, with `--enable-prompt-tokens-details`,
`prompt_tokens_details.cached_tokens` in `usage`. `cached_tokens` stays `None` whenever the
engine did not report it (details absent or `null`, as vLLM <= 0.23 does for a cold request);
a reported 0 stays 0. Counts that are not non-negative integers are treated as not reported.

`answer_from_body` parses a complete body once for both the usage and the generated text
(`choices[0].message.content` for chat, `choices[0].text` for completions), which the router
indexes so the next turn of the conversation, which repeats it, is predicted as cached.
The text is None unless there is exactly one choice with string content (n > 1: the next
turn repeats only one of them; tool calls: no plain text to index).
"""

from __future__ import annotations

from dataclasses import dataclass
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
    details = usage.get("prompt_tokens_details")
    cached = _count(details.get("cached_tokens")) if isinstance(details, dict) else None
    return Usage(
        prompt_tokens=_count(usage.get("prompt_tokens")),
        completion_tokens=_count(usage.get("completion_tokens")),
        cached_tokens=cached,
    )


def usage_from_body(body: bytes) -> Usage | None:
    """Usage of a complete JSON response body; None for bodies without one."""
    return answer_from_body(body)[0]


def reply_text(doc: dict[str, Any]) -> str | None:
    """The generated text of a parsed non-streaming chat/completions answer."""
    choices = doc.get("choices")
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        return None
    choice = choices[0]
    message = choice.get("message")
    text = message.get("content") if isinstance(message, dict) else choice.get("text")
    return text if isinstance(text, str) else None


def answer_from_body(body: bytes) -> tuple[Usage | None, str | None]:
    """(usage, generated text) of a complete JSON response body, parsed once."""
    if b'"usage"' not in body:  # error bodies and most non-chat answers: skip the parse
        return None, None
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None, None
    if not isinstance(doc, dict):
        return None, None
    return usage_from_mapping(doc.get("usage")), reply_text(doc)
