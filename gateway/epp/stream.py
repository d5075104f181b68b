"""One ext_proc stream (one request through the data plane), in whichever processing mode
the data plane runs (`gateway.epp.modes`): each message in, the messages to send back out,
in the order Envoy requires (for the request and for the response: headers, then body,
then trailers). The picker (`gateway.epp.picker.Picker`) makes every decision; this owns
the order and the gathering.

    request_headers   -> the pick (no body, body mode NONE, or STREAMED waiting for it),
                         "continue" (BUFFERED*), or nothing yet (gathering)
    request_body      -> BUFFERED*: the pick in the body response; gathering: nothing
                         until end of stream, then the pick in the headers response and
                         the body back (full duplex) or each chunk answered (STREAMED)
    request_trailers  -> (gathering: the request ends here, as at end of stream) answered
    response_headers  -> the gateway's headers; the body mode asked for when allowed
    response_body     -> each chunk passed back (full duplex) or answered; usage read
    response_trailers -> answered; the record ends if the body had not ended it

The pick is awaited (`Picker.route`: the admission queue may hold it; the stream waits
with it, and its cancellation takes the request out of the queue). When the request flow
changed the body (the granted `priority`, the tenant's engine salt), the changed body is
what the data plane forwards: the buffered body response's mutation, the body sent back
in full duplex, the first STREAMED chunk replaced and the rest cleared; `Content-Length`
set to its length in each.

Bounds: a gathered request body holds at most `max_body` bytes (more is a 413 in OpenAI's
shape); a JSON answer read in pieces at most `max_answer` bytes (past that its usage is not
read; the answer still flows on).
"""

from __future__ import annotations

from envoy.service.ext_proc.v3 import external_processor_pb2 as ext

from gateway.epp import decision, messages, modes
from gateway.epp.picker import Flow, Picker
from gateway.proxy.asgi import too_large
from gateway.proxy.errors import GatewayError

Out = list[ext.ProcessingResponse]


class Stream:
    __slots__ = ("answer", "answer_over", "body", "chunks", "closed", "flow", "hint",
                 "length_sent", "max_answer", "max_body", "modes", "picked", "picker",
                 "plan", "response_mode", "response_over", "selection")

    def __init__(self, picker: Picker, max_body: int, max_answer: int) -> None:
        self.picker = picker
        self.max_body = max_body
        self.max_answer = max_answer
        self.modes: modes.Modes | None = None
        self.flow: Flow | None = None
        self.hint: frozenset[str] | None = None
        self.selection: str | None = None  # `test-epp-endpoint-selection` (conformance)
        self.plan: modes.RequestPlan = "headers"
        self.length_sent: str | None = None  # the client's Content-Length
        self.body = bytearray()  # the request body gathered (full duplex, STREAMED early)
        self.chunks = 0  # request body messages gathered, each answered at the pick
        self.picked = False
        self.closed = False  # an immediate response went: nothing more to send
        self.response_mode = modes.NONE  # the response body mode in effect, as asked
        self.answer = bytearray()  # a JSON answer read in pieces
        self.answer_over = False
        self.response_over = False  # the record's response part ended

    async def on(self, request: ext.ProcessingRequest) -> Out:
        if self.modes is None:
            pc = request.protocol_config if request.HasField("protocol_config") else None
            self.modes = modes.of(
                pc.request_body_mode if pc else None, pc.response_body_mode if pc else None,
                pc.send_body_without_waiting_for_header_response if pc else False)
        kind = request.WhichOneof("request")
        try:
            if kind == "request_headers":
                return await self._request_headers(request)
            if kind == "request_body":
                return await self._request_body(request)
            if kind == "request_trailers":
                return await self._request_trailers()
        except GatewayError as err:
            self.closed = True
            return [messages.immediate(err, self.flow.added if self.flow else [])]
        if kind == "response_headers":
            return self._response_headers(request)
        if kind == "response_body":
            return self._response_body(request.response_body)
        return self._response_trailers()

    # request -------------------------------------------------------------------------

    async def _request_headers(self, request: ext.ProcessingRequest) -> Out:
        assert self.modes is not None
        headers = messages.headers_of(request.request_headers)
        self.length_sent = headers.get("content-length")
        self.hint = _hint(request)
        if self.picker.epp.conformance:
            self.selection = headers.get(decision.TEST_SELECTION)
        # the flow first, so that an answer at the headers (401, a stored response's
        # 404/503) carries the request's id
        self.flow = self.picker.begin(headers)
        self.picker.check(self.flow, headers)
        self.plan = modes.request_plan(self.modes, request.request_headers.end_of_stream)
        if self.plan == "headers":
            self.picked = True
            routed = await self.picker.route(self.flow, None, self._allowed())
            return [messages.routed(routed.destination, body_phase=False,
                                    headers=routed.trace, remove=routed.untrace)]
        if self.plan == "body":
            return [messages.request_headers_continue()]
        return []  # gathering: the headers are answered with the pick

    async def _request_body(self, request: ext.ProcessingRequest) -> Out:
        assert self.modes is not None
        flow, part = self.flow, request.request_body
        if flow is None:
            return []
        if request.HasField("metadata_context"):
            self.hint = _hint(request) if messages.subset_values(request) is not None \
                else self.hint
        if self.picked:  # STREAMED, picked at the headers: each chunk flows on
            return [messages.request_body_continue()]
        if self.plan == "body":
            if len(part.body) > self.max_body or (
                    self.modes.request == modes.BUFFERED_PARTIAL
                    and not modes.whole(part.body, part.end_of_stream)):
                raise self._too_large()
            self.picked = True
            routed = await self.picker.route(flow, part.body, self._allowed())
            if routed.body is None:
                return [messages.routed(routed.destination, body_phase=True,
                                        headers=routed.trace, remove=routed.untrace)]
            # the changed body replaces the buffered one (Envoy holds the headers until
            # this answer, so its Content-Length is set here too)
            return [messages.routed(
                routed.destination, body_phase=True, body=routed.body,
                headers=[("content-length", str(len(routed.body))), *routed.trace],
                remove=routed.untrace)]
        if len(self.body) + len(part.body) > self.max_body:
            raise self._too_large()
        self.body += part.body
        self.chunks += 1
        return await self._pick_gathered(end=True) if part.end_of_stream else []

    async def _request_trailers(self) -> Out:
        out: Out = []
        if self.flow is not None and not self.picked and self.plan == "gather":
            out = await self._pick_gathered(end=False)
        return [*out, messages.trailers(request=True)]

    async def _pick_gathered(self, *, end: bool) -> Out:
        assert self.flow is not None and self.modes is not None
        body = bytes(self.body)
        self.body = bytearray()
        self.picked = True
        routed = await self.picker.route(self.flow, body, self._allowed())
        destination = routed.destination
        if not self.modes.duplex_request:  # STREAMED: each chunk answered in turn
            if routed.body is None:  # ... passing as it was
                return [messages.routed(destination, body_phase=False,
                                        headers=routed.trace, remove=routed.untrace),
                        *[messages.request_body_continue()] * self.chunks]
            # the first chunk becomes the changed body, the others are cleared
            return [messages.routed(destination, body_phase=False,
                                    headers=[("content-length", str(len(routed.body))),
                                             *routed.trace], remove=routed.untrace),
                    messages.request_body_replaced(routed.body),
                    *[messages.request_body_replaced(None)] * (self.chunks - 1)]
        if routed.body is not None:
            body = routed.body  # changed by the request flow: that is what is forwarded
        length = modes.content_length(self.length_sent, len(body))
        return [messages.routed(destination, body_phase=False,
                                headers=[*([("content-length", length)] if length else ()),
                                         *routed.trace], remove=routed.untrace),
                *messages.streamed_body(body, end)]

    def _allowed(self) -> frozenset[str] | None:
        """The data plane's subset hint (as last sent), narrowed by the conformance
        suite's selection header when `[epp] conformance` is on."""
        return decision.test_selection(self.selection, self.hint)

    def _too_large(self) -> GatewayError:
        err = too_large(self.max_body)
        if self.flow is not None:
            self.picker.fail(self.flow, err)
        return err

    # response ------------------------------------------------------------------------

    def _response_headers(self, request: ext.ProcessingRequest) -> Out:
        assert self.modes is not None
        flow = self.flow
        if flow is None:
            return [ext.ProcessingResponse(response_headers=ext.HeadersResponse())]
        headers = messages.headers_of(request.response_headers)
        meta, attrs = messages.served_values(request)
        status = int(headers.get(":status", "0") or 0)
        served = decision.served_endpoint(meta, attrs)
        end = request.response_headers.end_of_stream
        added = self.picker.response_started(
            flow, status, served, headers.get("content-type", ""),
            unreachable=decision.unreachable(status, attrs.get(decision.CODE_DETAILS)),
            body_follows=self.modes.duplex_response and not end)
        if self.picker.epp.conformance:
            endpoint = served or (self.picker.endpoints.get(flow.replica.name)
                                  if flow.replica is not None else None)
            if endpoint:
                added = [*added, (decision.TEST_SERVED, endpoint)]
        override = None if end else modes.response_override(
            self.modes, flow.wants_body, flow.sse)
        self.response_mode = self.modes.response if override is None else override
        if end:
            self._end_response()
        return [messages.response_headers(added, override)]

    def _response_body(self, part: ext.HttpBody) -> Out:
        # once per chunk of every answer: each protobuf field read once (a bytes read
        # is a copy)
        assert self.modes is not None
        chunk, end = part.body, part.end_of_stream
        out = (messages.streamed(chunk, end, request=False)
               if self.modes.duplex_response else messages.response_body_continue())
        flow = self.flow
        if flow is not None and flow.sse and not flow.wants_body and not self.response_over:
            self.picker.stream_chunk(flow, chunk)  # full duplex: its first token (picker.py)
        if flow is None or self.response_over or not flow.wants_body:
            if end:
                self._end_response()
            return [out]
        if flow.sse or self.response_mode == modes.BUFFERED_PARTIAL:
            # a stream's chunks as they come; a JSON answer in one message, whole or
            # (over Envoy's buffer) its first part, which ends the record
            self.picker.response_body(flow, chunk, end)
            self.response_over = flow.finished
        elif end:
            self._answer(chunk)
            self.picker.response_body(flow, b"" if self.answer_over else bytes(self.answer),
                                      True)
            self.response_over = True
        else:
            self._answer(chunk)
        return [out]

    def _answer(self, chunk: bytes) -> None:
        if self.answer_over or len(self.answer) + len(chunk) > self.max_answer:
            self.answer_over, self.answer = True, bytearray()
        else:
            self.answer += chunk

    def _response_trailers(self) -> Out:
        self._end_response()
        return [messages.trailers(request=False)]

    def _end_response(self) -> None:
        flow = self.flow
        if flow is None or self.response_over:
            return
        self.response_over = True
        if flow.wants_body:
            if flow.sse:
                self.picker.response_body(flow, b"", True)
            else:
                self.picker.response_body(
                    flow, b"" if self.answer_over else bytes(self.answer), True)
        else:
            self.picker.finish(flow)

    def close(self) -> None:
        """The stream ended (client gone, error, or the data plane done with it)."""
        if self.flow is not None:
            self.picker.finish(self.flow, cut=True)


def _hint(request: ext.ProcessingRequest) -> frozenset[str] | None:
    return decision.subset_hint(messages.subset_values(request))
