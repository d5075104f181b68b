"""Where a replica publishes its KV events, and how to read its sequence numbers. Pure.

`GET /kv_event_sources` answers vLLM's `KVEventsConfig` per data-parallel rank, e.g.
`{"0": {"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557",
"replay_endpoint": "tcp://*:5558", "topic": "kv", ...}}`. A wildcard or unspecified bind
address (`*`, `0.0.0.0`, `::`) is where the replica listens, so the gateway connects to
the replica's own host. Only `tcp://` endpoints are accepted from the network: the
address came from a server, and the gateway must not be steered to local IPC paths.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal
from urllib.parse import urlsplit


class SourceError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class EventSource:
    endpoint: str  # tcp://host:port of the PUB socket
    replay_endpoint: str | None
    topic: str = ""


def _connectable(endpoint: object, host: str) -> str:
    if not isinstance(endpoint, str) or not endpoint.startswith("tcp://"):
        raise SourceError(f"not a tcp:// endpoint: {endpoint!r:.80}")
    address = endpoint[len("tcp://") :]
    where, sep, port = address.rpartition(":")
    # ASCII digits only: str.isdigit() also takes "²", on which int() raises
    if not sep or not (port.isascii() and port.isdigit() and len(port) <= 5) \
            or not 0 < int(port) < 65536:
        raise SourceError(f"endpoint without a valid port: {endpoint!r:.80}")
    if where in ("*", "0.0.0.0", "[::]", "::", ""):
        where = f"[{host}]" if ":" in host else host
    if any(c.isspace() or c in "/?#@" for c in where):
        raise SourceError(f"bad host in endpoint: {endpoint!r:.80}")
    return f"tcp://{where}:{port}"


def parse_sources(doc: object, replica_url: str) -> list[EventSource]:
    """The sources in a `/kv_event_sources` answer (one per data-parallel rank)."""
    host = urlsplit(replica_url).hostname
    if not host:
        raise SourceError(f"replica URL without a host: {replica_url!r:.80}")
    if not isinstance(doc, Mapping):
        raise SourceError("kv_event_sources is not an object")
    configs = [doc] if "endpoint" in doc else [doc[k] for k in sorted(doc, key=str)]
    out: list[EventSource] = []
    for cfg in configs:
        if not isinstance(cfg, Mapping):
            raise SourceError("kv_event_sources entry is not an object")
        if not cfg.get("enable_kv_cache_events") or cfg.get("publisher", "zmq") != "zmq":
            continue
        replay = cfg.get("replay_endpoint")
        topic = cfg.get("topic") or ""
        if not isinstance(topic, str):
            raise SourceError("topic is not a string")
        out.append(EventSource(_connectable(cfg.get("endpoint"), host),
                               _connectable(replay, host) if replay else None, topic))
    return out


Action = Literal["apply", "duplicate", "gap", "restart"]


def classify(expected: int | None, seq: int, floor: int) -> Action:
    """What to do with batch `seq` when `expected` is the next one in order.

    `floor`: the lowest sequence number the live stream can still repeat. After a catch-up
    triggered by live batch t, batches t+1.. may arrive again live after the replay
    delivered them (duplicates); anything older than that, or anything older than
    `expected` once the stream is in order again, means the publisher restarted."""
    if expected is None or seq > expected:
        return "gap"
    if seq == expected:
        return "apply"
    return "duplicate" if seq >= floor else "restart"
