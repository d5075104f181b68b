"""The simulated engine's KV-cache events feed the gateway's token-mode index exactly:
what the index predicts for a prompt equals what the engine then delivers, through
stores, evictions under KV pressure, salts and a reset."""

from __future__ import annotations

import pytest

from gateway.events.decode import AllBlocksCleared, BlockStored, decode_payload
from gateway.events.kvindex import KVIndex
from gateway.events.publisher import Encoding, encode_batch
from gateway.sim.engine import Engine
from gateway.sim.hashing import salt_key
from gateway.tokens.chain import chain_token_hashes, namespace
from tests.test_sim_engine import drain, make_engine, prompt, submit


def feed(engine: Engine, index: KVIndex, encoding: Encoding) -> list[object]:
    """One batch through the wire format, as the publisher would send it."""
    assert engine.kv_events is not None
    events = engine.kv_events.drain()
    batch = decode_payload(0, encode_batch(0.0, events, encoding))
    index.apply("r", batch.events, 0.0)
    return [type(e) for e in batch.events]


def predicted(index: KVIndex, ids: list[int], salt: str | None = None) -> int:
    hashes = chain_token_hashes(ids, namespace("m", None, salt), 16)
    return min(index.matched("r", hashes, 0.0) * 16, (len(ids) - 1) // 16 * 16)


@pytest.mark.parametrize("encoding", ["map", "array"])
def test_events_predict_delivery_under_pressure(encoding: Encoding) -> None:
    engine = make_engine(num_gpu_blocks=40, block_size=16, kv_events=True)
    index = KVIndex()
    index.add_replica("r", "m", 16)
    prompts = [prompt(200, base=1000 * k) for k in range(6)]  # 13 blocks each, 39 fit
    now = 0.0
    misses = 0
    for rnd in range(3):
        for ids in prompts:
            expect = predicted(index, ids)
            req = submit(engine, ids, now)
            now = drain(engine, now)
            feed(engine, index, encoding)
            misses += abs(req.num_cached_tokens - expect) >= 16
            assert req.num_cached_tokens == expect, (rnd, req.num_cached_tokens, expect)
    state = index.state("r")
    assert state is not None and state.removed > 0 and misses == 0


def test_salt_and_reset() -> None:
    engine = make_engine(num_gpu_blocks=200, block_size=16, kv_events=True)
    index = KVIndex()
    index.add_replica("r", "m", 16)
    ids = prompt(100)
    submit(engine, ids, 0.0, salt=salt_key("t1"))
    drain(engine, 0.0)
    assert BlockStored in feed(engine, index, "map")
    assert predicted(index, ids, "t1") == 96 and predicted(index, ids) == 0
    # The next turn extends the chain: its new blocks are stored with their parent.
    longer = ids + prompt(60, base=5000)
    assert predicted(index, longer, "t1") == 96
    submit(engine, longer, 0.5, salt=salt_key("t1"))
    drain(engine, 0.5)
    feed(engine, index, "array")
    assert predicted(index, longer, "t1") == 160 - 16 == (len(longer) - 1) // 16 * 16
    assert engine.reset_prefix_cache()
    assert feed(engine, index, "map") == [AllBlocksCleared]
    assert predicted(index, ids, "t1") == 0
    req = submit(engine, ids, 1.0, salt=salt_key("t1"))
    drain(engine, 1.0)
    assert req.num_cached_tokens == 0


def test_events_change_nothing_in_the_engine() -> None:
    results = []
    for on in (False, True):
        engine = make_engine(num_gpu_blocks=30, block_size=16, kv_events=on)
        assert (engine.kv_events is None) is not on
        got = []
        now = 0.0
        for k in (0, 1, 0, 2, 0, 1):
            req = submit(engine, prompt(150, base=1000 * k), now)
            now = drain(engine, now)
            got.append(req.num_cached_tokens)
        results.append(got)
    assert results[0] == results[1] and max(results[0]) > 0
