"""vLLM's KV-event wire types as msgspec structs, and the decoding of one batch payload.

The `kv` extra (msgspec, the library vLLM encodes its events with); `decode.py` imports
this module only when it decodes, so the simulator and the router keep importing the
event types without the extra.

The structs mirror `vllm/distributed/kv_events.py` (0.32 read; the earlier layout is in
`tests/kvreal/positional_events.py`). `EventBatch` is `array_like` in every version:
`[ts, [event, ...], data_parallel_rank?]`. The events changed encoding:

- vLLM >= 0.11: `KVCacheEvent(tag=True)`, a map with a `type` tag; the fields vLLM added
  later (`kv_cache_spec_kind`, `locality`, `session_id`, ...) are ignored, as msgspec
  ignores unknown fields;
- earlier: `KVCacheEvent(array_like=True, tag=True)`, a positional array, tag first;
  trailing elements a later version appended are ignored, missing optional ones are None.

msgspec cannot hold map and array structs in one union, so each event is kept raw in the
batch and decoded by its first byte (a msgpack map or array). msgspec checks the types
(block hashes are `int | bytes`, vLLM's `ExternalBlockHash`; a bool is neither);
`__post_init__` checks what types cannot say: `token_ids` holds exactly `block_size`
tokens per block hash. Errors are msgspec's `DecodeError` (not msgpack) and
`ValidationError` (not these types), with the path to the bad value.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

BlockHash = int | bytes
PositiveInt = Annotated[int, msgspec.Meta(gt=0)]
# A token id is packed as an unsigned 64-bit integer (tokens/chain.py): a negative one is
# refused here, as a malformed batch, rather than raising when it is hashed.
TokenId = Annotated[int, msgspec.Meta(ge=0)]


class Stored(msgspec.Struct, frozen=True, gc=False):
    """`BlockStored`'s fields common to both encodings, in vLLM's order."""

    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None
    token_ids: tuple[TokenId, ...]
    block_size: PositiveInt
    lora_id: int | None = None  # deprecated by vLLM for lora_name; not read
    medium: str | None = None
    lora_name: str | None = None

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.block_hashes) * self.block_size:
            raise ValueError(f"BlockStored carries {len(self.token_ids)} tokens for "
                             f"{len(self.block_hashes)} blocks of {self.block_size}")


class StoredMap(Stored, frozen=True, tag_field="type", tag="BlockStored"):
    # Per block, untagged: the LoRA name (when lora_name is set), multimodal pairs, the
    # cache_salt string, embedding digests. Only block 0 carries cache_salt.
    extra_keys: tuple[tuple[Any, ...] | None, ...] | None = None
    group_idx: int | None = None


class StoredArray(Stored, frozen=True, array_like=True, tag="BlockStored"):
    pass


class Removed(msgspec.Struct, frozen=True, gc=False):
    block_hashes: tuple[BlockHash, ...]
    medium: str | None = None


class RemovedMap(Removed, frozen=True, tag_field="type", tag="BlockRemoved"):
    group_idx: int | None = None


class RemovedArray(Removed, frozen=True, array_like=True, tag="BlockRemoved"):
    pass


class Cleared(msgspec.Struct, frozen=True, gc=False):
    pass


class ClearedMap(Cleared, frozen=True, tag_field="type", tag="AllBlocksCleared"):
    pass


class ClearedArray(Cleared, frozen=True, array_like=True, tag="AllBlocksCleared"):
    pass


WireEvent = Stored | Removed | Cleared


class Batch(msgspec.Struct, array_like=True, frozen=True, gc=False):
    ts: float
    events: tuple[msgspec.Raw, ...]
    data_parallel_rank: int | None = None


_BATCH = msgspec.msgpack.Decoder(Batch)
_MAP_EVENT = msgspec.msgpack.Decoder(StoredMap | RemovedMap | ClearedMap)
_ARRAY_EVENT = msgspec.msgpack.Decoder(StoredArray | RemovedArray | ClearedArray)
# msgpack's first byte: fixmap 0x80-0x8f, map16 0xde, map32 0xdf; fixarray 0x90-0x9f,
# array16 0xdc, array32 0xdd.
_MAPS = frozenset([*range(0x80, 0x90), 0xDE, 0xDF])
_ARRAYS = frozenset([*range(0x90, 0xA0), 0xDC, 0xDD])


def decode_batch(payload: bytes) -> tuple[float, list[WireEvent], int | None]:
    """(ts, events, data_parallel_rank) of one payload; raises msgspec's errors."""
    batch = _BATCH.decode(payload)
    return batch.ts, [_event(i, raw) for i, raw in enumerate(batch.events)], \
        batch.data_parallel_rank


def _event(index: int, raw: msgspec.Raw) -> WireEvent:
    head = memoryview(raw)[0]
    decoder: msgspec.msgpack.Decoder[Any]
    if head in _MAPS:
        decoder = _MAP_EVENT
    elif head in _ARRAYS:
        decoder = _ARRAY_EVENT
    else:
        raise msgspec.ValidationError(
            f"event {index} is neither a tagged map nor a tagged array")
    try:
        event: WireEvent = decoder.decode(raw)
    except msgspec.ValidationError as exc:
        raise msgspec.ValidationError(f"event {index}: {exc}") from exc
    return event
