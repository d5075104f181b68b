"""Tool calls on the simulator's other two APIs, with the official clients: Anthropic
Messages (`anthropic`) and Responses (`openai`), streamed and not, arguments validating
against the schema, and a three-turn loop with tool results on each, every turn's prefix
cached. The tool_choice and stop_reason mappings vLLM applies, by table."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest

from gateway.sim import messages_api
from gateway.sim import responses_api as rapi
from gateway.sim.errors import ApiError
from tests.schema_check import errors
from tests.servers import sim
from tests.sim_http import MODEL

WEATHER: dict[str, Any] = {"type": "object", "properties": {
    "city": {"type": "string", "minLength": 1}, "unit": {"enum": ["celsius", "fahrenheit"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "unit"], "additionalProperties": False}
SEARCH: dict[str, Any] = {"type": "object", "properties": {
    "query": {"type": "string"}, "filters": {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3}},
        "required": ["tags"]}},
    "required": ["query", "filters"]}
SCHEMAS = {"get_weather": WEATHER, "search_docs": SEARCH}
ANTHROPIC_TOOLS: list[Any] = [{"name": n, "description": f"{n} tool", "input_schema": s}
                              for n, s in SCHEMAS.items()]
RESPONSES_TOOLS: list[Any] = [{"type": "function", "name": n, "description": f"{n} tool",
                               "parameters": s} for n, s in SCHEMAS.items()]
BLOCK = 16  # the simulator's default KV block size
HERMES = ["--speed", "1000", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]


@pytest.mark.parametrize(("choice", "expect"), [
    (None, None),
    ({"type": "auto"}, "auto"),
    ({"type": "any"}, "required"),
    ({"type": "none"}, "none"),
    ({"type": "tool", "name": "f"}, {"type": "function", "function": {"name": "f"}}),
    ({"type": "tool"}, ApiError),
    ({"type": "function"}, ApiError),
    ("any", ApiError),
])
def test_anthropic_tool_choice_maps_as_vllm(choice: Any, expect: Any) -> None:
    if expect is ApiError:
        with pytest.raises(ApiError):
            messages_api.tool_choice(choice)
    else:
        assert messages_api.tool_choice(choice) == expect


@pytest.mark.parametrize(("finish", "reason"), [
    ("tool_calls", "tool_use"), ("stop", "end_turn"), ("length", "max_tokens"),
    (None, "end_turn"),
])
def test_stop_reason_maps_as_vllm(finish: str | None, reason: str) -> None:
    assert messages_api.stop_reason(finish) == reason


@pytest.mark.parametrize(("choice", "expect"), [
    ("required", "required"), ("auto", "auto"), ("none", "none"),
    ({"type": "function", "name": "f"}, {"type": "function", "function": {"name": "f"}}),
])
def test_responses_tool_choice_is_the_chat_one(choice: Any, expect: Any) -> None:
    assert rapi.tool_choice(choice) == expect


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with sim(1, [*HERMES, "--responses-store"]) as (base,):
        yield base


@pytest.fixture(scope="module")
def bare() -> Iterator[str]:
    """A replica without a tool parser."""
    with sim(1, ["--speed", "1000"]) as (base,):
        yield base


def _claude(url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key="none", max_retries=0, timeout=30)


def _gpt(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=30)


# -- Messages -----------------------------------------------------------------------------

@pytest.mark.parametrize(("choice", "reason"), [
    ({"type": "tool", "name": "search_docs"}, "end_turn"),  # the chat finish is "stop"
    ({"type": "any"}, "tool_use"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_messages_answer_a_tool_use_block(url: str, choice: Any, reason: str,
                                          stream: bool) -> None:
    kw: dict[str, Any] = {"model": MODEL, "max_tokens": 400, "tools": ANTHROPIC_TOOLS,
                          "tool_choice": choice,
                          "messages": [{"role": "user", "content": f"use a tool {stream}"}]}
    client = _claude(url)
    if stream:
        with client.messages.stream(**kw) as s:
            kinds = [e.type for e in s]
            message = s.get_final_message()
        assert kinds[0] == "message_start" and kinds[1] == "content_block_start"
        assert "input_json" in kinds and kinds[-3:] == [
            "content_block_stop", "message_delta", "message_stop"]
        assert "text" not in kinds  # no text block before the call
    else:
        message = client.messages.create(**kw)
    assert message.stop_reason == reason
    assert [b.type for b in message.content] == ["tool_use"]
    block = message.content[0]
    assert block.type == "tool_use" and block.id.startswith("chatcmpl-tool-")
    if choice["type"] == "tool":
        assert block.name == "search_docs"
    assert isinstance(block.input, dict)
    assert errors(block.input, SCHEMAS[block.name]) == []


def test_messages_three_turn_loop_with_tool_results(url: str) -> None:
    client = _claude(url)
    messages: list[Any] = [{"role": "user", "content": "plan a trip, tools please " * 20}]
    cached = []
    seen = 0
    for turn in range(3):
        message = client.messages.create(model=MODEL, max_tokens=400, tools=ANTHROPIC_TOOLS,
                                         tool_choice={"type": "any"}, messages=messages)
        assert message.stop_reason == "tool_use", turn
        (block,) = message.content
        assert block.type == "tool_use"
        assert errors(block.input, SCHEMAS[block.name]) == []
        cached.append(message.usage.cache_read_input_tokens or 0)
        if turn:  # the last turn's prompt and output, but for a partial block, were cached
            assert cached[-1] >= seen - BLOCK, (turn, cached, seen)
        seen = message.usage.input_tokens + cached[-1] + message.usage.output_tokens
        messages += [
            {"role": "assistant", "content": [block.model_dump()]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": block.id,
                                          "content": f"result {turn}: sunny"}]},
        ]
    last = client.messages.create(model=MODEL, max_tokens=8, tools=ANTHROPIC_TOOLS,
                                  tool_choice={"type": "none"}, messages=messages)
    assert last.content[0].type == "text" and last.stop_reason == "max_tokens"


def test_messages_tools_without_a_parser_are_an_anthropic_400(bare: str) -> None:
    with pytest.raises(anthropic.BadRequestError) as e:
        _claude(bare).messages.create(model=MODEL, max_tokens=20, tools=ANTHROPIC_TOOLS,
                                      messages=[{"role": "user", "content": "hi"}])
    assert '"auto" tool choice requires' in str(e.value.body)


def test_messages_call_cut_by_max_tokens_is_text(url: str) -> None:
    r = httpx.post(url + "/v1/messages", timeout=30, json={
        "model": MODEL, "max_tokens": 6, "tools": ANTHROPIC_TOOLS,
        "tool_choice": {"type": "any"}, "messages": [{"role": "user", "content": "cut"}]})
    body = r.json()
    assert body["stop_reason"] == "max_tokens"
    assert [b["type"] for b in body["content"]] == ["text"]
    assert body["content"][0]["text"].startswith("<tool_call>")


# -- Responses ----------------------------------------------------------------------------

@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "get_weather"}])
def test_responses_answer_a_function_call(url: str, choice: Any) -> None:
    response = _gpt(url).responses.create(model=MODEL, input="what is the weather",
                                          tools=RESPONSES_TOOLS, tool_choice=choice)
    assert response.status == "completed"
    (item,) = response.output
    assert item.type == "function_call" and item.status == "completed"
    assert item.call_id.startswith("call_") and item.id and item.id.startswith("fc_")
    if isinstance(choice, dict):
        assert item.name == "get_weather"
    assert errors(json.loads(item.arguments), SCHEMAS[item.name]) == []


def test_responses_stream_a_function_call_as_vllm(url: str) -> None:
    stream = _gpt(url).responses.create(model=MODEL, input="stream a call",
                                        tools=RESPONSES_TOOLS, tool_choice="required",
                                        stream=True)
    events = list(stream)
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress",
                         "response.output_item.added"]
    assert kinds[-3:] == ["response.function_call_arguments.done",
                          "response.output_item.done", "response.completed"]
    assert set(kinds[3:-3]) == {"response.function_call_arguments.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    added, done = events[2], events[-3]
    assert added.type == "response.output_item.added" and added.item.type == "function_call"
    assert added.item.arguments == "" and added.item.status == "in_progress"
    assert done.type == "response.function_call_arguments.done"
    deltas = "".join(e.delta for e in events
                     if e.type == "response.function_call_arguments.delta")
    assert deltas == done.arguments
    assert errors(json.loads(done.arguments), SCHEMAS[done.name]) == []
    final = events[-1]
    assert final.type == "response.completed"
    (item,) = final.response.output
    assert item.type == "function_call" and item.arguments == done.arguments
    assert item.id == added.item.id and item.call_id == added.item.call_id


@pytest.mark.parametrize("stored", [False, True])
def test_responses_three_turn_loop_with_function_call_outputs(url: str, stored: bool) -> None:
    client = _gpt(url)
    history: list[Any] = [{"role": "user", "content": "look things up for me " * 20}]
    new: list[Any] = list(history)
    previous: str | None = None
    cached = []
    seen = 0
    for turn in range(3):
        kw: dict[str, Any] = {"previous_response_id": previous} if stored and previous \
            else {}
        response = client.responses.create(
            model=MODEL, input=new if stored else history, tools=RESPONSES_TOOLS,
            tool_choice="required", **kw)
        (item,) = response.output
        assert item.type == "function_call", turn
        assert errors(json.loads(item.arguments), SCHEMAS[item.name]) == []
        assert response.usage is not None
        cached.append(response.usage.input_tokens_details.cached_tokens)
        if turn:  # the last turn's prompt and output, but for a partial block, were cached
            assert cached[-1] >= seen - BLOCK, (turn, cached, seen)
        seen = response.usage.input_tokens + response.usage.output_tokens
        result = {"type": "function_call_output", "call_id": item.call_id,
                  "output": f"result {turn}"}
        call = {"type": "function_call", "call_id": item.call_id, "name": item.name,
                "arguments": item.arguments}
        history += [call, result]
        new, previous = [result], response.id


def test_responses_auto_without_a_parser_answers_text(bare: str) -> None:
    response = _gpt(bare).responses.create(model=MODEL, input="hi", tools=RESPONSES_TOOLS,
                                           max_output_tokens=8)
    assert [i.type for i in response.output] == ["message"]
    guided = _gpt(bare).responses.create(model=MODEL, input="hi", tools=RESPONSES_TOOLS,
                                         tool_choice="required")
    assert [i.type for i in guided.output] == ["function_call"]


def test_responses_call_cut_by_max_output_tokens_is_text(url: str) -> None:
    response = _gpt(url).responses.create(model=MODEL, input="cut", tools=RESPONSES_TOOLS,
                                          tool_choice="required", max_output_tokens=6)
    assert response.status == "incomplete"
    (item,) = response.output
    assert item.type == "message"
