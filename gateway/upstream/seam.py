"""The seam between the gateway and its replicas: one `send()` that returns a response whose
body can be read whole or relayed chunk by chunk, and closed early.

The production transport is `gateway.proxy.client.AiohttpUpstream` (aiohttp's pooled
keep-alive client). The app builds two: one for client traffic and a small one for health
probes, so client load can never starve a probe of a connection. Bytes are relayed exactly
as the engine wrote them (no Accept-Encoding, no decompression).

Every transport failure surfaces as one of `gateway.upstream.errors.Upstream*`, each naming
what the replica can have seen (`gateway.upstream.failure` says what each allows): before the
request was written, `UpstreamConnectError` (not delivered) or `UpstreamPoolBusy` (no free
connection in time: the gateway's own congestion); after it, `UpstreamTimeout` or
`UpstreamProtocolError` (delivered, no usable answer). Tests inject any object with the same
shape (`tests.upstream_double.MockUpstream`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Collection, Sequence
from dataclasses import dataclass
from typing import Protocol

RawHeaders = Sequence[tuple[bytes, bytes]]


@dataclass(frozen=True, slots=True)
class Timeouts:
    connect_s: float
    read_s: float  # longest wait for the next bytes (or total, for probes: see `total`)
    total_s: float | None = None


class UpstreamResponse(Protocol):
    status: int
    headers: RawHeaders  # raw (name, value) pairs as received

    async def read(self) -> bytes: ...

    def chunks(self) -> AsyncIterator[bytes]: ...

    # Optional: `at_eof() -> bool`, True when the body has ended and was read whole, so the
    # relay can send the last bytes together with the end of the body (gateway.proxy.relay).

    def release(self) -> None:
        """Body fully consumed: give the connection back to the pool."""

    def abort(self) -> None:
        """Stop now: close the connection so the engine sees the client go and frees KV."""


class Upstream(Protocol):
    async def send(
        self, method: str, url: str, headers: Sequence[tuple[str, str]], body: bytes | None,
        timeouts: Timeouts,
    ) -> UpstreamResponse: ...

    def retain_origins(self, live: Collection[str]) -> None:
        """A replica left the fleet: drop what is kept per origin (`scheme://host:port`)
        for every origin not in `live`."""

    async def aclose(self) -> None: ...
