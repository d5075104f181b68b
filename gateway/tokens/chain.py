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
