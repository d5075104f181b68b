"""The decoder's KV, remembered per conversation for the next turn's prefill leg. Pure.

With vLLM's `bidirectional_kv_xfer`, D ends a turn with its own `kv_transfer_params`: sent
with the next turn's prefill leg, P pulls the conversation's KV from D instead of
recomputing it. The engine does not check that those are the tokens of the new prompt
(`real-vllm-pd.md`), so the gateway keeps, per conversation key, the replica that holds
them, the params, and what identifies `turn`: the exact bytes (prompt + answer, after a
tag of what renders them into tokens: gateway.pd.pullback) that D's KV covers. `take`
hands the params out only when the new prompt starts with those bytes exactly and the
entry is fresh; an entry is used once (taken whether it matches or not: after a mismatch
the KV on D belongs to a history the conversation left).

The bytes themselves are not kept: an agent's turn at 100k tokens is 400 KiB+, and
10,000 conversations of them would be gigabytes. An entry keeps the turn's length and its
BLAKE2b digest (`DIGEST_BYTES`, 128 bits); `take` digests the new prompt's first `length`
bytes. A prefix is accepted exactly when the byte comparison accepted it, save a digest
collision (2^-128 per comparison for unrelated bytes; BLAKE2b is collision resistant, so
a client cannot craft one to be handed another history's KV).

Bounds: at most `max_entries` conversations (least recently remembered dropped first),
each of a fixed size: the key, the replica's name, the params (D's own, a few hundred
bytes), a length, a 16-byte digest and an expiry, whatever the turn's length; an entry
lives `ttl_s` seconds (set it below the engine's `decoder_kv_blocks_ttl`, 480 s,
so D still holds the blocks when P pulls them). `forget_replica` drops a replica's
entries when it restarts or departs. Time is a parameter.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

DIGEST_BYTES = 16  # BLAKE2b-128: what an entry keeps of its turn, besides the length


def digest(data: bytes | memoryview) -> bytes:
    """The digest an entry keeps of its turn (and `take` of the prompt's prefix)."""
    return hashlib.blake2b(data, digest_size=DIGEST_BYTES).digest()


@dataclass(frozen=True, slots=True)
class _Entry:
    replica: str
    length: int  # of the turn's bytes
    digest: bytes  # of the turn's bytes (`digest`)
    params: dict[str, Any]
    expires: float


class DecoderKvMemory:
    def __init__(self, max_entries: int, ttl_s: float) -> None:
        if max_entries < 1:
            raise ValueError("max_entries must be >= 1")
        if not ttl_s > 0:
            raise ValueError("ttl_s must be > 0")
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        # Insertion order is expiry order: every entry lives ttl_s from its `remember`,
        # and `remember` moves a key to the end.
        self._entries: OrderedDict[str, _Entry] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def forget(self, key: str) -> None:
        self._entries.pop(key, None)

    def remember(self, key: str, replica: str, turn: bytes, params: dict[str, Any],
                 now: float) -> None:
        """D (`replica`) holds the KV of `turn` and returned `params` for it. An empty
        turn would match every prompt: it is not remembered (and forgets the key)."""
        entries = self._entries
        entries.pop(key, None)
        self._expire(now)
        if not turn:
            return
        entries[key] = _Entry(replica, len(turn), digest(turn), dict(params), now + self.ttl_s)
        while len(entries) > self.max_entries:
            entries.popitem(last=False)

    def take(self, key: str, prompt: bytes, now: float) -> tuple[str, dict[str, Any]] | None:
        """(replica, params) when `prompt` extends the remembered turn exactly and the entry
        is fresh; the entry is gone afterwards either way."""
        entry = self._entries.pop(key, None)
        if entry is None or now >= entry.expires or len(prompt) < entry.length:
            return None
        if digest(memoryview(prompt)[:entry.length]) != entry.digest:
            return None
        return entry.replica, dict(entry.params)

    def forget_replica(self, name: str) -> None:
        for key in [k for k, e in self._entries.items() if e.replica == name]:
            del self._entries[key]

    def _expire(self, now: float) -> None:
        entries = self._entries
        while entries:
            first = next(iter(entries.values()))
            if now < first.expires:
                return
            entries.popitem(last=False)
