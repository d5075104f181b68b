"""Relaying one upstream response to the client (I/O) and the header rules around it (pure).

Headers: only allow-listed client headers go upstream (gateway.proxy.target), plus the
gateway's `X-Request-Id` and the replica's own `Authorization`. Upstream response headers
come back minus hop-by-hop ones, `content-length` (recomputed), `server`, `date`,
`x-request-id` and any `x-gateway-*` (only the gateway sets those).

Body: an SSE answer (`text/event-stream`) is forwarded chunk by chunk through an
`SseUsageTap`; a failure after the first byte ends the stream with an OpenAI error event and
`data: [DONE]`; so does a stream cancelled from outside (the server's shutdown grace
period ran out), before the cancellation goes on. Any other answer is read whole (it is
complete JSON) and sent with its length; a 200 one is parsed once for its usage and its
generated text (`parse_answer`).

An answer's `kv_transfer_params` (engine host, port, block ids) never reach the client:
read into `outcome.kv_params`, then removed from the JSON body or the stream's event
(gateway.pd.answer). A stream's text is collected only when `collect_reply` asks (P/D's
turn two without re-prefill), bounded there; so are the answer's token ids
(`collect_ids`: token mode's check, gateway.pd.tokenids), which `strip_ids` (the gateway
asked for them, the client did not) writes back to `null` before the client sees them.

A Responses API answer names its id (body `id`, or the stream's `response.*` events):
`on_response_id` hears it before the bytes that carry it go to the client, so a client
that continues the chain at once already finds its creator remembered.

`first_token`: a stream whose first events come before the prefill (the Responses API's
`response.created`) times its first token at the first chunk holding one of these markers
(the first delta of text, a tool call's arguments, reasoning or a refusal: a stream that
only calls a tool has no text delta, and its prompt would count as queued prefill until
it ended) instead of its first byte.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

from gateway.pd.answer import StreamAnswer, strip_json
from gateway.pd.tokenids import answer_ids
from gateway.proxy.asgi import Headers, Send
from gateway.proxy.errors import GatewayError, UpstreamError, from_upstream
from gateway.proxy.target import HOP_BY_HOP
from gateway.upstream.seam import RawHeaders, UpstreamResponse
from gateway.usage.extract import Usage, parse_answer
from gateway.usage.sse import SseUsageTap, first_token_in

DROP_RESPONSE = HOP_BY_HOP | {b"content-length", b"server", b"date", b"x-request-id"}


def shutting_down() -> GatewayError:
    """What a request cut by the end of the shutdown grace period is told."""
    return GatewayError(503, "The request was cut: the gateway is shutting down.",
                        code="gateway_shutdown")


def upstream_request_headers(
    forwarded: list[tuple[str, str]], request_id: str, replica_auth: tuple[tuple[str, str], ...]
) -> list[tuple[str, str]]:
    """The allow-listed client headers (gateway.proxy.target.forwarded_headers), the
    gateway's request id and the replica's own key."""
    out = list(forwarded)
    if not any(k == "content-type" for k, _ in out):
        out.append(("content-type", "application/json"))
    out.append(("X-Request-Id", request_id))
    out.extend(replica_auth)
    return out


def client_response_headers(upstream: RawHeaders, extra: Headers) -> tuple[Headers, bytes]:
    """Headers for the client and the upstream content type."""
    out: Headers = []
    content_type = b""
    for key, value in upstream:
        k = key.lower()
        if k in DROP_RESPONSE or k.startswith(b"x-gateway-"):
            continue
        if k == b"content-type":
            content_type = value
        out.append((k, value))
    out.extend(extra)
    return out, content_type


class RelayOutcome:
    """What the relay observed; the request path turns it into the usage record."""

    __slots__ = ("error", "first_byte", "kv_params", "reasoned", "reply_text", "started",
                 "status", "token_ids", "usage")

    def __init__(self) -> None:
        self.started = False  # the response head went to the client
        self.first_byte: float | None = None  # perf_counter when the first body byte went
        self.status = 0
        self.usage: Usage | None = None
        # The generated text of a non-streamed answer; of a stream only when asked
        # (`collect_reply`): collecting it means parsing every token event.
        self.reply_text: str | None = None
        self.error: GatewayError | None = None
        # the answer's own kv_transfer_params (a P/D decoder's, gateway.pd), whole or
        # from a stream's final chunk; the client never gets them (gateway.pd.answer)
        self.kv_params: dict[str, Any] | None = None
        # the answer carried reasoning (whole, or a collected stream): D's KV then holds
        # tokens its text does not, and P/D keeps nothing for the next turn
        self.reasoned = False
        # the prompt's token ids then the generated ones (`collect_ids`), None when unknown
        self.token_ids: list[int] | None = None


async def relay(
    resp: UpstreamResponse, send: Send, extra: Headers, *, strip_usage: bool, replica: str | None,
    outcome: RelayOutcome, on_first_byte: Callable[[], None], timer: Callable[[], float],
    on_response_id: Callable[[str], None] | None = None,
    first_token: tuple[bytes, ...] | None = None,
    collect_reply: bool = False, collect_ids: bool = False, strip_ids: bool = False,
) -> None:
    """Send resp to the client. Upstream failures before the head propagate (nothing was
    sent); after it they end the stream with an error event recorded in `outcome.error`
    (naming `replica`, unless None: the client may not learn it, proxy/tenancy.py)."""
    headers, content_type = client_response_headers(resp.headers, extra)
    outcome.status = resp.status
    if not content_type.startswith(b"text/event-stream"):
        data = await resp.read()
        if resp.status == 200:
            answer = parse_answer(data)
            outcome.usage, outcome.reply_text = answer.usage, answer.text
            outcome.kv_params = answer.kv_transfer_params
            outcome.reasoned = answer.reasoning
            if collect_reply and collect_ids:
                outcome.token_ids = None if answer.doc is None else answer_ids(answer.doc)
            if answer.response_id is not None and on_response_id is not None:
                on_response_id(answer.response_id)
        data = strip_json(data, strip_ids)  # read above; never the client's (gateway.pd.answer)
        headers.append((b"content-length", str(len(data)).encode()))
        outcome.first_byte = timer()
        on_first_byte()
        outcome.started = True
        await send({"type": "http.response.start", "status": resp.status, "headers": headers})
        await send({"type": "http.response.body", "body": data})
        return

    tap = SseUsageTap(strip=strip_usage)
    # before the tap: a usage-only final chunk the tap strips may carry the params
    stream = StreamAnswer(collect=collect_reply and resp.status == 200, strip_ids=strip_ids,
                          collect_ids=collect_ids)
    outcome.started = True
    await send({"type": "http.response.start", "status": resp.status, "headers": headers})
    # A response that can tell it has ended without another read lets its last bytes and
    # the end of the body go to the client in one write instead of two.
    at_eof: Callable[[], bool] | None = getattr(resp, "at_eof", None)
    held = b""
    try:
        async for chunk in resp.chunks():
            out = tap.feed(stream.feed(chunk))
            if on_response_id is not None and tap.response_id is not None:
                on_response_id(tap.response_id)
                on_response_id = None
            if not out:
                continue
            if outcome.first_byte is None and first_token_in(out, first_token):
                outcome.first_byte = timer()
                on_first_byte()
            if held:  # at_eof was wrong after all: keep the order
                await send({"type": "http.response.body", "body": held, "more_body": True})
                held = b""
            if at_eof is not None and at_eof():
                held = out  # the loop ends on the next step without waiting
                continue
            await send({"type": "http.response.body", "body": out, "more_body": True})
        last = tap.feed(stream.finish())
        tail = held + last + tap.finish()
    except UpstreamError as exc:
        outcome.error = from_upstream(exc, replica)
        # close a half-written event so the error event parses on its own
        tail = held + (b"\n\n" if tap.pending else b"") + outcome.error.sse_events()
    except asyncio.CancelledError:
        # The client went (then nothing is sent) or the server is shutting down and its
        # grace period is over: end the stream the way a failed one ends, then go on.
        outcome.error = shutting_down()
        tail = held + (b"\n\n" if tap.pending else b"") + outcome.error.sse_events()
        with contextlib.suppress(RuntimeError, OSError):  # the response is over already
            await send({"type": "http.response.body", "body": tail, "more_body": False})
        raise
    outcome.usage = tap.usage
    outcome.kv_params = stream.params
    outcome.reasoned = stream.reasoned
    if outcome.error is None and resp.status == 200:
        outcome.reply_text = stream.reply
        outcome.token_ids = stream.token_ids
    await send({"type": "http.response.body", "body": tail, "more_body": False})
