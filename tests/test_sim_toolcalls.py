"""Tool calls on the simulator, the pure parts: which call, its arguments against the
function's schema, the text the template renders back, and the stream's deltas."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from gateway.sim.responses import ChunkWriter
from gateway.sim.template import render_chat
from gateway.sim.tokenizer import Tokenizer
from gateway.sim.toolcalls import (
    HARD_DEPTH,
    MAX_DEPTH,
    PlannedCall,
    StreamPlan,
    ToolStream,
    arguments,
    choose,
    hermes_text,
)
from tests.schema_check import errors

NODE: dict[str, Any] = {"type": "object", "properties": {
    "name": {"type": "string"}, "children": {"type": "array", "items": {"$ref": "#"}}}}
SCHEMAS: list[tuple[str, dict[str, Any]]] = [
    ("flat", {"type": "object", "properties": {"city": {"type": "string"}},
              "required": ["city"]}),
    ("every type", {"type": "object", "properties": {
        "s": {"type": "string", "minLength": 3, "maxLength": 5},
        "i": {"type": "integer", "minimum": -3, "maximum": 2},
        "n": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1},
        "b": {"type": "boolean"}, "z": {"type": "null"},
        "e": {"enum": ["celsius", "fahrenheit"]}, "c": {"const": 42},
        "u": {"type": ["integer", "null"]},
        "x": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 3}},
        "required": ["s", "i", "n", "b", "z", "e", "c", "u", "x"],
        "additionalProperties": False}),
    ("nested", {"type": "object", "properties": {
        "filter": {"type": "object", "properties": {
            "tags": {"type": "array", "items": {"type": "string"}, "minItems": 2,
                     "maxItems": 4},
            "range": {"type": "object", "properties": {
                "from": {"type": "integer", "maximum": -10},
                "to": {"type": "number", "minimum": 1e6}}, "required": ["from", "to"]}},
            "required": ["tags", "range"]},
        "mode": {"anyOf": [{"type": "string", "enum": ["fast"]}, {"type": "integer"}]}},
        "required": ["filter", "mode"]}),
    ("deep", {"type": "object", "properties": {"a": {"type": "object", "properties": {
        "b": {"type": "object", "properties": {"c": {"type": "object", "properties": {
            "d": {"type": "object", "properties": {"e": {"type": "object", "properties": {
                "f": {"type": "string"}}, "required": ["f"]}}, "required": ["e"]}},
            "required": ["d"]}}, "required": ["c"]}}, "required": ["b"]}},
        "required": ["a"]}),
    ("empty", {"type": "object", "properties": {}}),
    ("all of", {"allOf": [{"type": "object", "properties": {"x": {"type": "integer"}},
                           "required": ["x"]},
                          {"properties": {"y": {"type": "boolean"}}, "required": ["y"]}]}),
    ("required but undescribed", {"type": "object", "required": ["anything"]}),
    ("recursive by $ref", NODE),
    # what pydantic's model_json_schema() gives for nested models (agent frameworks send
    # it as is): the object behind a $ref into $defs, not a string
    ("pydantic $defs", {"type": "object", "$defs": {
        "Point": {"type": "object", "properties": {"x": {"type": "number"},
                                                    "y": {"type": "number"}},
                  "required": ["x", "y"], "additionalProperties": False},
        "Unit": {"enum": ["m", "km"], "type": "string"}},
        "properties": {"origin": {"$ref": "#/$defs/Point"},
                       "path": {"type": "array", "items": {"$ref": "#/$defs/Point"},
                                "minItems": 1},
                       "unit": {"$ref": "#/$defs/Unit", "description": "the unit"},
                       "labels": {"type": "object",
                                  "additionalProperties": {"type": "integer"}}},
        "required": ["origin", "path", "unit"], "additionalProperties": False}),
    ("draft-07 definitions", {"type": "object", "definitions": {
        "a/b": {"type": "integer", "minimum": 5, "maximum": 6}},
        "properties": {"n": {"$ref": "#/definitions/a~1b"}}, "required": ["n"]}),
]


@pytest.mark.parametrize(("case", "schema"), SCHEMAS)
def test_arguments_validate_against_the_schema(case: str, schema: dict[str, Any]) -> None:
    for seed in range(60):
        value = arguments(schema, random.Random(seed))
        assert errors(value, schema) == [], (case, seed, value)
        json.dumps(value)  # JSON all the way down


@pytest.mark.parametrize(("schema", "check"), [
    ({"type": "array", "items": {"type": "integer"}, "minItems": 10**9},
     lambda v: len(v) == 64),
    ({"type": "string", "minLength": 10**9}, lambda v: len(v) == 4096),
    ({"type": "string", "minLength": 5000, "maxLength": 6000}, lambda v: len(v) == 4096),
])
def test_a_hostile_schema_is_bounded(schema: dict[str, Any], check: Any) -> None:
    assert check(arguments(schema, random.Random(0)))


def test_a_ref_cycle_is_bounded() -> None:
    # a $ref to itself with nothing else: no value can be built, none is looped for
    assert arguments({"$ref": "#"}, random.Random(0)) is None
    assert arguments({"$ref": "#/$defs/missing"}, random.Random(0)) is not None


def test_required_nesting_stops_at_the_hard_depth() -> None:
    chain: dict[str, Any] = {"type": "string"}
    for _ in range(3000):  # deeper than Python's recursion would go
        chain = {"type": "object", "properties": {"n": chain}, "required": ["n"]}
    value = arguments(chain, random.Random(0))
    depth = 0
    while isinstance(value, dict):
        value, depth = value["n"], depth + 1
    assert value is None and depth == HARD_DEPTH + 1


def test_optional_members_stop_at_the_depth_bound() -> None:
    chain: dict[str, Any] = {"type": "string"}
    for _ in range(MAX_DEPTH + 4):
        chain = {"type": "object", "properties": {"next": chain}}

    def depth(v: Any) -> int:
        return 1 + depth(v["next"]) if isinstance(v, dict) and "next" in v else 0

    assert max(depth(arguments(chain, random.Random(s))) for s in range(200)) == MAX_DEPTH
    # ... while what is required is there at any depth (the "deep" schema above)


TOOLS = [{"type": "function", "function": {"name": n, "parameters": None}}
         for n in ("alpha", "beta", "gamma")]


@pytest.mark.parametrize(("choice", "probability", "expect"), [
    ({"type": "function", "function": {"name": "beta"}}, 0.0, {"beta"}),
    ("required", 0.0, {"alpha", "beta", "gamma"}),
    ("auto", 1.0, {"alpha", "beta", "gamma"}),
    ("auto", 0.0, {None}),
    ("none", 1.0, {None}),
    (None, 1.0, {None}),
])
def test_choose(choice: Any, probability: float, expect: set[str | None]) -> None:
    seen = set()
    for seed in range(80):
        fn = choose(choice, TOOLS, probability, random.Random(seed))
        seen.add(None if fn is None else fn["name"])
    assert seen == expect


def test_auto_calls_at_about_the_configured_rate() -> None:
    calls = sum(choose("auto", TOOLS, 0.3, random.Random(s)) is not None for s in range(2000))
    assert 500 <= calls <= 700


def test_the_call_text_is_what_the_template_renders_back() -> None:
    """So the next turn's prompt extends through the reply (its prefix stays cached)."""
    args = {"city": "Paris", "days": [1, 2], "unit": "°C"}
    call = {"id": "x", "type": "function", "function": {"name": "get_weather",
                                                        "arguments": args}}
    history = [{"role": "user", "content": "hi"}]
    prompt = render_chat(history)
    rendered = render_chat([*history, {"role": "assistant", "content": None,
                                       "tool_calls": [call]}], add_generation_prompt=False)
    assert rendered == prompt + hermes_text("get_weather", args) + "<|im_end|>\n"


@pytest.mark.parametrize("seed", range(12))
def test_streamed_fragments_rebuild_the_arguments(seed: int) -> None:
    schema = SCHEMAS[2][1]
    call = PlannedCall.draw({"name": "search", "parameters": schema}, random.Random(seed))
    tok = Tokenizer()
    pieces = tok.pieces(tok.encode(call.text))
    writer = ChunkWriter("chat", "chatcmpl-1", 0, "m")
    stream = ToolStream(call, writer)
    events: list[dict[str, Any]] = []
    for i, piece in enumerate(pieces):
        finish = "stop" if i == len(pieces) - 1 else None
        raw = stream.token(piece, finish, None, False)
        events += [json.loads(e[len("data: "):]) for e in raw.decode().split("\n\n") if e]
    deltas = [e["choices"][0]["delta"] for e in events]
    heads = [d["tool_calls"][0] for d in deltas if d.get("tool_calls")
             and "name" in d["tool_calls"][0]["function"]]
    assert heads == [{"id": call.id, "type": "function", "index": 0,
                      "function": {"name": "search"}}]
    assert "tool_calls" in deltas[0] and "name" in deltas[0]["tool_calls"][0]["function"]
    args = "".join(d["tool_calls"][0]["function"].get("arguments", "")
                   for d in deltas if d.get("tool_calls"))
    assert args == call.arguments and errors(json.loads(args), schema) == []
    assert [e["choices"][0]["finish_reason"] for e in events][-1] == "tool_calls"
    assert all(e["choices"][0]["finish_reason"] is None for e in events[:-1])
    assert len(events) > 3  # fragments, not one piece


@pytest.mark.parametrize(("text", "offset", "expect"), [
    ('{"name', 0, None),  # before the arguments: nothing yet
    ("s ", 14, None),
    (' {"', 20, (True, '{"')),  # the token that ends the head also starts the arguments
    ('": ', 18, (True, "")),  # a token ending just before the arguments ends the head
    ('{"', 21, (False, '{"')),  # ... and the next one is arguments only
    ("abc", 22, (False, "abc")),
    ("}}\n", 29, (False, "}")),  # the closing brace of the call itself is not arguments
    ("</", 31, None),
])
def test_stream_plan_cuts_tokens(text: str, offset: int,
                                 expect: tuple[bool, str] | None) -> None:
    plan = StreamPlan(start=21, end=30)
    d = plan.delta(text, offset)
    assert (None if d is None else (d.head, d.arguments)) == expect


@pytest.mark.parametrize(("choice", "finish", "expect", "content"), [
    # vLLM (chat_completion/serving.py, OpenAI's convention): "tool_calls" for "required"
    # and "auto", "stop" for a named function, streamed or not; a stream cut by length
    # after the call's head still says "tool_calls", a named one the engine's reason
    ({"type": "function", "function": {"name": "search"}}, "stop", "stop", ""),
    ({"type": "function", "function": {"name": "search"}}, "length", "length", ""),
    ("required", "stop", "tool_calls", ""),
    ("required", "length", "tool_calls", ""),
    ("auto", "stop", "tool_calls", None),
])
def test_finish_reason_and_content_by_choice(choice: Any, finish: str, expect: str,
                                             content: str | None) -> None:
    call = PlannedCall.draw({"name": "search", "parameters": SCHEMAS[0][1]},
                            random.Random(0), choice)
    assert call.content == content
    if finish == "stop":
        assert call.finish == expect
    tok = Tokenizer()
    pieces = tok.pieces(tok.encode(call.text))
    if finish == "length":
        pieces = pieces[: len(pieces) - 3]  # cut inside the arguments, after the head
    stream = ToolStream(call, ChunkWriter("chat", "chatcmpl-1", 0, "m"))
    raw = b"".join(stream.token(p, finish if i == len(pieces) - 1 else None, None, False)
                   for i, p in enumerate(pieces))
    events = [json.loads(e[len("data: "):]) for e in raw.decode().split("\n\n") if e]
    assert [e["choices"][0]["finish_reason"] for e in events][-1] == expect
