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
from packaging.requirements import Requirement

from gateway.proxy.client import AiohttpUpstream, _PeekingConnector

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


def test_the_session_retry_switch_keeps_its_name_and_meaning() -> None:
    """`AiohttpUpstream` turns aiohttp's re-send of idempotent methods off by setting the
    session's private `_retry_connection` (no public switch; aiohttp's own test client does
    the same). A rename would leave the switch on, silently: fail here by name. The
    behaviour on sockets is tests/test_proxy_client_pool.py's and
    tests/test_upstream_no_resend.py's."""
    assert "_retry_connection" in aiohttp.ClientSession.ATTRS
    request = inspect.getsource(aiohttp.ClientSession._request)
    assert "self._retry_connection and method in IDEMPOTENT_METHODS" in request
    assert "if not retry_persistent_connection:" in request
    source = inspect.getsource(AiohttpUpstream._open)
    assert "session._retry_connection = False" in source
