"""vLLM KV-cache event batches (msgpack) -> typed events. Pure.

A ZMQ message is three frames: topic, an 8-byte big-endian sequence number, a msgpack
payload. The payload is an array `[ts, [event, ...], data_parallel_rank?]` (msgspec
`array_like`), decoded by vLLM's own definitions as msgspec structs (`wire.py`, the `kv`
extra) and handed on as the frozen dataclasses below, which the simulator and the router
use without the extra. Each event is encoded one of two ways, and both are decoded:

- vLLM >= 0.11 (0.32 measured): a map with a `type` tag, e.g.
  `{"type": "BlockStored", "block_hashes": [...], "parent_block_hash": h, "token_ids":
  [...], "block_size": 32, "lora_id": null, "lora_name": null, "extra_keys": [...], ...}`;
- earlier versions: a positional array with the tag first,
  `["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id,
  medium?, lora_name?]`, `["BlockRemoved", block_hashes, medium?]`, `["AllBlocksCleared"]`.

Block hashes are 64-bit ints by default and bytes with other hash functions; both are kept
as opaque keys (the gateway recomputes its own hashes from `token_ids`, so vLLM's hash
function and seed never matter). Malformed input raises `EventDecodeError`, whose
message carries msgspec's path to the bad value.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

BlockKey = int | bytes

# vLLM's end-of-replay marker in the sequence frame: -1 as a signed 8-byte int.
END_SEQ = (-1).to_bytes(8, "big", signed=True)


class EventDecodeError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: tuple[BlockKey, ...]
    parent_block_hash: BlockKey | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_name: str | None = None
    # Per block, untagged: the LoRA name (when lora_name is set), multimodal pairs, the
    # cache_salt string, embedding digests. Only block 0 carries cache_salt.
    extra_keys: tuple[tuple[Any, ...] | None, ...] | None = None
    medium: str | None = None
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[BlockKey, ...]
    medium: str | None = None
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    seq: int
    ts: float
    events: tuple[Event, ...]
    data_parallel_rank: int | None = None


def decode_seq(frame: bytes) -> int:
    """The sequence frame; -1 is the end-of-replay marker."""
    if len(frame) != 8:
        raise EventDecodeError(f"sequence frame of {len(frame)} bytes, expected 8")
    return int.from_bytes(frame, "big", signed=True)


def decode_message(frames: Sequence[bytes]) -> EventBatch:
    """[topic, seq, payload] (a PUB message, or a replay reply without its envelope)."""
    if len(frames) != 3:
        raise EventDecodeError(f"{len(frames)} frames, expected topic, seq, payload")
    return decode_payload(decode_seq(frames[1]), frames[2])


def decode_payload(seq: int, payload: bytes) -> EventBatch:
    # the `kv` extra; the simulator imports the event types without it
    import msgspec

    from gateway.events import wire

    try:
        ts, events, rank = wire.decode_batch(payload)
    except msgspec.ValidationError as exc:
        raise EventDecodeError(f"malformed event batch: {exc}") from exc
    except msgspec.DecodeError as exc:
        raise EventDecodeError(f"payload is not msgpack: {exc}") from exc
    out: list[Event] = []
    for e in events:
        if isinstance(e, wire.Stored):
            extra, group = (e.extra_keys, e.group_idx) if isinstance(e, wire.StoredMap) else (
                None, None)
            out.append(BlockStored(e.block_hashes, e.parent_block_hash, e.token_ids,
                                   e.block_size, e.lora_name, extra, e.medium, group))
        elif isinstance(e, wire.Removed):
            group = e.group_idx if isinstance(e, wire.RemovedMap) else None
            out.append(BlockRemoved(e.block_hashes, e.medium, group))
        else:
            out.append(AllBlocksCleared())
    return EventBatch(seq, ts, tuple(out), rank)
