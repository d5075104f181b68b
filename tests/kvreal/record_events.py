"""Record a real replica's KV-event frames (topic, seq, payload) to a msgpack file.

    python tests/kvreal/record_events.py http://127.0.0.1:PORT OUT.msgpack

Sends a few chat requests (two turns of one conversation, a second conversation, a cache
salt), resets the prefix cache (needs VLLM_SERVER_DEV_MODE=1), sends one more, and
writes every frame it received as `[[topic, seq, payload], ...]`, and the request
bodies beside it (OUT.requests.json).
"""

from __future__ import annotations

import json
import sys
import time
import urllib.request

import msgpack
import zmq


def post(base: str, path: str, body: dict[str, object] | None) -> bytes:
    data = json.dumps(body).encode() if body is not None else b""
    req = urllib.request.Request(base + path, data=data, method="POST",
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return bytes(resp.read())


def main(base: str, out: str) -> None:
    with urllib.request.urlopen(base + "/kv_event_sources", timeout=10) as resp:
        source = json.loads(resp.read())["0"]
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    host = base.split("//", 1)[1].rsplit(":", 1)[0]
    sub.connect(source["endpoint"].replace("*", host))
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    time.sleep(0.5)
    words = " ".join(f"w{i % 97} x{i % 13}" for i in range(150))
    first = [{"role": "user", "content": "Tell me about " + words}]
    bodies: list[dict[str, object]] = [
        {"model": "tiny", "messages": first, "max_tokens": 4},
        {"model": "tiny", "max_tokens": 4, "messages": [
            *first, {"role": "assistant", "content": "ok ok"},
            {"role": "user", "content": "more " + words[:300]}]},
        {"model": "tiny", "messages": first, "max_tokens": 4, "cache_salt": "tenant-a"},
    ]
    post(base, "/reset_prefix_cache", None)  # start from an empty cache
    time.sleep(0.5)
    while sub.poll(200):
        sub.recv_multipart()
    for body in bodies:
        post(base, "/v1/chat/completions", body)
    post(base, "/reset_prefix_cache", None)
    post(base, "/v1/chat/completions", bodies[0])
    frames: list[list[bytes]] = []
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        if sub.poll(500):
            frames.append(sub.recv_multipart())
    with open(out, "wb") as f:
        f.write(msgpack.packb(frames))
    with open(out.removesuffix(".msgpack") + ".requests.json", "w") as f:
        json.dump(bodies, f, indent=1)
    print(len(frames), "frames")
    sub.close(0)
    ctx.term()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
