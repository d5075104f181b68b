"""Token mode, per replica: the blocks its KV events say it holds. Pure (time is a
parameter).

Confirmed entries come from the replica's events. A `BlockStored` carries the blocks'
`token_ids` and vLLM's hash of the parent; the gateway recomputes its own chained hashes
(tokens/chain.py) from its hash of that parent, or from the namespace (model, LoRA
adapter, `cache_salt` found in block 0's `extra_keys`) when there is none, and keeps vLLM's
hash -> its hash so later parents and `BlockRemoved` resolve. A store whose parent the
gateway never saw (events lost before it subscribed) cannot be placed and is counted as
unresolved. `AllBlocksCleared` empties the replica, predictions included: a reset replica
is predicted to hold nothing on the very next request.

Predicted entries are what routing decisions put there (a request sent is a prefix about
to be cached); they expire after `predict_ttl_s`, so a burst of sibling requests co-locates
before the first event arrives, and a wrong guess does not outlive the events that should
have confirmed it.

Data-parallel ranks are indexed apart: a replica served by several engine cores (vLLM
`--data-parallel-size`) has one event stream per rank, and each rank's engine hashes are
kept under that rank (`rank`: the subscriber's source). A rank's `AllBlocksCleared`, or a
gap its subscriber cannot fill, forgets that rank's blocks only; a block two ranks hold
stays held while one of them does.

A replica is live while its events are flowing: the subscriber marks it connected, and
it goes stale when requests were sent there `stale_after_s` ago and at least
`stale_requests` of them were never followed by any event. A stale or disconnected replica
is routed in text mode until events arrive again.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from itertools import filterfalse, islice, takewhile

from gateway.events.decode import (
    AllBlocksCleared,
    BlockKey,
    BlockRemoved,
    BlockStored,
    Event,
)
from gateway.routing.blocks import held_prefix
from gateway.tokens.chain import chain_token_hashes, namespace


@dataclass(slots=True)
class ReplicaBlocks:
    model: str
    block_size: int | None = None
    # (rank, engine hash) -> own hash; ranks apart (module docstring)
    engine_to_own: dict[tuple[Hashable, BlockKey], int] = field(default_factory=dict)
    held: dict[int, int] = field(default_factory=dict)  # own hash -> engine hashes naming it
    # Shape of `held`, so a lookup can bisect instead of walking: each held block's parent
    # (absent for a chain's first block), how many held blocks each block is the parent
    # of, and `holes`, the held blocks whose parent is not held.
    parent: dict[int, int] = field(default_factory=dict)
    children: dict[int, int] = field(default_factory=dict)
    holes: int = 0
    predicted: dict[int, float] = field(default_factory=dict)  # own hash -> expiry
    connected: bool = False
    unconfirmed: list[float] = field(default_factory=list)  # sends since the last event
    last_event_at: float | None = None
    stored: int = 0
    removed: int = 0
    cleared: int = 0
    unresolved: int = 0


@dataclass(frozen=True, slots=True)
class KVConfig:
    predict_ttl_s: float = 2.0
    stale_after_s: float = 10.0
    stale_requests: int = 3
    max_predicted: int = 1 << 20


class KVIndex:
    def __init__(self, config: KVConfig | None = None) -> None:
        self.config = config or KVConfig()
        self._replicas: dict[str, ReplicaBlocks] = {}

    # replicas -----------------------------------------------------------------------------
    def add_replica(self, replica: str, model: str, block_size: int | None = None) -> None:
        state = self._replicas.get(replica)
        if state is None or state.model != model:
            self._replicas[replica] = ReplicaBlocks(model, block_size)
        elif block_size is not None:
            state.block_size = block_size

    def remove_replica(self, replica: str) -> None:
        self._replicas.pop(replica, None)

    def state(self, replica: str) -> ReplicaBlocks | None:
        return self._replicas.get(replica)

    def set_connected(self, replica: str, connected: bool, now: float) -> None:
        state = self._replicas.get(replica)
        if state is not None:
            state.connected = connected
            state.unconfirmed.clear()
            if connected:
                state.last_event_at = now

    def live(self, replica: str, now: float) -> bool:
        state = self._replicas.get(replica)
        if state is None or not state.connected or state.block_size is None:
            return False
        cfg = self.config
        overdue = [t for t in state.unconfirmed if now - t >= cfg.stale_after_s]
        return len(overdue) < cfg.stale_requests

    # events -------------------------------------------------------------------------------
    def apply(self, replica: str, events: Sequence[Event], now: float,
              rank: Hashable = None) -> None:
        """`rank`: the data-parallel rank (event stream) the events come from."""
        state = self._replicas.get(replica)
        if state is None:
            return
        state.last_event_at = now
        state.unconfirmed.clear()
        for event in events:
            if isinstance(event, BlockStored):
                self._store(state, event, rank)
            elif isinstance(event, BlockRemoved):
                self._remove(state, [(rank, h) for h in event.block_hashes])
            elif isinstance(event, AllBlocksCleared):
                self.clear(replica, rank)

    def clear(self, replica: str, rank: Hashable = None) -> None:
        """Forget what the replica holds: every rank's blocks and the predictions, or, of
        a replica with several ranks, `rank`'s blocks only (the others still hold theirs)."""
        state = self._replicas.get(replica)
        if state is None:
            return
        ranks = {r for r, _ in state.engine_to_own}
        if rank is not None and ranks - {rank}:
            self._remove(state, [k for k in state.engine_to_own if k[0] == rank],
                         counted=False)
            state.cleared += 1
            return
        state.engine_to_own.clear()
        state.held.clear()
        state.parent.clear()
        state.children.clear()
        state.holes = 0
        state.predicted.clear()
        state.cleared += 1

    def _store(self, state: ReplicaBlocks, event: BlockStored, rank: Hashable) -> None:
        if event.group_idx not in (None, 0):
            return  # hybrid models: the full-attention group (0) decides prefix hits
        if state.block_size is None and event.block_hashes:
            # Learnt from an event that stores blocks: an empty one, whatever block size
            # it names, would otherwise fix the replica's for good.
            state.block_size = event.block_size
        if event.block_size != state.block_size:
            state.unresolved += len(event.block_hashes)
            return
        if event.parent_block_hash is None:
            seed = namespace(state.model, event.lora_name, _salt(event))
        else:
            known = state.engine_to_own.get((rank, event.parent_block_hash))
            if known is None:
                state.unresolved += len(event.block_hashes)
                return
            seed = known
        own = chain_token_hashes(event.token_ids, seed, event.block_size)
        # Block 0 of a chain has no parent block; every other block's parent is the block
        # before it (in this event, or the one the event names).
        parent: int | None = None if event.parent_block_hash is None else seed
        held = state.held
        for engine, mine in zip(event.block_hashes, own, strict=True):
            key = (rank, engine)
            if key not in state.engine_to_own:
                state.engine_to_own[key] = mine
                count = held.get(mine, 0)
                held[mine] = count + 1
                if count == 0:
                    self._held_now(state, mine, parent)
            state.predicted.pop(mine, None)
            parent = mine
        state.stored += len(own)

    def _remove(self, state: ReplicaBlocks, keys: Sequence[tuple[Hashable, BlockKey]],
                counted: bool = True) -> None:
        held = state.held
        for key in keys:
            mine = state.engine_to_own.pop(key, None)
            if mine is None:
                continue
            left = held.get(mine, 0) - 1
            if left > 0:
                held[mine] = left
            else:
                held.pop(mine, None)
                self._gone(state, mine)
            state.removed += counted

    @staticmethod
    def _held_now(state: ReplicaBlocks, mine: int, parent: int | None) -> None:
        if parent is not None:
            state.parent[mine] = parent
            state.children[parent] = state.children.get(parent, 0) + 1
            if parent not in state.held:
                state.holes += 1
        state.holes -= state.children.get(mine, 0)  # its held children are whole again

    @staticmethod
    def _gone(state: ReplicaBlocks, mine: int) -> None:
        parent = state.parent.pop(mine, None)
        if parent is not None:
            left = state.children[parent] - 1
            if left:
                state.children[parent] = left
            else:
                del state.children[parent]
            if parent not in state.held:
                state.holes -= 1  # it was a hole
        state.holes += state.children.get(mine, 0)  # its held children are holes now

    # routing ------------------------------------------------------------------------------
    def matched(self, replica: str, hashes: Sequence[int], now: float) -> int:
        """Leading blocks of `hashes` the replica holds (confirmed) or is about to hold
        (predicted, not expired)."""
        return self.leading(replica, hashes, now)[1]

    def leading(self, replica: str, hashes: Sequence[int], now: float) -> tuple[int, int]:
        """(leading blocks confirmed, leading blocks confirmed or predicted)."""
        state = self._replicas.get(replica)
        if state is None:
            return 0, 0
        held, predicted = state.held, state.predicted
        # The confirmed run first. With no holes, `held` is prefix-closed (a held block's
        # parent is held: hashes are chained, so hashes[i] held means hashes[:i] are) and
        # the run's end is found by bisection, a few lookups whatever the prompt's length
        # (vLLM evicts a chain's blocks deepest first, so holes are rare). Otherwise one
        # block at a time, in C (takewhile over dict membership). Then the mixed
        # confirmed/predicted tail one block at a time (it usually ends at once: expired
        # predictions stay in the dict until it is full, so a run taken in C first and
        # checked for expiry after would cost more than it saves).
        if state.holes == 0:
            confirmed = n = held_prefix(held, hashes)
        else:
            confirmed = n = len(list(takewhile(held.__contains__, hashes)))
        if not predicted:
            return n, n
        for h in islice(hashes, n, None):
            if h not in held:
                expiry = predicted.get(h)
                if expiry is None or expiry <= now:
                    break
            n += 1
        return confirmed, n

    def predict(self, replica: str, hashes: Sequence[int], now: float, start: int = 0) -> None:
        """A request with these blocks was sent there: expect them until the TTL ends.
        `start`: leading blocks known to be confirmed (nothing to predict there)."""
        state = self._replicas.get(replica)
        if state is None:
            return
        state.unconfirmed.append(now)
        if len(state.unconfirmed) > self.config.stale_requests * 4:
            del state.unconfirmed[: -self.config.stale_requests * 4]
        expiry = now + self.config.predict_ttl_s
        predicted, held = state.predicted, state.held
        # In C: every block from `start` that events have not confirmed.
        predicted.update(dict.fromkeys(
            filterfalse(held.__contains__, islice(hashes, start, None)), expiry))
        if len(predicted) > self.config.max_predicted:
            for h in [h for h, t in predicted.items() if t <= now]:
                del predicted[h]

    def held_blocks(self, replica: str) -> int:
        state = self._replicas.get(replica)
        return len(state.held) if state is not None else 0


def _salt(event: BlockStored) -> str | None:
    """cache_salt: the string in block 0's extra keys after the LoRA name (if any)."""
    if not event.extra_keys or not event.extra_keys[0]:
        return None
    keys = list(event.extra_keys[0])
    if event.lora_name is not None and keys and keys[0] == event.lora_name:
        keys = keys[1:]
    strings = [k for k in keys if isinstance(k, str)]
    return strings[0] if strings else None
