"""Deployment files: every YAML and JSON file under deploy/ parses; compose, Kubernetes and
the Dockerfile keep the properties the gateway depends on; the gateway settings they ship
are valid settings; and every metric the alert rules and the Grafana dashboard query is
one a live gateway exports (read from its `/metrics`), a recording rule of ours, or a vLLM
name (the contract in ../shared/vllm-contract.md, or what a live `gateway sim` exports)."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from gateway.settings import parse_settings
from tests.servers import ROOT, gateway, sim

DEPLOY = ROOT / "deploy"
YAML_FILES = sorted([*DEPLOY.rglob("*.yaml"), *DEPLOY.rglob("*.yml")])
JSON_FILES = sorted(DEPLOY.rglob("*.json"))
RULES = DEPLOY / "prometheus" / "rules" / "gateway.yml"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "cache-gateway.json"

# Gateway metrics the rules or the dashboard may use before the gateway exports them: the
# one place such names are allowed. `gateway_route_moves_total{reason}` (conversations
# moved off their replica) is being added with the routing work on implicit conversations.
UPCOMING_GATEWAY_METRICS: frozenset[str] = frozenset()  # names the gateway will export soon
# Prometheus' own series
PROMETHEUS_BUILTINS = frozenset({"up"})
VLLM_FLAGS = ("--enable-prompt-tokens-details", "--enable-prefix-caching",
              "--gpu-memory-utilization", "--max-model-len", "--kv-events-config")


def _load_yaml(path: Path) -> list[Any]:
    return list(yaml.safe_load_all(path.read_text()))


@pytest.mark.parametrize("path", YAML_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_yaml_parses(path: Path) -> None:
    docs = _load_yaml(path)
    assert docs and all(isinstance(d, dict) for d in docs)


@pytest.mark.parametrize("path", JSON_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_json_parses(path: Path) -> None:
    assert isinstance(json.loads(path.read_text()), dict)


def test_there_is_something_to_parse() -> None:
    assert len(YAML_FILES) >= 15 and DASHBOARD in JSON_FILES


# ---- the gateway settings shipped with compose and Kubernetes are valid settings ----

def _configmap_toml() -> str:
    (doc,) = _load_yaml(DEPLOY / "k8s" / "gateway-configmap.yaml")
    return str(doc["data"]["gateway.toml"])


@pytest.mark.parametrize("source", ["compose", "k8s"])
def test_shipped_gateway_settings_are_valid(source: str) -> None:
    text = ((DEPLOY / "gateway" / "gateway.toml").read_text() if source == "compose"
            else _configmap_toml())
    s = parse_settings(text, {}, source=source)
    assert s.server.host == "0.0.0.0" and s.server.port == 8080
    assert [r.name for r in s.replicas] == ["vllm-0", "vllm-1"]
    assert s.usage.redis_url is not None and "redis:6379" in s.usage.redis_url


# ---- compose ----

@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    (doc,) = _load_yaml(DEPLOY / "compose.yaml")
    return dict(doc)


def test_compose_services_and_profiles(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert {"gateway", "redis", "prometheus", "grafana"} <= set(services)
    for name in ("gateway", "redis", "prometheus", "grafana"):
        assert "profiles" not in services[name], name  # in both stacks
    for i in (0, 1):
        gpu, simulated = services[f"vllm-{i}"], services[f"sim-{i}"]
        assert gpu["profiles"] == ["gpu"] and simulated["profiles"] == ["sim"]
        # the sim replica answers to the vLLM replica's name: one gateway config for both
        assert simulated["networks"]["default"]["aliases"] == [f"vllm-{i}"]
        assert simulated["entrypoint"] == ["gateway", "sim"]
        assert "--host=0.0.0.0" in simulated["command"] and "--port=8000" in simulated["command"]
        (device,) = gpu["deploy"]["resources"]["reservations"]["devices"]
        assert device["device_ids"] == [str(i)] and device["capabilities"] == ["gpu"]
        command = " ".join(gpu["command"])
        for flag in VLLM_FLAGS:
            assert flag in command, flag
        assert "models:/models" in gpu["volumes"]  # the shared model cache
    kv = next(a for a in services["vllm-0"]["command"] if a.startswith("--kv-events-config"))
    assert json.loads(kv.partition("=")[2])["enable_kv_cache_events"] is True


def test_compose_mounts_exist(compose: dict[str, Any]) -> None:
    for name, service in compose["services"].items():
        for volume in service.get("volumes", []):
            source = volume.split(":", 1)[0]
            if source.startswith("."):
                assert (DEPLOY / source).exists(), (name, source)
        build = service.get("build")
        if build:
            assert (DEPLOY / build["context"] / build["dockerfile"]).is_file()


# ---- Kubernetes ----

def _k8s_docs() -> Iterator[dict[str, Any]]:
    for path in sorted((DEPLOY / "k8s").glob("*.yaml")):
        if path.name != "kustomization.yaml":
            yield from _load_yaml(path)


def _pod_specs() -> Iterator[tuple[str, dict[str, Any]]]:
    for doc in _k8s_docs():
        if doc["kind"] in ("Deployment", "StatefulSet"):
            yield doc["metadata"]["name"], doc["spec"]["template"]["spec"]


def test_kustomization_lists_every_manifest() -> None:
    (kust,) = _load_yaml(DEPLOY / "k8s" / "kustomization.yaml")
    on_disk = {p.name for p in (DEPLOY / "k8s").glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kust["resources"]) == on_disk


def test_k8s_pods_drop_service_links_and_have_probes() -> None:
    specs = dict(_pod_specs())
    assert set(specs) == {"gateway", "redis", "vllm"}
    for name, spec in specs.items():
        assert spec["enableServiceLinks"] is False, name
        for container in spec["containers"]:
            assert "readinessProbe" in container and "livenessProbe" in container, name


def test_k8s_shape() -> None:
    docs = {(d["kind"], d["metadata"]["name"]): d for d in _k8s_docs()}
    gw = docs[("Deployment", "gateway")]
    assert gw["spec"]["replicas"] >= 2
    (container,) = gw["spec"]["template"]["spec"]["containers"]
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert gw["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True
    vllm = docs[("StatefulSet", "vllm")]
    (engine,) = vllm["spec"]["template"]["spec"]["containers"]
    assert engine["resources"]["limits"]["nvidia.com/gpu"] == "1"
    for flag in VLLM_FLAGS:
        assert any(a.startswith(flag) for a in engine["args"]), flag
    assert {("PodDisruptionBudget", "gateway"), ("PodDisruptionBudget", "vllm"),
            ("Service", "gateway"), ("Service", "vllm"), ("Service", "redis"),
            ("ConfigMap", "gateway-config")} <= set(docs)
    # the ConfigMap's replica URLs are the StatefulSet's pod DNS names
    assert vllm["spec"]["serviceName"] == "vllm"
    assert "http://vllm-0.vllm:8000" in _configmap_toml()


# ---- Kubernetes RBAC: what is granted is what the code's calls need ----

Grant = tuple[str, str, str]  # (API group, resource, verb)
_VERBS = {"POST": "create", "PUT": "update", "PATCH": "patch"}


def api_grant(method: str, path_qs: str) -> Grant:
    """The RBAC grant a request to the Kubernetes API server needs: its API group and
    resource from the path, its verb from the method, whether it names one object, and
    `watch` in the query."""
    url = urllib.parse.urlsplit(path_qs)
    parts = url.path.strip("/").split("/")
    # /api/v1/namespaces/NS/RESOURCE[/NAME] or /apis/GROUP/VERSION/namespaces/NS/...
    group, rest = ("", parts[2:]) if parts[0] == "api" else (parts[1], parts[3:])
    assert rest[0] == "namespaces" and len(rest) >= 3, path_qs
    resource, named = rest[2], len(rest) > 3
    watch = urllib.parse.parse_qs(url.query).get("watch", [""])[-1] in ("true", "1")
    if method == "GET":
        verb = "watch" if watch else "get" if named else "list"
    elif method == "DELETE":
        verb = "delete" if named else "deletecollection"
    else:
        verb = _VERBS[method]
    return group, resource, verb


@pytest.mark.parametrize(("method", "path_qs", "grant"), [
    ("GET", "/api/v1/namespaces/ns/pods?labelSelector=app%3Dvllm", ("", "pods", "list")),
    ("GET", "/api/v1/namespaces/ns/pods?labelSelector=a&watch=true&resourceVersion=3",
     ("", "pods", "watch")),
    ("GET", "/api/v1/namespaces/ns/pods/vllm-0", ("", "pods", "get")),
    ("GET", "/apis/inference.networking.k8s.io/v1/namespaces/ns/inferencepools/vllm",
     ("inference.networking.k8s.io", "inferencepools", "get")),
    ("POST", "/api/v1/namespaces/ns/pods", ("", "pods", "create")),
    ("PATCH", "/api/v1/namespaces/ns/pods/vllm-0", ("", "pods", "patch")),
    ("DELETE", "/api/v1/namespaces/ns/pods/vllm-0", ("", "pods", "delete")),
    ("DELETE", "/api/v1/namespaces/ns/pods", ("", "pods", "deletecollection")),
])
def test_api_grant(method: str, path_qs: str, grant: Grant) -> None:
    assert api_grant(method, path_qs) == grant


def _rbac(path: Path) -> dict[str, dict[str, Any]]:
    return {d["kind"]: d for d in _load_yaml(path)}


def _granted(role: dict[str, Any]) -> set[Grant]:
    return {(group, resource, verb) for rule in role["rules"] for group in rule["apiGroups"]
            for resource in rule["resources"] for verb in rule["verbs"]}


async def _needed(start: Callable[[Any, Callable[[], None]], Any], tmp_path: Path
                  ) -> set[Grant]:
    """The grants of every call the watch `start(api, found)` makes to a fake API server
    (tests/fake_kube.py) until it has listed a ready pod and is watching."""
    pytest.importorskip("kubernetes")
    from kubernetes import config

    from tests.fake_kube import fake_kube, pod

    pool = {"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
            "metadata": {"name": "vllm", "namespace": "ns"},
            "spec": {"selector": {"matchLabels": {"app": "vllm"}},
                     "targetPorts": [{"number": 8000}]}}
    with fake_kube(pool) as kube:
        kube.put(pod("vllm-0", "127.0.0.1", True, {"app": "vllm"}))
        api = config.new_client_from_config(  # type: ignore[no-untyped-call]
            config_file=str(kube.kubeconfig(tmp_path / "kubeconfig")))
        found = asyncio.Event()
        watch = start(api, found.set)
        try:
            await asyncio.wait_for(found.wait(), 30)
            for _ in range(3000):  # the watch request follows the list
                if any("watch=" in p for _, p in kube.calls):
                    break
                await asyncio.sleep(0.01)
        finally:
            watch.stop()
        return {api_grant(method, path) for method, path in kube.calls}


async def test_gateway_service_account_may_do_what_the_selector_does(tmp_path: Path) -> None:
    from gateway.replicas.sources import KubeSource
    from gateway.settings import DiscoverySettings

    discovery = DiscoverySettings(kubernetes_selector="app=vllm", kubernetes_port=8000,
                                  kubernetes_namespace="ns")

    def start(api: Any, found: Callable[[], None]) -> Any:
        source = KubeSource(discovery, api, lambda _source, replicas: replicas and found())
        source.start()
        return source

    rbac = _rbac(DEPLOY / "k8s" / "gateway-rbac.yaml")
    assert _granted(rbac["Role"]) == await _needed(start, tmp_path)
    # the Deployment runs under that account, bound to that role
    account = rbac["ServiceAccount"]["metadata"]["name"]
    assert rbac["RoleBinding"]["subjects"] == [{"kind": "ServiceAccount", "name": account}]
    assert rbac["RoleBinding"]["roleRef"]["name"] == rbac["Role"]["metadata"]["name"]
    spec = dict(_pod_specs())["gateway"]
    assert spec["serviceAccountName"] == account
    # its token is mounted exactly when the shipped settings follow pods by label
    selector = parse_settings(_configmap_toml(), {}).discovery.kubernetes_selector
    assert spec["automountServiceAccountToken"] is bool(selector)


async def test_picker_service_account_may_do_what_the_pool_watch_does(tmp_path: Path) -> None:
    from gateway.epp.pool import PoolWatch

    def start(api: Any, found: Callable[[], None]) -> Any:
        watch = PoolWatch(api, "ns", "vllm", lambda endpoints: endpoints and found(),
                          asyncio.get_running_loop())
        watch.start()
        return watch

    rbac = _rbac(DEPLOY / "k8s" / "epp" / "epp-rbac.yaml")
    assert _granted(rbac["Role"]) == await _needed(start, tmp_path)


# ---- Dockerfile ----

def test_dockerfile() -> None:
    text = (ROOT / "Dockerfile").read_text()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("#")]
    assert sum(ln.startswith("FROM ") for ln in lines) == 2  # build stage + runtime
    assert "slim" in text
    user = [ln for ln in lines if ln.startswith("USER ")]
    assert user and user[-1].split()[1].split(":")[0] not in ("root", "0")
    assert any(ln.startswith("HEALTHCHECK") for ln in lines) and "/health" in text
    assert 'ENTRYPOINT ["gateway", "serve"]' in lines
    assert "/etc/gateway/gateway.toml" in text
    # what it copies is in the build context (.dockerignore re-includes it)
    ignore = (ROOT / ".dockerignore").read_text().split()
    for ln in lines:
        if ln.startswith("COPY ") and "--from" not in ln:
            for src in ln.split()[1:-1]:
                assert (ROOT / src).exists(), src
                name = src.rstrip("/")
                assert {f"!{name}", f"!{name}/"} & set(ignore), src


# ---- launch_vllm.sh ----

LAUNCH = DEPLOY / "launch_vllm.sh"


def _launch(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    # A directory with an executable named `vllm` satisfies the script's installation
    # check; --dry-run stops before anything is executed.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    exe = bin_dir / "vllm"
    exe.write_text("#!/bin/sh\nexit 1\n")
    exe.chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HF_HUB_OFFLINE": "1"}
    return subprocess.run(["bash", str(LAUNCH), *args], capture_output=True, text=True,
                          timeout=30, check=False, env=env)


def test_launch_vllm_prints_the_flags(tmp_path: Path) -> None:
    proc = _launch(["--dry-run", "--port", "8123", "--kv-events-port", "5557",
                    "--max-model-len", "8192", "--", "--block-size", "16"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    (started,) = [ln for ln in proc.stderr.splitlines() if "starting:" in ln]
    for flag in (*VLLM_FLAGS, "--port 8123", "--max-model-len 8192", "--block-size 16",
                 "tcp://\\*:5557", "tcp://\\*:5558"):
        assert flag in started, flag


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--port", "70000"], "--port must be 1..65535"),
        (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization"),
        (["--max-model-len", "big"], "--max-model-len"),
        (["--gpu", "zero"], "--gpu"),
        (["--bogus"], "unknown option --bogus"),
    ],
)
def test_launch_vllm_refuses_bad_values(args: list[str], needle: str, tmp_path: Path) -> None:
    proc = _launch(["--dry-run", *args], tmp_path)
    assert proc.returncode == 2
    assert needle in proc.stderr


def test_launch_vllm_without_vllm(tmp_path: Path) -> None:
    env = {"PATH": str(tmp_path)}  # no vllm, no python3
    proc = subprocess.run([shutil.which("bash") or "/bin/bash", str(LAUNCH), "--dry-run"],
                          capture_output=True, text=True, timeout=30, check=False, env=env)
    assert proc.returncode == 2 and "vllm is not installed" in proc.stderr


# ---- metric names in the rules and the dashboard ----

# a series name: not inside a label matcher or a string, followed by a selector, range,
# closing parenthesis, space or the end
_NAME = re.compile(
    r"(?<![\w:{\"'])(gateway[_:][A-Za-z0-9_:]*|vllm:[A-Za-z0-9_:]+|up)(?=\s*[{\[)]|\s|$)"
)


def _exprs() -> list[tuple[str, str]]:
    (rules,) = _load_yaml(RULES)
    out = [(f"rule {r.get('alert') or r.get('record')}", r["expr"])
           for g in rules["groups"] for r in g["rules"]]
    dashboard = json.loads(DASHBOARD.read_text())
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            out.append((f"panel {panel['title']!r}", target["expr"]))
    return out


def _metric_names(expr: str) -> set[str]:
    return set(_NAME.findall(expr))


def _recorded() -> set[str]:
    (rules,) = _load_yaml(RULES)
    return {r["record"] for g in rules["groups"] for r in g["rules"] if "record" in r}


def _sample_names(text: str, prefix: str) -> set[str]:
    """Every series name a /metrics text can produce, from its families (a family with no
    sample yet, e.g. a labelled counter nobody incremented, still counts)."""
    suffixes = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count",
                "_created"), "summary": ("_sum", "_count", "_created"), "gauge": ("",),
                "info": ("_info",), "unknown": ("",)}
    names = set()
    for family in text_string_to_metric_families(text):
        if family.name.startswith(prefix):
            names |= {family.name + s for s in suffixes.get(family.type, ("",))}
            names |= {s.name for s in family.samples}
    return names


def _contract_vllm_names() -> set[str] | None:
    for folder in (ROOT.parent / "shared", ROOT.parent.parent / "shared"):
        path = folder / "vllm-contract.md"
        if path.is_file():
            return set(re.findall(r"vllm:[a-z0-9_:]*[a-z0-9]", path.read_text()))
    return None


@pytest.fixture(scope="module")
def live_names() -> dict[str, set[str]]:
    """/metrics of a live gateway in front of a live `gateway sim`, after one request."""
    with sim(2) as urls, gateway(urls) as base:
        body = json.dumps({"model": "Qwen/Qwen2.5-7B-Instruct", "max_tokens": 4,
                           "messages": [{"role": "user", "content": "hello"}]}).encode()
        req = urllib.request.Request(base + "/v1/chat/completions", data=body,
                                     headers={"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as resp:
            assert resp.status == 200
        with urllib.request.urlopen(base + "/metrics", timeout=10) as resp:
            gateway_text = resp.read().decode()
        with urllib.request.urlopen(urls[0] + "/metrics", timeout=10) as resp:
            sim_text = resp.read().decode()
    return {"gateway": _sample_names(gateway_text, "gateway_"),
            "sim": _sample_names(sim_text, "vllm:")}


def _strip(name: str) -> str:
    return re.sub(r"_(bucket|sum|count|total|created)$", "", name)


def test_metric_name_extraction() -> None:
    expr = ('histogram_quantile(0.99, sum by (le, replica) (rate(vllm:inter_token_latency_'
            'seconds_bucket[5m]))) > 0.1 and gateway:cached_ratio:rate2m < 0.4 or '
            'up{job="vllm"} == 0 and sum(rate(gateway_cached_tokens_total[2m])) > 0')
    assert _metric_names(expr) == {"vllm:inter_token_latency_seconds_bucket",
                                   "gateway:cached_ratio:rate2m", "up",
                                   "gateway_cached_tokens_total"}
    assert _metric_names('sum by (replica) (x) / label_replace(y, "gateway", ...)') == set()


def test_every_queried_metric_exists(live_names: dict[str, set[str]]) -> None:
    assert "gateway_requests_total" in live_names["gateway"]  # the scrape worked
    contract = _contract_vllm_names()
    vllm_known = live_names["sim"] | (contract or set())
    recorded = _recorded()
    unknown = []
    used = set()
    for where, expr in _exprs():
        # no series name escapes the extraction
        mentioned = re.findall(r"(?<![\w:])(?:gateway[_:]|vllm:)[A-Za-z0-9_:]+", expr)
        assert set(mentioned) <= _metric_names(expr), (where, expr)
        for name in _metric_names(expr):
            used.add(name)
            ok = (name in live_names["gateway"] or name in UPCOMING_GATEWAY_METRICS
                  or name in recorded or name in PROMETHEUS_BUILTINS
                  or (name.startswith("vllm:")
                      and (name in vllm_known or _strip(name) in vllm_known
                           or _strip(name) + "_total" in vllm_known)))
            if not ok:
                unknown.append(f"{where}: {name}")
    assert not unknown, unknown
    # the rules and dashboard cover what the issue asks for
    for needed in ("vllm:kv_cache_usage_perc", "gateway_ttft_seconds_bucket",
                   "gateway_non_streamed_latency_seconds_bucket",
                   "vllm:inter_token_latency_seconds_bucket", "gateway_cached_tokens_total",
                   "gateway_predicted_cached_tokens_total", "gateway_best_available_tokens_total",
                   "vllm:num_preemptions_total", "gateway_replica_healthy",
                   "gateway_records_without_cached_tokens_total",
                   "gateway_routing_decisions_total", "gateway_route_moves_total",
                   "gateway_hygiene_findings_total"):
        assert needed in used, needed


def test_alerts_the_issue_lists() -> None:
    (rules,) = _load_yaml(RULES)
    alerts = {r["alert"]: r for g in rules["groups"] for r in g["rules"] if "alert" in r}
    assert alerts["ReplicaKVCacheUsageHigh"]["expr"].rstrip().endswith("> 0.85")
    assert alerts["ReplicaKVCacheUsageCritical"]["expr"].rstrip().endswith("> 0.95")
    assert alerts["ReplicaKVCacheUsageCritical"]["labels"]["severity"] == "critical"
    assert alerts["GatewayTTFTP99High"]["expr"].rstrip().endswith("> 1")
    assert alerts["ReplicaTPOTP99High"]["expr"].rstrip().endswith("> 0.1")
    assert "< 0.4" in alerts["GatewayCachedRatioLow"]["expr"]
    assert alerts["GatewayCachedRatioLow"]["for"] == "1m"
    assert "deriv(" in alerts["GatewayPredictionGapGrowing"]["expr"]
    for name in ("ReplicaPreemptionsClimbing", "ReplicaDown",
                 "ReplicaNotReportingCachedTokens"):
        assert name in alerts


@pytest.mark.skipif(shutil.which("promtool") is None,
                    reason="promtool not installed (Debian package prometheus; .ci/run has it)")
def test_promtool_checks_and_unit_tests() -> None:
    for argv in (["check", "rules", str(RULES)],
                 ["check", "config", str(DEPLOY / "prometheus" / "prometheus.yml")],
                 ["test", "rules", str(DEPLOY / "prometheus" / "tests" / "gateway_test.yml")]):
        proc = subprocess.run(["promtool", *argv], capture_output=True, text=True, timeout=60,
                              check=False)
        assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.skipif(shutil.which("promtool") is None,
                    reason="promtool not installed (Debian package prometheus; .ci/run has it)")
def test_dashboard_queries_are_valid_promql(tmp_path: Path) -> None:
    """promtool parses each dashboard query as the expression of a recording rule."""
    rules = [{"record": f"dashboard:query_{i}",
              "expr": expr.replace("$__rate_interval", "5m")}
             for i, (where, expr) in enumerate(_exprs()) if where.startswith("panel")]
    assert len(rules) >= 15
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    proc = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True,
                          text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.skipif(shutil.which("shellcheck") is None,
                    reason="shellcheck not installed (Debian package shellcheck; .ci/run has it)")
def test_launch_vllm_shellcheck() -> None:
    proc = subprocess.run(["shellcheck", str(LAUNCH)], capture_output=True, text=True,
                          timeout=60, check=False)
    assert proc.returncode == 0, proc.stdout
