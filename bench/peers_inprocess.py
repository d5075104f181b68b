"""bench_peers.py's `--in-process` mode: the gateway's own Python per request, no sockets.
The ASGI app is driven directly, with bench_proxy's instant upstream answering with usage
that follows the prompt's size (as the socket backends do), and only the CPU spent inside
the app is counted; `--profile` cProfiles the first round.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from peers_load import Feed, plan


async def _in_process(feeds: list[Feed], warm: list[Feed], env: dict[str, str]) -> float:
    """Gateway CPU ms per request, driving the ASGI app with bench_proxy's instant upstream;
    the feeds take turns (turn t of every conversation, then turn t + 1)."""
    from bench_proxy import _InstantResponse, _InstantUpstream
    from proxy_servers import sized_completion

    class Upstream(_InstantUpstream):
        """Usage that follows the prompt's size, as the socket backends answer here."""

        async def send(self, method: str, url: str, headers: object, body: bytes | None,
                       timeouts: object) -> _InstantResponse:
            if body is not None and url.endswith("/chat/completions") and (
                    b'"stream":true' not in body):
                return _InstantResponse(False, sized_completion(body))
            return await super().send(method, url, headers, body, timeouts)

    from gateway.proxy.app import create_app
    from gateway.settings import parse_settings

    settings = parse_settings(None, env, backends=["http://127.0.0.1:1", "http://127.0.0.1:2"])
    app = create_app(settings, upstream=Upstream())  # type: ignore[arg-type]
    async with app.running():
        assert app.services is not None
        for _ in range(100):  # the monitor's first probes mark the replicas up
            if len(app.services.fleet.healthy()) == 2:
                break
            await asyncio.sleep(0.01)
        never = asyncio.get_running_loop().create_future()

        async def one(payload: bytes) -> bytes:
            messages = [{"type": "http.request", "body": payload, "more_body": False}]
            answer: list[bytes] = []

            async def receive() -> dict[str, object]:
                if messages:
                    return messages.pop()
                await never
                return {"type": "http.disconnect"}

            async def send(message: dict[str, object]) -> None:
                if message["type"] == "http.response.body":
                    answer.append(message.get("body", b""))  # type: ignore[arg-type]

            await app({"type": "http", "method": "POST", "path": "/v1/chat/completions",
                       "query_string": b"", "headers": [
                           (b"host", b"gw"), (b"content-type", b"application/json"),
                           (b"content-length", b"%d" % len(payload))]}, receive, send)
            return b"".join(answer)

        async def run(feeds: list[Feed]) -> tuple[float, int]:
            """The feeds take turns; CPU seconds inside the app only, and requests."""
            cpu, n = 0.0, 0
            live = list(dict.fromkeys(feeds))  # a shared queue once
            answers: dict[int, bytes | None] = {id(f): None for f in live}
            while live:
                nxt = []
                for f in live:
                    payload = f.next(answers[id(f)])
                    if payload is None:
                        continue
                    c0 = time.process_time()
                    answers[id(f)] = await one(payload)
                    cpu += time.process_time() - c0
                    n += 1
                    nxt.append(f)
                live = nxt
            return cpu, n

        await run(warm)
        cpu, n = await run(feeds)
        return cpu / n * 1000


def gateway_env(args: argparse.Namespace) -> dict[str, str]:
    """The gateway's settings beyond its defaults: the KV capacity its index models (the
    peers' prefix trees hold 32-64 M characters per worker by default; the gateway's
    default, 262,144 tokens, is about 1 MiB of prompt, less than these cases' working
    set, so its index would evict, and model the engine evicting, on every request), the
    admission queue pinned off, whatever the default (these cases never overload a replica), and
    whatever `--gateway-env` adds."""
    return {"GATEWAY_ROUTING__DEFAULT_CAPACITY_TOKENS": str(args.capacity_tokens),
            "GATEWAY_ADMISSION__ENABLED": "false",
            **dict(kv.split("=", 1) for kv in args.gateway_env)}


def run_in_process(cases: list[str], args: argparse.Namespace) -> int:
    import cProfile
    import gc

    import uvloop

    from gateway.serve import GC_YOUNG_THRESHOLD

    # the collector as `gateway serve` sets it: at CPython's default (700) young
    # collections would add 10-30 µs a request that the server does not pay
    gc.set_threshold(GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])
    for case in cases:
        make, _ = plan(case, args.scale, args.turns)
        runs = []
        for r in range(args.rounds):
            feeds, warm = make(2 * r + 10), make(2 * r + 11)
            if args.profile and r == 0:
                prof = cProfile.Profile()
                prof.enable()
                runs.append(uvloop.run(_in_process(feeds, warm, gateway_env(args))))
                prof.disable()
                prof.dump_stats(f"{args.profile}.{case}")
            else:
                runs.append(uvloop.run(_in_process(feeds, warm, gateway_env(args))))
        print(f"{case}: gateway CPU ms/req in process, median {statistics.median(runs):.4f} "
              f"(runs: {' '.join(f'{x:.4f}' for x in runs)})", flush=True)
    return 0
