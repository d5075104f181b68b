"""What Starlette costs per request, in process (no sockets, no server): the same bytes
answered by a raw ASGI callable, by a Starlette endpoint (middleware, router, Request,
Response) and by a raw ASGI app routed through Starlette (`Route(path, asgi_app)`), the way
the gateway and the simulator could mount their inference paths instead of dispatching in
front. CPU time (process_time) per request, median of `--rounds`.

    .venv/bin/python bench/bench_asgi.py [--requests 20000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateway.asgi import Message, Receive, Scope, Send

BODY = b'{"status":"ok"}'
HEAD = [(b"content-type", b"application/json"), (b"content-length", str(len(BODY)).encode())]


async def raw(scope: Scope, receive: Receive, send: Send) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": HEAD})
    await send({"type": "http.response.body", "body": BODY})


class RawApp:
    """Neither a function nor a method: Starlette calls it as ASGI."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await raw(scope, receive, send)


async def endpoint(request: Request) -> Response:
    return Response(BODY, media_type="application/json")


def scope(method: str, path: str) -> dict[str, Any]:
    return {"type": "http", "method": method, "path": path, "raw_path": path.encode(),
            "query_string": b"", "headers": [], "root_path": ""}


async def per_request(app: Any, method: str, path: str, n: int) -> float:
    async def receive() -> Message:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: Message) -> None:
        return None

    start = time.process_time()
    for _ in range(n):
        await app(scope(method, path), receive, send)
    return (time.process_time() - start) / n * 1e6


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    star = Starlette(routes=[Route("/health", endpoint, methods=["GET"]),
                             Route("/v1/chat/completions", RawApp(), methods=["POST"])])
    cases = [("raw ASGI", raw, "GET", "/health"),
             ("Starlette endpoint", star, "GET", "/health"),
             ("raw ASGI routed by Starlette", star, "POST", "/v1/chat/completions")]
    print("| case | CPU us/request | rounds |\n|---|---|---|")
    for name, app, method, path in cases:
        rounds = [await per_request(app, method, path, args.requests) for _ in range(args.rounds)]
        print(f"| {name} | {statistics.median(rounds):.1f} | "
              f"{' '.join(f'{r:.1f}' for r in rounds)} |")


if __name__ == "__main__":
    asyncio.run(main())
