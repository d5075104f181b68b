"""The endpoint-picker deployment example (deploy/k8s/epp/): the manifests parse, the
kustomization lists each, the InferencePool (GIE v1) names the picker's Service and port,
the picker's settings are valid settings, and its pod is probed by gRPC health."""

from __future__ import annotations

from typing import Any

import yaml

from gateway.settings import parse_settings
from tests.servers import ROOT

EPP = ROOT / "deploy" / "k8s" / "epp"


def docs() -> dict[str, dict[str, Any]]:
    out = {}
    for path in sorted(EPP.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if "kind" in doc and doc["kind"] != "Kustomization":
                out[doc["kind"]] = doc
    return out


def test_kustomization_lists_every_manifest() -> None:
    kust = yaml.safe_load((EPP / "kustomization.yaml").read_text())
    assert set(kust["resources"]) == {p.name for p in EPP.glob("*.yaml")} - {
        "kustomization.yaml"}


def test_pool_names_the_picker() -> None:
    d = docs()
    pool = d["InferencePool"]
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    ref = pool["spec"]["endpointPickerRef"]
    service = d["Service"]
    assert ref["name"] == service["metadata"]["name"]
    assert ref["failureMode"] in ("FailOpen", "FailClose")
    (port,) = service["spec"]["ports"]
    assert ref["port"]["number"] == port["port"]
    route = d["HTTPRoute"]["spec"]["rules"][0]["backendRefs"][0]
    assert (route["kind"], route["name"]) == ("InferencePool", pool["metadata"]["name"])


def test_picker_settings_and_pod() -> None:
    d = docs()
    settings = parse_settings(d["ConfigMap"]["data"]["gateway.toml"], {})
    assert settings.epp.pool == d["InferencePool"]["metadata"]["name"]
    assert settings.epp.host == "0.0.0.0"
    pod = d["Deployment"]["spec"]["template"]["spec"]
    # the service account may read the pool and list and watch its pods, nothing more
    # (exactly what the pool watch's calls need: tests/test_deploy_rbac.py)
    assert pod["serviceAccountName"] == d["ServiceAccount"]["metadata"]["name"]
    rules = {(r["apiGroups"][0], r["resources"][0]): set(r["verbs"])
             for r in d["Role"]["rules"]}
    assert rules == {("inference.networking.k8s.io", "inferencepools"): {"get"},
                     ("", "pods"): {"list", "watch"}}
    (container,) = pod["containers"]
    assert container["command"][:2] == ["gateway", "epp"]
    assert container["readinessProbe"]["grpc"]["port"] == settings.epp.port
    assert pod["enableServiceLinks"] is False
