"""The router in token mode: exact predictions on replicas whose events flow, text mode on
the others, and the reset case (a replica whose cache was cleared is predicted to hold
nothing on the very next request, where the text index still believes it holds it)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from gateway.events.decode import AllBlocksCleared, BlockStored
from gateway.events.kvindex import KVConfig, KVIndex
from gateway.events.tokenmode import TokenMode
from gateway.routing.config import RoutingConfig
from gateway.routing.decision import ReplicaState
from gateway.routing.router import Router
from gateway.tokens.render import TokenRenderer
from gateway.tokens.template import load_template
from gateway.tokens.tokenize import TokenizerCache
from tests.kv_driver import decide

DATA = Path(__file__).parent / "data"
MODEL = DATA / "tiny-model"
REPLICAS = [ReplicaState("a", 0), ReplicaState("b", 0)]


@pytest.fixture
def renderer() -> TokenRenderer:
    return TokenRenderer("tiny", load_template(MODEL),
                         TokenizerCache.from_file(MODEL / "tokenizer.json"), 32)


def body() -> dict[str, Any]:
    out: dict[str, Any] = json.loads((DATA / "kv_events_vllm032.requests.json").read_text())[0]
    return out


def store_event(renderer: TokenRenderer, b: dict[str, Any]) -> BlockStored:
    """What vLLM publishes after computing the prompt (opaque engine hashes)."""
    ids = renderer.token_ids(b, "chat")
    full = len(ids) // 32
    return BlockStored(tuple(range(1000, 1000 + full)), None, tuple(ids[: full * 32]), 32)


def setup(renderer: TokenRenderer) -> tuple[Router, KVIndex]:
    index = KVIndex(KVConfig(predict_ttl_s=2.0))
    for r in ("a", "b"):
        index.add_replica(r, "tiny", 32)
        index.set_connected(r, True, 0.0)
    return Router(RoutingConfig(seed=1), TokenMode({"tiny": renderer}, index)), index


def test_reset_replica_predicts_nothing_next(renderer: TokenRenderer) -> None:
    router, index = setup(renderer)
    b = body()
    first = decide(router, b, "tiny", REPLICAS, 0.0)
    assert first.tokens is not None and first.decision.estimated_prompt_tokens == 834
    chosen = first.decision.replica
    index.apply(chosen, [store_event(renderer, b)], 0.1)
    again = decide(router, b, "tiny", REPLICAS, 0.2)
    assert again.decision.replica == chosen and again.decision.predicted_cached_tokens == 832
    index.apply(chosen, [AllBlocksCleared()], 0.3)
    after = decide(router, b, "tiny", REPLICAS, 0.4)
    assert after.predicted[chosen] == 0
    # Text mode (no token mode) still believes the replica holds the prompt.
    text = Router(RoutingConfig(seed=1))
    decide(text, b, "tiny", REPLICAS, 0.0, pin=chosen)
    assert decide(text, b, "tiny", REPLICAS, 0.4).predicted[chosen] > 0


def test_predictions_colocate_a_burst_then_expire(renderer: TokenRenderer) -> None:
    router, _ = setup(renderer)
    b = body()
    decide(router, b, "tiny", REPLICAS, 0.0, pin="a")
    sibling = decide(router, b, "tiny", REPLICAS, 0.5)  # before any event
    assert sibling.predicted["a"] == 832 and sibling.decision.replica == "a"
    late = decide(router, b, "tiny", REPLICAS, 5.0)  # never confirmed
    assert late.tokens is not None and late.tokens.matched["a"] == 0


def test_stale_replica_falls_back_to_text_mode(renderer: TokenRenderer) -> None:
    router, index = setup(renderer)
    index.set_connected("b", False, 0.0)
    plan = decide(router, body(), "tiny", REPLICAS, 0.0)
    assert plan.tokens is not None and set(plan.tokens.matched) == {"a"}
    index.set_connected("a", False, 0.0)
    plan = decide(router, body(), "tiny", REPLICAS, 0.0)
    assert plan.tokens is None  # nobody live: text mode throughout
    other = decide(router, body(), "other-model", REPLICAS, 0.0)
    assert other.tokens is None
