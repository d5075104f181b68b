"""Cheaper computations on the request path give exactly what the plain ones give: the
depth guard's C-speed proof (`inbound.shallow`) against the exact walk (`too_deep`)."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.proxy.errors import GatewayError
from gateway.proxy.inbound import MAX_DEPTH, parse_json, shallow, too_deep
from tests.props import json_value


def nest(depth: int, leaf: Any = "x", wide: int = 0) -> Any:
    """`depth` containers around `leaf`, alternating lists and objects, with `wide`
    shallow siblings at each level."""
    doc = leaf
    for i in range(depth):
        doc = [doc, *range(wide)] if i % 2 else {"k": doc, **{f"s{j}": j for j in range(wide)}}
    return doc


@given(depth=st.integers(0, 300), wide=st.integers(0, 3), leaf=json_value)
@settings(max_examples=300, deadline=None)
def test_shallow_proves_exactly_what_the_walk_finds(depth: int, wide: int, leaf: Any) -> None:
    doc = nest(depth, leaf, wide)
    try:
        orjson.dumps(leaf)
    except orjson.JSONEncodeError:
        return  # a value orjson cannot write proves nothing; the walk decides
    assert shallow(doc) is (not too_deep(doc, MAX_DEPTH))


@pytest.mark.parametrize(("depth", "pad", "ok"), [
    (MAX_DEPTH, 0, True),
    (MAX_DEPTH + 1, 0, False),
    (MAX_DEPTH, 64 * 1024, True),  # large bodies take the serializer's proof
    (MAX_DEPTH + 1, 64 * 1024, False),
    (3, 64 * 1024, True),
])
def test_parse_json_refuses_bodies_past_the_depth_limit(depth: int, pad: int, ok: bool) -> None:
    raw = orjson.dumps({"pad": "p" * pad, "doc": nest(depth - 1)})
    if ok:
        assert parse_json(raw)["pad"] == "p" * pad
    else:
        with pytest.raises(GatewayError) as err:
            parse_json(raw)
        assert err.value.status == 400
