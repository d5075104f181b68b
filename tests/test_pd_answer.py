"""gateway.pd.answer by table: an answer's kv_transfer_params never reach the client (a
whole JSON body, a stream's events however split), and a streamed answer's text is
collected for turn two without re-prefill only when it is the whole answer.

Mutations seen failing here: strip_json returning the body unchanged; the stream's key
left in its event; the params not read (None) or left in the doc; a tool-call delta or
a second choice not giving up the text; the bound on the text not applied; a partial
event with the key passed on at the bound."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from gateway.pd.answer import StreamAnswer, strip_json
from gateway.usage.extract import parse_answer

PARAMS = {"remote_host": "10.0.0.6", "remote_port": 5600, "remote_block_ids": [[7, 8]],
          "remote_engine_id": "d1"}


def ev(doc: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(doc) + b"\n\n"


def chat(text: str, **extra: Any) -> bytes:
    return ev({"object": "chat.completion.chunk",
               "choices": [{"index": 0, "delta": {"content": text}}], **extra})


@pytest.mark.parametrize(("body", "kept"), [
    ({"choices": [], "usage": {}, "kv_transfer_params": PARAMS}, {"choices": [], "usage": {}}),
    # vLLM's null on an answer without a connector: nothing to hide, the bytes stay
    ({"choices": [], "kv_transfer_params": None}, {"choices": [], "kv_transfer_params": None}),
    ({"choices": [{"text": "kv_transfer_params"}]}, {"choices": [{"text": "kv_transfer_params"}]}),
    # nested (a Responses object): removed wherever it is
    ({"response": {"id": "r", "kv_transfer_params": PARAMS}}, {"response": {"id": "r"}}),
])
def test_strip_json_removes_the_params(body: dict[str, Any], kept: dict[str, Any]) -> None:
    out = strip_json(orjson.dumps(body))
    assert orjson.loads(out) == kept
    assert b"10.0.0.6" not in out


def test_strip_json_leaves_other_bytes_as_they_are() -> None:
    for raw in (b'{"a": 1}', b"not json", b'["kv_transfer_params"]', b"",
                b'{"id": "c",  "kv_transfer_params": null}'):
        assert strip_json(raw) == raw


@pytest.mark.parametrize("params", [None, PARAMS])
def test_a_named_event_keeps_its_name_and_loses_only_the_params(
        params: dict[str, Any] | None) -> None:
    """A Responses stream names its events (`event:` lines) and nests the response
    object: an event is never dropped or renamed, only the params leave it."""
    created = (b"event: response.created\ndata: "
               + orjson.dumps({"type": "response.created",
                               "response": {"id": "r", "kv_transfer_params": params}})
               + b"\n\n")
    answer = StreamAnswer(collect=False)
    out = answer.feed(created) + answer.finish()
    if params is None:
        assert out == created
    else:
        assert out.startswith(b"event: response.created\ndata: ")
        assert b"10.0.0.6" not in out and out.endswith(b"\n\n")
        assert orjson.loads(out.split(b"data: ", 1)[1]) == {
            "type": "response.created", "response": {"id": "r"}}


STREAMS: list[tuple[str, list[bytes]]] = [
    ("final chunk", [chat("Hel"), chat("lo", kv_transfer_params=PARAMS), b"data: [DONE]\n\n"]),
    ("usage-only chunk", [chat("Hel"), chat("lo"),
                          ev({"choices": [], "usage": {"prompt_tokens": 3},
                              "kv_transfer_params": PARAMS}), b"data: [DONE]\n\n"]),
    ("crlf events", [chat("Hel").replace(b"\n", b"\r\n"),
                     chat("lo", kv_transfer_params=PARAMS).replace(b"\n", b"\r\n")]),
]


@pytest.mark.parametrize("split", [0, 1, 7, 30])  # 0: one read per event
@pytest.mark.parametrize(("name", "events"), STREAMS, ids=[s[0] for s in STREAMS])
def test_a_streams_params_are_read_and_never_passed_on(
        name: str, events: list[bytes], split: int) -> None:
    raw = b"".join(events)
    reads = events if split == 0 else [raw[i:i + split] for i in range(0, len(raw), split)]
    answer = StreamAnswer(collect=True)
    out = b"".join(answer.feed(r) for r in reads) + answer.finish()
    assert answer.params == PARAMS
    assert b"kv_transfer_params" not in out and b"10.0.0.6" not in out
    assert answer.reply == "Hello"
    # everything else passes: the same events, less the key
    docs = [orjson.loads(line[6:]) for line in out.split(b"\n") if line.startswith(b"data: {")]
    assert [d.get("choices") for d in docs] == [
        orjson.loads(e.strip()[6:]).get("choices") for e in events if b"{" in e]


def test_token_chunks_pass_untouched_and_nothing_is_collected_unasked() -> None:
    answer = StreamAnswer(collect=False)
    chunk = chat("Hel") + chat("lo")
    assert answer.feed(chunk) is chunk
    assert answer.reply is None and answer.params is None


@pytest.mark.parametrize(("events", "reply"), [
    ([chat("a"), chat("b")], "ab"),
    ([ev({"choices": [{"index": 0, "text": "x"}]}), ev({"choices": [{"index": 0, "text": "y"}]})],
     "xy"),  # completions
    ([chat("")], ""),
    ([chat("a"), ev({"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0}]}}]})],
     None),
    ([chat("a"), ev({"choices": [{"index": 1, "delta": {"content": "b"}}]})], None),
    ([chat("a" * 6)], None),  # over the bound (5)
    ([chat("a" * 5)], "a" * 5),
    # a reasoning model's thinking: D's KV holds it, the text does not (review F4)
    ([ev({"choices": [{"index": 0, "delta": {"reasoning_content": "hm"}}]}), chat("a")],
     None),
    ([chat("a"), ev({"choices": [{"index": 0, "delta": {"reasoning": "hm"}}]})], None),
    ([ev({"choices": [{"index": 0, "delta": {"reasoning_content": "", "content": "a"}}]})],
     "a"),  # an empty field is no thinking
])
def test_the_collected_text(events: list[bytes], reply: str | None) -> None:
    answer = StreamAnswer(collect=True, max_reply_chars=5)
    for e in events:
        answer.feed(e)
    answer.finish()
    assert answer.reply == reply
    assert answer.reasoned == any(b'"reasoning' in e and b'":""' not in e for e in events)


@pytest.mark.parametrize(("message", "reasoning"), [
    ({"content": "a"}, False),
    ({"content": "a", "reasoning_content": "hm"}, True),
    ({"content": "a", "reasoning": "hm"}, True),
    ({"content": "a", "reasoning_content": None, "reasoning": ""}, False),
])
def test_a_whole_answers_reasoning_is_read(message: dict[str, Any], reasoning: bool) -> None:
    body = {"choices": [{"index": 0, "message": message}], "usage": {"prompt_tokens": 1},
            "kv_transfer_params": PARAMS}
    answer = parse_answer(orjson.dumps(body))
    assert (answer.reasoning, answer.text, answer.kv_transfer_params) == (reasoning, "a", PARAMS)


def test_a_partial_event_over_the_bound_is_let_go_without_the_params() -> None:
    answer = StreamAnswer(collect=False, max_event_bytes=64)
    assert answer.feed(b'data: {"kv_transfer_params": {"remote_host": "10.0.0.6"') == b""
    # held past the bound: it goes on in pieces, the params removed as they pass
    out = answer.feed(b', "pad": "' + b"x" * 64 + b'"}, "id": 1}\n\ndata: {"next": 2}\n\n')
    out += answer.finish()
    assert b"10.0.0.6" not in out
    first, second, rest = out.split(b"\n\n")
    assert orjson.loads(first.removeprefix(b"data: ")) == {"id": 1}
    assert second == b'data: {"next": 2}' and rest == b""
    plain = StreamAnswer(collect=True, max_event_bytes=64)
    long = b"data: " + b"y" * 80
    # let go as it comes (all but the last bytes, where a key could begin)
    assert plain.feed(long) + plain.finish() == long and plain.reply is None
