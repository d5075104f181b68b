"""The KV block pool of one engine: ref counts, prefix-cache map and LRU free queue.

Mirrors vLLM V1's ``BlockPool`` / ``FreeKVCacheBlockQueue``:
- ``num_blocks`` physical blocks; block 0 is the reserved null block and never handed out.
- Free queue ordered head -> tail; new blocks are popped from the head. A popped block that
  still carries a hash is evicted at that moment (removed from the map). Nothing is evicted
  proactively.
- A prefix hit "touches" blocks: ref_cnt += 1 and, if it sat in the free queue, it is taken
  out so it cannot be evicted.
- Freed blocks (ref_cnt reaching 0) are appended at the tail, keep their hash and stay
  hittable. Callers free a request's blocks in reverse order so chain tails go first.
- The same hash may be held by several physical blocks; a lookup returns the first copy.
- usage = 1 - free / (num_blocks - 1): cached-but-unreferenced blocks count as free.

The free queue is an ``OrderedDict`` keyed by block id: O(1) pop-head, append-tail and
unlink-from-middle, which is all a doubly-linked list gives vLLM.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gateway.sim.kvevents import EventQueue


class KVBlock:
    __slots__ = ("block_hash", "block_id", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: int | None = None


class BlockPool:
    def __init__(self, num_blocks: int, events: EventQueue | None = None) -> None:
        if num_blocks < 2:
            raise ValueError("a KV pool needs at least 2 blocks (one is the null block)")
        self.num_blocks = num_blocks
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.null_block.ref_cnt = 1
        self._free: OrderedDict[int, KVBlock] = OrderedDict(
            (b.block_id, b) for b in self.blocks[1:]
        )
        self._cached: dict[int, dict[int, KVBlock]] = {}
        self.evictions = 0
        self.events = events  # KV-cache events, when the engine publishes them

    @property
    def num_free(self) -> int:
        return len(self._free)

    def usage(self) -> float:
        return 1.0 - len(self._free) / (self.num_blocks - 1)

    def free_order(self) -> list[int]:
        """Block ids in eviction order (head first); for tests and debugging."""
        return list(self._free)

    def lookup(self, block_hash: int) -> KVBlock | None:
        copies = self._cached.get(block_hash)
        if not copies:
            return None
        return next(iter(copies.values()))

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        free = self._free
        for b in blocks:
            if b.ref_cnt == 0:
                del free[b.block_id]
            b.ref_cnt += 1

    def allocate(self, n: int) -> list[KVBlock]:
        if n > len(self._free):
            raise ValueError(f"cannot allocate {n} blocks, {len(self._free)} free")
        out: list[KVBlock] = []
        pop = self._free.popitem
        for _ in range(n):
            _, b = pop(last=False)
            if b.block_hash is not None:
                self._evict(b)
            b.ref_cnt = 1
            out.append(b)
        return out

    def cache(self, block: KVBlock, block_hash: int) -> None:
        block.block_hash = block_hash
        copies = self._cached.get(block_hash)
        if copies is None:
            self._cached[block_hash] = {block.block_id: block}
        else:
            copies[block.block_id] = block

    def free(self, blocks_in_eviction_order: Iterable[KVBlock]) -> None:
        free = self._free
        for b in blocks_in_eviction_order:
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                free[b.block_id] = b

    def reset(self) -> bool:
        """Drop every cached hash; refused (False) while any block is in use."""
        if len(self._free) != self.num_blocks - 1:
            return False
        for copies in self._cached.values():
            for b in copies.values():
                b.block_hash = None
        self._cached.clear()
        if self.events is not None:
            self.events.cleared()
        return True

    def _evict(self, b: KVBlock) -> None:
        assert b.block_hash is not None
        copies = self._cached[b.block_hash]
        del copies[b.block_id]
        if not copies:
            del self._cached[b.block_hash]
        if self.events is not None:
            self.events.removed(b.block_hash)
        b.block_hash = None
        self.evictions += 1
