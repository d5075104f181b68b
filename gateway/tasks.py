"""Background tasks' end: cancel them and wait until each has finished."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable


async def cancel_all(tasks: Iterable[asyncio.Task[None]]) -> None:
    """Cancel every task, then wait for each (a task that ends with an error would have
    logged it already; cancellation is the expected end)."""
    tasks = list(tasks)
    for t in tasks:
        t.cancel()
    for t in tasks:
        with contextlib.suppress(asyncio.CancelledError):
            await t
