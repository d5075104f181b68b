"""Outside review of token mode's `return_token_ids` (gateway.pd.tokenids): cases where
the bytes a client gets differ from what D alone would have sent (vLLM 0.32's writing)."""

from __future__ import annotations

import orjson

from gateway.pd.answer import StreamAnswer
from gateway.pd.tokenids import asks_ids

TOOLS = [{"type": "function", "function": {"name": "get", "parameters": {"type": "object"}}}]
BODY = {"model": "m", "stream": True, "tools": TOOLS, "tool_choice": "auto",
        "messages": [{"role": "user", "content": "call get"}]}


def _chunk(token_ids: list[int] | None, delta: dict[str, object],
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
    ids = (lambda x: x) if flag else (lambda x: None)  # noqa: E731
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
