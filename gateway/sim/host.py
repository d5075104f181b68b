"""What the API routes (`api_routes.py`) need of the app that mounts them, as protocols:
the app module imports the routes, so the routes name the app only through these."""

from __future__ import annotations

from typing import Any, Protocol

from gateway.sim.connector import KvConnector
from gateway.sim.replica import Replica
from gateway.sim.request import SimRequest
from gateway.sim.tokenizer import Tokenizer


class RouteConfig(Protocol):
    @property
    def model(self) -> str: ...
    @property
    def prompt_tokens_details(self) -> bool: ...
    @property
    def timing_comments(self) -> bool: ...
    @property
    def tool_call_parser(self) -> str | None: ...
    @property
    def tool_call_probability(self) -> float: ...
    @property
    def seed(self) -> int: ...


class RouteHost(Protocol):
    @property
    def replica(self) -> Replica: ...
    @property
    def connector(self) -> KvConnector | None: ...
    @property
    def tokenizer(self) -> Tokenizer: ...
    @property
    def config(self) -> RouteConfig: ...
    def _check_model(self, model: str | None) -> None: ...
    def _check_length(self, n: int, max_tokens: int | None) -> int | None: ...
    def _check_tools(self, choice: str | dict[str, Any] | None) -> None: ...


def timing(req: SimRequest) -> dict[str, Any]:
    """`--timing-comments`: the simulated latencies of one request. A decode leg's TTFT
    and e2e include its prefill leg's time on P (P/D, gateway/sim/connector.py), so a
    benchmark's TTFT covers both legs; the router's hop between them is not counted, as
    no hop is in any request's timing."""
    first = req.first_token if req.first_token is not None else req.arrival
    sched = req.first_scheduled if req.first_scheduled is not None else req.arrival
    end = req.finished if req.finished is not None else first
    before = req.remote_prefill_s
    return {
        "arrival_s": round(req.arrival, 6),
        "queue_ms": round((sched - req.arrival) * 1000, 3),
        "ttft_ms": round((first - req.arrival + before) * 1000, 3),
        "e2e_ms": round((end - req.arrival + before) * 1000, 3),
        "prompt_tokens": req.num_prompt_tokens,
        "cached_tokens": req.num_cached_tokens,
    }
