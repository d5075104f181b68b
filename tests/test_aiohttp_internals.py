"""What `gateway/proxy/client.py`'s `_PeekingConnector` takes from aiohttp's private
`TCPConnector._get`, checked against the installed aiohttp so that an upgrade that moves it
fails here, by name, rather than as a request sent twice in production.

The connector overrides `_get(key, traces)`, aiohttp's one place where a pooled connection
is taken for reuse, calls it, and hands the connection out only while its peer has not
closed it. The behaviour on real sockets (a server that closes after every answer gets each
request once) is tests/test_proxy_client.py's; pyproject pins aiohttp to the versions whose
`_get` has this shape (3.10 to 3.14; 3.9's was synchronous with another signature).
"""

from __future__ import annotations

import inspect
import tomllib
from importlib.metadata import version
from pathlib import Path

import aiohttp
from packaging.requirements import Requirement

from gateway.proxy.client import _PeekingConnector

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"


def test_tcp_connector_get_keeps_its_shape() -> None:
    own = getattr(aiohttp.TCPConnector, "_get", None)
    assert own is not None, "aiohttp's TCPConnector._get is gone"
    assert inspect.iscoroutinefunction(own)
    assert list(inspect.signature(own).parameters) == ["self", "key", "traces"]
    assert "_get" in _PeekingConnector.__dict__  # the subclass still overrides it


def test_installed_aiohttp_is_in_the_pinned_range() -> None:
    deps = tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"]
    pin = next(Requirement(d) for d in deps if Requirement(d).name == "aiohttp")
    assert pin.specifier.contains(version("aiohttp")), (version("aiohttp"), str(pin))
    assert not pin.specifier.contains("3.9.5") and not pin.specifier.contains("4.0.0")
