"""What `gateway/proxy/protocol.py`'s `GatewayHttpProtocol` takes from uvicorn's private
`HttpToolsProtocol`, checked against the installed uvicorn so that an upgrade that moves
any of it fails here, by name, rather than in a hostile-input test or in production.

The subclass overrides `connection_made`, `connection_lost`, `data_received`,
`on_message_begin`, `on_headers_complete` and `send_400_response`, calls each of their
super methods, reads `self.loop`, `self.transport`, `self.url` and `self.headers`, and
relies on one behaviour: an exception raised from a parser callback reaches uvicorn's
`data_received` as an `httptools.HttpParserError` and is answered by `send_400_response`
(how a head over the bound is refused before any request cycle starts). The behaviour on
real sockets is tests/test_fuzz_loopback.py's; pyproject pins uvicorn to the versions it
passed with (0.29.0, 0.30.6, 0.40.0, 0.50.0, 0.54.0).
"""

from __future__ import annotations

import asyncio
import inspect
import tomllib
from importlib.metadata import version
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement
from uvicorn.config import Config
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

from gateway.proxy.protocol import GatewayHttpProtocol, bounded_protocol

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"


@pytest.mark.parametrize(
    ("method", "parameters"),
    [
        ("__init__", ["self", "config", "server_state", "app_state", "_loop"]),
        ("connection_made", ["self", "transport"]),
        ("connection_lost", ["self", "exc"]),
        ("data_received", ["self", "data"]),
        ("on_message_begin", ["self"]),
        ("on_headers_complete", ["self"]),
        ("send_400_response", ["self", "msg"]),
    ],
)
def test_overridden_methods_keep_their_signatures(method: str, parameters: list[str]) -> None:
    own = getattr(HttpToolsProtocol, method, None)
    assert own is not None, f"uvicorn's HttpToolsProtocol.{method} is gone"
    assert list(inspect.signature(own).parameters) == parameters
    assert method in GatewayHttpProtocol.__dict__  # the subclass still overrides it


def test_installed_uvicorn_is_in_the_pinned_range() -> None:
    deps = tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"]
    pin = next(Requirement(d) for d in deps if Requirement(d).name == "uvicorn")
    assert pin.specifier.contains(version("uvicorn")), (version("uvicorn"), str(pin))
    assert pin.specifier.contains("0.54.0") and not pin.specifier.contains("1.0.0")


class Transport(asyncio.Transport):
    """Records what the protocol writes; the socket-level tests have real ones."""

    def __init__(self) -> None:
        super().__init__()
        self.written = b""
        self.closed = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.written += bytes(data)

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": ("127.0.0.1", 5000), "sockname": ("127.0.0.1", 8000)}.get(
            name, default)


async def app(scope: Any, receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 204, "headers": []})
    await send({"type": "http.response.body", "body": b""})


def protocol(cls: type[HttpToolsProtocol]) -> tuple[HttpToolsProtocol, Transport]:
    config = Config(app, http=cls, lifespan="off", log_config=None)
    proto = cls(config=config, server_state=ServerState(), app_state={},
                _loop=asyncio.get_running_loop())
    transport = Transport()
    proto.connection_made(transport)
    return proto, transport


async def test_attributes_the_subclass_reads() -> None:
    proto, transport = protocol(HttpToolsProtocol)
    assert proto.loop is asyncio.get_running_loop() and proto.transport is transport
    proto.on_message_begin()
    proto.on_url(b"/v1/models")
    proto.on_header(b"Host", b"x")
    assert proto.url == b"/v1/models" and proto.headers == [(b"host", b"x")]
    proto.connection_lost(None)


async def test_a_callback_error_is_answered_by_send_400_response() -> None:
    answered: list[str] = []

    class Refusing(HttpToolsProtocol):
        def on_headers_complete(self) -> None:
            raise RuntimeError("refused")

        def send_400_response(self, msg: str) -> None:
            answered.append(msg)

    proto, _ = protocol(Refusing)
    proto.data_received(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
    assert len(answered) == 1  # uvicorn chose the message; the subclass only relays it
    proto.connection_lost(None)


async def test_the_subclass_refuses_a_large_head_with_431() -> None:
    proto, transport = protocol(bounded_protocol(max_head_bytes=64, head_timeout_s=5.0))
    proto.data_received(b"GET / HTTP/1.1\r\nhost: x\r\nx-a: " + b"a" * 100 + b"\r\n\r\n")
    assert transport.written.startswith(b"HTTP/1.1 431 ") and transport.closed
    proto.connection_lost(None)
