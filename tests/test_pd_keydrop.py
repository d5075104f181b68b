"""gateway.pd.keydrop: D's params removed from JSON that arrives in pieces, whatever the
pieces; null params and everything else left byte for byte."""

from __future__ import annotations

import itertools
from typing import Any

import orjson
import pytest

from gateway.pd.keydrop import KeyDropper

PARAMS = {"do_remote_decode": True, "remote_engine_id": "d1-engine",
          "remote_block_ids": [[7, 8]], "note": 'a } ] \\" , string'}

# (document, what the client gets): compact JSON as vLLM writes it
CASES: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
    ("last", {"id": 1, "kv_transfer_params": PARAMS}, {"id": 1}),
    ("first", {"kv_transfer_params": PARAMS, "id": 1}, {"id": 1}),
    ("alone", {"kv_transfer_params": PARAMS}, {}),
    ("nested", {"type": "response.completed",
                "response": {"output": ["x" * 300], "kv_transfer_params": PARAMS,
                             "usage": {"output_tokens": 3}}},
     {"type": "response.completed", "response": {"output": ["x" * 300],
                                                 "usage": {"output_tokens": 3}}}),
    ("scalar", {"a": 1, "kv_transfer_params": 12345, "b": 2}, {"a": 1, "b": 2}),
    ("string", {"a": 1, "kv_transfer_params": 'ab\\"}c', "b": 2}, {"a": 1, "b": 2}),
    # the key's text inside a string is no key
    ("in text", {"text": '"kv_transfer_params": {"x": 1}', "kv_transfer_params": None},
     {"text": '"kv_transfer_params": {"x": 1}', "kv_transfer_params": None}),
]


def _through(data: bytes, cuts: list[int]) -> bytes:
    dropper = KeyDropper()
    bounds = [0, *cuts, len(data)]
    out = b"".join(dropper.feed(data[a:b]) for a, b in itertools.pairwise(bounds))
    return out + dropper.finish()


@pytest.mark.parametrize(("case", "doc", "expected"), CASES, ids=[c[0] for c in CASES])
def test_every_split_gives_the_document_without_the_params(
        case: str, doc: dict[str, Any], expected: dict[str, Any]) -> None:
    data = orjson.dumps(doc)
    want = orjson.dumps(expected)
    for cut in range(len(data) + 1):
        assert _through(data, [cut]) == want, (case, cut)
    assert _through(data, list(range(1, len(data)))) == want  # a byte at a time


def test_null_params_and_spaced_json_keep_their_bytes() -> None:
    spaced = b'{"id": 1, "kv_transfer_params" : null, "b": [1, 2]}'
    assert _through(spaced, list(range(1, len(spaced)))) == spaced
    spaced_params = b'{"id": 1, "kv_transfer_params" :  {"remote_host": "10.0.0.6"}, "b": 2}'
    out = _through(spaced_params, [20, 40])
    assert b"10.0.0.6" not in out and orjson.loads(out) == {"id": 1, "b": 2}


def test_a_key_whose_value_never_came_is_not_passed_on() -> None:
    assert _through(b'{"id": 1,"kv_transfer_params":', []) == b'{"id": 1'
    assert _through(b'{"id": 1,"kv_transfer_params":{"remote_host": "10.0', []) == b'{"id": 1'


@pytest.mark.parametrize("data", [
    b'{"a": 1, "kv_transfer_params": {"h": 1}}',
    b'{"a":1,\n "kv_transfer_params": [1]}',
    b'{"a": 1 ,  "kv_transfer_params": {"h": 1}, "b": 2}',
], ids=["space", "newline", "spaces-around-comma"])
def test_the_comma_before_a_spaced_key_goes_with_it(data: bytes) -> None:
    """Found by review: a comma separated from the key by spaces stayed behind."""
    want = {k: v for k, v in orjson.loads(data).items() if k != "kv_transfer_params"}
    for cut in range(len(data) + 1):
        out = _through(data, [cut])
        assert orjson.loads(out) == want, (cut, out)


def test_an_escaped_quote_before_the_key_text_stays_escaped_across_pieces() -> None:
    """Found by review: a piece ending right after `\\"kv_transfer_params"` (a key whose
    text ends so) lost the backslash's context, and a member was dropped."""
    data = b'{"a\\"kv_transfer_params": {"keep": 1}, "b": 2}'
    for cut in range(len(data) + 1):
        assert _through(data, [cut]) == data, cut
