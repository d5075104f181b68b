"""Facts sized by what is new: which earlier chain a fact's blocks extend (the publisher's
side, `Published`) and the whole chain back from a reference (the receiver's, `Chains`).
Pure: no clock (times are parameters), no I/O.

An agent's conversation resends its whole history every turn, so its prompt's block
chain is the previous turn's plus what was added. A fact about it need carry only the
added blocks and a reference to the earlier chain, named by that chain's last hash and
length (a chained hash names its whole prefix, gateway/routing/blocks.py): a 32k-token
follow-up costs a few hundred bytes instead of 16 KiB, whatever the conversation's length.

The publisher references only chains it published itself, and sends a whole chain again
once the one its deltas hang from was published more than `rebase_s` ago: a receiver
that starts later (it replays only the last `replay_s` of the stream, replay_s >=
rebase_s) then finds, for every conversation active within `replay_s - rebase_s`, a whole
chain to resolve the deltas after it. A reference the receiver cannot resolve (it started
in between, or its store evicted the chain) is counted and the fact skipped: the
receiver's index misses that turn's blocks, the next whole chain repairs it.

Bounds: the publisher remembers `capacity` chain ends (LRU); the receiver keeps chains up
to `budget` blocks in all (8 bytes each, as arrays), LRU by chain end; a conversation
grown turn by turn extends one array in place, counted once.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from gateway.routing.facts import Base


class Published:
    """The chains this instance published: tip -> (length, when their whole chain went)."""

    def __init__(self, capacity: int, rebase_s: float) -> None:
        if capacity < 1 or rebase_s <= 0:
            raise ValueError("Published needs capacity >= 1 and rebase_s > 0")
        self._capacity = capacity
        self._rebase_s = rebase_s
        self._tips: OrderedDict[int, tuple[int, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._tips)

    def base(self, hashes: Sequence[int], now: float) -> Base | None:
        """The deepest chain published before that `hashes` extends (and whose whole
        form is recent enough to build on), or None: send the whole chain."""
        tips = self._tips
        if not tips:
            return None
        for i in range(len(hashes) - 1, -1, -1):
            got = tips.get(hashes[i])
            if got is not None and got[0] == i + 1:
                if now - got[1] > self._rebase_s:
                    return None
                return hashes[i], i + 1
        return None

    def sent(self, hashes: Sequence[int], base: Base | None, now: float) -> None:
        """`hashes` went out (as a delta on `base`, or whole): later facts may build on it."""
        if not hashes:
            return
        whole_at = now
        if base is not None:
            got = self._tips.get(base[0])
            if got is not None:
                whole_at = got[1]
        tips = self._tips
        tips[hashes[-1]] = (len(hashes), whole_at)
        tips.move_to_end(hashes[-1])
        while len(tips) > self._capacity:
            tips.popitem(last=False)


@dataclass(slots=True, eq=False)
class _Run:
    blocks: array[int] = field(default_factory=lambda: array("Q"))
    refs: int = 0


class Chains:
    """The chains this instance was told about, to resolve references: tip -> (run, length)
    where run.blocks[:length] is the chain; chains that extend each other share a run."""

    def __init__(self, budget: int) -> None:
        if budget < 1:
            raise ValueError("Chains needs a positive budget")
        self.budget = budget
        self.held = 0  # blocks in all runs referenced
        self._tips: OrderedDict[int, tuple[_Run, int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._tips)

    def resolve(self, base: Base, after: Sequence[int]) -> list[int] | None:
        """The whole chain: the one `base` names, then `after`; None when unknown."""
        got = self._tips.get(base[0])
        if got is None or got[1] != base[1]:
            return None
        whole = got[0].blocks[:base[1]].tolist()
        whole.extend(after)
        self.extend(base, after)
        return whole

    def extend(self, base: Base, after: Sequence[int]) -> bool:
        """Remember the chain `base` names followed by `after` (False: base unknown)
        without building it (a catch-up that only learns chains)."""
        got = self._tips.get(base[0])
        if got is None or got[1] != base[1]:
            return False
        if not after:
            self._tips.move_to_end(base[0])
            return True
        run, length = got
        if len(run.blocks) == length:
            # The chain grows at its end: extend the shared run in place.
            run.blocks.extend(after)
            self.held += len(after)
        else:
            run = _Run(run.blocks[:length])
            run.blocks.extend(after)
            self.held += len(run.blocks)
        self._put(after[-1], run, length + len(after))
        return True

    def learn(self, hashes: Sequence[int]) -> None:
        """A whole chain arrived: later references may name it."""
        if hashes:
            run = _Run(array("Q", hashes))
            self.held += len(hashes)
            self._put(hashes[-1], run, len(hashes))

    def _put(self, tip: int, run: _Run, length: int) -> None:
        old = self._tips.pop(tip, None)
        if old is not None:
            self._release(old[0])
        run.refs += 1
        self._tips[tip] = (run, length)
        while len(self._tips) > 1 and self.held > self.budget:
            _, (gone, _) = self._tips.popitem(last=False)
            self._release(gone)

    def _release(self, run: _Run) -> None:
        run.refs -= 1
        if run.refs == 0:
            self.held -= len(run.blocks)
