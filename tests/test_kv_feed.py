"""The KV-event feed on loopback: a real ZMQ publisher (vLLM's wire format, both
encodings) and the subscriber applying it to the index: catch-up on connect, gaps filled
from the replay socket, a lost gap, a publisher restart. Plus discovery and the sequence
rules as tables."""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Callable

import pytest

from gateway.events.decode import AllBlocksCleared, BlockStored
from gateway.events.kvindex import KVIndex
from gateway.events.publisher import Encoding, KVPublisher, encode_batch
from gateway.events.source import EventSource, SourceError, classify, parse_sources
from gateway.events.subscriber import KVSubscriber
from gateway.tokens.chain import chain_token_hashes, namespace

zmq_asyncio = pytest.importorskip("zmq.asyncio")


@pytest.mark.parametrize(("expected", "seq", "floor", "action"), [
    (None, 0, 0, "gap"), (None, 9, 0, "gap"), (3, 3, 3, "apply"),
    (3, 3, 0, "apply"), (3, 5, 3, "gap"), (13, 11, 11, "duplicate"), (13, 12, 11, "duplicate"),
    (13, 10, 11, "restart"), (3, 1, 3, "restart"), (3, 0, 3, "restart"),
])
def test_classify(expected: int | None, seq: int, floor: int, action: str) -> None:
    assert classify(expected, seq, floor) == action


@pytest.mark.parametrize(("doc", "sources"), [
    ({"0": {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:5557",
            "replay_endpoint": "tcp://*:5558", "topic": "kv"}},
     [EventSource("tcp://10.0.0.5:5557", "tcp://10.0.0.5:5558", "kv")]),
    ({"enable_kv_cache_events": True, "endpoint": "tcp://10.0.0.9:1", "replay_endpoint": None},
     [EventSource("tcp://10.0.0.9:1", None, "")]),
    ({"0": {"enable_kv_cache_events": False, "endpoint": "tcp://*:1"}}, []),
    ({"0": {"enable_kv_cache_events": True, "publisher": "null", "endpoint": "tcp://*:1"}}, []),
    ({"1": {"enable_kv_cache_events": True, "endpoint": "tcp://0.0.0.0:7"},
      "0": {"enable_kv_cache_events": True, "endpoint": "tcp://*:6"}},
     [EventSource("tcp://10.0.0.5:6", None, ""), EventSource("tcp://10.0.0.5:7", None, "")]),
])
def test_parse_sources(doc: object, sources: list[EventSource]) -> None:
    assert parse_sources(doc, "http://10.0.0.5:8000") == sources


@pytest.mark.parametrize("doc", [
    [], {"0": 3}, {"0": {"enable_kv_cache_events": True, "endpoint": "ipc:///tmp/x"}},
    {"0": {"enable_kv_cache_events": True, "endpoint": "tcp://*:http"}},
    {"0": {"enable_kv_cache_events": True, "endpoint": "tcp://*:70000"}},
    {"0": {"enable_kv_cache_events": True, "endpoint": "tcp://a/b:1"}},
    {"0": {"enable_kv_cache_events": True, "endpoint": "tcp://*:1", "topic": 5}},
])
def test_parse_sources_rejects(doc: object) -> None:
    with pytest.raises(SourceError):
        parse_sources(doc, "http://h:1")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def stored(tokens: list[int], key: int, parent: int | None) -> BlockStored:
    return BlockStored((key,), parent, tuple(tokens), 4)


async def until(cond: Callable[[], bool], within_s: float = 5.0) -> None:
    deadline = time.monotonic() + within_s
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


@pytest.mark.parametrize("encoding", ["map", "array"])
async def test_catch_up_gap_loss_and_restart(encoding: Encoding) -> None:
    ctx = zmq_asyncio.Context()
    pub_port, replay_port = free_port(), free_port()
    ep, rep = f"tcp://127.0.0.1:{pub_port}", f"tcp://127.0.0.1:{replay_port}"
    pub = KVPublisher(ctx, ep, rep, encoding=encoding)
    replay_task = asyncio.create_task(pub.serve_replay())
    index = KVIndex()
    index.add_replica("r", "m", 4)
    tokens = list(range(16))
    own = chain_token_hashes(tokens, namespace("m", None, None), 4)

    def m() -> int:
        return index.matched("r", own, time.monotonic())

    # Published before anyone listens: only the replay socket has it.
    pub.publish(0.0, [stored(tokens[:4], 100, None)])
    restarted: list[str] = []
    sub = KVSubscriber("r", EventSource(ep, rep, "kv"), index, ctx, time.monotonic,
                       on_restart=lambda name, now: restarted.append(name))
    task = asyncio.create_task(sub.run())
    try:
        await until(lambda: index.live("r", time.monotonic()))
        await asyncio.sleep(0.3)  # let the SUB connection settle
        pub.publish(0.0, [stored(tokens[4:8], 101, 100)])
        await until(lambda: m() == 2)
        assert sub.stats.replayed >= 1  # block 0 came from the replay
        # A batch the subscriber never saw live but the replay buffer holds: a gap.
        seq = pub._seq
        pub._seq += 1
        pub._buffer.append((seq, encode_batch(0.0, [stored(tokens[8:12], 102, 101)],
                                              encoding)))
        pub.publish(0.0, [stored(tokens[12:16], 103, 102)])
        await until(lambda: m() == 4)
        assert sub.stats.gaps == 1 and sub.stats.lost == 0
        # A batch nobody holds any more: the index is cleared rather than trusted.
        pub._seq += 1
        pub.publish(0.0, [stored(tokens[:4], 100, None)])
        await until(lambda: sub.stats.lost == 1)
        await until(lambda: m() == 1)
        # The publisher restarts (sequence from 0, empty cache, buffer gone).
        replay_task.cancel()
        pub.close()
        await asyncio.sleep(0.2)
        pub = KVPublisher(ctx, ep, rep, encoding=encoding)
        replay_task = asyncio.create_task(pub.serve_replay())
        await asyncio.sleep(0.5)  # the SUB reconnects by itself
        pub.publish(0.0, [stored(tokens[4:8], 201, 200)])  # parent unknown
        await until(lambda: sub.stats.restarts == 1)
        assert restarted == ["r"]  # the router is told once: it forgets the replica's memory
        assert m() == 0
        pub.publish(0.0, [AllBlocksCleared(), stored(tokens[:4], 300, None)])
        await until(lambda: m() == 1)
    finally:
        task.cancel()
        replay_task.cancel()
        await asyncio.gather(task, replay_task, return_exceptions=True)
        pub.close()
        ctx.term()
    assert not index.live("r", time.monotonic())


async def test_a_feed_of_garbage_is_logged_rate_limited_and_read_past(
        caplog: pytest.LogCaptureFixture) -> None:
    """A replica whose feed sends undecodable batches (not msgpack, wrong shapes, a seq
    frame of 3 bytes) as fast as it can: each one counted, the log told at most once a
    minute with the count (before: one warning line per batch, a log flood at the
    replica's rate), and the good batch after them applied."""
    ctx = zmq_asyncio.Context()
    ep = f"tcp://127.0.0.1:{free_port()}"
    pub = KVPublisher(ctx, ep, None)
    index = KVIndex()
    index.add_replica("r", "m", 4)
    tokens = list(range(4))
    own = chain_token_hashes(tokens, namespace("m", None, None), 4)
    sub = KVSubscriber("r", EventSource(ep, None, "kv"), index, ctx, time.monotonic)
    task = asyncio.create_task(sub.run())
    garbage = [b"\xc1", b"\x92\xa1x\xff", b"\x93" * 50, b""]
    try:
        await until(lambda: index.live("r", time.monotonic()))
        await asyncio.sleep(0.3)  # let the SUB connection settle
        with caplog.at_level(logging.WARNING, logger="gateway.events"):
            for i in range(400):
                pub._pub.send_multipart((b"kv", i.to_bytes(8, "big"),
                                         garbage[i % len(garbage)]))
            pub._pub.send_multipart((b"kv", b"abc", b"\x90"))
            await until(lambda: sub.stats.decode_errors == 401)
            pub.publish(0.0, [stored(tokens, 100, None)])
            await until(lambda: index.matched("r", own, time.monotonic()) == 1)
        lines = [r for r in caplog.records if "undecodable" in r.getMessage()]
        assert 1 <= len(lines) <= 2, len(lines)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        pub.close()
        ctx.term()
