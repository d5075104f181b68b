"""Labelled cases for the hygiene analyzer.

A `Case` is a short sequence of requests (one session, or sessionless requests of one
template) and the warning it should produce: `expect` (a finding kind, None for a negative
that must produce no warning at all) at `where` (message_index, role).

Families: timestamp, uuid, request_id, nonce, counter, tool_order, json_key_order,
history_rewrite, whitespace. Per family, `generate()` varies the value format, its label,
the surrounding format (prose, markdown, JSON, YAML, code), its place (system prompt, tool
description, an early user message the client regenerates, the completions prompt) and
the evidence that must find it (one request with a plainly per-request value: pattern;
a session where only the value changes: drift). Negatives: the same values held fixed
across the session, values only in the last user message or in replayed assistant output,
static or historical dates, and the hand-written `TRICKY` list (commit hashes in code,
version numbers, phone numbers, prices, base64 in examples, ...).
"""

from __future__ import annotations

import random

from tests.hygiene_corpus.common import FAMILIES, NOW, Case, Req
from tests.hygiene_corpus.structure import structural_cases
from tests.hygiene_corpus.tricky import tricky_cases
from tests.hygiene_corpus.values import value_cases

__all__ = ["FAMILIES", "NOW", "Case", "Req", "generate"]


def generate(per: int = 30, seed: int = 7) -> list[Case]:
    rng = random.Random(seed)
    return value_cases(rng, per) + structural_cases(rng, per) + tricky_cases()
