"""The ext_proc gRPC service (grpc.aio) and its lifecycle: one bidirectional stream per
request through the data plane, each message answered as `gateway.epp.stream.Stream` says
(in whichever processing mode the data plane runs: `gateway.epp.modes`); gRPC health
(`grpc.health.v1`) on the same listener, SERVING for "" and the ext_proc service name
while started.

The stream ending earlier (client gone, EPP-side error, headers-only reading) ends the
record there (`Picker.finish(cut=True)`), so every request is recorded once and its
in-flight count released. A request the admission queue holds keeps its stream waiting
in `Stream.on`; the stream's end cancels that wait (grpc.aio cancels the handler), which
takes it out of the queue at once (the gate's cancel path).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from gateway.epp.picker import Picker
from gateway.epp.stream import Stream

log = logging.getLogger("gateway.epp.server")

SERVICE_NAME = "envoy.service.ext_proc.v3.ExternalProcessor"


class ExternalProcessor:
    """`envoy.service.ext_proc.v3.ExternalProcessor` (registered by its generated helper)."""

    def __init__(self, picker: Picker) -> None:
        self.picker = picker
        # a gathered request body: `[server] max_body_bytes`, as `gateway serve` reads
        self.max_body = picker.s.settings.server.max_body_bytes
        # a JSON answer read in pieces (full duplex): as large as a request may be
        self.max_answer = self.max_body

    async def Process(
        self, request_iterator: AsyncIterator[ext.ProcessingRequest],
        context: grpc.aio.ServicerContext[ext.ProcessingRequest, ext.ProcessingResponse],
    ) -> AsyncIterator[ext.ProcessingResponse]:
        stream = Stream(self.picker, self.max_body, self.max_answer)
        try:
            async for request in request_iterator:
                for out in await stream.on(request):
                    yield out
                if stream.closed:
                    return
        finally:
            stream.close()


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
