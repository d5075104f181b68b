"""SseUsageTap and usage extraction: tables of streams, fed in every kind of split."""

from __future__ import annotations

import random

import orjson
import pytest

from gateway.usage.extract import Usage, answer_from_body, usage_from_body, usage_from_mapping
from gateway.usage.sse import SseUsageTap

ROLE = b'data: {"id":"c1","choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n'
TOK1 = b'data: {"id":"c1","choices":[{"index":0,"delta":{"content":"Hel"}}]}\n\n'
TOK2 = b'data: {"id":"c1","choices":[{"index":0,"delta":{"content":"lo \\"usage\\""}}]}\n\n'
FIN = b'data: {"id":"c1","choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n'
USAGE = (
    b'data: {"id":"c1","choices":[],"usage":{"prompt_tokens":1000,"total_tokens":1012,'
    b'"completion_tokens":12,"prompt_tokens_details":{"cached_tokens":992}}}\n\n'
)
USAGE_NO_DETAILS = (
    b'data: {"id":"c1","choices":[],"usage":{"prompt_tokens":7,"total_tokens":9,'
    b'"completion_tokens":2}}\n\n'
)
CONT = (  # continuous_usage_stats: a token chunk that carries running usage
    b'data: {"id":"c1","choices":[{"index":0,"delta":{"content":"x"}}],'
    b'"usage":{"prompt_tokens":1000,"total_tokens":1001,"completion_tokens":1}}\n\n'
)
COMMENT = b': sim-timing {"queue_ms":1.5,"usage":"not json usage"}\n\n'
DONE = b"data: [DONE]\n\n"
ERROR = b'data: {"error":{"message":"boom","type":"InternalServerError","code":500}}\n\n'

FULL = Usage(prompt_tokens=1000, completion_tokens=12, cached_tokens=992)

CASES = [
    # (name, events, strip, expected forwarded events, expected usage)
    ("plain", [ROLE, TOK1, FIN, DONE], False, [ROLE, TOK1, FIN, DONE], None),
    ("client asked usage", [ROLE, TOK1, FIN, USAGE, DONE], False,
     [ROLE, TOK1, FIN, USAGE, DONE], FULL),
    ("injected usage removed", [ROLE, TOK1, TOK2, FIN, USAGE, DONE], True,
     [ROLE, TOK1, TOK2, FIN, DONE], FULL),
    ("no details", [ROLE, FIN, USAGE_NO_DETAILS, DONE], True, [ROLE, FIN, DONE],
     Usage(prompt_tokens=7, completion_tokens=2, cached_tokens=None)),
    ("comments pass", [COMMENT, ROLE, COMMENT, FIN, USAGE, COMMENT, DONE], True,
     [COMMENT, ROLE, COMMENT, FIN, COMMENT, DONE], FULL),
    ("continuous usage kept", [ROLE, CONT, FIN, USAGE, DONE], False,
     [ROLE, CONT, FIN, USAGE, DONE], FULL),
    ("continuous chunk not stripped", [ROLE, CONT, FIN, USAGE, DONE], True,
     [ROLE, CONT, FIN, DONE], FULL),
    ("error event passes", [ROLE, TOK1, ERROR, DONE], True, [ROLE, TOK1, ERROR, DONE], None),
    ("crlf events", [e.replace(b"\n", b"\r\n") for e in (ROLE, FIN, USAGE, DONE)], True,
     [e.replace(b"\n", b"\r\n") for e in (ROLE, FIN, DONE)], FULL),
]


def _splits(data: bytes, seed: int) -> list[bytes]:
    rng = random.Random(seed)
    out, i = [], 0
    while i < len(data):
        n = rng.choice([1, 2, 3, 7, 50, 500])
        out.append(data[i : i + n])
        i += n
    return out


def _run(chunks: list[bytes], strip: bool) -> tuple[bytes, SseUsageTap]:
    tap = SseUsageTap(strip=strip)
    out = b"".join(tap.feed(c) for c in chunks) + tap.finish()
    return out, tap


@pytest.mark.parametrize(("name", "events", "strip", "expected", "usage"), CASES)
@pytest.mark.parametrize("split", ["whole", "events", "bytes", *[f"rand{i}" for i in range(6)]])
def test_tap_forwards_and_reads_usage(
    name: str, events: list[bytes], strip: bool, expected: list[bytes], usage: Usage | None,
    split: str,
) -> None:
    data = b"".join(events)
    if split == "whole":
        chunks = [data]
    elif split == "events":
        chunks = list(events)
    elif split == "bytes":
        chunks = [data[i : i + 1] for i in range(len(data))]
    else:
        chunks = _splits(data, int(split[4:]))
    out, tap = _run(chunks, strip)
    assert out == b"".join(expected), name
    assert tap.usage == usage


def test_pass_through_forwards_each_chunk_immediately() -> None:
    tap = SseUsageTap(strip=False)
    half = len(USAGE) // 2
    assert tap.feed(ROLE + USAGE[:half]) == ROLE + USAGE[:half]
    assert tap.usage is None
    assert tap.feed(USAGE[half:]) == USAGE[half:]
    assert tap.usage == FULL


def test_strip_holds_only_the_partial_event() -> None:
    tap = SseUsageTap(strip=True)
    assert tap.feed(ROLE + TOK1[:10]) == ROLE
    assert tap.feed(TOK1[10:]) == TOK1
    assert tap.feed(USAGE) == b""
    assert tap.stripped == 1


def test_stream_cut_mid_event_releases_tail() -> None:
    tap = SseUsageTap(strip=True)
    assert tap.feed(ROLE + TOK1[:-2]) == ROLE
    assert tap.finish() == TOK1[:-2]


@pytest.mark.parametrize(
    ("usage", "expected"),
    [
        ({"prompt_tokens": 5, "completion_tokens": 1,
          "prompt_tokens_details": {"cached_tokens": 0}}, Usage(5, 1, 0)),
        ({"prompt_tokens": 5, "completion_tokens": 1, "prompt_tokens_details": None},
         Usage(5, 1, None)),
        ({"prompt_tokens": 5}, Usage(5, None, None)),
        ({"prompt_tokens": True, "completion_tokens": -1}, Usage(None, None, None)),
        ({"prompt_tokens": "5", "prompt_tokens_details": {"cached_tokens": 2.0}},
         Usage(None, None, None)),
        (None, None),
        ([], None),
    ],
)
def test_usage_from_mapping(usage: object, expected: Usage | None) -> None:
    assert usage_from_mapping(usage) == expected


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (orjson.dumps({"id": "x", "usage": {"prompt_tokens": 3, "completion_tokens": 4,
                                            "prompt_tokens_details": {"cached_tokens": 2}}}),
         Usage(3, 4, 2)),
        (b'{"error": {"message": "m", "code": 400}}', None),
        (b'{"usage": null}', None),
        (b'not json "usage"', None),
        (b'["usage"]', None),
    ],
)
def test_usage_from_body(body: bytes, expected: Usage | None) -> None:
    assert usage_from_body(body) == expected


BODY_USAGE = {"prompt_tokens": 3, "completion_tokens": 4}


@pytest.mark.parametrize(
    ("doc", "text"),
    [
        ({"choices": [{"message": {"role": "assistant", "content": "Hi there"}}]}, "Hi there"),
        ({"choices": [{"text": " and so on", "index": 0}]}, " and so on"),  # completions
        ({"choices": [{"message": {"role": "assistant", "content": None,
                                   "tool_calls": [{"id": "t"}]}}]}, None),
        ({"choices": [{"text": "a"}, {"text": "b"}]}, None),  # n = 2: which one comes back?
        ({"choices": []}, None),
        ({"choices": "x"}, None),
        ({}, None),
    ],
)
def test_answer_from_body_reads_usage_and_text_in_one_parse(doc: dict[str, object],
                                                            text: str | None) -> None:
    usage, reply = answer_from_body(orjson.dumps({**doc, "usage": BODY_USAGE}))
    assert usage == Usage(3, 4, None)
    assert reply == text
    assert answer_from_body(orjson.dumps(doc)) == (None, None)  # no usage: not parsed at all
