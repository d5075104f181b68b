"""The token-mode index fed with real vLLM 0.32 events (recorded) and the gateway's own
rendering of the requests that produced them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgpack
import pytest

from gateway.events.decode import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    decode_message,
)
from gateway.events.kvindex import KVConfig, KVIndex
from gateway.tokens.render import TokenRenderer
from gateway.tokens.template import load_template
from gateway.tokens.tokenize import TokenizerCache

DATA = Path(__file__).parent / "data"
MODEL = DATA / "tiny-model"


@pytest.fixture(scope="module")
def renderer() -> TokenRenderer:
    return TokenRenderer("tiny", load_template(MODEL),
                         TokenizerCache.from_file(MODEL / "tokenizer.json"), 32)


def batches(name: str) -> list[EventBatch]:
    return [decode_message(f) for f in msgpack.unpackb((DATA / name).read_bytes())]


def bodies() -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = json.loads((DATA / "kv_events_vllm032.requests.json").read_text())
    return out


@pytest.mark.parametrize("name", ["kv_events_vllm032.msgpack", "kv_events_positional.msgpack"])
def test_recorded_events_match_requests(renderer: TokenRenderer, name: str) -> None:
    index = KVIndex()
    index.add_replica("r", "tiny", 32)
    turn1, turn2, salted = (renderer.prompt(b, "chat").hashes for b in bodies())
    got = batches(name)

    def m(hashes: list[int]) -> int:
        return index.matched("r", hashes, now=0.0)

    assert (m(turn1), m(turn2), m(salted)) == (0, 0, 0)
    index.apply("r", got[0].events, 0.0)
    assert (m(turn1), m(turn2), m(salted)) == (26, 26, 0)  # 832 of 834 prompt tokens
    index.apply("r", got[1].events, 0.0)
    assert m(turn2) == 33  # turn 2 extends turn 1's chain
    index.apply("r", got[2].events, 0.0)
    # A salt is a namespace of its own; the positional encoding predates cache_salt in
    # events (no extra_keys), so there the salted store cannot be told apart.
    assert m(salted) == (26 if "vllm032" in name else 0) and m(turn1) == 26
    index.apply("r", got[3].events, 0.0)  # reset, then turn 1 again
    assert (m(turn1), m(turn2), m(salted)) == (26, 26, 0)
    if len(got) > 4:  # the positional recording ends with a removal of turn 2's tail
        index.apply("r", [*got[1].events, *got[4].events], 0.0)
        assert m(turn2) == 31
    state = index.state("r")
    assert state is not None and state.unresolved == 0


def test_reset_predicts_nothing_on_the_next_request(renderer: TokenRenderer) -> None:
    index = KVIndex()
    index.add_replica("r", "tiny", 32)
    got = batches("kv_events_vllm032.msgpack")
    index.apply("r", got[0].events, 0.0)
    turn1 = renderer.prompt(bodies()[0], "chat").hashes
    turn2 = renderer.prompt(bodies()[1], "chat").hashes
    index.predict("r", turn2, 0.0)  # turn 2 sent: its new blocks predicted
    assert index.matched("r", turn2, 0.1) == len(turn2)
    index.apply("r", [AllBlocksCleared()], 0.1)
    assert index.matched("r", turn1, 0.2) == 0
    # Predictions go with the reset too: a fresh replica, only predicted blocks.
    fresh = KVIndex(KVConfig(predict_ttl_s=2.0))
    fresh.add_replica("r", "tiny", 32)
    fresh.predict("r", turn2, 0.0)
    assert fresh.matched("r", turn2, 0.1) == len(turn2)
    fresh.apply("r", [AllBlocksCleared()], 0.1)
    assert fresh.matched("r", turn2, 0.2) == 0


def test_unknown_parent_is_unresolved() -> None:
    index = KVIndex()
    index.add_replica("r", "m", 2)
    index.apply("r", [BlockStored((5,), 999, (1, 2), 2)], 0.0)
    state = index.state("r")
    assert state is not None and state.unresolved == 1 and index.held_blocks("r") == 0


def test_removed_and_shared_blocks() -> None:
    index = KVIndex()
    index.add_replica("r", "m", 2)
    # Two engine hashes for the same tokens (e.g. after an engine-side rehash): the block
    # stays held until both are removed.
    index.apply("r", [BlockStored((1,), None, (7, 8), 2), BlockStored((2,), None, (7, 8), 2)],
                0.0)
    assert index.held_blocks("r") == 1
    index.apply("r", [BlockRemoved((1,))], 0.0)
    assert index.held_blocks("r") == 1
    index.apply("r", [BlockRemoved((2, 3))], 0.0)
    assert index.held_blocks("r") == 0


@pytest.mark.parametrize(("events", "held"), [
    ([BlockStored((1,), None, (1, 2), 4)], 0),  # another block size: unresolved
    ([BlockStored((1,), None, (1, 2), 2, group_idx=1)], 0),  # not the full-attention group
    ([BlockStored((1, 2), None, (1, 2, 3, 4), 2)], 2),
])
def test_store_filters(events: list[BlockStored], held: int) -> None:
    index = KVIndex()
    index.add_replica("r", "m", 2)
    index.apply("r", events, 0.0)
    assert index.held_blocks("r") == held


@pytest.mark.parametrize(("now", "expected"), [(0.5, 3), (1.99, 3), (2.0, 0), (5.0, 0)])
def test_predictions_expire(now: float, expected: int) -> None:
    index = KVIndex(KVConfig(predict_ttl_s=2.0))
    index.add_replica("r", "m", 2)
    index.predict("r", [11, 12, 13], 0.0)
    assert index.matched("r", [11, 12, 13, 14], now) == expected


@pytest.mark.parametrize(("sends", "event_at", "now", "live"), [
    ([], None, 100.0, True),
    ([0.0, 1.0], None, 100.0, True),  # two unconfirmed: under the threshold of 3
    ([0.0, 1.0, 2.0], None, 12.0, False),
    ([0.0, 1.0, 2.0], None, 5.0, True),  # not overdue yet
    ([0.0, 1.0, 2.0], 3.0, 100.0, True),  # an event came after them: events flow
    ([0.0, 1.0, 2.0, 50.0], None, 55.0, False),
])
def test_liveness(sends: list[float], event_at: float | None, now: float, live: bool) -> None:
    index = KVIndex(KVConfig(stale_after_s=10.0, stale_requests=3))
    index.add_replica("r", "m", 2)
    index.set_connected("r", True, 0.0)
    for t in sends:
        index.predict("r", [1], t)
    if event_at is not None:
        index.apply("r", [], event_at)
    assert index.live("r", now) is live


def test_disconnected_or_unknown_is_not_live() -> None:
    index = KVIndex()
    index.add_replica("r", "m", 2)
    assert not index.live("r", 0.0)
    index.set_connected("r", True, 0.0)
    assert index.live("r", 0.0)
    index.set_connected("r", False, 1.0)
    assert not index.live("r", 1.0) and not index.live("nope", 1.0)
