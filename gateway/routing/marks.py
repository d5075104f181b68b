"""The deepest marked block of a chain, found without testing every block. Pure.

Conversations mark the last block of each recent prompt (their tips) and the estimator
the last block of each completed prompt (its anchors); a request asks for the deepest of
those marks its chain contains. Tested block by block from the end, a request that
contains none (a new conversation under a long shared system prompt) or whose newest mark
lies far back (a long new tail) costs one dict lookup per block: 1,000 at 64 KiB, about
40 µs of a request that costs 400.

So a mark past the chain's *head* (its first `HEAD_WINDOWS` windows of `stride` blocks)
also counts at its *gate*: the hash of the block just before its window (window w holds
blocks [w*stride, (w+1)*stride)). Because a block's hash names its whole prefix, a chain
holds a mark of window w only if it holds that mark's gate at block w*stride - 1: the
search tests one gate per window from the deepest down to the head (a C slice and
filter), looks inside a window only when its gate is counted, and looks at the head block
by block last. A request costs about blocks / stride lookups, one window per gate it
shares with a mark (one, usually) and the head's blocks. The answer is the block-by-block
scan's (the property tests hold it to that); a gate that a chain shares with another
chain's mark (the same prefix, another continuation) costs a window's look and nothing
else.

The head keeps short prompts as cheap as they were: a chain no longer than the head is
scanned block by block (below about 4 windows, 64 blocks or 4 KiB at the default block
size, that costs less than the gates: 0.7 against 1.3 µs at 32 blocks, 1.1 against 1.3 at
64, 2.3 against 1.4 at 128), and a mark in the head is written nowhere here (at 2 KiB,
counting every tip and anchor at a gate cost the request about 9 µs of its 190).

Marks may be scoped (XOR-ed with a tenant's key, as conversations store their tips): a
mark's gate is scoped the same way, and the search XORs the chain with the scope.

Bounds: one entry per mark past the head (its gate) and at most one per gate: the owner
bounds its marks.
"""

from __future__ import annotations

from collections.abc import Container, Sequence
from itertools import compress

HEAD_WINDOWS = 4
_ABSENT = -1  # not a mark past the head (gates are 64-bit hashes: never negative)


class Gates:
    def __init__(self, stride: int = 16) -> None:
        if stride < 1:
            raise ValueError("stride must be positive")
        self.stride = stride
        self.head = HEAD_WINDOWS * stride  # blocks always scanned one by one
        # mark past the head -> its gate (read-only outside: an owner tests it for any)
        self.gate_of: dict[int, int] = {}
        self._count: dict[int, int] = {}  # gate -> marks in its window

    def __len__(self) -> int:
        return len(self.gate_of)

    def add(self, mark: int, hashes: Sequence[int], at: int, scope: int = 0) -> None:
        """`mark` (hashes[at] ^ scope) is now a mark; one in the head, or already
        counted, is not counted (again: its position, so its gate, is the same, since the
        hash names its prefix)."""
        if at < self.head or mark in self.gate_of:
            return
        stride = self.stride
        gate = hashes[at // stride * stride - 1] ^ scope
        self.gate_of[mark] = gate
        self._count[gate] = self._count.get(gate, 0) + 1

    def remove(self, mark: int) -> None:
        """`mark` is no longer one (a mark never counted is ignored)."""
        gate = self.gate_of.pop(mark, _ABSENT)
        if gate == _ABSENT:
            return
        left = self._count[gate] - 1
        if left:
            self._count[gate] = left
        else:
            del self._count[gate]

    def deepest(self, hashes: Sequence[int], upto: int, marks: Container[int],
                scope: int = 0) -> int:
        """j such that hashes[j - 1] ^ scope is the deepest of hashes[:upto] in `marks`
        (which must hold exactly the marks added here and not removed); 0 when none."""
        upto = min(upto, len(hashes))
        if upto <= 0:
            return 0
        stride, count, head = self.stride, self._count, self.head
        if upto <= head:
            if scope or upto < len(hashes):
                return _scan(hashes, 0, upto, marks, scope)
            # the whole of a short chain, unscoped (most requests): no copy to scan
            found = next(filter(marks.__contains__, reversed(hashes)), None)
            return 0 if found is None else upto - hashes[::-1].index(found)
        if count:
            top = (upto - 1) // stride  # the deepest window holding a block below upto
            # the gates of windows top, top - 1, .., HEAD_WINDOWS (window w's: block
            # w*stride - 1, so down to block head - 1)
            gates = hashes[top * stride - 1 : head - 2 : -stride]
            if scope:
                gates = [g ^ scope for g in gates]
            for k in compress(range(len(gates)), map(count.__contains__, gates)):
                w = top - k
                j = _scan(hashes, w * stride, min(upto, (w + 1) * stride), marks, scope)
                if j:
                    return j
        return _scan(hashes, 0, head, marks, scope)


def _scan(hashes: Sequence[int], lo: int, hi: int, marks: Container[int], scope: int) -> int:
    """j for the deepest of hashes[lo:hi] (scoped) in `marks`, 0 when none (a C filter)."""
    window = hashes[lo:hi]
    if scope:
        window = [h ^ scope for h in window]
    found = next(filter(marks.__contains__, reversed(window)), None)
    if found is None:
        return 0
    return lo + len(window) - window[::-1].index(found)
