"""The Redis stream usage sink: `XADD stream MAXLEN ~ maxlen * record <json>`.

Its own module because the `redis` package is the `redis` extra: only a gateway configured
with `[usage] redis_url` imports it (through `gateway.usage.recorder.sinks_from_config`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from gateway.usage.sinks import SinkError


class RedisStreamSink:
    """`XADD stream MAXLEN ~ maxlen * record <json>` per record, pipelined per batch."""

    name = "redis"

    def __init__(self, url: str, stream: str, maxlen: int, *, timeout_s: float = 2.0) -> None:
        self._stream = stream
        self._maxlen = maxlen
        # One quick retry at most: a failed batch is dropped and counted; the pump's pause
        # is the backoff. Short timeouts keep a dead Redis from holding records for long.
        self._client: Redis = Redis.from_url(
            url,
            socket_connect_timeout=timeout_s,
            socket_timeout=timeout_s,
            retry=Retry(NoBackoff(), 1),
        )

    async def write(self, lines: Sequence[bytes]) -> None:
        try:
            async with self._client.pipeline(transaction=False) as pipe:
                for line in lines:
                    pipe.xadd(
                        self._stream,
                        {"record": line.rstrip(b"\n")},
                        maxlen=self._maxlen,
                        approximate=True,
                    )
                await pipe.execute()
        except (TimeoutError, RedisError, OSError) as e:
            raise SinkError(f"redis: {e}") from e

    async def aclose(self) -> None:
        with contextlib.suppress(RedisError, OSError):
            await self._client.aclose()
