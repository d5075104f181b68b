"""Second outside review of issue 37: how long `gateway serve` takes to start when the DNS
resolver never answers (a DNS outage at start, a resolver behind a dead network path).
Each name's first resolution is bounded (RESOLVE_TIMEOUT_S, 5 s); `[discovery] dns` holds
up to 16 names; the Redis catch-up's wait (`FleetSources.settled`, 10 s) comes after."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from gateway.proxy.app import GatewayApp
from gateway.replicas import sources
from tests.test_fleet_sources_loopback import DEADLINE_S, settings

NAMES = [f"vllm-{i}.example:8000" for i in range(4)]


async def test_names_that_never_resolve_delay_the_start_by_one_timeout_not_one_each(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A resolver that never answers: every name's first resolution must be under way
    when the first one times out (they wait together), so the start is bounded by one
    RESOLVE_TIMEOUT_S, not by 16 x 5 s = 80 s before the gateway serves the static
    replicas it has (and a SIGHUP reload that restarts the DNS watches holds its lock as
    long). Found: gateway/replicas/sources.py:250-255 `FleetSources._watch` awaits each
    DnsWatch.start (its first resolution, :83-85) in turn; `settled`'s bound (app.py:223,
    CATCH_UP_JOIN_WAIT_S) does not count this time."""
    monkeypatch.setattr(sources, "RESOLVE_TIMEOUT_S", 0.3)  # the bound itself is not tested
    asked: list[str] = []
    seen_at_first_timeout: list[int] = []

    async def never(host: str, port: int) -> Sequence[str]:
        asked.append(host)
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            seen_at_first_timeout.append(len(set(asked)))
            raise
        return []

    app = GatewayApp(settings(dns=list(NAMES)), resolver=never)
    async with asyncio.timeout(DEADLINE_S):
        async with app.running():
            pass
    assert seen_at_first_timeout, "the resolver was never timed out"
    assert seen_at_first_timeout[0] == len(NAMES), (
        f"{seen_at_first_timeout[0]} of {len(NAMES)} names asked when the first timed out")
