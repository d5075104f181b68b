"""P/D for the Responses and Messages APIs, pure parts by table: each endpoint's prefill
and decode leg bodies (gateway.pd.legs, the fields vLLM 0.32's protocol.py files name),
and the answer filter on each endpoint's whole and streamed shapes (gateway.pd.answer).

Mutations seen failing here: `max_tokens` set on a Responses prefill leg instead of
`max_output_tokens`; `store` left as the client sent it; `background` kept; `stream`
kept as sent on a Messages leg; a Responses stream's nested params not read
(`StreamAnswer.params` None); the strip limited to the top level."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from gateway.pd.answer import StreamAnswer, strip_json
from gateway.pd.legs import FRESH, answer_params, decode_body, prefill_body

P_PARAMS = {"do_remote_prefill": True, "do_remote_decode": False,
            "remote_block_ids": [[1, 2, 3]], "remote_engine_id": "e-1",
            "remote_request_id": "resp_1", "remote_host": "127.0.0.1", "remote_port": 5600,
            "tp_size": 1, "remote_num_tokens": 96, "remote_prefill_cached_tokens": 32}
D_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False,
            "remote_block_ids": [[7, 8]], "remote_engine_id": "d-1",
            "remote_host": "10.0.0.9", "remote_port": 5601, "remote_num_tokens": 140}

RESP = {"model": "m", "input": "summarize the build log", "instructions": "be short"}
MSGS = {"model": "m", "max_tokens": 300, "system": "be short",
        "messages": [{"role": "user", "content": "summarize the build log"}]}


@pytest.mark.parametrize(("endpoint", "client", "expected"), [
    # Responses: max_output_tokens 1 (added when absent), store false, not streamed
    ("responses", RESP, {**RESP, "max_output_tokens": 1, "store": False, "stream": False}),
    ("responses", {**RESP, "max_output_tokens": 300, "store": True, "temperature": 0},
     {**RESP, "max_output_tokens": 1, "store": False, "stream": False, "temperature": 0}),
    # streamed, in the background: neither on the leg; stream_options, min_tokens dropped
    ("responses", {**RESP, "stream": True, "background": True, "max_output_tokens": 50,
                   "stream_options": {"include_obfuscation": False}, "min_tokens": 9},
     {**RESP, "max_output_tokens": 1, "store": False, "stream": False}),
    # what shapes the prompt stays: reasoning, tools, cache_salt
    ("responses", {**RESP, "reasoning": {"effort": "low"}, "cache_salt": "s",
                   "tools": [{"type": "function", "name": "f", "parameters": {}}]},
     {**RESP, "reasoning": {"effort": "low"}, "cache_salt": "s",
      "tools": [{"type": "function", "name": "f", "parameters": {}}],
      "max_output_tokens": 1, "store": False, "stream": False}),
    # the client's own kv_transfer_params never reach P
    ("responses", {**RESP, "kv_transfer_params": {"remote_block_ids": [[9]]}},
     {**RESP, "max_output_tokens": 1, "store": False, "stream": False}),
    # Messages: max_tokens 1, not streamed
    ("messages", MSGS, {**MSGS, "max_tokens": 1, "stream": False}),
    ("messages", {**MSGS, "stream": True, "min_tokens": 4, "temperature": 0},
     {**MSGS, "max_tokens": 1, "stream": False, "temperature": 0}),
    # thinking stays (vLLM skips its budget check on a do_remote_decode leg)
    ("messages", {**MSGS, "thinking": {"type": "enabled", "budget_tokens": 100}},
     {**MSGS, "thinking": {"type": "enabled", "budget_tokens": 100}, "max_tokens": 1,
      "stream": False}),
])
def test_prefill_leg_body_per_endpoint(endpoint: Any, client: dict[str, Any],
                                       expected: dict[str, Any]) -> None:
    before = orjson.dumps(client)
    body = prefill_body(client, None, endpoint)
    assert body == {**expected, "kv_transfer_params": dict(FRESH)}
    assert orjson.dumps(client) == before  # the client's body is left as it was


@pytest.mark.parametrize(("endpoint", "client", "absent"), [
    ("responses", {**RESP, "max_tokens": 7}, None),  # not a Responses field: left as sent
    ("messages", MSGS, "max_output_tokens"),
    ("messages", MSGS, "store"),
    ("responses", RESP, "max_tokens"),
])
def test_each_endpoint_gets_only_its_own_limit(endpoint: Any, client: dict[str, Any],
                                               absent: str | None) -> None:
    body = prefill_body(client, None, endpoint)
    if absent is not None:
        assert absent not in body
    else:
        assert body["max_tokens"] == 7 and body["max_output_tokens"] == 1


@pytest.mark.parametrize("client", [
    RESP, {**RESP, "stream": True, "max_output_tokens": 50, "store": True},
    {**RESP, "background": True},
    MSGS, {**MSGS, "stream": True, "min_tokens": 4},
    {**MSGS, "kv_transfer_params": {"remote_block_ids": [[9]]}},
])
def test_decode_leg_is_the_clients_body_with_ps_params_verbatim(
        client: dict[str, Any]) -> None:
    assert decode_body(client, P_PARAMS) == {**client, "kv_transfer_params": P_PARAMS}


RESPONSE_OBJECT = {"id": "resp_1", "object": "response", "status": "completed",
                   "output": [{"type": "message", "content": [
                       {"type": "output_text", "text": "ok"}]}],
                   "usage": {"input_tokens": 140, "output_tokens": 1,
                             "input_tokens_details": {"cached_tokens": 32}}}
MESSAGE = {"id": "chatcmpl-1", "type": "message", "role": "assistant",
           "content": [{"type": "text", "text": "ok"}], "stop_reason": "end_turn",
           "usage": {"input_tokens": 108, "output_tokens": 1, "cache_read_input_tokens": 32}}


@pytest.mark.parametrize("answer", [RESPONSE_OBJECT, MESSAGE], ids=["responses", "messages"])
def test_ps_params_read_and_ds_stripped_from_whole_answers(answer: dict[str, Any]) -> None:
    # P's answer (the prefill leg, read whole): its params are at the top of both shapes
    assert answer_params(orjson.dumps({**answer, "kv_transfer_params": P_PARAMS})) == P_PARAMS
    # D's answer (relayed): its own params go, the rest is the engine's as sent
    out = orjson.loads(strip_json(orjson.dumps({**answer, "kv_transfer_params": D_PARAMS})))
    assert out == answer
    # vLLM's null on an answer without a connector: the bytes are left as they were
    plain = orjson.dumps({**answer, "kv_transfer_params": None})
    assert strip_json(plain) == plain


def responses_stream(params: dict[str, Any] | None) -> list[bytes]:
    """A Responses stream as vLLM 0.32 writes it: `event:` and `data:` per event, the
    whole response object (with the answer's params) in response.completed."""
    def event(kind: str, payload: dict[str, Any]) -> bytes:
        data = orjson.dumps({**payload, "type": kind})
        return b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n"
    started = {**RESPONSE_OBJECT, "status": "in_progress", "kv_transfer_params": None}
    done = {**RESPONSE_OBJECT, "kv_transfer_params": params}
    return [event("response.created", {"response": started}),
            event("response.output_text.delta", {"delta": "ok", "item_id": "msg_1"}),
            event("response.completed", {"response": done})]


def messages_stream() -> list[bytes]:
    """A Messages stream: vLLM's converter writes no kv_transfer_params on any event."""
    def event(kind: str, payload: dict[str, Any]) -> bytes:
        return (b"event: " + kind.encode() + b"\ndata: "
                + orjson.dumps({"type": kind, **payload}) + b"\n\n")
    return [event("message_start", {"message": {**MESSAGE, "content": []}}),
            event("content_block_delta", {"index": 0, "delta": {"type": "text_delta",
                                                                "text": "ok"}}),
            event("message_delta", {"delta": {"stop_reason": "end_turn"},
                                    "usage": {"output_tokens": 1}}),
            event("message_stop", {})]


def run(stream: StreamAnswer, chunks: list[bytes]) -> bytes:
    return b"".join(stream.feed(c) for c in chunks) + stream.finish()


@pytest.mark.parametrize("split", [False, True], ids=["whole-events", "split-events"])
def test_a_responses_stream_loses_ds_params_nested_in_its_completed_event(
        split: bool) -> None:
    events = responses_stream(D_PARAMS)
    chunks = events if not split else [b[i:i + 7] for b in events for i in range(0, len(b), 7)]
    stream = StreamAnswer(collect=False)
    out = run(stream, chunks)
    assert b"remote_engine_id" not in out and b"10.0.0.9" not in out
    assert stream.params == D_PARAMS  # read before it went
    parsed = [e for e in out.split(b"\n\n") if e]
    assert [e.split(b"\n")[0] for e in parsed] == [
        b"event: response.created", b"event: response.output_text.delta",
        b"event: response.completed"]
    completed = orjson.loads(parsed[-1].split(b"\n")[1].removeprefix(b"data: "))
    assert completed["response"] == RESPONSE_OBJECT
    assert out.startswith(events[0]) and events[1] in out  # the others as sent


def test_a_stream_without_params_passes_as_sent() -> None:
    for events in (responses_stream(None), messages_stream()):
        stream = StreamAnswer(collect=False)
        assert run(stream, events) == b"".join(events)
        assert stream.params is None
