"""Replica sources beside the static list: DNS names re-resolved on a timer, and the
settings file read again on SIGHUP (`FleetSources.reload`); each hands its whole set to
`Membership` (gateway.replicas.membership), which joins and drains.

DNS (`[discovery] dns = ["host:port", ...]`): every `dns_interval_s` the name is resolved
(A and AAAA, through `Resolver`, a seam: `getaddrinfo` on the loop's executor in
production, a table in tests); each address is a replica named `address:port`
(`dns_members`, pure), so a headless Service's name lists its ready pods as they come and
go. Names are stable (the same address is the same replica, on every gateway instance, so
instances sharing state through Redis name it alike) and bounded: at most `max_replicas`
addresses per name, the lowest first. A failed resolution keeps the last set (a DNS
outage does not empty the fleet); an answer with no address empties it.

Kubernetes (`[discovery] kubernetes_selector`, the `kubernetes` extra): `KubeSource` runs
the pod watch `gateway epp`'s InferencePool uses (gateway.replicas.kube.PodWatch) on a
label selector; each Ready pod with an IP is a replica `<pod>:<port>`, at most
`max_replicas` of them (by name). A broken watch keeps the last set until it is listed
again; a pod that turns unready or is deleted leaves through `Membership` like a name DNS
no longer answers.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any

from gateway.replicas.kube import PodWatch, kube_api, own_namespace
from gateway.replicas.membership import STATIC, Membership
from gateway.settings import DiscoverySettings, ReplicaSettings, host_port
from gateway.tasks import FailureLog, every, guarded

log = logging.getLogger("gateway.replicas.sources")

Resolver = Callable[[str, int], Awaitable[Sequence[str]]]
RESOLVE_TIMEOUT_S = 5.0  # one resolution; a slower one counts as failed (the set is kept)


async def getaddrinfo(host: str, port: int) -> list[str]:
    """The addresses `host` resolves to (A and AAAA), through the system resolver."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [str(info[4][0]) for info in infos]


def dns_members(addresses: Iterable[str], port: int, max_replicas: int,
                api_key: str | None = None) -> dict[str, ReplicaSettings]:
    """Replica name -> settings for each distinct address (module docstring); what is no IP
    address, or is a scoped IPv6 address (no URL names its interface), is skipped."""
    ips: set[ipaddress.IPv4Address | ipaddress.IPv6Address] = set()
    for text in addresses:
        try:
            ip = ipaddress.ip_address(text)
        except ValueError:
            continue
        if not (isinstance(ip, ipaddress.IPv6Address) and ip.scope_id):
            ips.add(ip)
    out: dict[str, ReplicaSettings] = {}
    for ip in sorted(ips, key=lambda a: (a.version, int(a)))[:max_replicas]:
        host = f"[{ip}]" if ip.version == 6 else str(ip)
        name = f"{host}:{port}"
        out[name] = ReplicaSettings(name=name, url=f"http://{name}", api_key=api_key)
    return out


class DnsWatch:
    """One DNS name of `[discovery] dns`, resolved every `dns_interval_s`."""

    def __init__(self, target: str, discovery: DiscoverySettings, resolver: Resolver,
                 publish: Callable[[str, dict[str, ReplicaSettings]], None],
                 failures: FailureLog) -> None:
        self.source = f"dns:{target}"
        self.host, self.port = host_port(target)
        self.discovery = discovery
        self.resolver = resolver
        self.publish = publish
        self.failures = failures
        self._failing = False
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """One resolution now (the fleet is known when the gateway starts), then a timer."""
        await guarded(self.refresh, f"resolve {self.source}", self.failures)
        self._task = asyncio.create_task(every(self.discovery.dns_interval_s, self.refresh,
                                               f"resolve {self.source}", self.failures))

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def refresh(self) -> None:
        try:
            async with asyncio.timeout(RESOLVE_TIMEOUT_S):
                addresses = await self.resolver(self.host, self.port)
        # UnicodeError: a name IDNA refuses (settings check names; a resolver's own
        # refusal is still a failed resolution, not the gateway's error)
        except (OSError, TimeoutError, UnicodeError) as exc:
            if not self._failing:  # said once per outage, not at every interval
                log.warning("DNS name not resolved; keeping its replicas", extra={
                    "dns_name": self.host, "error": str(exc)[:300]})
            self._failing = True
            return
        self._failing = False
        d = self.discovery
        found = dns_members(addresses, self.port, d.max_replicas, d.api_key)
        if len(found) == d.max_replicas and len(set(addresses)) > d.max_replicas:
            log.warning("DNS name lists more addresses than discovery.max_replicas", extra={
                "dns_name": self.host, "max_replicas": d.max_replicas})
        self.publish(self.source, found)


def kube_members(endpoints: Mapping[str, str], max_replicas: int,
                 api_key: str | None = None) -> dict[str, ReplicaSettings]:
    """Replica name -> settings for the watch's endpoints, the first `max_replicas` names."""
    return {name: ReplicaSettings(name=name, url=endpoints[name], api_key=api_key)
            for name in sorted(endpoints)[:max_replicas]}


def kube_identity(d: DiscoverySettings) -> tuple[str, str, int, str]:
    """What a pod watch is of (pure): a reload that changes only the rest of [discovery]
    (api_key, max_replicas, grace_s, the DNS names) keeps the watch and its pods."""
    return (d.kubernetes_selector, d.kubernetes_namespace, d.kubernetes_port,
            d.kubernetes_port_name)


class KubeSource:
    """The pods of `[discovery] kubernetes_selector`, watched in a thread (PodWatch)."""

    def __init__(self, discovery: DiscoverySettings, api: Any,
                 publish: Callable[[str, dict[str, ReplicaSettings]], None]) -> None:
        d = discovery
        namespace = own_namespace(d.kubernetes_namespace)
        self.source = f"kubernetes:{namespace}/{d.kubernetes_selector}"
        self.discovery = discovery
        self.identity = kube_identity(discovery)
        self.publish = publish
        self._last: dict[str, str] | None = None  # the watch's last endpoints
        self.listed = asyncio.Event()  # its first listing published
        port: int | str = d.kubernetes_port or d.kubernetes_port_name
        selector = d.kubernetes_selector
        self.watch = PodWatch(api, namespace, lambda _api: (selector, (port,)),
                              f"pods {namespace}/{selector}", self._found,
                              asyncio.get_running_loop())

    def start(self) -> None:
        self.watch.start()

    def stop(self) -> None:
        self.watch.stop()

    def retune(self, discovery: DiscoverySettings) -> None:
        """New parameters for the same watch: its last pods published again under them
        (a new api_key, max_replicas), the watch left running."""
        self.discovery = discovery
        if self._last is not None:
            self._found(self._last)

    def _found(self, endpoints: dict[str, str]) -> None:
        self._last = endpoints
        self.listed.set()
        d = self.discovery
        if len(endpoints) > d.max_replicas:
            log.warning("the selector picks more pods than discovery.max_replicas", extra={
                "selector": d.kubernetes_selector, "max_replicas": d.max_replicas})
        self.publish(self.source, kube_members(endpoints, d.max_replicas, d.api_key))


class FleetSources:
    """The static list, the DNS watches and the pod watch, applied to the fleet through
    `membership`."""

    def __init__(self, membership: Membership, resolver: Resolver = getaddrinfo,
                 kube: Callable[[], Any] = kube_api) -> None:
        self.membership = membership
        self.resolver = resolver
        self.kube = kube  # the Kubernetes API client's factory (a seam)
        self._watches: dict[str, DnsWatch] = {}
        self._kube: KubeSource | None = None
        self._reloading = asyncio.Lock()  # two SIGHUPs close together apply one at a time

    async def start(self, replicas: Sequence[ReplicaSettings]) -> None:
        self.membership.sources[STATIC] = {r.name: r for r in replicas}
        self.membership.start()
        await self._watch(self.membership.discovery)

    async def settled(self, timeout_s: float) -> None:
        """The sources' first answers applied and their replicas' joins ended (each first
        probe), within `timeout_s` in all: DNS names were resolved in `start`; the pod
        watch's first listing is awaited here. Shared state's catch-up waits on this: it
        applies only facts about replicas the router knows (Router.apply)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        if self._kube is not None:
            try:
                async with asyncio.timeout_at(deadline):
                    await self._kube.listed.wait()
            except TimeoutError:
                log.warning("the label selector's pods not listed in time; facts shared "
                            "about them are not replayed", extra={
                                "selector": self.membership.discovery.kubernetes_selector})
        await self.membership.joined(max(0.0, deadline - loop.time()))

    async def aclose(self) -> None:
        for watch in self._watches.values():
            await watch.aclose()
        self._watches.clear()
        self._stop_kube()
        await self.membership.aclose()

    async def reload(self, replicas: Sequence[ReplicaSettings],
                     discovery: DiscoverySettings) -> None:
        """A reloaded settings file: its static list and DNS names replace the running
        ones (changed DNS settings restart every watch; the replicas of a name no longer
        configured leave). The pod watch of an unchanged selector, namespace and port goes
        on, its pods kept and published again under the new parameters: stopping it
        took every pod out of routing until a new watch listed them."""
        async with self._reloading:
            await self._reload(replicas, discovery)

    async def _reload(self, replicas: Sequence[ReplicaSettings],
                      discovery: DiscoverySettings) -> None:
        before = self.membership.discovery
        self.membership.discovery = discovery
        self.membership.sources[STATIC] = {r.name: r for r in replicas}
        if discovery != before:
            for watch in self._watches.values():
                await watch.aclose()
            kube = self._kube
            if kube is not None and kube.identity != kube_identity(discovery):
                self._stop_kube()
                kube = None
            kept = ({w.source for w in self._watches.values()}
                    & {f"dns:{t}" for t in discovery.dns}) | ({kube.source} if kube else set())
            for source in [s for s in self.membership.sources
                           if s.startswith(("dns:", "kubernetes:"))]:
                if source not in kept:
                    del self.membership.sources[source]
            self._watches.clear()
            if kube is not None:
                kube.retune(discovery)
            self.membership.reconcile()
            await self._watch(discovery, kube=kube is None)
        else:
            self.membership.reconcile()

    async def _watch(self, discovery: DiscoverySettings, kube: bool = True) -> None:
        for target in discovery.dns:
            self._watches[target] = DnsWatch(target, discovery, self.resolver,
                                             self.membership.set_source,
                                             self.membership.monitor.failures)
        # The first resolutions run together: names that never answer delay the start
        # (and a reload, under its lock) by one RESOLVE_TIMEOUT_S, not one each in turn.
        # At most 16 at once: settings bound `discovery.dns` to 16 names.
        await asyncio.gather(*(watch.start() for watch in self._watches.values()))
        if kube and discovery.kubernetes_selector:
            try:
                api = self.kube()
            except Exception as exc:  # no kubeconfig, no service account: the rest runs
                log.error("no Kubernetes API client; the selector's pods are not watched",
                          extra={"selector": discovery.kubernetes_selector,
                                 "error": str(exc)[:300]})
                return
            self._kube = KubeSource(discovery, api, self.membership.set_source)
            self._kube.start()

    def _stop_kube(self) -> None:
        if self._kube is not None:
            self._kube.stop()
            self._kube = None
