"""Usage of Responses and Messages answers, from bodies and from streams split anywhere."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from gateway.usage.extract import Usage, parse_answer, usage_from_mapping
from gateway.usage.sse import SseUsageTap


@pytest.mark.parametrize(("usage", "expected"), [
    ({"input_tokens": 100, "input_tokens_details": {"cached_tokens": 64,
                                                   "cache_write_tokens": 0},
      "output_tokens": 5, "total_tokens": 105}, Usage(100, 5, 64)),
    ({"input_tokens": 36, "output_tokens": 5, "cache_read_input_tokens": 64},
     Usage(100, 5, 64)),
    ({"input_tokens": 30, "output_tokens": 5, "cache_read_input_tokens": 64,
      "cache_creation_input_tokens": 6}, Usage(100, 5, 64)),
    ({"input_tokens": 100, "output_tokens": 5}, Usage(100, 5, None)),  # details off
    ({"input_tokens": 0, "output_tokens": 0}, Usage(0, 0, None)),
    ({"input_tokens": -1, "output_tokens": 5}, Usage(None, 5, None)),
    ({"prompt_tokens": 10, "completion_tokens": 2}, Usage(10, 2, None)),  # chat unchanged
])
def test_usage_from_api_mappings(usage: dict[str, Any], expected: Usage) -> None:
    assert usage_from_mapping(usage) == expected


RESPONSE = {"id": "resp_1", "object": "response", "status": "completed", "output": [
    {"type": "message", "role": "assistant",
     "content": [{"type": "output_text", "text": "Hello", "annotations": []}]}],
    "usage": {"input_tokens": 20, "input_tokens_details": {"cached_tokens": 16},
              "output_tokens": 2}}
MESSAGE = {"id": "chatcmpl-1", "type": "message", "role": "assistant",
           "content": [{"type": "text", "text": "Hi"}],
           "usage": {"input_tokens": 4, "output_tokens": 1, "cache_read_input_tokens": 16}}


@pytest.mark.parametrize(("doc", "usage", "text", "rid"), [
    (RESPONSE, Usage(20, 2, 16), "Hello", "resp_1"),
    (MESSAGE, Usage(20, 1, 16), "Hi", None),
    ({**MESSAGE, "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]},
     Usage(20, 1, 16), None, None),
    ({**RESPONSE, "output": [{"type": "function_call", "name": "f"}]},
     Usage(20, 2, 16), None, "resp_1"),
])
def test_parse_answer(doc: dict[str, Any], usage: Usage, text: str | None,
                      rid: str | None) -> None:
    answer = parse_answer(orjson.dumps(doc))
    assert (answer.usage, answer.text, answer.response_id) == (usage, text, rid)


def _event(kind: str, payload: dict[str, Any]) -> bytes:
    return f"event: {kind}\ndata: ".encode() + orjson.dumps({"type": kind, **payload}) + b"\n\n"


RESPONSES_STREAM = b"".join([
    _event("response.created", {"response": {**RESPONSE, "status": "in_progress",
                                             "usage": None, "output": []}}),
    _event("response.output_text.delta", {"delta": "Hel"}),
    _event("response.output_text.delta", {"delta": "lo"}),
    _event("response.completed", {"response": RESPONSE}),
])
MESSAGES_STREAM = b"".join([
    _event("message_start", {"message": {**MESSAGE, "content": [],
                                         "usage": {"input_tokens": 20, "output_tokens": 0}}}),
    _event("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": "Hi"}}),
    _event("message_delta", {"delta": {"stop_reason": "end_turn"},
                             "usage": {"input_tokens": 4, "output_tokens": 1,
                                       "cache_read_input_tokens": 16}}),
    _event("message_stop", {}),
])
# Anthropic's own stream: input and cache counts only in message_start.
ANTHROPIC_STREAM = b"".join([
    _event("message_start", {"message": {**MESSAGE, "content": [], "usage": {
        "input_tokens": 4, "output_tokens": 1, "cache_read_input_tokens": 16}}}),
    _event("message_delta", {"delta": {"stop_reason": "end_turn"},
                             "usage": {"output_tokens": 7}}),
])


@pytest.mark.parametrize(("stream", "usage", "rid"), [
    (RESPONSES_STREAM, Usage(20, 2, 16), "resp_1"),
    (MESSAGES_STREAM, Usage(20, 1, 16), None),
    (ANTHROPIC_STREAM, Usage(20, 7, 16), None),
])
@pytest.mark.parametrize("step", [1, 7, 64, 10_000])
def test_tap_reads_api_streams_split_anywhere(stream: bytes, usage: Usage, rid: str | None,
                                              step: int) -> None:
    tap = SseUsageTap(strip=False)
    out = b"".join(tap.feed(stream[i:i + step]) for i in range(0, len(stream), step))
    out += tap.finish()
    assert out == stream  # relayed untouched
    assert (tap.usage, tap.response_id) == (usage, rid)


def test_tap_knows_the_response_id_from_the_first_event() -> None:
    tap = SseUsageTap(strip=False)
    created, _, _ = RESPONSES_STREAM.partition(b"event: response.output_text.delta")
    tap.feed(created)
    assert tap.response_id == "resp_1" and tap.usage is None
