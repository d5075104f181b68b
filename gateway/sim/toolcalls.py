"""Tool calls on the simulator: which call a request gets, its arguments, and how it streams.

Pure decisions; the HTTP side (gateway.sim.app) feeds them the request and the tokens.

- ``choose``: a named ``tool_choice`` calls that function, ``"required"`` one of the tools
  (drawn by the request's seeded generator), ``"auto"`` one of them with probability
  ``auto_probability``, ``"none"`` (or no tools) never.
- ``arguments``: a value valid for the function's JSON-schema ``parameters`` (type, enum,
  const, required and optional properties, nested objects and arrays, numeric and length
  bounds), nesting bounded by ``MAX_DEPTH``: below it optional properties and optional
  array items are left out. A local ``$ref`` (``#``, ``#/$defs/...``, ``#/definitions/...``:
  what pydantic's ``model_json_schema()`` emits for nested models) is followed, each one a
  level deeper so a recursive schema ends; ``pattern`` and remote refs are not (a string,
  any value, is drawn).
  Bounds against a hostile schema (the answer would break it there, not the simulator):
  at most ``MAX_ITEMS`` items per array, ``MAX_CHARS`` characters per string, and nothing
  (null) below ``HARD_DEPTH`` levels of required nesting.
- ``hermes_text``: the text the model emits for the call, exactly as Qwen2.5's template
  renders an assistant tool call back (``json.dumps`` separators), so the next turn's
  prompt extends through this reply and its prefix stays cached, as with real output.
- ``StreamPlan``: what each generated token adds to the stream, as vLLM's hermes parser
  streams it: nothing until the function's name is known, then one delta with the call's
  id, type and name, then the arguments' text in fragments, then nothing for the closing
  tag; the finish chunk carries ``PlannedCall.finish``.
- ``finish_reason`` and ``content`` of a whole call as vLLM's chat_completion/serving.py
  gives them (OpenAI's convention): ``"tool_calls"`` for ``"required"`` and ``"auto"``,
  ``"stop"`` for a named function, streamed or not; ``content`` ``""`` beside the call of a
  named or ``"required"`` choice, null for ``"auto"`` (the hermes parser's empty prefix).
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gateway.sim.generator import WORDS
from gateway.sim.responses import ChunkWriter

MAX_DEPTH = 4  # nesting of objects/arrays that still gets optional members
HARD_DEPTH = 32  # required members nest no deeper (Python's recursion, a request's size)
MAX_ITEMS = 64  # items of one array, whatever minItems asks
MAX_CHARS = 4096  # characters of one string, whatever minLength asks
_MAX_ITEMS = 3  # array length drawn when the schema does not bound it
_INT_SPAN = 100


def choose(
    choice: str | Mapping[str, Any] | None,
    tools: Sequence[Mapping[str, Any]] | None,
    auto_probability: float,
    rng: random.Random,
) -> Mapping[str, Any] | None:
    """The function (a tool's ``function`` object) this request calls, or None."""
    if not tools or choice is None or choice == "none":
        return None
    functions: list[Mapping[str, Any]] = [t["function"] for t in tools]
    if isinstance(choice, Mapping):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, Mapping) else None
        for f in functions:
            if f.get("name") == name:
                return f
        return None  # the protocol layer rejects an unknown name first
    if choice == "auto" and rng.random() >= auto_probability:
        return None
    return functions[rng.randrange(len(functions))]


def arguments(schema: Any, rng: random.Random, depth: int = 0, root: Any = None) -> Any:
    """A value valid for `schema` (a JSON-schema dict; anything else allows any value);
    `root`: the document local ``$ref``s point into (`schema` itself at the top)."""
    if not isinstance(schema, Mapping):
        return _word(rng)
    if depth > HARD_DEPTH:
        return None
    if root is None:
        root = schema
    ref = schema.get("$ref")
    if isinstance(ref, str):
        target = _resolve(ref, root)
        if target is None:
            return _word(rng)  # remote or dangling: nothing known, any value
        # the keywords beside a $ref apply too (draft 2019-09 on); the target's win
        siblings = {k: v for k, v in schema.items() if k != "$ref"}
        return arguments({**siblings, **target} if siblings else target, rng, depth + 1, root)
    if "const" in schema:
        return schema["const"]
    enum = schema.get("enum")
    if isinstance(enum, list) and enum:
        return enum[rng.randrange(len(enum))]
    for key in ("anyOf", "oneOf"):
        options = schema.get(key)
        if isinstance(options, list) and options:
            return arguments(options[rng.randrange(len(options))], rng, depth, root)
    all_of = schema.get("allOf")
    if isinstance(all_of, list) and all_of:
        merged: dict[str, Any] = {}
        for part in all_of:
            if isinstance(part, Mapping):
                _merge(merged, part)
        return arguments(merged, rng, depth, root)
    kind = schema.get("type")
    if isinstance(kind, list):
        kinds = [k for k in kind if k != "null"] or ["null"]
        kind = kinds[rng.randrange(len(kinds))]
    if kind is None:
        kind = "object" if "properties" in schema else "array" if "items" in schema else "string"
    if kind == "object":
        return _object(schema, rng, depth, root)
    if kind == "array":
        return _array(schema, rng, depth, root)
    if kind == "integer":
        return _integer(schema, rng)
    if kind == "number":
        return _number(schema, rng)
    if kind == "boolean":
        return rng.random() < 0.5
    if kind == "null":
        return None
    return _string(schema, rng)


def hermes_text(name: str, args: Any) -> str:
    """The generated text of one call (what ``<|im_end|>`` follows)."""
    return (
        '<tool_call>\n{"name": ' + json.dumps(name, ensure_ascii=False)
        + ', "arguments": ' + arguments_json(args) + "}\n</tool_call>"
    )


def arguments_json(args: Any) -> str:
    """The ``arguments`` string of the call (vLLM's hermes parser: ``json.dumps`` of the
    parsed value, ``ensure_ascii=False``), the same text the template renders back."""
    return json.dumps(args, ensure_ascii=False)


@dataclass(frozen=True, slots=True)
class PlannedCall:
    """The call one request answers with."""

    id: str
    name: str
    arguments: str  # the JSON text
    plan: StreamPlan
    text: str  # what the model generates
    named: bool = False  # tool_choice named the function
    required: bool = False  # tool_choice "required"

    @classmethod
    def draw(cls, function: Mapping[str, Any], rng: random.Random,
             choice: str | Mapping[str, Any] | None = "auto") -> PlannedCall:
        """`choice`: the request's tool_choice (a named one is a mapping)."""
        name = str(function.get("name", ""))
        args = arguments(function.get("parameters") or {"type": "object"}, rng)
        # vLLM: "chatcmpl-tool-" + a random hex id; drawn here so a seed repeats it
        call_id = f"chatcmpl-tool-{rng.getrandbits(128):032x}"
        return cls(call_id, name, arguments_json(args), StreamPlan.of(name, args),
                   hermes_text(name, args), named=isinstance(choice, Mapping),
                   required=choice == "required")

    @property
    def finish(self) -> str:
        """finish_reason once the whole call came out: "stop" for a named function."""
        return "stop" if self.named else "tool_calls"

    @property
    def content(self) -> str | None:
        """The message's content beside the call: "" for a named or "required" choice."""
        return "" if self.named or self.required else None

    def message(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True, slots=True)
class Delta:
    """What one token adds: the call's head (id, type, name), and/or argument text."""

    head: bool
    arguments: str


@dataclass(frozen=True, slots=True)
class StreamPlan:
    """Where the arguments lie in the call's text, to cut each token's delta."""

    start: int  # offset of the arguments' first character
    end: int  # offset just past the arguments

    @classmethod
    def of(cls, name: str, args: Any) -> StreamPlan:
        text = hermes_text(name, args)
        start = text.index(', "arguments": ') + len(', "arguments": ')
        return cls(start, start + len(arguments_json(args)))

    def delta(self, text: str, offset: int) -> Delta | None:
        """The delta for a token of `text` at character `offset` of the call's text."""
        end = offset + len(text)
        head = offset < self.start <= end
        a, b = max(self.start, offset), min(self.end, end)
        frag = text[a - offset : b - offset] if b > a else ""
        return Delta(head, frag) if head or frag else None


def _merge(into: dict[str, Any], part: Mapping[str, Any]) -> None:
    for k, v in part.items():
        if k == "properties" and isinstance(v, Mapping):
            into.setdefault("properties", {}).update(v)
        elif k == "required" and isinstance(v, list):
            into["required"] = [*into.get("required", []), *v]
        else:
            into[k] = v


def _resolve(ref: str, root: Any) -> Mapping[str, Any] | None:
    """The schema a local JSON-pointer `ref` names in `root`, or None."""
    if not ref.startswith("#"):
        return None
    node = root
    for part in ref[1:].split("/")[1:]:
        key = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, Mapping) and key in node:
            node = node[key]
        elif isinstance(node, list) and key.isdigit() and int(key) < len(node):
            node = node[int(key)]
        else:
            return None
    return node if isinstance(node, Mapping) else None


def _object(schema: Mapping[str, Any], rng: random.Random, depth: int,
            root: Any) -> dict[str, Any]:
    props = schema.get("properties")
    props = props if isinstance(props, Mapping) else {}
    required = schema.get("required")
    required = set(required) if isinstance(required, list) else set()
    out: dict[str, Any] = {}
    for key, sub in props.items():
        # Optional members while there is depth left, and only some of them.
        if key in required or (depth < MAX_DEPTH and rng.random() < 0.7):
            out[key] = arguments(sub, rng, depth + 1, root)
    for key in required - out.keys():
        out[key] = _word(rng)  # required but not described: any value is valid
    return out


def _array(schema: Mapping[str, Any], rng: random.Random, depth: int,
           root: Any) -> list[Any]:
    low = _int_bound(schema.get("minItems"), 0)
    high = _int_bound(schema.get("maxItems"), max(low, _MAX_ITEMS))
    if depth >= MAX_DEPTH:
        high = low
    n = min(MAX_ITEMS, rng.randint(low, max(low, high)))
    items = schema.get("items")
    return [arguments(items, rng, depth + 1, root) for _ in range(n)]


def _integer(schema: Mapping[str, Any], rng: random.Random) -> int:
    low, high, _ = _numeric_range(schema, 1.0)
    lo, hi = math.ceil(low), math.floor(high)
    return rng.randint(lo, hi) if lo <= hi else lo


def _number(schema: Mapping[str, Any], rng: random.Random) -> float:
    low, high, exclusive = _numeric_range(schema, 0.0)
    if high <= low:
        return low
    # strictly inside, so an exclusive bound holds too; rounded when that stays inside
    value = low + (high - low) * (0.05 + 0.9 * rng.random())
    rounded = round(value, 3)
    return rounded if low < rounded < high or (not exclusive and low <= rounded <= high) \
        else value


def _numeric_range(schema: Mapping[str, Any], step: float) -> tuple[float, float, bool]:
    """[low, high] from minimum/maximum and the exclusive ones (`step` inside an exclusive
    bound: 1 for integers; numbers stay strictly inside instead)."""
    low, high = _num(schema.get("minimum")), _num(schema.get("maximum"))
    ex_low, ex_high = _num(schema.get("exclusiveMinimum")), _num(schema.get("exclusiveMaximum"))
    if ex_low is not None:
        low = max(low, ex_low + step) if low is not None else ex_low + step
    if ex_high is not None:
        high = min(high, ex_high - step) if high is not None else ex_high - step
    if low is None:
        low = 0.0 if high is None or high >= 0 else high - _INT_SPAN
    if high is None:
        high = low + _INT_SPAN
    return low, high, ex_low is not None or ex_high is not None


def _string(schema: Mapping[str, Any], rng: random.Random) -> str:
    low = min(MAX_CHARS, _int_bound(schema.get("minLength"), 0))
    high = min(MAX_CHARS, _int_bound(schema.get("maxLength"), max(low, 40)))
    words: list[str] = []
    while len(" ".join(words)) < max(low, 1) or (len(words) < 2 and rng.random() < 0.5):
        words.append(_word(rng))
    text = " ".join(words)
    return text[:high] if len(text) > high else text


def _word(rng: random.Random) -> str:
    return WORDS[rng.randrange(len(WORDS))]


def _int_bound(value: Any, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 \
        else default


def _num(value: Any) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None


class ToolStream:
    """The SSE chunks of one streamed call, token by token (the HTTP side's state)."""

    def __init__(self, call: PlannedCall, writer: ChunkWriter) -> None:
        self.call = call
        self.writer = writer
        self.offset = 0
        self.head_sent = False

    def token(
        self, text: str, finish: str | None, usage: dict[str, Any] | None, last: bool
    ) -> bytes:
        """`finish`: the engine's reason when this is the last token (else None)."""
        d = self.call.plan.delta(text, self.offset)
        self.offset += len(text)
        out = b""
        if d is not None and d.head:
            self.head_sent = True
            head = {"id": self.call.id, "type": "function", "index": 0,
                    "function": {"name": self.call.name}}
            out += self.writer.delta({"tool_calls": [head]}, None, usage)
        # vLLM: a stream that sent a call finishes "tool_calls", even when cut by length;
        # a named function's stream finishes with the engine's reason ("stop", "length").
        reason = None if finish is None else \
            "tool_calls" if self.head_sent and not self.call.named else finish
        if d is not None and d.arguments:
            args = {"tool_calls": [{"index": 0, "function": {"arguments": d.arguments}}]}
            out += self.writer.delta(args, reason, usage, last)
        elif reason is not None:
            out += self.writer.delta({}, reason, usage, last)
        return out
