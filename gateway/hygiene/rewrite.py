"""Opt-in rewrites of a request body that keep its prefix stable across requests:
tools sorted by function name (`sort_tools`), and JSON object keys inside each tool
sorted recursively (`sort_schema_keys`; lists keep their order, since `required` and
`enum` order can carry meaning). Messages are never touched: their content is the user's.
Each returns True when it changed the body (the caller then re-encodes it).
"""

from __future__ import annotations

from typing import Any

from gateway.hygiene.prompt import tool_name


def sort_tools(body: dict[str, Any]) -> bool:
    tools = body.get("tools")
    if not isinstance(tools, list) or len(tools) < 2:
        return False
    # stable sort; nameless tools keep their relative order after the named ones
    ordered = sorted(tools, key=lambda t: (tool_name(t) == "", tool_name(t)))
    if all(a is b for a, b in zip(ordered, tools, strict=True)):
        return False
    body["tools"] = ordered
    return True


def sort_schema_keys(body: dict[str, Any]) -> bool:
    tools = body.get("tools")
    if not isinstance(tools, list):
        return False
    changed = False
    for i, t in enumerate(tools):
        if isinstance(t, dict):
            canon, moved = _sorted(t)
            if moved:
                tools[i] = canon
                changed = True
    return changed


def _sorted(v: Any) -> tuple[Any, bool]:
    if isinstance(v, dict):
        keys = sorted(v)
        moved = keys != list(v)
        out: dict[str, Any] = {}
        for k in keys:
            out[k], m = _sorted(v[k])
            moved = moved or m
        return out, moved
    if isinstance(v, list):
        items: list[Any] = []
        moved = False
        for x in v:
            y, m = _sorted(x)
            items.append(y)
            moved = moved or m
        return items, moved
    return v, False
