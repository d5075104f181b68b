"""What the data plane's ext_proc processing mode asks of the picker (pure: values in,
values out).

Envoy names the body modes it was configured with in the first message of each stream
(`ProcessingRequest.protocol_config`); a data plane that does not send them is taken to
run the project's own configuration (request body BUFFERED, response body NONE, the
picker asking for the body by mode override). Per request body mode, where the pick goes:

- NONE, or a request without body: in the request headers response.
- BUFFERED: in the body response (Envoy holds the headers until then; the body is whole).
- BUFFERED_PARTIAL: as BUFFERED when the one message holds the whole body (end of stream,
  or a complete JSON document followed by trailers); a first part only (the body is over
  Envoy's buffer) is a 413: routing on part of a prompt would be a guess.
- FULL_DUPLEX_STREAMED: Envoy sends every chunk without waiting; the picker gathers them
  until end of stream (or the trailers), then sends the headers response (the pick,
  `Content-Length`, `clear_route_cache`), then the body back as streamed mutations.
- STREAMED with `send_body_without_waiting_for_header_response`: gathered the same way,
  each chunk then answered unchanged after the headers response.
- STREAMED otherwise: Envoy sends no chunk before the headers response and routes when it
  gets it, so the pick is made at the headers, without the body (least busy, as a
  body-less call; no cache-aware routing). Configure one of the modes above instead.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import orjson

# ProcessingMode.BodySendMode, as Envoy numbers them
NONE, STREAMED, BUFFERED, BUFFERED_PARTIAL, FULL_DUPLEX_STREAMED = 0, 1, 2, 3, 4
NAMES = {NONE: "NONE", STREAMED: "STREAMED", BUFFERED: "BUFFERED",
         BUFFERED_PARTIAL: "BUFFERED_PARTIAL", FULL_DUPLEX_STREAMED: "FULL_DUPLEX_STREAMED"}

# where the request's pick is made: at the headers, at the one body message, or after
# gathering the chunks
RequestPlan = Literal["headers", "body", "gather"]


@dataclasses.dataclass(frozen=True, slots=True)
class Modes:
    request: int = BUFFERED
    response: int = NONE
    without_waiting: bool = False  # STREAMED: body chunks sent before the headers answer

    @property
    def duplex_request(self) -> bool:
        return self.request == FULL_DUPLEX_STREAMED

    @property
    def duplex_response(self) -> bool:
        return self.response == FULL_DUPLEX_STREAMED


def of(request_mode: int | None, response_mode: int | None,
       without_waiting: bool = False) -> Modes:
    """The modes named in `protocol_config` (None: not sent: the project's own file)."""
    if request_mode is None or response_mode is None:
        return Modes()
    return Modes(request_mode if request_mode in NAMES else BUFFERED,
                 response_mode if response_mode in NAMES else NONE, without_waiting)


def request_plan(modes: Modes, headers_end: bool) -> RequestPlan:
    if headers_end or modes.request == NONE:
        return "headers"
    if modes.request in (BUFFERED, BUFFERED_PARTIAL):
        return "body"
    if modes.request == FULL_DUPLEX_STREAMED or modes.without_waiting:
        return "gather"
    return "headers"  # STREAMED, waiting for the headers answer


def whole(body: bytes, end_of_stream: bool) -> bool:
    """A BUFFERED_PARTIAL message holds the whole body: at end of stream, or (trailers
    follow) when it parses as one JSON document."""
    if end_of_stream:
        return True
    try:
        orjson.loads(body)
    except orjson.JSONDecodeError:
        return False
    return True


def response_override(modes: Modes, wants_body: bool, sse: bool) -> int | None:
    """The response body mode to ask for (None: none asked). A JSON answer is asked for
    in one message (BUFFERED_PARTIAL: an answer over Envoy's buffer comes as its first
    part and the rest flows on), a stream chunk by chunk (STREAMED); a body the picker
    does not read is turned off. Full duplex is never overridden: Envoy has the picker
    send that body back, and a data plane configured so (llm-d) forbids overrides."""
    if modes.duplex_response:
        return None
    want = (STREAMED if sse else BUFFERED_PARTIAL) if wants_body else NONE
    return None if want == modes.response else want


def content_length(sent: str | None, body_len: int) -> str | None:
    """The `Content-Length` to set on a request whose body the picker sends back (full
    duplex): when the client's is absent (chunked) or differs from the body sent."""
    if sent is not None and sent.strip().isdigit() and int(sent) == body_len:
        return None
    return str(body_len)
