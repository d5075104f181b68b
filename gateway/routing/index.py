"""Per replica: the chained block hashes it probably holds in its KV cache.

Each replica has a bounded set of blocks whose capacity is the replica's KV capacity in
tokens converted to index blocks (tokens / tokens-per-block, with tokens-per-block =
block_bytes / bytes-per-token), times a feedback factor that shrinks when the replica
delivers less than the index promised.

Eviction mirrors vLLM's (least recently used first; a request's blocks freed deepest
first): a block's recency is the last time a request used it, and among the blocks of one
request the deeper goes first. So chain tails go before their prefixes, the held set stays
closed under prefixes along a chain, and `matched` binary-searches the longest leading run
(O(log n) lookups per replica instead of one per block).

Cost follows what is new in a request: a request that uses blocks 0..n-1 stamps only its
deepest block (a block's recency is the newest stamp in the subtree of chains below it),
so recording a conversation's next turn costs its new blocks, not its whole prompt. The
blocks form a forest (each block's parent is the block before it in its chain); eviction
takes the leaf with the oldest stamp from a heap and hands that stamp up to its parent,
which becomes a leaf once its last child is gone. The order is the one an LRU list that
moved a request's whole chain to the front (deepest first) would give, without moving it.

Memory per block: an entry in `parent` and, for a block with children, one in `kids`
(the hash ints are shared with the requests' hash lists while those live); stamps and
heap entries only for leaves and touched blocks (the heap is rebuilt when stale entries
outnumber the blocks).
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter
from collections.abc import Sequence

from gateway.routing.blocks import held_prefix


class _Held:
    """One replica's blocks: parent links, child counts, stamps, the eviction heap."""

    __slots__ = ("heap", "kids", "parent", "stamp")

    def __init__(self) -> None:
        self.parent: dict[int, int | None] = {}  # block -> the block before it (None: first)
        self.kids: dict[int, int] = {}  # block -> held children (absent: a leaf)
        self.stamp: dict[int, int] = {}  # block -> newest use known at it (leaves, touched)
        self.heap: list[tuple[int, int]] = []  # (stamp, leaf); stale entries skipped


class BlockIndex:
    def __init__(self, default_capacity_blocks: int) -> None:
        self._default = max(0, default_capacity_blocks)
        self._held: dict[str, _Held] = {}
        self._capacity: dict[str, int] = {}
        self._clock = itertools.count(1)

    # replicas -------------------------------------------------------------------------
    def add_replica(self, replica: str) -> None:
        self._held.setdefault(replica, _Held())
        self._capacity.setdefault(replica, self._default)

    def remove_replica(self, replica: str) -> None:
        self._held.pop(replica, None)
        self._capacity.pop(replica, None)

    def clear(self, replica: str) -> None:
        if replica in self._held:
            self._held[replica] = _Held()

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
        return len(held.parent) if held is not None else 0

    # lookups and updates ----------------------------------------------------------------
    def matched(self, replica: str, hashes: Sequence[int]) -> int:
        """Number of leading blocks of `hashes` the replica holds (prefix-closed search)."""
        held = self._held.get(replica)
        return held_prefix(held.parent, hashes) if held is not None and held.parent else 0

    def record(self, replica: str, hashes: Sequence[int], upto: int, held_already: int) -> None:
        """The replica now holds hashes[:upto], used just now; hashes[:held_already] were
        held before (a stale claim, some of them evicted meanwhile, is tolerated)."""
        held = self._held.get(replica)
        if held is None:
            self.add_replica(replica)
            held = self._held[replica]
        upto = min(upto, len(hashes))
        held_already = max(0, min(held_already, upto))
        if upto == 0:
            self._evict(replica)
            return
        parent, kids, stamp = held.parent, held.kids, held.stamp
        if held_already and hashes[held_already - 1] not in parent:
            # stale: the claimed run lost its tail since the caller looked
            held_already = held_prefix(parent, hashes[:held_already])
        prev = hashes[held_already - 1] if held_already else None
        fresh: Sequence[int] = hashes[held_already:upto]
        if fresh and parent.keys().isdisjoint(fresh):  # the usual case, linked in C
            parent.update(zip(fresh, itertools.chain((prev,), fresh), strict=False))
            kids.update(zip(fresh[:-1], itertools.repeat(1)))
            if prev is not None:
                kids[prev] = kids.get(prev, 0) + 1
                stamp.pop(prev, None)
            fresh = ()
        added = False
        for h in fresh:
            # (an already held block: the index is not perfectly prefix-closed after a
            # drop; it is linked under this chain again if its parent was just re-added)
            if h not in parent or added or parent[h] != prev:
                new = h not in parent
                parent[h] = prev
                if prev is not None:
                    kids[prev] = kids.get(prev, 0) + 1
                    # this request's stamp, newer than any, now covers prev's subtree
                    stamp.pop(prev, None)
                added = new
            else:
                added = False
            prev = h
        tip = hashes[upto - 1]
        now = next(self._clock)
        stamp[tip] = now
        if tip not in kids:
            heapq.heappush(held.heap, (now, tip))
        self._evict(replica)

    def drop_from(self, replica: str, hashes: Sequence[int], keep: int) -> int:
        """Forget hashes[keep:] on the replica (it does not hold them); returns how many."""
        held = self._held.get(replica)
        if held is None or not held.parent:
            return 0
        before = len(held.parent)
        for h in reversed(hashes[max(0, keep) :]):
            if h in held.parent:
                self._remove(held, h, held.stamp.get(h, 0))
        return before - len(held.parent)

    def shrink_to(self, replica: str, blocks: int) -> None:
        """Evict least recently used blocks until at most `blocks` remain."""
        held = self._held.get(replica)
        if held is None:
            return
        parent, kids, stamp, heap = held.parent, held.kids, held.stamp, held.heap
        limit = max(0, blocks)
        while len(parent) > limit:
            if not held.heap:
                self._rebuild(held)
                kids, heap = held.kids, held.heap
                if not heap:  # no leaf: only a hash cycle does that; take any block
                    self._remove(held, next(iter(parent)), 0)
                    continue
            s, h = heapq.heappop(heap)
            if stamp.get(h) != s or h in kids or h not in parent:
                continue  # stale entry
            # Evict h, then walk up its chain while each parent, now a leaf, is the next
            # oldest anyway (a chain's tail goes block after block): no heap round trip.
            # The heap does not change during the walk; a parent's stamp is written only
            # where the walk stops.
            top = heap[0] if heap else None
            while True:
                p = parent.pop(h)
                stamp.pop(h, None)
                if p is None or p not in parent:
                    break
                own = stamp.get(p)
                sp = s if own is None or own < s else own
                left = kids.get(p, 0) - 1
                if left > 0:
                    kids[p] = left
                    stamp[p] = sp
                    break
                kids.pop(p, None)
                if len(parent) <= limit or (top is not None and (sp, p) > top):
                    stamp[p] = sp
                    heapq.heappush(heap, (sp, p))
                    break
                h, s = p, sp
        if len(held.heap) > 2 * len(parent) + 64:
            self._rebuild(held)

    # internals ----------------------------------------------------------------------------
    def _evict(self, replica: str) -> None:
        self.shrink_to(replica, self._capacity.get(replica, self._default))

    @staticmethod
    def _remove(held: _Held, h: int, s: int) -> None:
        """Forget block h (stamp s): its parent inherits the stamp and, once childless, is
        a leaf that eviction may take."""
        parent, kids, stamp = held.parent, held.kids, held.stamp
        p = parent.pop(h)
        stamp.pop(h, None)
        kids.pop(h, None)  # children left behind (a drop) are simply no longer linked
        if p is None or p not in parent:
            return
        sp = max(stamp.get(p, 0), s)
        stamp[p] = sp
        left = kids.get(p, 0) - 1
        if left > 0:
            kids[p] = left
        else:
            kids.pop(p, None)
            heapq.heappush(held.heap, (sp, p))

    @staticmethod
    def _rebuild(held: _Held) -> None:
        """The child counts from the parent links and the heap from the leaves (drops
        stale entries; repairs counts a drop or a re-link left behind)."""
        parent, stamp = held.parent, held.stamp
        held.kids = kids = dict(Counter(p for p in parent.values() if p in parent))
        held.heap = [(stamp.setdefault(h, 0), h) for h in parent if h not in kids]
        heapq.heapify(held.heap)
