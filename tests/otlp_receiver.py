"""An OTLP/HTTP trace receiver on loopback (the `opentelemetry-proto` messages decoded, no
SDK mock): POST /v1/traces with an ExportTraceServiceRequest (protobuf), each span kept as
a `Span`. Runs its own event loop in a thread, so a gateway subprocess can export to it.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

MAX_SPANS = 10_000  # a bound on what one test keeps


@dataclass(frozen=True)
class Span:
    trace_id: str
    span_id: str
    parent_span_id: str
    name: str
    kind: int  # opentelemetry.proto.trace.v1.Span.SpanKind: 2 = SERVER
    attributes: dict[str, Any]
    service: str


def _value(v: Any) -> Any:
    which = v.WhichOneof("value")
    if which == "array_value":
        return tuple(_value(x) for x in v.array_value.values)
    return getattr(v, which) if which else None


@dataclass
class Receiver:
    spans: list[Span] = field(default_factory=list)
    port: int = 0
    _cond: threading.Condition = field(default_factory=threading.Condition)

    async def _traces(self, request: web.Request) -> web.Response:
        msg = ExportTraceServiceRequest()
        msg.ParseFromString(await request.read())
        got: list[Span] = []
        for rs in msg.resource_spans:
            res = {a.key: _value(a.value) for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    got.append(Span(s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(),
                                    s.name, s.kind,
                                    {a.key: _value(a.value) for a in s.attributes},
                                    str(res.get("service.name"))))
        with self._cond:
            self.spans.extend(got[:MAX_SPANS - len(self.spans)])
            self._cond.notify_all()
        return web.Response(body=ExportTraceServiceResponse().SerializeToString(),
                            content_type="application/x-protobuf")

    def wait_for(self, pred: Callable[[Span], bool], timeout: float = 20.0) -> Span:
        """The first span `pred` accepts, waiting up to `timeout` seconds for it."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                found = next((s for s in self.spans if pred(s)), None)
                left = deadline - time.monotonic()
                if found is not None or left <= 0:
                    break
                self._cond.wait(left)
        assert found is not None, f"no such span within {timeout}s: {self.spans}"
        return found

    @contextlib.contextmanager
    def serving(self) -> Iterator[Receiver]:
        loop = asyncio.new_event_loop()
        ready = threading.Event()
        stopping: asyncio.Future[None] | None = None

        async def main() -> None:
            nonlocal stopping
            app = web.Application()
            app.router.add_post("/v1/traces", self._traces)
            runner = web.AppRunner(app)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
            stopping = loop.create_future()
            ready.set()
            try:
                await stopping
            finally:
                await runner.cleanup()

        thread = threading.Thread(target=loop.run_until_complete, args=(main(),), daemon=True)
        thread.start()
        assert ready.wait(10), "the OTLP receiver did not start"
        try:
            yield self
        finally:
            assert stopping is not None
            loop.call_soon_threadsafe(stopping.set_result, None)
            thread.join(10)
