"""Token ids -> chained block hashes at the replica's block size. Pure.

Block i's hash is `xxh3_64(uint64 token ids of block i, seed=hash_{i-1})`, with `hash_{-1}`
the namespace: model, LoRA adapter and `cache_salt`. vLLM keys blocks the same way (its
block 0 mixes in the LoRA name and the salt, every later block chains on its parent), so a
LoRA block never matches a base-model block, tenants with different salts never share, and
any earlier difference changes every later hash. Only full blocks are hashed, like vLLM.

The gateway computes these hashes both for requests and from the `token_ids` carried by
the replica's `BlockStored` events, so vLLM's own hash function and seed never matter.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import xxhash

_xxh3 = xxhash.xxh3_64_intdigest


def namespace(model: str, lora: str | None, cache_salt: str | None) -> int:
    """Chain seed for one (model, adapter, salt); NUL-separated so fields cannot merge."""
    key = "\0".join((model, lora or "", cache_salt or "")).encode("utf-8", "surrogatepass")
    return _xxh3(key)


def token_bytes(token_ids: Sequence[int]) -> bytes:
    return array("Q", token_ids).tobytes()


def chain_token_hashes(token_ids: Sequence[int], seed: int, block_size: int,
                       start: int = 0) -> list[int]:
    """Hashes of the full blocks of `token_ids`, chained from `seed` (the hash of the
    block before `start`, or the namespace when `start` is 0)."""
    data = token_bytes(token_ids)
    step = 8 * block_size
    out: list[int] = []
    append = out.append
    h = seed
    for offset in range(start * step, len(data) - step + 1, step):
        h = _xxh3(data[offset : offset + step], h)
        append(h)
    return out


class ChainCache:
    """Block hashes of piece sequences, resumed from the longest prefix seen before.

    A prompt is a sequence of pieces (tokenize.py); a rolling key names each piece prefix
    (`xxh3(piece, seed=key of the prefix before it)`, starting from the namespace). For
    every piece prefix it computed, the cache keeps the hash list and how many of its blocks
    lie wholly inside that prefix: the next turn of the conversation finds its previous
    turn's pieces and hashes only the blocks after them. Bounded LRU of `max_entries`
    prefixes; the hash lists are shared by all prefixes of one prompt.
    """

    def __init__(self, block_size: int, max_entries: int = 65536) -> None:
        from collections import OrderedDict

        self.block_size = block_size
        self._max = max(1, max_entries)
        self._states: OrderedDict[int, tuple[list[int], int]] = OrderedDict()

    def hashes(self, pieces: Sequence[tuple[str, Sequence[int]]], seed: int,
               ids: Sequence[int]) -> list[int]:
        """`ids` is the concatenation of the pieces' ids."""
        keys: list[int] = []
        ends: list[int] = []  # token count at the end of each piece
        key, end = seed, 0
        for text, piece_ids in pieces:
            key = _xxh3(text.encode("utf-8", "surrogatepass"), key)
            end += len(piece_ids)
            keys.append(key)
            ends.append(end)
        states = self._states
        base: list[int] = []
        start = 0
        for j in range(len(keys) - 1, -1, -1):
            state = states.get(keys[j])
            if state is not None:
                states.move_to_end(keys[j])
                base, start = state[0][: state[1]], state[1]
                break
        parent = base[-1] if base else seed
        bs = self.block_size
        out = base + chain_token_hashes(ids[start * bs :], parent, bs)
        for k, e in zip(keys, ends, strict=True):
            if e // bs > start or k not in states:
                states[k] = (out, e // bs)
        while len(states) > self._max:
            states.popitem(last=False)
        return out
