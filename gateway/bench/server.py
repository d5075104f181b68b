"""What the endpoint under test accepts, learned before the workload runs.

- The model and its `max_model_len` from `/v1/models` (vLLM reports it per model): the
  sessions keep every prompt plus its `max_tokens` within it, as an agent would.
- Whether it accepts tools without a `tool_choice` (which means "auto"): vLLM answers 400
  unless started with `--enable-auto-tool-choice --tool-call-parser NAME`. Then the
  workload sends `tool_choice: "none"`, which vLLM accepts and which still renders the
  tools into the prompt, so what is cached does not change; the notice names the flags.
- How many characters of the workload's text make a token on this model: one sample
  prompt (the first session's first request) through `/tokenize`, so the sessions' prompt
  size estimates are right from the first turn (tokenizers differ by 2x and more).
- Each replica's KV block size from `vllm:cache_config_info` in its `/metrics`, for the
  bound (hits come in whole blocks of the replica's size).
- Behind this gateway (no replica URL given): the replicas it fronts, from its `/stats`
  (`replicas.<name>.url`, healthy ones), since a gateway serves neither `/tokenize` nor
  the engine's `/metrics`; the first of them tokenizes for the bound (`tokenize_url`).

`probe()` does the I/O; `tool_refusal()`, `block_size_of()` and `replica_urls()` are pure.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from gateway.replicas.scrape import parse_engine_metrics

TOOL_FLAGS = "--enable-auto-tool-choice --tool-call-parser NAME (hermes for Qwen2.5 models)"
_PROBE_TOOL = {"type": "function", "function": {"name": "probe", "parameters": {"type": "object"}}}


@dataclass(frozen=True, kw_only=True)
class ServerFacts:
    model: str
    max_model_len: int | None = None
    tool_choice: str | None = None  # None: send tools as the workload defines them
    block_size: int | None = None  # the smallest block size among the replicas read
    chars_per_token: float | None = None  # measured on a sample prompt, when /tokenize works
    tokenize_url: str | None = None  # a replica behind the gateway, for the bound
    notes: tuple[str, ...] = field(default=())


def tool_refusal(status: int, body: bytes) -> bool:
    """True when a 400 says tool_choice "auto" needs the server's tool flags."""
    return status == 400 and b"--enable-auto-tool-choice" in body


def block_size_of(metrics_text: str) -> int | None:
    return parse_engine_metrics(metrics_text, now=0.0).block_size  # time plays no part here


def replica_urls(stats: Any) -> list[str]:
    """The healthy replicas' URLs a gateway's `/stats` names (none for anything else)."""
    reps = stats.get("replicas") if isinstance(stats, dict) else None
    if not isinstance(reps, dict):
        return []
    return [r["url"] for _, r in sorted(reps.items())
            if isinstance(r, dict) and isinstance(r.get("url"), str)
            and r["url"].startswith(("http://", "https://")) and r.get("healthy") is not False]


async def _behind_gateway(http: aiohttp.ClientSession, base: str) -> list[str]:
    try:
        async with http.get(base + "/stats") as resp:
            return replica_urls(orjson.loads(await resp.read())) if resp.ok else []
    except (aiohttp.ClientError, orjson.JSONDecodeError):
        return []


def prompt_chars(body: dict[str, Any]) -> int:
    """The characters a session counts for a body (contents plus the tools' text)."""
    return sum(len(str(m.get("content") or "")) for m in body.get("messages") or ()) + len(
        str(body.get("tools") or [])
    )


async def probe(
    base_url: str, model: str | None = None, metrics_urls: Sequence[str] = (),
    timeout_s: float = 30.0, sample: dict[str, Any] | None = None, discover: bool = False,
) -> ServerFacts:
    """`sample`: a request body whose prompt is tokenized (on the first metrics URL's
    `/tokenize`, else the base URL's) to measure characters per token. `discover`: when the
    base URL is a gateway, use the replicas it names instead of `metrics_urls`."""
    base = base_url.rstrip("/")
    notes: list[str] = []
    tokenize_url = None
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as http:
        if discover:
            found = await _behind_gateway(http, base)
            if found:
                metrics_urls, tokenize_url = found, found[0]
        async with http.get(base + "/v1/models") as resp:
            cards = orjson.loads(await resp.read()).get("data") or []
        card: dict[str, Any] = next(
            (c for c in cards if model is None or c.get("id") == model), {}
        )
        name = model or str(card.get("id", ""))
        limit = card.get("max_model_len")
        max_model_len = limit if isinstance(limit, int) and limit > 0 else None
        body = {"model": name, "messages": [{"role": "user", "content": "probe"}],
                "tools": [_PROBE_TOOL], "max_tokens": 1}  # fmt: skip
        async with http.post(base + "/v1/chat/completions", json=body) as resp:
            refused = tool_refusal(resp.status, await resp.read())
        tool_choice = None
        if refused:
            tool_choice = "none"
            notes.append(
                'the server refuses tools without tool_choice ("auto"): start vLLM with '
                f'{TOOL_FLAGS}; sending tool_choice "none" instead (the tools still reach '
                "the prompt, so caching is unchanged)"
            )
        ratio = None
        if sample is not None:
            tokenize = (metrics_urls[0] if metrics_urls else base).rstrip("/") + "/tokenize"
            ask = {"model": name, "messages": sample.get("messages"), "tools": sample.get("tools")}
            try:
                async with http.post(tokenize, json=ask) as resp:
                    count = orjson.loads(await resp.read()).get("count") if resp.ok else None
            except (aiohttp.ClientError, orjson.JSONDecodeError):
                count = None
            if isinstance(count, int) and count > 0:
                ratio = prompt_chars(sample) / count
                if max_model_len and count + int(sample.get("max_tokens") or 0) > max_model_len:
                    notes.append(
                        f"the workload's first prompt alone is {count} tokens on this model, "
                        f"over max_model_len {max_model_len} with its max_tokens: sessions "
                        "like it will fail; start the replicas with a larger --max-model-len"
                    )
        sizes = []
        for url in metrics_urls:
            async with http.get(url.rstrip("/") + "/metrics") as resp:
                size = block_size_of((await resp.read()).decode(errors="replace"))
            if size:
                sizes.append(size)
    if len(set(sizes)) > 1:
        notes.append(f"replicas use different block sizes {sorted(set(sizes))}: the bound uses "
                     "the smallest (an upper bound for all)")  # fmt: skip
    return ServerFacts(
        model=name, max_model_len=max_model_len, tool_choice=tool_choice,
        block_size=min(sizes) if sizes else None, chars_per_token=ratio, notes=tuple(notes),
        tokenize_url=tokenize_url,
    )
