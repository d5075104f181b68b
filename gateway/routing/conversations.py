"""Implicit conversations: requests without a session id grouped by what they extend.

A chat client resends the whole history each turn, so a follow-up's canonical stream
starts with its previous prompt byte for byte (the previous prompt ends with the
generation prompt, which is where the answer and the next message are appended). With
chained block hashes (blocks.py), "request R extends prompt P" is one membership test: R's
chain contains the hash of P's last full block, because that hash names P's whole prefix.

So each conversation remembers the *tips* of its most recent prompts (the hash of their
last full block) in one dict, tip -> conversation, and a request joins the conversation of
the deepest tip its chain contains. A request that contains no tip opens a conversation:
what it shares with others (an agent's common prompt, the chat template) holds no tip,
because a tip is always the end of some whole prompt, past the part where that prompt's
conversation began to differ from every other.

Several tips per conversation (`tips_per_conversation`, most recent first): an agent's
fan-out sends siblings with the same history and different last messages; the next main
turn extends the main request, not necessarily the sibling sent last. A request that
extends only an older tip than those kept is a fork and opens its own conversation.

Continuations that do not extend the whole previous prompt. Some clients re-render the
end of the history (a trace that records prompts in 512-token blocks re-hashes the last,
partial one; a template that drops the previous turn's reasoning), so a follow-up shares
all of the previous prompt but its tail. For these, every `sample_every`-th block hash of
each prompt is remembered with the conversation that sent it, or SHARED once a second
conversation sends it too. A request that contains no tip but whose deepest remembered
sample belongs to one conversation alone, at most `max_tail_blocks` short of that
conversation's latest prompt, *forks* from it (`find` says so): it opens a
conversation of its own (so it is counted as one), placed as a follow-up of the one it
forks from, on that one's replica while its cache holds. Content that several
conversations sent (an agent's prompt, after its second conversation) is SHARED and
identifies nobody, so a new conversation of a popular agent is placed, and capped, as new.

Tenants (API keys' tenants) have conversations of their own: a tenant's tips and samples
are stored XOR-ed with a per-tenant `scope` (0 without one), so another tenant's request
with the same content finds none of them and cannot join, or move, the conversation.

Memory is bounded: at most `capacity` conversations, least recently active forgotten first
together with their tips, and at most `sample_capacity` samples (LRU). Pure: no clock, no
I/O; ids are increasing ints.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Literal, NamedTuple

from gateway.routing.marks import Gates

SHARED = -1  # a sample two conversations sent: it identifies neither


class Found(NamedTuple):
    conversation: int
    how: Literal["follows", "forks"]


class Conversations:
    def __init__(self, capacity: int, tips_per_conversation: int = 4,
                 sample_every: int = 16, sample_capacity: int = 262_144,
                 max_tail_blocks: int = 32) -> None:
        if min(capacity, tips_per_conversation, sample_capacity) < 1 or sample_every < 0:
            raise ValueError("Conversations sizes must be positive (sample_every: 0 is off)")
        self._capacity = capacity
        self._keep = tips_per_conversation
        self._every = sample_every
        self._sample_capacity = sample_capacity
        self._samples: OrderedDict[int, int] = OrderedDict()  # sample hash -> conv | SHARED
        self._max_tail = max_tail_blocks
        self._length: dict[int, int] = {}  # conversation -> blocks of its latest prompt
        self._tips: dict[int, int] = {}  # tip hash -> conversation
        self._gates = Gates()  # the tips' windows: `find` skips the rest (marks.py)
        # conversation -> its tips, most recent last; least recently active first
        self._conversations: OrderedDict[int, list[int]] = OrderedDict()
        self._next = 1

    def __len__(self) -> int:
        return len(self._conversations)

    def find(self, hashes: Sequence[int], scope: int = 0) -> Found | None:
        """The conversation whose recent prompt `hashes` extends (deepest tip: "follows"),
        else the one alone to have sent its deepest remembered sample ("forks"), or None.
        `scope`: the tenant's (module docstring)."""
        tips = self._tips
        if tips:
            j = self._gates.deepest(hashes, len(hashes), tips, scope)
            if j:
                return Found(tips[hashes[j - 1] ^ scope], "follows")
        samples = self._samples
        every = self._every
        if not every:
            return None
        # the deepest remembered sample: a C scan of every `every`-th block from the end
        picked = hashes[every - 1 :: every]
        if scope:
            picked = [h ^ scope for h in picked]
        deepest = next(filter(samples.__contains__, reversed(picked)), None)
        if deepest is None:
            return None
        owner = samples[deepest]
        if owner == SHARED or owner not in self._conversations:
            return None
        i = (len(picked) - 1 - picked[::-1].index(deepest)) * every + every - 1
        # Only a short tail may differ: a request that leaves more of the prompt behind
        # (another conversation of the same agent, while the first is the only one to
        # have sent its prompt) is a new one.
        if self._length[owner] - (i + 1) > self._max_tail:
            return None
        return Found(owner, "forks")

    def open(self) -> int:
        """A new conversation id (remembered once `advance` records a prompt for it)."""
        conv = self._next
        self._next += 1
        return conv

    def advance(self, conv: int, hashes: Sequence[int], scope: int = 0) -> None:
        """`conv` sent the prompt chained as `hashes`: its tip joins the conversation's."""
        if not hashes:
            return
        self._sample(conv, hashes, scope)
        self._length[conv] = len(hashes)
        tip = hashes[-1] ^ scope
        owner = self._tips.get(tip)
        if owner is not None and owner != conv:
            # The same prompt again from another conversation (two clients sending the
            # identical first request): the tip names the later one; the other keeps its
            # other tips.
            self._drop_tip(owner, tip)
        mine = self._conversations.pop(conv, None)
        if mine is None:
            mine = []
        elif tip in mine:
            mine.remove(tip)
        mine.append(tip)
        self._tips[tip] = conv
        if len(hashes) > self._gates.head:  # (a tip in the head is counted nowhere)
            self._gates.add(tip, hashes, len(hashes) - 1, scope)
        while len(mine) > self._keep:
            old = mine.pop(0)
            if self._tips.get(old) == conv:
                self._forget_tip(old)
        self._conversations[conv] = mine
        while len(self._conversations) > self._capacity:
            gone, old_tips = self._conversations.popitem(last=False)
            self._length.pop(gone, None)
            for old in old_tips:
                if self._tips.get(old) == gone:
                    self._forget_tip(old)

    def _sample(self, conv: int, hashes: Sequence[int], scope: int) -> None:
        samples = self._samples
        every = self._every
        if not every:
            return
        # every sample of the prompt renewed, deepest last (the order the LRU keeps):
        # each turn of an active conversation keeps its whole history's samples alive
        # (tests/test_review55_marks.py); a new one is written last already
        picked = hashes[every - 1 :: every]
        if scope:
            picked = [h ^ scope for h in picked]
        get, renew = samples.get, samples.move_to_end
        for h in picked:
            was = get(h)
            if was is None:
                samples[h] = conv
            else:
                if was != conv and was != SHARED:
                    samples[h] = SHARED
                renew(h)
        while len(samples) > self._sample_capacity:
            samples.popitem(last=False)

    def _forget_tip(self, tip: int) -> None:
        del self._tips[tip]
        if self._gates.gate_of:
            self._gates.remove(tip)

    def _drop_tip(self, conv: int, tip: int) -> None:
        self._forget_tip(tip)
        mine = self._conversations.get(conv)
        if mine is not None and tip in mine:
            mine.remove(tip)
