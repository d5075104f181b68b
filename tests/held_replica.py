"""A loopback replica that holds its chat answers until told (`Held`), and the gateway's
predicted cached tokens as its `x-gateway-cache` header tells them (`predicted`): the fleet
tests' way to keep a request in flight while the fleet changes under it."""

from __future__ import annotations

import asyncio
import re

import httpx
from aiohttp import web

from tests.proxy_fakes import COMPLETION, MODEL
from tests.servers import free_port
from tests.test_fleet_sources_loopback import ENGINE_METRICS


class Held:
    """A loopback replica whose chat answers wait until `release` is set; what it was asked."""

    def __init__(self) -> None:
        self.chats = 0
        self.auth: list[tuple[str, str]] = []  # ("health" | "chat", its Authorization)
        self.release = asyncio.Event()
        self.arrived = asyncio.Event()
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/chat/completions", self._chat)
        self.runner = web.AppRunner(app, access_log=None)
        self.port = 0

    async def _health(self, request: web.Request) -> web.Response:
        self.auth.append(("health", request.headers.get("Authorization", "")))
        return web.Response()

    @staticmethod
    async def _metrics(_request: web.Request) -> web.Response:
        return web.Response(text=ENGINE_METRICS)

    @staticmethod
    async def _models(_request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def _chat(self, request: web.Request) -> web.Response:
        await request.read()
        self.auth.append(("chat", request.headers.get("Authorization", "")))
        self.chats += 1
        self.arrived.set()
        await self.release.wait()
        return web.Response(body=COMPLETION, content_type="application/json")

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        await self.runner.setup()
        self.port = port or free_port()
        await web.TCPSite(self.runner, host, self.port).start()
        return f"http://{host}:{self.port}"


def predicted(resp: httpx.Response) -> int:
    """The predicted cached tokens the gateway names in its `x-gateway-cache` header."""
    found = re.search(r"predicted=(\d+)", resp.headers.get("x-gateway-cache", ""))
    return int(found.group(1)) if found else 0
