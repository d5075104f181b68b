"""config/gateway.example.toml documents every setting: each field of each section appears
(set, or commented out when its default is None or the value is an example), and every
value set there is the default, as the file says."""

from __future__ import annotations

import dataclasses
import re
import tomllib
from typing import Any

import pytest

from gateway.admission.config import AdmissionConfig
from gateway.events.config import TokenSettings
from gateway.hygiene.config import HygieneConfig
from gateway.routing.config import RoutingConfig
from gateway.settings import AuthSettings, EppSettings, ReplicaSettings, ServerSettings
from gateway.shared.config import RedisSettings
from gateway.usage.config import UsageConfig
from tests.servers import ROOT

EXAMPLE = ROOT / "config" / "gateway.example.toml"
_HEADER = re.compile(r"^\[\[?(\w+)\]\]?\s*$")
_COMMENTED = re.compile(r"^#\s*(\w+)\s*=")


def commented_keys(text: str) -> dict[str, set[str]]:
    """Keys written as `# key = ...` under each section header."""
    out: dict[str, set[str]] = {}
    section = ""
    for line in text.splitlines():
        if m := _HEADER.match(line):
            section = m.group(1)
        elif m := _COMMENTED.match(line):
            out.setdefault(section, set()).add(m.group(1))
    return out


@pytest.mark.parametrize(("section", "cls"), [
    ("server", ServerSettings), ("replicas", ReplicaSettings), ("auth", AuthSettings),
    ("routing", RoutingConfig), ("hygiene", HygieneConfig), ("usage", UsageConfig),
    ("tokens", TokenSettings), ("redis", RedisSettings), ("epp", EppSettings),
    ("admission", AdmissionConfig),
])
def test_example_lists_every_field(section: str, cls: type[Any]) -> None:
    text = EXAMPLE.read_text()
    doc = tomllib.loads(text)
    tables = doc[section] if isinstance(doc[section], list) else [doc[section]]
    written = set().union(*(t.keys() for t in tables))
    fields = {f.name: f for f in dataclasses.fields(cls)}
    assert written | commented_keys(text).get(section, set()) == set(fields)
    if section in ("replicas", "auth"):
        return  # example values
    for key, value in doc[section].items():
        default = fields[key].default
        if isinstance(value, list):  # a TOML array is a tuple setting
            value = tuple(value)
        assert value == default, f"{section}.{key} = {value!r}, default {default!r}"
