"""relay(): how the body goes to the client (one test per way a stream can end)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from gateway.proxy.errors import UpstreamProtocolError
from gateway.proxy.relay import RelayOutcome, relay
from gateway.usage.sse import RESPONSES_FIRST_TOKEN

EVENTS = [b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n',
          b'data: {"choices":[{"delta":{"content":"b"}}]}\n\n',
          b'data: {"choices":[],"usage":{"prompt_tokens":9,"completion_tokens":2}}\n\n'
          b"data: [DONE]\n\n"]


class Stream:
    """An upstream SSE answer read in len(reads) steps; `eof_known` says whether it can
    tell the body ended without another read (as H1Response.at_eof can)."""

    def __init__(self, reads: list[bytes], eof_known: bool, fail_after: int | None = None,
                 ) -> None:
        self.status = 200
        self.headers = [(b"content-type", b"text/event-stream")]
        self.reads = reads
        self.left = len(reads)
        self.fail_after = fail_after
        if eof_known:
            self.at_eof = lambda: self.left == 0

    async def chunks(self) -> AsyncIterator[bytes]:
        for i, chunk in enumerate(self.reads):
            if self.fail_after == i:
                raise UpstreamProtocolError("reset")
            self.left -= 1
            yield chunk

    async def read(self) -> bytes:
        return b"".join(self.reads)


@pytest.mark.parametrize(("eof_known", "fail_after", "bodies", "ends_with_error"), [
    # the last read goes out with the end of the body when EOF is known at once
    (True, None, [b"", EVENTS[0], EVENTS[1], EVENTS[2].replace(
        b'data: {"choices":[],"usage":{"prompt_tokens":9,"completion_tokens":2}}\n\n', b"")],
     False),
    (False, None, [b"", EVENTS[0], EVENTS[1], b"data: [DONE]\n\n", b""], False),
    (True, 2, [b"", EVENTS[0], EVENTS[1]], True),
])
async def test_stream_sends(eof_known: bool, fail_after: int | None, bodies: list[bytes],
                            ends_with_error: bool) -> None:
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    firsts: list[int] = []
    outcome = RelayOutcome()
    await relay(Stream(EVENTS, eof_known, fail_after), send, [], strip_usage=True,  # type: ignore[arg-type]
                replica="r", outcome=outcome, on_first_byte=lambda: firsts.append(1),
                timer=lambda: 1.0)
    assert sent[0]["type"] == "http.response.start"
    got = [m["body"] for m in sent[1:]]
    assert [m["more_body"] for m in sent[1:]] == [True] * (len(sent) - 2) + [False]
    if ends_with_error:
        assert got[:-1] == bodies[1:] and b'"error"' in got[-1] and outcome.error is not None
    else:
        assert got == bodies[1:]
        assert outcome.usage is not None and outcome.usage.prompt_tokens == 9
    assert firsts == [1] and outcome.first_byte == 1.0


RESPONSES_EVENTS = [
    b'event: response.created\ndata: {"type":"response.created","response":{"id":"resp_1",'
    b'"object":"response","usage":null}}\n\n',
    b'event: response.in_progress\ndata: {"type":"response.in_progress"}\n\n',
    b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta",'
    b'"delta":"a"}\n\n',
    b'event: response.completed\ndata: {"type":"response.completed","response":{"id":"resp_1",'
    b'"object":"response","usage":{"input_tokens":9,"input_tokens_details":'
    b'{"cached_tokens":0},"output_tokens":1}}}\n\n',
]


TOOL_CALL_EVENTS = [
    *RESPONSES_EVENTS[:2],
    b'event: response.function_call_arguments.delta\ndata: {"type":'
    b'"response.function_call_arguments.delta","delta":"{"}\n\n',
    RESPONSES_EVENTS[3],
]


async def test_a_responses_stream_that_only_calls_a_tool_has_a_first_token() -> None:
    """No text delta at all: its first token is its tool call's first arguments delta (else
    its prompt counted as queued prefill until the stream ended: review 64)."""
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    outcome = RelayOutcome()
    await relay(Stream(TOOL_CALL_EVENTS, False), send, [], strip_usage=False,  # type: ignore[arg-type]
                replica="r", outcome=outcome, on_first_byte=lambda: None,
                timer=lambda: float(len(sent)), first_token=RESPONSES_FIRST_TOKEN)
    assert outcome.first_byte == 3  # the head and two events before prefill had gone out


@pytest.mark.parametrize(("marker", "first_at"), [(None, 1), (b'"response.output_text.delta"', 3)])
async def test_responses_stream_first_token_and_id(marker: bytes | None, first_at: int) -> None:
    """The Responses stream opens before the prefill: its first token is the first delta.
    The response id is known before the bytes carrying it are sent."""
    sent: list[dict[str, Any]] = []
    ids: list[tuple[str, int]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    outcome = RelayOutcome()
    await relay(Stream(RESPONSES_EVENTS, False), send, [], strip_usage=False,  # type: ignore[arg-type]
                replica="r", outcome=outcome, on_first_byte=lambda: None,
                timer=lambda: float(len(sent)),
                on_response_id=lambda rid: ids.append((rid, len(sent))),
                first_token=None if marker is None else (marker,))
    assert outcome.first_byte == first_at  # bodies sent before it (the head counts as one)
    assert ids == [("resp_1", 1)]  # heard while only the response head had gone out
    assert outcome.usage is not None and outcome.usage.prompt_tokens == 9
