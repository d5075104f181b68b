"""The simulated engine's KV-cache events, as vLLM's block pool emits them. Pure.

vLLM queues `BlockStored` when a request's full blocks enter the prefix cache (one event
per run of new blocks, with the parent's hash and the blocks' token ids), `BlockRemoved`
when a cached block is evicted, and `AllBlocksCleared` on a prefix-cache reset; the engine
core drains the queue once per step and publishes it as one batch. `EventQueue` is that
queue; a publisher (gateway/events/publisher.py) sends what `drain` returns. The salt is
published untagged in block 0's extra keys, like vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence

from gateway.events.decode import AllBlocksCleared, BlockRemoved, BlockStored, Event

_SALT_PREFIX = b"salt\x00"


class EventQueue:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._events: list[Event] = []

    def stored(self, hashes: Sequence[int], parent: int | None, token_ids: Sequence[int],
               first_extra: bytes) -> None:
        extra: tuple[tuple[str, ...] | None, ...] | None = None
        if parent is None and first_extra.startswith(_SALT_PREFIX):
            salt = first_extra[len(_SALT_PREFIX) :].decode("utf-8", "surrogatepass")
            extra = ((salt,), *([None] * (len(hashes) - 1)))
        self._events.append(BlockStored(tuple(hashes), parent, tuple(token_ids),
                                        self.block_size, None, extra, "GPU"))

    def removed(self, block_hash: int) -> None:
        self._events.append(BlockRemoved((block_hash,), "GPU"))

    def cleared(self) -> None:
        self._events.append(AllBlocksCleared())

    def drain(self) -> list[Event]:
        out, self._events = self._events, []
        return out
