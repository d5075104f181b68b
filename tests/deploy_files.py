"""The deploy/ folder as the deployment tests read it: its YAML documents, the Kubernetes
pod specs and the gateway settings the ConfigMap ships."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from tests.servers import ROOT

DEPLOY = ROOT / "deploy"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "cache-gateway.json"


def load_yaml(path: Path) -> list[Any]:
    return list(yaml.safe_load_all(path.read_text()))


def k8s_docs() -> Iterator[dict[str, Any]]:
    for path in sorted((DEPLOY / "k8s").glob("*.yaml")):
        if path.name != "kustomization.yaml":
            yield from load_yaml(path)


def pod_specs() -> Iterator[tuple[str, dict[str, Any]]]:
    for doc in k8s_docs():
        if doc["kind"] in ("Deployment", "StatefulSet"):
            yield doc["metadata"]["name"], doc["spec"]["template"]["spec"]


def configmap_toml() -> str:
    """The gateway settings the Kubernetes ConfigMap ships."""
    (doc,) = load_yaml(DEPLOY / "k8s" / "gateway-configmap.yaml")
    return str(doc["data"]["gateway.toml"])
