"""A raw HTTP/1.1 "replica" on loopback that records every byte it receives and answers by
script, including answers no well-behaved server would give (an endless head, a huge body,
`101 Switching Protocols`, garbage, a truncated chunked body, a close mid-stream).

It runs its own event loop in a thread so a gateway subprocess can talk to it while the test
drives the gateway with raw sockets. Requests are recorded as (request line, whole head).
The answer is chosen by the request path (`/v1/echo`, `/v1/endless-head`, ...) or, for
inference calls, by the `"mode"` named in the body's first message content.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import orjson

MODELS = orjson.dumps({"object": "list", "data": [{"id": "m", "object": "model"}]})
USAGE = {"prompt_tokens": 10, "completion_tokens": 1, "total_tokens": 11,
         "prompt_tokens_details": {"cached_tokens": 0}}


def response(status: str, body: bytes, content_type: bytes = b"application/json") -> bytes:
    return (b"HTTP/1.1 " + status.encode() + b"\r\ncontent-type: " + content_type +
            b"\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


def completion(text: str) -> bytes:
    return orjson.dumps({"id": "cmpl-1", "object": "chat.completion", "model": "m",
                         "choices": [{"index": 0, "finish_reason": "stop",
                                      "message": {"role": "assistant", "content": text}}],
                         "usage": USAGE})


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


SSE_HEAD = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\n\r\n")
EVENT = b'data: {"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"x"}}]}\n\n'  # noqa: E501


@dataclass
class Recorder:
    requests: list[tuple[bytes, bytes]] = field(default_factory=list)
    port: int = 0
    huge_bytes: int = 80 * 1024 * 1024
    endless_s: float = 3.0

    def inference(self) -> list[bytes]:
        """Request lines of everything but the gateway's own health/models/metrics calls."""
        return [line for line, _ in self.requests
                if not line.startswith((b"GET /health", b"GET /v1/models ", b"GET /metrics"))]

    async def _answer(self, line: bytes, body: bytes,
                      writer: asyncio.StreamWriter) -> bool:
        """Write the answer; False to close the connection afterwards."""
        path = line.split(b" ")[1] if line.count(b" ") >= 2 else b""
        mode = path.decode("latin-1")
        if body:
            with contextlib.suppress(orjson.JSONDecodeError, KeyError, IndexError, TypeError):
                mode = "/v1/" + str(orjson.loads(body)["messages"][0]["content"])
        if path == b"/health":
            writer.write(response("200 OK", b"{}"))
        elif path == b"/v1/models":
            writer.write(response("200 OK", MODELS))
        elif mode.startswith("/v1/endless-head"):
            writer.write(b"HTTP/1.1 200 OK\r\n")
            loop = asyncio.get_running_loop()
            end = loop.time() + self.endless_s
            while loop.time() < end and not writer.is_closing():
                writer.write(b"x-filler: " + b"a" * 4000 + b"\r\n")
                await writer.drain()
            return False
        elif mode.startswith("/v1/huge"):
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                         b"content-length: " + str(self.huge_bytes).encode() + b"\r\n\r\n")
            block = b"x" * 65536
            for _ in range(self.huge_bytes // len(block)):
                if writer.is_closing():
                    break
                writer.write(block)
                await writer.drain()
            return False
        elif mode.startswith("/v1/upgrade"):
            writer.write(b"HTTP/1.1 101 Switching Protocols\r\nupgrade: h2c\r\n\r\n")
            await writer.drain()
            await asyncio.sleep(0.3)  # then speaks another protocol
            writer.write(b"\x00\x00\x12\x04\x00\x00\x00\x00\x00")
        elif mode.startswith("/v1/garbage"):
            writer.write(b"NOT HTTP AT ALL\r\n\r\n")
            return False
        elif mode.startswith("/v1/truncated"):
            writer.write(SSE_HEAD + chunk(EVENT) + b"ff\r\ndata: {\"partial")
            await writer.drain()
            return False
        elif mode.startswith("/v1/close-mid"):
            writer.write(SSE_HEAD + chunk(EVENT) + chunk(EVENT))
            await writer.drain()
            return False
        elif mode.startswith("/v1/slow-injected"):
            await asyncio.sleep(0.5)
            writer.write(response("200 OK", b'{"injected": true}'))
        else:  # echo: the answer names what was asked, so a mixed-up answer shows
            writer.write(response("200 OK", completion(f"echo {path.decode('latin-1')}")))
        await writer.drain()
        return True

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                line = head.split(b"\r\n", 1)[0]
                length = 0
                for h in head.split(b"\r\n")[1:]:
                    if h.lower().startswith(b"content-length:"):
                        length = int(h.split(b":", 1)[1])
                body = await reader.readexactly(length) if length else b""
                self.requests.append((line, head))
                if not await self._answer(line, body, writer):
                    break
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            pass
        writer.close()

    @contextlib.contextmanager
    def serving(self) -> Iterator[Recorder]:
        loop = asyncio.new_event_loop()
        ready = threading.Event()
        stopping: asyncio.Future[None] | None = None

        async def main() -> None:
            nonlocal stopping
            server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
            self.port = server.sockets[0].getsockname()[1]
            stopping = loop.create_future()
            ready.set()
            async with server:
                await stopping

        thread = threading.Thread(target=loop.run_until_complete, args=(main(),), daemon=True)
        thread.start()
        ready.wait(5)
        try:
            yield self
        finally:
            assert stopping is not None
            loop.call_soon_threadsafe(stopping.set_result, None)
            thread.join(10)
