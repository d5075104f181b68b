"""Per replica: the chained block hashes it probably holds in its KV cache.

Each replica has a bounded LRU (`OrderedDict[int, None]`, about 90 bytes per entry with the
hash int shared with the request's hash list, ~130 bytes when it is not) whose capacity is
the replica's KV capacity in tokens converted to index blocks (tokens / tokens-per-block,
with tokens-per-block = block_bytes / bytes-per-token), times a feedback factor that shrinks
when the replica delivers less than the index promised.

Order mirrors vLLM's eviction (free queue, request's blocks freed deepest first): a chain
is recorded deepest block first, so its shallow, shared blocks are the most recent and
eviction removes chain tails before their prefixes. The held set therefore stays closed
under prefixes along a chain, which lets `matched` binary-search the longest leading run
(O(log n) lookups per replica instead of one per block).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from itertools import repeat

from gateway.routing.blocks import held_prefix


class BlockIndex:
    def __init__(self, default_capacity_blocks: int) -> None:
        self._default = max(0, default_capacity_blocks)
        self._held: dict[str, OrderedDict[int, None]] = {}
        self._capacity: dict[str, int] = {}

    # replicas -------------------------------------------------------------------------
    def add_replica(self, replica: str) -> None:
        self._held.setdefault(replica, OrderedDict())
        self._capacity.setdefault(replica, self._default)

    def remove_replica(self, replica: str) -> None:
        self._held.pop(replica, None)
        self._capacity.pop(replica, None)

    def clear(self, replica: str) -> None:
        held = self._held.get(replica)
        if held is not None:
            held.clear()

    def replicas(self) -> list[str]:
        return list(self._held)

    def set_capacity(self, replica: str, blocks: int) -> None:
        self.add_replica(replica)
        self._capacity[replica] = max(0, blocks)
        self._evict(replica)

    def capacity(self, replica: str) -> int:
        return self._capacity.get(replica, self._default)

    def size(self, replica: str) -> int:
        held = self._held.get(replica)
        return len(held) if held is not None else 0

    # lookups and updates ----------------------------------------------------------------
    def matched(self, replica: str, hashes: Sequence[int]) -> int:
        """Number of leading blocks of `hashes` the replica holds (prefix-closed search)."""
        held = self._held.get(replica)
        return held_prefix(held, hashes) if held else 0

    def record(self, replica: str, hashes: Sequence[int], upto: int, held_already: int) -> None:
        """The replica now holds hashes[:upto]; hashes[:held_already] were held before
        (a stale claim, some of them evicted meanwhile, is tolerated).

        New blocks are appended deepest first, then the held ones are refreshed deepest
        first, leaving block 0 the most recently used (see the module docstring).
        """
        held = self._held.get(replica)
        if held is None:
            self.add_replica(replica)
            held = self._held[replica]
        upto = min(upto, len(hashes))
        held_already = max(0, min(held_already, upto))
        refresh = held_already
        if upto > held_already:
            before = len(held)
            held.update(zip(reversed(hashes[held_already:upto]), repeat(None)))
            if len(held) - before != upto - held_already:
                # Some "new" blocks were already there (the index is not perfectly
                # prefix-closed): update() left them in place, so refresh them all.
                refresh = upto
        try:
            deque(map(held.move_to_end, reversed(hashes[:refresh])), maxlen=0)
        except KeyError:
            # The caller's held_already was stale (blocks evicted since it looked): add
            # the whole run, then refresh it, so the order is the same as if it had known.
            held.update(zip(reversed(hashes[:upto]), repeat(None)))
            deque(map(held.move_to_end, reversed(hashes[:upto])), maxlen=0)
        self._evict(replica)

    def drop_from(self, replica: str, hashes: Sequence[int], keep: int) -> int:
        """Forget hashes[keep:] on the replica (it does not hold them); returns how many."""
        held = self._held.get(replica)
        if not held:
            return 0
        before = len(held)
        for h in hashes[max(0, keep) :]:
            held.pop(h, None)
        return before - len(held)

    def shrink_to(self, replica: str, blocks: int) -> None:
        """Evict least recently used entries until at most `blocks` remain."""
        held = self._held.get(replica)
        if held is None:
            return
        for _ in range(len(held) - max(0, blocks)):
            held.popitem(last=False)

    def _evict(self, replica: str) -> None:
        self.shrink_to(replica, self._capacity.get(replica, self._default))
