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

    python3 -m venv ~/.cache/gateway-peers-venv && \
        ~/.cache/gateway-peers-venv/bin/pip install sglang-router==0.3.2 vllm-router==0.1.17

(`--peers-venv DIR` points elsewhere; `--no-peers` measures the gateway and the relay only.)

    .venv/bin/python bench/bench_peers.py                      # all cases, 3 rounds (< 8 min)
    .venv/bin/python bench/bench_peers.py --cases 64k,grow256k --rounds 1 --scale 0.3
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
from peers_inprocess import gateway_env, run_in_process
from peers_load import CASES, KIB, Feed, Queue, fixed_bodies, plan
from proxy_servers import serve_asgi_relay, serve_backend, serve_relay, serve_starlette_relay

ROOT = Path(__file__).resolve().parent.parent
TICK = os.sysconf("SC_CLK_TCK")
# -- load -------------------------------------------------------------------------------------

async def drive(url: str, feeds: list[Feed], limit_s: float) -> list[float]:
    """One worker per feed (concurrency = len(feeds); the same feed may appear repeatedly)."""
    latencies: list[float] = []
    connector = aiohttp.TCPConnector(limit=len(feeds))
    headers = {"content-type": "application/json"}
    async with aiohttp.ClientSession(connector=connector) as session:
        async def worker(feed: Feed) -> None:
            payload = feed.next(None)
            while payload is not None:
                t0 = time.perf_counter()
                async with session.post(url + "/v1/chat/completions", data=payload,
                                        headers=headers) as r:
                    answer = await r.read()
                    if r.status != 200:
                        raise RuntimeError(f"{url}: status {r.status}")
                latencies.append(time.perf_counter() - t0)
                payload = feed.next(answer)

        await asyncio.wait_for(asyncio.gather(*(worker(f) for f in feeds)), limit_s)
    return latencies


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
            asyncio.run(drive(p.url, [Queue(probe)], 5.0))
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
    ap.add_argument("--baseline", metavar="SRC", type=Path,
                    help="also run a gateway from this source tree (PYTHONPATH=SRC, e.g. a "
                    "`git archive <commit> gateway` unpacked): the column `gateway before`")
    ap.add_argument("--gateway-env", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--capacity-tokens", type=int, default=8 << 20,
                    help="the gateway's routing.default_capacity_tokens (default 8 Mi tokens, "
                    "32 MiB of prompt per replica, as vllm-router's default tree)")
    ap.add_argument("--max-seconds", type=float, default=460.0,
                    help="stop measuring (and report what was measured) after this long")
    ap.add_argument("--out", type=Path, help="also append the table to this file")
    ap.add_argument("--in-process", action="store_true",
                    help="no sockets, no peers: drive the gateway's ASGI app directly with an "
                    "instant upstream (the gateway's own Python per request)")
    ap.add_argument("--profile", metavar="PREFIX",
                    help="with --in-process: cProfile the first round to PREFIX.<case>")
    ap.add_argument("--asgi-relay", action="store_true",
                    help="also run the bare relay as an ASGI app on uvicorn (the gateway's "
                    "front, nothing else)")
    ap.add_argument("--starlette-relay", action="store_true",
                    help="also run the relay written on Starlette (route, Request.body(), "
                    "StreamingResponse) on uvicorn: the issue's 'bare starlette + aiohttp "
                    "relay'")
    ap.add_argument("--asgi-relay-server", nargs="+", help=argparse.SUPPRESS)
    ap.add_argument("--starlette-relay-server", nargs="+", help=argparse.SUPPRESS)
    ap.add_argument("--backend-server", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--relay-server", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.backend_server:
        asyncio.run(serve_backend(args.backend_server, sized=True))
        return 0
    if args.asgi_relay_server:
        import uvloop

        uvloop.run(serve_asgi_relay(int(args.asgi_relay_server[0]), args.asgi_relay_server[1:]))
        return 0
    if args.starlette_relay_server:
        import uvloop

        uvloop.run(serve_starlette_relay(int(args.starlette_relay_server[0]),
                                         args.starlette_relay_server[1:]))
        return 0
    if args.relay_server:
        import uvloop

        uvloop.run(serve_relay(int(args.relay_server[0]), args.relay_server[1:]))
        return 0
    cases = [c for c in args.cases.split(",") if c]
    for c in cases:
        if c not in CASES:
            ap.error(f"unknown case {c!r}")
    if args.in_process:
        return run_in_process(cases, args)
    began = time.monotonic()
    procs: list[subprocess.Popen[bytes]] = []
    try:
        backends = []
        for _ in range(2):
            port = free_port()
            procs.append(subprocess.Popen([sys.executable, __file__, "--backend-server",
                                           str(port)]))
            backends.append(f"http://127.0.0.1:{port}")
        env = {**os.environ, **gateway_env(args)}
        proxies = [
            start("gateway", [str(ROOT / ".venv/bin/gateway"), "serve", "--port", "{port}",
                              "--log-level", "warning",
                              *(a for b in backends for a in ("--backend", b))], env),
            start("bare relay", [sys.executable, __file__, "--relay-server", "{port}",
                                 *backends]),
        ]
        if args.asgi_relay:
            proxies.append(start("ASGI relay on uvicorn", [
                sys.executable, __file__, "--asgi-relay-server", "{port}", *backends]))
        if args.starlette_relay:
            proxies.append(start("starlette relay", [
                sys.executable, __file__, "--starlette-relay-server", "{port}", *backends]))
        if args.baseline:
            proxies.insert(1, start("gateway before", [
                str(ROOT / ".venv/bin/gateway"), "serve", "--port", "{port}", "--log-level",
                "warning", *(a for b in backends for a in ("--backend", b))],
                {**env, "PYTHONPATH": str(args.baseline.resolve())}))
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
                asyncio.run(drive(p.url, make(salt)[:4], 120.0))
            for r in range(args.rounds):
                if time.monotonic() - began > args.max_seconds:
                    break
                k = r % len(proxies)
                for p in proxies[k:] + proxies[:k]:
                    salt += 1
                    feeds = make(salt)
                    c0 = tree_cpu(p.proc.pid)
                    lat = asyncio.run(drive(p.url, feeds, 300.0))
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
    before = "gateway before" in labels
    star = "starlette relay" in labels
    head = ("| case | requests/round | " + " | ".join(f"{lb} CPU ms/req" for lb in labels)
            + " | gateway / bare relay | gateway / vllm-router |"
            + (" gateway / starlette relay |" if star else "")
            + (" gateway before / bare relay |" if before else ""))
    lines = [head, "|" + "---|" * (len(labels) + 4 + star + before)]
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
        if star:
            sr = med.get("starlette relay")
            ratios.append(f"{med['gateway'] / sr:.2f}x" if sr else "-")
        if before:
            old = med.get("gateway before")
            ratios.append(f"{old / bare:.2f}x" if old and bare else "-")
        lines.append(f"| {case} | {counts[case]} | " + " | ".join(cells + ratios) + " |")
        for lb in labels:
            runs = results.get((case, lb), [])
            detail.append(f"- {case}, {lb}: CPU ms/req per round "
                          + " ".join(f"{x[0]:.3f}" for x in runs)
                          + "; client p50 ms " + " ".join(f"{x[1]:.2f}" for x in runs))
    return "\n".join(lines) + "\n\n" + "\n".join(detail)


if __name__ == "__main__":
    sys.exit(main())
