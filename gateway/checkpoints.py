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

Bounds: states are kept in LRU order up to `max_entries`, and the hashes of the runs they
reference up to `budget`: the checkpoints of one run share its list, so a list is counted
once, while any state still points at it.
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
        # key -> (state, owner); owner -> [states referencing it, its size]
        self._states: OrderedDict[int, tuple[S, Run]] = OrderedDict()
        self._owners: dict[Run, list[int]] = {}
        self.held = 0  # sum of the sizes of the runs any state references

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

    def run_for(self, found: Run | None, j: int, hashes: list[int]) -> Run:
        """The run a request's new states belong to: the one it resumed from, extended
        in place, when it resumed at that run's last checkpoint `j`; else a new one."""
        if found is not None and found.reach == j:
            found.hashes = hashes
            entry = self._owners.get(found)
            if entry is not None:
                self.held += len(hashes) - entry[1]
                entry[1] = len(hashes)
            return found
        return Run(hashes)

    def put(self, key: int, state: S, run: Run) -> None:
        """Store `state` at checkpoint `key`; `run` is what it references (its hashes
        counted once however many states share it) and now reaches past `key`."""
        states = self._states
        old = states.pop(key, None)
        if old is not None:
            self._release(old[1])
        entry = self._owners.get(run)
        if entry is None:
            self._owners[run] = [1, len(run.hashes)]
            self.held += len(run.hashes)
        else:
            entry[0] += 1
        states[key] = (state, run)
        while len(states) > 1 and (len(states) > self._max or self.held > self.budget):
            _, (_, gone) = states.popitem(last=False)
            self._release(gone)

    def _release(self, run: Run) -> None:
        entry = self._owners[run]
        entry[0] -= 1
        if entry[0] == 0:
            del self._owners[run]
            self.held -= entry[1]

    def __len__(self) -> int:
        return len(self._states)
