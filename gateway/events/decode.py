"""vLLM KV-cache event batches (msgpack) -> typed events. Pure.

A ZMQ message is three frames: topic, an 8-byte big-endian sequence number, a msgpack
payload. The payload is an array `[ts, [event, ...], data_parallel_rank?]` (msgspec
`array_like`). Each event is encoded one of two ways, and both are decoded:

- vLLM >= 0.11 (0.32 measured): a map with a `type` tag, e.g.
  `{"type": "BlockStored", "block_hashes": [...], "parent_block_hash": h, "token_ids":
  [...], "block_size": 32, "lora_id": null, "lora_name": null, "extra_keys": [...], ...}`;
- earlier versions: a positional array with the tag first,
  `["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id,
  medium?, lora_name?]`, `["BlockRemoved", block_hashes, medium?]`, `["AllBlocksCleared"]`.

Block hashes are 64-bit ints by default and bytes with other hash functions; both are kept
as opaque keys (the gateway recomputes its own hashes from `token_ids`, so vLLM's hash
function and seed never matter). Malformed input raises `EventDecodeError`.
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
    import msgpack  # the `kv` extra; the simulator imports the event types without it

    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=False, use_list=True)
    except (msgpack.ExtraData, msgpack.FormatError, msgpack.StackError, ValueError) as exc:
        raise EventDecodeError(f"payload is not msgpack: {exc}") from exc
    if isinstance(raw, dict):  # a map-encoded batch (not sent by vLLM today; cheap to accept)
        raw = [raw.get("ts", 0.0), raw.get("events"), raw.get("data_parallel_rank")]
    if not isinstance(raw, list) or len(raw) < 2 or not isinstance(raw[1], list):
        raise EventDecodeError("payload is not [ts, [events], dp_rank?]")
    ts = raw[0]
    if not isinstance(ts, int | float):
        raise EventDecodeError("batch timestamp is not a number")
    rank = raw[2] if len(raw) > 2 and isinstance(raw[2], int) else None
    return EventBatch(seq, float(ts), tuple(decode_event(e) for e in raw[1]), rank)


def decode_event(raw: object) -> Event:
    if isinstance(raw, dict):
        return _from_map(raw)
    if isinstance(raw, list) and raw and isinstance(raw[0], str):
        return _from_array(raw)
    raise EventDecodeError(f"event is neither a tagged map nor a tagged array: {raw!r:.80}")


def _from_map(m: dict[Any, Any]) -> Event:
    kind = m.get("type")
    if kind == "BlockStored":
        return _stored(m.get("block_hashes"), m.get("parent_block_hash"), m.get("token_ids"),
                       m.get("block_size"), m.get("lora_name"), m.get("extra_keys"),
                       m.get("medium"), m.get("group_idx"))
    if kind == "BlockRemoved":
        return BlockRemoved(_keys(m.get("block_hashes")), _opt_str(m.get("medium")),
                            _opt_int(m.get("group_idx")))
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    raise EventDecodeError(f"unknown event type {kind!r:.40}")


def _from_array(a: list[Any]) -> Event:
    kind, rest = a[0], a[1:]
    rest += [None] * (8 - len(rest))
    if kind == "BlockStored":
        if len(a) < 5:
            raise EventDecodeError("BlockStored array too short")
        # [tag, hashes, parent, token_ids, block_size, lora_id, medium, lora_name]
        return _stored(rest[0], rest[1], rest[2], rest[3], rest[6], None, rest[5], None)
    if kind == "BlockRemoved":
        return BlockRemoved(_keys(rest[0]), _opt_str(rest[1]))
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    raise EventDecodeError(f"unknown event type {kind!r:.40}")


def _stored(hashes: object, parent: object, tokens: object, block_size: object,
            lora_name: object, extra: object, medium: object, group: object) -> BlockStored:
    keys = _keys(hashes)
    if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
        raise EventDecodeError("BlockStored token_ids is not a list of ints")
    if type(block_size) is not int or block_size <= 0:
        raise EventDecodeError("BlockStored block_size is not a positive int")
    if len(tokens) != len(keys) * block_size:
        raise EventDecodeError(
            f"BlockStored carries {len(tokens)} tokens for {len(keys)} blocks of {block_size}")
    extra_keys: tuple[tuple[Any, ...] | None, ...] | None = None
    if isinstance(extra, list):
        extra_keys = tuple(tuple(e) if isinstance(e, list) else None for e in extra)
    return BlockStored(keys, None if parent is None else _key(parent), tuple(tokens),
                       block_size, _opt_str(lora_name), extra_keys, _opt_str(medium),
                       _opt_int(group))


def _keys(raw: object) -> tuple[BlockKey, ...]:
    if not isinstance(raw, list):
        raise EventDecodeError("block_hashes is not a list")
    return tuple(_key(h) for h in raw)


def _key(raw: object) -> BlockKey:
    if isinstance(raw, bool) or not isinstance(raw, int | bytes):
        raise EventDecodeError(f"block hash is neither int nor bytes: {raw!r:.40}")
    return raw


def _opt_str(raw: object) -> str | None:
    return raw if isinstance(raw, str) else None


def _opt_int(raw: object) -> int | None:
    return raw if type(raw) is int else None
