"""Where usage records go: JSON lines to a file or stdout, entries on a Redis stream.

Each sink sits behind a `SinkPump`: the request path calls `offer(line)` (a deque append,
never an await, never a raise); one task per sink takes up to `batch_size` lines at a time
and awaits the sink's `write`. File and stdout writes run in a worker thread
(`asyncio.to_thread`) so a slow disk never stalls the event loop; Redis is natively
async. The buffer is bounded (`capacity`): when a sink cannot keep up, new records are
dropped and counted (`gateway_usage_records_dropped_total{sink}`) instead of growing
memory or blocking requests.

Failures: a sink translates its library's errors into `SinkError` (or lets `OSError`
through); the pump counts them (`gateway_usage_sink_errors_total{sink}`), drops that
batch (counted), logs at most once per `LOG_EVERY_S` per sink, and pauses before the next
attempt so a dead Redis is not hammered: `retry_s`, doubling with each failure in a row up
to `RETRY_CAP_S` (less up to a fifth, drawn at random), back to `retry_s` after a write
succeeds (gateway/backoff.py). Redis reconnects by itself on
the next command (the client's pool opens a new connection). Nothing reaches the caller.

The Redis sink lives in `gateway.usage.redis_sink` (the `redis` package is an extra).

`aclose` stops taking records, writes what is buffered (bounded by a timeout) and closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import time
from collections import deque
from collections.abc import Sequence
from typing import IO, Final, Protocol

from gateway.backoff import Backoff, Retrier
from gateway.tasks import FailureLog, supervised
from gateway.usage.metrics import GatewayMetrics

log = logging.getLogger("gateway.usage")

LOG_EVERY_S: Final = 60.0
RETRY_CAP_S: Final = 10.0  # the longest pause between failed writes


class SinkError(Exception):
    """A sink could not write a batch."""


class Sink(Protocol):
    name: str

    async def write(self, lines: Sequence[bytes]) -> None: ...

    async def aclose(self) -> None: ...


class FileSink:
    """Appends JSON lines to `path` (opened on first write, reopened after an error)."""

    name = "file"

    def __init__(self, path: str) -> None:
        self._path = path
        self._fh: IO[bytes] | None = None

    def _write_sync(self, data: bytes) -> None:
        try:
            if self._fh is None:
                self._fh = open(self._path, "ab")  # noqa: SIM115 - kept open across batches
            self._fh.write(data)
            self._fh.flush()
        except OSError:
            self._close_sync()
            raise

    def _close_sync(self) -> None:
        fh, self._fh = self._fh, None
        if fh is not None:
            with contextlib.suppress(OSError):
                fh.close()

    async def write(self, lines: Sequence[bytes]) -> None:
        await asyncio.to_thread(self._write_sync, b"".join(lines))

    async def aclose(self) -> None:
        await asyncio.to_thread(self._close_sync)


class StdoutSink:
    """JSON lines on a text or binary stream (stdout by default)."""

    name = "stdout"

    def __init__(self, stream: IO[str] | None = None) -> None:
        self._stream = stream

    def _write_sync(self, data: bytes) -> None:
        stream = self._stream if self._stream is not None else sys.stdout
        buffer = getattr(stream, "buffer", None)
        if buffer is not None:
            buffer.write(data)
            buffer.flush()
        else:
            stream.write(data.decode())
            stream.flush()

    async def write(self, lines: Sequence[bytes]) -> None:
        await asyncio.to_thread(self._write_sync, b"".join(lines))

    async def aclose(self) -> None:
        return None


class SinkPump:
    """Bounded buffer plus one draining task in front of one sink."""

    def __init__(
        self,
        sink: Sink,
        metrics: GatewayMetrics,
        *,
        capacity: int = 10_000,
        batch_size: int = 512,
        retry_s: float = 1.0,
        retrier: Retrier | None = None,  # tests pass one with a recording sleep
    ) -> None:
        self.sink = sink
        self._metrics = metrics
        self._capacity = capacity
        self._batch_size = batch_size
        self._retrier = retrier or Retrier(
            Backoff(base_s=retry_s, cap_s=max(retry_s, RETRY_CAP_S), jitter=0.2))
        self._buf: deque[bytes] = deque()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self._last_log = -LOG_EVERY_S
        self._unlogged = 0
        self.written = 0
        self.dropped = 0
        self.errors = 0

    @property
    def queued(self) -> int:
        return len(self._buf)

    def offer(self, line: bytes) -> None:
        if self._closing or len(self._buf) >= self._capacity:
            self.dropped += 1
            self._metrics.records_dropped(self.sink.name, 1)
            return
        self._buf.append(line)
        if not self._wake.is_set():
            self._wake.set()

    def start(self) -> None:
        if self._task is None:
            # An error other than the sink's own (handled in _run) ends one run, logged;
            # the pump starts again (gateway/tasks.py).
            self._task = asyncio.create_task(
                supervised(f"usage sink {self.sink.name}", self._run, FailureLog(log)),
                name=f"usage-sink-{self.sink.name}")

    async def _run(self) -> None:
        buf = self._buf
        while True:
            if not buf:
                if self._closing:
                    return
                self._wake.clear()
                await self._wake.wait()
                continue
            batch = [buf.popleft() for _ in range(min(len(buf), self._batch_size))]
            try:
                await self.sink.write(batch)
            except (OSError, SinkError) as e:
                self._failed(len(batch), e)
                if not self._closing:
                    await self._retrier.wait()
            else:
                self.written += len(batch)
                self._retrier.reset()

    def _failed(self, lost: int, error: BaseException) -> None:
        self.errors += 1
        self.dropped += lost
        self._metrics.sink_error(self.sink.name)
        self._metrics.records_dropped(self.sink.name, lost)
        now = time.monotonic()
        if now - self._last_log >= LOG_EVERY_S:
            log.warning(
                "usage sink %s failed (%s); %d records lost (%d earlier failures not logged)",
                self.sink.name, error, lost, self._unlogged,
            )  # fmt: skip
            self._last_log = now
            self._unlogged = 0
        else:
            self._unlogged += 1

    async def aclose(self, timeout_s: float = 5.0) -> None:
        self._closing = True
        self._wake.set()
        task, self._task = self._task, None
        if task is None:
            # Never started (no event loop at the time): write what is buffered once.
            task = asyncio.create_task(self._run())
        try:
            await asyncio.wait_for(task, timeout_s)
        except TimeoutError:
            lost = len(self._buf)
            self._buf.clear()
            if lost:
                self.dropped += lost
                self._metrics.records_dropped(self.sink.name, lost)
        await self.sink.aclose()
