"""Proxy CPU per request beside the proxies users would run instead, at agent prompt sizes.

In one run, with the same load and the same rounds: the gateway (`gateway serve`, default
settings, log level warning) in front of two instant fake vLLM backends, the bare aiohttp
relay (`proxy_servers.serve_relay`, the yardstick), sglang-router and vllm-router (Rust,
both `--policy cache_aware`), each in front of the same two backends. Every peer is only
ever pointed at the 127.0.0.1 backends this script starts.

Cases (`--cases`, comma separated):
- `2k`, `16k`, `64k`, `256k`: non-streaming chat at concurrency 32; each prompt is one of
  32 shared prefixes (a system message of ~90% of the size) plus a fresh user tail;
- `grow64k`, `grow256k`: 32 conversations at once, each `--turns` turns, every turn the
  previous prompt plus the backend's answer and a new user tail, up to that size;
- `stream`: 2 KiB prompts, 64-chunk SSE answers, concurrency 32.

Measured: CPU time (utime + stime from /proc/<pid>/stat, summed over the proxy's process
tree) per request; medians of `--rounds` rounds, the proxies taking turns inside each round
(the order rotates every round); the client's median latency beside it (informative: the
client, the backends and every proxy share the machine). Every round sends fresh tails and
fresh conversations, so no proxy sees a request twice.

The peers live in a bench-only environment, never in the project's dependencies:

    python3 -m venv ~/.cache/gateway-peers-venv && ~/.cache/gateway-peers-venv/bin/pip install sglang-router==0.3.2 vllm-router==0.1.17

(`--peers-venv DIR` points elsewhere; `--no-peers` measures the gateway and the relay only.)

    .venv/bin/python bench/bench_peers.py                      # all cases, 3 rounds (< 8 min)
    .venv/bin/python bench/bench_peers.py --cases 64k,grow256k --rounds 1 --scale 0.3
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import orjson
from proxy_servers import serve_backend, serve_relay

ROOT = Path(__file__).resolve().parent.parent
TICK = os.sysconf("SC_CLK_TCK")
KIB = 1024
CONCURRENCY = 32
PREFIXES = 32
ANSWER = "ok " * 16  # what the instant backend answers: the next turn repeats it

# case -> (kind, prompt bytes, requests per round at --scale 1)
CASES: dict[str, tuple[str, int, int]] = {
    "2k": ("fixed", 2 * KIB, 3000),
    "16k": ("fixed", 16 * KIB, 1500),
    "64k": ("fixed", 64 * KIB, 800),
    "256k": ("fixed", 256 * KIB, 300),
    "grow64k": ("grow", 64 * KIB, 0),
    "grow256k": ("grow", 256 * KIB, 0),
    "stream": ("stream", 2 * KIB, 1500),
}


# -- prompts ----------------------------------------------------------------------------------

_WORDS = (
    "the function returns a list of records for each request and the caller checks the "
    "status before it writes the result to the cache; if the file is missing we raise an "
    "error with the path and line number so the agent can retry with another tool call "
    "config value index buffer stream token model router replica prefix block hash table "
    "parse render encode decode commit branch test build deploy review patch diff merge"
).split()


class Text:
    """Deterministic prose with a few numbers in it (agent prompts are code, logs and
    tool output: numbers are common, and the hygiene scanner looks at every digit)."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def __call__(self, size: int) -> str:
        rng, words, out, n = self.rng, _WORDS, [], 0
        while n < size:
            w = words[rng.randrange(len(words))] if rng.random() > 0.04 else (
                f"line {rng.randrange(1, 999)}")
            out.append(w)
            n += len(w) + 1
        return " ".join(out)[:size]


def body(messages: list[dict[str, str]], stream: bool) -> bytes:
    doc: dict[str, object] = {"model": "bench", "max_tokens": 16, "messages": messages}
    if stream:
        doc["stream"] = True
    return orjson.dumps(doc)


def fixed_bodies(size: int, n: int, salt: int, stream: bool) -> list[bytes]:
    """n prompts of ~size bytes: one of 32 shared prefixes (~90%) plus a fresh tail."""
    shared = Text(size)
    prefixes = [f"Project {i} instructions. " + shared(int(size * 0.9)) for i in range(PREFIXES)]
    fresh = Text(salt)
    tail = max(16, size - int(size * 0.9))
    return [body([{"role": "system", "content": prefixes[i % PREFIXES]},
                  {"role": "user", "content": f"Task {salt}-{i}: " + fresh(tail)}], stream)
            for i in range(n)]


def conversations(size: int, turns: int, salt: int) -> list[Iterator[bytes]]:
    """32 conversations sharing a 2 KiB system prompt, each growing by the backend's
    answer and a new user tail every turn, reaching ~size bytes at its last turn."""
    system = Text(7)(2 * KIB)
    tail = max(64, (size - 2 * KIB) // turns - len(ANSWER))

    def one(c: int) -> Iterator[bytes]:
        text = Text(salt * 1000 + c)
        messages = [{"role": "system", "content": system}]
        for t in range(turns):
            if t:
                messages.append({"role": "assistant", "content": ANSWER})
            messages.append({"role": "user", "content": f"Conversation {salt}-{c}, step "
                             f"{t}: " + text(tail)})
            yield body(messages, False)

    return [one(c) for c in range(CONCURRENCY)]


# -- load -------------------------------------------------------------------------------------

async def drive(url: str, streams: list[Iterator[bytes]], timeout: float) -> list[float]:
    """Each stream is sent in order by its own worker (concurrency = len(streams))."""
    latencies: list[float] = []
    connector = aiohttp.TCPConnector(limit=len(streams))
    headers = {"content-type": "application/json"}
    async with aiohttp.ClientSession(connector=connector) as session:
        async def worker(bodies: Iterator[bytes]) -> None:
            for payload in bodies:
                t0 = time.perf_counter()
                async with session.post(url + "/v1/chat/completions", data=payload,
                                        headers=headers) as r:
                    async for _ in r.content.iter_any():
                        pass
                    if r.status != 200:
                        raise RuntimeError(f"{url}: status {r.status}")
                latencies.append(time.perf_counter() - t0)

        await asyncio.wait_for(asyncio.gather(*(worker(s) for s in streams)), timeout)
    return latencies


def shared_queue(bodies: list[bytes]) -> list[Iterator[bytes]]:
    """CONCURRENCY workers taking the next body from one list."""
    it = iter(bodies)
    return [it for _ in range(CONCURRENCY)]


# -- processes --------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def tree_cpu(root: int) -> float:
    """CPU seconds of root and every live descendant."""
    parents: dict[int, int] = {}
    times: dict[int, float] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        pid = int(entry)
        parents[pid] = int(fields[1])
        times[pid] = (int(fields[11]) + int(fields[12])) / TICK
    tree, frontier = {root}, [root]
    while frontier:
        p = frontier.pop()
        kids = [c for c, pp in parents.items() if pp == p and c not in tree]
        tree.update(kids)
        frontier.extend(kids)
    return sum(times.get(p, 0.0) for p in tree)


@dataclass
class Proxy:
    label: str
    proc: subprocess.Popen[bytes]
    url: str


def start(label: str, argv: list[str], env: dict[str, str] | None = None) -> Proxy:
    port = free_port()
    argv = [a.replace("{port}", str(port)).replace("{port2}", str(free_port())) for a in argv]
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    return Proxy(label, proc, f"http://127.0.0.1:{port}")


def wait_ready(p: Proxy, timeout: float) -> None:
    """Until a chat completion goes through (every proxy has its own readiness notion)."""
    deadline = time.monotonic() + timeout
    probe = fixed_bodies(2 * KIB, 1, 0, False)
    while time.monotonic() < deadline:
        if p.proc.poll() is not None:
            raise RuntimeError(f"{p.label} exited with {p.proc.returncode}")
        try:
            asyncio.run(drive(p.url, [iter(probe)], 5.0))
            return
        except (OSError, RuntimeError, TimeoutError, aiohttp.ClientError):
            time.sleep(0.25)
    raise TimeoutError(f"{p.label} not ready after {timeout:.0f} s")


def stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5)


# -- the run ----------------------------------------------------------------------------------

def plan(case: str, scale: float, turns: int) -> tuple[Callable[[int], list[Iterator[bytes]]], int]:
    """(streams for a salt, requests per round) of a case."""
    kind, size, n = CASES[case]
    if kind == "grow":
        return (lambda salt: conversations(size, turns, salt)), CONCURRENCY * turns
    count = max(CONCURRENCY, int(n * scale))
    stream = kind == "stream"
    return (lambda salt: shared_queue(fixed_bodies(size, count, salt, stream))), count


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--cases", default=",".join(CASES), help="comma-separated, of: "
                    + ", ".join(CASES))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--scale", type=float, default=1.0,
                    help="multiply the requests per round of the fixed-size cases")
    ap.add_argument("--turns", type=int, default=24, help="turns per growing conversation")
    ap.add_argument("--peers-venv", type=Path,
                    default=Path.home() / ".cache/gateway-peers-venv",
                    help="the venv holding sglang-router and vllm-router")
    ap.add_argument("--no-peers", action="store_true")
    ap.add_argument("--gateway-env", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--max-seconds", type=float, default=460.0,
                    help="stop measuring (and report what was measured) after this long")
    ap.add_argument("--out", type=Path, help="also append the table to this file")
    ap.add_argument("--backend-server", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--relay-server", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.backend_server:
        asyncio.run(serve_backend(args.backend_server))
        return 0
    if args.relay_server:
        import uvloop

        uvloop.run(serve_relay(int(args.relay_server[0]), args.relay_server[1:]))
        return 0
    cases = [c for c in args.cases.split(",") if c]
    for c in cases:
        if c not in CASES:
            ap.error(f"unknown case {c!r}")
    began = time.monotonic()
    procs: list[subprocess.Popen[bytes]] = []
    try:
        backends = []
        for _ in range(2):
            port = free_port()
            procs.append(subprocess.Popen([sys.executable, __file__, "--backend-server",
                                           str(port)]))
            backends.append(f"http://127.0.0.1:{port}")
        env = {**os.environ, **dict(kv.split("=", 1) for kv in args.gateway_env)}
        proxies = [
            start("gateway", [str(ROOT / ".venv/bin/gateway"), "serve", "--port", "{port}",
                              "--log-level", "warning",
                              *(a for b in backends for a in ("--backend", b))], env),
            start("bare relay", [sys.executable, __file__, "--relay-server", "{port}",
                                 *backends]),
        ]
        if not args.no_peers:
            py = str(args.peers_venv / "bin/python")
            common = ["--host", "127.0.0.1", "--port", "{port}", "--policy", "cache_aware",
                      "--prometheus-host", "127.0.0.1", "--prometheus-port", "{port2}",
                      "--worker-urls", *backends]
            proxies.append(start("sglang-router", [py, "-m", "sglang_router.launch_router",
                                                   *common, "--log-level", "error"]))
            proxies.append(start("vllm-router", [py, "-m", "vllm_router.launch_router",
                                                 *common, "--log-level", "error"]))
        procs += [p.proc for p in proxies]
        for p in proxies:
            wait_ready(p, 90.0)
        results: dict[tuple[str, str], list[tuple[float, float]]] = {}
        counts: dict[str, int] = {}
        salt = 1
        for case in cases:
            make, n = plan(case, args.scale, args.turns)
            counts[case] = n
            for p in proxies:  # warm up: connections, caches of the shared prefixes
                salt += 1
                asyncio.run(drive(p.url, [s for s, _ in zip(make(salt), range(4), strict=False)],
                                  120.0))
            for r in range(args.rounds):
                if time.monotonic() - began > args.max_seconds:
                    break
                k = r % len(proxies)
                for p in proxies[k:] + proxies[:k]:
                    salt += 1
                    streams = make(salt)
                    c0 = tree_cpu(p.proc.pid)
                    lat = asyncio.run(drive(p.url, streams, 300.0))
                    cpu = (tree_cpu(p.proc.pid) - c0) / len(lat) * 1000
                    results.setdefault((case, p.label), []).append(
                        (cpu, statistics.median(lat) * 1000))
            print(f"[{time.monotonic() - began:.0f} s] {case} done", file=sys.stderr, flush=True)
        table = report(cases, [p.label for p in proxies], results, counts)
        print(table)
        if args.out:
            with args.out.open("a") as f:
                f.write(table + "\n")
        return 0
    finally:
        stop(procs)


def report(cases: list[str], labels: list[str],
           results: dict[tuple[str, str], list[tuple[float, float]]],
           counts: dict[str, int]) -> str:
    head = ("| case | requests/round | " + " | ".join(f"{lb} CPU ms/req" for lb in labels)
            + " | gateway / bare relay | gateway / vllm-router |")
    lines = [head, "|" + "---|" * (len(labels) + 4)]
    detail = []
    for case in cases:
        med = {lb: statistics.median(x[0] for x in results[(case, lb)])
               for lb in labels if (case, lb) in results}
        if "gateway" not in med:
            continue
        cells = [f"{med[lb]:.3f}" if lb in med else "-" for lb in labels]
        bare = med.get("bare relay")
        vr = med.get("vllm-router")
        ratios = [f"{med['gateway'] / d:.2f}x" if d else "-" for d in (bare, vr)]
        lines.append(f"| {case} | {counts[case]} | " + " | ".join(cells + ratios) + " |")
        for lb in labels:
            runs = results.get((case, lb), [])
            detail.append(f"- {case}, {lb}: CPU ms/req per round "
                          + " ".join(f"{x[0]:.3f}" for x in runs)
                          + "; client p50 ms " + " ".join(f"{x[1]:.2f}" for x in runs))
    return "\n".join(lines) + "\n\n" + "\n".join(detail)


if __name__ == "__main__":
    sys.exit(main())
