"""A small JSON-schema checker for the tool-call tests (the keywords the simulator's argument
generator honours; `jsonschema` is no dependency of the project)."""

from __future__ import annotations

from typing import Any

_TYPES: dict[str, tuple[type, ...]] = {
    "object": (dict,), "array": (list,), "string": (str,), "boolean": (bool,),
    "integer": (int,), "number": (int, float), "null": (type(None),),
}


def resolve(ref: str, root: Any) -> Any:
    """A local `$ref` ("#", "#/$defs/x", "#/definitions/x") within `root`."""
    assert ref.startswith("#"), ref
    node = root
    for part in ref[1:].split("/")[1:]:
        node = node[part.replace("~1", "/").replace("~0", "~")]
    return node


def errors(value: Any, schema: Any, path: str = "$", root: Any = None) -> list[str]:
    """Every way `value` breaks `schema` (empty: valid); local `$ref`s are followed."""
    if not isinstance(schema, dict):
        return []
    if root is None:
        root = schema
    out: list[str] = []
    if "$ref" in schema:
        out += errors(value, resolve(schema["$ref"], root), path, root)
    if "const" in schema and value != schema["const"]:
        out.append(f"{path}: not the const")
    if "enum" in schema and value not in schema["enum"]:
        out.append(f"{path}: {value!r} not in enum")
    for key in ("anyOf", "oneOf"):
        if key in schema and all(errors(value, s, path, root) for s in schema[key]):
            out.append(f"{path}: matches none of {key}")
    for part in schema.get("allOf", ()):
        out += errors(value, part, path, root)
    kind = schema.get("type")
    if kind is not None:
        kinds = kind if isinstance(kind, list) else [kind]
        ok = any(isinstance(value, _TYPES[k]) and not (
            k in ("integer", "number") and isinstance(value, bool)) for k in kinds)
        if not ok:
            return [*out, f"{path}: {value!r} is not {kind}"]
    if isinstance(value, dict):
        props = schema.get("properties", {})
        for name in schema.get("required", ()):
            if name not in value:
                out.append(f"{path}: missing {name}")
        for name, item in value.items():
            if name in props:
                out += errors(item, props[name], f"{path}.{name}", root)
            elif schema.get("additionalProperties") is False:
                out.append(f"{path}: unexpected {name}")
            elif isinstance(schema.get("additionalProperties"), dict):
                out += errors(item, schema["additionalProperties"], f"{path}.{name}", root)
    if isinstance(value, list):
        if len(value) < schema.get("minItems", 0):
            out.append(f"{path}: fewer than minItems")
        if "maxItems" in schema and len(value) > schema["maxItems"]:
            out.append(f"{path}: more than maxItems")
        for i, item in enumerate(value):
            out += errors(item, schema.get("items"), f"{path}[{i}]", root)
    if isinstance(value, str):
        if len(value) < schema.get("minLength", 0):
            out.append(f"{path}: shorter than minLength")
        if "maxLength" in schema and len(value) > schema["maxLength"]:
            out.append(f"{path}: longer than maxLength")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        bounds = (("minimum", lambda b: value >= b), ("maximum", lambda b: value <= b),
                  ("exclusiveMinimum", lambda b: value > b),
                  ("exclusiveMaximum", lambda b: value < b))
        for key, holds in bounds:
            if key in schema and not holds(schema[key]):
                out.append(f"{path}: {value} breaks {key} {schema[key]}")
    return out
