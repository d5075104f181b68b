"""Settings: the TOML + environment + flags loader, validated once (pure tables), and
`gateway serve` refusing bad settings with the key named."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest

from gateway.coerce import SettingsError
from gateway.servicelinks import is_service_link
from gateway.settings import Settings, parse_settings, scan_env
from tests.servers import ROOT, script

EXAMPLE = ROOT / "config" / "gateway.example.toml"


def test_example_config_loads() -> None:
    s = parse_settings(EXAMPLE.read_text(), {}, source=str(EXAMPLE))
    assert [r.name for r in s.replicas] == ["gpu-0", "gpu-1"]
    assert s.server.port == 8080
    assert s.routing.policy == "prefix"
    assert s.auth.keys == {}


def test_defaults_without_file() -> None:
    s = parse_settings(None, {})
    assert s == Settings()
    assert s.replicas == ()


GOOD: list[tuple[str, dict[str, str], str, Any]] = [
    ("[server]\nport = 9000", {}, "server.port", 9000),
    ("", {"GATEWAY_PORT": "9001"}, "server.port", 9001),
    ("[server]\nport = 9000", {"GATEWAY_SERVER__PORT": "9002"}, "server.port", 9002),
    ("", {"GATEWAY_ROUTING__POLICY": "session"}, "routing.policy", "session"),
    ("", {"GATEWAY_ROUTING_POLICY": "random"}, "routing.policy", "random"),
    ("", {"GATEWAY_LOG_LEVEL": "debug"}, "server.log_level", "debug"),
    ("", {"GATEWAY_HYGIENE__HEADER": "yes"}, "hygiene.header", True),
    ("", {"GATEWAY_HYGIENE__ENABLED": "0"}, "hygiene.enabled", False),
    ("", {"GATEWAY_USAGE__LOG_PATH": "/tmp/u.jsonl"}, "usage.log_path", "/tmp/u.jsonl"),
    ("[usage]\nlog_path = '/x'", {"GATEWAY_USAGE__LOG_PATH": "none"}, "usage.log_path", None),
    ("[server]\nread_timeout_s = 3", {}, "server.read_timeout_s", 3.0),
    ("", {"GATEWAY_AUTH__KEYS": "k1=team-a, k2=team-b"}, "auth.keys",
     {"k1": "team-a", "k2": "team-b"}),
    ('[auth]\nkeys = { "k" = "t" }', {}, "auth.keys", {"k": "t"}),
    ("", {"OTHER_PORT": "1"}, "server.port", 8080),
    # Kubernetes service links never count as settings, whatever they look like
    ("", {"GATEWAY_PORT": "tcp://10.0.0.11:8080"}, "server.port", 8080),
    ("[server]\nport = 9000", {"GATEWAY_PORT": "tcp://10.0.0.11:8080"}, "server.port", 9000),
    ("", {"GATEWAY_PORT_8080_TCP_PORT": "8080"}, "server.port", 8080),
    ("", {"GATEWAY_SERVICE_HOST": "10.0.0.11"}, "server.host", "127.0.0.1"),
    # an unknown variable is left aside (a warning), the rest still applies
    ("", {"GATEWAY_PORTT": "1", "GATEWAY_PORT": "9003"}, "server.port", 9003),
    ("", {"GATEWAY_NOPE__X": "1"}, "server.port", 8080),
    # The real-vLLM tier's variable, inherited by the gateways it starts: not a setting.
    ("", {"GATEWAY_VLLM_PYTHON": "/opt/vllm/bin/python"}, "server.port", 8080),
    ("", {"GATEWAY_DEMO__SPEED": "10"}, "demo.speed", 10.0),
    ("[demo]\ntool_call_probability = 0.2", {}, "demo.tool_call_probability", 0.2),
]


@pytest.mark.parametrize(("toml", "env", "key", "expected"), GOOD)
def test_values(toml: str, env: dict[str, str], key: str, expected: Any) -> None:
    s = parse_settings(toml, env)
    section, name = key.split(".")
    assert getattr(getattr(s, section), name) == expected


BAD: list[tuple[str, dict[str, str], str]] = [
    ("[server]\nprt = 1", {}, "server.prt"),
    ("[serverx]\nport = 1", {}, "[serverx]"),
    ("[server]\nport = 'x'", {}, "server.port"),
    ("[server]\nport = true", {}, "server.port"),
    ("[server]\nport = 70000", {}, "server.port"),
    ("[server]\nlog_level = 'loud'", {}, "server.log_level"),
    ("[server]\nread_timeout_s = 0", {}, "server.read_timeout_s"),
    ("[routing]\npolicy = 'fastest'", {}, "routing.policy"),
    ("[hygiene]\nheader = 'maybe'", {}, "hygiene.header"),
    ("[usage]\nredis_maxlen = 0", {}, "usage.redis_maxlen"),
    ("[server\nport = 1", {}, "invalid TOML"),
    ("", {"GATEWAY_PORT": "eighty"}, "GATEWAY_PORT"),
    ("", {"GATEWAY_ROUTING__POLICY": "fastest"}, "routing.policy"),
    ("", {"GATEWAY_AUTH__KEYS": "novalue"}, "key=value"),
    ("[[replicas]]\nname = 'a'", {}, "replicas[0]"),
    ("[[replicas]]\nname = 'a'\nurl = 'ftp://x'", {}, "url must be http"),
    ("[[replicas]]\nname = 'a'\nurl = 'http://x:1'\ncolor = 1", {}, "replicas[0].color"),
    ("[[replicas]]\nname = 'a'\nurl = 'http://x:1'\nmodels = 'm'", {}, "replicas[0].models"),
    ("[[replicas]]\nname = 'a'\nurl = 'http://x:1'\n[[replicas]]\nname = 'a'\n"
     "url = 'http://y:1'", {}, "duplicate replica name 'a'"),
    ("replicas = 3", {}, "array of tables"),
    ("[demo]\nspeed = 0", {}, "demo.speed"),
    ("[demo]\ntool_call_probability = 1.5", {}, "demo.tool_call_probability"),
]


@pytest.mark.parametrize(("toml", "env", "needle"), BAD)
def test_errors_name_the_key(toml: str, env: dict[str, str], needle: str) -> None:
    with pytest.raises(SettingsError) as info:
        parse_settings(toml, env)
    assert needle in str(info.value)


# (variable, value, service link?) as the kubelet writes them for Services `gateway`,
# `gateway-redis` and `gateway-vllm-0` (ports 8080/6379/8000, named port "http"), and
# look-alikes that are settings or typos.
SERVICE_LINKS: list[tuple[str, str, bool]] = [
    ("GATEWAY_SERVICE_HOST", "10.96.0.11", True),
    ("GATEWAY_SERVICE_PORT", "8080", True),
    ("GATEWAY_SERVICE_PORT_HTTP", "8080", True),
    ("GATEWAY_PORT", "tcp://10.96.0.11:8080", True),
    ("GATEWAY_PORT_8080_TCP", "tcp://10.96.0.11:8080", True),
    ("GATEWAY_PORT_8080_TCP_PROTO", "tcp", True),
    ("GATEWAY_PORT_8080_TCP_PORT", "8080", True),
    ("GATEWAY_PORT_8080_TCP_ADDR", "10.96.0.11", True),
    ("GATEWAY_PORT_5353_UDP_ADDR", "10.96.0.11", True),
    ("GATEWAY_REDIS_SERVICE_HOST", "10.96.0.12", True),
    ("GATEWAY_REDIS_PORT", "tcp://10.96.0.12:6379", True),
    ("GATEWAY_REDIS_PORT_6379_TCP_ADDR", "10.96.0.12", True),
    ("GATEWAY_VLLM_0_SERVICE_PORT", "8000", True),
    ("GATEWAY_PORT", "9000", False),
    ("GATEWAY_PORT", "http://10.96.0.11:8080", False),
    ("GATEWAY_HOST", "0.0.0.0", False),
    ("GATEWAY_USAGE__REDIS_URL", "redis://10.96.0.12:6379/0", False),
    ("GATEWAY_PORTT", "1", False),
    ("GATEWAY_PORT_8080", "1", False),
]


@pytest.mark.parametrize(("name", "value", "link"), SERVICE_LINKS)
def test_service_link_names(name: str, value: str, link: bool) -> None:
    assert is_service_link(name, value) is link


def test_kubernetes_service_links_are_ignored_with_one_note() -> None:
    env = {name: value for name, value, link in SERVICE_LINKS if link}
    env |= {"GATEWAY_ROUTING__POLICY": "session", "HOME": "/root"}
    scan = scan_env(env)
    assert scan.sections == {"routing": {"policy": "session"}}
    assert set(scan.service_links) == set(env) - {"GATEWAY_ROUTING__POLICY", "HOME"}
    assert scan.unknown == ()
    (note,) = scan.notes()
    assert note[0] == "info"
    assert "13 Kubernetes service-link variables" in note[1]
    assert "enableServiceLinks: false" in note[1]
    assert parse_settings(None, env).routing.policy == "session"


@pytest.mark.parametrize(
    ("name", "needle"),
    [
        ("GATEWAY_PORTT", "unknown key server.portt"),
        ("GATEWAY_NOPE__X", "unknown section 'nope'"),
        ("GATEWAY_ROUTING__POLCY", "unknown key routing.polcy"),
    ],
)
def test_unknown_variables_are_warnings(name: str, needle: str) -> None:
    scan = scan_env({name: "1"})
    assert scan.sections == {}
    assert [(level, needle in text, name in text) for level, text in scan.notes()] == [
        ("warning", True, True)]


def test_replicas_from_file_env_and_flags() -> None:
    toml = ("[[replicas]]\nname = 'a'\nurl = 'http://h1:8000'\napi_key = 'secret'\n"
            "models = ['m1', 'm2']\ncapacity_tokens = 4096\n")
    s = parse_settings(toml, {})
    (r,) = s.replicas
    assert (r.name, r.url, r.api_key, r.models, r.capacity_tokens) == (
        "a", "http://h1:8000", "secret", ("m1", "m2"), 4096)
    assert "secret" not in repr(s)
    env = parse_settings(toml, {"GATEWAY_BACKENDS": "http://h2:1,http://h3:2/v1"})
    assert [(x.name, x.url) for x in env.replicas] == [("h2:1", "http://h2:1"),
                                                         ("h3:2", "http://h3:2")]
    flags = parse_settings(toml, {"GATEWAY_BACKENDS": "http://h2:1"},
                           backends=["http://h4:3/"], overrides={"server": {"port": 1}})
    assert [x.url for x in flags.replicas] == ["http://h4:3"]
    assert flags.server.port == 1


def test_flags_win_over_env() -> None:
    s = parse_settings("[routing]\npolicy = 'session'", {"GATEWAY_ROUTING__POLICY": "random"},
                       overrides={"routing": {"policy": "round_robin"}})
    assert s.routing.policy == "round_robin"


@pytest.mark.parametrize(
    ("args", "env", "needle"),
    [
        (["--policy", "fastest"], {}, "routing.policy"),
        (["--backend", "nothing"], {}, "--backend"),
        ([], {"GATEWAY_PORT": "x"}, "GATEWAY_PORT"),
        (["--config", "/nonexistent/gw.toml"], {}, "cannot read"),
    ],
)
def test_serve_exits_non_zero_naming_the_key(
    args: list[str], env: dict[str, str], needle: str, tmp_path: Path
) -> None:
    import os

    full = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")} | env
    proc = subprocess.run([*script("gateway"), "serve", *args], env=full, capture_output=True,
                          timeout=30, check=False)
    assert proc.returncode == 2
    assert needle in proc.stderr.decode()
