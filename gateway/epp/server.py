"""The ext_proc gRPC service (grpc.aio) and its lifecycle: one bidirectional stream per
request through the data plane, answered by the `Picker`; gRPC health (`grpc.health.v1`)
on the same listener, SERVING for "" and the ext_proc service name while started.

Per stream, in the order Envoy sends them:

    request_headers  -> (GET and friends, no body) the pick, or "continue"
    request_body     -> the pick (the body comes whole: BUFFERED), or an immediate answer
    response_headers -> the gateway's headers; a mode override asks for the body when
                        `[epp] response` reads it (BUFFERED_PARTIAL for JSON under "json"
                        and "body", STREAMED for SSE under "body")
    response_body    -> "continue" per chunk; the last one ends the record

The stream ending earlier (client gone, EPP-side error, headers-only reading) ends the
record there (`Picker.finish(cut=True)`), so every request is recorded once and its
in-flight count released.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from gateway.epp import decision, messages
from gateway.epp.picker import Flow, Picker
from gateway.proxy.errors import GatewayError

log = logging.getLogger("gateway.epp.server")

SERVICE_NAME = "envoy.service.ext_proc.v3.ExternalProcessor"


class ExternalProcessor:
    """`envoy.service.ext_proc.v3.ExternalProcessor` (registered by its generated helper)."""

    def __init__(self, picker: Picker) -> None:
        self.picker = picker

    async def Process(
        self, request_iterator: AsyncIterator[ext.ProcessingRequest],
        context: grpc.aio.ServicerContext[ext.ProcessingRequest, ext.ProcessingResponse],
    ) -> AsyncIterator[ext.ProcessingResponse]:
        picker = self.picker
        flow: Flow | None = None
        try:
            async for request in request_iterator:
                kind = request.WhichOneof("request")
                if kind == "request_headers":
                    headers = messages.headers_of(request.request_headers)
                    try:
                        flow = picker.start(headers)
                        if request.request_headers.end_of_stream:
                            yield messages.routed(picker.route(flow, None, _hint(request)),
                                                  body_phase=False)
                        else:
                            yield messages.request_headers_continue()
                    except GatewayError as err:
                        yield messages.immediate(err, flow.added if flow else [])
                        return
                elif kind == "request_body":
                    if flow is None:
                        return
                    try:
                        # BUFFERED: the whole body in one message
                        destination = picker.route(flow, request.request_body.body,
                                                   _hint(request))
                    except GatewayError as err:
                        yield messages.immediate(err, flow.added)
                        return
                    yield messages.routed(destination, body_phase=True)
                elif kind == "response_headers":
                    if flow is None:
                        yield ext.ProcessingResponse(response_headers=ext.HeadersResponse())
                        continue
                    headers = messages.headers_of(request.response_headers)
                    meta, attrs = messages.served_values(request)
                    status = int(headers.get(":status", "0") or 0)
                    added = picker.response_started(
                        flow, status, decision.served_endpoint(meta, attrs),
                        headers.get("content-type", ""),
                        unreachable=decision.unreachable(status,
                                                         attrs.get(decision.CODE_DETAILS)))
                    body = None
                    if flow.wants_body and not request.response_headers.end_of_stream:
                        body = "streamed" if flow.sse else "buffered"
                    yield messages.response_headers(added, body)
                    if request.response_headers.end_of_stream:
                        picker.finish(flow)
                elif kind == "response_body":
                    if flow is not None:
                        picker.response_body(flow, request.response_body.body,
                                             request.response_body.end_of_stream)
                    yield messages.response_body_continue()
                else:  # trailers (not asked for in the shipped configuration)
                    yield _continue(kind)
        finally:
            if flow is not None:
                picker.finish(flow, cut=True)


def _hint(request: ext.ProcessingRequest) -> frozenset[str] | None:
    return decision.subset_hint(messages.subset_values(request))


def _continue(kind: str | None) -> ext.ProcessingResponse:
    if kind == "request_trailers":
        return ext.ProcessingResponse(request_trailers=ext.TrailersResponse())
    return ext.ProcessingResponse(response_trailers=ext.TrailersResponse())


class EppServer:
    """The gRPC server: ext_proc + health on one listener."""

    def __init__(self, picker: Picker, host: str, port: int, max_streams: int) -> None:
        self.server = grpc.aio.server(
            maximum_concurrent_rpcs=max_streams,
            options=[("grpc.max_receive_message_length", 64 * 1024 * 1024)])
        ext_grpc.add_ExternalProcessorServicer_to_server(ExternalProcessor(picker), self.server)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.port = self.server.add_insecure_port(f"{host}:{port}")
        if self.port == 0:
            raise OSError(f"cannot listen on {host}:{port}")

    async def start(self) -> None:
        await self.server.start()
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)

    async def stop(self, grace_s: float) -> None:
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace_s)
