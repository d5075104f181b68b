"""`compare --backend URL ...`: replicas the user runs (real vLLM), not a simulator.

Policies run one after another on the same replicas, so each must start from an empty
prefix cache, or the second inherits the first one's hits. vLLM clears it on
`POST /reset_prefix_cache`, which exists only when the server runs with
`VLLM_SERVER_DEV_MODE=1` (404 otherwise; 0.32 answers `{"success": false}` while requests
still hold blocks). `reset_caches()` calls it on every replica and reports which could not
be reset; `contamination_notice()` turns that into the plain explanation `compare` prints.
"""

from __future__ import annotations

from collections.abc import Sequence

import aiohttp
import orjson


async def reset_caches(urls: Sequence[str], timeout_s: float = 30.0) -> dict[str, str]:
    """Reset each replica's prefix cache; {url: why not} for those that were not reset."""
    failed: dict[str, str] = {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as http:
        for url in urls:
            try:
                async with http.post(url.rstrip("/") + "/reset_prefix_cache") as resp:
                    status, body = resp.status, await resp.read()
            except (aiohttp.ClientError, TimeoutError) as e:
                failed[url] = f"{type(e).__name__}: {e}"
                continue
            why = reset_failure(status, body)
            if why:
                failed[url] = why
    return failed


def reset_failure(status: int, body: bytes) -> str | None:
    """Why a reset answer is not a reset (pure), or None when the cache was cleared."""
    if status == 404:
        return "no /reset_prefix_cache (the server is not in dev mode)"
    if status != 200:
        return f"HTTP {status}"
    try:
        data = orjson.loads(body) if body else None
    except orjson.JSONDecodeError:
        data = None
    if isinstance(data, dict) and data.get("success") is False:
        return "the replica refused (requests still running)"
    return None


def contamination_notice(failed: dict[str, str]) -> str:
    lines = ["caches could not be reset between policies, so each policy after the first "
             "would inherit the previous one's cache and its results would be contaminated:"]
    lines += [f"  {url}: {why}" for url, why in failed.items()]
    lines.append(
        "start the replicas with VLLM_SERVER_DEV_MODE=1 (then POST /reset_prefix_cache "
        "works), or run one policy per invocation (--policies NAME) and restart the "
        "replicas in between; --allow-dirty-cache runs anyway"
    )
    return "\n".join(lines)
