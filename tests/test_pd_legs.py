"""P/D's pure parts by table: the decode-first choice and its skip threshold
(gateway.pd.choice), the two legs' bodies (gateway.pd.legs, as real-vllm-pd.md's flow),
and what a failed leg allows (gateway.pd.failures)."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from gateway.pd.choice import choose_legs
from gateway.pd.config import PdConfig
from gateway.pd.failures import after_prefill, prefill_instead
from gateway.pd.legs import FRESH, answer_params, decode_body, prefill_body, transferred_tokens
from gateway.upstream.failure import Happened

P_PARAMS = {"do_remote_prefill": True, "do_remote_decode": False,
            "remote_block_ids": [[1, 2, 3]], "remote_engine_id": "e-1",
            "remote_request_id": "r-1", "remote_host": "127.0.0.1", "remote_port": 5600,
            "tp_size": 1, "remote_num_tokens": 96, "remote_prefill_cached_tokens": 32}


@pytest.mark.parametrize(("prompt", "cached", "threshold", "prefill", "two", "why"), [
    (1000, 0, 256, ["p1", "p2"], True, "remote"),  # cold: P computes it
    (1000, 744, 256, ["p1"], True, "remote"),  # 256 uncached: exactly the threshold
    (1000, 745, 256, ["p1"], False, "cached"),  # 255 uncached: D alone
    (1000, 1000, 256, ["p1"], False, "cached"),  # all cached on D
    (100, 0, 256, ["p1"], False, "cached"),  # a short prompt is never worth a transfer
    (100, 0, 0, ["p1"], True, "remote"),  # threshold 0: every request takes two legs
    (1000, 0, 256, [], False, "no_prefill"),  # no healthy prefill replica
    (10, 50, 0, ["p1"], True, "remote"),  # a prediction above the estimate: 0 uncached
])
def test_decode_first_choice(prompt: int, cached: int, threshold: int, prefill: list[str],
                             two: bool, why: str) -> None:
    legs = choose_legs(prompt_tokens=prompt, decode_cached=cached,
                       min_remote_prefill_tokens=threshold, prefill_ranked=prefill)
    assert (legs.two, legs.why) == (two, why)
    assert legs.prefill == (tuple(prefill) if two else ())
    assert legs.uncached_tokens == max(0, prompt - cached)


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize(("client", "expected"), [
    # plain: stream false and max_tokens 1 added
    (CHAT, {**CHAT, "stream": False, "max_tokens": 1}),
    # a stream: not streamed, stream_options dropped
    ({**CHAT, "stream": True, "stream_options": {"include_usage": True}, "max_tokens": 300},
     {**CHAT, "stream": False, "max_tokens": 1}),
    # max_completion_tokens only when sent; min_tokens removed
    ({**CHAT, "max_completion_tokens": 50, "min_tokens": 80, "temperature": 0},
     {**CHAT, "max_completion_tokens": 1, "max_tokens": 1, "stream": False, "temperature": 0}),
    # the client's own kv_transfer_params never reach P
    ({**CHAT, "kv_transfer_params": {"remote_block_ids": [[9]], "do_remote_prefill": True}},
     {**CHAT, "stream": False, "max_tokens": 1}),
    # completions
    ({"model": "m", "prompt": "abc", "stream": True, "min_tokens": 2},
     {"model": "m", "prompt": "abc", "stream": False, "max_tokens": 1}),
])
def test_prefill_leg_body(client: dict[str, Any], expected: dict[str, Any]) -> None:
    before = orjson.dumps(client)
    body = prefill_body(client)
    assert body == {**expected, "kv_transfer_params": dict(FRESH)}
    assert body["kv_transfer_params"] == {
        "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
        "remote_block_ids": None, "remote_host": None, "remote_port": None}
    assert orjson.dumps(client) == before  # the client's body is left as it was


def test_prefill_leg_with_the_decoders_params_asks_to_pull_them() -> None:
    d_params = {"do_remote_decode": False, "remote_block_ids": [[4, 5]],
                "remote_num_tokens": 1207, "remote_blocks_expiry_time": 12.5}
    body = prefill_body(CHAT, d_params)
    assert body["kv_transfer_params"] == {**d_params, "do_remote_decode": True}
    assert d_params["do_remote_decode"] is False  # not changed in place


@pytest.mark.parametrize("client", [
    CHAT,
    {**CHAT, "stream": True, "stream_options": {"include_usage": True}, "min_tokens": 80,
     "max_tokens": 300},
    {**CHAT, "kv_transfer_params": {"remote_block_ids": [[9]]}},
    {"model": "m", "prompt": [1, 2, 3], "max_tokens": 5},
])
def test_decode_leg_body_is_the_clients_with_ps_params_verbatim(client: dict[str, Any]) -> None:
    body = decode_body(client, P_PARAMS)
    assert body == {**client, "kv_transfer_params": P_PARAMS}
    assert "kv_transfer_params" not in CHAT


@pytest.mark.parametrize(("answer", "params"), [
    (orjson.dumps({"choices": [], "kv_transfer_params": P_PARAMS}), P_PARAMS),
    (orjson.dumps({"choices": []}), None),  # an engine without a connector
    (orjson.dumps({"kv_transfer_params": None}), None),
    (orjson.dumps({"kv_transfer_params": {}}), None),
    (orjson.dumps({"kv_transfer_params": [1]}), None),
    (orjson.dumps([1, 2]), None),
    (b"not json", None),
])
def test_answer_params(answer: bytes, params: dict[str, Any] | None) -> None:
    assert answer_params(answer) == params


@pytest.mark.parametrize(("params", "prompt", "moved"), [
    (P_PARAMS, 100, 96),
    ({"remote_num_tokens": "96"}, 100, 100),  # not a count: P's prompt
    ({"remote_num_tokens": True}, 100, 100),
    ({"remote_num_tokens": -1}, None, None),
    ({}, None, None),
])
def test_transferred_tokens(params: dict[str, Any], prompt: int | None,
                            moved: int | None) -> None:
    assert transferred_tokens(params, prompt) == moved


@pytest.mark.parametrize(("what", "step"), [
    ("not_delivered", "next_prefill"),
    ("pool_busy", "decode_alone"),
    ("timeout", "decode_alone"),
    ("broken", "decode_alone"),
    ("client_error", "decode_alone"),
    ("server_error", "decode_alone"),
    ("no_params", "decode_alone"),
])
def test_after_a_failed_prefill_leg(what: Happened, step: str) -> None:
    assert after_prefill(what) == step


@pytest.mark.parametrize(("what", "instead"), [
    ("server_error", True),  # the pull failed (kv_load_failure_policy "fail")
    ("broken", True),  # D gave up before its head: nothing reached the client
    ("not_delivered", False),  # the ordinary retry on the next D
    ("client_error", False),  # the client's request is bad: relayed
    ("timeout", False),  # D may still be working: never piled onto P
    ("pool_busy", False),
])
def test_after_a_failed_decode_leg(what: Happened, instead: bool) -> None:
    assert prefill_instead(what) is instead


@pytest.mark.parametrize(("fields", "error"), [
    ({"min_remote_prefill_tokens": -1}, "min_remote_prefill_tokens"),
    ({"reuse_ttl_s": 480}, "below the engine"),
    ({"reuse_ttl_s": 0}, "reuse_ttl_s"),
    ({"reuse_max_conversations": 0}, "reuse_max_conversations"),
])
def test_pd_config_bounds(fields: dict[str, Any], error: str) -> None:
    with pytest.raises(ValueError, match=error):
        PdConfig(**fields)
    assert PdConfig().reuse_ttl_s < 480
