"""Gateway settings: a TOML file, then `GATEWAY_*` environment variables, then command-line
flags, validated once into frozen dataclasses (parsing is pure: the caller passes the file
text and the environment).

Sections: `[server]` (`ServerSettings`), `[[replicas]]` (`ReplicaSettings`, one table per
replica), `[auth]` (`AuthSettings`), and the components' own dataclasses, mapped generically
by field name and type (`gateway.coerce`): `[routing]` -> `RoutingConfig`, `[hygiene]` ->
`HygieneConfig`, `[usage]` -> `UsageConfig`, `[tokens]` -> `TokenSettings` (token mode and
KV events), `[redis]` -> `RedisSettings` (routing state shared between instances),
`[admission]` -> `AdmissionConfig` (the gateway queue: priorities, fair shares, shedding),
`[discovery]` -> `DiscoverySettings` (replicas from DNS names; how a replica leaves),
`[tracing]` -> `TracingSettings` (OpenTelemetry spans; the OTEL_* variables configure the rest),
`[pd]` -> `PdConfig` (prefill/decode disaggregation, gateway.pd). `[epp]`, `[demo]` and
`[discovery]`, which belong to no component's config module, are in
`gateway.settings_sections` (re-exported here).

Environment scheme (values are text, parsed by the field's type):
- `GATEWAY_<SECTION>__<KEY>` sets `[section] key`, e.g. `GATEWAY_ROUTING__POLICY=session`,
  `GATEWAY_USAGE__LOG_PATH=/var/log/usage.jsonl`, `GATEWAY_AUTH__KEYS=sk-a=team-a,sk-b=team-b`.
  A single underscore after the section name is accepted too (`GATEWAY_USAGE_LOG_PATH`).
- `GATEWAY_<KEY>` sets a `[server]` key: `GATEWAY_PORT=9000`, `GATEWAY_LOG_LEVEL=debug`.
- `GATEWAY_BACKENDS=http://h1:8000,http://h2:8000` replaces `[[replicas]]` (like `--backend`).
Variables Kubernetes injects for Services named `gateway`, `gateway-*`
(`GATEWAY_PORT=tcp://10.0.0.11:8080`, `GATEWAY_SERVICE_HOST`, `GATEWAY_PORT_8080_TCP_ADDR`,
...; see `gateway.servicelinks`) are recognized and ignored. Any other `GATEWAY_*` variable
that names no setting is reported as a warning (`EnvScan.unknown`), not an error: the
environment of a pod is shared with things the gateway does not own. A bad value for a
known setting, and an unknown key in the config file, stay errors.
`GATEWAY_VLLM_*` is left alone without a warning (it locates the real-vLLM install for
tests and benchmarks, which start gateways that inherit it).
"""

from __future__ import annotations

import dataclasses
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal
from urllib.parse import urlsplit

from gateway.admission.config import AdmissionConfig
from gateway.coerce import SettingsError, build, coerce, field_types
from gateway.events.config import TokenSettings
from gateway.hygiene.config import HygieneConfig
from gateway.logs import LogFormat
from gateway.pd.config import PdConfig
from gateway.routing.config import RoutingConfig
from gateway.servicelinks import is_service_link
from gateway.settings_sections import DemoSettings as DemoSettings
from gateway.settings_sections import DiscoverySettings as DiscoverySettings
from gateway.settings_sections import EppSettings as EppSettings
from gateway.settings_sections import ResponseRead as ResponseRead
from gateway.settings_sections import host_port as host_port
from gateway.settings_sections import resolvable_name as resolvable_name
from gateway.shared.config import RedisSettings
from gateway.tracing.config import TracingSettings
from gateway.usage.config import UsageConfig

LogLevel = Literal["debug", "info", "warning", "error"]
# The request headers that name a session, earliest first: the gateway's own, then the
# agent harnesses' (Claude Code, OpenCode, Codex x2), as llm-d and the vLLM Router read them.
SESSION_HEADERS = ("x-session-id", "x-claude-code-session-id", "x-session-affinity",
                   "session-id", "session_id")
ENV_PREFIX = "GATEWAY_"
# What a replica does for a request (gateway.pd): `both` computes prompt and answer (the
# default, every replica before P/D); `prefill` only ever gets prefill legs; `decode` gets
# decode legs and every request it serves alone.
Role = Literal["both", "prefill", "decode"]


@dataclass(frozen=True, kw_only=True, slots=True)
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 8080
    max_body_bytes: int = 32 * 1024 * 1024  # larger requests get 413
    connect_timeout_s: float = 5.0  # TCP connect to a replica
    read_timeout_s: float = 600.0  # longest silence from a replica (incl. prefill) -> 504
    retries: int = 1  # extra replicas tried when a request was not delivered (refused)
    health_interval_s: float = 5.0  # GET /health on every replica this often
    health_timeout_s: float = 2.0
    unhealthy_after: int = 3  # consecutive failed probes that mark a replica down
    # A replica down this long loses its routing memory (index, bindings) when it returns;
    # one back sooner keeps it unless it is seen restarted (gateway.replicas.monitor).
    forget_after_s: float = 600.0
    probe_connections: int = 4  # the health probes' own pool, per replica
    models_refresh_s: float = 30.0  # re-read /v1/models this often
    upstream_connections: int = 1024  # keep-alive connections per replica, at most
    # Longest wait for a free pooled connection; then 503 with Retry-After (congestion).
    upstream_pool_wait_s: float = 5.0
    upstream_idle_s: float = 4.0  # idle upstream connections closed after (< vLLM's 5 s)
    max_response_bytes: int = 64 * 1024 * 1024  # a non-streamed answer larger -> 502
    log_level: LogLevel = "info"
    log_format: LogFormat = "json"  # or "text", for a person at a terminal
    access_log: bool = True  # one line per request (logger gateway.access, level info)
    # On SIGTERM/SIGINT: stop accepting at once, let requests in flight finish for this
    # long, then end the streams still open with an error event; exit 0 either way.
    shutdown_grace_s: int = 30  # whole seconds (uvicorn's timeout_graceful_shutdown)
    # A client that stops sending its request body for this long gets a 408 (its
    # connection and task are not held for ever).
    client_body_timeout_s: float = 60.0
    # A request head (request line and headers) larger than this is a 431; one not
    # complete this long after its first byte has its connection closed (slowloris).
    max_head_bytes: int = 64 * 1024
    head_timeout_s: float = 30.0
    # An idle kept-alive client connection is closed after this long. Longer than the
    # pools of the clients that call the gateway (httpx, under the official openai client,
    # drops an idle connection after 5 s, aiohttp after 15 s): at uvicorn's own 5 s the
    # server closed connections the client was just reusing, and the client's request
    # failed unread. 75 s is nginx's default.
    keep_alive_s: int = 75  # whole seconds (uvicorn's timeout_keep_alive)
    # Request headers that name a session, earliest first (gateway.sessions): the
    # gateway's own, then the agent harnesses' (Claude Code, OpenCode, Codex).
    session_headers: tuple[str, ...] = SESSION_HEADERS

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"server.port must be 0..65535, got {self.port}")
        if self.max_body_bytes <= 0:
            raise ValueError("server.max_body_bytes must be positive")
        for name in ("connect_timeout_s", "read_timeout_s", "health_interval_s",
                     "client_body_timeout_s", "max_head_bytes", "head_timeout_s", "keep_alive_s",
                     "health_timeout_s", "models_refresh_s", "upstream_connections",
                     "upstream_idle_s", "max_response_bytes", "upstream_pool_wait_s",
                     "probe_connections", "forget_after_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"server.{name} must be positive")
        if self.shutdown_grace_s < 0:
            raise ValueError("server.shutdown_grace_s must be >= 0")
        if len(self.session_headers) > 16 or any(
                not h or not h.isascii() or not h.replace("-", "").replace("_", "").isalnum()
                for h in self.session_headers):
            raise ValueError("server.session_headers: at most 16 header names, each letters, "
                             "digits, '-' and '_'")
        if self.retries < 0 or self.unhealthy_after < 1:
            raise ValueError("server.retries must be >= 0 and server.unhealthy_after >= 1")


@dataclass(frozen=True, kw_only=True, slots=True)
class ReplicaSettings:
    name: str
    url: str  # base URL, e.g. http://10.0.0.5:8000 (no /v1)
    api_key: str | None = field(default=None, repr=False)  # sent upstream as Bearer
    models: tuple[str, ...] | None = None  # None: discovered from /v1/models
    capacity_tokens: int | None = None  # KV capacity if the engine does not report it
    # Where it publishes KV events, when GET /kv_event_sources cannot say ([tokens]):
    kv_events_endpoint: str | None = None  # tcp://host:port of the PUB socket
    kv_events_replay_endpoint: str | None = None  # tcp://host:port of the replay socket
    # both | prefill | decode (gateway.pd): prefill replicas get prefill legs only
    role: Role = "both"

    def __post_init__(self) -> None:
        for name in ("kv_events_endpoint", "kv_events_replay_endpoint"):
            value = getattr(self, name)
            if value is not None and not value.startswith("tcp://"):
                raise ValueError(f"replica {self.name!r}: {name} must be tcp://host:port, "
                                 f"got {value!r}")
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(f"replica {self.name!r}: url must be http(s)://host:port, "
                             f"got {self.url!r}")
        try:
            parts.port  # noqa: B018 (urlsplit checks the range only when asked)
        except ValueError:
            raise ValueError(f"replica {self.name!r}: url {self.url!r} has no valid port "
                             "(1-65535)") from None
        if not self.name:
            raise ValueError("replica name must not be empty")
        if self.capacity_tokens is not None and self.capacity_tokens <= 0:
            raise ValueError(f"replica {self.name!r}: capacity_tokens must be positive")


@dataclass(frozen=True, kw_only=True, slots=True)
class AuthSettings:
    # client API key -> tenant name; empty = no authentication
    keys: Mapping[str, str] = field(default_factory=dict, repr=False)
    # With keys set, /metrics and /stats need a key too; true opens their fleet-wide
    # fields and families (never a tenant's) to callers without a key.
    public_metrics: bool = False
    # Tenants whose keys have the admin role: only they read what /stats and /metrics
    # hold per tenant or about the prompts' sharing (gateway/usage/exposure.py); other
    # keys read the fleet-wide fields and their own tenant's rows.
    admin_tenants: tuple[str, ...] = ()
    # A secret: when set, each tenant's chat, completions, Responses and Messages requests carry
    # vLLM's `cache_salt` = HMAC-SHA256(secret, tenant), overriding the client's, so the
    # engines' prefix caches are isolated per tenant (gateway/proxy/tenancy.py). Changing
    # it empties every tenant's cache once. Empty: off.
    tenant_cache_salt: str = field(default="", repr=False)

    def __post_init__(self) -> None:
        if self.tenant_cache_salt and not self.keys:
            raise ValueError("auth.tenant_cache_salt needs auth.keys (tenants come from keys)")
        # An empty key would match a request without any key.
        if any(not key.strip() for key in self.keys):
            raise ValueError("auth.keys: a key must not be empty")
        # A tenant scopes session ids as "tenant\x1fid" (routing/sessions.py).
        if any(not t or not t.isprintable() for t in self.keys.values()):
            raise ValueError("auth.keys: a tenant name must be printable and not empty")
        unknown = set(self.admin_tenants) - set(self.keys.values())
        if unknown:
            raise ValueError(f"auth.admin_tenants: no key names tenant(s) {sorted(unknown)}")


@dataclass(frozen=True, kw_only=True, slots=True)
class Settings:
    server: ServerSettings = field(default_factory=ServerSettings)
    replicas: tuple[ReplicaSettings, ...] = ()
    auth: AuthSettings = field(default_factory=AuthSettings)
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    hygiene: HygieneConfig = field(default_factory=HygieneConfig)
    usage: UsageConfig = field(default_factory=UsageConfig)
    tokens: TokenSettings = field(default_factory=TokenSettings)
    redis: RedisSettings = field(default_factory=RedisSettings)
    epp: EppSettings = field(default_factory=EppSettings)  # `gateway epp` only
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    demo: DemoSettings = field(default_factory=DemoSettings)  # the embedded simulator


    discovery: DiscoverySettings = field(default_factory=DiscoverySettings)
    tracing: TracingSettings = field(default_factory=TracingSettings)  # OpenTelemetry spans
    pd: PdConfig = field(default_factory=PdConfig)  # prefill/decode disaggregation


# table sections: name -> dataclass (replicas, an array of tables, is handled apart)
SECTIONS: dict[str, type[Any]] = {
    "server": ServerSettings,
    "auth": AuthSettings,
    "routing": RoutingConfig,
    "hygiene": HygieneConfig,
    "usage": UsageConfig,
    "tokens": TokenSettings,
    "redis": RedisSettings,
    "epp": EppSettings,
    "admission": AdmissionConfig,
    "demo": DemoSettings,


    "discovery": DiscoverySettings,
    "tracing": TracingSettings,
    "pd": PdConfig,
}


def replica_from_url(url: str, role: Role = "both") -> ReplicaSettings:
    """A `--backend URL` replica (`--prefill`, `--decode`: of that role), named by its
    host:port (what x-gateway-replica shows)."""
    url = url.rstrip("/")
    if url.endswith("/v1"):
        url = url[:-3]
    netloc = urlsplit(url).netloc
    try:
        return ReplicaSettings(name=netloc or url, url=url, role=role)
    except ValueError as exc:
        flag = "--backend" if role == "both" else f"--{role}"
        raise SettingsError(f"{flag}: {exc}") from exc


def _env_target(name: str) -> tuple[str, str]:
    """GATEWAY_X__Y / GATEWAY_X_Y / GATEWAY_Y -> (section, key)."""
    rest = name[len(ENV_PREFIX):].lower()
    section, sep, key = rest.partition("__")
    if sep:
        return section, key
    for sec in SECTIONS:
        if rest.startswith(sec + "_"):
            return sec, rest[len(sec) + 1:]
    return "server", rest


@dataclass(frozen=True, slots=True)
class EnvScan:
    """What the `GATEWAY_*` environment says: typed overrides per section, the backends
    list, and the variables left aside (service links, names that are no setting)."""

    sections: Mapping[str, Mapping[str, Any]]
    backends: list[str] | None
    service_links: tuple[str, ...]  # Kubernetes Service variables, ignored
    unknown: tuple[str, ...]  # "NAME: why" for each variable that names no setting

    def notes(self) -> list[tuple[str, str]]:
        """(level, message) lines to log at start-up: one for all the service links, one
        warning per unknown variable."""
        out: list[tuple[str, str]] = []
        if self.service_links:
            out.append(("info", f"ignoring {len(self.service_links)} Kubernetes service-link "
                                f"variables ({', '.join(self.service_links)}); set "
                                "enableServiceLinks: false on the pod to drop them"))
        out.extend(("warning", f"ignoring environment variable {u}") for u in self.unknown)
        return out


def scan_env(env: Mapping[str, str]) -> EnvScan:
    """Sort the `GATEWAY_*` variables of `env` (pure). Bad values of known keys raise."""
    sections: dict[str, dict[str, Any]] = {}
    backends: list[str] | None = None
    links: list[str] = []
    unknown: list[str] = []
    for name in sorted(env):
        if not name.startswith(ENV_PREFIX):
            continue
        text = env[name]
        if name == ENV_PREFIX + "BACKENDS":
            backends = [u.strip() for u in text.split(",") if u.strip()]
            continue
        if is_service_link(name, text):
            links.append(name)
            continue
        if name.startswith(ENV_PREFIX + "VLLM_"):  # the real-vLLM tier's, not a setting
            continue
        section, key = _env_target(name)
        if section not in SECTIONS:
            unknown.append(f"{name}: unknown section {section!r} "
                           f"(known: {', '.join(SECTIONS)}, BACKENDS)")
            continue
        types_ = field_types(SECTIONS[section])
        if key not in types_:
            unknown.append(f"{name}: unknown key {section}.{key} "
                           f"(known keys: {', '.join(sorted(types_))})")
            continue
        sections.setdefault(section, {})[key] = coerce(
            text, types_[key], f"{name} ({section}.{key})", from_text=True
        )
    return EnvScan(sections, backends, tuple(links), tuple(unknown))


def parse_settings(
    toml_text: str | None,
    env: Mapping[str, str],
    *,
    source: str = "config",
    backends: Sequence[str] = (),
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
    prefill: Sequence[str] = (),
    decode: Sequence[str] = (),
) -> Settings:
    """Validate file text + environment + flags (later wins) into `Settings`.

    `backends` (from `--backend`, else `GATEWAY_BACKENDS`) replace the file's replicas;
    so do `prefill` and `decode` (`--prefill`, `--decode`: replicas of those roles), beside
    them.
    `overrides` maps section -> key -> typed value (command-line flags)."""
    try:
        doc: dict[str, Any] = tomllib.loads(toml_text) if toml_text else {}
    except tomllib.TOMLDecodeError as exc:
        raise SettingsError(f"{source}: invalid TOML: {exc}") from exc
    unknown = sorted(set(doc) - set(SECTIONS) - {"replicas"})
    if unknown:
        raise SettingsError(f"{source}: unknown section [{unknown[0]}] "
                            f"(known: {', '.join([*SECTIONS, 'replicas'])})")
    scanned = scan_env(env)
    env_sections, env_backends = scanned.sections, scanned.backends
    built: dict[str, Any] = {}
    for name, cls in SECTIONS.items():
        raw = doc.get(name, {})
        if not isinstance(raw, dict):
            raise SettingsError(f"{source}: [{name}] must be a table")
        merged = {**raw, **env_sections.get(name, {}), **(overrides or {}).get(name, {})}
        built[name] = build(cls, merged, name)

    urls = list(backends) or ([] if prefill or decode else env_backends or [])
    if urls or prefill or decode:
        replicas = (*(replica_from_url(u) for u in urls),
                    *(replica_from_url(u, "prefill") for u in prefill),
                    *(replica_from_url(u, "decode") for u in decode))
    else:
        raw_replicas = doc.get("replicas", [])
        if not isinstance(raw_replicas, list):
            raise SettingsError(f"{source}: replicas must be an array of tables [[replicas]]")
        replicas = tuple(
            build(ReplicaSettings, r, f"replicas[{i}]") if isinstance(r, dict)
            else _raise(f"{source}: replicas[{i}] must be a table")
            for i, r in enumerate(raw_replicas)
        )
    names = [r.name for r in replicas]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise SettingsError(f"duplicate replica name {dupes[0]!r}")
    return Settings(replicas=replicas, **built)


def _raise(message: str) -> ReplicaSettings:
    raise SettingsError(message)


def with_replicas(settings: Settings, replicas: Sequence[ReplicaSettings]) -> Settings:
    return dataclasses.replace(settings, replicas=tuple(replicas))
