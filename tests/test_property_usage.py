"""Properties of usage extraction on arbitrary input: the SSE tap gives the same bytes and
the same usage however the upstream stream is split, forwards everything in pass-through
mode, removes exactly the injected usage chunk in strip mode, and never raises."""

from __future__ import annotations

import json
from typing import Any

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.usage.extract import usage_from_body
from gateway.usage.sse import SseUsageTap
from tests.props import json_value, text

TOKEN_CHUNK = st.builds(
    lambda t: {"id": "c", "object": "chat.completion.chunk",
               "choices": [{"index": 0, "delta": {"content": t}}]}, text)
USAGE = st.fixed_dictionaries({
    "prompt_tokens": st.integers(0, 10**6), "completion_tokens": st.integers(0, 10**5),
    "total_tokens": st.integers(0, 10**6),
    "prompt_tokens_details": st.one_of(st.none(), st.fixed_dictionaries(
        {"cached_tokens": st.integers(0, 10**6)})),
})


def _event(doc: dict[str, Any], crlf: bool) -> bytes:
    sep = b"\r\n\r\n" if crlf else b"\n\n"
    return b"data: " + orjson.dumps(doc) + sep


def _split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    pieces, last = [], 0
    for p in points:
        pieces.append(data[last:p])
        last = p
    pieces.append(data[last:])
    return pieces


def _run(tap: SseUsageTap, pieces: list[bytes]) -> bytes:
    return b"".join(tap.feed(p) for p in pieces) + tap.finish()


@settings(max_examples=300, deadline=None)
@given(st.lists(TOKEN_CHUNK, max_size=8), USAGE, st.booleans(), st.booleans(),
       st.lists(st.integers(0, 10**6), max_size=12))
def test_any_split_gives_the_same_bytes_and_usage(
    tokens: list[dict[str, Any]], usage: dict[str, Any], crlf: bool, comment: bool,
    cuts: list[int],
) -> None:
    head = (b": keep-alive\n\n" if comment else b"") + b"".join(_event(t, crlf) for t in tokens)
    usage_event = _event({"id": "c", "object": "chat.completion.chunk", "choices": [],
                          "usage": usage}, crlf)
    done = b"data: [DONE]\n\n"
    stream = head + usage_event + done
    pieces = _split(stream, cuts)

    passthrough = SseUsageTap(strip=False)
    assert _run(passthrough, pieces) == stream
    stripped = SseUsageTap(strip=True)
    assert _run(stripped, pieces) == head + done
    assert stripped.stripped == 1
    for tap in (passthrough, stripped):
        assert tap.usage is not None
        assert tap.usage.prompt_tokens == usage["prompt_tokens"]
        details = usage["prompt_tokens_details"]
        assert tap.usage.cached_tokens == (details["cached_tokens"] if details else None)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(max_size=80), max_size=10))
def test_arbitrary_bytes_pass_through_unchanged(pieces: list[bytes]) -> None:
    tap = SseUsageTap(strip=False)
    assert _run(tap, pieces) == b"".join(pieces)
    strip = SseUsageTap(strip=True)
    out = _run(strip, pieces)  # never raises; may drop only a usage-only event
    assert len(out) <= len(b"".join(pieces))


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.binary(max_size=200), json_value.map(lambda v: json.dumps(v).encode()),
                 st.builds(lambda u: json.dumps({"usage": u}).encode(), json_value)))
def test_usage_from_any_body_never_raises(body: bytes) -> None:
    usage = usage_from_body(body)
    if usage is not None:
        for n in (usage.prompt_tokens, usage.cached_tokens, usage.completion_tokens):
            assert n is None or (isinstance(n, int) and n >= 0)


@settings(max_examples=100, deadline=None)
@given(st.booleans(), st.lists(st.integers(1, 5000), min_size=1, max_size=40))
def test_an_endless_event_is_never_held_beyond_the_bound(strip: bool, sizes: list[int]) -> None:
    tap = SseUsageTap(strip=strip, max_event_bytes=4096)
    sent = b""
    out = b""
    for n in sizes:  # one event that never ends: no blank line anywhere
        piece = b"data: " + b"x" * n
        sent += piece
        out += tap.feed(piece)
        assert len(tap._tail) <= 4096
    assert out + tap.finish() == sent  # nothing lost, nothing reordered
