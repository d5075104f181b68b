"""Redis stream sink against a real redis-server on loopback (started here), and against
a closed port (failures counted, never raised)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import orjson
from redis.asyncio import Redis
from redis.exceptions import RedisError

from gateway.usage.config import UsageConfig
from gateway.usage.metrics import GatewayMetrics
from gateway.usage.recorder import UsageRecorder
from tests.records import usage_record as rec
from tests.redis_server import needs_redis, redis_server
from tests.servers import free_port


async def _wait(cond: Any, limit_s: float = 5.0) -> None:
    deadline = time.monotonic() + limit_s
    while not await cond():
        if time.monotonic() > deadline:
            raise TimeoutError
        await asyncio.sleep(0.02)


@needs_redis
async def test_redis_stream_sink_round_trip_and_reconnect() -> None:
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    m = GatewayMetrics()
    cfg = UsageConfig(redis_url=url, redis_stream="usage-test", redis_maxlen=1000,
                      sink_retry_s=0.05)  # fmt: skip
    recorder = UsageRecorder(cfg, m)
    client = Redis.from_url(url)

    async def length() -> int:
        return int(await client.xlen("usage-test"))

    try:
        with redis_server(port):
            await recorder.start()
            recorder.record(rec(request_id="zero", cached_tokens=0))
            recorder.record(rec(request_id="null", cached_tokens=None))
            await _wait(lambda: _at_least(length, 2))
            entries = await client.xrange("usage-test")
            objs = [orjson.loads(fields[b"record"]) for _, fields in entries]
            assert [o["request_id"] for o in objs] == ["zero", "null"]
            assert objs[0]["cached_tokens"] == 0
            assert objs[1]["cached_tokens"] is None
            # MAXLEN ~ trims (approximately: whole macro-nodes of 100 entries)
            for i in range(3000):
                recorder.record(rec(request_id=f"bulk{i}"))
            await _wait(lambda: _done(recorder))
            n = await length()
            assert 1000 <= n < 3002
        # redis is gone: records fail, counted, not raised
        recorder.record(rec(request_id="lost"))
        await _wait(lambda: _errors(recorder))
        with redis_server(port):
            # the client reconnects by itself on the next write
            recorder.record(rec(request_id="after-restart"))
            await _wait(lambda: _at_least(length, 1))
            entries = await client.xrange("usage-test")
            assert orjson.loads(entries[-1][1][b"record"])["request_id"] == "after-restart"
            await recorder.aclose()
    finally:
        await recorder.aclose()
        await client.aclose()
    assert recorder.pumps[0].errors >= 1


async def _at_least(length: Any, n: int) -> bool:
    try:
        return bool(await length() >= n)
    except (OSError, RedisError):  # the test's own client meets the restart too
        return False


async def _done(recorder: UsageRecorder) -> bool:
    return recorder.pumps[0].queued == 0


async def _errors(recorder: UsageRecorder) -> bool:
    return recorder.pumps[0].errors > 0


async def test_redis_closed_port_is_counted_not_raised() -> None:
    port = free_port()  # nothing listens there
    m = GatewayMetrics()
    cfg = UsageConfig(redis_url=f"redis://127.0.0.1:{port}/0", sink_retry_s=0.0)
    recorder = UsageRecorder(cfg, m)
    await recorder.start()
    t0 = time.monotonic()
    for i in range(3):
        recorder.record(rec(request_id=str(i)))  # never raises, never blocks
    assert time.monotonic() - t0 < 0.1
    await _wait(lambda: _errors(recorder))
    await recorder.aclose()
    text = m.render().decode()
    assert 'gateway_usage_sink_errors_total{sink="redis"}' in text
    assert recorder.pumps[0].dropped == 3
    assert recorder.stats(1000.0, {})["sinks"]["redis"]["errors"] >= 1
