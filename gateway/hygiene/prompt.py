"""A request body seen as the ordered parts the engine's template renders: the tool
definitions, then each message (or the completions prompt).

Each part carries `text` (what `char_offset` indexes: a message's content, the serialized
tools JSON, the prompt) and `extra` (everything else of the part that reaches the template:
tool calls, names, tool_call_id, non-text content parts), plus a hash of both so drift can
compare parts without keeping their text. `chars_after(k, offset)` is the rendered size
from a break to the end of the prompt, the basis of `tokens_at_risk` (about 4 chars a token).

Tools are serialized with orjson (compact, key order as sent), which is what a template's
`tojson` keeps: key order matters, whitespace in the client's JSON does not.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import accumulate
from operator import itemgetter
from typing import Any, NamedTuple

import orjson
import xxhash
from xxhash import xxh3_64_intdigest as xxh3

# Role markers and separators a chat template adds around each message (ChatML: about
# "<|im_start|>user\n" + "<|im_end|>\n"); only the size matters here.
TEMPLATE_OVERHEAD = 24
CHARS_PER_TOKEN = 4


@dataclass(frozen=True, slots=True)
class Tool:
    name: str
    text: str  # orjson of the tool as sent
    offset: int  # where it starts in the serialized tools list
    canon: int  # hash of the tool with keys sorted: equal canon, different text = key order


_new = tuple.__new__
_SIZE = itemgetter(5)  # Part.size


class Part(NamedTuple):
    """A named tuple rather than a frozen dataclass: one is built per message per request,
    and a tuple is several times cheaper to construct."""

    message_index: int | None  # None for tools and the completions prompt
    role: str  # message role, "tools" or "prompt"
    text: str
    extra: str
    digest: int  # xxh3 of text and extra
    size: int  # rendered chars: text + extra + TEMPLATE_OVERHEAD


@dataclass(frozen=True, slots=True)
class Prompt:
    endpoint: str
    parts: tuple[Part, ...]  # tools part first when there are tools
    tools: tuple[Tool, ...]
    last_user: int  # position in `parts` of the last user message, len(parts) if none
    suffix: tuple[int, ...]  # suffix[k] = rendered chars of parts k.. end

    def chars_after(self, k: int, offset: int) -> int:
        return max(0, self.parts[k].size - offset) + self.suffix[k + 1]

    def tokens_after(self, k: int, offset: int) -> int:
        return self.chars_after(k, offset) // CHARS_PER_TOKEN


def validate(body: Any, endpoint: str) -> None:
    """Raise ValueError naming what is wrong with a body the analyzer cannot read."""
    if not isinstance(body, Mapping):
        raise ValueError("request body is not a JSON object")
    if endpoint == "chat":
        msgs = body.get("messages")
        if not isinstance(msgs, list):
            raise ValueError("'messages' is not a list")
        for i, m in enumerate(msgs):
            if type(m) is not dict and not isinstance(m, Mapping):
                raise ValueError(f"messages[{i}] is not an object")
        tools = body.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise ValueError("'tools' is not a list")
    elif not isinstance(body.get("prompt", ""), str | list):
        raise ValueError("'prompt' is not a string or list")


def parse(body: Mapping[str, Any], endpoint: str) -> Prompt:
    """The parts of a body (which `validate` accepts; anything unexpected inside a message
    is kept in `extra` rather than rejected)."""
    parts: list[Part] = []
    tools: tuple[Tool, ...] = ()
    last_user = -1
    if endpoint == "chat":
        raw_tools = body.get("tools")
        if isinstance(raw_tools, list) and raw_tools:
            tools, tools_text = _tools(raw_tools)
            parts.append(_part(None, "tools", tools_text, ""))
        msgs = body.get("messages")
        new, enc, size, append = _new, str.encode, len, parts.append
        for i, m in enumerate(msgs if isinstance(msgs, list) else ()):
            if type(m) is dict and len(m) == 2:
                # the usual message, {"role": ..., "content": "..."}, nothing else to
                # render: its part is built here (no call), as most of a long
                # conversation's are
                text = m.get("content")
                role = m.get("role")
                if type(text) is str and type(role) is str:
                    if role == "user":
                        last_user = len(parts)
                    append(new(Part, (i, role, text, "",
                                      xxh3(enc(text, "utf-8", "surrogatepass")),
                                      size(text) + TEMPLATE_OVERHEAD)))
                    continue
            # `type is dict` first: the ABC check of Mapping costs more than the rest
            if type(m) is not dict and not isinstance(m, Mapping):
                continue
            role = str(m.get("role", ""))
            text, extra = _content(m)
            if role == "user":
                last_user = len(parts)
            append(_part(i, role, text, extra))
    else:
        prompt = body.get("prompt", "")
        if isinstance(prompt, list):
            # a batch of strings or token ids: the first prompt stands for the template
            first = prompt[0] if prompt else ""
            prompt = first if isinstance(first, str) else _dumps(prompt)
        parts.append(_part(None, "prompt", str(prompt), ""))
    # suffix[k] = sizes of parts k.. end, summed from the end (in C)
    suffix = tuple(accumulate(map(_SIZE, reversed(parts)), initial=0))[::-1]
    return Prompt(
        endpoint=endpoint,
        parts=tuple(parts),
        tools=tools,
        last_user=last_user if last_user >= 0 else len(parts),
        suffix=suffix,
    )


def _part(index: int | None, role: str, text: str, extra: str) -> Part:
    digest = xxh3(text.encode("utf-8", "surrogatepass"))
    if extra:
        digest = xxh3(extra.encode("utf-8", "surrogatepass"), seed=digest)
    # tuple.__new__: a named tuple's own constructor is a Python function, 3x slower
    return _new(Part, (index, role, text, extra, digest,
                       len(text) + len(extra) + TEMPLATE_OVERHEAD))


def _tools(raw: Sequence[Any]) -> tuple[tuple[Tool, ...], str]:
    out: list[Tool] = []
    pieces: list[str] = []
    offset = 1  # after "["
    for t in raw:
        text = _dumps(t)
        canon = xxhash.xxh3_64_intdigest(_dumps(t, orjson.OPT_SORT_KEYS).encode())
        out.append(Tool(tool_name(t), text, offset, canon))
        pieces.append(text)
        offset += len(text) + 1
    return tuple(out), "[" + ",".join(pieces) + "]"


def tool_name(t: Any) -> str:
    if isinstance(t, Mapping):
        fn = t.get("function")
        if isinstance(fn, Mapping) and isinstance(fn.get("name"), str):
            return str(fn["name"])
        if isinstance(t.get("name"), str):
            return str(t["name"])
    return ""


def _content(m: Mapping[str, Any]) -> tuple[str, str]:
    content = m.get("content")
    rest: dict[str, Any] = {}
    if isinstance(content, str):
        text = content
    elif isinstance(content, list):
        texts: list[str] = []
        others: list[Any] = []
        for p in content:
            if isinstance(p, Mapping) and isinstance(p.get("text"), str):
                texts.append(p["text"])
            else:
                others.append(p)
        text = "\n".join(texts)
        if others:
            rest["content"] = others
    else:
        text = "" if content is None else _dumps(content)
    for key in ("name", "tool_calls", "tool_call_id", "function_call"):
        if key in m:
            rest[key] = m[key]
    return text, _dumps(rest) if rest else ""


def _dumps(value: Any, option: int = 0) -> str:
    """JSON text of a body part; a value orjson refuses (an integer beyond 64 bits, which a
    JSON parser other than orjson may hand over) falls back to its repr: the scanner never
    fails on what a client sent."""
    try:
        return orjson.dumps(value, option=option).decode()
    except TypeError:
        return repr(value)
