"""Outside review of issue 37's DNS source: a name the system resolver cannot even encode
(a label over 63 characters: IDNA refuses it before any query) is a settings error, and a
resolution that fails that way is a failed resolution (the last set kept, said once), not
an internal error of the gateway."""

from __future__ import annotations

import logging

import pytest

from gateway.replicas.sources import DnsWatch, getaddrinfo
from gateway.settings import DiscoverySettings, ReplicaSettings
from gateway.tasks import FailureLog

LONG = "a" * 64 + ".vllm.svc:8000"  # a 64-character label: no DNS name has one


def test_a_dns_name_no_resolver_can_ask_is_refused_in_settings() -> None:
    """Found: gateway/settings.py host_port (DiscoverySettings.__post_init__) checks the
    `host:port` shape only; the name is accepted and fails at every interval."""
    with pytest.raises(ValueError):
        DiscoverySettings(dns=(LONG,))


async def test_a_name_the_real_resolver_refuses_is_a_failed_resolution(
        caplog: pytest.LogCaptureFixture) -> None:
    """Found: DnsWatch.refresh (gateway/replicas/sources.py) catches OSError and
    TimeoutError only; `getaddrinfo`'s UnicodeError (a ValueError) goes to the failure
    boundary, logged as an error of the gateway at every rate-limit period instead of the
    one "DNS name not resolved" warning."""
    published: list[dict[str, ReplicaSettings]] = []
    failures = FailureLog(logging.getLogger("test.review37"))
    watch = DnsWatch("vllm:8000", DiscoverySettings(), getaddrinfo,
                     lambda source, found: published.append(found), failures)
    watch.host = LONG.rsplit(":", 1)[0]  # past the settings, which refuse it (or should)
    caplog.set_level(logging.WARNING)
    try:
        await watch.refresh()
    except ValueError as exc:
        pytest.fail(f"a failed resolution raised {exc!r}")
    await watch.refresh()
    assert published == []  # nothing published: the last set kept
    assert sum("not resolved" in r.getMessage() for r in caplog.records) == 1
