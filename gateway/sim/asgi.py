"""ASGI plumbing shared by the simulator's handlers: body reading with a size cap and
disconnect watching (a whole response is gateway.asgi.whole)."""

from __future__ import annotations

import uuid

from gateway.asgi import Message, Receive, Scope, Send, whole
from gateway.sim.errors import bad_request
from gateway.sim.replica import Pending, Replica

__all__ = ["Message", "Receive", "Scope", "Send", "whole"]

MAX_BODY_BYTES = 32 * 1024 * 1024


def request_id(scope: Scope) -> str:
    for k, v in scope["headers"]:
        if k == b"x-request-id":
            return str(v.decode("latin-1"))
    return uuid.uuid4().hex


async def read_body(receive: Receive) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            raise bad_request("client disconnected while sending the body")
        chunk = msg.get("body", b"")
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise bad_request(f"Request body exceeds {MAX_BODY_BYTES} bytes")
        chunks.append(chunk)
        if not msg.get("more_body", False):
            return b"".join(chunks)


async def watch_disconnect(receive: Receive, replica: Replica, pending: Pending) -> None:
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            replica.abort(pending)
            return
