"""Deterministic multi-session chat traffic and what the engine reported for it.

Workload: `sessions` chat sessions, each with its own ~`prefix_words`-word system prompt
(distinct per session, ~1 token per word with the generated tokenizer), playing `turns`
turns. Turn t sends the system prompt, every earlier user turn with the assistant answer
the engine actually gave, and a new ~`user_words`-word user message. Turns go in rounds;
the session order inside each round is shuffled with `seed`, so a round-robin router does
not map sessions onto replicas in a fixed pattern by accident. Up to `concurrency`
requests of one round are in flight together.

Each request is sent through an OpenAI-compatible base URL (the gateway) with the session
in `x-session-id` (or none, `session_ids=False`); the result keeps the engine-reported
`prompt_tokens` / `cached_tokens`, the replica and route headers the gateway set, TTFT
(streaming) and latency.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from tests.realengine.model import Words


@dataclass(frozen=True, kw_only=True)
class SessionPlan:
    sessions: int = 6
    turns: int = 4
    prefix_words: int = 1000
    user_words: int = 20
    max_tokens: int = 4
    seed: int = 11
    concurrency: int = 1
    stream: bool = False
    model: str = "tiny"
    session_ids: bool = True  # False: no x-session-id, as most applications send


@dataclass(frozen=True, kw_only=True)
class Result:
    session: int
    turn: int
    status: int
    replica: str | None
    route: str | None
    prompt_tokens: int
    cached_tokens: int | None
    ttft_s: float | None
    latency_s: float


@dataclass(kw_only=True)
class Summary:
    results: list[Result] = field(default_factory=list)

    @property
    def prompt_tokens(self) -> int:
        return sum(r.prompt_tokens for r in self.results)

    @property
    def cached_tokens(self) -> int:
        return sum(r.cached_tokens or 0 for r in self.results)

    @property
    def cached_ratio(self) -> float:
        return self.cached_tokens / max(1, self.prompt_tokens)

    def warm_ratio(self) -> float:
        """Cached share over turns after the first (the first turn of a session is cold
        whatever the routing)."""
        warm = [r for r in self.results if r.turn > 0]
        return sum(r.cached_tokens or 0 for r in warm) / max(1, sum(r.prompt_tokens for r in warm))

    def ttft_p50_ms(self) -> float | None:
        vals = [r.ttft_s for r in self.results if r.ttft_s is not None]
        return statistics.median(vals) * 1000 if vals else None

    def replicas_per_session(self) -> dict[int, set[str]]:
        out: dict[int, set[str]] = {}
        for r in self.results:
            out.setdefault(r.session, set()).add(r.replica or "?")
        return out


def _system_prompts(plan: SessionPlan) -> list[str]:
    return [
        f"You are agent {s}. " + Words(plan.seed * 1000 + s).text(plan.prefix_words)
        for s in range(plan.sessions)
    ]


async def _one(
    client: httpx.AsyncClient, plan: SessionPlan, session: int, turn: int,
    messages: list[dict[str, str]],
) -> tuple[Result, str]:  # fmt: skip
    body: dict[str, Any] = {
        "model": plan.model,
        "messages": messages,
        "max_tokens": plan.max_tokens,
        "temperature": 0,
    }
    headers = {"x-session-id": f"session-{session}"} if plan.session_ids else {}
    t0 = time.perf_counter()
    ttft: float | None = None
    usage: dict[str, Any] = {}
    text = ""
    if plan.stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
        async with client.stream("POST", "/chat/completions", json=body, headers=headers) as r:
            status, hdrs = r.status_code, r.headers
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                if ttft is None:
                    ttft = time.perf_counter() - t0
                chunk = json.loads(line[6:])
                for choice in chunk.get("choices") or []:
                    text += (choice.get("delta") or {}).get("content") or ""
                usage = chunk.get("usage") or usage
    else:
        r = await client.post("/chat/completions", json=body, headers=headers)
        status, hdrs = r.status_code, r.headers
        if status == 200:
            data = r.json()
            usage = data.get("usage") or {}
            text = data["choices"][0]["message"].get("content") or ""
    latency = time.perf_counter() - t0
    details = usage.get("prompt_tokens_details") or {}
    result = Result(
        session=session, turn=turn, status=status,
        replica=hdrs.get("x-gateway-replica"), route=hdrs.get("x-gateway-route"),
        prompt_tokens=int(usage.get("prompt_tokens") or 0),
        cached_tokens=details.get("cached_tokens"), ttft_s=ttft, latency_s=latency,
    )  # fmt: skip
    return result, text


async def run_sessions(base_url: str, plan: SessionPlan, request_timeout: float = 60.0) -> Summary:
    """Play `plan` against `base_url` (ending in /v1); every request must answer 200."""
    rng = random.Random(plan.seed)
    histories: list[list[dict[str, str]]] = [
        [{"role": "system", "content": p}] for p in _system_prompts(plan)
    ]
    user_words = Words(plan.seed + 1)
    summary = Summary()
    async with httpx.AsyncClient(base_url=base_url, timeout=request_timeout) as client:
        for turn in range(plan.turns):
            order = list(range(plan.sessions))
            rng.shuffle(order)
            for start in range(0, len(order), plan.concurrency):
                batch = order[start : start + plan.concurrency]
                for s in batch:
                    message = {"role": "user", "content": user_words.text(plan.user_words)}
                    histories[s].append(message)
                done = await asyncio.gather(
                    *(_one(client, plan, s, turn, list(histories[s])) for s in batch)
                )
                for s, (result, text) in zip(batch, done, strict=True):
                    if result.status != 200:
                        raise RuntimeError(f"session {s} turn {turn}: HTTP {result.status}")
                    summary.results.append(result)
                    histories[s].append({"role": "assistant", "content": text})
    return summary


def describe(summary: Summary) -> str:
    per = summary.replicas_per_session()
    spread = statistics.mean(len(v) for v in per.values()) if per else 0.0
    return (
        f"requests={len(summary.results)} prompt={summary.prompt_tokens} "
        f"cached={summary.cached_tokens} ratio={summary.cached_ratio:.3f} "
        f"warm_ratio={summary.warm_ratio():.3f} replicas/session={spread:.2f}"
    )


def by_replica(results: Sequence[Result]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for r in results:
        counts[r.replica or "?"] = counts.get(r.replica or "?", 0) + 1
    return counts
