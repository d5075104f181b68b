"""The llama.cpp facts the gateway relies on, checked directly against the engine (no
gateway): OpenAI endpoints, `cached_tokens` reporting, usage in the last streamed chunk,
one cache per replica, and a deterministic model file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.realengine.model import ModelSpec, Words, ensure_model

pytestmark = pytest.mark.realengine


def _chat(system: str, user: str = "hello there", **extra: Any) -> dict[str, Any]:
    return {
        "model": "tiny",
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
        "max_tokens": 4,
        "temperature": 0,
        **extra,
    }


def _stream_chunks(url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    chunks: list[dict[str, Any]] = []
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks


def test_model_file_is_deterministic_and_keyed_by_spec(tmp_path: Path) -> None:
    spec = ModelSpec(corpus_words=5_000, n_vocab=512)
    a = ensure_model(spec, tmp_path / "a")
    b = ensure_model(spec, tmp_path / "b")
    assert a.name == b.name
    assert a.read_bytes() == b.read_bytes()
    assert ModelSpec(corpus_words=5_000, n_vocab=512, seed=2).key() != spec.key()


def test_models_lists_the_alias(llama_pair: list[str]) -> None:
    data = httpx.get(llama_pair[0] + "/v1/models", timeout=10).json()["data"]
    assert [m["id"] for m in data] == ["tiny"]


def test_repeated_prompt_reports_cached_tokens_per_replica(llama_pair: list[str]) -> None:
    body = _chat("facts-cache " + Words(901).text(400))
    first = httpx.post(llama_pair[0] + "/v1/chat/completions", json=body, timeout=30).json()
    again = httpx.post(llama_pair[0] + "/v1/chat/completions", json=body, timeout=30).json()
    other = httpx.post(llama_pair[1] + "/v1/chat/completions", json=body, timeout=30).json()
    prompt = first["usage"]["prompt_tokens"]
    assert prompt > 300
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    # llama.cpp recomputes only the last token of an identical prompt.
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == prompt - 1
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


@pytest.mark.parametrize(("include_usage", "expect_usage"), [(True, True), (False, False)])
def test_stream_usage_only_in_final_chunk_when_asked(
    llama_pair: list[str], include_usage: bool, expect_usage: bool
) -> None:
    body = _chat("facts-stream " + Words(902).text(50), stream=True)
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    chunks = _stream_chunks(llama_pair[0], body)
    with_usage = [c for c in chunks if c.get("usage")]
    if expect_usage:
        assert with_usage == [chunks[-1]]
        assert chunks[-1]["choices"] == []
        assert chunks[-1]["usage"]["prompt_tokens"] > 50
        assert "cached_tokens" in chunks[-1]["usage"]["prompt_tokens_details"]
    else:
        assert with_usage == []
    assert any(c["choices"] and c["choices"][0]["delta"].get("content") for c in chunks)


def test_completions_endpoint_reports_usage(llama_pair: list[str]) -> None:
    body = {"model": "tiny", "prompt": Words(903).text(40), "max_tokens": 4}
    r = httpx.post(llama_pair[1] + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 200
    data = r.json()
    assert data["object"] == "text_completion"
    assert data["usage"]["prompt_tokens"] >= 40
    assert "cached_tokens" in data["usage"]["prompt_tokens_details"]
