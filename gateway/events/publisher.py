"""A vLLM-compatible KV-event publisher: PUB socket plus a ROUTER replay socket over a
bounded buffer of past batches, the wire format of vLLM's `ZmqEventPublisher`. The
simulator publishes through it and tests use it as a stand-in replica.

Batches are `[ts, [event, ...], dp_rank]`; `encoding="map"` writes events as tagged maps
(vLLM 0.11+), `"array"` as tagged positional arrays (earlier versions). `publish` is
synchronous and non-blocking (PUB drops for slow subscribers, as vLLM's does); `serve_replay`
answers replay requests until cancelled. `pyzmq` is imported lazily (the `kv` extra).
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Sequence
from typing import Any, Literal

from gateway.events.decode import (
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
)

Encoding = Literal["map", "array"]


def encode_event(event: Event, encoding: Encoding) -> object:
    if isinstance(event, BlockStored):
        if encoding == "array":
            return ["BlockStored", list(event.block_hashes), event.parent_block_hash,
                    list(event.token_ids), event.block_size, None, event.medium]
        return {"type": "BlockStored", "block_hashes": list(event.block_hashes),
                "parent_block_hash": event.parent_block_hash, "token_ids": list(event.token_ids),
                "block_size": event.block_size, "lora_id": None, "medium": event.medium,
                "lora_name": event.lora_name,
                "extra_keys": ([list(k) if k is not None else None for k in event.extra_keys]
                               if event.extra_keys is not None else None),
                "group_idx": 0, "kv_cache_spec_kind": "full_attention"}
    if isinstance(event, BlockRemoved):
        if encoding == "array":
            return ["BlockRemoved", list(event.block_hashes), event.medium]
        return {"type": "BlockRemoved", "block_hashes": list(event.block_hashes),
                "medium": event.medium, "group_idx": 0}
    assert isinstance(event, AllBlocksCleared)
    return ["AllBlocksCleared"] if encoding == "array" else {"type": "AllBlocksCleared"}


def encode_batch(ts: float, events: Sequence[Event], encoding: Encoding,
                 dp_rank: int | None = 0) -> bytes:
    import msgpack

    out: bytes = msgpack.packb([ts, [encode_event(e, encoding) for e in events], dp_rank])
    return out


class KVPublisher:
    def __init__(self, ctx: Any, endpoint: str, replay_endpoint: str | None, *,
                 topic: str = "kv", encoding: Encoding = "map", buffer: int = 10000) -> None:
        import zmq

        self.topic = topic.encode()
        self.encoding: Encoding = encoding
        self._pub = ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.bind(endpoint)
        self._replay = None
        if replay_endpoint is not None:
            self._replay = ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(replay_endpoint)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=max(1, buffer))
        self._seq = 0

    @property
    def next_seq(self) -> int:
        return self._seq

    def publish(self, ts: float, events: Sequence[Event]) -> int:
        import zmq

        seq = self._seq
        self._seq += 1
        payload = encode_batch(ts, events, self.encoding)
        self._buffer.append((seq, payload))
        # No room at a slow subscriber: it catches up from the replay buffer.
        with contextlib.suppress(zmq.Again):
            self._pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload),
                                     flags=zmq.NOBLOCK)
        return seq

    async def serve_replay(self) -> None:
        if self._replay is None:
            return
        while True:
            frames = await self._replay.recv_multipart()
            if len(frames) != 3:
                continue
            client, _, start_bytes = frames
            start = int.from_bytes(start_bytes, "big")
            for seq, payload in list(self._buffer):
                if seq >= start:
                    await self._replay.send_multipart(
                        (client, b"", self.topic, seq.to_bytes(8, "big"), payload))
            await self._replay.send_multipart((client, b"", b"", END_SEQ, b""))

    def close(self) -> None:
        self._pub.close(0)
        if self._replay is not None:
            self._replay.close(0)
