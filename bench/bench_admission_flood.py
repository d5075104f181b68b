"""Priorities at the admission defaults: a `low` flood beside a few `high` clients, on two
simulated replicas with `--max-num-seqs 4` and nothing configured but `[admission]
enabled = true` (as a new user would try it).

    .venv/bin/python bench/bench_admission_flood.py [--speed 1] [--seconds 30]

Starts `gateway sim --replicas 2 --max-num-seqs 4` and `gateway serve` in front of it, then:
1. unloaded: the `high` clients alone (`x-gateway-priority: high`; with no keys the default
   cap grants `normal`, the class above `low`), `--seconds / 3`;
2. flood: `--low` clients (40) send `low` requests back to back beside the same `high`
   clients; after `--warmup` seconds every answer's time to first token is kept.
Time to first token: from sending the request to the first content byte of the stream,
measured by the client (the gateway's queue wait included). Prints a JSON object of
p50/p90 per phase and class, the ratios the tests hold (tests/test_admission_faults.py),
and the gateway's `/stats` admission object at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
MODEL = "Qwen/Qwen2.5-7B-Instruct"


def free_ports(n: int) -> int:
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = int(s.getsockname()[1])
        try:
            for p in range(base, base + n):
                with socket.socket() as t:
                    t.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
    raise RuntimeError("no free ports")


def wait_ready(url: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(url)


def serve_command(gateway_src: Path | None, admission: bool) -> tuple[list[str], dict[str, str]]:
    """`gateway serve`'s argv and environment: this install's, or that of another source
    tree (`--gateway-src`: another commit's `gateway/`, from `git archive`), with the
    admission queue set on or off whatever that tree's default."""
    env = {**os.environ}
    argv = [str(Path(sys.executable).parent / "gateway"), "serve"]
    if gateway_src is not None:  # site off: the editable install would win the import
        paths = [str(gateway_src.resolve()), *(p for p in sys.path if "site-packages" in p)]
        env["PYTHONPATH"] = os.pathsep.join(paths)
        argv = [sys.executable, "-S", "-m", "gateway.cli", "serve"]
    env["GATEWAY_ADMISSION__ENABLED"] = "true" if admission else "false"
    return argv, env


@contextlib.contextmanager
def two_replicas(sim_args: list[str], gateway_src: Path | None, admission: bool,
                 serve_args: tuple[str, ...] = ()) -> Iterator[str]:
    """`gateway sim --replicas 2 *sim_args` and `gateway serve` in front of it (from
    `gateway_src` when given, `serve_command`), both stopped at the end; yields the
    gateway's URL once it is ready."""
    gw = [str(Path(sys.executable).parent / "gateway")]
    port, gport = free_ports(2), free_ports(1)
    sim = subprocess.Popen([*gw, "sim", "--replicas", "2", "--port", str(port), *sim_args],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    serve_argv, env = serve_command(gateway_src, admission)
    serve = None
    try:
        for i in range(2):
            wait_ready(f"http://127.0.0.1:{port + i}/health")
        serve = subprocess.Popen(
            [*serve_argv, "--host", "127.0.0.1", "--port", str(gport), *serve_args,
             "--backend", f"http://127.0.0.1:{port}", "--backend",
             f"http://127.0.0.1:{port + 1}"], env=env, cwd=gateway_src,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        url = f"http://127.0.0.1:{gport}"
        wait_ready(url + "/ready")
        yield url
    finally:
        for p in (serve, sim):
            if p is not None:
                p.terminate()
                p.wait(10)


def quantile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


async def ttft(client: httpx.AsyncClient, url: str, cls: str, n: int, tokens: int) -> float:
    body = {"model": MODEL, "stream": True, "max_tokens": tokens,
            "messages": [{"role": "user", "content": f"{cls} request {n}: say something"}]}
    start = time.monotonic()
    async with client.stream("POST", url + "/v1/chat/completions", json=body,
                             headers={"x-gateway-priority": cls}) as r:
        if r.status_code != 200:
            await r.aread()
            raise RuntimeError(f"{cls}: {r.status_code} {r.text[:200]}")
        first: float | None = None
        async for line in r.aiter_lines():
            if first is None and line.startswith("data: ") and '"content"' in line:
                first = time.monotonic() - start
        if first is None:
            raise RuntimeError(f"{cls}: no content")
        return first


async def clients(url: str, cls: str, count: int, tokens: int, until: float,
                  keep_from: float, out: list[float]) -> None:
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(
            max_connections=count + 4)) as client:
        async def one(i: int) -> None:
            n = 0
            while time.monotonic() < until:
                sent = time.monotonic()
                t = await ttft(client, url, cls, i * 100_000 + n, tokens)
                n += 1
                if sent >= keep_from:
                    out.append(t)
        await asyncio.gather(*(one(i) for i in range(count)))


async def measure(url: str, seconds: float, warmup: float, low: int, high: int,
                  low_tokens: int, high_tokens: int) -> dict[str, Any]:
    now = time.monotonic()
    alone: list[float] = []
    await clients(url, "high", high, high_tokens, now + seconds / 3, now, alone)
    now = time.monotonic()
    loaded: list[float] = []
    flood: list[float] = []
    end = now + warmup + seconds
    await asyncio.gather(
        clients(url, "low", low, low_tokens, end, now + warmup, flood),
        clients(url, "high", high, high_tokens, end, now + warmup, loaded))
    fig = {
        "unloaded_high": {"n": len(alone), "p50": quantile(alone, 0.5),
                          "p90": quantile(alone, 0.9)},
        "flood_high": {"n": len(loaded), "p50": quantile(loaded, 0.5),
                       "p90": quantile(loaded, 0.9)},
        "flood_low": {"n": len(flood), "p50": quantile(flood, 0.5),
                      "p90": quantile(flood, 0.9)},
    }
    h, u, lo = (fig["flood_high"]["p90"], fig["unloaded_high"]["p90"],
                fig["flood_low"]["p90"])
    if h is not None and u is not None and lo is not None:
        fig["high_p90_over_unloaded"] = round(h / u, 2)
        fig["high_p90_over_low_p90"] = round(h / lo, 3)
    return fig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--speed", type=float, default=1.0, help="the simulator's --speed")
    ap.add_argument("--seconds", type=float, default=30.0, help="flood phase, measured")
    ap.add_argument("--warmup", type=float, default=10.0, help="flood phase, not measured")
    ap.add_argument("--low", type=int, default=40)
    ap.add_argument("--high", type=int, default=2)
    ap.add_argument("--low-tokens", type=int, default=64)
    ap.add_argument("--high-tokens", type=int, default=8)
    ap.add_argument("--admission", choices=["on", "off"], default="on")
    ap.add_argument("--gateway-src", type=Path,
                    help="run `gateway serve` from this source tree instead (another "
                         "commit's `gateway/`, from `git archive`), the simulator as is")
    args = ap.parse_args()
    with two_replicas(["--max-num-seqs", "4", "--speed", str(args.speed)],
                      args.gateway_src, args.admission == "on") as url:
        fig = asyncio.run(measure(url, args.seconds, args.warmup, args.low, args.high,
                                  args.low_tokens, args.high_tokens))
        fig["admission"] = httpx.get(url + "/stats", timeout=10).json().get("admission")
        fig["args"] = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
        print(json.dumps(fig, indent=2))


if __name__ == "__main__":
    main()
