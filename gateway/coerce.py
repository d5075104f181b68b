"""Build a frozen config dataclass from a mapping of raw values, generically, by each
field's name and annotated type (pure).

This is what lets every component own its config dataclass (`RoutingConfig`,
`HygieneConfig`, `UsageConfig`, ...) and add fields without touching the settings loader.
Values come either typed (TOML) or as strings (environment variables); both are checked
against the annotation and every failure is a `SettingsError` naming `section.key` and the
offending value.

Supported annotations: `bool`, `int`, `float`, `str`, `X | None`, `Literal[...]`,
`tuple[X, ...]`, `list[X]`, `dict[str, X]` / `Mapping[str, X]`, and nested dataclasses
(a TOML table). From a string: booleans are `1/true/yes/on` and `0/false/no/off`, `none`,
`null` or the empty string mean `None` for optional fields, sequences are comma-separated,
mappings are `key=value` pairs separated by commas.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal, TypeVar, Union, cast

T = TypeVar("T")

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}
_NONE = {"", "none", "null"}


class SettingsError(ValueError):
    """A configuration value or key is invalid; the message names it."""


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "none"
    return getattr(tp, "__name__", str(tp))


def coerce(value: Any, tp: Any, where: str, *, from_text: bool) -> Any:
    """Check (and, for text, parse) one value against an annotation."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    bad = SettingsError(f"{where}: expected {_type_name(tp)}, got {_show(value)}")

    if origin in (Union, types.UnionType):
        members = [a for a in args if a is not type(None)]
        if type(None) in args and (
            value is None or (from_text and isinstance(value, str) and value.lower() in _NONE)
        ):
            return None
        for member in members:
            try:
                return coerce(value, member, where, from_text=from_text)
            except SettingsError:
                continue
        raise bad
    if origin is Literal:
        for choice in args:
            if value == choice and type(value) is type(choice):
                return choice
            if from_text and isinstance(value, str) and str(choice) == value:
                return choice
        raise bad
    if tp is bool:
        if isinstance(value, bool):
            return value
        if from_text and isinstance(value, str) and value.lower() in _TRUE | _FALSE:
            return value.lower() in _TRUE
        raise bad
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if from_text and isinstance(value, str):
            try:
                return int(value.strip().replace("_", ""))
            except ValueError:
                raise bad from None
        raise bad
    if tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if from_text and isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                raise bad from None
        raise bad
    if tp is str:
        if isinstance(value, str):
            return value
        raise bad
    if origin in (tuple, list, collections.abc.Sequence):
        items = value
        if from_text and isinstance(value, str):
            items = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(items, list | tuple):
            raise bad
        if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            if len(items) != len(args):
                raise bad
            return tuple(
                coerce(v, a, f"{where}[{i}]", from_text=from_text)
                for i, (v, a) in enumerate(zip(items, args, strict=True))
            )
        item_tp = args[0] if args else Any
        out = [
            coerce(v, item_tp, f"{where}[{i}]", from_text=from_text) for i, v in enumerate(items)
        ]
        return out if origin is list else tuple(out)
    if origin in (dict, collections.abc.Mapping):
        mapping = value
        if from_text and isinstance(value, str):
            mapping = {}
            for pair in (p.strip() for p in value.split(",") if p.strip()):
                key, sep, val = pair.partition("=")
                if not sep:
                    raise SettingsError(f"{where}: expected key=value pairs, got {_show(pair)}")
                mapping[key.strip()] = val.strip()
        if not isinstance(mapping, dict):
            raise bad
        val_tp = args[1] if len(args) == 2 else Any
        return {
            coerce(k, str, where, from_text=False): coerce(
                v, val_tp, f"{where}.{k}", from_text=from_text
            )
            for k, v in mapping.items()
        }
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        if not isinstance(value, dict):
            raise bad
        return build(tp, value, where, from_text=from_text)
    if tp is Any:
        return value
    raise SettingsError(f"{where}: unsupported field type {tp!r}")


def field_types(cls: type[Any]) -> dict[str, Any]:
    """Init fields of a dataclass and their resolved annotations."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.init}


def build(
    cls: type[T], raw: Mapping[str, Any], section: str, *, from_text: bool = False
) -> T:
    """Instantiate `cls` from raw values; unknown keys and bad values are errors."""
    types_ = field_types(cls)
    unknown = sorted(set(raw) - set(types_))
    if unknown:
        known = ", ".join(sorted(types_))
        raise SettingsError(f"unknown key {section}.{unknown[0]} (known keys: {known})")
    required = [f.name for f in dataclasses.fields(cast(Any, cls)) if f.init
                and f.default is dataclasses.MISSING
                and f.default_factory is dataclasses.MISSING]
    missing = [name for name in required if name not in raw]
    if missing:
        raise SettingsError(f"missing key {section}.{missing[0]} (required: "
                            f"{', '.join(required)})")
    kwargs = {
        key: coerce(value, types_[key], f"{section}.{key}", from_text=from_text)
        for key, value in raw.items()
    }
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as exc:
        raise SettingsError(f"[{section}] {exc}") from exc
