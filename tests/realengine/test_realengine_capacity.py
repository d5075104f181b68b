"""Capacity from configuration: llama.cpp reports no `vllm:cache_config_info`, so the
gateway must size its per-replica index from the TOML `[[replicas]] capacity_tokens`.

A replica configured with 300 tokens of capacity cannot be predicted to deliver a ~1k-token
prefix, whatever llama.cpp really caches; the usage log's `predicted_cached_tokens` shows
the capacity the router used. Checked with llama.cpp's `/metrics` on and off (off is
llama.cpp's default)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.realengine.engine import EngineOptions, llama_replicas
from tests.realengine.fleet import fronted
from tests.realengine.model import Words

pytestmark = pytest.mark.realengine

CAPACITY = 300


def _records(options: EngineOptions, log: Path, capacity: int | None) -> list[dict[str, Any]]:
    body = {
        "model": "tiny",
        "messages": [
            {"role": "system", "content": Words(77).text(1000)},
            {"role": "user", "content": "hello"},
        ],
        "max_tokens": 2,
    }
    usage_toml = f"\n[usage]\nlog_path = {json.dumps(str(log))}\n"
    with (
        llama_replicas(options, 2) as urls,
        fronted(urls, capacity_tokens=capacity, extra_toml=usage_toml) as gw,
    ):
        for _ in range(3):
            r = httpx.post(gw + "/v1/chat/completions", json=body, timeout=30)
            assert r.status_code == 200
    # The gateway has stopped: its usage sink has flushed.
    return [json.loads(line) for line in log.read_text().splitlines()]


@pytest.mark.parametrize("metrics", [True, False], ids=["metrics-on", "metrics-off"])
def test_configured_capacity_bounds_the_prediction(
    llama_options: EngineOptions, tmp_path: Path, metrics: bool
) -> None:
    options = dataclasses.replace(llama_options, metrics=metrics)
    recs = _records(options, tmp_path / "usage.jsonl", CAPACITY)
    assert len(recs) == 3
    first, *repeats = recs
    assert first["cached_tokens"] == 0
    for rec in repeats:
        assert rec["prompt_tokens"] > 1000
        # The engine delivered the whole prefix (it recomputes only the last token) ...
        assert rec["cached_tokens"] == rec["prompt_tokens"] - 1
        # ... but the gateway was told the replica holds at most CAPACITY tokens.
        assert 0 < rec["predicted_cached_tokens"] <= CAPACITY


def test_without_configured_capacity_the_whole_prefix_is_predicted(
    llama_options: EngineOptions, tmp_path: Path
) -> None:
    recs = _records(llama_options, tmp_path / "usage.jsonl", None)
    for rec in recs[1:]:
        assert rec["predicted_cached_tokens"] > 1000
        assert rec["predicted_cached_tokens"] <= rec["cached_tokens"]
