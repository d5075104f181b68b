"""Tool calls through the demo with the official openai client: `gateway serve` with its
embedded replicas answers a named tool_choice and "required" (streamed and not) with a call
whose arguments parse and validate against the function's schema, and an agent loop of
five turns with tool results completes, each turn's prefix cached."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.schema_check import errors
from tests.servers import free_port, running, script

MODEL = "Qwen/Qwen2.5-7B-Instruct"
SEARCH: dict[str, Any] = {"type": "object", "properties": {
    "query": {"type": "string", "minLength": 1},
    "limit": {"type": "integer", "minimum": 1, "maximum": 20},
    "filters": {"type": "object", "properties": {
        "lang": {"enum": ["en", "fr", "de"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3}},
        "required": ["lang"]}},
    "required": ["query", "filters"], "additionalProperties": False}
WEATHER: dict[str, Any] = {"type": "object", "properties": {
    "city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"]}
SCHEMAS = {"search_docs": SEARCH, "get_weather": WEATHER}
TOOLS: list[Any] = [{"type": "function", "function": {
    "name": name, "description": f"{name} tool", "parameters": schema}}
    for name, schema in SCHEMAS.items()]


@pytest.fixture(scope="module")
def demo_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("demo") / "serve.log"


@pytest.fixture(scope="module")
def client(demo_log: Path) -> Iterator[openai.OpenAI]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # --demo-speed: the embedded replicas 20x faster than real time
    with running([*script("gateway"), "serve", "--demo-speed", "20"], [url + "/ready"],
                 env={"GATEWAY_SERVER__PORT": str(port)}, log_path=demo_log):
        yield openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)


def test_the_start_up_line_says_the_speed(client: openai.OpenAI, demo_log: Path) -> None:
    lines = [json.loads(line) for line in demo_log.read_text().splitlines()
             if line.startswith("{")]
    started = [r for r in lines if r.get("msg", r.get("message", "")).startswith(
        "embedded simulator started")]
    assert len(started) == 1, lines
    assert "at 20x an H100's real time" in started[0].get("msg", started[0].get("message"))


def check_call(name: str | None, arguments: str | None, expect: set[str]) -> None:
    assert name in expect
    args = json.loads(arguments or "")
    assert errors(args, SCHEMAS[name]) == [], args


CHOICES: list[tuple[Any, set[str]]] = [
    ({"type": "function", "function": {"name": "search_docs"}}, {"search_docs"}),
    ({"type": "function", "function": {"name": "get_weather"}}, {"get_weather"}),
    ("required", set(SCHEMAS)),
]


def finish_for(choice: Any) -> str:
    """vLLM's finish_reason for a whole call (chat_completion/serving.py, as OpenAI's API):
    "tool_calls" for "required" (and "auto"), "stop" for a named function, streamed or not."""
    return "tool_calls" if choice == "required" else "stop"


@pytest.mark.parametrize(("choice", "expect"), CHOICES)
def test_a_tool_call_not_streamed(client: openai.OpenAI, choice: Any,
                                  expect: set[str]) -> None:
    for i in range(3):
        answer = client.chat.completions.create(
            model=MODEL, tools=TOOLS, tool_choice=choice,
            messages=[{"role": "user", "content": f"question {i}: look it up"}])
        c = answer.choices[0]
        # vLLM: content "" beside the calls of a named or "required" choice (null for auto)
        assert c.finish_reason == finish_for(choice) and c.message.content == ""
        calls = c.message.tool_calls or []
        assert len(calls) == 1 and calls[0].type == "function"
        assert calls[0].id.startswith("chatcmpl-tool-")
        fn = calls[0].function  # type: ignore[union-attr]
        check_call(fn.name, fn.arguments, expect)
        assert answer.usage is not None and answer.usage.completion_tokens > 5


@pytest.mark.parametrize(("choice", "expect"), CHOICES)
def test_a_tool_call_streamed(client: openai.OpenAI, choice: Any, expect: set[str]) -> None:
    for i in range(3):
        stream = client.chat.completions.create(
            model=MODEL, tools=TOOLS, tool_choice=choice, stream=True,
            stream_options={"include_usage": True},
            messages=[{"role": "user", "content": f"question {i}: stream it"}])
        chunks = list(stream)
        deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
        calls = [tc for d in deltas for tc in (d.tool_calls or [])]
        # the first call delta names the function, with its id and type; the rest carry
        # argument fragments only
        assert calls[0].id and calls[0].type == "function" and calls[0].function
        name = calls[0].function.name
        assert all(tc.id is None and tc.function and tc.function.name is None
                   for tc in calls[1:])
        assert len(calls) > 3
        args = "".join(tc.function.arguments or "" for tc in calls if tc.function)
        check_call(name, args, expect)
        assert not any(d.content for d in deltas)
        finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices]
        assert finishes[-1] == finish_for(choice) and not any(finishes[:-1])
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 5


def test_an_agent_loop_of_five_turns(client: openai.OpenAI) -> None:
    messages: list[Any] = [
        {"role": "system", "content": "You are an agent. Use the tools."},
        {"role": "user", "content": "Find the docs on prefix caching and the weather."}]
    cached = []
    for turn in range(5):
        answer = client.chat.completions.create(
            model=MODEL, tools=TOOLS, tool_choice="required", messages=messages,
            extra_headers={"x-session-id": "agent-loop"})
        c = answer.choices[0]
        assert c.finish_reason == "tool_calls", turn
        call = (c.message.tool_calls or [])[0]
        check_call(call.function.name, call.function.arguments, set(SCHEMAS))  # type: ignore[union-attr]
        messages.append(c.message.model_dump(exclude_none=True))
        messages.append({"role": "tool", "tool_call_id": call.id,
                         "content": json.dumps({"turn": turn, "result": "ok " * 40})})
        assert answer.usage is not None and answer.usage.prompt_tokens_details is not None
        cached.append(answer.usage.prompt_tokens_details.cached_tokens or 0)
    final = client.chat.completions.create(model=MODEL, tools=TOOLS, tool_choice="none",
                                           messages=messages, max_tokens=16,
                                           extra_headers={"x-session-id": "agent-loop"})
    assert final.choices[0].message.content and not final.choices[0].message.tool_calls
    # every later turn reuses the one before (the tool call re-renders as generated)
    assert all(later > earlier for earlier, later in itertools.pairwise(cached))
    assert cached[-1] > 0


def test_auto_calls_for_a_share_of_prompts_the_same_each_time(client: openai.OpenAI) -> None:
    """The demo's [demo] tool_call_probability (0.5): some prompts call, others answer
    text, and a prompt repeats its answer (drawn from the seed)."""
    def kind(i: int) -> str | None:
        answer = client.chat.completions.create(
            model=MODEL, tools=TOOLS, tool_choice="auto", max_tokens=128,
            messages=[{"role": "user", "content": f"auto question {i}"}])
        c = answer.choices[0]
        if c.message.tool_calls:
            fn = c.message.tool_calls[0].function  # type: ignore[union-attr]
            check_call(fn.name, fn.arguments, set(SCHEMAS))
            assert c.finish_reason == "tool_calls" and c.message.content is None
            return "call"
        assert c.message.content and c.finish_reason in ("stop", "length")
        return "text"

    kinds = [kind(i) for i in range(12)]
    assert set(kinds) == {"call", "text"}
    assert [kind(i) for i in range(4)] == kinds[:4]
