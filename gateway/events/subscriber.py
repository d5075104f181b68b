"""One replica's KV-event feed: a ZMQ SUB socket applied to the token-mode index, with
catch-up from the replica's replay socket. I/O only; decisions are in source.py.

On connecting, the subscriber asks the replay socket (a ROUTER: send `[b"", start_seq]`,
receive `[b"", topic, seq, payload]` until the end-of-replay marker) for everything it
still buffers, so blocks cached before the gateway subscribed are known; on the first live
batch when that gave nothing, and on every sequence gap, it asks for everything from the
next expected sequence number, applies it, then skips the live batches the replay already
covered. A sequence that goes backwards
past those (source.classify) means the publisher restarted: the replica's cache is empty, so
the index is cleared before catching up from 0. A gap the replay cannot fill (no replay
socket, the replica's buffer moved on, a timeout) also clears the index, since the missed
batches may have removed blocks: better to predict nothing than blocks that are gone.

`pyzmq` is imported lazily (the `kv` extra).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gateway.events.decode import END_SEQ, EventBatch, EventDecodeError, decode_message
from gateway.events.kvindex import KVIndex
from gateway.events.source import EventSource, classify
from gateway.tasks import FailureLog

log = logging.getLogger("gateway.events")

MAX_REPLAY_BATCHES = 200_000


@dataclass(slots=True)
class FeedStats:
    batches: int = 0
    gaps: int = 0
    replayed: int = 0
    lost: int = 0  # gaps the replay could not fill
    restarts: int = 0
    decode_errors: int = 0
    last_seq: int | None = None


class KVSubscriber:
    def __init__(self, replica: str, source: EventSource, index: KVIndex, ctx: Any,
                 clock: Callable[[], float], replay_timeout_s: float = 2.0, *,
                 on_restart: Callable[[str, float], None] | None = None) -> None:
        self.replica = replica
        # told (replica, now) when the publisher restarted: a new engine process, whose
        # cache is empty (the router forgets what it held, session bindings included)
        self._on_restart = on_restart
        self.source = source
        self.stats = FeedStats()
        self._index = index
        self._ctx = ctx  # a zmq.asyncio.Context
        self._clock = clock
        self._decode_log = FailureLog(log)  # the rate limit of the undecodable-batch line
        self._replay_timeout = replay_timeout_s

    async def run(self) -> None:
        """Until cancelled."""
        import zmq

        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, self.source.topic.encode())
        sub.connect(self.source.endpoint)
        self._index.set_connected(self.replica, True, self._clock())
        expected: int | None = None
        floor = 0
        try:
            # What the replica cached before this subscription (its replay buffer), so a
            # gateway that starts, or reconnects, after the traffic knows it at once.
            got = await self._replay(0)
            for batch in got:
                self._apply(batch)
            self.stats.replayed += len(got)
            if got:
                expected, floor = got[-1].seq + 1, got[0].seq
            while True:
                frames = await sub.recv_multipart()
                try:
                    batch = decode_message(frames)
                except EventDecodeError as exc:
                    self.stats.decode_errors += 1
                    self._undecodable(exc)
                    continue
                action = classify(expected, batch.seq, floor)
                if action == "duplicate":
                    continue
                if action != "apply":
                    if action == "restart":
                        self.stats.restarts += 1
                        self._index.clear(self.replica, self.source.endpoint)
                        log.warning("replica %s: KV event sequence restarted (%s after %s)",
                                    self.replica, batch.seq, expected)
                        if self._on_restart is not None:
                            self._on_restart(self.replica, self._clock())
                        expected = None
                    expected = await self._catch_up(expected, batch.seq)
                    floor = batch.seq + 1  # live batches after this one may repeat
                    if batch.seq < expected:
                        continue  # the replay covered it
                self._apply(batch)
                expected = batch.seq + 1
                if action == "apply":
                    floor = expected
        finally:
            self._index.set_connected(self.replica, False, self._clock())
            sub.close(0)

    def _undecodable(self, exc: EventDecodeError) -> None:
        """Said at once, then at most once a minute with a count: a replica sending garbage
        as fast as it can must not flood the log (every batch is counted in `stats`)."""
        skipped = self._decode_log.due("undecodable")
        if skipped is not None:
            log.warning("replica %s: undecodable KV event batch: %s (%d more since the "
                        "last line)", self.replica, exc, skipped)

    def _apply(self, batch: EventBatch) -> None:
        self.stats.batches += 1
        self.stats.last_seq = batch.seq
        self._index.apply(self.replica, batch.events, self._clock(), self.source.endpoint)

    async def _catch_up(self, expected: int | None, seq: int) -> int:
        """Replay from `expected` (0 when nothing was seen); returns the next sequence
        number to apply from the live stream."""
        start = 0 if expected is None else expected
        if expected is not None:
            self.stats.gaps += 1
        got = await self._replay(start)
        if expected is not None and seq > start and not (got and got[0].seq <= start):
            # Batches from `start` on are gone: whatever they removed is still indexed.
            self.stats.lost += 1
            self._index.clear(self.replica, self.source.endpoint)
            log.warning("replica %s: KV events from %s lost, index cleared", self.replica,
                        start)
        for batch in got:
            self._apply(batch)
        self.stats.replayed += len(got)
        return got[-1].seq + 1 if got else seq

    async def _replay(self, start: int) -> list[EventBatch]:
        if self.source.replay_endpoint is None:
            return []
        import zmq

        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.source.replay_endpoint)
        out: list[EventBatch] = []
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._replay_timeout
        try:
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            while len(out) < MAX_REPLAY_BATCHES:
                left = deadline - loop.time()
                if left <= 0 or not await dealer.poll(int(left * 1000) + 1):
                    log.warning("replica %s: KV event replay timed out after %d batches",
                                self.replica, len(out))
                    break
                frames = await dealer.recv_multipart()
                if frames and frames[0] == b"":
                    frames = frames[1:]
                if len(frames) == 3 and frames[1] == END_SEQ:
                    break
                try:
                    batch = decode_message(frames)
                except EventDecodeError as exc:
                    self.stats.decode_errors += 1
                    self._undecodable(exc)
                    continue
                if batch.seq >= start:
                    out.append(batch)
        finally:
            dealer.close(0)
        return out
