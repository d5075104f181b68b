"""The theoretical prefix-cache bound of a request stream (pure).

For each request, in arrival order: the longest block-aligned prefix of its engine tokens
that appeared in ANY earlier request (one infinite cache shared by all replicas, nothing
ever evicted), capped the way vLLM caps hits: at most floor((N - 1) / B) * B tokens of an
N-token prompt, because the last prompt token is always recomputed. Summed over requests
it is the most cached prompt tokens any routing policy could obtain on this stream.

"Appeared" covers what an engine would have cached from the earlier request: its prompt
and, when known, its prompt followed by its generated tokens (`cacheable`), since vLLM
hashes blocks that fill up during decoding too.

`compute_lru_reference` is the finite-cache counterpart: the same walk over ONE cache that
holds at most `capacity_blocks` blocks (the fleet's combined KV capacity), least recently
used evicted first, a request's deepest blocks before its shallow ones (vLLM's free-queue
order). It is what a fleet of that total size could reach if it behaved as one cache, so
the share of the bound a router can be asked for once caches are finite.

Blocks are chain-hashed (a block's key covers the whole prefix up to it), so a prefix
match is a walk over keys until the first unseen one, as in the engine. Keys are tuples
of (parent key id, block tokens) interned to small ints so memory stays linear.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class BoundInput:
    prompt: Sequence[int]
    cacheable: Sequence[int] | None = None  # prompt + output tokens, if known


@dataclass(frozen=True, kw_only=True)
class BoundResult:
    per_request: tuple[int, ...]  # best possible cached tokens of each request
    prompt_tokens: int
    cached_tokens: int
    distinct_blocks: int  # the stream's working set, in full blocks

    @property
    def ratio(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


class _Chains:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.ids: dict[tuple[int, tuple[int, ...]], int] = {}

    def keys(self, tokens: Sequence[int], add: bool) -> list[int]:
        """Chain keys of the full blocks; with add=False stops at the first unknown block."""
        out: list[int] = []
        parent = -1
        b = self.block_size
        for start in range(0, len(tokens) - b + 1, b):
            key = (parent, tuple(tokens[start : start + b]))
            found = self.ids.get(key)
            if found is None:
                if not add:
                    break
                found = len(self.ids)
                self.ids[key] = found
            out.append(found)
            parent = found
        return out


def max_cache_hit(prompt_tokens: int, block_size: int) -> int:
    """vLLM's cap: whole blocks only, and never the last prompt token."""
    return max(0, (prompt_tokens - 1) // block_size * block_size)


def compute_bound(requests: Sequence[BoundInput], block_size: int = 16) -> BoundResult:
    if block_size < 1:
        raise ValueError("block_size must be >= 1")
    chains = _Chains(block_size)
    per: list[int] = []
    for req in requests:
        n = len(req.prompt)
        hit_blocks = len(chains.keys(req.prompt, add=False))
        per.append(min(hit_blocks * block_size, max_cache_hit(n, block_size)))
        chains.keys(req.prompt, add=True)
        if req.cacheable is not None:
            chains.keys(req.cacheable, add=True)
    return BoundResult(
        per_request=tuple(per),
        prompt_tokens=sum(len(r.prompt) for r in requests),
        cached_tokens=sum(per),
        distinct_blocks=len(chains.ids),
    )


def compute_lru_reference(
    requests: Sequence[BoundInput], capacity_blocks: int, block_size: int = 16
) -> BoundResult:
    """Cached tokens one LRU cache of `capacity_blocks` blocks would give this stream."""
    if block_size < 1 or capacity_blocks < 0:
        raise ValueError("block_size must be >= 1 and capacity_blocks >= 0")
    chains = _Chains(block_size)
    held: OrderedDict[int, None] = OrderedDict()
    per: list[int] = []
    for req in requests:
        keys = chains.keys(req.prompt, add=True)
        hit = 0
        while hit < len(keys) and keys[hit] in held:
            hit += 1
        per.append(min(hit * block_size, max_cache_hit(len(req.prompt), block_size)))
        stored = chains.keys(req.cacheable, add=True) if req.cacheable is not None else keys
        if len(stored) < len(keys):
            stored = keys
        for key in reversed(stored):  # shallow blocks end most recent: evicted last
            held[key] = None
            held.move_to_end(key)
        while len(held) > capacity_blocks:
            held.popitem(last=False)
    return BoundResult(
        per_request=tuple(per),
        prompt_tokens=sum(len(r.prompt) for r in requests),
        cached_tokens=sum(per),
        distinct_blocks=len(chains.ids),
    )
