"""Ask a replica where it publishes KV events: `GET /kv_event_sources` (vLLM >= 0.11),
so a backend URL alone is enough. I/O; parsing is source.parse_sources."""

from __future__ import annotations

from collections.abc import Mapping

import aiohttp

from gateway.events.source import EventSource, SourceError, parse_sources

MAX_BODY = 64 * 1024


async def discover(session: aiohttp.ClientSession, base_url: str,
                   timeout_s: float = 5.0, headers: Mapping[str, str] | None = None
                   ) -> list[EventSource]:
    """The replica's event sources; [] when it publishes none (404: an older vLLM or the
    simulator without events). Raises SourceError for an answer that makes no sense and
    aiohttp.ClientError / TimeoutError for a replica that cannot be asked."""
    url = base_url.rstrip("/") + "/kv_event_sources"
    async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s),
                           headers=headers) as resp:
        if resp.status == 404:
            return []
        if resp.status != 200:
            raise SourceError(f"{url}: HTTP {resp.status}")
        raw = await resp.content.read(MAX_BODY + 1)
        if len(raw) > MAX_BODY:
            raise SourceError(f"{url}: answer over {MAX_BODY} bytes")
    import json

    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # RecursionError: nested too deep
        raise SourceError(f"{url}: not JSON") from exc
    return parse_sources(doc, base_url)
