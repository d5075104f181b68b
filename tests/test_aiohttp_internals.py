"""What `gateway/proxy/client.py`'s `_PeekingConnector` takes from aiohttp's private
`TCPConnector._get`, checked against the installed aiohttp so that an upgrade that moves it
fails here, by name, rather than as a request sent twice in production.

The connector overrides `_get(key, traces)`, aiohttp's one place where a pooled connection
is taken for reuse, calls it, and hands the connection out only while its peer has not
closed it; before that it reads the pool, `_conns[key]` (pairs of protocol and release
time, oldest first), for connections aiohttp will drop as closed. It overrides
`_release(key, protocol, *, should_close)`, the one way back into the pool, to close the
connections of a replica that closes after every answer. The behaviour on real sockets (a
server that closes after every answer gets each request once) is
tests/test_proxy_client_pool.py's; pyproject pins aiohttp to the versions whose `_get` has
this shape (3.10 to 3.14; 3.9's was synchronous with another signature). And the
session's `_retry_connection`, the switch of aiohttp's re-send of idempotent methods after
a broken connection, which the client turns off (below).
"""

from __future__ import annotations

import inspect
import tomllib
from importlib.metadata import version
from pathlib import Path

import aiohttp
import pytest
from packaging.requirements import Requirement

from gateway.proxy.client import AiohttpUpstream, _PeekingConnector
from gateway.upstream.seam import Timeouts

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"


def test_tcp_connector_get_keeps_its_shape() -> None:
    own = getattr(aiohttp.TCPConnector, "_get", None)
    assert own is not None, "aiohttp's TCPConnector._get is gone"
    assert inspect.iscoroutinefunction(own)
    assert list(inspect.signature(own).parameters) == ["self", "key", "traces"]
    assert "_get" in _PeekingConnector.__dict__  # the subclass still overrides it


def test_tcp_connector_release_and_pool_keep_their_shape() -> None:
    own = getattr(aiohttp.TCPConnector, "_release", None)
    assert own is not None, "aiohttp's TCPConnector._release is gone"
    params = inspect.signature(own).parameters
    assert list(params) == ["self", "key", "protocol", "should_close"]
    assert params["should_close"].kind is inspect.Parameter.KEYWORD_ONLY
    assert "_release" in _PeekingConnector.__dict__
    init = inspect.getsource(aiohttp.BaseConnector.__init__)
    assert "self._conns" in init, "aiohttp's BaseConnector no longer keeps its pool in _conns"
    get = inspect.getsource(aiohttp.BaseConnector._get)
    assert "proto, t0 = conns.popleft()" in get or "proto, t0 = conns.pop" in get


def test_installed_aiohttp_is_in_the_pinned_range() -> None:
    deps = tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"]
    pin = next(Requirement(d) for d in deps if Requirement(d).name == "aiohttp")
    assert pin.specifier.contains(version("aiohttp")), (version("aiohttp"), str(pin))
    assert not pin.specifier.contains("3.9.5") and not pin.specifier.contains("4.0.0")
    # 3.10.x has no `_retry_connection`: it re-sends every idempotent method after a broken
    # connection whatever the session says (a DELETE the engine read arrives twice); and
    # before 3.14 `ClientSession` takes no `max_headers`, so the client cannot even open.
    assert not pin.specifier.contains("3.10.11") and not pin.specifier.contains("3.13.5")


def test_the_session_retry_switch_keeps_its_name_and_meaning() -> None:
    """`AiohttpUpstream` turns aiohttp's re-send of idempotent methods off by setting the
    session's private `_retry_connection` (no public switch; aiohttp's own test client does
    the same). A rename would leave the switch on, silently: fail here by name. The
    behaviour on sockets is tests/test_proxy_client_pool.py's and
    tests/test_upstream_no_resend.py's."""
    assert "_retry_connection" in aiohttp.ClientSession.ATTRS
    request = inspect.getsource(aiohttp.ClientSession._request)
    # The switch gates the re-send (3.14.0 words the branch `if retry_persistent_connection:
    # ... continue`, later ones `if not retry_persistent_connection: raise`).
    assert "self._retry_connection and method in IDEMPOTENT_METHODS" in request
    assert "retry_persistent_connection = False" in request
    source = inspect.getsource(AiohttpUpstream._open)
    assert "session._retry_connection = False" in source


async def test_an_aiohttp_without_the_switch_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Installed past the pin, an aiohttp with no `_retry_connection` (3.10) would re-send
    every idempotent method: the client refuses to open rather than send a DELETE twice."""
    monkeypatch.setattr(aiohttp.ClientSession, "ATTRS",
                        aiohttp.ClientSession.ATTRS - {"_retry_connection"})
    upstream = AiohttpUpstream()
    with pytest.raises(RuntimeError, match="re-send of idempotent methods"):
        await upstream.send("DELETE", "http://127.0.0.1:9/v1/responses/r", [], None,
                            Timeouts(connect_s=1, read_s=1, total_s=1))
    await upstream.aclose()
