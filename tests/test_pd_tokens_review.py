"""Outside review of token mode's `return_token_ids` (gateway.pd.tokenids): cases where
the bytes a client gets differ from what D alone would have sent (vLLM 0.32's writing)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, cast

import orjson
import pytest

from gateway.pd.answer import StreamAnswer
from gateway.pd.pullback import token_turn
from gateway.pd.tokenids import StreamIds, answer_ids, asks_ids, ids_only, renders_alike

if TYPE_CHECKING:
    from gateway.routing.plan import RoutePlan

TOOLS = [{"type": "function", "function": {"name": "get", "parameters": {"type": "object"}}}]
BODY = {"model": "m", "stream": True, "tools": TOOLS, "tool_choice": "auto",
        "messages": [{"role": "user", "content": "call get"}]}


def _chunk(token_ids: list[int] | None, delta: dict[str, Any],
           finish: str | None = None) -> bytes:
    """A chat chunk as vLLM writes it (model_dump_json(exclude_unset=True), compact)."""
    choice: dict[str, object] = {"index": 0, "delta": delta, "logprobs": None,
                                 "finish_reason": finish}
    if finish is not None:
        choice["stop_reason"] = None
    choice["token_ids"] = token_ids
    doc = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1,
           "model": "m", "choices": [choice]}
    return b"data: " + orjson.dumps(doc) + b"\n\n"


def _stream(flag: bool) -> bytes:
    """A Mistral-parser tool stream: once every tool call is complete the parser returns
    `DeltaMessage()` for each further token (vllm/parser/mistral.py, ALL_TOOLS_COMPLETE),
    which chat_completion/serving.py sends as `"delta":{}` with or without the flag: the
    chunk is not one only the flag produced."""
    def ids(got: list[int]) -> list[int] | None:
        return got if flag else None

    call = {"tool_calls": [{"id": "c1", "type": "function", "index": 0,
                            "function": {"name": "get", "arguments": "{}"}}]}
    return (_chunk(ids([11, 12]), call) + _chunk(ids([13]), {}) + _chunk(ids([14]), {})
            + _chunk(ids([2]), {}, "tool_calls") + b"data: [DONE]\n\n")


def test_an_empty_delta_the_parser_sent_is_not_dropped() -> None:
    """A client that did not ask for ids, with tools, gets what D alone sends: each chunk,
    the parser's empty-delta ones included (`ids_only` cannot tell them from the chunks
    vLLM adds only for the flag: both are `"delta":{}` with ids, no finish, no logprobs)."""
    if not asks_ids(BODY):
        return  # the gateway leaves such a request's answer alone: nothing to compare
    answer = StreamAnswer(collect=True, strip_ids=True, collect_ids=True)
    got = answer.feed(_stream(True)) + answer.finish()
    assert got == _stream(False)


# -- tests that kill mutations the suite let survive ----------------------------------------

def _plan() -> RoutePlan:
    return cast("RoutePlan", SimpleNamespace(seed=7))


@pytest.mark.parametrize("count", [0, True, -1, 2.0, "2"])
def test_a_count_that_is_no_positive_int_keeps_nothing(count: object) -> None:
    """0 (`0 < held`) and True (`type(held) is int`, not isinstance) are no count."""
    assert token_turn(_plan(), [1, 2, 3], {"remote_num_tokens": count}) is None
    assert token_turn(_plan(), [1, 2, 3], {"remote_num_tokens": 2}) is not None


def test_an_answer_of_two_choices_tells_no_ids() -> None:
    doc: dict[str, Any] = {"prompt_token_ids": [1],
                           "choices": [{"token_ids": [2]}, {"token_ids": [3]}]}
    assert answer_ids(doc) is None
    assert answer_ids({**doc, "choices": doc["choices"][:1]}) == [1, 2]


def test_prompt_ids_twice_tell_no_ids() -> None:
    ids = StreamIds(100)
    ids.read({"prompt_token_ids": [1, 2], "choices": []})
    ids.read({"prompt_token_ids": [9, 9], "choices": [{"index": 0, "token_ids": [3]}]})
    assert ids.ids is None


def test_the_first_chunk_is_never_ids_only() -> None:
    """A chunk with the prompt's ids is vLLM's first, sent with or without the flag."""
    chunk = {"object": "chat.completion.chunk", "prompt_token_ids": [1], "choices": [
        {"index": 0, "delta": {}, "logprobs": None, "finish_reason": None, "token_ids": [4]}]}
    assert not ids_only(chunk)


@pytest.mark.parametrize("body", [
    {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:,"}}]}]},
    {"messages": [{"role": "user", "content": "x"}], "documents": [{"text": "d"}]},
], ids=["non-text", "documents"])
def test_what_the_renderer_does_not_render_is_not_alike(body: dict[str, Any]) -> None:
    assert not renders_alike(body)
    assert renders_alike({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "x"}]}]})
