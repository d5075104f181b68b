"""Properties of settings parsing on arbitrary input: any config text and any `GATEWAY_*`
environment either builds `Settings` or raises `SettingsError` (the CLI's exit 2 with the
offending key named), never another exception."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.coerce import SettingsError
from gateway.settings import SECTIONS, Settings, parse_settings
from tests.props import ascii_text, text

KEYS = {name: [f.name for f in dataclasses.fields(cls)] for name, cls in SECTIONS.items()}
SCALAR = st.one_of(st.booleans(), st.integers(-(2**40), 2**40),
                   st.floats(allow_nan=False, allow_infinity=False), ascii_text)
VALUE = st.one_of(SCALAR, st.lists(SCALAR, max_size=3))


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, str):
        return json.dumps(v)  # a TOML basic string for printable ASCII
    return repr(v)


@st.composite
def config_text(draw: st.DrawFn) -> str:
    lines: list[str] = []
    for section in draw(st.lists(st.sampled_from([*SECTIONS, "bogus"]), unique=True,
                                 max_size=4)):
        lines.append(f"[{section}]")
        names = KEYS.get(section, ["x"])
        for key in draw(st.lists(st.sampled_from([*names, "nope"]), unique=True, max_size=4)):
            lines.append(f"{key} = {_toml_value(draw(VALUE))}")
    return "\n".join(lines)


def _parse(toml: str | None, env: dict[str, str]) -> Settings | None:
    try:
        return parse_settings(toml, env)
    except SettingsError as exc:
        assert str(exc)  # the message says what is wrong
        return None


@settings(max_examples=300, deadline=None)
@given(config_text())
def test_any_config_builds_or_names_its_error(toml: str) -> None:
    _parse(toml, {})


@settings(max_examples=200, deadline=None)
@given(text)
def test_any_text_as_config_builds_or_names_its_error(toml: str) -> None:
    _parse(toml, {})


ENV_NAME = st.one_of(
    st.sampled_from([f"GATEWAY_{s.upper()}__{k.upper()}" for s in KEYS for k in KEYS[s]]),
    st.sampled_from([f"GATEWAY_{k.upper()}" for k in KEYS["server"]] + ["GATEWAY_BACKENDS"]),
    ascii_text.map(lambda s: "GATEWAY_" + s.upper()),
)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(ENV_NAME, ascii_text, max_size=4))
def test_any_environment_builds_or_names_its_error(env: dict[str, str]) -> None:
    _parse(None, env)
