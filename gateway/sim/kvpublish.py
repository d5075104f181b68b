"""The simulated replicas' KV-event publishing, as vLLM runs it with `--kv-events-config`.

Each replica binds a PUB socket and a ROUTER replay socket (gateway/events/publisher.py,
vLLM's `ZmqEventPublisher` wire format) and publishes, after every engine step, the batch
its block pool queued during that step (gateway/sim/kvevents.py). Like vLLM 0.32, nothing
is published between steps: a prefix-cache reset on an idle replica reaches subscribers
with the next step's batch. `GET /kv_event_sources` answers the configuration in force,
keyed by data-parallel rank, as vLLM does.

Replica i publishes on `port + 2i` and answers replays on `port + 2i + 1`. `pyzmq` and
`msgpack` are the `kv` extra.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from gateway.events.publisher import KVPublisher
from gateway.extras import require
from gateway.sim.engine import Engine

Encoding = Literal["map", "array"]
TOPIC = "kv"


@dataclass(frozen=True, slots=True)
class KVEventsOptions:
    port: int = 5557  # replica i: PUB on port + 2i, replay on port + 2i + 1
    encoding: Encoding = "map"  # "array": the positional events of vLLM before 0.11
    buffer_steps: int = 10_000  # batches kept for replay (vLLM's default)


def source_config(host: str, pub_port: int, replay_port: int, buffer_steps: int
                  ) -> dict[str, Any]:
    """A replica's `GET /kv_event_sources` answer (vLLM's `KVEventsConfig` per rank)."""
    bind = "*" if host in ("0.0.0.0", "") else host
    return {"0": {
        "enable_kv_cache_events": True, "publisher": "zmq",
        "endpoint": f"tcp://{bind}:{pub_port}",
        "replay_endpoint": f"tcp://{bind}:{replay_port}",
        "buffer_steps": buffer_steps, "hwm": 100_000, "max_queue_size": 100_000,
        "topic": TOPIC,
    }}


class ReplicaEvents:
    """One replica's publisher. `after_step` is the replica loop's hook."""

    def __init__(self, ctx: Any, engine: Engine, host: str, pub_port: int, replay_port: int,
                 options: KVEventsOptions, clock: Callable[[], float] = time.time) -> None:
        if engine.kv_events is None:
            raise ValueError("the engine does not queue KV events (EngineConfig.kv_events)")
        self._queue = engine.kv_events
        self._clock = clock
        self.sources = source_config(host, pub_port, replay_port, options.buffer_steps)
        self._publisher = KVPublisher(ctx, f"tcp://{host}:{pub_port}",
                                      f"tcp://{host}:{replay_port}", topic=TOPIC,
                                      encoding=options.encoding, buffer=options.buffer_steps)
        self._replay: asyncio.Task[None] = asyncio.get_running_loop().create_task(
            self._publisher.serve_replay())

    def after_step(self) -> None:
        events = self._queue.drain()
        if events:
            self._publisher.publish(self._clock(), events)

    async def close(self) -> None:
        self._replay.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._replay
        self._publisher.close()


def zmq_context() -> Any:
    """An asyncio ZMQ context (raises MissingExtra without the `kv` extra)."""
    require("msgpack", extra="kv", feature="KV-event publishing")
    zmq_asyncio = require("zmq.asyncio", extra="kv", feature="KV-event publishing")
    return zmq_asyncio.Context()
