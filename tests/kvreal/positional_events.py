"""Re-encode recorded vLLM 0.32 batches the way vLLM 0.9/0.10 sent them: each event a
tagged positional array (msgspec `array_like=True, tag=True`), plus one `BlockRemoved`
of the last two blocks of the second batch's chain. Run with the vLLM venv's python
(it has msgspec, the library vLLM encodes with):

    $GATEWAY_VLLM_PYTHON tests/kvreal/positional_events.py IN.msgpack OUT.msgpack
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import msgspec


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def convert(event: dict[str, Any]) -> KVCacheEvent:
    if event["type"] == "BlockStored":
        return BlockStored(event["block_hashes"], event["parent_block_hash"],
                           event["token_ids"], event["block_size"], event["lora_id"],
                           event["medium"])
    if event["type"] == "BlockRemoved":
        return BlockRemoved(event["block_hashes"], event["medium"])
    return AllBlocksCleared()


def main(src: str, dst: str) -> None:
    frames = msgspec.msgpack.decode(Path(src).read_bytes())
    enc = msgspec.msgpack.Encoder()
    out = []
    for topic, seq, payload in frames:
        batch = msgspec.msgpack.decode(payload)
        events = [convert(e) for e in batch[1]]
        rank = batch[2] if len(batch) > 2 else None
        out.append([topic, seq, enc.encode(KVEventBatch(batch[0], events, rank))])
    second = next(e for e in msgspec.msgpack.decode(frames[1][2])[1]
                  if e["type"] == "BlockStored")
    seq = int.from_bytes(out[-1][1], "big") + 1
    removal = KVEventBatch(0.0, [BlockRemoved(second["block_hashes"][-2:], "GPU")])
    out.append([b"kv", seq.to_bytes(8, "big"), enc.encode(removal)])
    Path(dst).write_bytes(msgspec.msgpack.encode(out))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
