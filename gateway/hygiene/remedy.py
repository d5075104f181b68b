"""What to do about a finding, and what doing it saves (pure).

Every finding carries a one-line `remedy` written for what was found: where the value sits
and where it should go instead (the last user message: the cached prefix of the next turn
ends in front of it), which tools arrived in which order, which tool's keys moved, which
message of the history was rewritten. `fix_code` names the remedy's family in one token
for the `x-gateway-cache` header.

The saving of a remedy, per request, is the finding's `tokens_at_risk`: the prompt tokens
from the break to the end of the prompt, which the next request of the conversation could
read from the cache instead of computing them again. Per hour, `per_hour` scales the tokens
at risk of a span of traffic (each request counted once per kind, at its costliest finding,
as gateway.usage.findings sums them) to an hour: tokens x 3600 / the span's seconds, the
span taken as at least `MIN_RATE_SPAN_S` so the first few requests after a start are not
multiplied into a rate nobody sends.

The remedy names message positions, character offsets and tool names, never the offending
text itself (which `[hygiene] redact` hides): tool names are the client's own identifiers,
shown at most `_MAX_NAMES` of them, each cut to `_NAME_CHARS`; a message's role, the
client's text too, is cut likewise. A remedy is one printable line: a control character
(a newline, a terminal escape) from the client becomes `?`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Final, NamedTuple

from gateway.hygiene.prompt import Prompt, Tool

MAX_REMEDY_CHARS: Final = 400  # a remedy is one line; the header carries it whole
MIN_RATE_SPAN_S: Final = 60.0
_MAX_NAMES: Final = 6
_NAME_CHARS: Final = 24

# One sf-token per family for the response header (`fix=`).
FIX_CODES: Final[Mapping[str, str]] = {
    "timestamp": "move_or_round",
    "uuid": "move_id",
    "request_id": "move_id",
    "nonce": "drop_nonce",
    "counter": "drop_counter",
    "tool_order": "sort_tools",
    "json_key_order": "sort_keys",
    "history_rewrite": "append_only",
    "whitespace": "keep_whitespace",
    "volatile_span": "keep_head_fixed",
}
_DEFAULT_CODE: Final = "keep_prefix_stable"


class Where(NamedTuple):
    """What a remedy is written from."""

    place: str  # "message 0 (system)", "tool 'search' in the tool definitions", "the prompt"
    target: str  # where volatile content belongs: "the last user message (message 3)"
    offset: int  # the character the finding starts at
    time_of_day: bool  # a timestamp names a time of day or an instant (not a bare date)
    tool: str  # the tool the finding sits in, "" when none
    names: tuple[str, ...]  # the tools in the order this request sent them
    before: tuple[str, ...]  # the tools in the order the previous request sent them


def fix_code(kind: str) -> str:
    return FIX_CODES.get(kind, _DEFAULT_CODE)


def where(p: Prompt, k: int, offset: int, time_of_day: bool = True,
          before: Sequence[str] = ()) -> Where:
    """The `Where` of a finding at character `offset` of part `k` of `p`; `time_of_day`:
    the pattern hit's `dated` (False for a bare date)."""
    part = p.parts[k]
    tool = ""
    if part.role == "tools":
        tool = _tool_at(p.tools, offset)
        place = (f"tool {_name(tool)} in the tool definitions" if tool
                 else "the tool definitions")
    elif part.message_index is None:
        place = "the prompt"
    else:
        place = f"message {part.message_index} ({_plain(part.role)})"
    return Where(place, target(p), offset, time_of_day, tool,
                 tuple(t.name for t in p.tools), tuple(before))


def target(p: Prompt) -> str:
    """Where content that changes per request costs nothing: the last user message (the
    next turn's cached prefix ends in front of it), else the end of the prompt."""
    if p.endpoint != "chat":
        return "the end of the prompt"
    if p.last_user < len(p.parts):
        return f"the last user message (message {p.parts[p.last_user].message_index})"
    last = next((q.message_index for q in reversed(p.parts) if q.message_index is not None),
                None)
    return "the end of the messages" if last is None else f"a message after message {last}"


def remedy(kind: str, w: Where) -> str:
    """The one-line remedy for a finding of `kind` at `w`: printable (it goes into a log
    line, a header and onto a terminal), at most `MAX_REMEDY_CHARS`."""
    return _cut(_printable(_WRITERS.get(kind, _keep_stable)(w)))


def per_hour(tokens: int, span_s: float) -> int:
    """Tokens at risk over a span of `span_s` seconds, as a rate per hour."""
    return round(tokens * 3600.0 / max(span_s, MIN_RATE_SPAN_S))


def _timestamp(w: Where) -> str:
    if w.time_of_day:  # it changes every second or minute
        return (f"move the time from {w.place} into {w.target}, after the cached prefix, "
                "or round it to the day")
    return (f"move the date from {w.place} into {w.target}, or keep it: it breaks the "
            "cache once a day")


def _identifier(w: Where) -> str:
    return (f"take the per-request id out of {w.place}: send it as a header or in "
            f"`metadata`, keep it the same for the whole session, or move it into {w.target}")


def _nonce(w: Where) -> str:
    return (f"drop the random value from {w.place} or draw it once per session; if the "
            f"model needs it, move it into {w.target}")


def _counter(w: Where) -> str:
    return (f"drop the turn counter from {w.place} (the messages already show the turns) "
            f"or move it into {w.target}")


def _tool_order(w: Where) -> str:
    if list(w.names) == sorted(w.names):  # the previous request's order was the odd one
        return (f"keep the tools sorted by name as this request sent them {_names(w.names)}: "
                f"the previous one sent {_names(w.before)}; or set [hygiene] "
                "rewrite_sort_tools")
    return (f"sort the tools by name {_names(sorted(w.names))}: this request sent "
            f"{_names(w.names)}, the previous one {_names(w.before)}; or set [hygiene] "
            "rewrite_sort_tools")


def _json_key_order(w: Where) -> str:
    which = f"tool {_name(w.tool)}" if w.tool else "the tools"
    return (f"serialize {which} with its JSON keys in one fixed order (e.g. sorted): its key "
            "order changed since the last request; or set [hygiene] rewrite_schema_keys")


def _history_rewrite(w: Where) -> str:
    return (f"append to the conversation instead of rewriting it: {w.place} changed at "
            f"character {w.offset} since the last request; send earlier messages "
            "byte-identical")


def _whitespace(w: Where) -> str:
    return (f"send {w.place} with the whitespace it had (a strip or re-wrap changed it at "
            f"character {w.offset}); keep earlier text byte-identical")


def _volatile_span(w: Where) -> str:
    return (f"keep {w.place} identical from request to request (it changed at character "
            f"{w.offset}); put what changes into {w.target}")


def _keep_stable(w: Where) -> str:
    return (f"keep {w.place} identical from request to request; put what changes into "
            f"{w.target}")


_WRITERS: Final[Mapping[str, Callable[[Where], str]]] = {
    "timestamp": _timestamp,
    "uuid": _identifier,
    "request_id": _identifier,
    "nonce": _nonce,
    "counter": _counter,
    "tool_order": _tool_order,
    "json_key_order": _json_key_order,
    "history_rewrite": _history_rewrite,
    "whitespace": _whitespace,
    "volatile_span": _volatile_span,
}


def _tool_at(tools: Sequence[Tool], offset: int) -> str:
    for t in tools:
        if t.offset <= offset < t.offset + len(t.text) + 1:
            return t.name
    return ""


def _name(name: str) -> str:
    short = name if len(name) <= _NAME_CHARS else name[: _NAME_CHARS - 3] + "..."
    return repr(short)


def _names(names: Sequence[str]) -> str:
    shown = [_name(n) for n in names[:_MAX_NAMES]]
    if len(names) > _MAX_NAMES:
        shown.append(f"+{len(names) - _MAX_NAMES} more")
    return "[" + ", ".join(shown) + "]"


def _plain(text: str) -> str:
    """Client text shown bare (a message's role): cut to `_NAME_CHARS`, printable."""
    return _printable(text if len(text) <= _NAME_CHARS else text[: _NAME_CHARS - 3] + "...")


def _printable(text: str) -> str:
    """A control character (a newline, a terminal escape, a bidi override) as `?`."""
    return text if text.isprintable() else "".join(c if c.isprintable() else "?"
                                                   for c in text)


def _cut(text: str) -> str:
    return text if len(text) <= MAX_REMEDY_CHARS else text[: MAX_REMEDY_CHARS - 3] + "..."
