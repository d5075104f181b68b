"""Chained block hashes of a token sequence, as vLLM V1's prefix cache computes them.

Block i covers tokens [i*bs, (i+1)*bs); only full blocks are hashed. The hash is
``H(parent_hash, tokens_of_block, extra)`` where the parent of block 0 is the per-engine
``none_hash`` seed, so one hash identifies the whole prefix up to its block. ``extra`` is the
request's ``cache_salt`` in block 0 only, plus an optional key on every block (a LoRA name).
H is xxh3-64 over the parent's 8 bytes, the block's token ids as uint64 and the extras
(vLLM's ``xxhash`` algorithm family; collisions are as unlikely as there).

The seed models vLLM's ``NONE_HASH``: ``fixed`` (same value in every replica, like 0.33's
``vllm-none-hash`` for sha256) or a per-replica random value (like 0.11 without
``PYTHONHASHSEED``) derived from the simulator seed and the replica index.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import xxhash

FIXED_NONE_HASH = xxhash.xxh3_64_intdigest(b"vllm-none-hash")


def none_hash(mode: str, seed: int, replica: int) -> int:
    if mode == "fixed":
        return FIXED_NONE_HASH
    return xxhash.xxh3_64_intdigest(f"random-none-hash/{seed}/{replica}".encode())


def salt_key(cache_salt: str | None) -> bytes:
    return b"" if cache_salt is None else b"salt\x00" + cache_salt.encode("utf-8")


def extend_hashes(
    hashes: list[int],
    token_ids: Sequence[int],
    upto_tokens: int,
    block_size: int,
    seed: int,
    first_extra: bytes = b"",
    every_extra: bytes = b"",
) -> None:
    """Append the hashes of every full block within the first ``upto_tokens`` tokens."""
    full = min(upto_tokens, len(token_ids)) // block_size
    digest = xxhash.xxh3_64_intdigest
    parent = hashes[-1] if hashes else seed
    for i in range(len(hashes), full):
        start = i * block_size
        data = array("Q", token_ids[start : start + block_size]).tobytes()
        if i == 0 and first_extra:
            data += first_extra
        if every_extra:
            data += every_extra
        parent = digest(data, seed=parent)
        hashes.append(parent)
