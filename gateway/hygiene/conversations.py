"""Which earlier conversation a request without a session id continues (pure, bounded).

Drift detection compares a request with the previous request of its conversation. Without
a session id the router recognises a follow-up by its prefix (routing/conversations.py),
but a history rewrite is exactly a request whose prefix stops matching: a summary in place
of the first turns, the oldest exchange dropped, an old answer truncated. What such a
request keeps is most of the conversation's messages. So here a conversation is recognised
by its messages: each conversation message (user, assistant, tool; not the head, which
conversations of one agent share) is remembered by digest with the conversation that sent
it, and a request belongs to the conversation owning the most recent of its earlier
messages (not its last one: that one is new). A digest seen in two conversations (a
templated first message, "continue") names neither and is skipped.

Bounded: `capacity` digests in an LRU; conversations are ints from a counter.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

SHARED = -1  # a digest two conversations sent: it identifies neither


class MessageOwners:
    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("capacity must be positive")
        self._capacity = capacity
        self._owner: OrderedDict[int, int] = OrderedDict()
        self._next = 1

    def __len__(self) -> int:
        return len(self._owner)

    def find(self, earlier: Sequence[int]) -> int | None:
        """The conversation owning the latest of `earlier` (digests, in order), or None."""
        return self.find_latest(reversed(earlier))

    def find_latest(self, latest_first: Iterable[int]) -> int | None:
        """As `find`, given the digests latest first: the owner is usually the first one
        asked, so a caller that derives digests lazily derives one or two, not all."""
        owner = self._owner
        for digest in latest_first:
            conv = owner.get(digest)
            if conv is not None and conv != SHARED:
                return conv
        return None

    def open(self) -> int:
        conv = self._next
        self._next += 1
        return conv

    def record(self, conv: int, digests: Sequence[int]) -> None:
        """`conv` sent these messages (all of them, its last included)."""
        owner = self._owner
        for digest in digests:
            was = owner.get(digest)
            owner[digest] = conv if was is None or was == conv else SHARED
            owner.move_to_end(digest)
        while len(owner) > self._capacity:
            owner.popitem(last=False)
