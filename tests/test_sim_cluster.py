"""SimCluster in-process (the embedded-backend path), options validation, CLI, stats line."""

from __future__ import annotations

import asyncio
import json
import subprocess

import httpx
import pytest

from gateway.sim.cluster import SimCluster, SimOptions
from gateway.sim.statslog import stats_line
from tests.servers import free_port, free_ports, script, sim

MODEL = "Qwen/Qwen2.5-7B-Instruct"


async def test_cluster_serves_independent_replicas_and_stops() -> None:
    port = free_ports(2)
    cluster = SimCluster(SimOptions(replicas=2, port=port, speed=1000, timing_comments=True))
    await cluster.start()
    try:
        assert cluster.urls == [f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port + 1}"]
        body = {"messages": [{"role": "user", "content": "cluster " * 50}], "max_tokens": 3}
        async with httpx.AsyncClient(timeout=10) as client:
            usages = []
            for url in (cluster.urls[0], cluster.urls[0], cluster.urls[1]):
                r = await client.post(url + "/v1/chat/completions", json=body)
                usages.append(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
            assert usages[0] == 0 and usages[1] > 0 and usages[2] == 0
    finally:
        await cluster.stop()
    async with httpx.AsyncClient() as client:
        with pytest.raises(httpx.ConnectError):
            await client.get(cluster.urls[0] + "/health")


async def test_cluster_start_fails_cleanly_on_busy_port() -> None:
    port = free_port()
    first = SimCluster(SimOptions(replicas=1, port=port))
    await first.start()
    try:
        with pytest.raises(OSError):
            await SimCluster(SimOptions(replicas=1, port=port)).start()
    finally:
        await first.stop()
    await asyncio.sleep(0)


@pytest.mark.parametrize(
    "kw",
    [
        {"replicas": 0},
        {"kv_blocks": 1},
        {"speed": 0},
        {"port": 65535, "replicas": 2},
        {"max_num_seqs": 0},
        {"block_size": 0},
    ],
)
def test_options_are_validated(kw: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        SimOptions(**kw)  # type: ignore[arg-type]


def test_cli_rejects_bad_options() -> None:
    r = subprocess.run(
        [*script("gateway"), "sim", "--replicas", "0"], capture_output=True, timeout=30
    )
    assert r.returncode == 2 and b"replicas must be >= 1" in r.stderr


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (
            ("[127.0.0.1:8100]", 1000, 200, 10.0, 3, 1, 0.4567, 0.496),
            "[127.0.0.1:8100] Engine 000: Avg prompt throughput: 100.0 tokens/s, Avg generation "
            "throughput: 20.0 tokens/s, Running: 3 reqs, Waiting: 1 reqs, GPU KV cache usage: "
            "45.7%, Prefix cache hit rate: 49.6%",
        ),
        (
            ("r", 0, 0, 0.0, 0, 0, 0.0, 0.0),
            "r Engine 000: Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 0.0 "
            "tokens/s, Running: 0 reqs, Waiting: 0 reqs, GPU KV cache usage: 0.0%, Prefix cache "
            "hit rate: 0.0%",
        ),
    ],
)
def test_stats_line(args: tuple[str, int, int, float, int, int, float, float], line: str) -> None:
    assert stats_line(*args) == line


def test_salts_and_simulated_timing_over_http() -> None:
    with sim(1, ["--speed", "1000", "--timing-comments", "--seed", "3"]) as urls:
        base = urls[0]

        def send(content: str, salt: str | None = None) -> dict[str, float]:
            body: dict[str, object] = {
                "messages": [{"role": "user", "content": content}],
                "max_tokens": 2,
            }
            if salt is not None:
                body["cache_salt"] = salt
            r = httpx.post(base + "/v1/chat/completions", json=body, timeout=30)
            assert r.status_code == 200, r.text
            timing: dict[str, float] = json.loads(r.headers["x-sim-timing"])
            assert (
                timing["cached_tokens"]
                == r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            )
            return timing

        long = "simulated timing " * 700  # ~2k tokens
        cold = send(long, "a")
        warm = send(long, "a")
        other_salt = send(long, "b")
        assert cold["cached_tokens"] == 0 and other_salt["cached_tokens"] == 0
        assert warm["cached_tokens"] == (warm["prompt_tokens"] - 1) // 16 * 16
        assert warm["ttft_ms"] * 5 < cold["ttft_ms"]
        expected_ms = 1.5 + 0.033 * cold["prompt_tokens"]  # t_base + 33 us per uncached token
        assert expected_ms * 0.95 < cold["ttft_ms"] < expected_ms * 1.1
        short = send("short prompt here", "c")
        assert short["ttft_ms"] < cold["ttft_ms"] / 5
