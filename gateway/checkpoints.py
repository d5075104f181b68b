"""Work done on a byte stream, resumed from the longest prefix seen before. Pure.

A conversation's next request repeats its previous request and adds a turn. Hashing (text
mode) or tokenizing (token mode) the whole prompt again costs time in proportion to the
conversation; what is new is only the last turn. The stream is cut at fixed `stride`
bytes; a chained key names every whole-stride prefix (`xxh3(chunk_j, seed=key_{j-1})`,
starting from the caller's seed), a few C calls for a whole 128 KiB prompt. After doing
its work, the caller stores its state at each checkpoint; the next request finds the
longest checkpoint whose key it shares and does only the work after it.

A key names its prefix exactly as a chained block hash names its block (any earlier byte
changes it), under the same 64-bit collision assumption that prefix routing and vLLM's own
block keys make.

Bounds: states are kept in LRU order up to `max_entries`, and the values they reference are
counted by `size` (a caller-given measure: hashes) up to `budget`: the checkpoints of one
run share its list, so a list is counted once, while any state still points at it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import xxhash

_xxh3 = xxhash.xxh3_64_intdigest

S = TypeVar("S")


@dataclass(slots=True, eq=False)
class Run:
    """A line of work the states share: the hashes of the longest prompt along it, and how
    many checkpoints (strides) it reaches. A request that resumes at a run's last
    checkpoint extends the run in place (its new list repeats the old one up to there), so
    a conversation grown turn by turn keeps one list alive, not one per turn; a request
    that resumes earlier (a fork, a retry) starts a run of its own."""

    hashes: list[int]
    reach: int = 0


class Checkpoints(Generic[S]):
    def __init__(self, stride: int, budget: int, max_entries: int = 65536) -> None:
        if stride <= 0 or budget <= 0:
            raise ValueError("stride and budget must be positive")
        self.stride = stride
        self.budget = budget
        self._max = max(1, max_entries)
        # key -> (state, owner id); owner id -> [refs, size]
        self._states: OrderedDict[int, tuple[S, int]] = OrderedDict()
        self._owners: dict[int, list[int]] = {}
        self._owned: dict[int, object] = {}  # keeps an owner alive (its id stays unique)
        self.held = 0  # sum of the sizes of the owners any state references

    def keys(self, data: bytes, seed: int) -> list[int]:
        """The key of every whole-stride prefix of `data` (key j-1 names data[: j*stride])."""
        view = memoryview(data)
        stride = self.stride
        out: list[int] = []
        key = seed
        for start in range(0, len(data) - stride + 1, stride):
            key = _xxh3(view[start : start + stride], key)
            out.append(key)
        return out

    def find(self, keys: Sequence[int]) -> tuple[int, S | None]:
        """(j, state) for the longest stored prefix data[: j*stride]; (0, None) if none."""
        states = self._states
        for j in range(len(keys), 0, -1):
            got = states.get(keys[j - 1])
            if got is not None:
                states.move_to_end(keys[j - 1])
                return j, got[0]
        return 0, None

    def put(self, key: int, state: S, owner: object, size: int) -> None:
        """Store `state` at checkpoint `key`; `owner` is what it references (counted once
        by `size` however many states share it)."""
        states = self._states
        oid = id(owner)
        old = states.pop(key, None)
        if old is not None:
            self._release(old[1])
        entry = self._owners.get(oid)
        if entry is None:
            self._owners[oid] = [1, size]
            self._owned[oid] = owner
            self.held += size
        else:
            entry[0] += 1
        states[key] = (state, oid)
        while len(states) > 1 and (len(states) > self._max or self.held > self.budget):
            _, (_, gone) = states.popitem(last=False)
            self._release(gone)

    def resize(self, owner: object, size: int) -> None:
        """`owner` (referenced by some states) now measures `size`."""
        entry = self._owners.get(id(owner))
        if entry is not None:
            self.held += size - entry[1]
            entry[1] = size

    def _release(self, oid: int) -> None:
        entry = self._owners[oid]
        entry[0] -= 1
        if entry[0] == 0:
            del self._owners[oid]
            del self._owned[oid]
            self.held -= entry[1]

    def __len__(self) -> int:
        return len(self._states)
