"""bench_epp.py's fake vLLM backend (`--backend-server PORT`): proxy_servers.Backend's
instant answers with a stream's events paced `--gap-ms` apart, and a chunked request body
read too (Envoy forwards the body chunked when a processor may rewrite it: STREAMED,
BUFFERED_PARTIAL, full duplex).
"""

from __future__ import annotations

import asyncio

from proxy_servers import STREAM, Backend


class PacedBackend(Backend):
    """Backend's answers, a stream's events paced; a chunked request body read too (Envoy
    forwards the body chunked when a processor may rewrite it: STREAMED, BUFFERED_PARTIAL,
    full duplex)."""

    gap_s = 0.0005

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while (head_end := self.buf.find(b"\r\n\r\n")) >= 0:
            head = self.buf[:head_end].decode("latin-1").lower()
            if "transfer-encoding: chunked" not in head:
                super().data_received(b"")
                return
            body, at = b"", head_end + 4
            while (eol := self.buf.find(b"\r\n", at)) >= 0:
                size = int(self.buf[at:eol].split(b";", 1)[0], 16)
                if len(self.buf) < eol + 2 + size + 2:
                    return  # the rest of this chunk has not come
                body += self.buf[eol + 2:eol + 2 + size]
                at = eol + 2 + size + 2
                if size == 0:
                    break
            else:
                return
            self.buf = self.buf[at:]
            self.answer(head.split(" ", 2)[1], body)

    def answer(self, path: str, body: bytes) -> None:
        if b'"stream":true' not in body:
            super().answer(path, body)
            return
        self.t.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                     b"transfer-encoding: chunked\r\n\r\n")
        loop = asyncio.get_running_loop()
        for i, event in enumerate([*STREAM, b""]):
            frame = b"%x\r\n%s\r\n" % (len(event), event) if event else b"0\r\n\r\n"
            loop.call_later(i * self.gap_s, self._write, frame)

    def _write(self, frame: bytes) -> None:
        if not self.t.is_closing():
            self.t.write(frame)


async def serve_paced(port: int, gap_ms: float) -> None:
    PacedBackend.gap_s = gap_ms / 1000
    loop = asyncio.get_running_loop()
    server = await loop.create_server(PacedBackend, "127.0.0.1", port)
    async with server:
        await server.serve_forever()
