"""An in-memory `Upstream` test double (in the spirit of httpx's MockTransport): every request
goes to a handler function that returns a `MockReply` or raises an `UpstreamError`.

The mock records the requests it saw and whether each response was released or aborted,
so tests can check what went upstream and that cancelled streams closed their connection.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass, field

from gateway.proxy.upstream import RawHeaders, Timeouts


@dataclass(frozen=True, slots=True)
class MockRequest:
    method: str
    url: str
    headers: dict[str, str]  # lower-case names
    body: bytes | None


@dataclass(slots=True)
class MockReply:
    status: int = 200
    headers: list[tuple[str, str]] = field(
        default_factory=lambda: [("content-type", "application/json")]
    )
    chunks: list[bytes] = field(default_factory=list)
    chunk_delay_s: float = 0.0  # pause before each chunk (streams the tests can cut)


Handler = Callable[[MockRequest], Awaitable[MockReply]]


class MockResponse:
    def __init__(self, reply: MockReply) -> None:
        self.status = reply.status
        self.headers: RawHeaders = [(k.encode(), v.encode()) for k, v in reply.headers]
        self._reply = reply
        self.released = False
        self.aborted = False

    async def read(self) -> bytes:
        return b"".join([c async for c in self.chunks()])

    async def chunks(self) -> AsyncIterator[bytes]:
        for chunk in self._reply.chunks:
            if self._reply.chunk_delay_s:
                await asyncio.sleep(self._reply.chunk_delay_s)
            yield chunk

    def release(self) -> None:
        self.released = True

    def abort(self) -> None:
        self.aborted = True


class MockUpstream:
    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.requests: list[MockRequest] = []
        self.responses: list[MockResponse] = []
        self.retained: list[frozenset[str]] = []  # live origins told at each departure

    async def send(
        self, method: str, url: str, headers: Sequence[tuple[str, str]], body: bytes | None,
        timeouts: Timeouts,
    ) -> MockResponse:
        request = MockRequest(method, url, {k.lower(): v for k, v in headers}, body)
        self.requests.append(request)
        response = MockResponse(await self.handler(request))
        self.responses.append(response)
        return response

    def retain_origins(self, live: Collection[str]) -> None:
        self.retained.append(frozenset(live))

    async def aclose(self) -> None:
        return None
