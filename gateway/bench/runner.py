"""Replays a workload's agent sessions against an OpenAI-compatible endpoint.

Each session is a task that waits for its arrival time, takes one of `concurrency` session
slots, then plays its turns: wait the turn's think time, send the main request and its
fan-out siblings at once, feed the main reply back into the history. Workload seconds are
multiplied by `time_scale` to get wall seconds (compare sets it to 1/sim-speed so think
times stay in step with the simulator's compressed clock).

Every request becomes a `RequestRecord` (what the reports read) plus the body and reply
kept for the exact bound (`/tokenize` afterwards). A session whose main request fails
stops there: its history could not continue consistently. The whole run is bounded by
`max_wall_s`; sessions still running then are cancelled and counted as unfinished.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import aiohttp

from gateway.bench.apis import PATHS, Api, to_api
from gateway.bench.client import Exchange, post
from gateway.bench.progress import Progress
from gateway.bench.session import AgentSession, ServerLimits, TurnRequest
from gateway.bench.workload import SessionPlan, Workload

# How a request names its session: the `x-session-id` header, the body's
# `prompt_cache_key` or `user` field (what OpenAI clients send), or not at all (most
# applications: the gateway then recognises conversations by their content).
SessionIds = Literal["header", "prompt_cache_key", "user", "none"]
SESSION_IDS: tuple[SessionIds, ...] = ("header", "prompt_cache_key", "user", "none")


def named(body: dict[str, Any], session_id: str,
          how: SessionIds) -> tuple[dict[str, Any], dict[str, str]]:
    """(body, headers) of a request naming its session as `how` says."""
    if how == "header":
        return body, {"x-session-id": session_id}
    if how == "none":
        return body, {}
    return {**body, how: session_id}, {}


def program_headers(plan: SessionPlan) -> dict[str, str]:
    """Claude Code's headers naming a session's agent program and sub-agent (workload.py
    `subagents`); none for a session of no program."""
    if plan.program is None:
        return {}
    return {"x-claude-code-session-id": plan.program,
            "x-claude-code-agent-id": plan.agent_id or ""}


def tenant_key(tenant: str) -> str:
    """The API key a workload tenant sends (the gateway maps it back: `auth_keys`)."""
    return f"sk-bench-{tenant}"


def auth_keys(tenants: tuple[tuple[str, float], ...]) -> str:
    """`GATEWAY_AUTH__KEYS` for a workload's tenants."""
    return ",".join(f"{tenant_key(t)}={t}" for t, _ in tenants)


@dataclass(frozen=True, kw_only=True)
class RunOptions:
    base_url: str
    model: str = "sim-model"
    concurrency: int = 16  # sessions active at once
    time_scale: float = 1.0  # wall seconds per workload second
    request_timeout_s: float = 120.0
    max_wall_s: float = 600.0
    progress: bool = True
    label: str = "run"
    limits: ServerLimits = field(default_factory=ServerLimits)  # what the server accepts
    api: Api = "chat"  # which inference API the turns go to (gateway.bench.apis)
    session_ids: SessionIds = "header"
    # More instances of the same endpoint: requests go round robin over base_url and these,
    # as a plain load balancer in front of several gateways would send them.
    more_base_urls: tuple[str, ...] = ()


@dataclass(kw_only=True)
class RequestRecord:
    session_id: str
    agent: str
    turn: int
    sibling: int
    send_s: float  # wall seconds since the start of the run
    status: int
    error: str | None
    prompt_tokens: int | None
    cached_tokens: int | None
    completion_tokens: int | None
    ttft_ms: float | None
    e2e_ms: float
    timing: str  # "sim" (simulated clock) or "wall"
    sim_arrival_s: float | None
    replica: str | None
    route: str | None
    request_id: str | None
    tenant: str | None = None
    priority: str | None = None
    queue_ms: float | None = None  # wall ms the request waited in the gateway's queue
    # where a simulated request's TTFT went (simulated ms): waiting in the gateway's queue
    # and in the engine's own waiting queue (the simulator's `queue_ms`); the rest is prefill
    gateway_wait_ms: float | None = None
    engine_wait_ms: float | None = None
    # P/D: the prefill leg's replica (`x-gateway-prefill`); None when the request took one leg
    prefill: str | None = None


@dataclass(kw_only=True)
class RunResult:
    records: list[RequestRecord] = field(default_factory=list)
    bodies: list[dict[str, Any]] = field(default_factory=list)  # parallel to records
    replies: list[str] = field(default_factory=list)  # parallel to records
    wall_s: float = 0.0
    unfinished_sessions: int = 0


def record_of(req: TurnRequest, ex: Exchange, send_s: float, plan: SessionPlan | None = None,
              time_scale: float = 1.0) -> RequestRecord:
    """`time_scale` turns the gateway's queue wait (wall ms, `x-gateway-queue-ms`) into
    the simulator's time, where the simulated TTFT (which starts when the request reaches
    the engine) is measured: a queued request's TTFT is the wait plus that."""
    sim = ex.sim_timing
    queue = ex.headers.get("x-gateway-queue-ms")
    queue_ms = float(queue) if queue and queue.replace(".", "", 1).isdigit() else None
    ttft = float(sim["ttft_ms"]) if sim else ex.wall_ttft_ms
    if sim and ttft is not None and queue_ms:
        ttft += queue_ms / time_scale
    return RequestRecord(
        session_id=req.session_id,
        agent=req.agent,
        turn=req.turn,
        sibling=req.sibling,
        send_s=send_s,
        status=ex.status,
        error=ex.error,
        prompt_tokens=ex.prompt_tokens,
        cached_tokens=ex.cached_tokens,
        completion_tokens=ex.completion_tokens,
        ttft_ms=ttft,
        e2e_ms=float(sim["e2e_ms"]) if sim else ex.wall_e2e_ms,
        timing="sim" if sim else "wall",
        sim_arrival_s=float(sim["arrival_s"]) if sim and "arrival_s" in sim else None,
        replica=ex.headers.get("x-gateway-replica"),
        prefill=ex.headers.get("x-gateway-prefill"),
        route=ex.headers.get("x-gateway-route"),
        request_id=ex.headers.get("x-request-id"),
        tenant=plan.tenant if plan else None,
        priority=plan.priority if plan else None,
        queue_ms=queue_ms,
        gateway_wait_ms=(queue_ms or 0.0) / time_scale if sim else None,
        engine_wait_ms=float(sim["queue_ms"]) if sim and "queue_ms" in sim else None,
    )


class Runner:
    def __init__(self, workload: Workload, options: RunOptions) -> None:
        self.workload = workload
        self.options = options
        self.result = RunResult()
        self.progress = Progress(
            workload.request_count(), label=options.label, enabled=options.progress
        )
        self._start = 0.0
        self._sent = 0  # requests sent: the round robin over the base URLs

    async def run(self) -> RunResult:
        opts = self.options
        slots = asyncio.Semaphore(max(1, opts.concurrency))
        connector = aiohttp.TCPConnector(limit=0)
        self._start = time.perf_counter()
        async with aiohttp.ClientSession(connector=connector) as http:
            tasks = [
                asyncio.create_task(self._session(http, slots, plan))
                for plan in self.workload.sessions
            ]
            done, pending = await asyncio.wait(tasks, timeout=opts.max_wall_s)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            self.result.unfinished_sessions = len(pending) + sum(
                1 for t in done if t.exception() is not None or t.result() is False
            )
        self.result.wall_s = time.perf_counter() - self._start
        self.progress.close()
        return self.result

    async def _send(self, http: aiohttp.ClientSession, req: TurnRequest,
                    plan: SessionPlan) -> Exchange:
        opts = self.options
        send_s = time.perf_counter() - self._start
        body, headers = named(req.body, req.session_id, opts.session_ids)
        if plan.tenant is not None:
            headers = {**headers, "authorization": f"Bearer {tenant_key(plan.tenant)}"}
        if plan.priority is not None:
            headers = {**headers, "x-gateway-priority": plan.priority}
        headers = {**headers, **program_headers(plan)}
        urls = (opts.base_url, *opts.more_base_urls)
        base = urls[self._sent % len(urls)]
        self._sent += 1
        ex = await post(
            http,
            base.rstrip("/") + PATHS[opts.api],
            to_api(body, opts.api),
            headers=headers,
            timeout_s=opts.request_timeout_s,
        )
        self.result.records.append(record_of(req, ex, send_s, plan, opts.time_scale))
        self.result.bodies.append(req.body)
        self.result.replies.append(ex.text)
        self.progress.advance(error=ex.error is not None)
        return ex

    async def _session(
        self, http: aiohttp.ClientSession, slots: asyncio.Semaphore, plan: SessionPlan
    ) -> bool:
        """Play one session; False when it stopped early on a failed request."""
        wl = self.workload
        scale = self.options.time_scale
        wait = self._start + plan.start_s * scale - time.perf_counter()
        if wait > 0:
            await asyncio.sleep(wait)
        async with slots:
            session = AgentSession(
                plan, wl.prompts[plan.agent], self.options.model, wl.config.hygiene_break,
                self.options.limits, wl.config.tool_calls,
            )
            while not session.done:
                if session.next_delay_s > 0:
                    await asyncio.sleep(session.next_delay_s * scale)
                reqs = session.requests()
                exchanges = await asyncio.gather(*(self._send(http, r, plan) for r in reqs))
                if exchanges[0].error is not None:
                    self.progress.advance(self._remaining(plan, reqs[0].turn))
                    return False
                session.reply(exchanges[0].text, exchanges[0].prompt_tokens,
                              exchanges[0].tool_calls)
        return True

    @staticmethod
    def _remaining(plan: SessionPlan, failed_turn: int) -> int:
        return sum(1 + len(t.siblings) for t in plan.turns if t.index > failed_turn)


async def run_workload(workload: Workload, options: RunOptions) -> RunResult:
    return await Runner(workload, options).run()
