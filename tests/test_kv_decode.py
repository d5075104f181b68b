"""KV-event decoding on payloads recorded from real vLLM 0.32 (tagged maps) and the same
batches in the positional-array encoding of earlier versions."""

from __future__ import annotations

from pathlib import Path

import msgpack
import pytest

from gateway.events.decode import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventDecodeError,
    decode_message,
    decode_payload,
    decode_seq,
)

DATA = Path(__file__).parent / "data"


def frames(name: str) -> list[list[bytes]]:
    out: list[list[bytes]] = msgpack.unpackb((DATA / name).read_bytes())
    return out


@pytest.mark.parametrize("name", ["kv_events_vllm032.msgpack", "kv_events_positional.msgpack"])
def test_recorded_batches_decode(name: str) -> None:
    batches = [decode_message(f) for f in frames(name)]
    seqs = [b.seq for b in batches]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # consecutive
    # The recording starts with the reset that emptied the cache before the first request.
    assert [type(e) for e in batches[0].events] == [AllBlocksCleared, BlockStored]
    first = batches[0].events[1]
    assert isinstance(first, BlockStored)
    assert first.parent_block_hash is None and first.block_size == 32
    assert len(first.token_ids) == 32 * len(first.block_hashes) == 832
    second = batches[1].events[0]
    assert isinstance(second, BlockStored)
    assert second.parent_block_hash == first.block_hashes[-1]  # turn 2 extends turn 1
    kinds = [type(e) for e in batches[3].events]
    assert kinds == [AllBlocksCleared, BlockStored]  # reset, then the same prompt again


def test_both_encodings_agree() -> None:
    new = [decode_message(f) for f in frames("kv_events_vllm032.msgpack")]
    old = [decode_message(f) for f in frames("kv_events_positional.msgpack")]
    for a, b in zip(new, old, strict=False):
        for x, y in zip(a.events, b.events, strict=True):
            assert type(x) is type(y)
            if isinstance(x, BlockStored) and isinstance(y, BlockStored):
                assert (x.block_hashes, x.parent_block_hash, x.token_ids) == (
                    y.block_hashes, y.parent_block_hash, y.token_ids)


def test_salt_travels_in_extra_keys() -> None:
    salted = decode_message(frames("kv_events_vllm032.msgpack")[2]).events[0]
    assert isinstance(salted, BlockStored) and salted.extra_keys is not None
    assert salted.extra_keys[0] == ("tenant-a",)


def test_positional_removal() -> None:
    last = decode_message(frames("kv_events_positional.msgpack")[-1])
    assert isinstance(last.events[0], BlockRemoved) and len(last.events[0].block_hashes) == 2


def pack(events: list[object]) -> bytes:
    return msgpack.packb([1.0, events, 0])


@pytest.mark.parametrize(("payload", "match"), [
    (b"\xc1", "msgpack"),
    (msgpack.packb({"x": 1}), "Expected `array`, got `object`"),
    (msgpack.packb(["now", []]), r"Expected `float`, got `str` - at `\$\[0\]`"),
    (pack([{"type": "Nope"}]), r"event 0: Invalid value 'Nope' - at `\$.type`"),
    (pack([["Nope"]]), r"event 0: Invalid value 'Nope'"),
    (pack([42]), "neither"),
    (pack([{"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
            "token_ids": [1, 2], "block_size": 4}]), "2 tokens for 1 blocks"),
    (pack([{"type": "BlockStored", "block_hashes": [1.5], "parent_block_hash": None,
            "token_ids": [1], "block_size": 1}]),
     r"Expected `int \| bytes`, got `float` - at `\$.block_hashes\[0\]`"),
    (pack([{"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
            "token_ids": ["a"], "block_size": 1}]),
     r"Expected `int`, got `str` - at `\$.token_ids\[0\]`"),
    (pack([{"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
            "token_ids": [1], "block_size": 0}]), r"Expected `int` >= 1"),
    (pack([["BlockStored", [1]]]), "Expected `array` of at least length 5, got 2"),
    (pack([{"type": "BlockRemoved", "block_hashes": 7}]), r"got `int` - at `\$.block_hashes`"),
    (pack([{"type": "BlockStored", "block_hashes": [True], "parent_block_hash": None,
            "token_ids": [1], "block_size": 1}]), "got `bool`"),
    (pack([{"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
            "token_ids": [1], "block_size": 1, "lora_name": 5}]), r"at `\$.lora_name`"),
    (msgpack.packb([1.0, [], "rank"]), r"Expected `int \| null`, got `str` - at `\$\[2\]`"),
    (msgpack.packb([1.0, [{"type": "AllBlocksCleared"}]])[:-3], "truncated"),
])
def test_malformed_payloads(payload: bytes, match: str) -> None:
    with pytest.raises(EventDecodeError, match=match):
        decode_payload(0, payload)


@pytest.mark.parametrize(("frame", "seq"), [
    ((0).to_bytes(8, "big"), 0), ((7).to_bytes(8, "big"), 7), (b"\xff" * 8, -1)])
def test_sequence_frames(frame: bytes, seq: int) -> None:
    assert decode_seq(frame) == seq


def test_bytes_hashes_and_short_frames() -> None:
    batch = decode_payload(3, pack([{"type": "BlockStored", "block_hashes": [b"\x01" * 32],
                                     "parent_block_hash": b"\x00" * 32, "token_ids": [5],
                                     "block_size": 1}]))
    ev = batch.events[0]
    assert isinstance(ev, BlockStored) and ev.block_hashes == (b"\x01" * 32,)
    with pytest.raises(EventDecodeError, match="expected 8"):
        decode_seq(b"\x00")
    with pytest.raises(EventDecodeError, match="frames"):
        decode_message([b"kv", b"\x00" * 8])


def test_core_imports_without_the_kv_extra() -> None:
    """The simulator and the router import the event types; the `kv` extra's libraries
    (msgpack, msgspec, pyzmq, jinja2, tokenizers) load only when token mode is used."""
    import subprocess
    import sys

    code = (
        "import builtins\n"
        "real = builtins.__import__\n"
        "def guard(name, *a, **k):\n"
        "    if name.split('.')[0] in ('msgpack', 'msgspec', 'zmq', 'jinja2', 'tokenizers'):\n"
        "        raise ImportError('blocked ' + name)\n"
        "    return real(name, *a, **k)\n"
        "builtins.__import__ = guard\n"
        "import gateway.sim.engine, gateway.routing.router, gateway.events.kvindex\n"
        "import gateway.events.tokenmode, gateway.cli\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr


def test_mixed_encodings_unknown_fields_and_trailing_elements() -> None:
    """Fields a later vLLM adds to a map, and elements a later version appends to an
    array, are ignored; both encodings may share a batch."""
    batch = decode_payload(9, pack([
        {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
         "token_ids": [5, 6], "block_size": 2, "lora_id": None, "medium": "GPU",
         "lora_name": None, "extra_keys": [["salt"]], "group_idx": 1,
         "kv_cache_spec_kind": "full", "session_id": "s"},
        ["BlockStored", [2], 1, [7, 8], 2, None, "CPU", "adapter", "appended"],
        ["BlockRemoved", [2], "CPU", "appended"],
        {"type": "BlockRemoved", "block_hashes": [1], "medium": None, "group_idx": 3},
        ["AllBlocksCleared"],
    ]))
    assert batch.events == (
        BlockStored((1,), None, (5, 6), 2, None, (("salt",),), "GPU", 1),
        BlockStored((2,), 1, (7, 8), 2, "adapter", None, "CPU"),
        BlockRemoved((2,), "CPU"),
        BlockRemoved((1,), None, 3),
        AllBlocksCleared(),
    )
    assert (batch.seq, batch.ts, batch.data_parallel_rank) == (9, 1.0, 0)
